"""Pure logic of scripts/bench_step.py: interleaved timing and the profile's operator shares."""

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "bench_step.py"
_spec = importlib.util.spec_from_file_location("bench_step", _PATH)
bs = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("bench_step", bs)
_spec.loader.exec_module(bs)


def _node(op, ts, dur, name="n"):
    return {"cat": "Node", "name": f"{name}_kernel_time", "ts": ts, "dur": dur, "args": {"op_name": op}}


def test_op_shares_counts_only_the_selected_runs():
    events = [
        {"cat": "Session", "name": "model_run", "ts": 0, "dur": 100},  # run 0: a prefill, not counted
        _node("MatMul", 10, 80),
        {"cat": "Session", "name": "model_run", "ts": 200, "dur": 50},
        _node("MatMul", 205, 30), _node("GroupQueryAttention", 236, 10),
        {"cat": "Node", "name": "n_fence_before", "ts": 240, "dur": 5, "args": {"op_name": "MatMul"}},
        {"cat": "Session", "name": "model_run", "ts": 300, "dur": 70},
        _node("MatMul", 301, 30), _node("GroupQueryAttention", 332, 30),
    ]
    rows, kernel_ms, wall_ms = bs.op_shares(events, slice(1, 3))
    assert [r[0] for r in rows] == ["MatMul", "GroupQueryAttention"]
    assert rows[0][1] == pytest.approx(0.030) and rows[0][2] == pytest.approx(0.6)
    assert rows[1][1] == pytest.approx(0.020) and rows[1][2] == pytest.approx(0.4)
    assert kernel_ms == pytest.approx(0.050) and wall_ms == pytest.approx(0.060)
    assert bs.op_shares(events, slice(5, 6)) == ([], 0.0, 0.0)


def test_interleaved_ms_runs_every_function_in_turn(monkeypatch):
    """On a fake clock: "a" takes 2 ms, "b" 5 ms, except b's second timed run (70 ms): the medians are 2 and 5."""
    order, clock = [], [0.0]
    cost = {"a": [2e-3] * 4, "b": [5e-3, 5e-3, 70e-3, 5e-3]}  # per call, the warm-up first

    def run(key):
        clock[0] += cost[key][order.count(key)]
        order.append(key)

    monkeypatch.setattr(bs.time, "perf_counter", lambda: clock[0])
    times = bs.interleaved_ms({"a": lambda: run("a"), "b": lambda: run("b")}, repeats=3, warmup=1)
    assert order == ["a", "b"] + ["a", "b"] * 3
    assert times == pytest.approx({"a": 2.0, "b": 5.0})
