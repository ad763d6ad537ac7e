"""Token trees for Medusa verification: ``medusa_choices`` -> tree buffers.

Pure numpy, no model. A tree is a list of paths (``medusa_choices``): the path
``[i1, ..., ik]`` is the node whose token is the ``ik``-th top prediction of Medusa
head ``k`` (1-based head numbering as in Medusa paper §2.1.1: head k predicts token
t+k+1), placed under the node ``[i1, ..., i(k-1)]``. The root (depth 0, path ``[]``)
is the backbone's own next token and is always present.

Node order (the "slot" order of the tree step) is: root first, then paths sorted by
(depth, path). Every buffer below is derived from that order; none is stored twice.

Sources: Medusa paper §2.1.2 (tree attention, position = prefix length + depth) and
§2.3.3 (greedy sparse tree from per-head top-i accuracies).
"""

from __future__ import annotations

import heapq
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from ..errors import InvalidTreeError

#: Candidate top-k taken from each Medusa head when a tree does not say otherwise
#: (FasterDecoding/Medusa uses 10).
DEFAULT_TOPK = 10

TREE_FORMAT = "medusa-export-tree"
TREE_FORMAT_VERSION = 1


@dataclass(frozen=True)
class TreeBuffers:
    """Every array the tree step and acceptance need, derived from ``medusa_choices``.

    Attributes:
        attention_mask: bool [T, T]; ``[i, j]`` is True when node i may attend to node j
            (j is i itself or one of its ancestors). The past is always fully visible
            and is not part of this mask.
        depth: int64 [T]; the node's depth (root 0). Position id = past length + depth.
        parent: int64 [T]; index of the parent node, -1 for the root.
        candidate_index: int64 [T]; index into the flat candidate vector
            ``concat([root_token], heads_topk.reshape(-1))`` (length 1 + K * topk),
            i.e. 0 for the root and ``1 + (k - 1) * topk + i_k`` for a node at depth k.
        retrieve_indices: int64 [P, D + 1]; one row per root-to-leaf path (leaves in
            node order), node indices from the root down, padded with -1.
    """

    attention_mask: np.ndarray
    depth: np.ndarray
    parent: np.ndarray
    candidate_index: np.ndarray
    retrieve_indices: np.ndarray


@dataclass(frozen=True)
class Tree:
    """A validated Medusa token tree.

    Attributes:
        choices: the non-root paths in node order (sorted by depth, then path).
        topk: the candidate top-k per head; every path index is < topk.
        num_heads: number of Medusa heads the tree was validated against; depth <= it.
    """

    choices: tuple[tuple[int, ...], ...]
    topk: int = DEFAULT_TOPK
    num_heads: int = 4
    _buffers: TreeBuffers | None = field(default=None, repr=False, compare=False)

    @property
    def size(self) -> int:
        """Number of nodes T, root included."""
        return len(self.choices) + 1

    @property
    def max_depth(self) -> int:
        """Depth of the deepest node (0 for a root-only tree)."""
        return max((len(c) for c in self.choices), default=0)

    #: A static tree (:data:`~medusa_runtime.trees.dynamic.StepTree`'s "static"): the same nodes every step.
    policy = "static"
    #: The manifest's ``tree.policy`` of a static tree: none.
    policy_spec = ""

    def static_shape(self, accuracies=None) -> "Tree":
        """Itself (a per-step tree answers with the static tree of its size; ``accuracies`` is unused here)."""
        return self

    def buffers(self) -> TreeBuffers:
        """Derive the tree buffers (cached on first call). See :class:`TreeBuffers`."""
        if self._buffers is None:
            object.__setattr__(self, "_buffers", build_buffers(self.choices, self.topk))
        return self._buffers

    def to_json(self) -> dict:
        """The tree as a JSON-able dict (format tag, version, topk, heads, choices)."""
        return {
            "format": TREE_FORMAT,
            "version": TREE_FORMAT_VERSION,
            "topk": self.topk,
            "num_heads": self.num_heads,
            "medusa_choices": [list(c) for c in self.choices],
        }

    def to_json_with_buffers(self) -> dict:
        """:meth:`to_json` plus the derived buffers as nested lists (for C++ / Triton users)."""
        data = self.to_json()
        b = self.buffers()
        data["buffers"] = {
            "attention_mask": b.attention_mask.astype(np.int8).tolist(),
            "depth": b.depth.tolist(),
            "parent": b.parent.tolist(),
            "candidate_index": b.candidate_index.tolist(),
            "retrieve_indices": b.retrieve_indices.tolist(),
        }
        return data


