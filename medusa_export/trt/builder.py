"""Building the engines with TensorRT's Python API (needs ``tensorrt`` and cuda-python).

    Builder -> strongly typed network (OnnxParser.parse_from_file of the artifact's graph, or of its typed graph)
        -> builder config (profiles, TF32 cleared for fp32, timing cache) -> build_serialized_network
        -> plan written atomically

Every network is strongly typed: TensorRT 10 is asked for it (``NetworkDefinitionCreationFlag.STRONGLY_TYPED``),
TensorRT 11 has nothing else (the flag is kept and ignored: NvInfer.h 11.x). The precision comes from the ONNX's
types (:data:`~.config.ENGINE_PRECISION_TABLE`: the artifact's own graphs, or a typed graph :mod:`.typed` wrote),
never from a builder precision flag, so the same calls build on both majors. Direct calls rather than Polygraphy's
loaders: the same few steps, and a surface small enough that CI runs it against the emulated TensorRT under
``tests/emulated`` (a test double, not TensorRT). The ONNX is parsed by path, so its external data resolves.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from medusa_runtime.engines.cuda import device_key, import_cudart
from medusa_runtime.engines.trt_plan import ENGINE_DIR, graph_profiles, plan_files, plan_graphs, plan_sources, profile_shapes
from medusa_runtime.errors import ArtifactError, BackendUnavailableError
from medusa_runtime.contract.manifest import Manifest, as_manifest

from .config import TIMING_CACHE, EngineConfig, engine_precision


class EngineBuildError(ArtifactError):
    """TensorRT refused to parse or build a graph, or this TensorRT cannot build the asked precision."""


def _cudart():
    """cuda-python's runtime module, or None when it is not installed."""
    try:
        return import_cudart("tensorrt")
    except BackendUnavailableError:
        return None


def tensorrt_version() -> str | None:
    """TensorRT's version, or None when it does not import."""
    try:
        import tensorrt as trt
    except Exception:  # noqa: BLE001 - ImportError, or a broken install's OSError
        return None
    return trt.__version__


def gpu_key(device: int = 0) -> dict:
    """Name and compute capability of CUDA device ``device`` (via cuda-python): the part of a plan's key that
    ties it to a GPU model (a plan runs only on the GPU model it was built for). "unknown" where none answers."""
    cudart = _cudart()
    if cudart is None:
        return {"gpu": "unknown", "compute_capability": "unknown"}
    return device_key(cudart, device)


def _add_profiles(trt, builder, config, manifest: Manifest, graph: str) -> list:
    """One optimization profile per :func:`~medusa_runtime.engines.trt_plan.graph_profiles` entry, in that order."""
    out = []
    for prof in graph_profiles(manifest, graph):
        p = builder.create_optimization_profile()
        for name, (lo, opt, hi) in profile_shapes(manifest.graphs[graph].inputs, prof).items():
            p.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(p)
        out.append(p)
    return out


