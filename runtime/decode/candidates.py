"""Candidates for a tree step: which tree, and which token on each node (pure numpy, no model).

Four cases, one interface (:class:`Proposal` = a :class:`~medusa_runtime.trees.tree.Tree` and the token
of each of its nodes):

===================  ==========================================  =========================================
heads \\ tree        static (``--tree N``, a preset, a file)      per step, T nodes (``--tree dynamic:T``)
===================  ==========================================  =========================================
Medusa (h_t only)    :func:`static_medusa`: every head once on    :func:`dynamic_medusa`: the T-node tree of
                     h_t, tokens gathered by ``candidate_index``  most expected accepted tokens from this
                     (Medusa paper §2.1.2)                           step's head probabilities (best first)
Hydra (path-         :func:`static_levels`: head d on every       :func:`dynamic_levels`: a beam of W nodes
conditioned)         depth-(d-1) node with children, level by     per level (EAGLE-2), the T-1 best of all
                     level                                        candidates
===================  ==========================================  =========================================

**Objective of the per-step trees** (EAGLE-2 arXiv 2406.16858 §4; OPT-Tree arXiv 2406.17276). Greedy verification accepts the longest prefix of the
backbone's greedy continuation that lies in the tree, so with v(n) = P(every node on the path
root -> n is right), E[tokens per step] = 1 + sum_{n != root} v(n). We estimate
v(n) = prod_{a on the path} c_d(q(a)), with q(a) the probability the head of depth d gave a and
c_d the head's calibration map (:class:`~medusa_runtime.trees.calibration.ProbabilityMap`: P(right | ancestors right, q)). Since
c_d <= 1, a child's v never exceeds its parent's, so the best T-node tree is the root plus the
T - 1 nodes of largest v (ties to the shallower node): that set is always a tree.

T is fixed: the step graph and engine shapes never change, only the values of the mask,
positions and tokens (all derived from the :class:`Tree` each step).
"""

from __future__ import annotations

import heapq
from typing import Callable, Generator, NamedTuple, Sequence

import numpy as np

from ..errors import InvalidTreeError
from ..contract.manifest import HEAD_TYPES  # medusa heads read h_t alone; hydra heads also read the path
from ..trees.tree import Tree, gather_candidates, make_tree
from ..trees.dynamic import DynamicTree, StepTree

#: ``run_level(depth, path_ids int64 [R, depth]) -> (ids int64 [R, k], logprobs float32 [R, k])``: the
#: path-conditioned head of that depth on R paths (root first), best first.
RunLevel = Callable[[int, np.ndarray], tuple[np.ndarray, np.ndarray]]


class Proposal(NamedTuple):
    """One step's tree and the token on each of its nodes (node order of ``tree``)."""

    tree: Tree
    tokens: np.ndarray  # int64 [T]


class HeadsCall(NamedTuple):
    """One run of the heads a step's candidates need; the driver runs it on the engine (:func:`run_heads`
    in :mod:`medusa_runtime.decode.loop`, or batched over many sequences by :mod:`medusa_runtime.decode.batch`) and sends
    the result back into the :data:`Plan`.

    ``kind`` and the result the plan expects:

    * "topk": the Medusa heads on h_t (``engine.heads``) -> int [K, >= topk] each head's best tokens;
    * "logprobs": the same with log-probabilities (``engine.heads_logprobs``) -> (ids [K, topk], float [K, topk]);
    * "level": path-conditioned head ``depth`` on ``path_ids`` int64 [R, depth] (root first;
      ``engine.heads_level``) -> (ids [R, topk], float [R, topk]).
    """

    kind: str
    topk: int
    depth: int = 0
    path_ids: np.ndarray | None = None


#: A step's candidate choice as a generator: it yields the :class:`HeadsCall` s it needs one at a time
#: (a level's paths depend on the level before), receives each result, and returns the :class:`Proposal`.
Plan = Generator[HeadsCall, object, Proposal]


# ---------------------------------------------------------------------------
# Static trees
# ---------------------------------------------------------------------------


def static_medusa(root: int, heads_ids: np.ndarray, tree: Tree) -> Proposal:
    """Medusa heads on a static tree: :func:`~medusa_runtime.trees.tree.gather_candidates`.

    Args:
        root: the backbone's next token.
        heads_ids: int [K, >= topk], head k's best tokens in row k-1.
        tree: the tree.
    """
    return Proposal(tree, gather_candidates(root, heads_ids, tree))


def plan_static_medusa(root: int, tree: Tree) -> Plan:
    """:func:`static_medusa` as a :data:`Plan`: one "topk" call."""
    ids = yield HeadsCall("topk", tree.topk)
    return static_medusa(root, ids, tree)


