"""Hardware-aware trees (``--tree auto``): the tree that maximises accepted tokens per second.

Medusa papers and tools pick the tree that maximises accepted tokens *per step* for a node
budget (Medusa paper §2.3.3). On a GPU a bigger tree step is nearly free, but on a CPU the tree
step's cost grows with the node count, so the best tree is the one that maximises

    tokens/s(N) = E[accepted tokens per step](N) / (t_step(N) + t_heads)

where E[...] is what ``medusa-export calibrate`` simulated for the head type and tree policy in
use (``simulated`` in ``accuracies.json`` / ``tree.json``: static greedy trees or per-step trees
of N nodes, on held-out replies), else the expected accepted length of the greedy tree of N
nodes under the calibrated head accuracies (Medusa paper §2.3.3,
:func:`medusa_runtime.trees.tree.expected_accept_length`), and the times are measured on the target
engine: the tree step, and the heads with the candidate selection (per size: per-step trees and
path-conditioned heads cost more with more nodes). N = 1 is plain decoding (no heads run).

:func:`choose_tree` is the pure choice from measured times; :func:`time_tree_steps` does the
measuring; :func:`auto_tree` combines both.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Sequence

import numpy as np

from ..trees.calibration import ProbabilityMap
from ..errors import InvalidTreeError
from ..trees.tree import DEFAULT_TOPK, chain_tree, default_accuracies, expected_accept_length, greedy_tree, make_tree
from ..trees.dynamic import DEFAULT_WIDTH, DynamicTree, StepTree

#: Tree policies: one fixed tree, or a tree of fixed size chosen every step.
POLICIES = ("static", "dynamic", "chain")

#: Node counts tried by ``--tree auto`` (1 = plain decoding).
DEFAULT_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
#: Past length (tokens already in the cache) at which steps are timed: a typical mid-reply context.
DEFAULT_PAST_LENGTH = 256
#: How much faster (a fraction) a tree must be expected to run than plain decoding to be chosen over it.
#: The expected tokens per step are a calibrated mean over held-out replies, and one prompt accepts less or
#: more: on the embedded model the 4-node tree's calibrated 1.395 tokens/step was 1.24-1.31 on the README's
#: prompt (6-11% less), and repeated timings of the same sizes differ by a few percent (docs/trees.md).
#: Below this margin plain decoding is kept: it is never slower than itself.
DEFAULT_MARGIN = 0.1
#: Tokens generated per decode-loop timing (:func:`time_decode_loop`).
LOOP_TOKENS = 16


@dataclass(frozen=True)
class TreeTiming:
    """One candidate tree size with its prediction and measured cost.

    Attributes:
        size: node count N (root included; 1 = plain decoding).
        expected_tokens: expected tokens per step, root included (Medusa paper §2.3.3).
        step_ms: measured engine time of one step of N nodes, milliseconds.
        heads_ms: measured heads-graph time added to each step (0 for N = 1), milliseconds.
        loop_ms: measured wall time per step of the whole decode loop with this tree (engine,
            heads and the host's work: candidates, acceptance, KV compaction), milliseconds; None
            when not measured (:func:`refine_with_loop` measures the leading sizes).
        overhead_ms: the loop's cost beyond step_ms + heads_ms, estimated from the sizes whose loop
            was measured (used when ``loop_ms`` is None), milliseconds.
        spread: the step timing's relative spread, (75th - 25th percentile) / median of its repeats (0: not
            measured); :func:`timing_noise` compares a pick's lead with it.
    """

    size: int
    expected_tokens: float
    step_ms: float
    heads_ms: float
    loop_ms: float | None = None
    overhead_ms: float = 0.0
    spread: float = 0.0

    @property
    def ms_per_step(self) -> float:
        """The step's cost: ``loop_ms`` when measured, else step_ms + heads_ms + overhead_ms."""
        return self.loop_ms if self.loop_ms is not None else self.step_ms + self.heads_ms + self.overhead_ms

    @property
    def tokens_per_second(self) -> float:
        """Expected tokens per second: expected_tokens / :attr:`ms_per_step`."""
        return 1e3 * self.expected_tokens / self.ms_per_step

    def to_json(self) -> dict:
        doc = {"size": self.size, "expected_tokens_per_step": round(self.expected_tokens, 4),
               "step_ms": round(self.step_ms, 3), "heads_ms": round(self.heads_ms, 3),
               "expected_tokens_per_second": round(self.tokens_per_second, 2)}
        if self.loop_ms is not None:
            doc["loop_ms"] = round(self.loop_ms, 3)
        elif self.overhead_ms:
            doc["overhead_ms"] = round(self.overhead_ms, 3)
        if self.spread:
            doc["spread"] = round(self.spread, 4)
        return doc


