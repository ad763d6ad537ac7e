"""The artifact's ``manifest.json`` as typed, versioned data: the contract the exporter writes and every
reader (runtime, TensorRT, Triton, C++) reads.

:class:`Manifest` and its sections are frozen dataclasses. :meth:`Manifest.from_json` checks the
document (a missing or mistyped key is an :class:`~medusa_runtime.errors.ArtifactError` naming the key,
a ``format_version`` this runtime does not read says which it reads and what to do) and
:meth:`Manifest.to_json` gives it back unchanged. :func:`json_schema` derives a JSON Schema (draft
2020-12) from the same dataclasses; it is shipped as ``docs/manifest.schema.json`` and written into every
artifact as ``manifest.schema.json``.

Unknown keys are preserved, not rejected: every section keeps the keys it does not declare in ``extra``
and writes them back. Later stages and tools add optional keys to a finished artifact (``engines``,
``validation``, a newer exporter's optional entries) without a new ``format_version``; a runtime of the
same version must still read such an artifact, and rewriting a manifest (``update_manifest``) must not
drop what it does not know. A change that an older reader would misread bumps ``format_version``.

Pure data: json and dataclasses only (no numpy, no exporter).
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from ..errors import ArtifactError

ARTIFACT_FORMAT = "medusa-export-artifact"
#: The ``format_version`` the exporter writes.
ARTIFACT_VERSION = 1
#: The ``format_version`` values this runtime reads.
SUPPORTED_VERSIONS = (1,)
MANIFEST = "manifest.json"
#: The JSON Schema of the manifest, written beside it in every artifact (and shipped as docs/manifest.schema.json).
MANIFEST_SCHEMA = "manifest.schema.json"
SCHEMA_ID = "https://medusa-export/manifest.schema.json"

#: Head types an artifact may declare (``heads.type``; absent = "medusa").
HEAD_TYPES = ("medusa", "hydra")
#: KV cache layouts an artifact may declare (``kv_layout.layout``; absent = sequence-major).
KV_LAYOUTS = ("sequence-major", "head-major")


def _doc(text: str, default: Any = dataclasses.MISSING, factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field with its schema description (``metadata["doc"]``)."""
    kw = {}
    if default is not dataclasses.MISSING:
        kw["default"] = default
    if factory is not dataclasses.MISSING:
        kw["default_factory"] = factory
    return field(metadata={"doc": text}, **kw)


def _extra() -> Any:
    return field(default_factory=dict, metadata={"extra": True}, repr=False)


def _order() -> Any:
    """The key order of the parsed document (so that to_json gives it back byte for byte); not compared."""
    return field(default=(), metadata={"extra": True}, repr=False, compare=False)


@dataclass(frozen=True, kw_only=True)
class Section:
    """Base of the manifest's sections: ``extra`` holds the keys a section does not declare."""

    def to_json(self) -> dict:
        """The section as JSON (declared keys in declaration order, absent optional keys left out, then
        ``extra``)."""
        out = {}
        for f in dataclasses.fields(self):
            if f.metadata.get("extra"):
                continue
            value = getattr(self, f.name)
            if value is None and _optional(_hints(type(self))[f.name]) and f.name not in self.key_order:
                continue  # absent (a null the document had is written back)
            out[f.name] = _encode(value)
        out.update(self.extra)
        if self.key_order:
            rank = {k: i for i, k in enumerate(self.key_order)}
            out = dict(sorted(out.items(), key=lambda kv: rank.get(kv[0], len(rank))))
        return out

    @classmethod
    def from_json(cls, doc: Any, where: str = ""):
        """Parse and check ``doc``.

        Raises:
            ArtifactError: a missing required key, a value of the wrong JSON type; the message names the
                key's path (``model.num_layers``).
        """
        return _decode(cls, doc, where or cls.__name__)


@dataclass(frozen=True, kw_only=True)
class Exporter(Section):
    """Versions of the tools that wrote the artifact."""

    medusa_export: str
    torch: str
    onnx: str
    onnxruntime: str
    opset: int = _doc("ONNX opset of the graphs")
    extra: dict = _extra()
    key_order: tuple = _order()


