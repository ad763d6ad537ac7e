"""Token trees (medusa_runtime.trees.tree): buffers, validation, JSON, presets. Pure numpy, no model."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from medusa_runtime.errors import InvalidTreeError
from medusa_runtime.trees.tree import (
    default_accuracies,
    expected_accept_length,
    gather_candidates,
    greedy_tree,
    load_tree,
    make_tree,
    tree_from_json,
)
from medusa_runtime.trees.treespec import PRESETS, tree_from_spec

# A small tree checked by hand. Node order (depth, path):
#   0 root, 1 [0], 2 [1], 3 [0,0], 4 [0,1], 5 [1,0], 6 [0,0,0]
HAND_CHOICES = [[0, 0, 0], [1, 0], [0], [0, 1], [1], [0, 0]]  # deliberately shuffled


@pytest.fixture
def hand_tree():
    return make_tree(HAND_CHOICES, num_heads=3, topk=2)


def test_hand_tree_node_order(hand_tree):
    assert hand_tree.choices == ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    assert hand_tree.size == 7
    assert hand_tree.max_depth == 3


def test_hand_tree_buffers(hand_tree):
    b = hand_tree.buffers()
    np.testing.assert_array_equal(b.depth, [0, 1, 1, 2, 2, 2, 3])
    np.testing.assert_array_equal(b.parent, [-1, 0, 0, 1, 1, 2, 3])
    # 1 + (depth - 1) * topk + last index, topk = 2
    np.testing.assert_array_equal(b.candidate_index, [0, 1, 2, 3, 4, 3, 5])
    expected_mask = np.array(
        [
            [1, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0, 0],
            [1, 1, 0, 1, 0, 0, 0],
            [1, 1, 0, 0, 1, 0, 0],
            [1, 0, 1, 0, 0, 1, 0],
            [1, 1, 0, 1, 0, 0, 1],
        ],
        dtype=bool,
    )
    np.testing.assert_array_equal(b.attention_mask, expected_mask)
    # leaves 4, 5, 6 in node order, padded with -1 to depth + 1 = 4 columns
    np.testing.assert_array_equal(b.retrieve_indices, [[0, 1, 4, -1], [0, 2, 5, -1], [0, 1, 3, 6]])
    for arr in (b.depth, b.parent, b.candidate_index, b.retrieve_indices):
        assert arr.dtype == np.int64


def test_gather_candidates_on_hand_tree(hand_tree):
    heads_topk = np.array([[10, 11, 12], [20, 21, 22], [30, 31, 32]])  # 3 columns: only topk=2 are used
    tokens = gather_candidates(100, heads_topk, hand_tree)
    np.testing.assert_array_equal(tokens, [100, 10, 11, 20, 21, 20, 30])


def test_gather_candidates_rejects_too_few_heads(hand_tree):
    with pytest.raises(ValueError, match="needs at least"):
        gather_candidates(100, np.zeros((2, 2), np.int64), hand_tree)


def test_root_only_tree():
    t = make_tree([], num_heads=4)
    b = t.buffers()
    assert t.size == 1 and t.max_depth == 0
    np.testing.assert_array_equal(b.attention_mask, [[True]])
    np.testing.assert_array_equal(b.retrieve_indices, [[0]])
    np.testing.assert_array_equal(b.parent, [-1])
    # the root path [] may be given explicitly and is ignored
    assert make_tree([[]], num_heads=4) == t


# --- validation: each bad tree gives InvalidTreeError naming the path -----------------------


@pytest.mark.parametrize(
    "choices, kwargs, message",
    [
        ([[0], [0, 1], [1, 0, 0]], {}, r"tree path \[1, 0, 0\] has no parent"),
        ([[0], [1], [0]], {}, r"tree path \[0\] appears more than once"),
        ([[0], [0, 10]], {"topk": 10}, r"tree path \[0, 10\] uses top-k index 10; valid indices are 0\.\.9"),
        ([[-1]], {}, r"tree path \[-1\] uses top-k index -1"),
        ([[0], [0, 0], [0, 0, 0]], {"num_heads": 2}, r"tree path \[0, 0, 0\] has depth 3 .* only 2 Medusa heads"),
        ([[0], [1], [2]], {"budget": 3}, r"4 nodes .* budget is 3; first path over budget: \[2\]"),
        ([[0], [0.5]], {}, r"tree path \[0\.5\] is not a list of ints"),
        ([[0], [True]], {}, r"tree path \[True\] is not a list of ints"),
        ([[0], "01"], {}, r"tree path '01' is not a list of ints"),
        ([[0], 1], {}, r"tree path 1 is not a list of ints"),
    ],
    ids=["missing-parent", "duplicate", "topk-out-of-range", "negative-index", "too-deep", "over-budget",
         "float-index", "bool-index", "string-path", "int-path"],
)
def test_bad_tree_names_the_path(choices, kwargs, message):
    kw = {"num_heads": 3, "topk": 10, **kwargs}
    with pytest.raises(InvalidTreeError, match=message):
        make_tree(choices, **kw)


def test_budget_exactly_met_is_accepted():
    assert make_tree([[0], [1], [2]], num_heads=1, budget=4).size == 4


# --- JSON round trip ------------------------------------------------------------------------------


def test_json_round_trip(hand_tree, tmp_path):
    data = json.loads(json.dumps(hand_tree.to_json()))
    assert data["format"] == "medusa-export-tree" and data["topk"] == 2
    assert tree_from_json(data, num_heads=3) == hand_tree
    path = tmp_path / "tree.json"
    path.write_text(json.dumps(hand_tree.to_json()))
    assert load_tree(path, num_heads=3) == hand_tree
    assert tree_from_spec(str(path), num_heads=3) == hand_tree
    # a bare list of paths works too (topk from the argument)
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(HAND_CHOICES))
    assert load_tree(bare, num_heads=3, topk=2) == hand_tree


def test_json_with_buffers_matches_buffers(hand_tree):
    data = json.loads(json.dumps(hand_tree.to_json_with_buffers()))
    b = hand_tree.buffers()
    np.testing.assert_array_equal(np.array(data["buffers"]["attention_mask"], bool), b.attention_mask)
    np.testing.assert_array_equal(data["buffers"]["retrieve_indices"], b.retrieve_indices)
    np.testing.assert_array_equal(data["buffers"]["candidate_index"], b.candidate_index)
    assert tree_from_json(data, num_heads=3) == hand_tree


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "does not exist"),
        ("{not json", "not valid JSON"),
        ('{"topk": 10}', "no 'medusa_choices' key"),
        ('{"medusa_choices": 3}', "must be a list of paths"),
        ("[[0], [2, 0, 0]]", r"tree path \[2, 0, 0\] has no parent"),
    ],
    ids=["missing-file", "bad-json", "no-choices", "choices-not-list", "invalid-tree"],
)
def test_bad_tree_file(tmp_path, content, message):
    path = tmp_path / "tree.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(InvalidTreeError, match=message):
        load_tree(path, num_heads=4)


# --- presets and greedy trees from accuracies ----------------------------------------------------


def test_presets():
    assert tree_from_spec("root", num_heads=4).size == 1
    chain = tree_from_spec("chain", num_heads=4)
    assert chain.choices == ((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0))
    np.testing.assert_array_equal(chain.buffers().retrieve_indices, [[0, 1, 2, 3, 4]])
    assert set(PRESETS) == {"root", "chain"}


def test_unknown_preset_lists_presets():
    with pytest.raises(InvalidTreeError, match=r"unknown tree 'bushy'.*preset: chain, root"):
        tree_from_spec("bushy", num_heads=4)


@pytest.mark.parametrize("budget", [1, 4, 16, 64])
def test_budget_tree_has_exactly_budget_nodes(budget):
    t = tree_from_spec(str(budget), num_heads=4)
    assert t.size == budget
    assert t.max_depth <= 4


def test_default_prior_trees_by_hand():
    # default_accuracies(4): head k top-1 = 0.6 * 0.75**(k-1); other choices share half the rest.
    # [0]=.6, [0,0]=.27, [0,0,0]=.091, then [1]~.071 beats [0,1]~.059 and [0,0,0,0]~.023.
    assert tree_from_spec("4", num_heads=4).choices == ((0,), (0, 0), (0, 0, 0))
    assert tree_from_spec("5", num_heads=4).choices == ((0,), (1,), (0, 0), (0, 0, 0))
    acc = default_accuracies(4)
    assert acc.shape == (4, 10) and acc[0, 0] == pytest.approx(0.6) and acc[3, 0] == pytest.approx(0.6 * 0.75**3)


def test_greedy_tree_from_accuracies():
    acc = np.array([[0.5, 0.4], [0.9, 0.1]])
    t = greedy_tree(4, acc)
    assert t.choices == ((0,), (1,), (0, 0))  # [0]=.5, [0,0]=.45, [1]=.4; [1,0]=.36 left out
    assert expected_accept_length(t, acc) == pytest.approx(1 + 0.5 + 0.4 + 0.45)
    # greedy trees are nested: each budget extends the smaller one
    small = set(tree_from_spec("16", num_heads=4).choices)
    assert small < set(tree_from_spec("64", num_heads=4).choices)


@pytest.mark.parametrize("budget", [0, -3])
def test_greedy_tree_rejects_bad_budget(budget):
    with pytest.raises(InvalidTreeError, match="budget must be >= 1"):
        greedy_tree(budget, default_accuracies(2))


# --- property: buffers of any valid tree are consistent -------------------------------------------


@st.composite
def valid_choices(draw):
    num_heads = draw(st.integers(1, 4))
    topk = draw(st.integers(1, 4))
    raw = draw(st.lists(st.lists(st.integers(0, topk - 1), min_size=1, max_size=num_heads), max_size=25))
    closed = {tuple(p[:i]) for p in raw for i in range(1, len(p) + 1)}  # add every prefix
    order = draw(st.permutations(sorted(closed)))
    return [list(p) for p in order], num_heads, topk


@settings(max_examples=150, deadline=None)
@given(valid_choices())
def test_buffers_consistent_for_random_trees(case):
    choices, num_heads, topk = case
    tree = make_tree(choices, num_heads=num_heads, topk=topk)
    b = tree.buffers()
    paths = [()] + list(tree.choices)
    assert tree.size == len(set(map(tuple, choices))) + 1
    assert paths == sorted(paths, key=lambda p: (len(p), p))
    index = {p: n for n, p in enumerate(paths)}
    for n, path in enumerate(paths):
        ancestors = {index[path[:i]] for i in range(len(path) + 1)}  # includes the node itself
        assert set(np.flatnonzero(b.attention_mask[n])) == ancestors
        assert b.depth[n] == len(path)
        assert b.parent[n] == (index[path[:-1]] if path else -1)
        assert b.candidate_index[n] == (1 + (len(path) - 1) * topk + path[-1] if path else 0)
    has_child = {int(p) for p in b.parent if p >= 0}
    assert b.retrieve_indices.shape[1] == tree.max_depth + 1
    seen = set()
    for row in b.retrieve_indices:
        nodes = [int(n) for n in row if n >= 0]
        assert (row[len(nodes):] == -1).all()
        assert nodes[0] == 0 and nodes[-1] not in has_child  # root to a leaf
        assert [b.depth[n] for n in nodes] == list(range(len(nodes)))
        assert all(b.parent[c] == p for p, c in zip(nodes, nodes[1:]))
        seen.update(nodes)
    assert seen == set(range(tree.size))
    assert len(b.retrieve_indices) == tree.size - len(has_child)
