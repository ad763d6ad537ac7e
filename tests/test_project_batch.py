"""scripts/project_batch.py: the roofline formula checked by hand."""

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "project_batch.py"
sys.path.insert(0, str(_PATH.parent))
_spec = importlib.util.spec_from_file_location("project_batch", _PATH)
pb = importlib.util.module_from_spec(_spec)
sys.modules["project_batch"] = pb
_spec.loader.exec_module(pb)


def test_memory_then_compute_bound_by_hand():
    m = pb.Machine("m", bandwidth=100e9, peak=1e12)
    c = pb.ModelCost(weight_bytes=1e9, macs_per_row=1e9, kv_bytes_per_token=1e5)
    # B=1, T=1, context 1000: memory (1e9 + 1e8) / 1e11 = 11 ms; compute 2e9 / 1e12 = 2 ms
    assert pb.step_seconds(m, c, 1, 1, 1000) == pytest.approx(0.011)
    # B=64, T=4: memory (1e9 + 64 * 1e8) / 1e11 = 74 ms; compute 2e9 * 256 / 1e12 = 512 ms
    assert pb.step_seconds(m, c, 64, 4, 1000) == pytest.approx(0.512)
    assert pb.step_seconds(pb.Machine("m", 100e9, 1e12, step_overhead=0.001), c, 1, 1, 1000) == pytest.approx(0.012)


def test_curve_keeps_the_best_tree_per_batch():
    m = pb.Machine("m", bandwidth=100e9, peak=1e12)
    c = pb.ModelCost(weight_bytes=1e9, macs_per_row=1e9, kv_bytes_per_token=0.0)
    rows = pb.curve(m, c, {1: 1.0, 4: 1.5}, [1, 64], context=0)
    # B=1: plain 1 / 10 ms = 100 tokens/s; T=4: 1.5 / max(10 ms, 8 ms) = 150 tokens/s, memory bound
    assert rows[0]["plain"] == pytest.approx(100) and rows[0]["medusa"] == pytest.approx(150)
    assert (rows[0]["tree"], rows[0]["bound"]) == (4, "memory")
    # B=64: plain 64 / max(10 ms, 128 ms) = 500; T=4 96 / 512 ms = 187.5: plain wins, compute bound
    assert rows[1]["plain"] == pytest.approx(500) and rows[1]["tree"] == 1 and rows[1]["bound"] == "compute"


def test_a_whole_run_adds_each_sequence_s_prefill_by_hand():
    m = pb.Machine("m", bandwidth=100e9, peak=1e12)
    c = pb.ModelCost(weight_bytes=1e9, macs_per_row=1e9, kv_bytes_per_token=0.0)
    # prefill of 100 rows: max(10 ms, 2e9 * 100 / 1e12 = 200 ms) = 200 ms
    assert pb.prefill_seconds(m, c, 100) == pytest.approx(0.2)
    # B=2, T=1, 10 new tokens: 2 * 200 ms + 10 steps * max(10 ms, 4 ms) = 0.5 s for 20 tokens
    assert pb.tokens_per_second(m, c, 2, 1, 1.0, 0, prompt_tokens=100, new_tokens=10) == pytest.approx(40.0)
    # T=4 with E = 1.5: ceil(10 / 1.5) = 7 steps of max(10 ms, 16 ms): 0.4 + 0.112 s for 20 tokens
    assert pb.tokens_per_second(m, c, 2, 4, 1.5, 0, prompt_tokens=100, new_tokens=10) == pytest.approx(20 / 0.512)
    # no prompt: the steady state, B * E / t
    assert pb.tokens_per_second(m, c, 2, 4, 1.5, 0) == pytest.approx(3 / 0.016)


def test_the_cpu_gemm_peak_follows_matmulnbits_accuracy_level():
    from onnx import helper

    def graph(*levels, extra=()):
        nodes = [helper.make_node("MatMulNBits", ["x", f"w{i}"], [f"y{i}"], domain="com.microsoft", K=64, N=64,
                                  bits=4, block_size=32, accuracy_level=lv) for i, lv in enumerate(levels)]
        return helper.make_model(helper.make_graph([*nodes, *extra], "g", [], []))

    assert pb.compute_precision(graph(4, 4)) == "int8"
    assert pb.compute_precision(graph(1, 1)) == "fp32"
    assert pb.compute_precision(graph(4, 1)) == "fp32"  # one fp32-compute product: not every product is int8
    assert pb.compute_precision(graph(extra=[helper.make_node("MatMul", ["a", "b"], ["c"])])) == "fp32"
