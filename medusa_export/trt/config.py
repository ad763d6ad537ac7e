"""Options of ``medusa-export engine`` and the engine-precision table; the CLI reads its defaults from here."""

from __future__ import annotations

from dataclasses import dataclass

from medusa_runtime.engines.trt_plan import ENGINE_PRECISIONS
from medusa_runtime.errors import EXIT_UNAVAILABLE, MedusaError

from ..export.precisions import Column

#: Artifact precisions whose portable graphs are already Q/DQ (int8, int4, fp8): their engines build from them.
QDQ_ARTIFACTS = Column("name", qdq=True)

#: Exit code of ``medusa-export engine`` when TensorRT is not importable (the commands and
#: build script are written, no engine is built): the command lines' "not available here" code.
EXIT_NO_TENSORRT = EXIT_UNAVAILABLE
TIMING_CACHE = "engines/timing.cache"
BUILD_SCRIPT = "engines/build_engine.sh"
#: ONNX op types that stay float32 in a typed graph (:mod:`.typed`): RMSNorm (Pow, ReduceMean, Sqrt,
#: Reciprocal), attention softmax, and the output tail (LogSoftmax, Exp, ReduceSum for the entropy, TopK over
#: the log-probs). The Add and Mul nodes of each RMSNorm chain stay float32 by name (``*/rmsnorm/*``).
FP32_OPS = ("Pow", "ReduceMean", "Sqrt", "Reciprocal", "Softmax", "LogSoftmax", "Exp", "ReduceSum", "TopK")
#: The trtexec options of every build, beside the shapes and file names. The same for TensorRT 10 and 11: both
#: majors' ``samples/common/sampleOptions.cpp`` (NVIDIA/TensorRT tags v10.16 and v11.1) parse ``--stronglyTyped``
#: (a no-op in 11, where every network is strongly typed) and ``--noTF32``; neither ``--fp16``, ``--bf16``,
#: ``--int8``, ``--calib``, ``--precisionConstraints`` nor ``--layerPrecisions`` is used (11 removed them).
TRTEXEC_COMMON = ("--stronglyTyped",)


@dataclass(frozen=True)
class EnginePrecision:
    """One row of :data:`ENGINE_PRECISION_TABLE`: what ``engine --precision NAME`` builds, from which graphs.

    Attributes:
        name: the ``--precision`` value (also the plans' ``engines/*.NAME.plan`` suffix).
        computes_in: the float type the engine's heavy layers compute in (recorded in the plan's key).
        sources: artifact K/V dtype -> which graphs the plans are built from: "artifact" (its own graphs, already
            typed) or "typed" (a typed graph written from them by :mod:`.typed`, beside the plans); a dtype not
            listed is refused, naming the artifact to build instead.
        trtexec: trtexec options of this precision beyond :data:`TRTEXEC_COMMON` (both majors).
        min_compute_capability: the oldest GPU architecture with the type's tensor cores (None: any).
        validated: how the graphs of this precision are checked here (docs/tensorrt.md's table reads it).
        unavailable: empty when buildable; else why not, and what to do instead.
    """

    name: str
    computes_in: str
    sources: dict
    trtexec: tuple[str, ...] = ()
    min_compute_capability: tuple[int, int] | None = None
    validated: str = ""
    unavailable: str = ""

    def source(self, kv_dtype: str, artifact_precision: str = "") -> str:
        """"artifact" or "typed" for an artifact of ``kv_dtype`` built with ``--precision artifact_precision``.

        An artifact whose graphs are already Q/DQ (``build --graph portable --precision int8|fp8|int4``) builds the
        engines of its own precision from its own graphs, and no other (its float weights are gone).

        Raises:
            MedusaError: this precision is not built (:attr:`unavailable`), or not from such an artifact (the message
                names the build command that makes one it is built from).
        """
        if self.unavailable:
            raise MedusaError(f"{self.name} engines: {self.unavailable}")
        if artifact_precision in QDQ_ARTIFACTS:
            if artifact_precision == self.name:
                return "artifact"
            raise MedusaError(f"{self.name} engines cannot be built from this artifact: its graphs are already "
                              f"{artifact_precision} Q/DQ (the float weights are not in it). Build one with "
                              f"`medusa-export build --graph portable --precision "
                              f"{self.name if self.name in QDQ_ARTIFACTS else 'fp16'}` (or fp32 for any precision), "
                              f"or choose --precision {artifact_precision}")
        if kv_dtype not in self.sources:
            kinds = " or ".join(k for k in self.sources)
            raise MedusaError(f"{self.name} engines are built from a {kinds} artifact, this one is {kv_dtype}: "
                              f"{'build --precision fp32' if 'float32' in self.sources else 'build --precision fp16'} "
                              f"first, or choose --precision {'fp16' if kv_dtype == 'float16' else 'fp32'}")
        return self.sources[kv_dtype]


