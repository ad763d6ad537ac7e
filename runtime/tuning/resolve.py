"""The one place a ``--tree`` value becomes the tree that runs (issue 38).

``build`` (before the export and again after it), :class:`~medusa_runtime.front.session.MedusaSession`, both
CLIs and Triton all call :func:`resolve_tree`; the grammar itself is :mod:`medusa_runtime.trees.treespec`.

=====================  ===============================================  ==========================================
spec                   with an engine (a session, build after export)   without one (build, before the export)
=====================  ===============================================  ==========================================
None (the default)     ``$MEDUSA_EXPORT_TREE``, else the fastest tree   (build passes its registry entry's tree)
                       here, timed once and cached (:mod:`.treecache`);
                       engines built for one tree (TensorRT plans) run
                       the artifact's
``auto``,              time the tree step at several sizes now          the largest candidate, marked ``deferred``:
``auto:dynamic``       (:func:`~.autotree.auto_tree`), keep the most     build exports it and times after the export
                       expected tokens per second
``artifact``           the artifact's tree (per-step when it was built  refused: build writes the artifact
                       with ``dynamic:T`` and the engine runs them)
``N``, a preset, a     :func:`~medusa_runtime.trees.treespec.tree_from_spec`, checked against the heads graph
file, ``dynamic:T``
=====================  ===============================================  ==========================================
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np

from ..decode.loop import runs_dynamic_trees
from ..engines import backend_spec
from ..errors import InvalidTreeError, MedusaError
from ..trees.dynamic import DynamicTree, StepTree
from ..trees.tree import DEFAULT_TOPK, Tree, default_accuracies, is_chain
from ..contract.artifact import step_limits
from ..trees.treespec import BUILD_TREES, TreeSpec, most_nodes, parse_tree_spec, tree_from_spec
from .autotree import DEFAULT_SIZES, TreeTiming, auto_tree, candidate_trees, timing_noise
from .treecache import (DEFAULT_SPEC, TREE_ENV, DefaultTree, artifact_identity, backend_fingerprint, cached_choice,
                        default_spec, machine_fingerprint, timing_key)


@dataclass(frozen=True)
class TreeContext:
    """What resolving a spec may read.

    Attributes:
        num_heads: the heads K (the depth limit).
        topk: the heads graph's candidates per head (the most a tree may take).
        accuracies: float [K', topk] a_k^(i) (Medusa paper §2.3.3), or None (default accuracies).
        calibration: the heads' :class:`~medusa_runtime.trees.calibration.ProbabilityMap` (per-step trees), or None.
        simulated: measured tokens per step by tree size (``tree.json``'s ``simulated``), or None.
        artifact: the loaded :class:`~medusa_runtime.contract.artifact.Artifact` (``artifact`` spec, the default's
            cache), or None before one exists (build).
        engine: the engine that ``auto`` times (None: ``auto`` is deferred).
        backend: the engine's backend name (the default tree's cache key; fixed-tree backends).
        threads: the engine's threads (the cache key).
        capacity: the KV capacity in tokens the timing fits in (None: the artifact's).
        progress: called with a line per measurement of ``auto`` (None: silent).
        notice: called with one line when ``auto`` starts timing, when the default tree is timed, or when a
            fixed-tree engine runs the artifact's (None: silent).
        chains_only: Medusa is exact on chain trees only (the manifest's ``precision.step_rows``, an engine's
            ``capabilities.chain_trees``): ``auto`` and the default time chains, other trees are refused.
    """

    num_heads: int
    topk: int = DEFAULT_TOPK
    accuracies: np.ndarray | None = None
    calibration: object = None
    simulated: Mapping | None = None
    artifact: object = None
    engine: object = None
    backend: str | None = None
    threads: int | None = None
    capacity: int | None = None
    progress: Callable[[str], None] | None = None
    notice: Callable[[str], None] | None = None
    chains_only: bool = False

    @classmethod
    def of_artifact(cls, artifact, engine=None, **options) -> "TreeContext":
        """The context of a loaded artifact (its heads, accuracies and calibration), run on ``engine`` (whose
        capabilities say whether only chains are exact; without one, the artifact's manifest says)."""
        chains = (engine.capabilities.chain_trees if engine is not None
                  else step_limits(artifact.manifest).chain_trees)
        return cls(num_heads=engine.num_heads if engine is not None else artifact.tree.num_heads,
                   topk=artifact.tree.topk, accuracies=artifact.head_accuracies, calibration=artifact.calibration,
                   simulated=artifact.simulated, artifact=artifact, engine=engine, chains_only=chains, **options)


@dataclass(frozen=True)
class ResolvedTree:
    """A resolved ``--tree``.

    Attributes:
        tree: the tree that runs (:data:`~medusa_runtime.trees.dynamic.StepTree`); for a ``deferred`` one, the largest
            candidate, to be exported and timed.
        source: where it came from, for summaries ("--tree 8", "the artifact's", "fastest here, cached", ...).
        policy: "static" or "dynamic" (``auto:dynamic`` keeps it while ``deferred``).
        timings: the table ``auto`` timed (empty otherwise).
        default: how the default tree was obtained (timed now or cached), else None.
        deferred: ``auto`` without an engine: time it once the artifact exists.
    """

    tree: StepTree
    source: str
    policy: str = "static"
    timings: tuple[TreeTiming, ...] = field(default=())
    default: DefaultTree | None = None
    deferred: bool = False

    @property
    def timed_now(self) -> bool:
        """True when ``auto`` timed the sizes in this call (the CLI prints the table)."""
        return bool(self.timings) and self.default is None


def build_spec(spec: str | int) -> TreeSpec:
    """Parse ``build``'s ``--tree`` before anything opens (all but ``artifact``, which build writes).

    Raises:
        InvalidTreeError: what :func:`~medusa_runtime.trees.treespec.parse_tree_spec` raises, and ``artifact``; the
            message lists what build takes.
    """
    ts = parse_tree_spec(spec)
    if ts.kind == "artifact":
        raise InvalidTreeError(f"build writes the artifact, so --tree {ts.text} has no tree to take: give {BUILD_TREES}")
    return ts


def resolve_tree(spec: StepTree | TreeSpec | str | int | None, ctx: TreeContext) -> ResolvedTree:
    """The tree a spec means in ``ctx`` (the module's table).

    Args:
        spec: a ``--tree`` value, a parsed :class:`~medusa_runtime.trees.treespec.TreeSpec`, a tree (checked and
            kept), or None for the default.
        ctx: what may be read: the heads, the artifact, the engine.

    Returns:
        A :class:`ResolvedTree`.

    Raises:
        InvalidTreeError: a bad spec (:func:`~medusa_runtime.trees.treespec.parse_tree_spec`), ``artifact`` without an
            artifact, a node budget the heads cannot make.
        MedusaError: a tree wider or deeper than the artifact's heads graph.
    """
    if isinstance(spec, (Tree, DynamicTree)):
        return ResolvedTree(_fits(_chain_checked(spec, "the given tree", ctx), ctx), "as given", spec.policy)
    if spec is None:
        if ctx.backend is not None and backend_spec(ctx.backend).fixed_tree:  # e.g. TensorRT plans
            base = ctx.artifact.tree
            if ctx.notice:
                ctx.notice(f"the {ctx.backend} engine is built for the artifact's {base.size}-node tree: running it "
                           f"(no timing of other sizes; --tree picks another)")
            return ResolvedTree(base, "the tree the engine was built for")
        spec = default_spec()
        if spec == DEFAULT_SPEC and ctx.engine is not None:
            return _fastest_here(ctx)
        source = f"${TREE_ENV}={spec}"
    else:
        source = None
    ts = spec if isinstance(spec, TreeSpec) else parse_tree_spec(spec)
    source = source or f"--tree {ts.text}"
    if ts.kind == "artifact":
        if ctx.artifact is None:
            build_spec(ts)  # raises
        source = "the artifact's"
        policy = ctx.artifact.manifest.tree.policy  # "dynamic:T" when built with --tree dynamic:T
        if not policy or ctx.engine is None or not runs_dynamic_trees(ctx.engine.capabilities):
            return ResolvedTree(_chain_checked(ctx.artifact.tree, "the artifact's tree", ctx), source)
        ts = parse_tree_spec(policy)
    if ts.kind == "auto":
        policy = "chain" if ctx.chains_only else ts.policy
        if ctx.engine is None:  # build: export the largest candidate, time after the export
            most = ctx.num_heads + 1 if ctx.chains_only else min(max(DEFAULT_SIZES), most_nodes(ctx.num_heads, ctx.topk))
            tree = tree_from_spec(f"chain:{most}" if ctx.chains_only else str(most), num_heads=ctx.num_heads,
                                  topk=ctx.topk, accuracies=ctx.accuracies)
            return ResolvedTree(tree, source, policy, deferred=True)
        if ctx.notice:
            ctx.notice(f"--tree {ts.text}: timing the tree step at several sizes on this engine"
                       + (" (chains: this engine's Medusa is exact on chains only)" if ctx.chains_only else "") + " ...")
        tree, table = auto_tree(ctx.engine, ctx.accuracies, capacity=_capacity(ctx), topk=ctx.topk,
                                progress=ctx.progress, policy=policy, calibration=ctx.calibration,
                                simulated=ctx.simulated)
        noisy = timing_noise(table)
        if noisy and ctx.notice:
            ctx.notice(f"--tree {ts.text}: {noisy}")
        return ResolvedTree(tree, f"--tree {ts.text}, timed now", policy, tuple(table))
    tree = tree_from_spec(ts, num_heads=ctx.num_heads, topk=ctx.topk, accuracies=ctx.accuracies,
                          calibration=ctx.calibration)
    return ResolvedTree(_fits(_chain_checked(tree, f"--tree {ts.text}", ctx), ctx), source, tree.policy)


def _chain_checked(tree: StepTree, what: str, ctx: TreeContext) -> StepTree:
    """``tree`` itself, unless only chains are exact here and it is not one.

    Raises:
        InvalidTreeError: a branching or per-step tree where ``ctx.chains_only``; the message names the choices.
    """
    if ctx.chains_only and not is_chain(tree):
        raise InvalidTreeError(
            f"{what} ({tree.size} nodes, depth {tree.max_depth}) branches, but this artifact's backbone computes with "
            f"int8 activations (precision.step_rows: MatMulNBits accuracy level 4), where Medusa equals plain greedy "
            f"decoding only on a chain. Use --tree auto, chain, chain:N (N = 1..{ctx.num_heads + 1}) or root; or "
            f"build with --accuracy-level 1 (fp32 activations, any tree)")
    return tree


def _capacity(ctx: TreeContext) -> int | None:
    return ctx.capacity if ctx.capacity is not None else (ctx.artifact.model.max_context if ctx.artifact else None)


def _fits(tree: StepTree, ctx: TreeContext) -> StepTree:
    if ctx.artifact is not None and (tree.topk > ctx.topk or tree.max_depth > ctx.num_heads):
        raise MedusaError(f"tree (topk {tree.topk}, depth {tree.max_depth}) exceeds the artifact's heads graph "
                          f"(topk {ctx.topk}, {ctx.num_heads} heads)")
    return tree


def _fastest_here(ctx: TreeContext) -> ResolvedTree:
    """The default tree: the cached ``auto`` choice for this artifact, machine and backend, timed and cached when
    there is none or it is stale (:mod:`.treecache`)."""
    art, engine = ctx.artifact, ctx.engine
    policy = ("chain" if ctx.chains_only else
              "dynamic" if art.manifest.tree.policy and runs_dynamic_trees(engine.capabilities) else "static")
    key = timing_key(artifact=artifact_identity({f: c.sha256 for f, c in art.manifest.checksums.items()}),
                     machine=machine_fingerprint(), backend=backend_fingerprint(ctx.backend, engine, ctx.threads),
                     capacity=_capacity(ctx), policy=policy)
    acc = ctx.accuracies if ctx.accuracies is not None else default_accuracies(ctx.num_heads, ctx.topk)

    def measure():
        tree, table = auto_tree(engine, acc, capacity=_capacity(ctx), topk=ctx.topk, progress=ctx.progress,
                                policy=policy, calibration=ctx.calibration, simulated=ctx.simulated,
                                sizes=key["sizes"], margin=key["margin"])
        return tree.size, table

    # a noisy timing is used now but not cached: a later, quieter run times again
    choice = cached_choice(art.path, key, measure, cacheable=lambda table: timing_noise(table, key["margin"]) is None)
    noisy = timing_noise(choice.record.table, key["margin"]) if choice.timed else None
    if noisy and ctx.notice:
        ctx.notice(f"the default tree: {noisy}; not cached")
    if choice.timed and ctx.notice:
        ctx.notice(choice.notice())
    # the chosen size's tree, as auto_tree made it (greedy trees are a function of the accuracies)
    tree = candidate_trees(acc, [choice.record.chosen], num_heads=ctx.num_heads, topk=ctx.topk, policy=policy,
                           calibration=ctx.calibration)[choice.record.chosen]
    return ResolvedTree(tree, choice.describe(), policy, tuple(choice.record.table), default=choice)
