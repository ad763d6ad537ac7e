"""Will TensorRT's ONNX parser take this artifact? A check that needs no TensorRT.

Checks each graph of an artifact against the parser of the targeted TensorRT release
(the op table in ``trt/onnx_ops_trt10.json``, condensed from onnx-tensorrt's
``docs/operators.md``):

* opset: the default-domain opset lies in the release's supported range;
* ops: every (domain, op type), subgraphs and local functions included, is one the parser
  supports; the types of its inputs are ones it lists (a mismatch is a warning: the
  parser may still insert casts); the few restrictions that can be read from the graph
  (constant ``axes`` / ``K``, TopK ``sorted``, ScatterND ``reduction``, zero points);
* shapes: with the tree step's profile applied (S = T), every output shape is static and
  only the past length P stays dynamic in the inputs;
* weights: every external-data location is a relative path inside the artifact, exists,
  and covers the recorded offset and length (nothing depends on the working directory);
* Q/DQ: every QuantizeLinear / DequantizeLinear against TensorRT's explicit-quantization rules of each
  major (:data:`QDQ_RULES`, :func:`check_qdq`): quantized types, scale shapes and axes, block sizes, zero
  points, constant scales, and fp8's compute capability;
* flavour: an ``ort-contrib`` artifact (weight-only MatMulNBits graphs, ONNX Runtime only) or
  an ``ort-fused`` one (step graph of ONNX Runtime fused contrib ops, head-major KV written in
  place) fails with that reason first, before the op-by-op findings.

Errors mean the parser (or the runtime's fixed-shape plan) would fail; warnings do not
block a build.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path, PurePosixPath

import onnx
from onnx import shape_inference

from medusa_runtime.contract.manifest import MANIFEST, Manifest, as_manifest

from ..export.precisions import Column

TARGET = "10.15"
#: The majors whose Q/DQ rules every artifact is checked against (:data:`QDQ_RULES`).
QDQ_MAJORS = ("10", "11")
#: The precisions whose artifacts TensorRT can run (the table's portable ones), for the flavour errors.
TENSORRT_PRECISIONS = Column("name", tensorrt=True)
#: ONNX elem type -> the type names the op table uses.
_TRT_TYPE = {
    onnx.TensorProto.FLOAT: "FP32", onnx.TensorProto.FLOAT16: "FP16", onnx.TensorProto.BFLOAT16: "BF16",
    onnx.TensorProto.INT32: "INT32", onnx.TensorProto.INT64: "INT64", onnx.TensorProto.INT8: "INT8",
    onnx.TensorProto.UINT8: "UINT8", onnx.TensorProto.BOOL: "BOOL", onnx.TensorProto.DOUBLE: "DOUBLE",
    onnx.TensorProto.FLOAT8E4M3FN: "FP8", onnx.TensorProto.INT4: "INT4",
}
_REDUCE_OPS = ("ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax", "ReduceMean", "ReduceMin",
               "ReduceProd", "ReduceSum", "ReduceSumSquare")
_TOPK_MAX = 3840
#: Ops whose inputs after the first n are parameters (a constant axis, checked by the restrictions),
#: not tensors of the types the op table lists: their types are not compared with the table.
_TYPED_INPUTS = {"CumSum": 1, "QuantizeLinear": 1, "DequantizeLinear": 1}  # Q/DQ scales, zero points: check_qdq


@dataclass(frozen=True)
class QdqRules:
    """TensorRT's explicit-quantization rules of one major version, as far as they can be read off an ONNX graph.

    Sources: NvInfer.h's IQuantizeLayer / IDequantizeLayer comments (10.x: "scale must be a scalar for per-tensor
    quantization, a 1D tensor for per-channel quantization, or the same rank as the input tensor for block
    quantization"; "zeroPt must only contain zero-valued coefficients, because only symmetric quantization is
    supported"; "All scale coefficients must have strictly positive values"; "For block quantization, the shape of
    scale must match the shape of the input, except for one dimension (the last or second to last) in which blocking
    occurs"), the operator pages of TensorRT's documentation (docs.nvidia.com/deeplearning/tensorrt, operators
    Quantize / Dequantize: the scale is a build-time constant of type float32 / float16 / bfloat16; 10.0's page: block
    quantization "supported for DataType::kINT4 only"; the current page: kINT4, kFP4, kFP8 and kINT8), and the
    developer guide's "Working with Quantized Types" (INT8, INT4 weight-only, FP8 E4M3, FP4 E2M1; FP8 GEMMs on compute
    capability 8.9+).

    Attributes:
        major: "10" or "11".
        types: the quantized ONNX types this check accepts -> their name (FP4 is left out: never written here).
        weight_only: types only a DequantizeLinear of a constant may carry (INT4: weight-only).
        blocked: types whose scale may be blocked (same rank as the input).
        block_sizes: the block sizes accepted along K (128 is the size TensorRT's and ModelOpt's INT4 AWQ examples
            use; 64 / 32 / 16 for a K that 128 does not divide).
        scale_types: the scale's ONNX types.
        min_compute_capability: per type, the oldest GPU that computes in it.
    """

    major: str
    types: dict
    weight_only: frozenset
    blocked: frozenset
    block_sizes: tuple = (128, 64, 32, 16)
    scale_types: frozenset = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16})
    min_compute_capability: tuple = ((onnx.TensorProto.FLOAT8E4M3FN, (8, 9)),)


_Q_TYPES = {onnx.TensorProto.INT8: "int8", onnx.TensorProto.FLOAT8E4M3FN: "fp8 E4M3", onnx.TensorProto.INT4: "int4"}
#: Per major: 10 blocks INT4 only (10.0's Dequantize page), 11 (the current pages) INT4, FP8 and INT8 too; both take
#: INT4 weight-only and symmetric (zero) zero points only.
QDQ_RULES = {
    "10": QdqRules("10", _Q_TYPES, frozenset({onnx.TensorProto.INT4}), frozenset({onnx.TensorProto.INT4})),
    "11": QdqRules("11", _Q_TYPES, frozenset({onnx.TensorProto.INT4}),
                   frozenset({onnx.TensorProto.INT4, onnx.TensorProto.INT8, onnx.TensorProto.FLOAT8E4M3FN})),
}


def _qtype(node: onnx.NodeProto, types: dict[str, int]) -> int:
    """The quantized type of a Q or DQ node: DQ's input; Q's zero point, else its ``output_dtype`` (opset 21), else
    UINT8 (ONNX's default)."""
    if node.op_type == "DequantizeLinear":
        return types.get(node.input[0], 0)
    if len(node.input) > 2 and node.input[2]:
        return types.get(node.input[2], 0)
    attrs = {a.name: a.i for a in node.attribute}
    return attrs.get("output_dtype", 0) or onnx.TensorProto.UINT8


def check_qdq(model: onnx.ModelProto, graph_name: str, major: str = "10",
              compute_capability: tuple[int, int] | None = None) -> list[Finding]:
    """Every QuantizeLinear / DequantizeLinear of ``model`` against :data:`QDQ_RULES` of ``major``.

    Args:
        model: the ONNX model (external data not loaded: zero points are read when inline, shapes from the
            initializers' dims).
        graph_name: file name for messages.
        major: "10" or "11".
        compute_capability: the target GPU's (major, minor), or None when unknown (not checked).

    Returns:
        Errors naming the node, what it has and what TensorRT ``major`` takes.
    """
    from onnx import numpy_helper

    rules = QDQ_RULES[major]
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    consts = _constant_names(g)
    types = _types(model)
    out: list[Finding] = []

    def err(node, msg):
        out.append(Finding("error", graph_name, f"TensorRT {major}: {node.op_type} node {node.name or node.output[0]!r}: "
                                                f"{msg}"))

    for node in g.node:
        if node.op_type not in ("QuantizeLinear", "DequantizeLinear"):
            continue
        qt = _qtype(node, types)
        if qt not in rules.types:
            name = onnx.TensorProto.DataType.Name(qt) if qt else "an unknown type"
            err(node, f"quantizes to {name}; TensorRT {major} takes {', '.join(rules.types.values())}")
            continue
        if qt in rules.weight_only and (node.op_type == "QuantizeLinear" or node.input[0] not in consts):
            err(node, f"{rules.types[qt]} is weight-only in TensorRT: only a DequantizeLinear of a constant weight may "
                      "carry it")
        scale = node.input[1]
        if scale not in consts:
            err(node, f"scale {scale!r} is computed at run time; TensorRT needs a build-time constant")
            continue
        st = types.get(scale, 0)
        if st and st not in rules.scale_types:
            err(node, f"scale type {onnx.TensorProto.DataType.Name(st)}; TensorRT takes FLOAT, FLOAT16 or BFLOAT16")
        attrs = {a.name: a.i for a in node.attribute}
        sdims = list(inits[scale].dims) if scale in inits else []
        xdims = list(inits[node.input[0]].dims) if node.input[0] in inits else None
        block = attrs.get("block_size", 0)
        if block or (xdims is not None and len(sdims) == len(xdims) and len(sdims) > 1):
            rank = len(xdims) if xdims is not None else len(sdims)
            axis = attrs.get("axis", 1) % max(rank, 1)
            if qt not in rules.blocked:
                err(node, f"blocked scales of {rules.types[qt]}; TensorRT {major} blocks only "
                          f"{', '.join(rules.types[t] for t in rules.blocked)} (per-tensor or per-channel otherwise)")
            elif axis not in (rank - 1, rank - 2):
                err(node, f"blocked along axis {axis}; TensorRT blocks the last or second to last dimension")
            elif block not in rules.block_sizes:
                err(node, f"block size {block}; this check accepts {', '.join(map(str, rules.block_sizes))}")
            elif xdims is not None and (xdims[axis] % block or sdims[axis] != xdims[axis] // block
                                        or any(s != x for i, (s, x) in enumerate(zip(sdims, xdims)) if i != axis)):
                err(node, f"scale shape {sdims} does not block input {xdims} by {block} along axis {axis}")
        elif len(sdims) > 1:
            err(node, f"scale of shape {sdims}: TensorRT takes a scalar (per tensor), a 1-D tensor (per channel) or, "
                      f"for {', '.join(rules.types[t] for t in rules.blocked)}, a blocked one of the input's rank")
        elif len(sdims) == 1 and sdims[0] != 1 and xdims is not None:
            axis = attrs.get("axis", 1) % len(xdims)
            if xdims[axis] != sdims[0]:
                err(node, f"per-channel scale of {sdims[0]} values along axis {axis} of an input of shape {xdims}")
        if len(node.input) > 2 and node.input[2]:
            zp = inits.get(node.input[2])
            if zp is None:
                err(node, f"zero point {node.input[2]!r} is not a constant; TensorRT takes none or zeros")
            elif zp.data_location != onnx.TensorProto.EXTERNAL:
                if list(zp.dims) != sdims:
                    err(node, f"zero point of shape {list(zp.dims)} beside a scale of shape {sdims}; they must match")
                elif zp.raw_data.strip(b"\0") if zp.raw_data else np_nonzero(numpy_helper.to_array(zp)):
                    err(node, "zero point holds non-zero values; TensorRT quantization is symmetric (zeros only)")
        for t, need in rules.min_compute_capability:
            if qt == t and compute_capability is not None and tuple(compute_capability) < need:
                err(node, f"{rules.types[qt]} needs compute capability {need[0]}.{need[1]}+, the target GPU has "
                          f"{compute_capability[0]}.{compute_capability[1]}")
    return out


def np_nonzero(arr) -> bool:
    """Whether an array (of any ONNX type numpy_helper returns) holds a non-zero value."""
    import numpy as np

    return bool(np.any(np.asarray(arr).astype(np.float32) != 0))


@dataclass(frozen=True)
class OpTable:
    """The ONNX parser's operator support of one TensorRT release."""

    tensorrt: str
    opset: tuple[int, int]
    supported: dict[str, frozenset[str]]  # op type -> tensor types
    unsupported: frozenset[str]
    notes: dict[str, str]


@lru_cache(maxsize=None)
def load_op_table(version: str = TARGET) -> OpTable:
    """The shipped op table, with the opset range of ``version``.

    Raises:
        ValueError: no opset range is recorded for ``version``.
    """
    data = json.loads(resources.files("medusa_export.trt").joinpath("onnx_ops_trt10.json").read_text())
    if version not in data["opset"]:
        raise ValueError(f"no ONNX parser data for TensorRT {version}; known: {', '.join(data['opset'])}")
    lo, hi = data["opset"][version]
    return OpTable(version, (lo, hi), {k: frozenset(v.split()) for k, v in data["supported"].items()},
                   frozenset(data["unsupported"]), data["notes"])


@dataclass(frozen=True)
class Finding:
    """One problem: ``level`` is "error" or "warning"; ``graph`` the file it was found in."""

    level: str
    graph: str
    message: str

    def __str__(self) -> str:
        return f"{self.graph}: {self.message}"


@dataclass
class ReadinessReport:
    """Result of :func:`check_artifact`; ``to_json`` is what the manifest stores."""

    tensorrt: str
    opset_range: tuple[int, int]
    findings: list[Finding] = field(default_factory=list)
    graphs: dict[str, dict] = field(default_factory=dict)

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "warning"]

    @property
    def passed(self) -> bool:
        return not self.errors

    def summary(self) -> str:
        """One line for the build summary."""
        n_ops = len({op for g in self.graphs.values() for op in g["op_types"]})
        head = (f"TensorRT {self.tensorrt} readiness: {'PASSED' if self.passed else 'FAILED'} "
                f"({n_ops} op types, opset {'/'.join(str(g['opset']) for g in self.graphs.values())}"
                f"; parser range {self.opset_range[0]}-{self.opset_range[1]})")
        if self.errors:
            head += f"; {len(self.errors)} error(s), first: {self.errors[0]}"
        elif self.warnings:
            head += f"; {len(self.warnings)} warning(s)"
        return head

    def to_json(self) -> dict:
        return {"tensorrt": self.tensorrt, "source": "onnx-tensorrt docs/operators.md", "passed": self.passed,
                "opset_range": list(self.opset_range), "graphs": self.graphs,
                "errors": [str(f) for f in self.errors], "warnings": [str(f) for f in self.warnings]}


