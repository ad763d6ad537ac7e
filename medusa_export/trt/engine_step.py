"""``medusa-export engine --artifact DIR``: readiness check -> trtexec commands -> engines (where TensorRT is).

Exit codes (also :class:`EngineOutcome.code`): 0 engines built and recorded; 1 a typed graph failed its
validation on ONNX Runtime; 2 the ONNX is not ready for TensorRT (the errors are printed), a precision not built
from this artifact, or a GPU too old for it; 3 (:data:`EXIT_NO_TENSORRT`) TensorRT
does not import here: the ``trtexec`` commands and ``engines/build_engine.sh`` were
written into the artifact for a GPU machine, and the manifest records the engine as
pending.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from medusa_runtime.contract.artifact import load_artifact
from medusa_runtime.engines.trt_plan import ENGINE_DIR, plan_files, plan_graphs, profiles_json
from medusa_runtime.errors import EXIT_MISMATCH
from medusa_runtime.contract.manifest import Manifest

from ..validation.manifest_update import update_manifest
from .builder import EngineBuildError, build_engines, gpu_key, tensorrt_version
from .commands import write_commands
from .config import BUILD_SCRIPT, EXIT_NO_TENSORRT, EngineConfig, engine_precision
from .readiness import TARGET, check_artifact


@dataclass
class EngineOutcome:
    """What the engine step did: exit ``code``, a plain ``message``, the files it wrote."""

    code: int
    message: str
    files: list[str] = field(default_factory=list)


def _pending_record(manifest: Manifest, cfg: EngineConfig, files: list[str]) -> dict:
    plans = plan_files(manifest, cfg.precision)
    return {
        "status": "pending: TensorRT was not available where the artifact was built",
        "backend": "tensorrt",
        "target_tensorrt": TARGET,
        "precision": cfg.precision,
        **{f"{g}_plan": rel for g, rel in plans.items()},
        "profiles": profiles_json(manifest),
        "trtexec": files[0],
        "script": BUILD_SCRIPT,
        "build": f"bash {BUILD_SCRIPT} {cfg.precision}",
    }


def _check_gpu(cfg: EngineConfig) -> None:
    """Refuse a precision the visible GPU cannot compute in (its row's ``min_compute_capability``); nothing is
    checked where no GPU answers (the commands are written for another machine).

    Raises:
        EngineBuildError: the device's compute capability is below the row's, naming both and the fix.
    """
    row = engine_precision(cfg.precision)
    cc = str(gpu_key(cfg.device_id).get("compute_capability", "unknown"))  # "major.minor" (cudaGetDeviceProperties)
    if not row.min_compute_capability or cc == "unknown":
        return
    if tuple(int(x) for x in cc.split(".")) < row.min_compute_capability:
        need = ".".join(map(str, row.min_compute_capability))
        raise EngineBuildError(f"{cfg.precision} engines need a GPU of compute capability {need} or newer; device "
                               f"{cfg.device_id} has {cc}: build --precision fp16 (or fp32) engines there")


def _typed_graphs(folder: Path, manifest: Manifest, cfg: EngineConfig) -> tuple[dict, dict]:
    """Write (and validate on ONNX Runtime) the typed graphs of ``cfg.precision``; return (their files by graph and
    ``weights``, the record of what was written and how it validated)."""
    from ..validation.validate import read_prompts
    from .typed import typed_paths, write_typed_graphs
    from .typed_check import validate_typed

    from .typed import DEFAULT_INT4_SCALES, OUTLIER_RATIO, SMOOTH_ALPHA, W8A8

    graphs = plan_graphs(manifest)
    files = {g: manifest.graphs[g].file for g in graphs}
    prompts = read_prompts(cfg.prompts) if cfg.prompts else None
    calibration = None
    scales = {"int4_scales": DEFAULT_INT4_SCALES if cfg.precision == "int4" else "rtn",
              "smooth_alpha": SMOOTH_ALPHA.get(cfg.precision), "outlier_ratio": OUTLIER_RATIO.get(cfg.precision)}
    if cfg.precision in W8A8 or scales["int4_scales"] != "rtn":
        from .ranges import calibrate, default_calibration_prompts

        print(f"calibrating {cfg.precision} (layer by layer from the artifact's weights) ...", file=sys.stderr,
              flush=True)
        calibration = calibrate(folder, files, prompts or default_calibration_prompts())
    print(f"writing the {cfg.precision} typed graphs (float32 islands: norms, softmax, the output tail) ...",
          file=sys.stderr, flush=True)
    report = write_typed_graphs(folder, files, cfg.precision, calibration=calibration, **scales)
    record = report.to_json()
    if calibration is not None:
        record["calibration"] = {**calibration.record, **({"int4_scales": scales["int4_scales"]} if cfg.precision ==
                                                           "int4" else {"smoothquant_alpha": scales["smooth_alpha"],
                                                                  "outlier_ratio": scales["outlier_ratio"]})}
    if cfg.validate:
        print("validating them on ONNX Runtime ...", file=sys.stderr, flush=True)
        record["validation"] = validate_typed(folder, report, prompts=prompts)
    return typed_paths(cfg.precision, graphs), record


def run_engine_step(path: str | Path, cfg: EngineConfig = EngineConfig()) -> EngineOutcome:
    """Check, write the typed graph where the precision needs one, write the build commands, and build the engines
    if TensorRT imports.

    Raises:
        ArtifactError: ``path`` is not a valid artifact.
        MedusaError: the precision is not built (int8), or not from this artifact's type (the row says which).
        EngineBuildError: the visible GPU is too old for the precision.
    """
    art = load_artifact(path)
    folder, manifest = art.path, art.manifest
    row = engine_precision(cfg.precision)
    source = row.source(manifest.precision.kv_dtype)
    _check_gpu(cfg)
    report = check_artifact(folder, manifest)
    patch = {"trt_readiness": report.to_json()}
    if not report.passed:
        files = write_commands(folder, manifest, cfg.precision, cfg.workspace_mib)
        record = {**_pending_record(manifest, cfg, files), "status": "blocked: the TensorRT readiness check failed"}
        update_manifest(folder, {**patch, "engines": {cfg.precision: record}}, files)
        errors = "\n  ".join(str(e) for e in report.errors)
        return EngineOutcome(2, f"the ONNX is not ready for TensorRT {report.tensorrt}:\n  {errors}", files)
    if source == "artifact" and row.computes_in != "float32":  # an fp16 artifact's own graphs: typed as exported
        from .typed import check_strong_typing

        for g in plan_graphs(manifest):
            check_strong_typing(onnx.load(str(folder / manifest.graphs[g].file), load_external_data=False),
                                where=manifest.graphs[g].file)
    typed_files, typed_record = (_typed_graphs(folder, manifest, cfg) if source == "typed" else (None, None))
    files = write_commands(folder, manifest, cfg.precision, cfg.workspace_mib)
    record = _pending_record(manifest, cfg, files)
    record["computes_in"] = row.computes_in
    if typed_files:
        record.update(typed_graphs=typed_files, typed_graph=typed_record)
        files = [*typed_files.values(), *files]
    if typed_record and not typed_record.get("validation", {"passed": True})["passed"]:
        record["status"] = "blocked: the typed graph failed its validation on ONNX Runtime"
        update_manifest(folder, {**patch, "engines": {cfg.precision: record}}, files)
        bad = [p for p in typed_record["validation"]["prompts"] if not p["passed"]]
        return EngineOutcome(EXIT_MISMATCH, (
            f"the {cfg.precision} typed graph leaves plain greedy decoding of itself on {len(bad)} prompt(s) beyond a "
            f"near-tie (first: {bad[0]['prompt']!r} at token {bad[0]['medusa_divergence']}, margin "
            f"{bad[0]['medusa_margin']}); no engine was built"), files)
    manifest = update_manifest(folder, {**patch, "engines": {cfg.precision: record}}, files)
    if tensorrt_version() is None:
        return EngineOutcome(EXIT_NO_TENSORRT, (
            "TensorRT is not available here (`import tensorrt` failed), so no engine was built.\n"
            f"Wrote {', '.join(files)} into {folder}.\n"
            f"On a machine with an NVIDIA GPU and TensorRT 10.x or 11.x, run from the artifact: bash {BUILD_SCRIPT} "
            f"{cfg.precision}\n(or `medusa-export engine --artifact {folder} --precision {cfg.precision}` where "
            f"TensorRT's Python package is installed)."), files)
    built, built_files = build_engines(folder, manifest, cfg, typed_files)
    record.update(built)
    rec_rel = f"{ENGINE_DIR}/build_record.{cfg.precision}.json"
    (folder / rec_rel).write_text(json.dumps(record, indent=2) + "\n")
    update_manifest(folder, {**patch, "engines": {cfg.precision: record}}, files + built_files + [rec_rel])
    built_plans = " and ".join(plan_files(manifest, cfg.precision).values())
    return EngineOutcome(0, (f"built {built_plans} with TensorRT {record['tensorrt']} on {record['gpu']} in "
                             f"{record['build_seconds']}s (strongly typed, computing in {row.computes_in})"),
                         files + built_files + [rec_rel])