#: The engine precisions, one row each: read by the Python builder, the trtexec writer, the engine step, doctor
#: and docs/tensorrt.md. TensorRT builds every one strongly typed: the types come from the ONNX (int8 / fp8 / int4:
#: explicit QuantizeLinear / DequantizeLinear), never from a builder precision flag or a calibrator (TensorRT 11
#: removed them; 10.12 deprecated weak typing and implicit quantization).
ENGINE_PRECISION_TABLE: dict[str, EnginePrecision] = {r.name: r for r in (
    EnginePrecision("fp16", "float16", {"float32": "typed", "float16": "artifact"},
                    min_compute_capability=(5, 3),
                    validated="typed graph on ONNX Runtime's CPU: Medusa == plain greedy of the same graph (near-ties "
                              "below a 0.1 log-prob margin reported), agreement with the fp32 graphs; an fp16 "
                              "artifact: its own build validation"),
    EnginePrecision("bf16", "bfloat16", {"float32": "typed"}, min_compute_capability=(8, 0),
                    validated="typed graph on ONNX Runtime's CPU with its bf16 rounding points computed in fp32 (no "
                              "bf16 MatMul there): Medusa == plain greedy (near-ties below 0.8 reported), agreement "
                              "with the fp32 graphs"),
    EnginePrecision("fp32", "float32", {"float32": "artifact"}, trtexec=("--noTF32",),
                    validated="the artifact's own build validation (ONNX Runtime against PyTorch); TF32 cleared so the "
                              "GPU computes what was validated"),
    EnginePrecision("int4", "float16 (int4 weights)", {"float32": "typed", "float16": "typed"},
                    validated="typed graph on ONNX Runtime's CPU (blocked DequantizeLinear, opset 21): Medusa == plain "
                              "greedy of the same graph (near-ties below 0.8 reported), agreement with the fp32 graphs"),
    EnginePrecision("int8", "int8 (W8A8)", {"float32": "typed", "float16": "typed"},
                    validated="typed graph on ONNX Runtime's CPU: Q/DQ pairs (int8, per-channel weights, per-tensor "
                              "activations calibrated on prompts) on every weight product; Medusa == plain greedy of "
                              "the same graph (near-ties below 0.8 reported), agreement with the fp32 graphs"),
    EnginePrecision("fp8", "fp8 E4M3 (W8A8)", {"float32": "typed", "float16": "typed"}, min_compute_capability=(8, 9),
                    validated="as int8, with float8 E4M3 Q/DQ (Ada and Hopper tensor cores: compute capability 8.9+)"),
)}
assert set(ENGINE_PRECISIONS) == {n for n, r in ENGINE_PRECISION_TABLE.items() if not r.unavailable}, \
    "the runtime's ENGINE_PRECISIONS must list the table's buildable precisions"


def buildable_precisions() -> list[str]:
    """The table's precisions ``medusa-export engine`` builds (from an artifact of a type the row takes)."""
    return [n for n, r in ENGINE_PRECISION_TABLE.items() if not r.unavailable]


def engine_precision(name: str) -> EnginePrecision:
    """The table's row of ``name``.

    Raises:
        MedusaError: an unknown name (the known ones listed).
    """
    if name not in ENGINE_PRECISION_TABLE:
        raise MedusaError(f"unknown engine precision {name!r}; choose one of {', '.join(ENGINE_PRECISION_TABLE)}")
    return ENGINE_PRECISION_TABLE[name]


@dataclass(frozen=True)
class EngineConfig:
    """How to build the engines.

    Attributes:
        precision: a row of :data:`ENGINE_PRECISION_TABLE` ("fp16", "bf16" or "fp32").
        prompts: JSONL prompts the typed graph is validated on (default: the project's prompts).
        workspace_mib: builder workspace limit in MiB (None: TensorRT's default, all free memory).
        timing_cache: load and update ``engines/timing.cache``.
        device_id: the CUDA device the engines are built on (and tuned for).
        validate: validate a typed graph on ONNX Runtime before building (``--no-validate`` skips it).
    """

    precision: str = "fp16"
    prompts: str | None = None
    workspace_mib: int | None = None
    timing_cache: bool = True
    device_id: int = 0
    validate: bool = True

    def __post_init__(self) -> None:
        engine_precision(self.precision)
        if self.workspace_mib is not None and self.workspace_mib <= 0:
            raise MedusaError(f"--workspace must be a positive number of MiB, got {self.workspace_mib}")
        if self.device_id < 0:
            raise MedusaError(f"--device-id must be >= 0, got {self.device_id}")
