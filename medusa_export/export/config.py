"""The export's options: precisions, step graphs and :class:`ExportConfig`.

The CLI reads its choices and defaults from here; :mod:`.writer`, :mod:`.build` and :mod:`.manifest` read an
:class:`ExportConfig`. The validation's options are :class:`medusa_export.validation.config.ValidationConfig`;
``build`` takes both (:class:`medusa_export.pipeline.BuildConfig`).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from medusa_runtime.contract.artifact import step_batch
from medusa_runtime.contract.manifest import Manifest

from ..errors import MedusaError
from ..loading.draft_vocab import HeadsVocabError
from .precisions import PRECISION_TABLE, Column, GraphForm, PrecisionSpec, graphs_of, precisions_of
from .quantize import WEIGHT_ONLY_BITS, WeightOnlyConfig

#: Backbone precisions (:data:`.precisions.PRECISION_TABLE`): every one has a portable graph (standard ONNX ops, the
#: TensorRT path; int8 / fp8 / int4 as Q/DQ); int8 / int4 also MatMulNBits graphs (``--graph contrib|fused``, ONNX
#: Runtime only, see :mod:`.quantize`).
PRECISIONS = Column("name")
class _HeadsPrecisions(Collection):
    """"auto", "same", then the table's weight-only precisions (read live, as :class:`.precisions.Column`)."""

    def __iter__(self):
        yield from ("auto", "same", *WEIGHT_ONLY_BITS)

    def __contains__(self, name: object) -> bool:
        return name in ("auto", "same") or name in WEIGHT_ONLY_BITS

    def __len__(self) -> int:
        return 2 + len(WEIGHT_ONLY_BITS)


#: Heads-graph precisions: "auto" (portable backbones: same; weight-only ones:
#: :data:`QUANTIZED_HEADS_DEFAULT`), "same" as the backbone, or a weight-only precision.
HEADS_PRECISIONS = _HeadsPrecisions()
#: The heads of a weight-only artifact under "auto": on SmolLM2-135M int8 heads cost 1.6 ms per step
#: against fp32's 4.3 ms on an idle machine, with 0.96 top-1 agreement (int4 0.65; see quantize.py).
QUANTIZED_HEADS_DEFAULT = "int8"
#: Backbone step graphs (``--graph``): "portable" standard ops (:mod:`.portable`; int8 / fp8 / int4 as standard
#: Q/DQ), "contrib" the portable step with ONNX Runtime's MatMulNBits weights (flavour ``ort-contrib``: int8 / int4),
#: "fused" ONNX Runtime's fused operators (:mod:`.fused`, flavour ``ort-fused``). Which graph carries which precision
#: is the precision table's (:func:`.precisions.graphs_of`).
GRAPHS = ("portable", "contrib", "fused")
#: The step graph (:data:`GRAPHS`) of a manifest's ``flavour`` (:data:`.manifest.FLAVOURS`): ort-fused is the
#: fused graph's; ort-contrib the contrib graph's (a portable step with MatMulNBits weights; a fp32 / fp16 backbone
#: with MatMulNBits heads too), portable the portable graph's.
FLAVOUR_GRAPHS = {"ort-fused": "fused", "ort-contrib": "contrib"}
#: Precisions the fused graph composes with (weight-only ones quantize its MatMuls; its activations are fp32).
FUSED_PRECISIONS = Column("name", fused=True)


#: MatMulNBits accuracy level of a weight-only backbone by precision (see ExportConfig.accuracy_level).
BACKBONE_ACCURACY = Column("accuracy_level", weight_only=True)


class UnknownPrecisionError(MedusaError, ValueError):
    """A precision name is not one of the choices; the message lists them."""


class UnsupportedGraphError(MedusaError, ValueError):
    """A ``--graph`` name, or its combination with ``--precision``, is not supported; the message lists the choices."""