@dataclass(frozen=True, kw_only=True)
class ModelInfo(Section):
    """The model's geometry: every integer a runtime sizes its buffers with."""

    name: str
    backbone_source: str
    heads_source: str = _doc("where the heads came from; 'init...' for untrained heads")
    architecture: str
    features: list[str] | None = _doc("the architecture's feature switches (absent in older artifacts)", None)
    vocab_size: int
    hidden_size: int = _doc("d: width of hidden_states")
    num_layers: int = _doc("L: one key and one value past input per layer")
    num_attention_heads: int
    num_kv_heads: int = _doc("H_kv")
    head_dim: int = _doc("D")
    rope_theta: float
    medusa_heads: int = _doc("K: Medusa heads (tree depth limit)")
    medusa_layers: int
    medusa_own_projection: bool
    max_context: int = _doc("KV capacity in tokens the graphs were built for (the rotary tables end there)")
    extra: dict = _extra()
    key_order: tuple = _order()


#: The tree shapes a :class:`StepRows` regime may require (``any``: every tree; ``chain``: one path, no branching).
STEP_TREES = ("any", "chain")


@dataclass(frozen=True, kw_only=True)
class StepRows(Section):
    """How a step graph must be called for Medusa to equal plain greedy decoding of the same graph bit for bit.

    Written for backbones whose weight products quantize their activations (ONNX Runtime's MatMulNBits at
    accuracy level 4: int8 activations): a rounding difference of one ulp between two ways of computing a row flips
    an int8 step that then grows through the layers. Measured on ONNX Runtime 1.32's CPU kernels (docs/precisions.md):
    MatMulNBits gives one row the same bits at every M >= 2 but others at M = 1, and the attention's softmax sums
    give a row the same bits whenever its keys are contiguous (a chain) but others when masked keys sit between them
    (a branching tree).
    """

    min_rows: int = _doc("pad every step to at least this many rows (extra rows: copies of the last one, masked)", 1)
    trees: str = _doc("tree shapes that keep Medusa exact: any, or chain (one path)", "any")
    reason: str = _doc("why, in words", "")
    extra: dict = _extra()
    key_order: tuple = _order()


@dataclass(frozen=True, kw_only=True)
class Precision(Section):
    """The precision of the graphs' weights, KV cache and heads."""

    name: str = _doc("the build's --precision: fp32, fp16, int8, int4 ...")
    weights: str
    heads: str
    heads_weights: str
    quantized_matmuls: dict[str, dict[str, int]] = _doc("MatMulNBits counts by graph file")
    kv_dtype: str = _doc("float32 or float16: dtype of the KV tensors and float graph I/O")
    norm_and_softmax: str
    step_rows: StepRows | None = _doc("the row regime the step needs (absent: any rows, any tree)", None)
    extra: dict = _extra()
    key_order: tuple = _order()


@dataclass(frozen=True, kw_only=True)
class HeadsVocab(Section):
    """The tokens the heads graph projects onto (the full vocabulary or a draft subset)."""

    size: int
    vocab_size: int
    subset: bool
    source: str | None = None
    draft_vocab_ids: int | None = None
    extra: dict = _extra()
    key_order: tuple = _order()


@dataclass(frozen=True, kw_only=True)
class StepSampler(Section):
    """The step graph carries the in-graph sampler (docs/sampling.md)."""

    version: int = _doc("version of the sampler's I/O contract; this runtime reads 1")
    spec: str | None = None
    extra: dict = _extra()
    key_order: tuple = _order()


@dataclass(frozen=True, kw_only=True)
class Batch(Section):
    """A batched step graph (docs/batching.md): every step tensor has a leading dynamic dimension B."""

    version: int = _doc("version of the batch contract; this runtime reads 1")
    max_batch_size: int | None = _doc("B the graph was built and profiled for (>= 1)", None)
    dim: str | None = None
    dynamic: bool | None = None
    note: str | None = None
    graph: str | None = None
    extra: dict = _extra()
    key_order: tuple = _order()


@dataclass(frozen=True, kw_only=True)
class KvLayout(Section):
    """How the step graph reads and writes the KV cache (words for people; ``layout`` for programs)."""

    layout: str = _doc("sequence-major or head-major")
    shape: str
    inputs: str
    outputs: str
    compaction: str
    extra: dict = _extra()
    key_order: tuple = _order()


@dataclass(frozen=True, kw_only=True)
class TensorSpec(Section):
    """One graph input or output."""

    name: str
    dtype: str = _doc("ONNX element type name: float32, float16, int64, int32, bool")
    shape: list[int | str] = _doc("integers, or the symbolic dims named in the graph's dims")
    meaning: str | None = None
    extra: dict = _extra()
    key_order: tuple = _order()