def candidate_trees(accuracies: np.ndarray, sizes: Sequence[int], *, num_heads: int,
                    topk: int = DEFAULT_TOPK, policy: str = "static", calibration: ProbabilityMap | None = None,
                    width: int = DEFAULT_WIDTH) -> dict[int, StepTree]:
    """The tree of each size under a policy (size 1: the root alone).

    Args:
        accuracies: float [K', topk'] calibrated a_k^(i); rows beyond ``num_heads`` and
            columns beyond ``topk`` are ignored.
        sizes: node counts (each >= 1).
        num_heads, topk: the engine's heads and candidate top-k.
        policy: "static" (the greedy tree of each size), "dynamic" (a per-step tree of each size) or "chain" (the
            chain of each size; sizes above ``num_heads + 1`` are left out: no chain is longer).
        calibration, width: of the per-step trees.

    Raises:
        InvalidTreeError: a size < 1, accuracies not 2-D, or an unknown policy.
    """
    acc = np.asarray(accuracies, dtype=np.float64)
    if acc.ndim != 2:
        raise InvalidTreeError(f"accuracies must be [num_heads, topk], got shape {acc.shape}")
    if policy not in POLICIES:
        raise InvalidTreeError(f"unknown tree policy {policy!r}; choose {' or '.join(POLICIES)}")
    acc = acc[:num_heads, :topk]
    out: dict[int, StepTree] = {}
    for n in sorted(set(int(s) for s in sizes)):
        if n < 1:
            raise InvalidTreeError(f"tree sizes must be >= 1 node, got {n}")
        if n == 1:
            out[n] = make_tree([], num_heads=num_heads, topk=topk)
        elif policy == "chain":
            if n <= num_heads + 1:
                out[n] = chain_tree(num_heads, topk, n)
        elif policy == "dynamic":
            out[n] = DynamicTree(n, num_heads, topk, width, calibration)
        else:
            out[n] = greedy_tree(n, acc, topk=topk)
    return out


def expected_tokens(tree: StepTree, accuracies: np.ndarray,
                    simulated: Mapping[int, float] | None = None) -> float:
    """Expected tokens per step of a tree: the simulated value for its size when there is one, else the
    greedy tree's expected accepted length under ``accuracies`` (Medusa paper §2.3.3; for a per-step tree a
    lower bound: each step's tree is chosen to beat the fixed one)."""
    if tree.size == 1:
        return 1.0
    if simulated and tree.size in simulated:
        return float(simulated[tree.size])
    acc = np.asarray(accuracies, dtype=np.float64)
    return expected_accept_length(tree.static_shape(acc), acc)


def choose_tree(trees: Mapping[int, StepTree], accuracies: np.ndarray, step_ms: Mapping[int, float],
                heads_ms: float | Mapping[int, float], simulated: Mapping[int, float] | None = None,
                margin: float = DEFAULT_MARGIN, spreads: Mapping[int, float] | None = None
                ) -> tuple[StepTree, list[TreeTiming]]:
    """Pick the tree with the most expected tokens per second (pure; no timing).

    Args:
        trees: size -> tree (:func:`candidate_trees`).
        accuracies: float [K, topk] a_k^(i) used for the expected accepted length.
        step_ms: size -> measured step time in ms (every key of ``trees``).
        heads_ms: measured heads time per step in ms (with the candidate selection), one value for
            every size or size -> ms (not charged to size 1).
        simulated: size -> simulated tokens per step of the policy in use (:func:`expected_tokens`).
        margin: when size 1 (plain decoding) is among ``trees``, another size is chosen only if its
            expected tokens/s exceed plain decoding's by this fraction (:data:`DEFAULT_MARGIN`; >= 0).
        spreads: size -> the step timing's relative spread (:attr:`TreeTiming.spread`), or None.

    Returns:
        (the best tree, the table of every size in increasing size). Ties go to the smaller tree.

    Raises:
        InvalidTreeError: no trees, a size without a time, or a negative margin.
    """
    if margin < 0:
        raise InvalidTreeError(f"the margin over plain decoding must be >= 0, got {margin}")
    if not trees:
        raise InvalidTreeError("no candidate tree sizes to choose from")
    missing = sorted(set(trees) - set(step_ms))
    if missing:
        raise InvalidTreeError(f"no measured step time for tree sizes {missing}")
    acc = np.asarray(accuracies, dtype=np.float64)
    heads = heads_ms if isinstance(heads_ms, Mapping) else {n: float(heads_ms) for n in trees}
    table = [TreeTiming(n, expected_tokens(t, acc, simulated), float(step_ms[n]),
                        float(heads.get(n, 0.0)) if t.size > 1 else 0.0, spread=float((spreads or {}).get(n, 0.0)))
             for n, t in sorted(trees.items())]
    return trees[pick(table, margin).size], table


