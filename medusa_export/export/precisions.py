"""The table of backbone precisions: one frozen :class:`PrecisionSpec` per ``--precision`` name.

Every per-precision fact lives here and nowhere else: the graphs' float dtype, the weight-only
MatMulNBits bits and accuracy level (:mod:`.quantize`, :mod:`.weights`), whether the fused graph
composes with it (:mod:`.config`), the artifact flavour a portable build of it gets and so whether
TensorRT can run it (:mod:`medusa_export.trt.readiness`, ``doctor``), the validation rule
(:mod:`medusa_export.validation.validate`) and ONNX Runtime's memory per weight byte
(:mod:`medusa_export.validation.plan`). Pure data: no torch, no onnx.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Tolerance:
    """Per-precision pass/fail rule.

    Attributes:
        atol: limit on |log-prob| and |entropy| differences against PyTorch (None: not checked).
        hidden_atol: limit on |hidden state| differences against PyTorch (None: not checked).
        margin: below this top-2 log-prob gap a token divergence from PyTorch counts as a
            near-tie (0 = every divergence fails).
        exact: greedy tokens must equal PyTorch's exactly.
        reference: "pytorch": the limits above decide; "vanilla": Medusa must equal plain
            greedy decoding of the same graph token for token, and the PyTorch figures are
            information (agreement with fp32), not pass/fail.
    """

    atol: float | None
    hidden_atol: float | None
    margin: float
    exact: bool
    reference: str = "pytorch"


@dataclass(frozen=True)
class PrecisionSpec:
    """What one backbone precision means, for every stage.

    Attributes:
        name: the ``--precision`` name (``fp32``, ``fp16``, ``int8``, ``int4``).
        dtype: the graphs' float dtype (activations, KV cache, float weights): ``float32`` / ``float16``.
        weight_bits: bits of the weight-only MatMulNBits quantization, or None for float weights.
        accuracy_level: MatMulNBits compute type of the weight-only backbone when ``--accuracy-level``
            is not given (1: fp32 activations, 4: int8 activations; see ExportConfig.accuracy_level),
            None for float weights.
        fused: whether the fused graph (``--graph fused``, its CPU kernels compute in fp32) takes it.
        flavour: the artifact flavour of its portable graph (``portable``: standard ONNX ops;
            ``ort-contrib``: com.microsoft MatMulNBits, ONNX Runtime only).
        tolerance: the validation rule.
        ort_factor: ONNX Runtime CPU session resident bytes per byte of ``weights.bin`` as
            validation opens them (measured on the embedded model, onnxruntime 1.32, rounded up:
            fp32 1.26, fp16 3.1 (float32 copies of the fp16 weights), int8 1.45, int4 1.23).
    """

    name: str
    dtype: str
    weight_bits: int | None
    accuracy_level: int | None
    fused: bool
    flavour: str
    tolerance: Tolerance
    ort_factor: float

    @property
    def weight_only(self) -> bool:
        """Whether the weights are MatMulNBits blocks (int8 / int4)."""
        return self.weight_bits is not None

    @property
    def tensorrt(self) -> bool:
        """Whether TensorRT can run an artifact of this precision (its portable graph has standard ops only)."""
        return self.flavour == "portable"


#: Weight-only precisions are lossless relative to their own graph: Medusa must equal plain greedy decoding.
_SELF = Tolerance(atol=None, hidden_atol=None, margin=0.0, exact=False, reference="vanilla")

#: name -> spec, in the CLI's order of choices.
PRECISION_TABLE: dict[str, PrecisionSpec] = {p.name: p for p in (
    PrecisionSpec("fp32", "float32", None, None, fused=True, flavour="portable",
                  tolerance=Tolerance(atol=1e-3, hidden_atol=1e-3, margin=0.0, exact=True), ort_factor=1.4),
    PrecisionSpec("fp16", "float16", None, None, fused=False, flavour="portable",  # hidden values reach ~10: ulp ~1e-2
                  tolerance=Tolerance(atol=5e-2, hidden_atol=2e-1, margin=0.1, exact=False), ort_factor=3.3),
    PrecisionSpec("int8", "float32", 8, 4, fused=True, flavour="ort-contrib", tolerance=_SELF, ort_factor=1.6),
    PrecisionSpec("int4", "float32", 4, 1, fused=True, flavour="ort-contrib", tolerance=_SELF, ort_factor=1.4),
)}


def precisions(**where: bool) -> tuple[str, ...]:
    """Names of the precisions whose spec has every given attribute value, in table order.

    E.g. ``precisions(weight_only=True)`` -> ``("int8", "int4")``; ``precisions()``: all of them.
    """
    return tuple(Column("name", **where))


def _matches(p: PrecisionSpec, where: dict[str, bool]) -> bool:
    return all(getattr(p, k) == v for k, v in where.items())


class Column(Mapping):
    """A live, read-only view of one field of :data:`PRECISION_TABLE`: precision name -> ``field`` of the rows
    that have every attribute value in ``where``, in table order.

    Every stage reads the table through views like this one instead of a dict or tuple copied at import, so a
    row added to the table (the one step of adding a precision, docs/house.md) is seen by the CLI's choices,
    the export's checks, quantization, validation and the memory plan alike.

    E.g. ``Column("weight_bits", weight_only=True)`` -> ``{"int8": 8, "int4": 4}`` (as a Mapping; ``in``,
    ``[]``, iteration over names and ``", ".join(...)`` work as on a dict, argparse ``choices=`` too).

    Raises:
        KeyError: ``[name]`` of a precision not in the table or not matching ``where``.
    """

    def __init__(self, field: str, **where: bool) -> None:
        self._field, self._where = field, where

    def _rows(self) -> Iterator[PrecisionSpec]:
        return (p for p in PRECISION_TABLE.values() if _matches(p, self._where))

    def __getitem__(self, name: str):
        p = PRECISION_TABLE.get(name) if isinstance(name, str) else None
        if p is None or not _matches(p, self._where):
            raise KeyError(name)
        return getattr(p, self._field)

    def __iter__(self) -> Iterator[str]:
        return (p.name for p in self._rows())

    def __len__(self) -> int:
        return sum(1 for _ in self._rows())

    def __repr__(self) -> str:
        return f"Column({self._field!r}, {dict(self)!r})"
