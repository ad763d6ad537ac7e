"""The Medusa decode loop, batch size 1, over any engine (seeds/001, Algorithm).

prefill -> candidates from the heads -> one step over the tree (tree mask, position =
past length + depth) -> host-side acceptance -> KV compaction -> stops, repeated.

The loop is written once and driven by an :class:`Engine`: ONNX Runtime or TensorRT in
deployment, PyTorch for the reference (``medusa_export.model.decode.TorchEngine``). It owns the
KV buffers (numpy, sequence-major ``[1, capacity, H_kv, D]`` per layer and K/V), hands the
engine views of their valid prefix (no copy) and keeps only the accepted nodes' K/V. Engines
whose step writes into the cache itself bring their own cache (``make_cache``), e.g. the
head-major :class:`HeadMajorKVCache` of ``ort-fused`` artifacts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Protocol, Sequence

import numpy as np

from .acceptance import TypicalConfig, accept_greedy, accept_typical, sample_topk
from .errors import ContextOverflowError
from .kvcache import compact_in_place, fits, write_accepted
from .stops import apply_stops
from .candidates import DynamicTree, Proposal, dynamic_levels, dynamic_medusa, static_levels, static_medusa
from .tree import Tree, make_tree


class StepResult(NamedTuple):
    """One engine step's outputs, batch dimension dropped (see medusa_export.model.medusa)."""

    topk_ids: np.ndarray  # int64 [S, k]
    topk_logprobs: np.ndarray  # float32 [S, k]
    entropy: np.ndarray  # float32 [S]
    token_logprobs: np.ndarray  # float32 [S, S]
    hidden: np.ndarray  # [S, d]
    new_kv: list  # per layer (key, value), each [1, S, H_kv, D]


class Engine(Protocol):
    """What the loop needs from a backend."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_heads: int  # Medusa heads K
    kv_dtype: np.dtype

    def step(self, input_ids: np.ndarray, position_ids: np.ndarray, mask: np.ndarray, temperature: float,
             past: list[tuple[np.ndarray, np.ndarray]]) -> StepResult:
        """Run S tokens (input_ids/position_ids int64 [1, S], mask bool [S, S]) after the past views."""

    def heads(self, hidden: np.ndarray, topk: int) -> np.ndarray:
        """hidden [R, d] -> int64 [R, K, >=topk] the heads' best tokens.

        ``hidden`` is a row slice of a step's ``StepResult.hidden`` (whatever type the
        engine returned there, e.g. a device buffer).
        """

    # Optional, by head type and tree policy (see :func:`proposer`):
    # * ``head_type``: "medusa" (default when absent) or "hydra" (path-conditioned heads);
    # * ``heads_logprobs(hidden [R, d], topk) -> (ids int64 [R, K, topk], logprobs float32 [R, K, topk])``:
    #   Medusa heads with their log-probabilities (per-step trees);
    # * ``heads_level(depth, hidden [1, d], path_ids int64 [R, depth], topk) -> (ids [R, topk], logprobs [R, topk])``:
    #   the path-conditioned head of that depth on R paths (root first), the heads of "hydra" engines.

    # Optional: ``make_cache(capacity) -> cache`` for engines that keep the KV cache in
    # their own memory (a GPU). The cache must offer what :class:`KVCache` offers
    # (a :class:`CacheState` with past() and keep()); ``step`` then receives its
    # ``past()`` and may write the new K/V into the cache itself (``new_kv`` ignored).


class CacheState:
    """What every KV cache tracks besides its buffers (base of :class:`KVCache` and the device caches).

    Attributes:
        capacity: slots (tokens).
        length: valid slots (the past length P).
        tokens: the token id whose K/V is in each valid slot (len == length; -1 if unknown),
            so that a later prompt sharing a prefix can reuse the cache (multi-turn chat).
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.length = 0
        self.tokens: list[int] = []

    def _advance(self, accepted: np.ndarray, token_ids: Sequence[int] | None) -> None:
        """Count ``len(accepted)`` newly kept slots and record their tokens."""
        self.length += len(accepted)
        self.tokens.extend([int(t) for t in token_ids] if token_ids is not None else [-1] * len(accepted))

    def truncate(self, length: int) -> None:
        """Keep only the first ``length`` slots (no copy; later steps overwrite the rest).

        Raises:
            ValueError: ``length`` is negative or beyond the valid length.
        """
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {length}")
        self.length = length
        del self.tokens[length:]


