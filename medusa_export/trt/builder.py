"""Building the engines with TensorRT's Python API (needs ``tensorrt`` and cuda-python).

    Builder -> network (OnnxParser.parse_from_file) -> [pin norms/softmax to fp32]
        -> builder config (profiles, precision flags, calibrator, timing cache)
        -> build_serialized_network -> plan written atomically

Direct calls rather than Polygraphy's loaders: the same few steps, and a surface small enough
that CI runs it against the emulated TensorRT under ``tests/emulated`` (a test double, not
TensorRT). Written against TensorRT 10's Python API; under TensorRT 11, which builds strongly
typed networks only (no FP16 / INT8 builder flags, no calibrators: the 11.x ``NvInfer.h``), an
fp16 or int8 engine of an fp32 artifact is a typed error naming the fix. The ONNX is parsed by
path, so its external data (``weights.bin``) resolves.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from medusa_runtime.engines.cuda import device_key, import_cudart
from medusa_runtime.engines.trt_plan import ENGINE_DIR, graph_profiles, plan_files, plan_graphs, plan_sources, profile_shapes
from medusa_runtime.errors import ArtifactError, BackendUnavailableError
from medusa_runtime.contract.manifest import Manifest, as_manifest

from .commands import fp32_node_names, strongly_typed
from .config import CALIBRATION_CACHE, TIMING_CACHE, EngineConfig

#: The first TensorRT major version without weak typing (BuilderFlag FP16 / INT8, per-layer precisions,
#: calibrators): TensorRT 11's NvInfer.h, where every network is strongly typed.
STRONGLY_TYPED_ONLY_FROM = 11


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


def _pin_fp32(network, names: set[str]) -> None:
    """Per-layer constraints: layers named after the float32 nodes (or, if the parser named
    none of them, layers of the matching types) compute and output float32."""
    import tensorrt as trt

    float_types = (trt.float32, trt.float16)
    layers = [network.get_layer(i) for i in range(network.num_layers)]
    chosen = [ly for ly in layers if ly.name in names]
    if not chosen:
        kinds = {trt.LayerType.SOFTMAX, trt.LayerType.REDUCE, trt.LayerType.TOPK}
        unary = {trt.UnaryOperation.SQRT, trt.UnaryOperation.RECIP, trt.UnaryOperation.EXP, trt.UnaryOperation.LOG}
        for ly in layers:
            if ly.type in kinds:
                chosen.append(ly)
            elif ly.type == trt.LayerType.UNARY:
                ly.__class__ = trt.IUnaryLayer
                if ly.op in unary:
                    chosen.append(ly)
            elif ly.type == trt.LayerType.ELEMENTWISE:
                ly.__class__ = trt.IElementWiseLayer
                if ly.op == trt.ElementWiseOperation.POW:
                    chosen.append(ly)
    for ly in chosen:
        if ly.num_outputs and ly.get_output(0).dtype in float_types:
            ly.precision = trt.float32
            for i in range(ly.num_outputs):
                if ly.get_output(i).dtype in float_types:
                    ly.set_output_type(i, trt.float32)


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


def _calibrator(trt, cudart, feeds: list[dict[str, np.ndarray]], cache: Path):
    """An entropy calibrator (TensorRT 10 only) that copies each feed to device buffers it owns; ``free()``
    releases them after the build."""

    def check(result, what):
        err, *rest = result
        if int(err) != 0:
            raise EngineBuildError(f"{what} failed during int8 calibration: CUDA error {int(err)}")
        return rest[0] if rest else None

    class Calibrator(trt.IInt8EntropyCalibrator2):
        def __init__(self):
            trt.IInt8EntropyCalibrator2.__init__(self)
            self.feeds, self.ptrs = list(feeds), {}

        def get_batch_size(self) -> int:
            return 1

        def get_batch(self, names):
            if not self.feeds:
                return None
            feed = self.feeds.pop(0)
            out = []
            for n in names:
                arr = np.ascontiguousarray(feed[n])
                if n not in self.ptrs:  # feeds share the prefill opt shape: one buffer per input
                    self.ptrs[n] = check(cudart.cudaMalloc(max(arr.nbytes, 1)), "cudaMalloc")
                check(cudart.cudaMemcpy(self.ptrs[n], arr.ctypes.data, arr.nbytes,
                                        cudart.cudaMemcpyKind.cudaMemcpyHostToDevice), "cudaMemcpy")
                out.append(int(self.ptrs[n]))
            return out

        def read_calibration_cache(self):
            return cache.read_bytes() if cache.is_file() else None

        def write_calibration_cache(self, data) -> None:
            cache.write_bytes(bytes(data))

        def free(self) -> None:
            for p in self.ptrs.values():
                cudart.cudaFree(p)
            self.ptrs.clear()

    return Calibrator()


def _check_precision(trt, manifest: Manifest, precision: str, typed: bool) -> None:
    """TensorRT >= :data:`STRONGLY_TYPED_ONLY_FROM` builds what the ONNX's types say: no fp16 / int8 of fp32 graphs."""
    major = int(trt.__version__.split(".")[0])
    if major >= STRONGLY_TYPED_ONLY_FROM and not typed and precision != "fp32":
        raise EngineBuildError(
            f"TensorRT {trt.__version__} builds strongly typed networks only (no FP16/INT8 builder flags or "
            f"calibrators since TensorRT 11), and this artifact's graphs are {manifest.precision.kv_dtype}: build "
            f"--precision fp32 engines, or export an fp16 artifact (medusa-export build --precision fp16) for fp16 "
            f"engines")


