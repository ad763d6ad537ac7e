"""Many sequences through one engine: the batched engine interface, its looped reference, and the
in-flight scheduler.

Each sequence runs the decode loop of :class:`~medusa_runtime.decode.loop.Decoding` (the same code as
batch-1 :func:`~medusa_runtime.decode.loop.generate`): its own KV cache, sampling stream (a generator
seeded with its own seed), acceptance, stops and streaming callback. The :class:`Scheduler`
only decides who runs when:

* at each step boundary, finished sequences leave (their KV rows are released), waiting ones
  join up to ``max_batch`` (each is prefilled by a call over its own row: prompts of
  different lengths never share a call), then every running sequence takes one tree step;
* a tree step over B sequences is one :meth:`BatchEngine.step_rows` call when the engine declares
  ``capabilities.batched``, else B calls (the looped reference below); the heads of the sequences that
  need them run after it (one call over the B rows, or one per row likewise): Medusa heads in
  one call, path-conditioned heads one call per tree level, each over the paths every sequence
  chose at the level before (:class:`~medusa_runtime.decode.candidates.HeadsCall`).

KV rows are per sequence (``BatchEngine.row_cache``): compaction after acceptance
(:meth:`~medusa_runtime.engines.kvcache.KVCache.keep`) writes only the slots of the sequence's own row.

Batched engine interface (:class:`BatchEngine`): the geometry and limits of
:class:`~medusa_runtime.engines.base.Engine`, plus

* ``row_cache(capacity) -> cache`` / ``release(cache)``: one sequence's KV row, owned by the
  runtime, with the interface of :class:`~medusa_runtime.engines.kvcache.KVCache` (``length``,
  ``capacity``, ``tokens``, ``past()``, ``keep()``);
* ``step_rows(caches, inputs) -> list[StepResult]``: one step over B rows; row b runs
  ``inputs[b]`` (:class:`~medusa_runtime.engines.base.RowInputs`: tokens, position ids, mask over the
  new tokens, temperature, in-graph sampler inputs) after the valid past of ``caches[b]``
  (per-row past lengths); returns per-row results (batch dimension dropped) whose K/V the
  rows' ``keep`` compacts;
* ``capabilities.batched`` (:class:`~medusa_runtime.engines.base.Capabilities`): False when
  ``step_rows`` runs one call per row, so that the scheduler runs each row's heads before the
  next row's step (engines whose outputs live in reused device buffers stay correct);
* ``heads(hidden [R, d], topk)``: the heads over R rows; by head type and tree policy also
  ``heads_logprobs`` and ``heads_level`` (:class:`~medusa_runtime.engines.base.Engine`), where
  ``heads_level`` takes one hidden row per path (``[R, d]``) when paths of several sequences share a call.

:class:`LoopedBatchEngine` implements it with one batch-1 call of any
:class:`~medusa_runtime.engines.base.Engine` per row: the reference, and the engine for artifacts
whose step graphs have no batch dimension.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable, Protocol, Sequence

import numpy as np

from .acceptance import SamplingConfig
from .candidates import HeadsCall
from ..engines.base import Capabilities, Engine, RowInputs, StepResult
from ..engines.kvcache import KVCache
from ..errors import ContextOverflowError, InvalidSettingError
from .loop import (Decoding, GenerationResult, check_request, context_capacity, engine_sampling_route, engine_step,
                   run_heads)
from ..trees.dynamic import StepTree

#: Sequences per step when none is given (the CLI's --batch-size; Triton's batch_size parameter).
DEFAULT_BATCH_SIZE = 8


class BatchEngine(Protocol):
    """What the scheduler needs from a backend (see the module docstring)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_heads: int
    kv_dtype: np.dtype
    capabilities: Capabilities

    def row_cache(self, capacity: int):
        """A KV row for one sequence (``capacity`` slots)."""

    def release(self, cache) -> None:
        """The sequence of ``cache`` has left; its row may be reused."""

    def step_rows(self, caches: Sequence, inputs: Sequence[RowInputs]) -> list[StepResult]:
        """One step over ``len(caches)`` rows (row b: ``inputs[b]`` after ``caches[b]``'s valid past)."""

    def heads(self, hidden, topk: int) -> np.ndarray:
        """hidden [R, d] -> int64 [R, K, >=topk] the heads' best tokens."""