def timing_noise(table: Sequence[TreeTiming], margin: float = DEFAULT_MARGIN) -> str | None:
    """Why the pick of ``table`` (:func:`pick`) cannot be trusted, or None when it can. Pure.

    The pick is a comparison of measured tokens per second: the chosen tree against plain decoding (it must lead by
    ``margin``) and against the best other tree (it must lead). When the lead over either falls within the timings'
    spread (the larger relative spread of the two rows), a repeat of the same timing on the same machine could pick
    otherwise: on a loaded machine that is the common case, and the answer is a notice rather than a silent flip.
    """
    chosen = pick(table, margin)
    root = next((r for r in table if r.size == 1), None)
    others = [r for r in table if r.size not in (chosen.size, 1)]
    rivals = []  # (rival, the ratio the decision rests on, the threshold it must clear)
    if chosen.size == 1:
        if others:
            best = max(others, key=lambda r: r.tokens_per_second)
            rivals.append((best, (1 + margin) * chosen.tokens_per_second / best.tokens_per_second, 1.0))
    else:
        if root is not None:
            rivals.append((root, chosen.tokens_per_second / root.tokens_per_second, 1 + margin))
        if others:
            best = max(others, key=lambda r: r.tokens_per_second)
            rivals.append((best, chosen.tokens_per_second / best.tokens_per_second, 1.0))
    for rival, ratio, threshold in rivals:
        noise = max(chosen.spread, rival.spread)
        if noise and ratio - threshold < noise * threshold:
            return (f"the timing was noisy: {chosen.size} node(s) lead {rival.size} by {100 * (ratio / threshold - 1):.1f}%"
                    f"{' beyond the margin' if threshold > 1 else ''}, within the timings' spread of {100 * noise:.1f}%; "
                    "the pick may differ on a quiet machine (run alone, or give --tree)")
    return None


def pick(table: Sequence[TreeTiming], margin: float = DEFAULT_MARGIN) -> TreeTiming:
    """The row with the most expected tokens/s (ties: the smaller tree); plain decoding (size 1) when it is in
    the table and no row beats it by ``margin`` (a fraction). Pure."""
    best = max(table, key=lambda r: (r.tokens_per_second, -r.size))
    root = next((r for r in table if r.size == 1), None)
    if root is not None and best.tokens_per_second < (1 + margin) * root.tokens_per_second:
        return root
    return best