def _write_atomically(path: Path, data) -> None:
    """Write ``data`` beside ``path`` and rename it into place: a failed write leaves no half plan."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_bytes(bytes(data))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def build_graph(folder: Path, manifest: Manifest | dict, graph: str, cfg: EngineConfig, calibration_feeds=None) -> dict:
    """Build and save one graph's engine; return its part of the build record.

    Args:
        folder: the artifact.
        manifest: its manifest.
        graph: "model", "heads" or a level graph ``heads_level{j}``.
        cfg: precision, workspace, timing cache, device.
        calibration_feeds: int8 only (model graph): a list of input dicts at the prefill
            profile's opt shapes (see ``calibration.calibration_feeds``).

    Raises:
        EngineBuildError: the parser or the builder failed (TensorRT's errors in the message), or this
            TensorRT cannot build ``cfg.precision`` from this artifact.
    """
    manifest = as_manifest(manifest)
    import tensorrt as trt

    onnx_path = folder / manifest.graphs[graph].file
    typed = strongly_typed(manifest, cfg.precision)
    _check_precision(trt, manifest, cfg.precision, typed)
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED) if typed else 0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise EngineBuildError(f"TensorRT's ONNX parser refused {onnx_path}: {errors}")
    pinned: list[str] = []
    if cfg.precision in ("fp16", "int8") and not typed:
        import onnx

        pinned = fp32_node_names(onnx.load(str(onnx_path), load_external_data=False))
        _pin_fp32(network, set(pinned))
    config = builder.create_builder_config()
    if cfg.precision in ("fp16", "int8") and not typed:
        config.set_flag(trt.BuilderFlag.FP16)
    if pinned:
        config.set_flag(trt.BuilderFlag.OBEY_PRECISION_CONSTRAINTS)
    if cfg.workspace_mib:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, cfg.workspace_mib << 20)
    config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
    profiles = _add_profiles(trt, builder, config, manifest, graph)
    timing_path = folder / TIMING_CACHE
    if cfg.timing_cache:
        data = timing_path.read_bytes() if timing_path.is_file() else b""
        config.set_timing_cache(config.create_timing_cache(data), False)
    calibrator = None
    if cfg.precision == "int8" and graph == "model":
        config.set_flag(trt.BuilderFlag.INT8)
        calibrator = _calibrator(trt, _cudart(), calibration_feeds or [], folder / CALIBRATION_CACHE)
        config.int8_calibrator = calibrator
        config.set_calibration_profile(profiles[0])  # the prefill profile (its opt shape is the feeds')
    plan_rel = plan_files(manifest, cfg.precision)[graph]
    (folder / ENGINE_DIR).mkdir(exist_ok=True)
    t0 = time.perf_counter()
    try:
        plan = builder.build_serialized_network(network, config)
    finally:
        if calibrator is not None:
            calibrator.free()
    if plan is None:
        raise EngineBuildError(f"TensorRT could not build {onnx_path} ({cfg.precision}); its log above says why")
    _write_atomically(folder / plan_rel, plan)
    if cfg.timing_cache and config.get_timing_cache() is not None:
        _write_atomically(timing_path, config.get_timing_cache().serialize())
    return {"plan": plan_rel, "build_seconds": round(time.perf_counter() - t0, 1), "strongly_typed": typed,
            "fp32_layers": len(pinned), "profiles": [p.name for p in graph_profiles(manifest, graph)]}


def build_engines(folder: Path, manifest: Manifest | dict, cfg: EngineConfig, calibration_feeds=None) -> tuple[dict, list[str]]:
    """Build every graph's plan (:func:`~medusa_runtime.engines.trt_plan.plan_graphs`: the model, then the heads
    graph or, for path-conditioned heads, one level graph per tree level); return (the manifest's engine
    record, files written). The record names each plan as ``{graph}_plan``.

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
    graphs = {g: build_graph(folder, manifest, g, cfg, calibration_feeds if g == "model" else None)
              for g in plan_graphs(manifest)}
    files = [g["plan"] for g in graphs.values()]
    if cfg.timing_cache and (folder / TIMING_CACHE).is_file():
        files.append(TIMING_CACHE)
    if cfg.precision == "int8" and (folder / CALIBRATION_CACHE).is_file():
        files.append(CALIBRATION_CACHE)
    record = {
        "status": "built",
        "backend": "tensorrt",
        # The plan's key (checked when the runtime loads it: medusa_runtime.engines.trt_plan.plan_key_mismatches).
        "tensorrt": tensorrt_version(),
        **gpu_key(cfg.device_id),
        "precision": cfg.precision,
        "sources": plan_sources(manifest),
        **{f"{g}_plan": built["plan"] for g, built in graphs.items()},
        "build_seconds": round(sum(g["build_seconds"] for g in graphs.values()), 1),
        "graphs": graphs,
        "timing_cache": TIMING_CACHE if TIMING_CACHE in files else None,
        "calibration_cache": CALIBRATION_CACHE if CALIBRATION_CACHE in files else None,
    }
    return record, files