def make_tree(
    choices: Iterable[Sequence[int]],
    *,
    num_heads: int,
    topk: int = DEFAULT_TOPK,
    budget: int | None = None,
) -> Tree:
    """Validate ``medusa_choices`` and return a :class:`Tree` in canonical node order.

    Args:
        choices: paths, each a sequence of non-negative ints; ``[]`` (the root) may be
            given and is ignored.
        num_heads: number of Medusa heads K; a path deeper than K is rejected.
        topk: candidate top-k per head; every index must be < topk.
        budget: maximum node count T (root included), or None for no limit.

    Returns:
        The validated tree.

    Raises:
        InvalidTreeError: a path that is not a list of ints, a negative or out-of-range
            top-k index, depth > num_heads, a duplicate node, a missing parent, or more
            nodes than the budget. The message names the offending path.
    """
    if num_heads < 1:
        raise InvalidTreeError(f"num_heads must be >= 1, got {num_heads}")
    if topk < 1:
        raise InvalidTreeError(f"topk must be >= 1, got {topk}")
    paths: list[tuple[int, ...]] = []
    seen: set[tuple[int, ...]] = set()
    for raw in choices:
        if isinstance(raw, (str, bytes)) or not hasattr(raw, "__iter__"):
            raise InvalidTreeError(f"tree path {raw!r} is not a list of ints")
        path = tuple(raw)
        if not all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in path):
            raise InvalidTreeError(f"tree path {list(raw)!r} is not a list of ints")
        path = tuple(int(i) for i in path)
        if not path:
            continue  # the root is implicit
        if len(path) > num_heads:
            raise InvalidTreeError(
                f"tree path {list(path)} has depth {len(path)} but the model has only "
                f"{num_heads} Medusa heads (depth must be <= {num_heads})"
            )
        for i in path:
            if i < 0 or i >= topk:
                raise InvalidTreeError(
                    f"tree path {list(path)} uses top-k index {i}; valid indices are 0..{topk - 1}"
                )
        if path in seen:
            raise InvalidTreeError(f"tree path {list(path)} appears more than once")
        seen.add(path)
        paths.append(path)
    for path in paths:
        if len(path) > 1 and path[:-1] not in seen:
            raise InvalidTreeError(
                f"tree path {list(path)} has no parent: add {list(path[:-1])} or remove it"
            )
    if budget is not None and len(paths) + 1 > budget:
        ordered = sorted(paths, key=lambda p: (len(p), p))
        raise InvalidTreeError(
            f"tree has {len(paths) + 1} nodes (root included) but the budget is {budget}; "
            f"first path over budget: {list(ordered[budget - 1])}"
        )
    ordered = tuple(sorted(paths, key=lambda p: (len(p), p)))
    return Tree(choices=ordered, topk=topk, num_heads=num_heads)


def build_buffers(choices: Sequence[tuple[int, ...]], topk: int) -> TreeBuffers:
    """Derive :class:`TreeBuffers` from paths already in canonical node order.

    Args:
        choices: validated non-root paths sorted by (depth, path).
        topk: candidate top-k per head.

    Returns:
        The buffers; T = len(choices) + 1.
    """
    index = {(): 0}
    for n, path in enumerate(choices, start=1):
        index[path] = n
    size = len(choices) + 1
    depth = np.zeros(size, dtype=np.int64)
    parent = np.full(size, -1, dtype=np.int64)
    cand = np.zeros(size, dtype=np.int64)
    mask = np.eye(size, dtype=bool)
    for path, n in index.items():
        if not path:
            continue
        depth[n] = len(path)
        parent[n] = index[path[:-1]]
        cand[n] = 1 + (len(path) - 1) * topk + path[-1]
        mask[n] = mask[parent[n]]
        mask[n, n] = True
    has_child = np.zeros(size, dtype=bool)
    has_child[parent[parent >= 0]] = True
    leaves = [n for n in range(size) if not has_child[n]]
    max_depth = int(depth.max()) if size else 0
    retrieve = np.full((len(leaves), max_depth + 1), -1, dtype=np.int64)
    for row, leaf in enumerate(leaves):
        chain = []
        n = leaf
        while n >= 0:
            chain.append(n)
            n = parent[n]
        retrieve[row, : len(chain)] = chain[::-1]
    return TreeBuffers(mask, depth, parent, cand, retrieve)


