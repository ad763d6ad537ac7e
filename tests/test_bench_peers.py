"""Pure logic of scripts/bench_peers.py: run order, aggregation, agreement (no peers, no models)."""

import importlib.util
import sys
from collections import Counter
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "bench_peers.py"
_spec = importlib.util.spec_from_file_location("bench_peers", _PATH)
bp = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("bench_peers", bp)  # dataclasses look their module up
_spec.loader.exec_module(bp)


def test_schedule_runs_every_system_once_per_prompt_and_round():
    order = bp.schedule(3, 2, 2)
    assert len(order) == 3 * 2 * 2
    assert Counter((r, p, s) for r, p, s in order) == Counter({(r, p, s): 1 for r in range(2) for p in range(2)
                                                               for s in range(3)})
    # rounds in sequence, prompts in sequence within a round, all systems of a (round, prompt) together
    assert [(r, p) for r, p, _ in order] == sorted((r, p) for r, p, _ in order)


def test_schedule_rotates_so_each_system_takes_each_position_equally():
    n = 4
    order = bp.schedule(n, 2, 2)  # 4 (round, prompt) blocks: one full rotation
    blocks = [[s for _, _, s in order[i:i + n]] for i in range(0, len(order), n)]
    assert blocks == [[0, 1, 2, 3], [1, 2, 3, 0], [2, 3, 0, 1], [3, 0, 1, 2]]
    positions = Counter((b.index(s), s) for b in blocks for s in b)
    assert set(positions.values()) == {1}


def test_schedule_empty():
    assert bp.schedule(0, 3, 2) == []
    assert bp.schedule(2, 3, 0) == []


@pytest.mark.parametrize("a,b,n", [([1, 2, 3], [1, 2, 3], 3), ([1, 2, 3], [1, 5, 3], 1), ([], [1], 0),
                                   ([1, 2], [1, 2, 3], 2), ([9], [1], 0)])
def test_common_prefix(a, b, n):
    assert bp.common_prefix(a, b) == n


def test_agreement_counts_identical_prompts_and_prefix_share():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8]]
    a = bp.agreement([[1, 2, 3, 4], [5, 6, 0, 8]], ref)
    assert a == {"identical": 1, "prompts": 2, "prefix_tokens": [4, 2], "prefix_fraction": 6 / 8}
    # a shorter output (e.g. an earlier EOS) is not identical, even if it is a prefix
    assert bp.agreement([[1, 2]], [[1, 2, 3]])["identical"] == 0
    assert bp.agreement(ref, ref)["prefix_fraction"] == 1.0


def test_aggregate_medians_and_ranges():
    runs = [{"tokens": [0] * 10, "seconds": 1.0, "ttft_seconds": 0.1},
            {"tokens": [0] * 10, "seconds": 0.5, "ttft_seconds": 0.3},
            {"tokens": [0] * 30, "seconds": 1.0, "ttft_seconds": None, "tokens_per_step": 1.5}]
    m = bp.aggregate(runs)
    assert m["median_tokens_per_second"] == 20.0
    assert (m["min_tokens_per_second"], m["max_tokens_per_second"]) == (10.0, 30.0)
    assert m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["mean_tokens_per_step"] == 1.5
    assert (m["runs"], m["new_tokens"]) == (3, 50)
    assert bp.aggregate([])["median_tokens_per_second"] is None


def test_deterministic_and_table():
    runs = [{"prompt": 0, "tokens": [1, 2]}, {"prompt": 0, "tokens": [1, 2]}, {"prompt": 1, "tokens": [3]}]
    assert bp.deterministic(runs)
    assert not bp.deterministic(runs + [{"prompt": 1, "tokens": [4]}])
    summary = bp.aggregate([{"tokens": [0] * 8, "seconds": 1.0, "ttft_seconds": 0.05}])
    report = {"config": {"prompts": 1, "max_new_tokens": 8, "rounds": 1, "threads": 2}, "reference": "ref",
              "skipped": {"llama-f32": "llama-cpp-python is not installed"},
              "systems": [{"name": "slow", "precision": "fp32", "summary": summary, "note": "",
                           "agreement": {"identical": 1, "prompts": 1, "prefix_tokens": [8], "prefix_fraction": 1.0}},
                          {"name": "fast", "precision": "int4", "note": "int4 weights", "summary":
                           bp.aggregate([{"tokens": [0] * 16, "seconds": 1.0, "ttft_seconds": None}]),
                           "agreement": {"identical": 0, "prompts": 1, "prefix_tokens": [4], "prefix_fraction": 0.5}}]}
    table = bp.markdown_table(report)
    lines = table.splitlines()
    assert lines[2] == "| fast | int4 | 16.0 | 16.0-16.0 | – | – | – | – | 0/1 (50% of tokens before divergence) | – |"
    assert lines[3] == "| slow | fp32 | 8.0 | 8.0-8.0 | 50 | – | – | – | 1/1 | – |"
    assert "- skipped llama-f32: llama-cpp-python is not installed" in lines
    assert "- fast: int4 weights" in lines


def test_table_gives_the_fraction_of_the_bandwidth_limit_and_medusa_against_its_own_plain():
    # 30 GB/s over 600 MB a step: 50 tokens/s at most; 40 measured is 0.80 of it (by hand)
    summary = bp.aggregate([{"tokens": [0] * 40, "seconds": 1.0, "ttft_seconds": None}])
    summary["limit_tokens_per_second"] = bp.limit_tokens_per_second(30e9, 600e6)
    summary["fraction_of_limit"] = 40 / summary["limit_tokens_per_second"]
    same = {"identical": 2, "prompts": 2, "prefix_tokens": [8, 8], "prefix_fraction": 1.0}
    report = {"config": {"prompts": 2, "max_new_tokens": 8, "rounds": 1, "threads": 2}, "reference": "ref",
              "skipped": {}, "machine": {"load_average_before": (0.05, 0, 0), "load_average_after": (0.5, 0, 0)},
              "limits": {"bandwidth": 30e9, "bandwidth_bytes_per_s": {"copy": 25e9, "triad": 30e9}, "threads": 2,
                         "host": {"cpu": "cpu", "date": "today"}},
              "systems": [{"name": "m", "precision": "fp32", "summary": summary, "note": "", "bytes_per_step": 600e6,
                           "agreement": same, "equals_own_plain": same}]}
    lines = bp.markdown_table(report).splitlines()
    assert lines[2] == "| m | fp32 | 40.0 | 40.0-40.0 | – | – | 600 | 0.80 of 50 | 2/2 | 2/2 |"
    assert "- load average before / after: 0.05 / 0.50" in lines
    assert any(line.startswith("- bandwidth limit: STREAM-like triad 30.0 GB/s") for line in lines)