@dataclass(frozen=True, kw_only=True)
class Graph(Section):
    """One ONNX graph of the artifact: its file and I/O."""

    file: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    dims: dict[str, str] | None = _doc("meaning of each symbolic dim", None)
    profiles: dict[str, dict[str, list[int]]] | None = _doc(
        "TensorRT optimization profiles: {profile: {dim: [min, max]}} (portable step graph)", None)
    extra: dict = _extra()
    key_order: tuple = _order()

    def names(self) -> set[str]:
        """Names of every input and output."""
        return {t.name for t in self.inputs} | {t.name for t in self.outputs}

    def shape(self, name: str, outputs: bool = False) -> list | None:
        """The shape of input (or output) ``name``, None if the graph has none."""
        return next((t.shape for t in (self.outputs if outputs else self.inputs) if t.name == name), None)


@dataclass(frozen=True, kw_only=True)
class Heads(Section):
    """The heads' type and how a runtime runs them."""

    type: str | None = _doc("medusa (heads.onnx) or hydra (heads_level{j}.onnx); absent = medusa", None)
    num_heads: int | None = None
    num_layers: int | None = None
    runs: str | None = None
    extra: dict = _extra()
    key_order: tuple = _order()


@dataclass(frozen=True, kw_only=True)
class Weights(Section):
    """``weights.bin``: the graphs' external data."""

    file: str
    bytes: int
    tensors: int
    deduplicated: int | None = None
    records: list[dict] | None = _doc("each tensor's offset, length, SHA-256 and recipe", None)
    extra: dict = _extra()
    key_order: tuple = _order()


@dataclass(frozen=True, kw_only=True)
class TreeInfo(Section):
    """Summary of ``tree.json``."""

    file: str
    size: int = _doc("T: nodes, root included")
    depth: int
    topk: int
    policy: str | None = _doc("'dynamic:T': per-step trees of T nodes", None)
    selection: dict | None = _doc("--tree auto: the timed candidates and the chosen size", None)
    extra: dict = _extra()
    key_order: tuple = _order()


@dataclass(frozen=True, kw_only=True)
class TokenizerInfo(Section):
    """The tokenizer folder and the EOS ids."""

    dir: str
    eos_token_ids: list[int]
    chat_template: str | None = None
    extra: dict = _extra()
    key_order: tuple = _order()


@dataclass(frozen=True, kw_only=True)
class TypicalDefaults(Section):
    """Typical acceptance defaults (docs/trees.md)."""

    temperature: float
    posterior_threshold: float
    posterior_alpha: float
    extra: dict = _extra()
    key_order: tuple = _order()


@dataclass(frozen=True, kw_only=True)
class Checksum(Section):
    """SHA-256 and size of one artifact file."""

    sha256: str
    bytes: int
    extra: dict = _extra()
    key_order: tuple = _order()


