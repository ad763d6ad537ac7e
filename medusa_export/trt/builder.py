"""Building the engines with TensorRT, through Polygraphy's loaders (needs ``tensorrt``).

    NetworkFromOnnxPath -> [PostprocessNetwork: pin norms/softmax to fp32]
        -> CreateConfig(profiles, fp16/int8, calibrator, timing cache) -> EngineFromNetwork -> SaveEngine

Not executed in this project's CI (TensorRT cannot be installed there); written against
TensorRT 10's Python API and Polygraphy 0.49+, and kept to the loaders' documented
arguments. The ONNX is parsed by path, so its external data (``weights.bin``) resolves.
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path

from medusa_runtime.manifest import Manifest, as_manifest
from medusa_runtime.trt_plan import ENGINE_DIR, graph_profiles, plan_files, profile_shapes

from .commands import fp32_node_names, strongly_typed
from .config import CALIBRATION_CACHE, TIMING_CACHE, EngineConfig


def tensorrt_version() -> str | None:
    """TensorRT's version, or None when it does not import."""
    try:
        import tensorrt as trt
    except Exception:  # noqa: BLE001 - ImportError, or a broken install's OSError
        return None
    return trt.__version__


def gpu_name() -> str:
    """Name of CUDA device 0 (via cuda-python), or "unknown"."""
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        try:
            from cuda import cudart
        except ImportError:
            return "unknown"
    err, props = cudart.cudaGetDeviceProperties(0)
    if int(err) != 0:
        return "unknown"
    name = props.name
    return (name.decode(errors="replace") if isinstance(name, bytes) else str(name)).rstrip("\x00")


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


def _polygraphy_profiles(manifest: Manifest | dict, graph: str):
    from polygraphy.backend.trt import Profile

    out = []
    for prof in graph_profiles(manifest, graph):
        p = Profile()
        for name, (lo, opt, hi) in profile_shapes(manifest.graphs[graph].inputs, prof).items():
            p.add(name, min=lo, opt=opt, max=hi)
        out.append(p)
    return out


def build_graph(folder: Path, manifest: Manifest | dict, graph: str, cfg: EngineConfig, calibration_feeds=None) -> dict:
    """Build and save one graph's engine; return its part of the build record.

    Args:
        folder: the artifact.
        manifest: its manifest.
        graph: "model" or "heads".
        cfg: precision, workspace, timing cache.
        calibration_feeds: int8 only (model graph): a list of input dicts at the prefill
            profile's opt shapes (see ``calibration.calibration_feeds``).
    """
    manifest = as_manifest(manifest)
    import tensorrt as trt
    from polygraphy.backend.trt import (Calibrator, CreateConfig, EngineFromNetwork, NetworkFromOnnxPath,
                                        PostprocessConfig, PostprocessNetwork, SaveEngine)

    onnx_path = folder / manifest.graphs[graph].file
    typed = strongly_typed(manifest, cfg.precision)
    network = NetworkFromOnnxPath(str(onnx_path), strongly_typed=typed)
    pinned: list[str] = []
    if cfg.precision in ("fp16", "int8") and not typed:
        import onnx

        pinned = fp32_node_names(onnx.load(str(onnx_path), load_external_data=False))
        network = PostprocessNetwork(network, func=partial(_pin_fp32, names=set(pinned)), name="pin norms/softmax to fp32")
    profiles = _polygraphy_profiles(manifest, graph)
    int8 = cfg.precision == "int8" and graph == "model"
    calibrator = None
    if int8:
        calibrator = Calibrator(data_loader=calibration_feeds, cache=str(folder / CALIBRATION_CACHE))
    timing = str(folder / TIMING_CACHE) if cfg.timing_cache else None
    config = CreateConfig(
        fp16=cfg.precision in ("fp16", "int8") and not typed,
        int8=int8,
        profiles=profiles,
        calibrator=calibrator,
        precision_constraints="obey" if pinned else None,
        load_timing_cache=timing,
        memory_pool_limits={trt.MemoryPoolType.WORKSPACE: cfg.workspace_mib << 20} if cfg.workspace_mib else None,
        profiling_verbosity=trt.ProfilingVerbosity.DETAILED,
    )
    if int8:  # calibrate on the prefill profile (Polygraphy would take the last one, decode)
        def _calib_profile(builder, network, config, prof=profiles[0]):
            config.set_calibration_profile(prof.fill_defaults(network).to_trt(builder, network))

        config = PostprocessConfig(config, func=_calib_profile)
    plan = plan_files(manifest, cfg.precision)[graph]
    (folder / ENGINE_DIR).mkdir(exist_ok=True)
    t0 = time.perf_counter()
    SaveEngine(EngineFromNetwork(network, config=config, save_timing_cache=timing), path=str(folder / plan))()
    return {"plan": plan, "build_seconds": round(time.perf_counter() - t0, 1), "strongly_typed": typed,
            "fp32_layers": len(pinned), "profiles": [p.name for p in graph_profiles(manifest, graph)]}


def build_engines(folder: Path, manifest: Manifest | dict, cfg: EngineConfig, calibration_feeds=None) -> tuple[dict, list[str]]:
    """Build both graphs; return (the manifest's engine record, files written).

    Raises:
        UnsupportedModelError: path-conditioned (hydra) heads, whose level graphs TensorRT plans do not cover yet.
    """
    manifest = as_manifest(manifest)
    if manifest.head_type != "medusa":
        from ..errors import UnsupportedModelError

        raise UnsupportedModelError(f"TensorRT engines run Medusa heads (heads.onnx) only; this artifact's heads are "
                                    f"{manifest.head_type!r} (heads_level{{j}}.onnx): run it with ONNX Runtime")
    graphs = {g: build_graph(folder, manifest, g, cfg, calibration_feeds if g == "model" else None)
              for g in ("model", "heads")}
    files = [graphs["model"]["plan"], graphs["heads"]["plan"]]
    if cfg.timing_cache and (folder / TIMING_CACHE).is_file():
        files.append(TIMING_CACHE)
    if cfg.precision == "int8" and (folder / CALIBRATION_CACHE).is_file():
        files.append(CALIBRATION_CACHE)
    record = {
        "status": "built",
        "backend": "tensorrt",
        "tensorrt": tensorrt_version(),
        "gpu": gpu_name(),
        "precision": cfg.precision,
        "model_plan": graphs["model"]["plan"],
        "heads_plan": graphs["heads"]["plan"],
        "build_seconds": round(sum(g["build_seconds"] for g in graphs.values()), 1),
        "graphs": graphs,
        "timing_cache": TIMING_CACHE if TIMING_CACHE in files else None,
        "calibration_cache": CALIBRATION_CACHE if CALIBRATION_CACHE in files else None,
    }
    return record, files