def _write_atomically(path: Path, data) -> None:
    """Write ``data`` beside ``path`` and rename it into place: a failed write leaves no half plan."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_bytes(bytes(data))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def build_graph(folder: Path, manifest: Manifest | dict, graph: str, cfg: EngineConfig, onnx_rel: str) -> dict:
    """Build and save one graph's engine; return its part of the build record.

    Args:
        folder: the artifact.
        manifest: its manifest.
        graph: "model", "heads" or a level graph ``heads_level{j}``.
        cfg: precision, workspace, timing cache, device.
        onnx_rel: the artifact-relative ONNX the plan is built from (the graph's own, or its typed graph).

    Raises:
        EngineBuildError: the parser or the builder failed (TensorRT's errors in the message).
    """
    manifest = as_manifest(manifest)
    import tensorrt as trt

    onnx_path = folder / onnx_rel
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise EngineBuildError(f"TensorRT's ONNX parser refused {onnx_path}: {errors}")
    config = builder.create_builder_config()
    if engine_precision(cfg.precision).computes_in == "float32":
        # TF32 is on by default in both majors (NvInfer.h BuilderFlag::kTF32): fp32 plans compute in fp32, as validated.
        config.clear_flag(trt.BuilderFlag.TF32)
    if cfg.workspace_mib:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, cfg.workspace_mib << 20)
    config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
    _add_profiles(trt, builder, config, manifest, graph)
    timing_path = folder / TIMING_CACHE
    if cfg.timing_cache:
        data = timing_path.read_bytes() if timing_path.is_file() else b""
        config.set_timing_cache(config.create_timing_cache(data), False)
    plan_rel = plan_files(manifest, cfg.precision)[graph]
    (folder / ENGINE_DIR).mkdir(exist_ok=True)
    t0 = time.perf_counter()
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise EngineBuildError(f"TensorRT could not build {onnx_path} ({cfg.precision}); its log above says why")
    _write_atomically(folder / plan_rel, plan)
    if cfg.timing_cache and config.get_timing_cache() is not None:
        _write_atomically(timing_path, config.get_timing_cache().serialize())
    return {"plan": plan_rel, "onnx": onnx_rel, "build_seconds": round(time.perf_counter() - t0, 1),
            "strongly_typed": True, "tf32": bool(config.get_flag(trt.BuilderFlag.TF32)),
            "profiles": [p.name for p in graph_profiles(manifest, graph)]}


def build_engines(folder: Path, manifest: Manifest | dict, cfg: EngineConfig,
                  typed_graphs: dict[str, str] | None = None) -> tuple[dict, list[str]]:
    """Build every graph's plan (:func:`~medusa_runtime.engines.trt_plan.plan_graphs`: the model, then the heads
    graph or, for path-conditioned heads, one level graph per tree level); return (the manifest's engine
    record, files written). The record names each plan as ``{graph}_plan``.

    Args:
        folder, manifest: the artifact.
        cfg: precision, workspace, timing cache, device.
        typed_graphs: graph -> the typed graph to build it from (and ``weights``: their weights file), when the
            precision's row builds from a typed graph; None: the artifact's own graphs.

    Raises:
        EngineBuildError: cuda-python is missing, the device does not exist, or a graph does not build.
    """
    manifest = as_manifest(manifest)
    cudart = _cudart()
    if cudart is None:
        raise EngineBuildError("building TensorRT engines needs cuda-python (pip install cuda-python)")
    if int(cudart.cudaSetDevice(cfg.device_id)[0]) != 0:  # the builder works on this thread's current device
        raise EngineBuildError(f"CUDA device {cfg.device_id} is not available (cudaSetDevice failed); this machine "
                               f"has {cudart.cudaGetDeviceCount()[1]} device(s)")
    sources = {g: (typed_graphs or {}).get(g) or manifest.graphs[g].file for g in plan_graphs(manifest)}
    graphs = {g: build_graph(folder, manifest, g, cfg, sources[g]) for g in plan_graphs(manifest)}
    files = [g["plan"] for g in graphs.values()]
    if cfg.timing_cache and (folder / TIMING_CACHE).is_file():
        files.append(TIMING_CACHE)
    record = {
        "status": "built",
        "backend": "tensorrt",
        # The plan's key (checked when the runtime loads it: medusa_runtime.engines.trt_plan.plan_key_mismatches).
        "tensorrt": tensorrt_version(),
        **gpu_key(cfg.device_id),
        "precision": cfg.precision,
        "computes_in": engine_precision(cfg.precision).computes_in,
        "sources": plan_sources(manifest, cfg.precision),
        **{f"{g}_plan": built["plan"] for g, built in graphs.items()},
        "build_seconds": round(sum(g["build_seconds"] for g in graphs.values()), 1),
        "graphs": graphs,
        "timing_cache": TIMING_CACHE if TIMING_CACHE in files else None,
    }
    return record, files