def _nodes(graph: onnx.GraphProto):
    """Every node of ``graph`` and of its subgraphs (If/Loop/Scan bodies)."""
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _nodes(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from _nodes(g)


def _is_default_domain(domain: str) -> bool:
    return domain in ("", "ai.onnx")


def _types(model: onnx.ModelProto) -> dict[str, int]:
    """Tensor name -> ONNX elem type, from the graph's declarations and shape inference."""
    try:
        model = shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:  # noqa: BLE001 - types are advisory; the op check does not need them
        pass
    g = model.graph
    out = {t.name: t.data_type for t in g.initializer}
    for vi in (*g.input, *g.output, *g.value_info):
        if vi.type.HasField("tensor_type"):
            out[vi.name] = vi.type.tensor_type.elem_type
    for n in g.node:
        if n.op_type == "Constant":
            for a in n.attribute:
                if a.name == "value":
                    out[n.output[0]] = a.t.data_type
    return out


def _constant_names(graph: onnx.GraphProto) -> set[str]:
    names = {t.name for t in graph.initializer}
    names.update(n.output[0] for n in graph.node if n.op_type == "Constant")
    return names


def _check_restrictions(node: onnx.NodeProto, consts: set[str], where: str, graph_name: str) -> list[Finding]:
    """The op table's restrictions that can be read off the graph."""
    errs = []

    def err(msg: str) -> None:
        errs.append(Finding("error", graph_name, f"{node.op_type} node {where}: {msg}"))

    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    if node.op_type in _REDUCE_OPS or node.op_type in ("Squeeze", "Unsqueeze"):
        if len(node.input) > 1 and node.input[1] and node.input[1] not in consts:
            err(f"axes input {node.input[1]!r} is computed at run time; TensorRT needs a constant")
    elif node.op_type == "CumSum" and node.input[1] not in consts:
        err(f"axis input {node.input[1]!r} is computed at run time; TensorRT needs a constant")
    elif node.op_type == "TopK":
        if attrs.get("sorted", 1) != 1:
            err("sorted=0 is not supported")
        if node.input[1] not in consts:
            err(f"K input {node.input[1]!r} is not a constant")
    elif node.op_type == "ScatterND" and attrs.get("reduction", b"none") not in (b"none", "none"):
        err(f"reduction={attrs['reduction']!r} is not supported (only 'none')")
    return errs


def _topk_values(graph: onnx.GraphProto) -> dict[str, int]:
    """Constant K values of TopK nodes (by K input name)."""
    from onnx import numpy_helper

    vals = {}
    tensors = {t.name: t for t in graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL}
    for n in graph.node:
        if n.op_type == "Constant":
            for a in n.attribute:
                if a.name == "value":
                    tensors[n.output[0]] = a.t
    for n in graph.node:
        if n.op_type == "TopK" and n.input[1] in tensors:
            vals[n.name or n.output[0]] = int(numpy_helper.to_array(tensors[n.input[1]]).reshape(-1)[0])
    return vals


def check_ops(model: onnx.ModelProto, graph_name: str, table: OpTable | None = None) -> tuple[list[Finding], dict]:
    """Opset, op support, input types and readable restrictions of one model.

    Args:
        model: the ONNX model (external data need not be loaded).
        graph_name: the file name used in messages.
        table: the parser's op table (default: :data:`TARGET`'s).

    Returns:
        (findings, info) where info = {"opset", "nodes", "op_types"}.
    """
    table = table or load_op_table()
    findings: list[Finding] = []
    opset = next((o.version for o in model.opset_import if _is_default_domain(o.domain)), None)
    lo, hi = table.opset
    if opset is None:
        findings.append(Finding("error", graph_name, "no default-domain opset import"))
    elif not lo <= opset <= hi:
        findings.append(Finding("error", graph_name, f"opset {opset} is outside TensorRT {table.tensorrt}'s "
                                                     f"supported range {lo}-{hi}"))
    local_funcs = {(f.domain, f.name): f for f in model.functions}
    nodes = list(_nodes(model.graph))
    for f in model.functions:
        nodes.extend(f.node)
    types = _types(model)
    consts = _constant_names(model.graph)
    bad_ops: dict[str, list[str]] = {}
    type_warned: set[tuple[str, str]] = set()
    for n in nodes:
        where = repr(n.name or n.output[0])
        if (n.domain, n.op_type) in local_funcs:
            continue  # a local function: the parser inlines it; its body's nodes are checked above
        if not _is_default_domain(n.domain):
            bad_ops.setdefault(f"{n.domain}::{n.op_type} (custom domain: needs a TensorRT plugin)", []).append(where)
            continue
        if n.op_type in table.unsupported or n.op_type not in table.supported:
            bad_ops.setdefault(n.op_type, []).append(where)
            continue
        findings.extend(_check_restrictions(n, consts, where, graph_name))
        allowed = table.supported[n.op_type]
        for name in n.input[:_TYPED_INPUTS.get(n.op_type)]:
            t = _TRT_TYPE.get(types.get(name, 0), None) if name in types else None
            if t and t not in allowed and (n.op_type, t) not in type_warned:
                type_warned.add((n.op_type, t))
                findings.append(Finding("warning", graph_name,
                                        f"{n.op_type} node {where} takes {t} input {name!r}; the parser lists "
                                        f"{', '.join(sorted(allowed))}"))
    for op, where in sorted(bad_ops.items()):
        more = f" and {len(where) - 3} more" if len(where) > 3 else ""
        findings.append(Finding("error", graph_name, f"unsupported op {op} ({len(where)} node(s): "
                                                     f"{', '.join(where[:3])}{more}) is not in TensorRT "
                                                     f"{table.tensorrt}'s ONNX parser"))
    for name, k in _topk_values(model.graph).items():
        if k >= _TOPK_MAX:
            findings.append(Finding("error", graph_name, f"TopK node {name!r} has K={k}; TensorRT needs K < {_TOPK_MAX}"))
    ops = sorted({n.op_type if _is_default_domain(n.domain) else f"{n.domain}::{n.op_type}" for n in nodes})
    return findings, {"opset": opset, "nodes": len(nodes), "op_types": ops}


def _dims(vi: onnx.ValueInfoProto) -> list:
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in vi.type.tensor_type.shape.dim]


