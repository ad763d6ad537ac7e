"""Options of ``medusa-export engine``; the CLI reads its defaults from here."""

from __future__ import annotations

from dataclasses import dataclass

from medusa_runtime.engines.trt_plan import ENGINE_PRECISIONS
from medusa_runtime.errors import EXIT_UNAVAILABLE, MedusaError

#: Exit code of ``medusa-export engine`` when TensorRT is not importable (the commands and
#: build script are written, no engine is built): the command lines' "not available here" code.
EXIT_NO_TENSORRT = EXIT_UNAVAILABLE
TIMING_CACHE = "engines/timing.cache"
CALIBRATION_CACHE = "engines/calibration.cache"
BUILD_SCRIPT = "engines/build_engine.sh"
#: ONNX op types whose layers are pinned to float32 when TensorRT may lower precision: RMSNorm
#: (Pow, ReduceMean, Sqrt, Reciprocal), attention softmax, and the output tail (LogSoftmax, Exp,
#: ReduceSum for the entropy, TopK over the log-probs). The Add and Mul nodes of each RMSNorm chain
#: are pinned by name (``trt.commands.fp32_node_names``).
FP32_OPS = ("Pow", "ReduceMean", "Sqrt", "Reciprocal", "Softmax", "LogSoftmax", "Exp", "ReduceSum", "TopK")


@dataclass(frozen=True)
class EngineConfig:
    """How to build the engines.

    Attributes:
        precision: "fp16" (norms and softmax kept fp32), "int8" (calibrated, fp16 elsewhere)
            or "fp32".
        calibration: JSONL prompts for int8 calibration (default: the project's prompts).
        calibration_batches: calibration windows fed to TensorRT (int8 only).
        workspace_mib: builder workspace limit in MiB (None: TensorRT's default, all free memory).
        timing_cache: load and update ``engines/timing.cache``.
        device_id: the CUDA device the engines are built on (and tuned for).
    """

    precision: str = "fp16"
    calibration: str | None = None
    calibration_batches: int = 16
    workspace_mib: int | None = None
    timing_cache: bool = True
    device_id: int = 0

    def __post_init__(self) -> None:
        if self.precision not in ENGINE_PRECISIONS:
            raise MedusaError(f"unknown engine precision {self.precision!r}; choose one of {', '.join(ENGINE_PRECISIONS)}")
        if self.workspace_mib is not None and self.workspace_mib <= 0:
            raise MedusaError(f"--workspace must be a positive number of MiB, got {self.workspace_mib}")
        if self.device_id < 0:
            raise MedusaError(f"--device-id must be >= 0, got {self.device_id}")
        if self.calibration_batches < 1:
            raise MedusaError(f"--calibration-batches must be >= 1, got {self.calibration_batches}")