class KVCache(CacheState):
    """Per-layer K and V numpy buffers [1, capacity, H_kv, D], reused across steps."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int, dtype=np.float32):
        super().__init__(capacity)
        shape = (1, capacity, num_kv_heads, head_dim)
        self.keys = [np.zeros(shape, dtype) for _ in range(num_layers)]
        self.values = [np.zeros(shape, dtype) for _ in range(num_layers)]

    @classmethod
    def for_engine(cls, engine: Engine, capacity: int):
        """The engine's own cache type when it has one (``make_cache``), else a numpy :class:`KVCache`."""
        make = getattr(engine, "make_cache", None)
        if make is not None:
            return make(capacity)
        return cls(engine.num_layers, engine.num_kv_heads, engine.head_dim, capacity, engine.kv_dtype)

    def past(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Contiguous views of the valid prefix, per layer ([1, length, H_kv, D] each); no copy."""
        n = self.length
        return [(k[:, :n], v[:, :n]) for k, v in zip(self.keys, self.values)]

    def keep(self, new_kv, accepted: np.ndarray, token_ids: Sequence[int] | None = None) -> None:
        """Copy the accepted nodes' K/V (root first) into the next slots (KV compaction).

        Args:
            new_kv: per layer (key, value) [1, S, H_kv, D], the step's K/V.
            accepted: int [n] node indices, root first.
            token_ids: the n accepted tokens (recorded in :attr:`tokens`); -1 when unknown.
        """
        for ck, cv, (k, v) in zip(self.keys, self.values, new_kv):
            write_accepted(ck, np.asarray(k), self.length, accepted)
            write_accepted(cv, np.asarray(v), self.length, accepted)
        self._advance(accepted, token_ids)


class InPlacePast(NamedTuple):
    """What :meth:`HeadMajorKVCache.past` hands to the engine: the cache and its valid length."""

    cache: "HeadMajorKVCache"
    length: int


class HeadMajorKVCache(CacheState):
    """Head-major K and V numpy buffers that the engine's step writes into (``ort-fused`` artifacts).

    ``keys`` / ``values`` are [L, 1, H_kv, capacity, D]; layer l's buffer ``keys[l]`` is the
    contiguous [1, H_kv, capacity, D] array GroupQueryAttention reads and writes in place: a
    step of S tokens after P valid slots writes node j's K/V into slot P + j. :meth:`keep`
    then only moves the accepted nodes that are not in place (strided copy on the slot axis).
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int, dtype=np.float32):
        super().__init__(capacity)
        shape = (num_layers, 1, num_kv_heads, capacity, head_dim)
        self.keys = np.zeros(shape, dtype)
        self.values = np.zeros(shape, dtype)

    def past(self) -> InPlacePast:
        """The cache and its current valid length (the engine binds the whole buffers)."""
        return InPlacePast(self, self.length)

    def new_kv(self, start: int, count: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Views of slots [start, start + count) per layer, as [1, count, H_kv, D] (no copy; valid
        until the next step or :meth:`keep` changes those slots)."""
        sl = slice(start, start + count)
        return [(k[:, :, sl].transpose(0, 2, 1, 3), v[:, :, sl].transpose(0, 2, 1, 3))
                for k, v in zip(self.keys, self.values)]

    def keep(self, new_kv, accepted: np.ndarray, token_ids: Sequence[int] | None = None) -> None:
        """Compact after a step that wrote node j to slot length + j (``new_kv`` is not read).

        Args:
            new_kv: the step's ``StepResult.new_kv`` (views of this cache; ignored).
            accepted: int [n] node indices, root first, increasing.
            token_ids: the n accepted tokens (recorded in :attr:`tokens`); -1 when unknown.
        """
        for buf in (self.keys, self.values):
            compact_in_place(buf, self.length, accepted, slot_axis=3)
        self._advance(accepted, token_ids)


def proposer(engine: Engine, tree: Tree | DynamicTree, timed: Callable = lambda f, *a: f(*a)
             ) -> Callable[[object, int], Proposal]:
    """The candidate generator of a step for the engine's head type and the tree policy.

    Args:
        engine: the backend (``head_type`` and the heads methods, see :class:`Engine`).
        tree: a static :class:`Tree`, or a :class:`~medusa_runtime.candidates.DynamicTree` (per-step
            trees of fixed size).
        timed: ``timed(fn, *args)`` calls ``fn(*args)``; the loop passes one that adds the time
            to the engine's share.

    Returns:
        ``propose(hidden_row, root) -> Proposal``: hidden_row is the [1, d] row of the last
        accepted node's hidden state, root the next token.

    Raises:
        ValueError: an engine without what the head type or the tree policy needs.
    """
    head_type = getattr(engine, "head_type", "medusa")
    topk = tree.topk
    if head_type == "hydra":
        if not hasattr(engine, "heads_level"):
            raise ValueError("the engine's heads are path-conditioned but it has no heads_level()")

        def levels(hidden_row):
            return lambda depth, paths: timed(engine.heads_level, depth, hidden_row, paths, topk)

        if isinstance(tree, DynamicTree):
            return lambda hidden_row, root: dynamic_levels(root, levels(hidden_row), tree)
        return lambda hidden_row, root: static_levels(root, tree, levels(hidden_row))
    if head_type != "medusa":
        raise ValueError(f"unknown head type {head_type!r}; this runtime runs medusa and hydra heads")
    if isinstance(tree, DynamicTree):
        if not hasattr(engine, "heads_logprobs"):
            raise ValueError("per-step trees need the heads' log-probabilities, which this engine's heads graph "
                             "does not return (rebuild the artifact)")

        def propose_dynamic(hidden_row, root):
            ids, logprobs = timed(engine.heads_logprobs, hidden_row, topk)
            return dynamic_medusa(root, ids[0], logprobs[0], tree)

        return propose_dynamic
    return lambda hidden_row, root: static_medusa(root, timed(engine.heads, hidden_row, topk)[0], tree)


@dataclass
class GenerationResult:
    """Output of one generation.

    Attributes:
        tokens: emitted token ids (EOS excluded).
        finish_reason: "stop" (EOS or stop string) or "length" (max_new_tokens, or the context is full).
        step_tokens: tokens produced by each tree step (accepted candidates + 1), before stops.
        accept_depths: per tree step, the accepted candidates after the root.
        prompt_tokens: prompt length.
        engine_seconds / host_seconds: wall time in engine calls / in the loop's own work.
        prefill_seconds: wall time of the prefill call.
    """

    tokens: list[int]
    finish_reason: str
    step_tokens: list[int] = field(default_factory=list)
    accept_depths: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    engine_seconds: float = 0.0
    host_seconds: float = 0.0
    prefill_seconds: float = 0.0

    @property
    def steps(self) -> int:
        """Tree steps run after the prefill."""
        return len(self.step_tokens)

    @property
    def mean_accepted(self) -> float:
        """Mean tokens per tree step (acceptance length incl. the bonus token); 0 if no step."""
        return float(np.mean(self.step_tokens)) if self.step_tokens else 0.0


def causal_mask(n: int) -> np.ndarray:
    """bool [n, n] lower-triangular: the prefill's mask over the new tokens."""
    return np.tril(np.ones((n, n), dtype=bool))


def generate(
    engine: Engine,
    prompt_ids: Sequence[int],
    tree: Tree | DynamicTree,
    *,
    max_new_tokens: int,
    eos_token_ids: Sequence[int] = (),
    max_context: int = 2048,
    typical: TypicalConfig | None = None,
    seed: int = 0,
    on_tokens: Callable[[list[int]], bool | None] | None = None,
    cache: KVCache | None = None,
) -> GenerationResult:
    """Generate with Medusa; greedy when ``typical`` is None (lossless vs plain greedy).

    Args:
        engine: the backend.
        prompt_ids: the prompt's token ids (chat template applied), length >= 1. With
            ``cache`` given, these are the tokens *after* the cache's valid prefix.
        tree: the token tree; ``make_tree([])`` (root only) gives plain one-token steps; a
            :class:`~medusa_runtime.candidates.DynamicTree` chooses a tree of its size every step.
        max_new_tokens: maximum emitted tokens (exact).
        eos_token_ids: tokens that end generation (not emitted).
        max_context: KV capacity in tokens. When the tree no longer fits, steps fall back
            to the root alone; when nothing fits, generation ends with "length".
        typical: typical acceptance settings (temperature > 0), or None for greedy.
        seed: seeds the sampling of bonus tokens under typical acceptance.
        on_tokens: called with each step's emitted tokens (streaming); returning True
            stops generation (finish_reason "stop"; used for stop strings).
        cache: a cache to continue from (multi-turn chat); a new one when None.

    Raises:
        ValueError: empty prompt, negative max_new_tokens, or a tree deeper than the heads.
        ContextOverflowError: the prompt does not fit the context.
    """
    prompt = np.asarray([int(t) for t in prompt_ids], dtype=np.int64)
    if prompt.size == 0:
        raise ValueError("the prompt is empty: give at least one token")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if tree.max_depth > engine.num_heads:
        raise ValueError(f"tree depth {tree.max_depth} exceeds the engine's {engine.num_heads} Medusa heads")
    cache = cache if cache is not None else KVCache.for_engine(engine, max_context)
    if cache.length + prompt.size > cache.capacity:
        raise ContextOverflowError(
            f"the prompt has {prompt.size} tokens but only {cache.capacity - cache.length} of the "
            f"{cache.capacity}-token context are free"
        )
    rng = np.random.default_rng(seed)
    result = GenerationResult([], "length", prompt_tokens=int(prompt.size))
    if max_new_tokens == 0:
        return result
    root_tree = make_tree([], num_heads=engine.num_heads, topk=tree.topk)
    temperature = typical.temperature if typical else 1.0
    t_start = time.perf_counter()

    def run(tokens, positions, mask) -> StepResult:
        t = time.perf_counter()
        out = engine.step(tokens[None], positions[None], mask, temperature, cache.past())
        result.engine_seconds += time.perf_counter() - t
        return out

    def timed(fn, *args):  # the heads' time is engine time
        t = time.perf_counter()
        out = fn(*args)
        result.engine_seconds += time.perf_counter() - t
        return out

    propose = proposer(engine, tree, timed) if tree.size > 1 else None

    def emit(step_tokens: list[int]) -> bool:
        stop = apply_stops(step_tokens, generated=len(result.tokens), max_new_tokens=max_new_tokens,
                           eos_token_ids=eos_token_ids)
        result.tokens.extend(stop.tokens)
        if on_tokens and stop.tokens and on_tokens(stop.tokens):
            result.finish_reason = "stop"
            return True
        if stop.finish_reason:
            result.finish_reason = stop.finish_reason
            return True
        return False

    def finish() -> GenerationResult:
        total = time.perf_counter() - t_start
        result.host_seconds = total - result.engine_seconds
        return result

    # Prefill: the prompt with a causal mask; all of its K/V are kept.
    n = int(prompt.size)
    out = run(prompt, cache.length + np.arange(n, dtype=np.int64), causal_mask(n))
    result.prefill_seconds = result.engine_seconds
    cache.keep(out.new_kv, np.arange(n), prompt)
    root = int(out.topk_ids[-1, 0]) if typical is None else sample_topk(out.topk_ids[-1], out.topk_logprobs[-1], rng)
    if emit([root]):
        return finish()
    hidden_row = out.hidden[n - 1 : n]
    while True:
        if propose is not None and fits(cache.length, tree.size, cache.capacity):
            step_tree, tokens = propose(hidden_row, root)
        else:
            step_tree, tokens = root_tree, np.array([root], np.int64)
        if not fits(cache.length, step_tree.size, cache.capacity):
            result.finish_reason = "length"  # the context is full
            return finish()
        b = step_tree.buffers()
        out = run(tokens, cache.length + b.depth, b.attention_mask)
        if typical is None:
            acc = accept_greedy(step_tree, tokens, out.topk_ids[:, 0])
        else:
            acc = accept_typical(step_tree, tokens, out.token_logprobs, out.entropy, out.topk_ids,
                                 out.topk_logprobs, typical, rng)
        cache.keep(out.new_kv, acc.accepted, tokens[acc.accepted])
        step_tokens = [int(t) for t in tokens[acc.accepted[1:]]] + [acc.next_token]
        result.step_tokens.append(len(step_tokens))
        result.accept_depths.append(acc.accept_length)
        if emit(step_tokens):
            return finish()
        root = acc.next_token
        last = int(acc.accepted[-1])
        hidden_row = out.hidden[last : last + 1]