@dataclass(frozen=True, kw_only=True)
class Manifest(Section):
    """The whole ``manifest.json`` (docs/artifact.md)."""

    format: str = _doc(f"always {ARTIFACT_FORMAT!r}")
    format_version: int = _doc(f"this runtime reads {', '.join(map(str, SUPPORTED_VERSIONS))}")
    created: str | None = None
    exporter: Exporter | None = None
    model: ModelInfo
    precision: Precision | None = None
    heads_vocab: HeadsVocab | None = None
    flavour: str | None = _doc("portable, ort-contrib or ort-fused (docs/precisions.md)", None)
    flavour_note: str | None = None
    step_topk: int | None = _doc("k of the step graph's topk outputs", None)
    step_sampler: StepSampler | None = None
    batch: Batch | None = None
    kv_layout: KvLayout | None = None
    graphs: dict[str, Graph] = _doc("'model' (the step), 'heads' or 'heads_level{j}'")
    heads: Heads | None = None
    weights: Weights | None = None
    tree: TreeInfo
    tokenizer: TokenizerInfo | None = None
    typical_defaults: TypicalDefaults | None = None
    files: dict[str, str] = _doc("artifact-relative file names by role")
    checksums: dict[str, Checksum] = _doc("every file of the artifact by relative path")
    trt_readiness: dict | None = _doc("the TensorRT readiness report (medusa_export.trt.readiness)", None)
    validation: dict | None = _doc("the build's validation record", None)
    build: dict | None = _doc("build stages, peak memory, preflight estimates", None)
    engines: dict[str, dict] | None = _doc("TensorRT plans by precision (medusa-export engine)", None)
    extra: dict = _extra()
    key_order: tuple = _order()

    @classmethod
    def from_json(cls, doc: Any, where: str = "") -> Manifest:
        """Parse and check a manifest document.

        Raises:
            ArtifactError: wrong ``format``; a ``format_version`` this runtime does not read (the message
                says which it reads and what to do); a missing or mistyped key (named by its path).
        """
        if not isinstance(doc, dict):
            raise ArtifactError(f"the manifest must be a JSON object, got {type(doc).__name__}")
        if doc.get("format") != ARTIFACT_FORMAT:
            raise ArtifactError(f"format is {doc.get('format')!r}, expected {ARTIFACT_FORMAT!r}")
        version = doc.get("format_version")
        if version not in SUPPORTED_VERSIONS:
            reads = ", ".join(map(str, SUPPORTED_VERSIONS))
            advice = (f"rebuild the artifact with this medusa-export (writes {ARTIFACT_VERSION})"
                      if isinstance(version, int) and not isinstance(version, bool) and version < min(SUPPORTED_VERSIONS)
                      else "upgrade medusa-export / medusa_runtime, or rebuild the artifact with this version")
            raise ArtifactError(f"format_version {version!r} is not supported (this runtime reads version {reads}): "
                                f"{advice}")
        return _decode(cls, doc, "")

    def checked(self) -> Manifest:
        """This manifest parsed back from its JSON text: checks a manifest built in code (the constructors do
        not check types) and turns tuples into lists.

        Raises:
            ArtifactError: a missing or mistyped key.
        """
        return Manifest.from_json(json.loads(json.dumps(self.to_json())))

    # -- what readers ask of it ---------------------------------------------------------------------------

    @property
    def head_type(self) -> str:
        """"medusa" (also when there is no ``heads`` entry) or "hydra".

        Raises:
            ArtifactError: an unknown type.
        """
        kind = (self.heads.type if self.heads is not None else None) or HEAD_TYPES[0]
        if kind not in HEAD_TYPES:
            raise ArtifactError(f"unknown heads.type {kind!r}; this runtime reads {', '.join(HEAD_TYPES)}")
        return kind

    @property
    def layout(self) -> str:
        """The KV layout name (``kv_layout.layout``; absent = "sequence-major").

        Raises:
            ArtifactError: an unknown layout name.
        """
        layout = self.kv_layout.layout if self.kv_layout is not None else KV_LAYOUTS[0]
        if layout not in KV_LAYOUTS:
            raise ArtifactError(f"unknown kv_layout.layout {layout!r}; this runtime reads {', '.join(KV_LAYOUTS)}")
        return layout

    @property
    def precision_name(self) -> str:
        """``precision.name`` ("" when absent)."""
        return self.precision.name if self.precision is not None else ""

    def total_bytes(self) -> int:
        """Sum of the sizes of every checksummed file."""
        return sum(c.bytes for c in self.checksums.values())

    def merged(self, patch: dict, checksums: dict[str, dict] | None = None) -> Manifest:
        """A new manifest with ``patch``'s top-level keys set (a dict value merged one level deep into an
        existing dict, e.g. ``{"engines": {"fp16": {...}}}`` keeps other precisions) and ``checksums``
        added or replaced.

        Raises:
            ArtifactError: the result is not a valid manifest.
        """
        doc = self.to_json()
        for key, value in patch.items():
            old = doc.get(key)
            doc[key] = {**old, **value} if isinstance(value, dict) and isinstance(old, dict) else value
        doc["checksums"] = {**doc["checksums"], **(checksums or {})}
        return Manifest.from_json(doc)


def as_manifest(manifest: Manifest | dict) -> Manifest:
    """``manifest`` itself, or the :class:`Manifest` of a manifest document."""
    return manifest if isinstance(manifest, Manifest) else Manifest.from_json(manifest)


# -- the machinery: JSON <-> dataclasses, JSON Schema --------------------------------------------------------


def _hints(cls) -> dict:
    cached = _HINTS.get(cls)
    if cached is None:
        cached = _HINTS[cls] = typing.get_type_hints(cls)
    return cached


_HINTS: dict = {}
_JSON_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false", list: "an array",
               dict: "an object"}


def _optional(tp) -> bool:
    return _is_union(tp) and type(None) in typing.get_args(tp)


def _is_union(tp) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def _encode(value):
    if isinstance(value, Section):
        return value.to_json()
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    return value


def _outer(tp):
    """The Python type a JSON value of annotation ``tp`` parses to (Section -> dict, list[X] -> list)."""
    if tp is Any:
        return object
    if isinstance(tp, type) and issubclass(tp, Section):
        return dict
    return typing.get_origin(tp) or tp


def _fits(tp, value) -> bool:
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, tp)