def gather_candidates(root_token: int, heads_topk: np.ndarray, tree: Tree) -> np.ndarray:
    """Fill the tree's nodes with tokens (Medusa paper Algorithm step 2).

    Args:
        root_token: the backbone's next token (node 0).
        heads_topk: int [K, >=topk]; row k-1 holds head k's top tokens, best first.
        tree: the tree.

    Returns:
        int64 [T]: the token at each node.

    Raises:
        ValueError: heads_topk has fewer heads than the tree's depth or fewer than topk columns.
    """
    heads_topk = np.asarray(heads_topk)
    if heads_topk.ndim != 2 or heads_topk.shape[0] < tree.max_depth or heads_topk.shape[1] < tree.topk:
        raise ValueError(
            f"heads_topk has shape {heads_topk.shape}; the tree needs at least "
            f"[{tree.max_depth}, {tree.topk}]"
        )
    flat = np.empty(1 + heads_topk.shape[0] * tree.topk, dtype=np.int64)
    flat[0] = root_token
    flat[1:] = heads_topk[:, : tree.topk].reshape(-1)
    return flat[tree.buffers().candidate_index]


# ---------------------------------------------------------------------------
# Trees from head accuracies (Medusa paper §2.3.3)
# ---------------------------------------------------------------------------


def default_accuracies(num_heads: int, topk: int = DEFAULT_TOPK) -> np.ndarray:
    """A prior for a_k^(i) when no calibration exists: float64 [K, topk].

    Head k's top-1 accuracy is taken as 0.6 * 0.75^(k-1), and the i-th choice gets a
    share decaying as 1/(i+1)^1.5 of what is left. Only the *order* matters to the
    greedy builder, so this gives a reasonable bushy-then-deep tree; calibrated
    accuracies (``medusa-export calibrate``) replace it.
    """
    acc = np.zeros((num_heads, topk), dtype=np.float64)
    for k in range(num_heads):
        top1 = 0.6 * 0.75**k
        rest = np.array([1.0 / (i + 1) ** 1.5 for i in range(1, topk)])
        rest = rest / rest.sum() * (1.0 - top1) * 0.5
        acc[k, 0] = top1
        acc[k, 1:] = rest
    return acc


def expected_accept_length(tree: Tree, accuracies: np.ndarray) -> float:
    """Expected tokens per step for a tree under independent head accuracies.

    Sum over nodes of prod_j a_j^(i_j), plus 1 for the root token (always produced).
    Source: Medusa paper §2.3.3.

    Args:
        tree: the tree.
        accuracies: float [K, topk]; ``accuracies[k-1, i]`` = a_k^(i), the probability that
            head k's i-th choice (0-based) is the correct token.
    """
    return 1.0 + sum(_path_accuracy(p, accuracies) for p in tree.choices)


def _path_accuracy(path: tuple[int, ...], acc: np.ndarray) -> float:
    return float(math.prod(acc[k, i] for k, i in enumerate(path)))