def check_fixed_shapes(model: onnx.ModelProto, graph_name: str, fixed: dict[str, int],
                       dynamic: tuple[str, ...]) -> list[Finding]:
    """With ``fixed`` dims bound, inputs may vary only in ``dynamic`` dims and outputs must be static.

    The outputs' declared shapes are dropped and re-inferred (ONNX shape inference with
    data propagation) from the bound inputs, so a dim that secretly depends on P is caught.

    Args:
        model: the ONNX model (external data need not be loaded; it is copied, not changed).
        graph_name: file name for messages.
        fixed: symbol -> value, e.g. {"S": T} for the tree step.
        dynamic: symbols allowed to stay dynamic in inputs, e.g. ("P",).
    """
    findings = []
    m = onnx.ModelProto()
    m.CopyFrom(model)  # external weights are not loaded: a cheap copy; small constants feed data propagation
    for vi in m.graph.input:
        for d in vi.type.tensor_type.shape.dim:
            if d.HasField("dim_param") and d.dim_param in fixed:
                d.dim_value = fixed[d.dim_param]  # setting the value clears the oneof's dim_param
    for vi in model.graph.input:
        bad = [d for d in _dims(vi) if not isinstance(d, int) and d not in fixed and d not in dynamic]
        if bad:
            findings.append(Finding("error", graph_name, f"input {vi.name!r} has dynamic dims {bad}; with "
                                                         f"{fixed} bound only {'/'.join(dynamic)} may vary"))
    for vi in m.graph.output:
        vi.type.tensor_type.ClearField("shape")
    m.graph.ClearField("value_info")
    try:
        inferred = shape_inference.infer_shapes(m, strict_mode=False, data_prop=True)
    except Exception as exc:  # noqa: BLE001
        return findings + [Finding("warning", graph_name, f"shape inference failed ({exc}); output shapes not checked")]
    for vi in inferred.graph.output:
        dims = _dims(vi)
        if not vi.type.tensor_type.HasField("shape") or any(not isinstance(d, int) for d in dims):
            findings.append(Finding("error", graph_name, f"output {vi.name!r} has shape {dims} with "
                                                         f"{fixed} bound; it must be static"))
    return findings