def plan_static_levels(root: int, tree: Tree) -> Plan:
    """Path-conditioned heads on a static tree, level by level (a :data:`Plan` of "level" calls).

    Head d runs once on every depth-(d-1) node that has children (its path root..node as input,
    in node order); the child ``[..., i]`` of that node gets its i-th best token.

    Args:
        root: the backbone's next token.
        tree: the tree (its ``choices`` index each level's top-k under the node's parent).
    """
    b = tree.buffers()
    tokens = np.zeros(tree.size, dtype=np.int64)
    tokens[0] = root
    paths = np.full((tree.size, tree.max_depth + 1), -1, dtype=np.int64)
    paths[0, 0] = root
    rank = np.array([0] + [c[-1] for c in tree.choices], dtype=np.int64)
    for d in range(1, tree.max_depth + 1):
        children = np.flatnonzero(b.depth == d)
        parents = np.unique(b.parent[children])
        ids, _ = yield HeadsCall("level", tree.topk, d, paths[parents, :d])
        row = np.searchsorted(parents, b.parent[children])
        tokens[children] = ids[row, rank[children]]
        paths[children, :d] = paths[b.parent[children], :d]
        paths[children, d] = tokens[children]
    return Proposal(tree, tokens)


def run_plan(plan: Plan, run: Callable[[HeadsCall], object]) -> Proposal:
    """Drive a :data:`Plan` to its :class:`Proposal`, answering each call with ``run(call)``."""
    try:
        call = next(plan)
        while True:
            call = plan.send(run(call))
    except StopIteration as stop:
        return stop.value


def _levels(run_level: RunLevel) -> Callable[[HeadsCall], object]:
    return lambda call: run_level(call.depth, call.path_ids)


def static_levels(root: int, tree: Tree, run_level: RunLevel) -> Proposal:
    """:func:`plan_static_levels` with the heads run by ``run_level`` (:data:`RunLevel`)."""
    return run_plan(plan_static_levels(root, tree), _levels(run_level))


# ---------------------------------------------------------------------------
# Per-step trees
# ---------------------------------------------------------------------------


def best_first_paths(scores: np.ndarray, count: int) -> list[tuple[tuple[int, ...], float]]:
    """The ``count`` paths of largest product score when level d's i-th choice scores ``scores[d-1, i]``.

    Args:
        scores: float [K, k], each row non-increasing in i, values in [0, 1].
        count: paths wanted (fewer when there are fewer).

    Returns:
        [(path, score)], best first (ties: shallower, then smaller path first). Every prefix of a
        returned path is returned before it, so the paths form a tree.

    Cost: O(count log count): popping a path pushes only its first child and its next sibling,
    which are the only candidates it makes best (rows are sorted, scores <= 1).
    """
    num, k = scores.shape
    out: list[tuple[tuple[int, ...], float]] = []
    if num == 0 or k == 0 or count <= 0:
        return out
    heap = [(-float(scores[0, 0]), 1, (0,), float(scores[0, 0]))]
    prefix_score = {(): 1.0}
    while heap and len(out) < count:
        _, depth, path, score = heapq.heappop(heap)
        out.append((path, score))
        prefix_score[path] = score
        if depth < num:  # first child
            s = score * float(scores[depth, 0])
            heapq.heappush(heap, (-s, depth + 1, path + (0,), s))
        i = path[-1] + 1
        if i < k:  # next sibling
            s = prefix_score[path[:-1]] * float(scores[depth - 1, i])
            heapq.heappush(heap, (-s, depth, path[:-1] + (i,), s))
    return out


def dynamic_medusa(root: int, heads_ids: np.ndarray, heads_logprobs: np.ndarray, spec: DynamicTree) -> Proposal:
    """The T-node tree of most expected accepted tokens for Medusa heads (independent levels).

    v(node [i1..id]) = prod_d c_d(q_d(i_d)): the heads do not see the path, so a node's
    probability is the product of its levels' (calibrated) marginals, the approximation of
    MEDUSA-Plus (arXiv 2502.05947), enumerated best first instead of over k^K.

    Args:
        root: the backbone's next token.
        heads_ids: int [K, >= topk], head k's best tokens (best first).
        heads_logprobs: float [K, >= topk], their log-probabilities.
        spec: the per-step tree (size T, top-k, calibration).
    """
    k = spec.topk
    prob = spec.probability()
    scores = np.stack([prob(d + 1, heads_logprobs[d, :k]) for d in range(spec.num_heads)])
    scores = np.minimum.accumulate(np.clip(scores, 0.0, 1.0), axis=1)  # ties of a flat map stay ordered
    paths = [p for p, _ in best_first_paths(scores, spec.size - 1)]
    tree = make_tree(paths, num_heads=spec.num_heads, topk=k)
    return Proposal(tree, gather_candidates(root, heads_ids, tree))


def plan_dynamic_medusa(root: int, spec: DynamicTree) -> Plan:
    """:func:`dynamic_medusa` as a :data:`Plan`: one "logprobs" call."""
    ids, logprobs = yield HeadsCall("logprobs", spec.topk)
    return dynamic_medusa(root, ids, logprobs, spec)


