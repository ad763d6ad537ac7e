"""scripts/bench_limit.py: bytes and multiply-adds per step counted by hand on small graphs."""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "bench_limit.py"
_spec = importlib.util.spec_from_file_location("bench_limit", _PATH)
bl = importlib.util.module_from_spec(_spec)
sys.modules["bench_limit"] = bl
_spec.loader.exec_module(bl)


def _model(nodes, inits):
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(a, n) for n, a in inits.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])


def test_float_graph_with_an_untied_embedding_reads_one_row_of_the_table():
    inits = {"emb": np.zeros((100, 8), np.float32), "norm": np.ones(8, np.float32),
             "w1": np.zeros((8, 16), np.float32), "w2": np.zeros((16, 100), np.float16)}
    m = _model([helper.make_node("Gather", ["emb", "ids"], ["x"]), helper.make_node("Mul", ["x", "norm"], ["h"]),
                helper.make_node("MatMul", ["h", "w1"], ["a"]), helper.make_node("MatMul", ["a", "w2"], ["y"])], inits)
    t = bl.graph_traffic(m)
    # one embedding row (8 x 4) + norm (8 x 4) + w1 (8 x 16 x 4) + w2 in fp16 (16 x 100 x 2)
    assert t.weight_bytes == 32 + 32 + 512 + 3200
    assert t.macs_per_row == 8 * 16 + 16 * 100
    assert t.products == 2
    assert bl.graph_traffic(m, gather_rows=4).weight_bytes == 4 * 32 + 32 + 512 + 3200


def test_tied_table_is_read_whole_once():
    inits = {"emb": np.zeros((100, 8), np.float32)}
    m = _model([helper.make_node("Gather", ["emb", "ids"], ["x"]),
                helper.make_node("Gemm", ["x", "emb"], ["y"], transB=1)], inits)
    t = bl.graph_traffic(m)
    assert t.weight_bytes == 100 * 8 * 4
    assert t.macs_per_row == 800


def test_quantized_weights_count_at_their_stored_size():
    k, n, block = 64, 32, 32
    packed = np.zeros((n, k // block, block // 2), np.uint8)  # MatMulNBits: 4 bits a weight
    scales = np.ones(n * k // block, np.float32)
    w4 = np.zeros((k, n), np.int8)  # stands for an int4 tensor: counted below with its data type rewritten
    m = _model([helper.make_node("MatMulNBits", ["ids", "p", "s"], ["a"], domain="com.microsoft", K=k, N=n, bits=4,
                                 block_size=block),
                helper.make_node("DequantizeLinear", ["w4", "s4"], ["w"], axis=0, block_size=block),
                helper.make_node("MatMul", ["a", "w"], ["y"])],
               {"p": packed, "s": scales, "w4": w4, "s4": np.ones((k // block, n), np.float16)})
    for t in m.graph.initializer:
        if t.name == "w4":
            t.data_type = TensorProto.INT4
    t = bl.graph_traffic(m)
    # MatMulNBits: n * k / 2 packed bytes + n * k / block fp32 scales; the DQ'd int4 weight k * n / 2 + fp16 scales
    assert t.weight_bytes == n * k / 2 + n * k // block * 4 + k * n / 2 + (k // block) * n * 2
    assert t.macs_per_row == 2 * k * n
    assert t.products == 2


def test_limit_is_bandwidth_over_bytes_times_tokens_per_step():
    assert bl.limit_tokens_per_second(34e9, 540e6) == pytest.approx(62.96, abs=0.01)
    assert bl.limit_tokens_per_second(34e9, 540e6, tokens_per_step=1.4) == pytest.approx(88.15, abs=0.01)
    with pytest.raises(ValueError, match="must be positive"):
        bl.limit_tokens_per_second(0, 1)