def check_external_data(model: onnx.ModelProto, graph_name: str, folder: Path) -> list[Finding]:
    """External-data locations: relative, inside ``folder``, existing and long enough."""
    findings = []
    root = folder.resolve()
    sizes: dict[str, int | None] = {}
    for t in model.graph.initializer:
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in t.external_data}
        loc = info.get("location", "")
        if loc not in sizes:
            p = PurePosixPath(loc)
            target = (folder / loc).resolve()
            if not loc or p.is_absolute() or Path(loc).is_absolute():
                findings.append(Finding("error", graph_name, f"initializer {t.name!r} has an absolute or empty "
                                                             f"external-data location {loc!r}"))
                sizes[loc] = None
            elif root not in target.parents:
                findings.append(Finding("error", graph_name, f"external-data location {loc!r} points outside the artifact"))
                sizes[loc] = None
            elif not target.is_file():
                findings.append(Finding("error", graph_name, f"external-data file {loc!r} is missing"))
                sizes[loc] = None
            else:
                sizes[loc] = target.stat().st_size
        size = sizes[loc]
        if size is not None and int(info.get("offset", 0)) + int(info.get("length", 0)) > size:
            findings.append(Finding("error", graph_name, f"initializer {t.name!r} extends past the end of {loc!r}"))
    return findings