def plan_dynamic_levels(root: int, spec: DynamicTree) -> Plan:
    """The T-node tree for path-conditioned heads: a beam of W nodes per level (EAGLE-2), the T-1 best kept.

    Level 1: head 1 on the root gives k children with v = c_1(q). Level d: head d runs on the W
    depth-(d-1) candidates of largest v, giving W k children with v = v(parent) c_d(q). Every
    candidate of every level competes; the T - 1 of largest v form the tree. Levels stop early
    when the beam's best v is below the (T-1)-th best v found so far (nothing deeper can enter:
    OPT-Tree's stopping rule), which saves head runs on uncertain steps. The beam never needs more
    than T - 1 nodes: a node of the best tree is among the T - 1 best overall, so among the T - 1
    best of its level; with W >= T - 1 the tree is the exact optimum.

    Args:
        root: the backbone's next token.
        spec: the per-step tree (size T, top-k, width W, calibration).
    """
    k, need = spec.topk, spec.size - 1
    prob = spec.probability()
    if need == 0:
        return Proposal(make_tree([], num_heads=spec.num_heads, topk=k), np.array([root], dtype=np.int64))
    # Candidates: path (ranks), token path (root first), score.
    ids, lp = yield HeadsCall("level", k, 1, np.array([[root]], dtype=np.int64))
    v = np.minimum.accumulate(np.clip(prob(1, lp[0, :k]), 0.0, 1.0))
    cand_paths: list[tuple[int, ...]] = [(i,) for i in range(k)]
    cand_tokens: list[np.ndarray] = [np.array([root, ids[0, i]], dtype=np.int64) for i in range(k)]
    cand_v: list[float] = [float(x) for x in v]
    level = list(range(k))  # indices of the newest level's candidates
    for d in range(2, spec.num_heads + 1):
        beam = sorted(level, key=lambda c: -cand_v[c])[:min(spec.width, need)]
        if len(cand_v) >= need and cand_v[beam[0]] < np.partition(np.asarray(cand_v), -need)[-need]:
            break  # deeper candidates score below the T-1 best already found
        ids, lp = yield HeadsCall("level", k, d, np.stack([cand_tokens[c] for c in beam]))
        q = np.clip(prob(d, lp[:, :k]), 0.0, 1.0)
        level = []
        for r, parent in enumerate(beam):
            for i in range(k):
                cand_paths.append(cand_paths[parent] + (i,))
                cand_tokens.append(np.append(cand_tokens[parent], ids[r, i]))
                cand_v.append(cand_v[parent] * float(q[r, i]))
                level.append(len(cand_v) - 1)
    # A child never outscores its parent and is deeper, so this order puts every parent first: a tree.
    order = sorted(range(len(cand_v)), key=lambda c: (-cand_v[c], len(cand_paths[c]), cand_paths[c]))[:need]
    tree = make_tree([cand_paths[c] for c in order], num_heads=spec.num_heads, topk=k)
    token_of = {cand_paths[c]: int(cand_tokens[c][-1]) for c in order}
    tokens = np.array([root] + [token_of[p] for p in tree.choices], dtype=np.int64)
    return Proposal(tree, tokens)


def dynamic_levels(root: int, run_level: RunLevel, spec: DynamicTree) -> Proposal:
    """:func:`plan_dynamic_levels` with the heads run by ``run_level`` (:data:`RunLevel`)."""
    return run_plan(plan_dynamic_levels(root, spec), _levels(run_level))


#: The candidate plan of each (head type, tree policy): the table in :func:`plan_for`.
PLANS: dict[tuple[str, str], Callable[[int, StepTree], Plan]] = {
    ("medusa", "static"): plan_static_medusa, ("medusa", "dynamic"): plan_dynamic_medusa,
    ("hydra", "static"): plan_static_levels, ("hydra", "dynamic"): plan_dynamic_levels,
}


def plan_for(head_type: str, tree: StepTree) -> Callable[[int], Plan]:
    """The candidate choice of a step for a head type and a tree policy: ``root -> Plan``.

    ========  ============================  =============================
    heads     static :class:`Tree`          :class:`DynamicTree`
    ========  ============================  =============================
    medusa    :func:`plan_static_medusa`    :func:`plan_dynamic_medusa`
    hydra     :func:`plan_static_levels`    :func:`plan_dynamic_levels`
    ========  ============================  =============================

    Raises:
        InvalidTreeError: a head type other than :data:`HEAD_TYPES`.
    """
    if head_type not in HEAD_TYPES:
        raise InvalidTreeError(f"unknown head type {head_type!r}; the runtime runs {', '.join(HEAD_TYPES)} heads")
    plan = PLANS[head_type, tree.policy]
    return lambda root: plan(root, tree)


def expected_tokens(scores_per_node: Sequence[float]) -> float:
    """E[tokens per step] = 1 + sum of the nodes' path probabilities v(n) (the objective above)."""
    return 1.0 + float(np.sum(scores_per_node))