@dataclass(frozen=True)
class ExportConfig:
    """What the export writes (``build``'s export options); the CLI reads its defaults from here.

    Attributes:
        precision: backbone precision, one of :data:`PRECISIONS`.
        heads_precision: heads-graph precision, one of :data:`HEADS_PRECISIONS`; the heads only
            propose candidates the backbone verifies, so their precision never changes the output.
        max_context: KV capacity (None: the model's registered context).
        block_size: block size of the quantized weights along K: MatMulNBits' (``contrib`` / ``fused`` graphs; None:
            32), or the int4 Q/DQ graph's (None: per weight the largest of TensorRT's 128 / 64 / 32 / 16 that divides
            its K, :data:`medusa_export.trt.typed.INT4_BLOCKS`; a given size must divide every K, else
            :class:`UnsupportedGraphError` naming the sizes that do).
        quantize_lm_head: quantize the (tied) lm_head in the backbone graph too (the embedding
            Gather always reads the float table).
        heads_vocab: 0 (the heads project onto the full vocabulary) or N: they project onto the
            top N ids of the model's draft vocabulary (:mod:`medusa_export.loading.draft_vocab`; topk <= N <= V). The
            heads graph then reads an [N, d] matrix instead of [V, d]; the output never changes
            (the backbone verifies), a correct guess outside the subset is lost.
        graph: backbone step graph, one of :data:`GRAPHS`: "portable" (standard ops; TensorRT
            too) or "fused" (ONNX Runtime fused operators, flavour ``ort-fused``; precisions
            :data:`FUSED_PRECISIONS`).
        accuracy_level: MatMulNBits compute type of the weight-only *backbone*: 4 (int8
            activations, VNNI; fastest), 1 (fp32 activations) or None (:data:`BACKBONE_ACCURACY`:
            4 for int4 and int8). Level 4 quantizes activations, so a rounding difference of one ulp
            between two ways of computing a row flips an int8 step that grows through the layers: ONNX
            Runtime's one-row kernel rounds otherwise than its multi-row one, and the attention's sums
            otherwise when masked keys sit between a row's keys. Such a build records
            :attr:`step_rows`: the runtime runs one-token steps as two rows and trees are chains, and then
            Medusa equals plain greedy decoding of the same graph bit for bit (tests/test_step_rows.py).
            Level 1 takes any tree but its multi-row steps are slow (the 4-bit kernel dequantizes the
            weights for M > 1). The heads graph always uses level 4 (its candidates are verified, so its
            rounding never changes the output).
        batch_size: sequences per step the artifact is built for (``--batch-size``): 1 writes the batch-1
            step graph of every artifact before; N > 1 the batched portable step (a dynamic batch dimension B,
            per-row past lengths; :func:`~.contract.step_io`; with ``graph`` "fused" its batched variant,
            :func:`~.fused.write_fused_step`), recorded as the manifest's ``batch`` (``max_batch_size`` N).
        int4_scales: ``--graph portable --precision int4``'s block scales: "awq" (AWQ's clip search on the calibration
            prompts, :mod:`medusa_export.trt.ranges`; closer to fp32) or "rtn" (round-to-nearest, no calibration).
    """

    precision: str = "fp32"
    heads_precision: str = "auto"
    max_context: int | None = None
    block_size: int | None = None
    quantize_lm_head: bool = True
    accuracy_level: int | None = None
    graph: str = "portable"
    heads_vocab: int = 0
    batch_size: int = 1
    int4_scales: str = "awq"

    def __post_init__(self) -> None:
        for what, value, choices in (("precision", self.precision, PRECISIONS),
                                     ("heads precision", self.heads_precision, HEADS_PRECISIONS)):
            if value not in choices:
                raise UnknownPrecisionError(f"unknown {what} {value!r}; choose one of {', '.join(choices)}")
        if self.graph not in GRAPHS:
            raise UnsupportedGraphError(f"unknown graph {self.graph!r}; choose one of {', '.join(GRAPHS)}")
        if self.graph not in self.spec.graphs:
            why = " (its CPU kernels compute in fp32)" if self.graph == "fused" else \
                " (MatMulNBits: weight-only int8 / int4)" if self.graph == "contrib" else ""
            raise UnsupportedGraphError(f"--graph {self.graph} does not take --precision {self.precision}{why}; choose "
                                        f"--precision {', '.join(precisions_of(self.graph))}, or --graph "
                                        f"{' or '.join(graphs_of(self.precision))} for {self.precision}")
        hp = self.resolved_heads_precision
        if hp != self.precision and (self.form.dtype != "float32" or hp not in WEIGHT_ONLY_BITS):
            # MatMulNBits heads read float32 hidden states; a Q/DQ backbone's heads are its own precision
            raise UnknownPrecisionError(f"heads precision {self.heads_precision!r} needs an fp32 or weight-only backbone "
                                        f"in MatMulNBits (the {self.precision} {self.graph} graph's hidden states "
                                        f"are {self.form.dtype}); use same or auto")
        if self.heads_vocab < 0:
            raise HeadsVocabError(f"--heads-vocab must be 0 (the full vocabulary) or a subset size N > 0, "
                                  f"got {self.heads_vocab}")
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise UnsupportedGraphError(f"--batch-size must be an integer >= 1, got {self.batch_size!r}")
        if self.max_context is not None and self.max_context < 2:
            raise MedusaError(f"--max-context must be >= 2, got {self.max_context}")

    @classmethod
    def of_manifest(cls, manifest: Manifest, **overrides) -> ExportConfig:
        """The export options an artifact was built with, as far as its manifest records them: the precision,
        the step graph (:data:`FLAVOUR_GRAPHS` of its ``flavour``), the batch size (``batch.max_batch_size``,
        :func:`medusa_runtime.contract.artifact.step_batch`) and the context; the rest at their defaults.

        Args:
            manifest: the artifact's manifest.
            overrides: fields to set instead (e.g. ``precision="fp32"`` for the truncated check's re-export).

        Raises:
            ArtifactError: the manifest's ``batch`` entry is malformed (:func:`~medusa_runtime.contract.artifact.step_batch`).
            UnknownPrecisionError, UnsupportedGraphError: as the constructor.
        """
        precision = overrides.get("precision", manifest.precision_name)
        graph = FLAVOUR_GRAPHS.get(manifest.flavour, "portable")
        if precision in PRECISION_TABLE and graph not in PRECISION_TABLE[precision].graphs:
            graph = "portable"  # e.g. fp32 with MatMulNBits heads (ort-contrib), or an fp32 re-export of a contrib one
        recorded = dict(precision=manifest.precision_name, graph=graph,
                        batch_size=step_batch(manifest) or 1, max_context=manifest.model.max_context)
        return cls(**{**recorded, **overrides})

    @property
    def batched(self) -> bool:
        """Whether the step graph has the batch dimension (``batch_size`` > 1)."""
        return self.batch_size > 1

    @property
    def spec(self) -> PrecisionSpec:
        """The backbone precision's row of :data:`.precisions.PRECISION_TABLE`."""
        return PRECISION_TABLE[self.precision]

    @property
    def form(self) -> GraphForm:
        """What the backbone's ``--graph`` of its precision writes (flavour, dtype, weight form)."""
        return self.spec.graphs[self.graph]

    @property
    def qdq(self) -> bool:
        """Whether the graphs are written in float16 and then rewritten with Q/DQ (:mod:`medusa_export.trt.typed`)."""
        return self.form.weights == "qdq"

    @property
    def graphs_dtype(self) -> str:
        """The float dtype the graphs are written in (the heads' too)."""
        return self.form.dtype

    @property
    def resolved_heads_precision(self) -> str:
        """The heads graph's precision name ("fp32", "fp16", "int8", "int4" or "fp8")."""
        if self.heads_precision == "same" or (self.heads_precision == "auto" and self.form.weights != "nbits"):
            return self.precision
        return QUANTIZED_HEADS_DEFAULT if self.heads_precision == "auto" else self.heads_precision

    @property
    def step_rows(self) -> dict | None:
        """The manifest's ``precision.step_rows`` (:class:`medusa_runtime.contract.manifest.StepRows`) of this
        build, or None: a backbone whose MatMulNBits quantize their activations (accuracy level 4) is exact only when
        every step runs at least 2 rows (ONNX Runtime's one-row kernel rounds differently) and on chain trees (the
        attention's sums round differently when masked keys sit between a row's keys). Measured on ONNX Runtime
        1.32's CPU kernels: docs/precisions.md, "int8 activations". A Q/DQ graph (float16 activations, explicit
        attention) needs the two rows only: its tree rows then equal plain decoding's bit for bit on any tree
        (tests/test_qdq_build.py). TensorRT engines do not pad (the regime is ONNX Runtime's)."""
        if self.qdq:
            trees = self.form.step_trees
            return {"min_rows": 2, "trees": trees,
                    "reason": "Q/DQ graph on ONNX Runtime's CPU: one-token steps run as 2 rows (the one-row kernels "
                              "round otherwise)" + (" and trees are chains (quantized activations)" if trees == "chain"
                                                    else "") + ", so every row is computed as in plain decoding"}
        wo = self.weight_only(self.precision)
        if wo is None or wo.accuracy_level != 4:
            return None
        return {"min_rows": 2, "trees": "chain",
                "reason": "int8 activations (MatMulNBits accuracy level 4): one-token steps run as 2 rows and trees "
                          "are chains, so every row is computed bit for bit as in plain decoding (docs/precisions.md)"}

    @property
    def nbits_block(self) -> int:
        """MatMulNBits block size (``block_size``, default 32)."""
        return self.block_size or 32

    def weight_only(self, precision: str, heads: bool = False) -> WeightOnlyConfig | None:
        """The MatMulNBits settings of ``precision`` (None for float weights and for the Q/DQ forms, whose graphs are
        written in float16 and quantized afterwards).

        Args:
            precision: a precision name.
            heads: settings for the heads graph, whose vocabulary projection is always
                quantized (it is their whole cost, and they only propose candidates).
        """
        nbits = (precision != self.precision or self.form.weights == "nbits") if heads else self.form.weights == "nbits"
        if precision not in WEIGHT_ONLY_BITS or not nbits:
            return None
        level = 4 if heads else (self.accuracy_level or BACKBONE_ACCURACY[precision])
        return WeightOnlyConfig.for_precision(precision, block_size=self.nbits_block, accuracy_level=level,
                                              vocab_projection=heads or self.quantize_lm_head)