def check_artifact(path: str | Path, manifest: Manifest | dict | None = None, version: str = TARGET) -> ReadinessReport:
    """Run every check on an artifact's graphs.

    Args:
        path: the artifact directory (or a build's temporary folder).
        manifest: its manifest (read from ``path`` when None).
        version: the targeted TensorRT release.

    Returns:
        The report; ``passed`` is False when any error was found. An ``ort-contrib`` or ``ort-fused`` artifact gets one
        error naming its flavour and the build that TensorRT takes; its graphs' ops are not listed.
    """
    path = Path(path)
    manifest = as_manifest(manifest or json.loads((path / MANIFEST).read_text()))
    table = load_op_table(version)
    report = ReadinessReport(version, table.opset)
    name = manifest.precision_name
    if manifest.flavour == "ort-contrib":
        report.findings.append(Finding("error", "manifest.json", (
            f"this artifact's flavour is 'ort-contrib' (precision {name}, heads "
            f"{manifest.precision.heads or name}): its graphs use ONNX Runtime "
            "contrib ops (com.microsoft::MatMulNBits weight-only quantization) that TensorRT does not parse; it runs "
            f"on ONNX Runtime only. For TensorRT build the portable flavour: --graph portable --precision "
            f"{' or '.join(TENSORRT_PRECISIONS)} with --heads-precision auto/same (int8, fp8 and int4 there are "
            "standard Q/DQ graphs)")))
    elif manifest.flavour == "ort-fused":
        report.findings.append(Finding("error", "manifest.json", (
            f"this artifact's flavour is 'ort-fused' (precision {name}): its step graph is "
            "built from ONNX Runtime's own ops (com.microsoft::GroupQueryAttention, QuickGelu, "
            "SimplifiedLayerNormalization) that TensorRT does not parse, and its head-major KV cache is written in place; it runs on ONNX "
            "Runtime only. For TensorRT build the portable graph: --graph portable (the default) with --precision "
            f"{' or '.join(TENSORRT_PRECISIONS)}")))
    if report.findings:  # a flavour TensorRT cannot take: one error; an op-by-op list of its ONNX Runtime ops adds nothing
        return report
    tree_size = manifest.tree.size
    for key in ["model", *(k for k in manifest.graphs if k.startswith("heads"))]:
        rel = manifest.graphs[key].file
        model = onnx.load(str(path / rel), load_external_data=False)
        findings, info = check_ops(model, rel, table)
        findings += check_external_data(model, rel, path)
        for major in QDQ_MAJORS:
            findings += check_qdq(model, rel, major)
        if key == "model":  # the tree step: S = T fixed (a batched graph: B at its built size), only P varies
            fixed = {"S": tree_size, **({"B": manifest.batch.max_batch_size} if manifest.batch else {})}
            findings += check_fixed_shapes(model, rel, fixed, ("P",))
            info["tree_step"] = f"static with {', '.join(f'{k}={v}' for k, v in fixed.items())}; P dynamic"
        report.findings += findings
        report.graphs[key] = info
    return report