def run_heads_rows(engine, rows: Sequence, calls: Sequence[HeadsCall]) -> list:
    """The heads calls of several sequences in one engine call (the same kind, depth and top-k).

    Args:
        engine: the backend.
        rows: each sequence's [1, d] hidden row (host arrays).
        calls: each sequence's :class:`~medusa_runtime.decode.candidates.HeadsCall`.

    Returns:
        Per sequence, what :func:`~medusa_runtime.decode.loop.run_heads` would return for it alone.
    """
    kind, topk = calls[0].kind, calls[0].topk
    if kind == "topk":
        out = engine.heads(np.concatenate(rows), topk)
        return [out[i] for i in range(len(rows))]
    if kind == "logprobs":
        ids, logprobs = engine.heads_logprobs(np.concatenate(rows), topk)
        return [(ids[i], logprobs[i]) for i in range(len(rows))]
    counts = [len(c.path_ids) for c in calls]  # "level": one hidden row per path
    hidden = np.concatenate([np.repeat(r, n, axis=0) for r, n in zip(rows, counts)])
    ids, logprobs = engine.heads_level(calls[0].depth, hidden, np.concatenate([c.path_ids for c in calls]), topk)
    ends = np.cumsum(counts)
    return [(ids[e - n:e], logprobs[e - n:e]) for e, n in zip(ends, counts)]


class LoopedBatchEngine:
    """The reference :class:`BatchEngine`: one batch-1 call of ``engine`` per row.

    Works with every artifact (their step graphs take one sequence); each row's tokens are
    those of :func:`~medusa_runtime.decode.loop.generate` by construction. Its geometry and capabilities
    are the engine's, ``batched`` False (one call per row); the heads methods are the engine's.

    Args:
        engine: a batch-1 :class:`~medusa_runtime.engines.base.Engine`.
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self.num_layers, self.num_kv_heads, self.head_dim = engine.num_layers, engine.num_kv_heads, engine.head_dim
        self.num_heads, self.kv_dtype = engine.num_heads, engine.kv_dtype

    @property
    def capabilities(self) -> Capabilities:
        """The engine's, ``batched`` False (read at each use: they are the engine's own)."""
        return replace(self.engine.capabilities, batched=False)

    def row_cache(self, capacity: int):
        """The engine's own cache type (:meth:`~medusa_runtime.engines.kvcache.KVCache.for_engine`) of ``capacity`` slots."""
        return KVCache.for_engine(self.engine, capacity)

    def release(self, cache) -> None:
        """Free the row's cache (:meth:`~medusa_runtime.engines.kvcache.CacheState.free`: device memory now,
        nothing for numpy caches)."""
        cache.free()

    def step_rows(self, caches: Sequence, inputs: Sequence[RowInputs]) -> list[StepResult]:
        """``engine.step`` once per row, in order."""
        return [engine_step(self.engine, inp, cache.past()) for cache, inp in zip(caches, inputs)]

    def heads(self, hidden, topk: int) -> np.ndarray:
        """The engine's ``heads``."""
        return self.engine.heads(hidden, topk)

    def heads_logprobs(self, hidden, topk: int):
        """The engine's ``heads_logprobs`` (when its capabilities declare them)."""
        return self.engine.heads_logprobs(hidden, topk)

    def heads_level(self, depth: int, hidden, path_ids, topk: int):
        """The engine's ``heads_level`` (path-conditioned heads)."""
        return self.engine.heads_level(depth, hidden, path_ids, topk)


