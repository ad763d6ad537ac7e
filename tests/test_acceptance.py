"""Acceptance (medusa_runtime.acceptance): greedy and typical, on hand-made arrays."""

from __future__ import annotations

import math

import numpy as np
import pytest

from medusa_runtime.acceptance import TypicalConfig, accept_greedy, accept_typical, sample_topk
from medusa_runtime.tree import make_tree

# Nodes: 0 root, 1 [0], 2 [1], 3 [0,0], 4 [0,1], 5 [1,0], 6 [0,0,0]
# retrieve rows: [0,1,4,-1], [0,2,5,-1], [0,1,3,6]
TREE = make_tree([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]], num_heads=3, topk=2)
TOKENS = np.array([100, 10, 11, 20, 21, 20, 30])


def _argmax(**at_node) -> np.ndarray:
    """Backbone argmax per node: 99 (matches no candidate) except where given."""
    out = np.full(TREE.size, 99)
    for node, tok in at_node.items():
        out[int(node[1:])] = tok
    return out


def test_greedy_nothing_accepted():
    acc = accept_greedy(TREE, TOKENS, _argmax(n0=7))
    np.testing.assert_array_equal(acc.accepted, [0])
    assert (acc.next_token, acc.accept_length, acc.path_index) == (7, 0, 0)


def test_greedy_accepts_second_child_path():
    # root predicts 10 (node 1), node 1 predicts 21 (node 4, not node 3), node 4 predicts 77
    acc = accept_greedy(TREE, TOKENS, _argmax(n0=10, n1=21, n4=77))
    np.testing.assert_array_equal(acc.accepted, [0, 1, 4])
    assert (acc.next_token, acc.accept_length, acc.path_index) == (77, 2, 0)


def test_greedy_picks_the_longest_path():
    acc = accept_greedy(TREE, TOKENS, _argmax(n0=10, n1=20, n3=30, n6=5))
    np.testing.assert_array_equal(acc.accepted, [0, 1, 3, 6])
    assert (acc.next_token, acc.accept_length, acc.path_index) == (5, 3, 2)


def test_greedy_needs_every_ancestor():
    # node 6's token matches node 3's argmax, but node 3 itself is rejected
    acc = accept_greedy(TREE, TOKENS, _argmax(n0=10, n1=55, n3=30))
    np.testing.assert_array_equal(acc.accepted, [0, 1])
    assert acc.next_token == 55


def test_greedy_tie_goes_to_the_first_row():
    # nodes 3 and 4 carry the same token: both accepted at depth 2; node 6 rejected.
    tokens = TOKENS.copy()
    tokens[4] = 20
    acc = accept_greedy(TREE, tokens, _argmax(n0=10, n1=20, n3=42, n4=43))
    np.testing.assert_array_equal(acc.accepted, [0, 1, 4])  # row 0 ([0,1,4]) before row 2 ([0,1,3,6])
    assert (acc.path_index, acc.next_token) == (0, 43)


def test_greedy_root_only_tree():
    acc = accept_greedy(make_tree([], num_heads=2), np.array([5]), np.array([9]))
    np.testing.assert_array_equal(acc.accepted, [0])
    assert acc.next_token == 9


# --- typical acceptance -------------------------------------------------------------------------
# Tree: root with two children (node 1 = [0], node 2 = [1]); retrieve rows [0,1], [0,2].
FORK = make_tree([[0], [1]], num_heads=1, topk=2)
FORK_TOKENS = np.array([5, 3, 4])


def _typical(p1, p2, entropy, config, seed=0):
    token_logprobs = np.full((3, 3), -30.0)
    token_logprobs[0, 1], token_logprobs[0, 2] = math.log(p1), math.log(p2)
    topk_ids = np.array([[3, 4], [8, 9], [6, 7]])
    topk_logprobs = np.log(np.array([[0.5, 0.5], [1.0, 1e-12], [1e-12, 1.0]]))
    return accept_typical(FORK, FORK_TOKENS, token_logprobs, np.array([entropy, 0.0, 0.0]), topk_ids,
                          topk_logprobs, config, np.random.default_rng(seed))


@pytest.mark.parametrize(
    "p1, entropy, accepted",
    [
        # threshold = min(epsilon, delta * exp(-H)) with epsilon = 0.6, delta = 0.9
        (0.5, 0.0, False),  # min(0.6, 0.9) = 0.6 > 0.5
        (0.5, 1.0, True),  # min(0.6, 0.9 / e = 0.331) = 0.331 < 0.5
        (0.32, 1.0, False),  # 0.32 < 0.331
        (0.65, 0.0, True),  # 0.65 > 0.6
    ],
)
def test_typical_threshold_formula(p1, entropy, accepted):
    cfg = TypicalConfig(temperature=1.0, posterior_threshold=0.6, posterior_alpha=0.9)
    acc = _typical(p1, 0.01, entropy, cfg)
    if accepted:
        np.testing.assert_array_equal(acc.accepted, [0, 1])
        assert acc.next_token == 8  # node 1's top-k puts all its mass on token 8
    else:
        np.testing.assert_array_equal(acc.accepted, [0])
        assert acc.next_token in (3, 4)


def test_typical_tie_broken_by_probability():
    # both children pass (threshold 0.3); the second row has the larger log-probability
    cfg = TypicalConfig(temperature=1.0, posterior_threshold=0.3, posterior_alpha=0.3)
    acc = _typical(0.35, 0.55, 0.0, cfg)
    np.testing.assert_array_equal(acc.accepted, [0, 2])
    assert (acc.path_index, acc.next_token) == (1, 7)


def test_typical_is_reproducible_for_a_seed():
    cfg = TypicalConfig(temperature=1.0, posterior_threshold=0.9, posterior_alpha=0.9)  # rejects both
    draws = [_typical(0.1, 0.1, 0.0, cfg, seed=s).next_token for s in range(40)]
    assert draws == [_typical(0.1, 0.1, 0.0, cfg, seed=s).next_token for s in range(40)]
    assert set(draws) == {3, 4}  # the root's bonus token is sampled from its two equally likely tokens


def test_sample_topk_follows_probabilities():
    rng = np.random.default_rng(1)
    ids, logp = np.array([11, 22, 33]), np.log(np.array([0.7, 0.2, 0.1]))
    draws = np.array([sample_topk(ids, logp, rng) for _ in range(4000)])
    for tok, p in zip(ids, [0.7, 0.2, 0.1]):
        assert abs((draws == tok).mean() - p) < 0.03


def test_typical_defaults_and_validation():
    d = TypicalConfig()
    assert (d.temperature, d.posterior_threshold, d.posterior_alpha) == (0.7, 0.09, 0.3)
    with pytest.raises(ValueError, match="temperature > 0"):
        TypicalConfig(temperature=0.0)
    with pytest.raises(ValueError, match="epsilon"):
        TypicalConfig(posterior_threshold=0.0)
    with pytest.raises(ValueError, match="delta"):
        TypicalConfig(posterior_alpha=0.0)