def refine_with_loop(table: Sequence[TreeTiming], loop_ms: Callable[[int], float], *, margin: float = DEFAULT_MARGIN,
                     rounds: int = 3, alternations: int = 3) -> list[TreeTiming]:
    """Time plain decoding and the leading sizes through the whole decode loop, and choose on those times.

    The tree-step table leaves out part of a real step's cost: the host's candidates, acceptance and
    KV compaction, and the loop around the calls. On the embedded model on a 2-core CPU that was
    2.5-3 ms of a 37-43 ms tree step and nothing for plain decoding, enough to turn a predicted 12%
    gain into a measured 4% (docs/trees.md). So plain decoding and the leading tree of the table are timed as the
    loop runs them, alternately, ``alternations`` times each, keeping each one's fastest: the pick rests on their
    ratio, and on a VM whose speed drifts by 20% within seconds (the 2-core EPYC hosts here) two timings taken one
    after the other can differ by more than the margin; alternating, both see the same phases. The leading tree is
    timed even when plain decoding's loop time would put plain decoding ahead on paper (a loop time against a table
    figure is the comparison across moments this avoids). The other tree rows get the mean extra cost measured on
    the tree rows (``overhead_ms``); if another row then leads, it is timed too, ``rounds`` tree rows at most.

    Args:
        table: the tree-step table (:func:`choose_tree`).
        loop_ms: size -> measured ms per step of the decode loop (:func:`time_decode_loop`).
        margin: see :func:`pick`.
        rounds: most tree rows (size > 1) timed through the loop.
        alternations: timings of plain decoding and of the leading tree, taken in turn (>= 1).

    Returns:
        The table with ``loop_ms`` filled for the timed sizes and ``overhead_ms`` for the others.
    """
    rows = {r.size: r for r in table}

    def spread_overhead(rows: dict) -> dict:
        extra = [r.loop_ms - r.step_ms - r.heads_ms for r in rows.values() if r.size > 1 and r.loop_ms is not None]
        if not extra:
            return rows
        overhead = max(0.0, float(np.mean(extra)))
        return {n: r if r.loop_ms is not None else replace(r, overhead_ms=overhead) for n, r in rows.items()}

    trees = [r for r in rows.values() if r.size > 1]
    first = ([1] if 1 in rows else []) + ([pick(trees, margin).size] if trees and rounds > 0 else [])
    times: dict[int, list[float]] = {n: [] for n in first}
    for _ in range(max(1, alternations)):
        for n in first:
            times[n].append(float(loop_ms(n)))
    rows = spread_overhead({**rows, **{n: replace(rows[n], loop_ms=min(ts)) for n, ts in times.items()}})
    for _ in range(max(0, rounds - 1)):
        best = pick(list(rows.values()), margin)
        if best.loop_ms is not None:
            break
        rows[best.size] = replace(best, loop_ms=float(loop_ms(best.size)))
        rows = spread_overhead(rows)
    return [rows[n] for n in sorted(rows)]


def time_decode_loop(engine, tree: StepTree, *, past_length: int = DEFAULT_PAST_LENGTH,
                     new_tokens: int = LOOP_TOKENS, repeats: int = 2, seed: int = 0) -> float:
    """Milliseconds per step of the decode loop (:func:`medusa_runtime.decode.loop.generate`, greedy) with ``tree``,
    after ``past_length`` cached tokens as :func:`time_tree_steps` times them (zeros: the cost of the dense
    kernels does not depend on the values, nor much on what is accepted): (engine + host time - the
    one-token prefill) / steps, the fastest of ``repeats`` runs of ``new_tokens`` tokens.

    Raises:
        InvalidTreeError: the past, the tokens and the tree do not fit the engine's context.
    """
    from ..decode.loop import generate

    capacity = past_length + 1 + new_tokens + tree.size
    caps = engine.capabilities
    if caps.max_context is not None and capacity > caps.max_context:
        raise InvalidTreeError(f"timing the decode loop needs {capacity} tokens of context; the engine has "
                               f"{caps.max_context}")
    vocab = int(caps.vocab_size or 1000)
    token = int(np.random.default_rng(seed).integers(0, vocab))
    cache, best = None, float("inf")
    for _ in range(max(1, repeats)):
        cache = _cache_after(engine, capacity, past_length, cache)
        res = generate(engine, [token], tree, max_new_tokens=new_tokens, cache=cache)
        if res.steps:
            best = min(best, 1e3 * (res.engine_seconds + res.host_seconds - res.prefill_seconds) / res.steps)
    return best


