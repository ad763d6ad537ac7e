"""The in-graph sampler (docs/sampling.md, step contract ``step_sampler`` version 1) in ONNX, grafted
onto a built artifact's step graph: the reference the exporter's graph writers follow, and what the
tests run the runtime's ``sampled_ids`` path on until the exporter writes it itself.

The nodes read the step's own ``LogSoftmax`` output (log-probabilities at ``temperature``,
[1, S, V]) and add three inputs and one output:

    sample_uniforms float32 [1, S]   row i's uniform in [0, 1); < 0: row i is not sampled
    sample_top_k    int64   [1]      -1 = sampler off; 0 = the whole vocabulary; k > 0 = top-k
    sample_top_p    float32 [1]      (0, 1]; 1 = off
    sampled_ids     int64   [1, S]   row i's token (-1 when the sampler is off or the row not sampled)

The sampler is the then-branch of an ``If(sample_top_k >= 0)``: ONNX Runtime runs every node of a
graph whatever outputs are fetched, so a sampler outside a branch would cost every step (greedy
ones too); inside, an off step pays one comparison. Rows with a negative uniform are left out
before any work (a prefill samples its last row only). The branch computes, per sampled row:

    p      = Exp(logp)                                            # [1, S, V]
    k      = min(top_k, V) if top_k > 0 else (V if top_p < 1 else 1)
    top    = TopK(p, k) values, descending                        # only what the threshold needs
    tau_k  = min(top) if top_k > 0 else 0                         # transformers' top-k: p >= k-th value
    q      = top / sum(top);  keep = CumSum(q) - q < top_p        # transformers' top-p inside the top-k
    tau_p  = min(top where keep) if top_p < 1 else 0
    kept   = p >= max(tau_k, tau_p)                               # [1, S, V]
    c      = CumSum(Where(kept, p, 0)) over the vocabulary, in id order
    sampled_ids = min(count(c <= u * c[V - 1]), the largest kept id)

So the common settings cost a few passes over the vocabulary and a small TopK; only top_k 0 with
top_p < 1 sorts the whole vocabulary (TopK with k = V: ~8 ms per row at V = 49152 on ONNX
Runtime's CPU TopK; an exporter may find tau_p by bisection instead, the result is defined above).
Only onnx.helper; standard opset-18 ops.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from medusa_runtime.artifact import MANIFEST, sha256_file

SAMPLER_INPUTS = [
    {"name": "sample_uniforms", "dtype": "float32", "shape": [1, "S"],
     "meaning": "row i's uniform in [0, 1) for the inverse-CDF draw of sampled_ids[0, i]; < 0: row i not sampled"},
    {"name": "sample_top_k", "dtype": "int64", "shape": [1],
     "meaning": "top-k of the draw; 0 = the whole vocabulary; -1 = sampler off (skipped; sampled_ids all -1)"},
    {"name": "sample_top_p", "dtype": "float32", "shape": [1], "meaning": "top-p inside the top-k, in (0, 1]; 1 = off"},
]
SAMPLER_OUTPUTS = [
    {"name": "sampled_ids", "dtype": "int64", "shape": [1, "S"],
     "meaning": "a token drawn at each row from softmax(logits / temperature) truncated by top-k then top-p, by "
                "inverse CDF over the kept tokens in increasing id order with sample_uniforms"},
]


def sampler_nodes(logp: str, uniforms: str, token: str) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """The sampler's nodes: ``logp`` float32 [1, R, V] (or [R, V]) and ``uniforms`` float32 [R] -> ``token``
    int64 [R]; and its constants (names prefixed ``sampler/``)."""
    n = lambda name: f"sampler/{name}"  # noqa: E731
    c = lambda name, value: numpy_helper.from_array(np.asarray(value), n(name))  # noqa: E731
    consts = [c("zero_i", np.array([0], np.int64)), c("one_i", np.array([1], np.int64)),
              c("zero_f", np.array(0.0, np.float32)), c("one_f", np.array([1.0], np.float32)),
              c("inf_f", np.array(np.inf, np.float32)), c("last_axis", np.array(-1, np.int64)),
              c("last_axes", np.array([-1], np.int64)), c("zero_s", np.array(0, np.int64)),
              c("one_s", np.array(1, np.int64))]
    nodes = [
        helper.make_node("Exp", [logp], [n("p")]),
        helper.make_node("Shape", [logp], [n("v")], start=-1),
        # k of the threshold's TopK
        helper.make_node("Greater", ["sample_top_k", n("zero_i")], [n("k_given")]),
        helper.make_node("Less", ["sample_top_p", n("one_f")], [n("p_given")]),
        helper.make_node("Min", ["sample_top_k", n("v")], [n("k_capped")]),
        helper.make_node("Where", [n("p_given"), n("v"), n("one_i")], [n("k_for_p")]),
        helper.make_node("Where", [n("k_given"), n("k_capped"), n("k_for_p")], [n("k")]),
        helper.make_node("TopK", [n("p"), n("k")], [n("top"), n("top_ids")], axis=-1, largest=1, sorted=1),
        # tau_k: the k-th value (top-k), 0 without top-k
        helper.make_node("ReduceMin", [n("top"), n("last_axes")], [n("kth")], keepdims=1),
        helper.make_node("Where", [n("k_given"), n("kth"), n("zero_f")], [n("tau_k")]),
        # tau_p: the smallest probability top-p keeps inside the top-k, 0 without top-p
        helper.make_node("ReduceSum", [n("top"), n("last_axes")], [n("top_mass")], keepdims=1),
        helper.make_node("Div", [n("top"), n("top_mass")], [n("q")]),
        helper.make_node("CumSum", [n("q"), n("last_axis")], [n("q_cum")]),
        helper.make_node("Sub", [n("q_cum"), n("q")], [n("before")]),
        helper.make_node("Less", [n("before"), "sample_top_p"], [n("in_nucleus")]),
        helper.make_node("Where", [n("in_nucleus"), n("top"), n("inf_f")], [n("nucleus")]),
        helper.make_node("ReduceMin", [n("nucleus"), n("last_axes")], [n("smallest_kept")], keepdims=1),
        helper.make_node("Where", [n("p_given"), n("smallest_kept"), n("zero_f")], [n("tau_p")]),
        # the kept set over the vocabulary, and the inverse CDF in id order
        helper.make_node("Max", [n("tau_k"), n("tau_p")], [n("tau")]),
        helper.make_node("GreaterOrEqual", [n("p"), n("tau")], [n("kept")]),
        helper.make_node("Where", [n("kept"), n("p"), n("zero_f")], [n("p_kept")]),
        helper.make_node("CumSum", [n("p_kept"), n("last_axis")], [n("cdf")]),
        helper.make_node("ReduceMax", [n("cdf"), n("last_axes")], [n("total")], keepdims=1),
        helper.make_node("Shape", [logp], [n("rows")], end=-1),  # [1, S] (or [S] in a graph without the batch axis)
        helper.make_node("Concat", [n("rows"), n("one_i")], [n("u_shape")], axis=0),
        helper.make_node("Reshape", [uniforms, n("u_shape")], [n("u")]),
        helper.make_node("Mul", [n("u"), n("total")], [n("target")]),
        helper.make_node("LessOrEqual", [n("cdf"), n("target")], [n("below")]),
        helper.make_node("Cast", [n("below")], [n("below_i")], to=TensorProto.INT64),
        helper.make_node("ReduceSum", [n("below_i"), n("last_axes")], [n("count")], keepdims=1),
        helper.make_node("Squeeze", [n("v"), n("zero_i")], [n("v_s")]),
        helper.make_node("Range", [n("zero_s"), n("v_s"), n("one_s")], [n("ids")]),
        helper.make_node("Cast", [n("kept")], [n("kept_i")], to=TensorProto.INT64),
        helper.make_node("Mul", [n("kept_i"), n("ids")], [n("kept_ids")]),
        helper.make_node("ReduceMax", [n("kept_ids"), n("last_axes")], [n("last_kept")], keepdims=1),
        helper.make_node("Min", [n("count"), n("last_kept")], [n("token")]),
        helper.make_node("Reshape", [n("token"), n("last_axes")], [token]),
    ]
    return nodes, consts


def sampler_if(logp: str) -> list[onnx.NodeProto]:
    """``sampled_ids = If(sample_top_k >= 0, then: the sampler on the rows whose uniform is >= 0, -1 on the
    others; else: -1 everywhere)``."""
    n = lambda name: f"sampler/{name}"  # noqa: E731
    core, consts = sampler_nodes(n("logp_rows"), n("u_rows"), n("tokens"))
    consts += [numpy_helper.from_array(np.array([-1], np.int64), n("flat")),
               numpy_helper.from_array(np.array(0.0, np.float32), n("zero_u"))]
    rows = [
        helper.make_node("Reshape", ["sample_uniforms", n("flat")], [n("u_all")]),  # [S]
        helper.make_node("GreaterOrEqual", [n("u_all"), n("zero_u")], [n("wanted")]),
        helper.make_node("NonZero", [n("wanted")], [n("nz")]),
        helper.make_node("Reshape", [n("nz"), n("flat")], [n("sel")]),  # [R] the rows to sample
        helper.make_node("Gather", [logp, n("sel")], [n("logp_rows")], axis=-2),
        helper.make_node("Gather", [n("u_all"), n("sel")], [n("u_rows")], axis=0),
    ]
    scatter = [
        helper.make_node("Shape", [n("u_all")], [n("s")]),
        helper.make_node("ConstantOfShape", [n("s")], [n("none")], value=numpy_helper.from_array(np.array([-1], np.int64))),
        helper.make_node("ScatterElements", [n("none"), n("sel"), n("tokens")], [n("ids_flat")], axis=0),
        helper.make_node("Shape", ["sample_uniforms"], [n("out_shape")]),
        helper.make_node("Reshape", [n("ids_flat"), n("out_shape")], ["sampled_ids"]),
    ]
    out = helper.make_tensor_value_info("sampled_ids", TensorProto.INT64, None)
    then = helper.make_graph(rows + core + scatter, "sampler_on", [], [out], consts)
    off = helper.make_graph(
        [helper.make_node("Shape", ["sample_uniforms"], ["sampler_off/shape"]),
         helper.make_node("ConstantOfShape", ["sampler_off/shape"], ["sampled_ids"],
                          value=numpy_helper.from_array(np.array([-1], np.int64)))],
        "sampler_off", [], [out])
    zero = helper.make_node("Constant", [], ["sampler/zero_k"], value=numpy_helper.from_array(np.array([0], np.int64)))
    on = helper.make_node("GreaterOrEqual", ["sample_top_k", "sampler/zero_k"], ["sampler/on"])
    return [zero, on, helper.make_node("If", ["sampler/on"], ["sampled_ids"], then_branch=then, else_branch=off)]


def _value_info(t: dict) -> onnx.ValueInfoProto:
    dtype = {"float32": TensorProto.FLOAT, "int64": TensorProto.INT64}[t["dtype"]]
    return helper.make_tensor_value_info(t["name"], dtype, t["shape"])


def graft_sampler(artifact: str | Path, out: str | Path) -> Path:
    """A copy of ``artifact`` whose step graph has the in-graph sampler and whose manifest says so.

    Args:
        artifact: a built artifact (portable or fused step graph with one LogSoftmax).
        out: the new artifact folder (replaced).

    Returns:
        ``out``.
    """
    src, out = Path(artifact), Path(out)
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(src, out)
    manifest = json.loads((out / MANIFEST).read_text())
    model_file = manifest["files"]["model"]
    model = onnx.load(str(out / model_file), load_external_data=False)
    (logsoftmax,) = [node for node in model.graph.node if node.op_type == "LogSoftmax"]
    model.graph.node.extend(sampler_if(logsoftmax.output[0]))
    model.graph.input.extend(_value_info(t) for t in SAMPLER_INPUTS)
    model.graph.output.extend(_value_info(t) for t in SAMPLER_OUTPUTS)
    onnx.save(model, str(out / model_file))
    graph = manifest["graphs"]["model"]
    graph["inputs"] += SAMPLER_INPUTS
    graph["outputs"] += SAMPLER_OUTPUTS
    manifest["step_sampler"] = {"version": 1, "spec": "docs/sampling.md"}
    manifest["checksums"][model_file] = {"sha256": sha256_file(out / model_file),
                                         "bytes": (out / model_file).stat().st_size}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return out
