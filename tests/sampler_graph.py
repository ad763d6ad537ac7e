"""The in-graph sampler (docs/sampling.md, step contract ``step_sampler`` version 1) in ONNX, grafted
onto a built artifact's step graph: the reference the exporter's graph writers follow, and what the
tests run the runtime's ``sampled_ids`` path on until the exporter writes it itself.

The nodes read the step's own ``LogSoftmax`` output (log-probabilities at ``temperature``,
[1, S, V]) and add three inputs and one output:

    sample_uniforms float32 [1, S]   row i's uniform in [0, 1)
    sample_top_k    int64   [1]      0 = the whole vocabulary
    sample_top_p    float32 [1]      (0, 1]; 1 = off
    sampled_ids     int64   [1, S]   row i's token

    k       = top_k if 0 < top_k < V else V
    lp, ids = TopK(logp, k, largest, sorted)          # descending; ties: the lower id first
    p       = Softmax(lp)                             # renormalised top-k
    keep    = CumSum(p) - p < top_p                   # the mass before a token (top-p, the best always kept)
    c       = CumSum(Where(keep, p, 0))
    col     = min(count(c <= u * c[-1]), count(keep) - 1)
    sampled_ids = ids[col]

Only onnx.helper; standard opset-18 ops (TopK with a tensor k, CumSum, GatherElements).
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
     "meaning": "row i's uniform in [0, 1) for the inverse-CDF draw of sampled_ids[0, i]"},
    {"name": "sample_top_k", "dtype": "int64", "shape": [1], "meaning": "top-k of the draw; 0 = the whole vocabulary"},
    {"name": "sample_top_p", "dtype": "float32", "shape": [1], "meaning": "top-p inside the top-k, in (0, 1]; 1 = off"},
]
SAMPLER_OUTPUTS = [
    {"name": "sampled_ids", "dtype": "int64", "shape": [1, "S"],
     "meaning": "a token drawn at each row from softmax(logits / temperature) truncated by top-k then top-p, by "
                "inverse CDF in descending-probability order (ties: lower id first) with sample_uniforms"},
]


def sampler_nodes(logp: str) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """The sampler's nodes reading ``logp`` (float32 [1, S, V]) and its constants (prefix ``sampler/``)."""
    n = lambda name: f"sampler/{name}"  # noqa: E731
    consts = [numpy_helper.from_array(np.array([0], np.int64), n("zero_i")),
              numpy_helper.from_array(np.array([1], np.int64), n("one_i")),
              numpy_helper.from_array(np.array(0.0, np.float32), n("zero_f")),
              numpy_helper.from_array(np.array(-1, np.int64), n("last_axis")),
              numpy_helper.from_array(np.array([-1], np.int64), n("last_axes"))]
    nodes = [
        helper.make_node("Shape", [logp], [n("v")], start=-1),
        helper.make_node("Greater", ["sample_top_k", n("zero_i")], [n("k_given")]),
        helper.make_node("Min", ["sample_top_k", n("v")], [n("k_capped")]),
        helper.make_node("Where", [n("k_given"), n("k_capped"), n("v")], [n("k")]),
        helper.make_node("TopK", [logp, n("k")], [n("lp"), n("ids")], axis=-1, largest=1, sorted=1),
        helper.make_node("Softmax", [n("lp")], [n("p")], axis=-1),
        helper.make_node("CumSum", [n("p"), n("last_axis")], [n("c")]),
        helper.make_node("Sub", [n("c"), n("p")], [n("before")]),
        helper.make_node("Less", [n("before"), "sample_top_p"], [n("keep")]),
        helper.make_node("Where", [n("keep"), n("p"), n("zero_f")], [n("p_kept")]),
        helper.make_node("CumSum", [n("p_kept"), n("last_axis")], [n("c_kept")]),
        helper.make_node("ReduceMax", [n("c_kept"), n("last_axes")], [n("total")], keepdims=1),
        helper.make_node("Shape", [logp], [n("rows")], end=-1),  # [1, S] (or [S] in a graph without the batch axis)
        helper.make_node("Concat", [n("rows"), n("one_i")], [n("u_shape")], axis=0),
        helper.make_node("Reshape", ["sample_uniforms", n("u_shape")], [n("u")]),
        helper.make_node("Mul", [n("u"), n("total")], [n("target")]),
        helper.make_node("LessOrEqual", [n("c_kept"), n("target")], [n("below")]),
        helper.make_node("Cast", [n("below")], [n("below_i")], to=TensorProto.INT64),
        helper.make_node("ReduceSum", [n("below_i"), n("last_axes")], [n("count")], keepdims=1),
        helper.make_node("Cast", [n("keep")], [n("keep_i")], to=TensorProto.INT64),
        helper.make_node("ReduceSum", [n("keep_i"), n("last_axes")], [n("kept")], keepdims=1),
        helper.make_node("Sub", [n("kept"), n("one_i")], [n("last_kept")]),
        helper.make_node("Min", [n("count"), n("last_kept")], [n("col")]),
        helper.make_node("GatherElements", [n("ids"), n("col")], [n("token")], axis=-1),
        helper.make_node("Shape", ["sample_uniforms"], [n("out_shape")]),
        helper.make_node("Reshape", [n("token"), n("out_shape")], ["sampled_ids"]),
    ]
    return nodes, consts


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
    nodes, consts = sampler_nodes(logsoftmax.output[0])
    model.graph.node.extend(nodes)
    model.graph.initializer.extend(consts)
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