def median_ms(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` in milliseconds over ``repeats`` runs after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def _cache_after(engine, capacity: int, past_length: int, cache=None):
    """A KV cache of ``capacity`` slots (``cache`` itself when given) whose first ``past_length`` slots count as
    valid (zeros, tokens unknown): what the timings run their steps after."""
    from ..engines.kvcache import KVCache

    cache = cache if cache is not None else KVCache.for_engine(engine, capacity)
    cache.length, cache.tokens = past_length, [-1] * past_length
    return cache


def time_tree_steps(engine, trees: Mapping[int, StepTree], *, past_length: int = DEFAULT_PAST_LENGTH,
                    repeats: int = 5, warmup: int = 1, progress: Callable[[str], None] | None = None,
                    spreads: dict[int, float] | None = None) -> tuple[dict[int, float], dict[int, float]]:
    """Time one tree step of each tree, and the heads with the candidate selection, on ``engine``.

    Each step runs a T-node tree's real attention mask and positions after ``past_length``
    cached tokens (zeros; the values do not change the cost of dense kernels; a per-step tree
    is timed on a fixed tree of its size, the same shapes). The heads are timed as the decode
    loop runs them (:func:`medusa_runtime.decode.loop.proposer`): Medusa heads once, path-conditioned
    heads level by level, plus the host's choice of a per-step tree.

    Args:
        engine: a :class:`medusa_runtime.engines.base.Engine` with numpy KV (``make_cache`` engines
            are timed through their own cache).
        trees: size -> tree.
        past_length: cached tokens before the step (>= 0).
        repeats, warmup: timed and untimed runs per size; the median is kept. All sizes are
            warmed up first, then timed in interleaved rounds (one run of each size per round).
        progress: called with a short line per measured size.
        spreads: when given, filled with size -> the step times' relative spread, (75th - 25th percentile) /
            median (:attr:`TreeTiming.spread`).

    Sizes below the engine's ``capabilities.min_rows`` run padded to that many rows (a row regime, the manifest's
    ``precision.step_rows``), the same kernels on the same shapes as the ``min_rows``-node tree: such sizes share
    that tree's timing instead of a second, independently noisy one (on the int4 default, plain decoding and the
    2-node chain are the same two-row step, and two timings of it differed by up to 20% on a quiet 2-core VM).

    Returns:
        (size -> median step ms, size -> median heads ms (0 for size 1)).
    """
    from ..decode.loop import proposer

    cache = _cache_after(engine, past_length + max(trees), past_length)
    out = None
    steps = {}
    min_rows = int(getattr(getattr(engine, "capabilities", None), "min_rows", 1) or 1)
    shared = {n: min_rows for n in trees if n < min_rows and min_rows in trees}  # size -> the size timed for it
    for n, tree in sorted(trees.items()):
        if n in shared:
            continue
        shape = tree.static_shape()
        b = shape.buffers()
        ids = np.zeros((1, n), dtype=np.int64)
        pos = (past_length + b.depth)[None].astype(np.int64)

        def step(ids=ids, pos=pos, mask=b.attention_mask):
            nonlocal out
            out = engine.step(ids, pos, mask, 1.0, cache.past())

        steps[n] = step
    # Interleaved rounds: every size is warmed up first, then each round times every size once,
    # so warm-up and drift of the machine do not favour the sizes timed later.
    for step in steps.values():
        for _ in range(warmup):
            step()
    times: dict[int, list[float]] = {n: [] for n in steps}
    for _ in range(max(1, repeats)):
        for n, step in steps.items():
            t = time.perf_counter()
            step()
            times[n].append(time.perf_counter() - t)
    times.update({n: times[m] for n, m in shared.items()})
    step_ms = {n: 1e3 * statistics.median(ts) for n, ts in sorted(times.items())}
    if spreads is not None:
        for n, ts in times.items():
            q1, _, q3 = np.percentile(ts, [25, 50, 75])
            spreads[n] = float((q3 - q1) / statistics.median(ts)) if len(ts) > 1 else 0.0
    if progress:
        for n in step_ms:
            padded = f" (runs as the {shared[n]}-row step)" if n in shared else ""
            progress(f"tree of {n:3d} nodes: {step_ms[n]:7.2f} ms per step{padded}")
    heads_ms: dict[int, float] = {}
    hidden = out.hidden[:1]
    for n, tree in sorted(trees.items()):
        if tree.size == 1:
            heads_ms[n] = 0.0
            continue
        propose = proposer(engine, tree)
        heads_ms[n] = median_ms(lambda: propose(hidden, 0), repeats, warmup)
    if progress:
        progress("heads and candidates: " + ", ".join(f"{n}: {ms:.2f}" for n, ms in heads_ms.items() if n > 1)
                 + " ms per step")
    return step_ms, heads_ms


def auto_tree(engine, accuracies: np.ndarray | None, *, capacity: int | None = None,
              sizes: Sequence[int] = DEFAULT_SIZES, past_length: int = DEFAULT_PAST_LENGTH, repeats: int = 5,
              topk: int = DEFAULT_TOPK, progress: Callable[[str], None] | None = None, policy: str = "static",
              calibration: ProbabilityMap | None = None, simulated: Mapping[str, Mapping[int, float]] | None = None,
              margin: float = DEFAULT_MARGIN, loop: bool = True) -> tuple[StepTree, list[TreeTiming]]:
    """Measure, then choose: the tree with the most expected tokens per second on ``engine``.

    Args:
        engine: the target engine (its heads count bounds the depth).
        accuracies: float [K, topk] calibrated a_k^(i) (the artifact's or ``accuracies.json``);
            None: the prior of :func:`medusa_runtime.trees.tree.default_accuracies`.
        capacity: the KV capacity steps must fit in (None: unbounded); sizes above half of it
            are dropped and ``past_length`` shrinks so that the largest tree fits after it.
        sizes: node counts to try (1 = plain decoding).
        past_length, repeats: see :func:`time_tree_steps`.
        topk: candidate top-k (at most the heads graph's).
        progress: called with a line per measurement.
        policy: "static" or "dynamic" (per-step trees of each size).
        calibration: the heads' probability map (per-step trees).
        simulated: {policy: {size: tokens per step}} from ``calibrate`` for these heads (the
            expected tokens of the policy in use; sizes without a value use the accuracies).
        margin: see :func:`choose_tree`.
        loop: also time plain decoding and the leading sizes through the whole decode loop
            (:func:`refine_with_loop`) and choose on those times.

    Returns:
        (the chosen tree, the table of every size).

    Raises:
        InvalidTreeError: bad sizes, accuracies or policy, or no size fits ``capacity``.
    """
    if accuracies is None:
        accuracies = default_accuracies(engine.num_heads, topk)
    if policy == "chain":  # every chain: 1 (plain decoding) .. K + 1 nodes
        sizes = range(1, engine.num_heads + 2)
    if capacity is not None:
        sizes = [n for n in sizes if n <= capacity // 2]
        if not sizes:
            raise InvalidTreeError(f"no tree size fits half of a {capacity}-token context")
        past_length = min(past_length, capacity - max(sizes))
    loop_past = max(0, min(past_length, int(capacity or engine.capabilities.max_context) - LOOP_TOKENS - 1 - max(sizes)))
    trees = candidate_trees(accuracies, sizes, num_heads=engine.num_heads, topk=topk, policy=policy,
                            calibration=calibration)
    spreads: dict[int, float] = {}
    step_ms, heads_ms = time_tree_steps(engine, trees, past_length=past_length, repeats=repeats, progress=progress,
                                        spreads=spreads)
    table = {int(n): float(v) for n, v in (simulated or {}).get(policy, {}).items()}
    _, rows = choose_tree(trees, np.asarray(accuracies)[: engine.num_heads, :topk], step_ms, heads_ms, table, margin,
                          spreads)
    if loop:
        rows = refine_with_loop(rows, lambda n: time_decode_loop(engine, trees[n], past_length=loop_past), margin=margin)
        if progress:
            progress("decode loop: " + ", ".join(f"{r.size}: {r.loop_ms:.2f}" for r in rows if r.loop_ms is not None)
                     + " ms per step")
    return trees[pick(rows, margin).size], rows


def format_table(table: Sequence[TreeTiming], chosen: int) -> str:
    """The measurement table as aligned text lines (the chosen size marked with '*'; loop ms where measured,
    '~' where estimated)."""
    lines = ["nodes  tokens/step  step ms  heads ms  loop ms  tokens/s   (loop ms: the decode loop, ~ estimated)"]
    for r in table:
        mark = " *" if r.size == chosen else ""
        loop = (f"{r.loop_ms:7.2f}" if r.loop_ms is not None else
                f"~{r.ms_per_step:6.2f}" if r.overhead_ms else "      -")
        lines.append(f"{r.size:5d}  {r.expected_tokens:11.3f}  {r.step_ms:7.2f}  {r.heads_ms:8.2f}  {loop}  "
                     f"{r.tokens_per_second:8.1f}{mark}")
    return "\n".join(lines)
