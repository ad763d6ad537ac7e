"""``medusa-export engine --artifact DIR``: readiness check -> trtexec commands -> engines (where TensorRT is).

Exit codes (also :class:`EngineOutcome.code`): 0 engines built and recorded; 2 the ONNX
is not ready for TensorRT (the errors are printed); 3 (:data:`EXIT_NO_TENSORRT`) TensorRT
does not import here: the ``trtexec`` commands and ``engines/build_engine.sh`` were
written into the artifact for a GPU machine, and the manifest records the engine as
pending.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from medusa_runtime.contract.artifact import load_artifact
from medusa_runtime.engines.trt_plan import ENGINE_DIR, plan_files, profiles_json
from medusa_runtime.contract.manifest import Manifest

from ..validation.manifest_update import update_manifest
from .builder import build_engines, tensorrt_version
from .commands import write_commands
from .config import BUILD_SCRIPT, EXIT_NO_TENSORRT, EngineConfig
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


def run_engine_step(path: str | Path, cfg: EngineConfig = EngineConfig()) -> EngineOutcome:
    """Check, write the build commands, and build the engines if TensorRT imports.

    Raises:
        ArtifactError: ``path`` is not a valid artifact.
    """
    art = load_artifact(path)
    folder, manifest = art.path, art.manifest
    report = check_artifact(folder, manifest)
    files = write_commands(folder, manifest, cfg.precision, cfg.workspace_mib)
    record = _pending_record(manifest, cfg, files)
    patch = {"trt_readiness": report.to_json()}
    if not report.passed:
        record["status"] = "blocked: the TensorRT readiness check failed"
        update_manifest(folder, {**patch, "engines": {cfg.precision: record}}, files)
        errors = "\n  ".join(str(e) for e in report.errors)
        return EngineOutcome(2, f"the ONNX is not ready for TensorRT {report.tensorrt}:\n  {errors}", files)
    if tensorrt_version() is None:
        update_manifest(folder, {**patch, "engines": {cfg.precision: record}}, files)
        return EngineOutcome(EXIT_NO_TENSORRT, (
            "TensorRT is not available here (`import tensorrt` failed), so no engine was built.\n"
            f"Wrote {', '.join(files)} into {folder}.\n"
            f"On a machine with an NVIDIA GPU and TensorRT 10.x, run from the artifact: bash {BUILD_SCRIPT} {cfg.precision}\n"
            f"(or `medusa-export engine --artifact {folder} --precision {cfg.precision}` where TensorRT's Python package is installed)."),
            files)
    feeds = None
    if cfg.precision == "int8":
        from ..validation.validate import default_prompts, read_prompts
        from .calibration import calibration_feeds

        prompts = read_prompts(cfg.calibration) if cfg.calibration else default_prompts()
        feeds = calibration_feeds(folder, manifest, prompts, cfg.calibration_batches)
    built, built_files = build_engines(folder, manifest, cfg, feeds)
    record.update(built)
    rec_rel = f"{ENGINE_DIR}/build_record.{cfg.precision}.json"
    (folder / rec_rel).write_text(json.dumps(record, indent=2) + "\n")
    update_manifest(folder, {**patch, "engines": {cfg.precision: record}}, files + built_files + [rec_rel])
    built_plans = " and ".join(plan_files(manifest, cfg.precision).values())
    return EngineOutcome(0, (f"built {built_plans} with TensorRT {record['tensorrt']} "
                             f"on {record['gpu']} in {record['build_seconds']}s"), files + built_files + [rec_rel])
