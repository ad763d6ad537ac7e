"""The table of backbone precisions: one frozen :class:`PrecisionSpec` per ``--precision`` name.

Every per-precision fact lives here and nowhere else: which step graphs (``--graph``) carry it and, per graph, the
artifact flavour, float dtype and weight form it gets (:class:`GraphForm`: float weights, ONNX Runtime's MatMulNBits,
or standard-ONNX QuantizeLinear / DequantizeLinear written by :mod:`medusa_export.trt.typed`), so whether TensorRT can
run it (:mod:`medusa_export.trt.readiness`, ``doctor``); the weight-only MatMulNBits bits and accuracy level
(:mod:`.quantize`, :mod:`.weights`); how many calibration prompts its Q/DQ form needs; the validation rule
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
class GraphForm:
    """What one ``--graph`` of one precision writes.

    Attributes:
        flavour: the artifact's ``flavour`` (``portable``: standard ONNX ops, TensorRT-ready; ``ort-contrib``:
            com.microsoft MatMulNBits, ONNX Runtime only; ``ort-fused``: ONNX Runtime's fused step).
        dtype: the graphs' float dtype (graph I/O, KV cache, activations): ``float32`` / ``float16``.
        weights: ``float`` (the dtype's weights), ``nbits`` (MatMulNBits blocks written with the graph,
            :mod:`.quantize`) or ``qdq`` (the ``dtype`` graph written first, then every weight product rewritten
            with QuantizeLinear / DequantizeLinear by :mod:`medusa_export.trt.typed`: int4 weight-only blocked DQ,
            int8 / fp8 W8A8).
        ort_factor: ONNX Runtime CPU session resident bytes per byte of ``weights.bin`` as validation opens
            them (measured on the embedded model, onnxruntime 1.32, rounded up: fp32 1.26, fp16 3.1 (float32
            copies of the fp16 weights), MatMulNBits int8 1.45, int4 1.23). The Q/DQ forms' factor is per byte of
            the float16 weights the build plans (their own file is 2-4x smaller), fp16's bound: not measured yet.
        near_tie: below this top-2 log-prob margin of the graph itself, a divergence of Medusa from plain greedy
            decoding of the same graph is a near-tie (reported with its step and margin, not a failure): a tree
            step and one-token steps are products of different shapes whose float16 accumulation orders differ
            (DESIGN.md "Precision and parity"). 0: every divergence fails, which every form takes today: the Q/DQ
            forms run in their row regime (:attr:`~medusa_export.export.config.ExportConfig.step_rows`) and are then
            exact; the typed graphs' check (:data:`medusa_export.trt.typed_check.NEAR_TIE`) reads it.
        step_trees: for a Q/DQ form, the trees its row regime keeps exact on ONNX Runtime (``any``; ``chain`` for
            int8 W8A8, whose quantized activations also amplify the attention's rounding between a branching tree's
            rows and plain decoding: measured, its 16-node tree left plain greedy decoding at token 60 of one of
            three prompts even with two-row steps).
    """

    flavour: str
    dtype: str
    weights: str = "float"
    ort_factor: float = 1.4
    near_tie: float = 0.0
    step_trees: str = "any"


@dataclass(frozen=True)
class PrecisionSpec:
    """What one backbone precision means, for every stage.

    Attributes:
        name: the ``--precision`` name (``fp32``, ``fp16``, ``int8``, ``int4``, ``fp8``).
        graphs: ``--graph`` name -> its :class:`GraphForm`; a graph not listed cannot carry the precision (the
            error names those that can).
        weight_bits: bits of the weight-only MatMulNBits quantization (its ``nbits`` forms, and the heads'
            ``--heads-precision``), or None.
        accuracy_level: MatMulNBits compute type of the weight-only backbone when ``--accuracy-level``
            is not given (1: fp32 activations, 4: int8 activations; see ExportConfig.accuracy_level),
            None for float weights.
        tolerance: the validation rule.
        calibration_prompts: the fewest calibration prompts its ``qdq`` form takes (0: none needed). W8A8's
            per-tensor activation scales are max |x| over the calibration decode: at least two prompts, so a
            range is never one reply's.
        scheme: what its Q/DQ graph holds (the manifest's ``precision.weights``); empty for the others.
    """

    name: str
    graphs: dict
    weight_bits: int | None
    accuracy_level: int | None
    tolerance: Tolerance
    calibration_prompts: int = 0
    scheme: str = ""

    @property
    def weight_only(self) -> bool:
        """Whether it has a MatMulNBits form (int8 / int4), so may be a ``--heads-precision``."""
        return self.weight_bits is not None

    @property
    def fused(self) -> bool:
        """Whether the fused graph (``--graph fused``, its CPU kernels compute in fp32) takes it."""
        return "fused" in self.graphs

    @property
    def portable(self) -> GraphForm:
        """Its ``--graph portable`` form (every precision has one)."""
        return self.graphs["portable"]

    @property
    def dtype(self) -> str:
        """The float dtype of its portable graph."""
        return self.portable.dtype

    @property
    def flavour(self) -> str:
        """The flavour of its portable graph."""
        return self.portable.flavour

    @property
    def ort_factor(self) -> float:
        """ONNX Runtime memory per weight byte of its portable graph (:attr:`GraphForm.ort_factor`)."""
        return self.portable.ort_factor

    @property
    def tensorrt(self) -> bool:
        """Whether TensorRT can run an artifact of this precision (its portable graph has standard ops only)."""
        return self.portable.flavour == "portable"

    @property
    def qdq(self) -> bool:
        """Whether its portable graph is a standard Q/DQ graph (int8, fp8, int4)."""
        return self.portable.weights == "qdq"


#: Weight-only precisions are lossless relative to their own graph: Medusa must equal plain greedy decoding.
_SELF = Tolerance(atol=None, hidden_atol=None, margin=0.0, exact=False, reference="vanilla")

_FUSED32 = GraphForm("ort-fused", "float32")
#: The Q/DQ forms are written from the float16 graph (a 7B base is 13.5 GB on disk and streams in ~6 GB; float32 would
#: double both, and the typed graph's activations are float16 anyway): per-precision base dtype, one place.
_QDQ_BASE = "float16"
#: 0: with their row regime (ExportConfig.step_rows: one-token steps as two rows on ONNX Runtime) the Q/DQ graphs'
#: Medusa equals plain greedy decoding bit for bit; without it they diverged at margins up to 0.26 (docs/precisions.md).
_QDQ_TIE = 0.0

#: name -> spec, in the CLI's order of choices.
PRECISION_TABLE: dict[str, PrecisionSpec] = {p.name: p for p in (
    PrecisionSpec("fp32", {"portable": GraphForm("portable", "float32", ort_factor=1.4), "fused": _FUSED32}, None, None,
                  tolerance=Tolerance(atol=1e-3, hidden_atol=1e-3, margin=0.0, exact=True)),
    PrecisionSpec("fp16", {"portable": GraphForm("portable", "float16", ort_factor=3.3)}, None, None,
                  # hidden values reach ~10: ulp ~1e-2
                  tolerance=Tolerance(atol=5e-2, hidden_atol=2e-1, margin=0.1, exact=False)),
    PrecisionSpec("int8", {"portable": GraphForm("portable", _QDQ_BASE, "qdq", ort_factor=3.3, near_tie=_QDQ_TIE,
                                                 step_trees="chain"),
                           "contrib": GraphForm("ort-contrib", "float32", "nbits", ort_factor=1.6),
                           "fused": GraphForm("ort-fused", "float32", "nbits", ort_factor=1.6)}, 8, 4, tolerance=_SELF,
                  calibration_prompts=2, scheme="int8 W8A8: QuantizeLinear/DequantizeLinear on both inputs of every "
                  "weight product (per-channel weights, per-tensor calibrated activations, symmetric), float16 elsewhere"),
    PrecisionSpec("int4", {"portable": GraphForm("portable", _QDQ_BASE, "qdq", ort_factor=3.3, near_tie=_QDQ_TIE),
                           "contrib": GraphForm("ort-contrib", "float32", "nbits", ort_factor=1.4),
                           "fused": GraphForm("ort-fused", "float32", "nbits")}, 4, 4, tolerance=_SELF,
                  scheme="int4 weight-only: blocked DequantizeLinear (opset 21, symmetric, float16 scales) feeding "
                  "float16 MatMuls"),
    PrecisionSpec("fp8", {"portable": GraphForm("portable", _QDQ_BASE, "qdq", ort_factor=3.3, near_tie=_QDQ_TIE)}, None, None,
                  tolerance=_SELF, calibration_prompts=2, scheme="float8 E4M3 W8A8: QuantizeLinear/DequantizeLinear on "
                  "both inputs of every weight product (per-channel weights, per-tensor calibrated activations), "
                  "float16 elsewhere"),
)}


def graphs_of(precision: str) -> tuple[str, ...]:
    """The ``--graph`` names that carry ``precision``, in table order."""
    return tuple(PRECISION_TABLE[precision].graphs)


def precisions_of(graph: str) -> tuple[str, ...]:
    """The precisions ``--graph graph`` carries, in table order."""
    return tuple(n for n, p in PRECISION_TABLE.items() if graph in p.graphs)


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
