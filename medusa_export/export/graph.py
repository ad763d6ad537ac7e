"""Writing ONNX graphs node by node from a checkpoint's weights: the builder every graph of the artifact uses.

The graphs are written, not traced: nothing is run in PyTorch and no model is held in memory. One
``make``-style method per part of a layer, in the manner of ONNX Runtime GenAI's model builder
(onnxruntime-genai ``src/python/py/models/builders/base.py``: ``make_layernorm``, ``make_attention``,
``make_mlp``, ``make_lm_head``), but each weight is read from the checkpoint, converted and written to
``weights.bin`` by a :class:`~.weights.WeightsWriter` the moment its node is made, and dropped; the graph
proto holds only external-data references.

Node names are chosen here, so tools can find the parts by name: every node of an RMSNorm chain is
named ``<norm>/rmsnorm/<step>`` (``pow``, ``mean``, ``add_eps``, ``sqrt``, ``reciprocal``, ``mul_x``,
``mul_w``) and every attention softmax ``<layer>/softmax``; :func:`fp32_nodes` lists them for
TensorRT's per-layer float32 constraints (issue 13, item 6).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .contract import IR_VERSION, OPSET, TensorSpec
from .quantize import CONTRIB_DOMAIN, WeightOnlyConfig
from .weights import OutTensor, Recipe, WeightsPlan

#: Marks the nodes of an RMSNorm chain in their names (``layers.3.input_norm/rmsnorm/add_eps``).
RMSNORM_MARK = "/rmsnorm/"
#: The name suffix of attention softmax nodes.
SOFTMAX_MARK = "/softmax"
ONNX_TYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "int64": TensorProto.INT64,
              "int32": TensorProto.INT32, "bool": TensorProto.BOOL, "uint8": TensorProto.UINT8}


def fp32_nodes(model: onnx.ModelProto) -> list[str]:
    """Names of the nodes of every RMSNorm chain and every attention softmax, in graph order."""
    return [n.name for n in model.graph.node if RMSNORM_MARK in n.name or n.name.endswith(SOFTMAX_MARK)]


def value_info(t: TensorSpec) -> onnx.ValueInfoProto:
    """A graph input / output declaration of a contract tensor (symbolic dims stay names)."""
    return helper.make_tensor_value_info(t.name, ONNX_TYPES[t.dtype], list(t.shape))


class GraphBuilder:
    """Collects nodes, small inline constants and the weights they reference.

    Args:
        weights: where weights go (:class:`~.weights.WeightsPlan` to lay out, :class:`~.weights.WeightsWriter`
            to write); shared by the graphs of one artifact, so a tensor both use is stored once.
        dtype: the graph's float dtype ("float32" or "float16": weights, activations, K/V).
        quant: MatMulNBits settings for the linear layers (None: float MatMuls).
    """

    def __init__(self, weights: WeightsPlan, dtype: str = "float32", quant: WeightOnlyConfig | None = None):
        self.w = weights
        self.dtype = dtype
        self.onnx_dtype = ONNX_TYPES[dtype]
        self.quant = quant
        self.nodes: list[onnx.NodeProto] = []
        self._consts: dict[tuple, str] = {}
        self._inits: list[onnx.TensorProto] = []
        self._weights: dict[str, OutTensor] = {}
        self._names: set[str] = set()

    # ---- primitives -------------------------------------------------------------------------------------

    def const(self, value, dtype: str | None = None) -> str:
        """A small constant stored inside the graph (shapes, axes, epsilon); equal constants are shared."""
        arr = np.asarray(value, dtype=dtype) if dtype else np.asarray(value)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self._consts:
            name = f"const_{len(self._consts)}"
            self._inits.append(numpy_helper.from_array(arr, name))
            self._consts[key] = name
        return self._consts[key]

    def op(self, op_type: str, inputs: list[str], name: str, n_out: int = 1, outputs: list[str] | None = None,
           domain: str = "", **attrs):
        """Add a node; returns its output name (a list when ``n_out`` > 1). Node names must be unique."""
        if name in self._names:
            raise ValueError(f"duplicate node name {name!r}")
        self._names.add(name)
        outputs = outputs or ([f"{name}/out"] if n_out == 1 else [f"{name}/out{j}" for j in range(n_out)])
        self.nodes.append(helper.make_node(op_type, inputs, outputs, name=name, domain=domain, **attrs))
        return outputs[0] if n_out == 1 and len(outputs) == 1 else outputs

    def weight(self, name: str, recipe: Recipe) -> list[OutTensor]:
        """The tensors of ``recipe`` (written now by a writer; stored once across graphs)."""
        outs = self.w.add(name, recipe)
        for o in outs:
            self._weights[o.name] = o
        return outs

    def array(self, name: str, array: np.ndarray, origin: str) -> str:
        """An exporter-made tensor stored in the weights file (e.g. the heads' vocabulary ids)."""
        o = self.w.add_array(name, array, origin)
        self._weights[o.name] = o
        return o.name

    @property
    def weight_names(self) -> set[str]:
        """Names of the weights this graph references."""
        return set(self._weights)

    def if_(self, cond: str, name: str, then: Callable[[], str], otherwise: Callable[[], str], dtype: str,
            rank: int) -> str:
        """An ``If`` node with one output: each branch's nodes are those ``then()`` / ``otherwise()`` add.

        The branches read outer values (inputs, earlier nodes, the builder's constants, which stay
        initializers of the main graph: TensorRT's parser sees them as build-time constants) and
        take no inputs of their own. Their outputs have different names, as TensorRT's parser
        requires, and the same ``dtype`` and ``rank``.

        Args:
            cond: a bool tensor of one element.
            name: the If node's name (its output is ``<name>/out``).
            then, otherwise: add a branch's nodes and return its output's name.
            dtype: the output's dtype name; rank: its rank.
        """
        def branch(body: Callable[[], str], which: str) -> onnx.GraphProto:
            outer, self.nodes = self.nodes, []
            try:
                out = body()
                nodes = self.nodes
            finally:
                self.nodes = outer
            return helper.make_graph(nodes, f"{name}/{which}", [],
                                     [helper.make_tensor_value_info(out, ONNX_TYPES[dtype], [None] * rank)])

        then_g, else_g = branch(then, "then"), branch(otherwise, "else")
        return self.op("If", [cond], name, then_branch=then_g, else_branch=else_g)

    def cast(self, x: str, to: str, name: str) -> str:
        return self.op("Cast", [x], name, to=ONNX_TYPES[to])

    def to_float32(self, x: str, name: str) -> str:
        """``x`` in float32 (a Cast in an fp16 graph, ``x`` itself otherwise)."""
        return x if self.dtype == "float32" else self.cast(x, "float32", name)

    def from_float32(self, x: str, name: str, out: str | None = None) -> str:
        if self.dtype == "float32":
            return x
        return self.op("Cast", [x], name, outputs=[out] if out else None, to=self.onnx_dtype)

    # ---- layer parts ------------------------------------------------------------------------------------

    def rms_norm(self, x: str, key: str, eps: float, name: str, source: str = "backbone",
                 out: str | None = None) -> str:
        """RMSNorm over the last axis: ``w * (x * 1 / sqrt(mean(x^2) + eps))`` with the variance and the
        normalisation in float32, the weight product in the graph's dtype (transformers ``LlamaRMSNorm``,
        ``model/backbone.py`` ``RMSNorm``).

        Args:
            x: input [..., n] in the graph's dtype.
            key: the weight's checkpoint key ([n]).
            eps: epsilon.
            name: node name prefix (the chain's nodes are ``name/rmsnorm/*``).
            source: the weight's source.
            out: output name (default: generated).
        """
        p = name + RMSNORM_MARK
        w = self.weight(key, Recipe(source, (key,), "rows", self.dtype))[0].name
        xf = self.to_float32(x, name + "/cast_in")
        sq = self.op("Pow", [xf, self.const(np.float32(2.0))], p + "pow")
        mean = self.op("ReduceMean", [sq, self.const([-1], "int64")], p + "mean", keepdims=1)
        var = self.op("Add", [mean, self.const(np.float32(eps))], p + "add_eps")
        inv = self.op("Reciprocal", [self.op("Sqrt", [var], p + "sqrt")], p + "reciprocal")
        normed = self.from_float32(self.op("Mul", [xf, inv], p + "mul_x"), name + "/cast_out")
        return self.op("Mul", [w, normed], p + "mul_w", outputs=[out] if out else None)

    def linear(self, x: str, name: str, keys: tuple[str, ...], bias: tuple[str, ...] = (), source: str = "backbone",
               quant: WeightOnlyConfig | None | bool = True, out: str | None = None) -> str:
        """``x @ W^T (+ b)`` for checkpoint weights ``keys`` (``[out, in]`` each, concatenated along out).

        Float: ``MatMul`` on the transposed ``[in, out]`` weight. Quantized (``quant`` True: the builder's
        settings, or a :class:`WeightOnlyConfig`): ``com.microsoft::MatMulNBits`` on blocks of the rows.

        Args:
            x: input [..., in].
            name: node name (the weight is ``<name>.weight``).
            keys: weight keys; bias: bias keys (same order), or () for none.
            source: the weights' source.
            quant: True (the builder's), False (float), or explicit settings.
            out: output name.
        """
        q = self.quant if quant is True else (quant or None)
        o = [out] if out and not bias else None
        if q is None:
            w = self.weight(f"{name}.weight", Recipe(source, keys, "cols", self.dtype))[0]
            y = self.op("MatMul", [x, w.name], name, outputs=o)
        else:
            ws = self.weight(f"{name}.weight", Recipe(source, keys, "rows", f"int{q.bits}", q.block_size, q.symmetric))
            n, k = ws[0].shape[0], self._in_features(source, keys[0])
            attrs = {"K": k, "N": n, "bits": q.bits, "block_size": q.block_size}
            if q.accuracy_level:
                attrs["accuracy_level"] = q.accuracy_level
            y = self.op("MatMulNBits", [x, *(t.name for t in ws)], name, outputs=o, domain=CONTRIB_DOMAIN, **attrs)
        if bias:
            b = self.weight(f"{name}.bias", Recipe(source, bias, "rows", "float32" if q else self.dtype))[0]
            y = self.op("Add", [y, b.name], name + "/bias", outputs=[out] if out else None)
        return y

    def _in_features(self, source: str, key: str) -> int:
        return self.w.sources[source].info(key).shape[1]

    def projection(self, x2d: str, name: str, key: str, source: str = "backbone",
                   quant: WeightOnlyConfig | None = None, rows_of: str = "", out: str | None = None) -> str:
        """A vocabulary projection of rows [R, d] -> [R, V] on a ``[V, d]`` table stored as is: float
        ``Gemm(transB=1)`` (the table is the embedding's when tied: no transposed copy), or MatMulNBits.

        Args:
            x2d: input [R, d].
            name: node name.
            key: the [V, d] checkpoint tensor.
            quant: MatMulNBits settings, or None for float.
            rows_of: an int64 [N] weights tensor: project onto those rows only ([R, N]).
        """
        o = [out] if out else None
        if quant is None:
            base = key if not rows_of else f"{key}[{rows_of}]"
            w = self.weight(base, Recipe(source, (key,), "rows", self.dtype, rows_of=rows_of))[0]
            return self.op("Gemm", [x2d, w.name], name, outputs=o, transB=1)
        base = key if not rows_of else f"{key}[{rows_of}]"
        ws = self.weight(base, Recipe(source, (key,), "rows", f"int{quant.bits}", quant.block_size, quant.symmetric,
                                      rows_of=rows_of))
        attrs = {"K": self._in_features(source, key), "N": ws[0].shape[0], "bits": quant.bits,
                 "block_size": quant.block_size}
        if quant.accuracy_level:
            attrs["accuracy_level"] = quant.accuracy_level
        return self.op("MatMulNBits", [x2d, *(t.name for t in ws)], name, outputs=o, domain=CONTRIB_DOMAIN, **attrs)

    def silu(self, x: str, name: str) -> str:
        """SiLU as standard ops: ``x * Sigmoid(x)``."""
        return self.op("Mul", [x, self.op("Sigmoid", [x], name + "/sigmoid")], name)

    # ---- the model --------------------------------------------------------------------------------------

    def model(self, graph_name: str, inputs: list[TensorSpec], outputs: list[TensorSpec], producer: str,
              contrib: bool = False) -> onnx.ModelProto:
        """The ONNX model: nodes, inline constants, and every weight as an external-data reference.

        Raises:
            TypeError: the builder wrote into a :class:`~.weights.WeightsPlan` (no offsets to reference).
        """
        records = getattr(self.w, "records", None)
        if records is None:
            raise TypeError("a weights plan has no offsets: build the model with a WeightsWriter")
        inits = self._inits + [records[name].proto() for name in self._weights]
        graph = helper.make_graph(self.nodes, graph_name, [value_info(t) for t in inputs],
                                  [value_info(t) for t in outputs], inits)
        opsets = [helper.make_opsetid("", OPSET)] + ([helper.make_opsetid(CONTRIB_DOMAIN, 1)] if contrib else [])
        model = helper.make_model(graph, opset_imports=opsets, producer_name=producer)
        model.ir_version = IR_VERSION
        return model
