"""``--tree auto``: the pure choice, the timing harness and the build/runtime wiring."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from medusa_runtime.tuning.autotree import TreeTiming, candidate_trees, choose_tree, pick, time_tree_steps, timing_noise
from medusa_runtime.engines.base import Capabilities, StepResult
from medusa_runtime.errors import InvalidTreeError
from medusa_runtime.trees.treespec import tree_from_spec

from conftest import hand_timed_trees, make_tiny_medusa, tiny_loaded

ACC = np.array([[0.5, 0.2], [0.3, 0.1]])  # a_k^(i), K = 2 heads, top-2


def test_choose_tree_by_hand():
    # Greedy trees: size 2 adds [0] (0.5); size 4 adds [1] (0.2) and [0, 0] (0.5 * 0.3 = 0.15).
    trees = candidate_trees(ACC, [1, 2, 4], num_heads=2, topk=2)
    assert trees[2].choices == ((0,),) and trees[4].choices == ((0,), (1,), (0, 0))
    best, table = choose_tree(trees, ACC, {1: 10.0, 2: 11.0, 4: 20.0}, heads_ms=2.0)
    assert [r.size for r in table] == [1, 2, 4]
    assert [r.expected_tokens for r in table] == pytest.approx([1.0, 1.5, 1.85])
    assert [r.tokens_per_second for r in table] == pytest.approx([100.0, 1500 / 13, 1850 / 22])
    assert table[0].heads_ms == 0.0  # plain decoding runs no heads
    assert best is trees[2]


def test_choose_tree_falls_back_to_plain_decoding_when_heads_cost_too_much():
    trees = candidate_trees(ACC, [1, 2, 4], num_heads=2, topk=2)
    best, _ = choose_tree(trees, ACC, {1: 10.0, 2: 11.0, 4: 20.0}, heads_ms=6.0)
    assert best.size == 1


def test_choose_tree_prefers_the_bigger_tree_when_steps_cost_the_same():
    trees = candidate_trees(ACC, [1, 2, 4], num_heads=2, topk=2)
    best, _ = choose_tree(trees, ACC, {1: 10.0, 2: 10.0, 4: 10.0}, heads_ms=0.0)
    assert best.size == 4


def test_bad_inputs_are_refused():
    trees = candidate_trees(ACC, [1, 2], num_heads=2, topk=2)
    with pytest.raises(InvalidTreeError, match=r"no measured step time for tree sizes \[2\]"):
        choose_tree(trees, ACC, {1: 1.0}, heads_ms=0.0)
    with pytest.raises(InvalidTreeError, match=">= 1 node"):
        candidate_trees(ACC, [0, 2], num_heads=2, topk=2)
    with pytest.raises(InvalidTreeError, match="needs an artifact"):
        tree_from_spec("auto", num_heads=2)


def test_tree_timing_json_round_numbers():
    r = TreeTiming(4, 1.85, 20.0, 2.0)
    assert r.to_json() == {"size": 4, "expected_tokens_per_step": 1.85, "step_ms": 20.0, "heads_ms": 2.0,
                           "expected_tokens_per_second": 84.09}


class RecordingEngine:
    """Records what the timing harness feeds; costs nothing."""

    num_layers, num_kv_heads, head_dim, num_heads = 2, 1, 4, 2
    kv_dtype = np.dtype(np.float32)
    capabilities = Capabilities()  # Medusa heads, the loop's numpy KV cache, no limits said

    def __init__(self):
        self.calls, self.heads_calls = [], 0

    def step(self, input_ids, position_ids, mask, temperature, past):
        s = input_ids.shape[1]
        self.calls.append((input_ids.copy(), position_ids.copy(), mask.copy(), [k.shape[1] for k, _ in past]))
        return StepResult(np.zeros((s, 10), np.int64), np.zeros((s, 10), np.float32), np.zeros(s, np.float32),
                          np.zeros((s, s), np.float32), np.zeros((s, 8), np.float32), [])

    def heads(self, hidden, topk):
        self.heads_calls += 1
        return np.zeros((hidden.shape[0], self.num_heads, topk), np.int64)


def test_auto_tree_uses_the_simulated_tokens_of_the_policy_in_use():
    from medusa_runtime.trees.dynamic import DynamicTree

    trees = candidate_trees(ACC, [1, 2, 4], num_heads=2, topk=2, policy="dynamic")
    assert isinstance(trees[4], DynamicTree) and trees[4].size == 4 and trees[1].size == 1
    steps = {1: 10.0, 2: 11.0, 4: 20.0}
    best, table = choose_tree(trees, ACC, steps, {1: 0.0, 2: 1.0, 4: 2.0}, simulated={2: 1.3, 4: 2.6})
    assert [r.expected_tokens for r in table] == [1.0, 1.3, 2.6] and best.size == 4  # 2.6 / 22 ms beats 1 / 10 ms
    _, table = choose_tree(trees, ACC, steps, {1: 0.0, 2: 1.0, 4: 2.0}, simulated={2: 1.3})
    assert table[2].expected_tokens == pytest.approx(1 + 0.5 + 0.2 + 0.15)  # no value for 4: the greedy tree's
    with pytest.raises(InvalidTreeError, match="unknown tree policy"):
        candidate_trees(ACC, [2], num_heads=2, topk=2, policy="bushy")


class ClockedEngine(RecordingEngine):
    """A RecordingEngine on a fake clock: a step of T nodes takes T ms (the ``slow``-th call of a size, 50 ms more),
    a heads call 0.25 ms; nothing else advances the clock."""

    def __init__(self, slow: dict[int, int]):
        super().__init__()
        self.now, self.slow, self.seen = 0.0, slow, {}

    def perf_counter(self) -> float:
        return self.now

    def step(self, input_ids, position_ids, mask, temperature, past):
        t = input_ids.shape[1]
        self.seen[t] = self.seen.get(t, 0) + 1
        self.now += 1e-3 * t + (50e-3 if self.slow.get(t) == self.seen[t] else 0.0)
        return super().step(input_ids, position_ids, mask, temperature, past)

    def heads(self, hidden, topk):
        self.now += 0.25e-3
        return super().heads(hidden, topk)


def test_time_tree_steps_feeds_each_tree_after_the_past(monkeypatch):
    import medusa_runtime.tuning.autotree as autotree

    # size 4's calls: 1 warm-up, then 3 timed; the 2nd timed one (its 3rd call) takes 54 ms: the median ignores it
    eng = ClockedEngine(slow={4: 3})
    monkeypatch.setattr(autotree.time, "perf_counter", eng.perf_counter)
    trees = candidate_trees(ACC, [1, 4], num_heads=2, topk=2)
    step_ms, heads_ms = time_tree_steps(eng, trees, past_length=7, repeats=3, warmup=1)
    assert step_ms == pytest.approx({1: 1.0, 4: 4.0})  # by hand: T ms per T-node step, median of (4, 54, 4)
    assert heads_ms == pytest.approx({1: 0.0, 4: 0.25})  # plain decoding runs no heads; one heads call per step
    assert len(eng.calls) == 2 * (1 + 3) and eng.heads_calls == 1 + 3
    ids, pos, mask, past = eng.calls[-1]
    b = trees[4].buffers()
    assert ids.shape == (1, 4) and pos.tolist() == [(7 + b.depth).tolist()]
    np.testing.assert_array_equal(mask, b.attention_mask)
    assert past == [7, 7]  # every layer sees the 7 cached tokens


def test_sizes_padded_to_the_row_regime_share_its_timing(monkeypatch):
    """An engine whose steps run at least 2 rows (manifest step_rows: a 1-node step runs padded to 2 rows) has plain
    decoding timed as the 2-node step it runs: one timing, not two, and no 1-row step is fed."""
    import medusa_runtime.tuning.autotree as autotree

    eng = ClockedEngine(slow={2: 3})  # size 2's 3rd call (its 2nd timed one) takes 52 ms: the median ignores it
    eng.capabilities = Capabilities(min_rows=2)
    monkeypatch.setattr(autotree.time, "perf_counter", eng.perf_counter)
    trees = candidate_trees(ACC, [1, 2, 4], num_heads=2, topk=2)
    spreads = {}
    lines = []
    step_ms, heads_ms = time_tree_steps(eng, trees, past_length=7, repeats=3, warmup=1, spreads=spreads,
                                        progress=lines.append)
    assert step_ms == pytest.approx({1: 2.0, 2: 2.0, 4: 4.0})  # by hand: the 2-row step's median of (2, 52, 2)
    assert spreads[1] == spreads[2] > 0 and spreads[4] == pytest.approx(0.0, abs=1e-9)
    assert sorted({ids.shape[1] for ids, *_ in eng.calls}) == [2, 4] and len(eng.calls) == 2 * (1 + 3)
    assert heads_ms[1] == 0.0 and heads_ms[2] == pytest.approx(0.25)  # plain decoding still runs no heads
    assert "tree of   1 nodes:    2.00 ms per step (runs as the 2-row step)" in lines
    # no row regime (the class's Capabilities()): plain decoding timed on its own
    eng = ClockedEngine(slow={})
    monkeypatch.setattr(autotree.time, "perf_counter", eng.perf_counter)
    step_ms, _ = time_tree_steps(eng, trees, past_length=7, repeats=3, warmup=1)
    assert step_ms == pytest.approx({1: 1.0, 2: 2.0, 4: 4.0})


@pytest.fixture(scope="module")
def auto_artifact(tmp_path_factory):
    from medusa_export.pipeline import BuildConfig, build_artifact

    _, model = make_tiny_medusa(medusa_heads=2)
    acc = np.zeros((2, 10))
    acc[:, :2] = ACC
    lm = dataclasses.replace(tiny_loaded(model, max_context=256), head_accuracies=acc)
    tree = tree_from_spec("64", num_heads=2, accuracies=acc)
    out = tmp_path_factory.mktemp("auto") / "art"
    with pytest.MonkeyPatch.context() as mp:
        hand_timed_trees(mp, lambda n: 10.0 if n <= 4 else 100.0)  # see test_build_tree_auto_keeps_the_measured_best
        return build_artifact(lm, tree, out, BuildConfig(validate=False), progress=False, auto_tree=True)


def test_build_tree_auto_keeps_the_measured_best(auto_artifact):
    from medusa_runtime.contract.artifact import load_artifact

    art = load_artifact(auto_artifact)
    sel = art.manifest.tree.selection
    table = sel["candidates"]
    # By hand, with the timings the fixture gave (10 ms per step up to 4 nodes, 100 ms above): the greedy trees of
    # ACC are 1: the root (1 token/step), 2: + [0] (1.5), 3: + [1] (1.7), 4: + [0, 0] (1 + 0.5 + 0.2 + 0.5 * 0.3 =
    # 1.85): 185 tokens/s, 85% above plain decoding's 100; no larger tree reaches 1 + depth 2 = 3 tokens per 100 ms.
    assert sel["chosen"] == 4 == art.tree.size == art.manifest.tree.size
    assert sorted(art.tree.choices) == [(0,), (0, 0), (1,)]
    rows = {c["size"]: c for c in table}
    assert [rows[n]["expected_tokens_per_second"] for n in (1, 2, 3, 4)] == pytest.approx([100.0, 150.0, 170.0, 185.0])
    assert [c["size"] for c in table] == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
    np.testing.assert_allclose(art.head_accuracies[:, :2], ACC)
    data = json.loads((auto_artifact / "tree.json").read_text())
    assert data["medusa_choices"] == [list(c) for c in art.tree.choices]


def test_session_tree_auto_is_lossless(auto_artifact, monkeypatch):
    from medusa_runtime.front.session import MedusaSession

    # By hand: 2 nodes (1.5 tokens) in 5 ms is 300 tokens/s; every other size takes 10 ms: at most 3 tokens, 300/s
    # only for a tree that accepts its whole depth 2 every step; with ACC the most any tree gets is 1 + 0.7 + 0.7 * 0.4.
    hand_timed_trees(monkeypatch, lambda n: 5.0 if n == 2 else 10.0)
    s = MedusaSession(auto_artifact, threads=1, tree="auto", max_context=64)
    assert [r.size for r in s.tree_timings] == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32]  # sizes <= max_context // 2
    assert s.tree.size == 2 and s.tree.choices == ((0,),)
    big = MedusaSession(auto_artifact, threads=1, tree="8")  # the greedy tree from the artifact's accuracies
    assert big.tree.choices == tree_from_spec("8", num_heads=2, accuracies=big.artifact.head_accuracies).choices
    assert big.tree.choices != tree_from_spec("8", num_heads=2).choices  # not the default prior's tree
    prompt = [5, 17, 33, 2]
    out = s.generate(prompt_ids=prompt, max_new_tokens=20).token_ids
    assert len(out) == 20 and out == big.generate(prompt_ids=prompt, max_new_tokens=20, vanilla=True).token_ids


def _row(size, tokens, ms, spread):
    return TreeTiming(size, tokens, ms, 0.0, spread=spread)


def test_timing_noise_flags_a_lead_within_the_spread_by_hand():
    # plain 40 tokens/s (25 ms); 4 nodes: 1.4 tokens / 30 ms = 46.7 tokens/s, a lead of 16.7% over plain, 6.1% beyond
    # the 10% margin (46.67 / 44 = 1.0606)
    table = [_row(1, 1.0, 25.0, 0.02), _row(4, 1.4, 30.0, 0.02)]
    assert pick(table).size == 4
    assert timing_noise(table) is None  # 6.1% beyond the margin > 2% spread
    noisy = [_row(1, 1.0, 25.0, 0.08), _row(4, 1.4, 30.0, 0.02)]
    note = timing_noise(noisy)
    assert note is not None and "4 node(s) lead 1 by 6.1% beyond the margin" in note and "8.0%" in note
    # two trees 2% apart (1.4 / 30 ms vs 1.45 / 31.7 ms = 45.74 tokens/s), spread 3%: noisy; spread 1%: not
    trees = [_row(1, 1.0, 40.0, 0.01), _row(4, 1.4, 30.0, 0.03), _row(6, 1.45, 31.7, 0.01)]
    assert pick(trees).size == 4 and "lead 6 by 2.0%" in timing_noise(trees)
    assert timing_noise([_row(1, 1.0, 40.0, 0.01), _row(4, 1.4, 30.0, 0.01), _row(6, 1.45, 31.7, 0.01)]) is None
    assert timing_noise([_row(1, 1.0, 25.0, 0.0), _row(4, 1.4, 30.0, 0.0)]) is None  # spread not measured


def test_a_noisy_default_tree_is_used_but_not_cached(tmp_path):
    from medusa_runtime.tuning.treecache import cached_choice

    table = [_row(1, 1.0, 25.0, 0.08), _row(4, 1.4, 30.0, 0.02)]
    calls = []

    def measure():
        calls.append(1)
        return 4, table

    key = {"artifact": "a", "margin": 0.1}
    first = cached_choice(tmp_path / "art", key, measure, folder=tmp_path, cacheable=lambda t: timing_noise(t) is None)
    assert first.timed and first.record.chosen == 4 and first.cache_error == "the timing was noisy"
    again = cached_choice(tmp_path / "art", key, measure, folder=tmp_path, cacheable=lambda t: timing_noise(t) is None)
    assert again.timed and len(calls) == 2  # timed again: nothing was cached
    kept = cached_choice(tmp_path / "art", key, measure, folder=tmp_path)
    assert kept.timed and not cached_choice(tmp_path / "art", key, measure, folder=tmp_path).timed