def batch_engine(engine) -> BatchEngine:
    """``engine`` itself when it declares ``capabilities.batched`` (a :class:`BatchEngine`, or a
    :class:`LoopedBatchEngine` already), else a :class:`LoopedBatchEngine` over it."""
    return engine if engine.capabilities.batched or isinstance(engine, LoopedBatchEngine) else LoopedBatchEngine(engine)


@dataclass
class SequenceRequest:
    """One sequence for the :class:`Scheduler`.

    Attributes:
        prompt_ids: the prompt's token ids (chat template applied), length >= 1.
        max_new_tokens: reply budget, exact, >= 0.
        sampling: the sequence's settings and seed (default: greedy).
        on_tokens: the sequence's streaming callback, as :func:`~medusa_runtime.decode.loop.generate`'s
            (called with each step's emitted tokens; True or an int stops it).
        tree: the sequence's tree (default: the scheduler's), e.g. the root-only tree for
            plain one-token steps.
        tag: anything the caller wants back with the result (an index, a request).
    """

    prompt_ids: Sequence[int]
    max_new_tokens: int
    sampling: SamplingConfig | None = None
    on_tokens: Callable[[list[int]], bool | int | None] | None = None
    tree: StepTree | None = None
    tag: object = None


@dataclass(eq=False)
class SequenceState:
    """A submitted sequence: its request, and once admitted its decode state and result.

    Attributes:
        request: what was submitted.
        result: the decode loop's record (tokens, finish reason, steps; engine_seconds counts the
            wall time of every call the sequence took part in, shared with the other rows).
        error: the exception that ended this sequence alone (its callback raised, its engine call
            failed), or None.
        cancelled: set by :meth:`cancel`; the sequence leaves at the next step boundary with
            finish reason "cancelled".
        submitted / started / finished: ``time.perf_counter()`` when it was submitted, admitted
            (prefill) and finished.
        max_batch_seen: the most sequences it shared a tree step with (itself included).
    """

    request: SequenceRequest
    result: GenerationResult | None = None
    error: BaseException | None = None
    cancelled: bool = False
    submitted: float = 0.0
    started: float = 0.0
    finished: float = 0.0
    max_batch_seen: int = 0
    _decoding: Decoding | None = field(default=None, repr=False)
    _cache: object = field(default=None, repr=False)

    @property
    def done(self) -> bool:
        return self.finished > 0

    @property
    def seconds(self) -> float:
        """Wall time from admission to finish (prefill included)."""
        return self.finished - self.started if self.done and self.started else 0.0

    def cancel(self) -> None:
        """Ask the scheduler to end this sequence at the next step boundary ("cancelled")."""
        self.cancelled = True


def check_row_fits(prompt_tokens: int, capacity: int) -> None:
    """A prompt of ``prompt_tokens`` must fit a batch row's context of ``capacity`` tokens.

    Raises:
        ContextOverflowError: it does not (the message gives both).
    """
    if prompt_tokens > capacity:
        raise ContextOverflowError(f"the prompt has {prompt_tokens} tokens but a sequence's context holds {capacity}")