def greedy_tree(budget: int, accuracies: np.ndarray, *, topk: int | None = None) -> Tree:
    """Build the tree of ``budget`` nodes maximising expected accept length (Medusa paper §2.3.3).

    Repeatedly adds the connected node (parent already in the tree) with the highest
    estimated accuracy prod_j a_j^(i_j). Because a child's accuracy never exceeds its
    parent's, this greedy choice gives the optimal tree for the budget under the
    independence assumption. Ties are broken by the smaller (depth, path).

    Args:
        budget: node count T, root included (>= 1).
        accuracies: float [K, topk] as in :func:`expected_accept_length`.
        topk: candidate top-k; defaults to accuracies.shape[1].

    Raises:
        InvalidTreeError: budget < 1 or accuracies not 2-D.
    """
    acc = np.asarray(accuracies, dtype=np.float64)
    if acc.ndim != 2:
        raise InvalidTreeError(f"accuracies must be [num_heads, topk], got shape {acc.shape}")
    if budget < 1:
        raise InvalidTreeError(f"tree budget must be >= 1 node (the root), got {budget}")
    num_heads, width = acc.shape
    topk = width if topk is None else topk
    heap: list[tuple[float, int, tuple[int, ...]]] = []

    def push_children(path: tuple[int, ...]) -> None:
        if len(path) >= num_heads:
            return
        for i in range(min(topk, width)):
            child = path + (i,)
            heapq.heappush(heap, (-_path_accuracy(child, acc), len(child), child))

    chosen: list[tuple[int, ...]] = []
    push_children(())
    while heap and len(chosen) + 1 < budget:
        _, _, path = heapq.heappop(heap)
        chosen.append(path)
        push_children(path)
    return make_tree(chosen, num_heads=num_heads, topk=topk, budget=budget)


# ---------------------------------------------------------------------------
# Presets and JSON (the --tree grammar: medusa_runtime.trees.treespec)
# ---------------------------------------------------------------------------


def chain_tree(num_heads: int, topk: int = DEFAULT_TOPK, nodes: int | None = None) -> Tree:
    """The chain of the heads' top-1 guesses: [0], [0,0], ... ``nodes`` nodes with the root (default and at most
    ``num_heads + 1``: every head's).

    Raises:
        InvalidTreeError: ``nodes`` outside 1..num_heads + 1.
    """
    nodes = num_heads + 1 if nodes is None else int(nodes)
    if not 1 <= nodes <= num_heads + 1:
        raise InvalidTreeError(f"a chain of {num_heads} heads has 1..{num_heads + 1} nodes (root included), got {nodes}")
    return make_tree([(0,) * d for d in range(1, nodes)], num_heads=num_heads, topk=topk)


def is_chain(tree) -> bool:
    """Whether a tree is one path from the root (every node but the last has one child): its size is its depth + 1.
    A per-step tree (:class:`~medusa_runtime.trees.dynamic.DynamicTree`) of more than one node is not."""
    return tree.policy == "static" and tree.size == tree.max_depth + 1


def load_tree(path: str | Path, *, num_heads: int, topk: int = DEFAULT_TOPK) -> Tree:
    """Read a tree JSON file (a list of paths, or a dict with ``medusa_choices``).

    Raises:
        InvalidTreeError: the file is missing, a directory, unreadable, not UTF-8 or not valid JSON, or the
            tree is invalid.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise InvalidTreeError(f"tree file {path} does not exist") from None
    except IsADirectoryError:
        raise InvalidTreeError(f"tree file {path} is a directory; give a JSON file of medusa_choices") from None
    except OSError as exc:
        raise InvalidTreeError(f"tree file {path} cannot be read: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise InvalidTreeError(f"tree file {path} is not UTF-8 text (byte {exc.start}): a tree file is JSON "
                               "(a list of paths, or a dict with medusa_choices)") from None
    except json.JSONDecodeError as exc:
        raise InvalidTreeError(f"tree file {path} is not valid JSON: {exc}") from None
    return tree_from_json(data, num_heads=num_heads, topk=topk)


def tree_from_json(data, *, num_heads: int, topk: int = DEFAULT_TOPK) -> Tree:
    """Inverse of :meth:`Tree.to_json`; also accepts a bare list of paths.

    Raises:
        InvalidTreeError: wrong structure or invalid tree.
    """
    if isinstance(data, dict):
        if "medusa_choices" not in data:
            raise InvalidTreeError("tree JSON object has no 'medusa_choices' key")
        topk = int(data.get("topk", topk))
        choices = data["medusa_choices"]
    else:
        choices = data
    if not isinstance(choices, list):
        raise InvalidTreeError("medusa_choices must be a list of paths (lists of ints)")
    return make_tree(choices, num_heads=num_heads, topk=topk)
