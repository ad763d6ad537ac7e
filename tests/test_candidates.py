"""Per-step trees and level-by-level candidates (pure numpy, no model)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from medusa_runtime.trees.dynamic import DynamicTree
from medusa_runtime.trees.treespec import parse_tree_spec
from medusa_runtime.decode.candidates import (best_first_paths, dynamic_levels, dynamic_medusa, static_levels,
                                              static_medusa)
from medusa_runtime.trees.calibration import ProbabilityMap
from medusa_runtime.errors import InvalidTreeError
from medusa_runtime.trees.tree import make_tree


def _all_paths(num_heads, k):
    for d in range(1, num_heads + 1):
        yield from itertools.product(range(k), repeat=d)


def _is_tree(paths):
    s = set(paths)
    return all(len(p) == 1 or p[:-1] in s for p in paths)


@pytest.mark.parametrize("seed", range(4))
def test_best_first_paths_are_the_top_products_and_a_tree(seed):
    rng = np.random.default_rng(seed)
    scores = -np.sort(-rng.uniform(0, 1, size=(3, 4)), axis=1)
    for count in (1, 5, 17, 40):
        got = best_first_paths(scores, count)
        every = sorted((float(np.prod([scores[d, i] for d, i in enumerate(p)])) for p in _all_paths(3, 4)),
                       reverse=True)
        assert [s for _, s in got] == pytest.approx(every[:count])
        assert _is_tree([p for p, _ in got]) and len({p for p, _ in got}) == count


def test_best_first_paths_by_hand():
    scores = np.array([[0.5, 0.3], [0.4, 0.1]])
    # [0] .5, [1] .3, [0,0] .2, [1,0] .12, [0,1] .05, [1,1] .03
    assert best_first_paths(scores, 4) == [((0,), 0.5), ((1,), 0.3), ((0, 0), 0.2), ((1, 0), pytest.approx(0.12))]


def _connected_subtrees(nodes, size):
    for subset in itertools.combinations(nodes, size):
        if _is_tree(subset):
            yield subset


def test_dynamic_medusa_maximises_the_expected_accepted_length():
    rng = np.random.default_rng(7)
    logp = np.log(-np.sort(-rng.dirichlet(np.ones(4), size=2) * 0.9, axis=1))  # 2 heads, top-4, sorted
    ids = np.arange(8).reshape(2, 4) + 100
    spec = DynamicTree(size=5, num_heads=2, topk=3)
    prop = dynamic_medusa(7, ids, logp, spec)
    assert prop.tree.size == 5 and prop.tokens[0] == 7
    value = lambda paths: sum(np.prod([np.exp(logp[d, i]) for d, i in enumerate(p)]) for p in paths)  # noqa: E731
    best = max(value(t) for t in _connected_subtrees(list(_all_paths(2, 3)), 4))
    assert value(prop.tree.choices) == pytest.approx(best)
    for path, tok in zip(prop.tree.choices, prop.tokens[1:]):
        assert tok == ids[len(path) - 1, path[-1]]  # static_medusa's gathering on the chosen tree
    assert np.array_equal(static_medusa(7, ids, prop.tree).tokens, prop.tokens)


def _fake_heads(num_heads, vocab=50, seed=0):
    """A deterministic path-conditioned head: ids and log-probs depend on the whole path."""
    calls = []

    def run_level(depth, paths):
        calls.append((depth, paths.copy()))
        assert paths.shape[1] == depth
        out_ids, out_lp = [], []
        for row in paths:
            r = np.random.default_rng(hash((seed, depth) + tuple(int(t) for t in row)) % (2**32))
            p = np.sort(r.dirichlet(np.ones(vocab)))[::-1]
            out_ids.append(r.permutation(vocab))
            out_lp.append(np.log(p))
        return np.asarray(out_ids), np.asarray(out_lp, dtype=np.float32)

    return run_level, calls


def _exhaustive_conditional(root, run_level, num_heads, k, need):
    """Every path with its conditional score, by brute force."""
    cands = []

    def walk(tokens, ranks, v):
        d = len(ranks) + 1
        if d > num_heads:
            return
        ids, lp = run_level(d, np.array([tokens]))
        for i in range(k):
            s = v * float(np.exp(lp[0, i]))
            cands.append((s, ranks + (i,), int(ids[0, i])))
            walk(tokens + [int(ids[0, i])], ranks + (i,), s)

    walk([root], (), 1.0)
    cands.sort(key=lambda c: (-c[0], len(c[1]), c[1]))
    return cands[:need]


@pytest.mark.parametrize("size", [2, 5, 12])
def test_dynamic_levels_with_a_wide_beam_is_exact(size):
    run_level, _ = _fake_heads(3)
    spec = DynamicTree(size=size, num_heads=3, topk=3, width=9)  # width >= k^(d-1): every node expanded
    prop = dynamic_levels(11, run_level, spec)
    best = _exhaustive_conditional(11, run_level, 3, 3, size - 1)
    assert sorted(prop.tree.choices) == sorted(r for _, r, _ in best)
    token_of = {r: t for _, r, t in best}
    assert [token_of[p] for p in prop.tree.choices] == prop.tokens[1:].tolist()
    assert prop.tree.size == size  # the fixed T


def test_dynamic_levels_runs_one_row_per_beam_node_and_stops_early():
    run_level, calls = _fake_heads(4, vocab=200)
    prop = dynamic_levels(3, run_level, DynamicTree(size=4, num_heads=4, topk=5, width=2))
    assert calls[0][0] == 1 and calls[0][1].tolist() == [[3]]
    assert all(len(paths) <= 2 for _, paths in calls[1:])
    assert len(calls) < 4  # 200-way flat heads: deeper levels cannot beat the first level's top 3
    assert prop.tree.size == 4


def test_static_levels_fill_each_node_from_its_parents_path():
    run_level, calls = _fake_heads(3)
    tree = make_tree([(0,), (1,), (0, 0), (0, 2), (1, 1), (0, 0, 1)], num_heads=3, topk=3)
    prop = static_levels(5, tree, run_level)
    assert [d for d, _ in calls] == [1, 2, 3]
    assert len(calls[1][1]) == 2 and len(calls[2][1]) == 1  # only the nodes that have children run
    b = tree.buffers()
    for n, path in enumerate(tree.choices, start=1):
        toks = [5]
        node = n
        chain = []
        while node > 0:
            chain.append(node)
            node = b.parent[node]
        toks += [int(prop.tokens[c]) for c in reversed(chain[1:])]
        ids, _ = run_level(len(path), np.array([toks]))
        assert prop.tokens[n] == ids[0, path[-1]]


def test_probability_map_round_trip_and_errors():
    m = ProbabilityMap(np.array([-5.0, -1.0, 0.0]), np.array([[0.0, 0.3, 0.9], [0.1, 0.2, 0.5]]))
    assert m(1, np.array([-3.0, 0.0])).tolist() == pytest.approx([0.15, 0.9])
    assert m(7, -1.0) == pytest.approx(0.2)  # deeper heads use the last row
    back = ProbabilityMap.from_json(m.to_json())
    assert np.allclose(back.p_right, m.p_right)
    with pytest.raises(InvalidTreeError, match="must increase"):
        ProbabilityMap.from_json({"logprobs": [0, -1], "p_right": [[0.1, 0.2]]})


def test_dynamic_tree_spec_checks():
    assert parse_tree_spec("dynamic:6").size == 6 and parse_tree_spec("dynamic:6").policy == "dynamic"
    assert parse_tree_spec("16").kind == "size"
    with pytest.raises(InvalidTreeError, match="node count"):
        parse_tree_spec("dynamic:x")
    assert DynamicTree(size=7, num_heads=2, topk=2, width=4).size == 7  # 2 + 2 x 2 candidates
    with pytest.raises(InvalidTreeError, match="choose at most 7 nodes"):
        DynamicTree(size=8, num_heads=2, topk=2, width=4)