class Scheduler:
    """In-flight batching: sequences join and leave at step boundaries; each runs its own decode loop.

    Not thread-safe: one thread calls :meth:`submit` and :meth:`step` (a server funnels its
    requests to that thread, see :class:`medusa_runtime.front.serving.BatchServer`).

    Args:
        engine: a :class:`BatchEngine` (or any batch-1 engine, wrapped in :class:`LoopedBatchEngine`).
        tree: the default tree of every sequence.
        max_batch: at most this many sequences run at once (>= 1).
        capacity: KV slots per sequence (default: the engine's ``max_context``).
        eos_token_ids: tokens that end a sequence (not emitted).

    Raises:
        InvalidSettingError: ``max_batch`` < 1, or a bad ``capacity`` (:func:`~medusa_runtime.decode.loop.context_capacity`).
        ContextOverflowError: ``capacity`` exceeds the engine's context.
    """

    def __init__(self, engine, tree: StepTree, *, max_batch: int = DEFAULT_BATCH_SIZE, capacity: int | None = None,
                 eos_token_ids: Sequence[int] = ()):
        if isinstance(max_batch, bool) or not isinstance(max_batch, (int, np.integer)) or max_batch < 1:
            raise InvalidSettingError(f"the batch size must be an integer >= 1, got {max_batch!r}")
        self.engine = batch_engine(engine)
        self.tree = tree
        self.max_batch = int(max_batch)
        self.capacity = context_capacity(self.engine, capacity)
        self.eos_token_ids = list(eos_token_ids)
        self.waiting: deque[SequenceState] = deque()
        self.running: list[SequenceState] = []

    @property
    def idle(self) -> bool:
        """Nothing waiting and nothing running."""
        return not self.waiting and not self.running

    def submit(self, request: SequenceRequest) -> SequenceState:
        """Queue a sequence; it joins at the next step boundary with a free row.

        Raises:
            InvalidSettingError: empty prompt, bad max_new_tokens (checked now, before any work).
            InvalidTreeError: a tree deeper than the engine's heads.
            ContextOverflowError: the prompt does not fit a row.
            UnsupportedSamplingError: settings the engine cannot sample exactly.
        """
        tree = request.tree or self.tree
        prompt = check_request(self.engine, request.prompt_ids, tree, request.max_new_tokens)
        check_row_fits(int(prompt.size), self.capacity)
        if request.sampling is not None and self.engine.capabilities.step_topk:
            engine_sampling_route(self.engine, request.sampling)
        state = SequenceState(request, submitted=time.perf_counter())
        self.waiting.append(state)
        return state

    def run(self) -> list[SequenceState]:
        """Step until every submitted sequence has finished; returns them in the order they finished."""
        done: list[SequenceState] = []
        while not self.idle:
            done.extend(self.step())
        return done

    def step(self) -> list[SequenceState]:
        """One step boundary: cancelled sequences leave, waiting ones join (prefilled), then every
        running sequence takes one tree step.

        Returns:
            The sequences that finished during this call (with ``result`` or ``error`` set).
        """
        finished: list[SequenceState] = []
        for s in [s for s in self.running if s.cancelled]:
            s.result.finish_reason = "cancelled"
            self._leave(s, finished)
        while self.waiting and len(self.running) < self.max_batch:
            s = self.waiting.popleft()
            if s.cancelled:
                s.result = GenerationResult([], "cancelled", prompt_tokens=len(s.request.prompt_ids))
                s.finished = time.perf_counter()
                finished.append(s)
                continue
            self._join(s, finished)
        if self.running:
            self._run(list(self.running), finished)
        return finished

    # -- internals -------------------------------------------------------------------------

    def _join(self, s: SequenceState, finished: list[SequenceState]) -> None:
        req = s.request
        s.started = time.perf_counter()
        try:
            s._cache = self.engine.row_cache(self.capacity)
            s._decoding = Decoding(self.engine, req.prompt_ids, req.tree or self.tree,
                                   max_new_tokens=req.max_new_tokens, cache=s._cache,
                                   eos_token_ids=self.eos_token_ids, sampling=req.sampling, on_tokens=req.on_tokens)
        except Exception as exc:  # noqa: BLE001 - this sequence alone fails
            s.result = GenerationResult([], "error", prompt_tokens=len(req.prompt_ids))
            s.error = exc
            self._leave(s, finished)
            return
        s.result = s._decoding.result
        self.running.append(s)
        self._run([s], finished, prefill=True)

    def _leave(self, s: SequenceState, finished: list[SequenceState]) -> None:
        if s in self.running:
            self.running.remove(s)
        if s._cache is not None:
            self.engine.release(s._cache)
            s._cache = None
        s._decoding = None
        s.finished = time.perf_counter()
        if s.result is not None and s.started:
            s.result.host_seconds = max(0.0, s.finished - s.started - s.result.engine_seconds)
        finished.append(s)

    def abort(self) -> list[SequenceState]:
        """Drop every running and waiting sequence, releasing the running ones' KV rows; returns them (running
        first) for the caller to answer."""
        dropped = list(self.running) + list(self.waiting)
        for s in self.running:
            if s._cache is not None:
                self.engine.release(s._cache)
                s._cache = None
            s._decoding = None
        self.running.clear()
        self.waiting.clear()
        return dropped

    def _fail(self, s: SequenceState, exc: BaseException, finished: list[SequenceState]) -> None:
        s.error = exc
        s.result.finish_reason = "error"
        self._leave(s, finished)

    def _run(self, seqs: list[SequenceState], finished: list[SequenceState], prefill: bool = False) -> None:
        """One engine call over ``seqs`` (one per row for row-by-row engines), then advance and heads."""
        ready = []
        for s in seqs:
            try:
                inputs = s._decoding.inputs()
            except Exception as exc:  # noqa: BLE001
                self._fail(s, exc, finished)
                continue
            if inputs is None:  # finished without a call (max_new_tokens 0, the context is full)
                self._leave(s, finished)
            else:
                ready.append((s, inputs))
        if not prefill:
            for s, _ in ready:
                s.max_batch_seen = max(s.max_batch_seen, len(ready))
        groups = ([ready] if ready else []) if self.engine.capabilities.batched else [[r] for r in ready]
        for group in groups:
            t = time.perf_counter()
            try:
                outs = self.engine.step_rows([s._cache for s, _ in group], [inp for _, inp in group])
            except Exception as exc:  # noqa: BLE001 - the rows of this call fail, the others go on
                for s, _ in group:
                    self._fail(s, exc, finished)
                continue
            self._charge(group, time.perf_counter() - t, prefill)
            need = []
            for (s, _), out in zip(group, outs):
                try:
                    s._decoding.advance(out)
                except Exception as exc:  # noqa: BLE001 - its callback raised: it alone fails
                    self._fail(s, exc, finished)
                    continue
                if s._decoding.done:
                    self._leave(s, finished)
                elif s._decoding.heads_row is not None:
                    need.append(s)
            self._heads(need, finished)

    def _charge(self, group, seconds: float, prefill: bool) -> None:
        for s, _ in group:
            s.result.engine_seconds += seconds
            if prefill:
                s.result.prefill_seconds = seconds

    def _heads(self, need: list[SequenceState], finished: list[SequenceState]) -> None:
        """The heads of the sequences that need them, call after call until each has its next step's
        candidates (one call for Medusa heads, one per tree level for path-conditioned heads): the calls of
        the same kind, level and top-k in one engine call when the rows are host arrays, else one per row."""
        while need:
            groups: dict[tuple, list[SequenceState]] = {}
            for s in need:
                call, row = s._decoding.heads_call, s._decoding.heads_row
                key = (call.kind, call.depth, call.topk) if isinstance(row, np.ndarray) else ("row", id(s))
                groups.setdefault(key, []).append(s)
            for key, group in groups.items():
                rows = [s._decoding.heads_row for s in group]
                calls = [s._decoding.heads_call for s in group]
                t = time.perf_counter()
                try:
                    if len(group) > 1:
                        results = run_heads_rows(self.engine, rows, calls)
                    else:
                        results = [run_heads(self.engine, rows[0], calls[0])]
                except Exception as exc:  # noqa: BLE001
                    for s in group:
                        self._fail(s, exc, finished)
                    continue
                dt = time.perf_counter() - t
                for s, result in zip(group, results):
                    s._decoding.set_heads(result)
                    s.result.engine_seconds += dt
            need = [s for s in need if s._decoding is not None and s._decoding.heads_row is not None]
