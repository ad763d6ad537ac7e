"""Weight-only quantization of the exported graphs with ONNX Runtime's MatMulNBits.

``int8`` / ``int4`` artifacts replace each constant-weight MatMul by the contrib operator
``com.microsoft::MatMulNBits`` (``onnxruntime.quantization.matmul_nbits_quantizer``):
weights stored blockwise (``block_size`` values share one scale and zero point along the
input dimension), activations stay float. With ``accuracy_level=4`` the CPU kernel
quantizes each activation row to int8 per block and multiplies in int8 (AVX512-VNNI /
AVX-VNNI where present). Such a graph is ONNX Runtime only (the artifact's flavour is
``ort-contrib``); the portable fp32 / fp16 graphs are the TensorRT path.

The exporter writes the projections in two shapes the quantizer does not take, so they are
rewritten first (:func:`fold_weight_transposes`), values unchanged:

* ``Gemm(x, W, b, transB=1)`` (``nn.Linear`` in the heads graph) -> ``MatMul(x, W^T) + b``;
* ``MatMul(x, Transpose(W))`` (the tied lm_head, whose ``W`` is also the embedding table
  read by ``Gather``) -> ``MatMul(x, W^T)`` with a pre-transposed copy. The embedding keeps
  reading the float table, so token lookup is exact.

Whether the vocabulary projection (``[d, V]``, the lm_head) is quantized is a parameter:
it is the largest matrix of a small model and the heads' whole cost.

Measured on SmolLM2-135M (this 2-core CPU shared with other work, ORT 1 thread, past 256,
round-robin medians; top-1 agreement with fp32 over 256 prefill positions of plain text):

=================  =======  ===========  ============  =========  ==============  ===========
graphs             weights  decode step  tree-16 step  heads R=1  backbone top-1  heads top-1
=================  =======  ===========  ============  =========  ==============  ===========
fp32               544 MB   54.0 ms      100.8 ms      11.3 ms    1                1
int8, block 32     269 MB   22.8 ms      70.1 ms       3.8 ms     0.926            0.960
int8, lm_head fp   236 MB   24.9 ms      75.9 ms       3.7 ms     0.949            0.960
int4, block 32     200 MB   19.5 ms      73.6 ms       3.2 ms     0.621            0.646
int4, lm_head fp   181 MB   23.5 ms      80.8 ms       3.1 ms     0.727            0.646
int4, block 128    192 MB   13.8 ms      58.1 ms       2.4 ms     0.570            0.619
=================  =======  ===========  ============  =========  ==============  ===========

So the lm_head is quantized by default (faster decode step, a few points of agreement), the
embedding stays a float ``Gather`` (quantizing it with ``GatherBlockQuantized`` saves ~95 MB
but needs the quantizer's forced opset-21 upgrade and makes token lookup approximate), and
the heads default to int8 (3x cheaper than fp32 in the table above, which was measured with other jobs
on the cores; 1.6 vs 4.3 ms, 2.7x, on an idle machine; top-1 agreement 0.96 against int4's 0.65).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..errors import MedusaError

#: weight-only precision name -> bits per weight (MatMulNBits).
WEIGHT_ONLY_BITS = {"int8": 8, "int4": 4}
CONTRIB_DOMAIN = "com.microsoft"


class QuantizationError(MedusaError):
    """A graph could not be quantized (bad settings or an unexpected graph)."""


@dataclass(frozen=True)
class WeightOnlyConfig:
    """Settings of one MatMulNBits pass.

    Attributes:
        bits: 8 or 4 bits per weight.
        block_size: weights per scale along the input dimension (a power of two >= 16).
        accuracy_level: MatMulNBits compute type (0 unset, 1 fp32, 2 fp16, 3 bf16, 4 int8).
        symmetric: symmetric blocks (no zero points) instead of asymmetric ones.
        vocab_projection: also quantize MatMuls whose output width is the vocabulary (the lm_head).
    """

    bits: int
    block_size: int = 32
    accuracy_level: int = 4
    symmetric: bool = False
    vocab_projection: bool = True

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise QuantizationError(f"MatMulNBits bits must be 4 or 8, got {self.bits}")
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise QuantizationError(f"block_size must be a power of two >= 16, got {self.block_size}")
        if self.accuracy_level not in (0, 1, 2, 3, 4):
            raise QuantizationError(f"accuracy_level must be 0-4, got {self.accuracy_level}")

    @classmethod
    def for_precision(cls, precision: str, **kw) -> "WeightOnlyConfig":
        """The config of a weight-only precision name ("int8" or "int4").

        Raises:
            QuantizationError: ``precision`` is not a weight-only precision (the message lists them).
        """
        if precision not in WEIGHT_ONLY_BITS:
            raise QuantizationError(f"{precision!r} is not a weight-only precision; choose one of "
                                    f"{', '.join(WEIGHT_ONLY_BITS)}")
        return cls(bits=WEIGHT_ONLY_BITS[precision], **kw)

    def describe(self) -> str:
        """One line for the manifest, e.g. "int4 MatMulNBits, block 32, accuracy_level 4 (int8 compute), asymmetric"."""
        comp = {0: "default", 1: "fp32", 2: "fp16", 3: "bf16", 4: "int8"}[self.accuracy_level]
        return (f"int{self.bits} weight-only (com.microsoft MatMulNBits), block {self.block_size}, "
                f"accuracy_level {self.accuracy_level} ({comp} compute), "
                f"{'symmetric' if self.symmetric else 'asymmetric'}, "
                f"lm_head {'quantized' if self.vocab_projection else 'float'}; embedding Gather float")


def _const(model: onnx.ModelProto) -> dict[str, onnx.TensorProto]:
    return {t.name: t for t in model.graph.initializer}


def fold_weight_transposes(model: onnx.ModelProto, skip_width: int | None = None) -> int:
    """Rewrite constant-weight projections as ``MatMul(x, W)`` with ``W`` an initializer (in place).

    ``Gemm(A, B[, C])`` with a constant ``B`` (alpha = beta = 1, transA = 0) becomes
    ``MatMul(A, B or B^T)`` (+ ``Add(C)``); ``MatMul(x, Transpose(W))`` with a constant 2-D
    ``W`` reads a transposed copy ``W^T``. Transposes left without consumers are removed;
    ``W`` itself stays when another node (the embedding ``Gather``) reads it. External data
    must be loaded.

    Args:
        model: the ONNX model, changed in place.
        skip_width: leave projections with this output width as they are (the vocabulary
            size, when the lm_head stays float: it then keeps sharing the embedding table
            instead of adding a transposed float copy).

    Returns:
        The number of rewritten nodes.

    Raises:
        QuantizationError: a Gemm with alpha/beta != 1 or transA = 1 on a constant weight.
    """
    g = model.graph
    inits = _const(model)
    producers = {o: n for n in g.node for o in n.output}
    added: dict[str, onnx.TensorProto] = {}

    def transposed(name: str) -> str:
        if name not in added:
            arr = numpy_helper.to_array(inits[name])
            added[name] = numpy_helper.from_array(np.ascontiguousarray(arr.T), f"{name}.T")
        return added[name].name

    def width(name: str, transpose: bool) -> int:
        dims = list(inits[name].dims)
        return dims[0] if transpose else dims[-1]

    new_nodes, rewritten = [], 0
    for n in g.node:
        a = {x.name: helper.get_attribute_value(x) for x in n.attribute}
        if (n.op_type == "Gemm" and len(n.input) > 1 and n.input[1] in inits
                and width(n.input[1], bool(a.get("transB", 0))) != skip_width):
            if a.get("alpha", 1.0) != 1.0 or a.get("beta", 1.0) != 1.0 or a.get("transA", 0):
                raise QuantizationError(f"Gemm node {n.name!r} has alpha/beta/transA the rewrite does not handle")
            w = transposed(n.input[1]) if a.get("transB", 0) else n.input[1]
            has_bias = len(n.input) > 2 and n.input[2]
            mm_out = f"{n.output[0]}_matmul" if has_bias else n.output[0]
            new_nodes.append(helper.make_node("MatMul", [n.input[0], w], [mm_out], name=f"{n.name}_matmul"))
            if has_bias:
                new_nodes.append(helper.make_node("Add", [mm_out, n.input[2]], [n.output[0]], name=f"{n.name}_bias"))
            rewritten += 1
            continue
        if n.op_type == "MatMul" and n.input[1] in producers:
            t = producers[n.input[1]]
            perm = next((helper.get_attribute_value(x) for x in t.attribute if x.name == "perm"), None)
            if (t.op_type == "Transpose" and t.input[0] in inits and len(inits[t.input[0]].dims) == 2
                    and list(perm or [1, 0]) == [1, 0] and width(t.input[0], True) != skip_width):
                new_nodes.append(helper.make_node("MatMul", [n.input[0], transposed(t.input[0])], list(n.output),
                                                  name=n.name))
                rewritten += 1
                continue
        new_nodes.append(n)
    used = {i for n in new_nodes for i in n.input} | {o.name for o in g.output}
    new_nodes = [n for n in new_nodes if n.op_type != "Transpose" or any(o in used for o in n.output)]
    used = {i for n in new_nodes for i in n.input}
    kept = [t for t in g.initializer if t.name in used]
    g.ClearField("node")
    g.node.extend(new_nodes)
    g.ClearField("initializer")
    g.initializer.extend(kept + list(added.values()))
    return rewritten


def quantize_graph(path: Path, cfg: WeightOnlyConfig, vocab_size: int) -> dict:
    """Quantize one exported graph file in place with :class:`MatMulNBitsQuantizer`.

    The file is rewritten with its weights in ``<name>.data`` beside it (``merge_weights``
    folds that into the artifact's one weights file afterwards).

    Args:
        path: the ONNX file (its external data beside it).
        cfg: bits, block size, accuracy level, whether the vocabulary projection is quantized.
        vocab_size: output width that identifies the vocabulary projection.

    Returns:
        {"quantized": MatMulNBits node count, "float_matmuls": constant-weight MatMuls left float}.

    Raises:
        QuantizationError: the graph has no weight the quantizer took.
    """
    import logging

    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    model = onnx.load(str(path), load_external_data=True)
    skip = None if cfg.vocab_projection else vocab_size
    fold_weight_transposes(model, skip_width=skip)
    inits = _const(model)
    exclude = [n.name for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in inits
               and list(inits[n.input[1]].dims)[-1:] == [skip]]  # an untransposed [d, V] MatMul
    logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)
    q = MatMulNBitsQuantizer(model, bits=cfg.bits, block_size=cfg.block_size, is_symmetric=cfg.symmetric,
                             accuracy_level=cfg.accuracy_level, nodes_to_exclude=exclude,
                             op_types_to_quantize=("MatMul",))
    q.process()
    out = q.model.model
    nodes = list(out.graph.node)
    n_q = sum(n.op_type == "MatMulNBits" for n in nodes)
    if n_q == 0:
        raise QuantizationError(f"{path.name}: no MatMul weight was quantized")
    inits = _const(out)
    n_float = sum(n.op_type == "MatMul" and n.input[1] in inits for n in nodes)
    data = path.with_name(path.name + ".data")
    for f in path.parent.iterdir():
        if f.name.startswith(path.name) and f != path:
            f.unlink()
    onnx.save(out, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=data.name,
              size_threshold=1024)
    return {"quantized": n_q, "float_matmuls": n_float}


def uses_contrib_ops(path: Path) -> list[str]:
    """Sorted ``domain::op`` names of the non-standard (com.microsoft) ops in an ONNX file."""
    m = onnx.load(str(path), load_external_data=False)
    return sorted({f"{n.domain}::{n.op_type}" for n in m.graph.node if n.domain not in ("", "ai.onnx")})
