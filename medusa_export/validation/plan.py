"""Pre-flight: each stage's peak memory estimated from the headers, and the validation checks that fit.

Before anything is loaded, ``build`` and ``verify`` estimate what each stage needs (resident bytes) from
the checkpoint's headers and the weights plan, compare it with the memory available now
(``psutil.virtual_memory().available``) and choose the checks that fit:

=========  ================================================================================================
check      what it does
=========  ================================================================================================
full       the whole artifact through ONNX Runtime against the whole fp32 PyTorch reference: step outputs
           within the precision's tolerance, Medusa's and plain greedy tokens identical to the independent
           reference (:mod:`.independent`; it includes ``self``)
truncated  (a) the same exporter on the first N layers (+ final norm, lm_head and the real heads) in fp32,
           against the PyTorch reference of the same truncation: Medusa's and plain greedy tokens identical
           to the independent reference of that truncation
checksums  (b) every tensor of ``weights.bin`` re-read, and re-made from the checkpoint, against its SHA-256
self       (c) the whole artifact through ONNX Runtime: Medusa equals plain greedy decoding of that graph
gpu        (d) where torch sees a GPU: the whole reference there against ONNX Runtime
=========  ================================================================================================

``auto`` runs ``full`` + ``checksums`` when the full check fits, otherwise ``truncated`` + ``checksums`` +
whichever of ``self`` / ``gpu`` fit. A check asked for by name that does not fit is refused with both
numbers and the options (:class:`~medusa_export.errors.InsufficientMemoryError`), as is an export that
does not fit at all.

The estimates are deliberately simple sums (sizes read from the headers times factors measured here:
see :data:`ORT_FACTORS`), printed with the plan so a user can see what was assumed. A check that runs the
PyTorch reference and then ONNX Runtime may need both at once: the reference is freed before ONNX Runtime
opens, but glibc serves allocations below its mmap threshold (128 KiB, raised up to 32 MiB as large blocks are
freed) from its heap, whose freed pages stay resident: a reference of matrices of a few MB, with its phase's KV
caches and logits, is still resident when ONNX Runtime's memory comes on top (larger tensors are mapped on their
own and given back). The ``full``
check's estimate is therefore their sum: a model of small matrices (the embedded SmolLM2-135M) peaks at it,
one of large matrices stays below it (tests/test_streamed_export.py measures both). The ``truncated`` check
keeps the larger of the two: its reference is mostly large tensors (embeddings, lm_head, the heads'
projections; measured 6.6 GB at 7B against 8.7 GB estimated, docs/export-memory.md).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..errors import InsufficientMemoryError, MedusaError
from ..export.precisions import Column
from ..loading.checkpoint import backbone_shapes
from ..loading.sources import ModelSources

CHECKS = ("full", "truncated", "checksums", "self", "gpu")
CHECK_TEXT = {
    "full": "the whole artifact on ONNX Runtime against the whole fp32 PyTorch reference (step outputs; Medusa's and "
            "plain greedy tokens == the independent reference's, transformers generate or a full-recompute loop)",
    "truncated": "the same exporter on the first {layers} layer(s) (+ final norm, lm_head, real heads) in fp32 against "
                 "the PyTorch reference of that truncation: Medusa's and plain greedy tokens == the independent "
                 "reference's",
    "checksums": "every tensor of weights.bin re-read and re-made from the checkpoint against its SHA-256",
    "self": "the whole artifact on ONNX Runtime: Medusa == plain greedy decoding of the same graph",
    "gpu": "the whole model: the PyTorch reference on the GPU against ONNX Runtime",
}
#: Resident bytes of the process before any model work (Python, torch, transformers, onnx, ONNX Runtime
#: imported, a tokenizer loaded): 0.6 GB measured here; rounded up.
BASE_BYTES = 800_000_000
#: Conversion buffers of the export besides the largest matrix (blocks of rows, quantization scratch, the
#: graph protos).
EXPORT_WORKING_BYTES = 256 << 20
#: ONNX Runtime CPU session resident bytes per byte of ``weights.bin``, by precision, as validation opens them
#: (``checks.FP32_SESSION_CONFIG``: no pre-packing for float32 graphs); :attr:`PrecisionSpec.ort_factor
#: <medusa_export.export.precisions.PrecisionSpec>`. Measured on the embedded model (onnxruntime 1.32, session +
#: three 100-token prefill steps, resident growth / weights): fp32 1.26 (the mapped weights file's pages, 1.68
#: with pre-packing), fp16 3.1 (ONNX Runtime's CPU casts keep float32 copies of the fp16 weights), int8 1.45,
#: int4 1.23; rounded up.
ORT_FACTORS = Column("ort_factor")
#: The share of available memory a plan may use (the rest is headroom for the OS and other processes).
HEADROOM = 0.9
#: Above this many bytes of weights, the ``self`` check decodes :data:`SELF_CHECK_TOKENS` tokens of the
#: first prompt only (a CPU step of a 7B model takes seconds; of a 64-node tree step, tens of seconds).
SELF_CHECK_LIMIT = 2_000_000_000
SELF_CHECK_TOKENS = 16


@dataclass
class ValidationPlan:
    """What will run, and why.

    Attributes:
        checks: the checks to run, in order.
        layers: N of the truncated check.
        skipped: check -> reason it does not run.
        estimates: stage -> estimated peak resident bytes.
        available: memory available when planned (bytes).
        requested: what was asked ("auto", or the comma-separated list).
    """

    checks: list[str]
    layers: int
    skipped: dict[str, str] = field(default_factory=dict)
    estimates: dict[str, int] = field(default_factory=dict)
    available: int = 0
    requested: str = "auto"

    def describe(self) -> list[str]:
        """One line per check that runs, then one per check skipped (for the build log)."""
        lines = [f"{c}: {CHECK_TEXT[c].format(layers=self.layers)}" for c in self.checks]
        return lines + [f"not run: {c} ({why})" for c, why in self.skipped.items()]

    def to_json(self) -> dict:
        return asdict(self)


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def estimate_memory(src: ModelSources, precision: str, weights_bytes: int, largest_fp32: int, layers: int,
                    graph: str = "portable") -> dict[str, int]:
    """Estimated peak resident bytes of each stage (see the module docstring for the factors).

    Args:
        src: the model's sources (sizes from headers).
        precision: the artifact's precision.
        weights_bytes: planned size of ``weights.bin``.
        largest_fp32: float32 bytes of the largest matrix the export transposes whole.
        layers: N of the truncated check.
        graph: the ``--graph`` (its :class:`~medusa_export.export.precisions.GraphForm` holds the factor).
    """
    from ..export.precisions import PRECISION_TABLE

    forms = PRECISION_TABLE[precision].graphs if precision in PRECISION_TABLE else {}
    factor = forms[graph].ort_factor if graph in forms else ORT_FACTORS[precision]
    full_ref = src.fp32_bytes()
    trunc_ref = src.fp32_bytes(min(layers, src.config.num_hidden_layers))
    ort = factor * weights_bytes
    trunc_ort = ORT_FACTORS["fp32"] * trunc_ref
    export = BASE_BYTES + 3 * largest_fp32 + EXPORT_WORKING_BYTES
    # The reference, then ONNX Runtime: their sum, not the larger (module docstring). The main job (smollm2-135m,
    # --tree 64, fp32) held 1.49 GB after the reference phase and peaked at 2.06 GB once ONNX Runtime ran, where
    # base + the larger said 1.56 GB; base + both says 2.11 GB.
    return {
        "export": int(export),
        "full": int(BASE_BYTES + full_ref + ort),
        "truncated": int(BASE_BYTES + max(trunc_ref, trunc_ort)),
        "checksums": int(export),
        "self": int(BASE_BYTES + ort),
        "gpu_host": int(BASE_BYTES + max(ort, 3 * largest_fp32)),
        "gpu_device": int(full_ref * 1.2),
    }


def largest_transposed_fp32(src: ModelSources, graph: str = "portable") -> int:
    """float32 bytes of the largest weight the export writes transposed in one piece (a linear layer, or the
    fused graph's concatenated QKV / gate-up); embeddings and lm_heads are written in blocks of rows."""
    c = src.config
    shapes = backbone_shapes(c.truncated(1))
    mats = [s for k, s in shapes.items() if len(s) == 2 and "layers." in k]
    biggest = max((s[0] * s[1] for s in mats), default=0)
    if graph == "fused":
        biggest = max(biggest, 2 * c.intermediate_size * c.hidden_size,
                      (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim * c.hidden_size)
    heads = [src.heads.info(k).numel for k in src.heads.keys() if len(src.heads.info(k).shape) == 2]
    return 4 * max([biggest, *heads])


def gpu_memory() -> int | None:
    """Free bytes on CUDA device 0 as torch sees it, or None without a GPU."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        return int(torch.cuda.mem_get_info(0)[0])
    except Exception:  # noqa: BLE001 - a broken CUDA install is "no GPU" here
        return None


def available_memory() -> int:
    """Bytes of memory available to a new allocation now (``psutil.virtual_memory().available``)."""
    import psutil

    return int(psutil.virtual_memory().available)


def parse_checks(spec: str) -> list[str] | None:
    """``--checks``: "auto" -> None, "full" or a comma list of :data:`CHECKS` -> the list.

    Raises:
        MedusaError: an unknown check name (the message lists them).
    """
    if spec == "auto":
        return None
    names = [s.strip() for s in spec.split(",") if s.strip()]
    bad = [n for n in names if n not in CHECKS]
    if bad or not names:
        raise MedusaError(f"unknown check {bad[0] if bad else spec!r}; choose auto or a comma-separated list of "
                          f"{', '.join(CHECKS)}")
    return names


def plan_validation(src: ModelSources, precision: str, weights_bytes: int, *, graph: str = "portable",
                    checks: str = "auto", layers: int = 2, validate: bool = True, available: int | None = None,
                    gpu_free: int | None = -1) -> ValidationPlan:
    """Estimate every stage and choose the checks (module docstring).

    Args:
        src: the model's sources.
        precision: the artifact's precision.
        weights_bytes: planned ``weights.bin`` size.
        graph: the step graph flavour.
        checks: "auto", or the checks to run (comma-separated names of :data:`CHECKS`).
        layers: N of the truncated check.
        validate: False: only the export is checked against memory (``--no-validate``).
        available: memory available (default: measured now).
        gpu_free: free GPU bytes (-1: measured now; None: no GPU).

    Returns:
        The plan.

    Raises:
        InsufficientMemoryError: the export itself, or a check asked for by name, does not fit.
        MedusaError: an unknown check name.
    """
    available = available_memory() if available is None else available
    gpu_free = gpu_memory() if gpu_free == -1 else gpu_free
    layers = max(1, min(layers, src.config.num_hidden_layers))
    largest = largest_transposed_fp32(src, graph)
    est = estimate_memory(src, precision, weights_bytes, largest, layers, graph)
    budget = int(available * HEADROOM)
    options = ("--precision int4 (a smaller artifact for the ONNX Runtime checks), --validate-layers N (a smaller "
               "truncated check), --checks checksums (no model run), or --no-validate")
    if est["export"] > budget:
        raise InsufficientMemoryError(
            f"the export needs about {_gb(est['export'])} (its largest weight, {_gb(largest)} in float32, converted "
            f"in memory) but {_gb(available)} is available; close other programs or use a machine with more memory")
    plan = ValidationPlan([], layers, estimates=est, available=available, requested=checks if validate else "none")
    if not validate:
        plan.skipped = {c: "--no-validate" for c in CHECKS}
        return plan
    wanted = parse_checks(checks)

    def fits(check: str) -> bool:
        if check == "gpu":
            return gpu_free is not None and est["gpu_device"] <= gpu_free and est["gpu_host"] <= budget
        return est[check] <= budget

    def why_not(check: str) -> str:
        if check == "gpu":
            if gpu_free is None:
                return "torch sees no GPU"
            return (f"needs {_gb(est['gpu_device'])} on the GPU ({_gb(gpu_free)} free) and {_gb(est['gpu_host'])} "
                    f"here ({_gb(available)} available)")
        return f"needs about {_gb(est[check])}, {_gb(available)} available"

    if wanted is not None:
        for c in wanted:
            if not fits(c):
                raise InsufficientMemoryError(f"the {c} check {why_not(c)}; options: {options}")
        plan.checks = list(dict.fromkeys(wanted))
        plan.skipped = {c: "not asked for" for c in CHECKS if c not in plan.checks}
        return plan
    order = []
    if fits("full"):
        order.append("full")
    else:
        plan.skipped["full"] = why_not("full")
        if fits("truncated"):
            order.append("truncated")
        else:
            plan.skipped["truncated"] = why_not("truncated")
    order.append("checksums")
    if "full" not in order:
        for c in ("self", "gpu"):
            if fits(c):
                order.append(c)
            else:
                plan.skipped[c] = why_not(c)
    else:
        plan.skipped.update({"truncated": "the full check runs", "self": "part of the full check",
                             "gpu": "the full check runs here"})
    plan.checks = order
    return plan