def _decode(tp, value, where: str):
    if tp is Any:
        return value
    if _is_union(tp):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None and len(args) < len(typing.get_args(tp)):
            return None
        for a in args:
            if _fits(_outer(a), value):
                return _decode(a, value, where)
        raise ArtifactError(f"manifest key {where!r} must be {' or '.join(_JSON_NAMES.get(_outer(a), 'a value') for a in args)}, "
                            f"got {json_type(value)}")
    origin = typing.get_origin(tp)
    if origin is list:
        if not isinstance(value, list):
            raise ArtifactError(f"manifest key {where!r} must be an array, got {json_type(value)}")
        (item,) = typing.get_args(tp)
        return [_decode(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ArtifactError(f"manifest key {where!r} must be an object, got {json_type(value)}")
        if tp is dict:
            return value
        _, item = typing.get_args(tp)
        return {k: _decode(item, v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(tp, type) and issubclass(tp, Section):
        if not isinstance(value, dict):
            raise ArtifactError(f"manifest key {where!r} must be an object, got {json_type(value)}")
        hints, kwargs = _hints(tp), {}
        declared = set()
        for f in dataclasses.fields(tp):
            if f.metadata.get("extra"):
                continue
            declared.add(f.name)
            path = f"{where}.{f.name}" if where else f.name
            if f.name not in value:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise ArtifactError(f"missing key {path!r}")
                continue
            kwargs[f.name] = _decode(hints[f.name], value[f.name], path)
        return tp(**kwargs, extra={k: v for k, v in value.items() if k not in declared}, key_order=tuple(value))
    if not _fits(tp, value):
        raise ArtifactError(f"manifest key {where!r} must be {_JSON_NAMES.get(tp, tp.__name__)}, got {json_type(value)}")
    return value


def json_type(value) -> str:
    """The JSON type name of a parsed value (for messages)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    for t, name in ((int, "an integer"), (float, "a number"), (str, "a string"), (list, "an array"),
                    (dict, "an object")):
        if isinstance(value, t):
            return f"{name} ({value!r})" if t in (int, float, str) else name
    return type(value).__name__


def _schema(tp, defs: dict) -> dict:
    if tp is Any:
        return {}
    if _is_union(tp):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _schema(args[0], defs) if len(args) == 1 else {"anyOf": [_schema(a, defs) for a in args]}
    origin = typing.get_origin(tp)
    if origin is list:
        return {"type": "array", "items": _schema(typing.get_args(tp)[0], defs)}
    if tp is dict:
        return {"type": "object"}
    if origin is dict:
        return {"type": "object", "additionalProperties": _schema(typing.get_args(tp)[1], defs)}
    if isinstance(tp, type) and issubclass(tp, Section):
        if tp.__name__ not in defs:
            defs[tp.__name__] = None  # reserve: recursion and order
            defs[tp.__name__] = _object_schema(tp, defs)
        return {"$ref": f"#/$defs/{tp.__name__}"}
    return {"type": {bool: "boolean", int: "integer", float: "number", str: "string"}[tp]}


def _object_schema(cls, defs: dict) -> dict:
    hints, props, required = _hints(cls), {}, []
    for f in dataclasses.fields(cls):
        if f.metadata.get("extra"):
            continue
        props[f.name] = {**_schema(hints[f.name], defs), **({"description": f.metadata["doc"]}
                                                            if "doc" in f.metadata else {})}
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            required.append(f.name)
    return {"type": "object", "description": (cls.__doc__ or "").strip().split("\n\n")[0].replace("\n", " "),
            "properties": props, "required": required, "additionalProperties": True}


def schema_text() -> str:
    """The JSON Schema as written into every artifact (``manifest.schema.json``) and docs/manifest.schema.json."""
    return json.dumps(json_schema(), indent=2) + "\n"


def json_schema() -> dict:
    """The JSON Schema (draft 2020-12) of ``manifest.json``, derived from :class:`Manifest`.

    Optional keys are those an artifact of a supported version may lack; unknown keys are allowed
    (``additionalProperties``: true) because readers preserve them (module docstring).
    """
    defs: dict = {}
    root = _object_schema(Manifest, defs)
    root["properties"]["format"] = {**root["properties"]["format"], "const": ARTIFACT_FORMAT}
    root["properties"]["format_version"] = {**root["properties"]["format_version"], "enum": list(SUPPORTED_VERSIONS)}
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": SCHEMA_ID,
            "title": "medusa-export artifact manifest", **root, "$defs": dict(sorted(defs.items()))}
