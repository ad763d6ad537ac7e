"""The Medusa decode loop, batch size 1, over any engine (Medusa paper, Algorithm).

prefill -> candidates from the heads -> one step over the tree (tree mask, position =
past length + depth) -> host-side acceptance -> KV compaction -> stops, repeated.

The loop is written once and driven by an :class:`~medusa_runtime.engines.base.Engine`: ONNX Runtime or TensorRT in
deployment, PyTorch for the reference (``medusa_export.model.decode.TorchEngine``). It owns the
KV buffers (numpy, sequence-major ``[1, capacity, H_kv, D]`` per layer and K/V), hands the
engine views of their valid prefix (no copy) and keeps only the accepted nodes' K/V. Engines
whose step writes into the cache itself bring their own cache (``make_cache``), e.g. the
head-major :class:`~medusa_runtime.engines.kvcache.HeadMajorKVCache` of ``ort-fused`` artifacts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from .acceptance import PositionUniforms, SamplingConfig, draw_tokens, sampling_route
from .candidates import HeadsCall, Plan, Proposal, plan_for, run_plan
from ..engines.base import Capabilities, Engine, RowInputs, SamplerInputs, StepResult
from ..engines.kvcache import KVCache, fits
from ..errors import ContextOverflowError, InvalidPromptError, InvalidSettingError, InvalidTreeError
from ..stops import apply_stops
from ..trees.tree import make_tree
from ..trees.dynamic import StepTree


def runs_dynamic_trees(caps: Capabilities) -> bool:
    """Whether an engine of these capabilities runs per-step trees (``--tree dynamic:T``): path-conditioned
    heads always do (each level returns its log-probabilities), Medusa heads when ``heads_logprobs``
    returns them (the heads graph has ``medusa_topk_logprobs``)."""
    return caps.head_type == "hydra" or caps.heads_logprobs


def check_heads(engine: Engine, tree: StepTree) -> None:
    """Refuse a tree policy the engine's heads cannot run (before any work), from its declared
    :class:`~medusa_runtime.engines.base.Capabilities`.

    Raises:
        InvalidTreeError: a per-step tree on an engine that cannot run one (:func:`runs_dynamic_trees`:
            Medusa heads whose graph returns no log-probabilities; the message says to rebuild the
            artifact or use a static tree).
    """
    if tree.size > 1 and tree.policy == "dynamic" and not runs_dynamic_trees(engine.capabilities):
        raise InvalidTreeError("per-step trees (--tree dynamic:T) need the heads' log-probabilities, which this "
                               "artifact's heads graph does not return: rebuild it, or use a static --tree")


def run_heads(engine: Engine, hidden_row, call: HeadsCall):
    """Answer one :class:`~medusa_runtime.decode.candidates.HeadsCall` of one sequence with the engine's heads.

    Args:
        engine: the backend.
        hidden_row: [1, d] the hidden state of the sequence's last accepted node (a row slice of
            ``StepResult.hidden``).
        call: what the sequence's candidate choice needs.

    Returns:
        What the call's kind expects (see :class:`~medusa_runtime.decode.candidates.HeadsCall`).
    """
    if call.kind == "topk":
        return engine.heads(hidden_row, call.topk)[0]
    if call.kind == "logprobs":
        ids, logprobs = engine.heads_logprobs(hidden_row, call.topk)
        return ids[0], logprobs[0]
    return engine.heads_level(call.depth, hidden_row, call.path_ids, call.topk)


def proposer(engine: Engine, tree: StepTree, timed: Callable = lambda f, *a: f(*a)
             ) -> Callable[[object, int], Proposal]:
    """A step's candidates for the engine's head type and the tree policy, the heads run at once
    (benchmarks and ``--tree auto`` time it; the decode loop runs the same plan through :class:`Decoding`).

    Args:
        engine: the backend (``capabilities.head_type`` and the heads methods, see :class:`Engine`).
        tree: a static :class:`Tree`, or a :class:`~medusa_runtime.trees.dynamic.DynamicTree` (per-step
            trees of fixed size).
        timed: ``timed(fn, *args)`` calls ``fn(*args)`` (e.g. adding its time to a total).

    Returns:
        ``propose(hidden_row, root) -> Proposal``: hidden_row is the [1, d] row of the last
        accepted node's hidden state, root the next token.

    Raises:
        InvalidTreeError: see :func:`check_heads`.
    """
    check_heads(engine, tree)
    plan = plan_for(engine.capabilities.head_type, tree)
    return lambda hidden_row, root: run_plan(plan(root), lambda call: timed(run_heads, engine, hidden_row, call))


@dataclass
class GenerationResult:
    """Output of one generation.

    Attributes:
        tokens: emitted token ids (EOS excluded).
        finish_reason: "stop" (EOS or stop string) or "length" (max_new_tokens, or the context is full).
        step_tokens: tokens each tree step emitted (accepted candidates + 1, less what EOS, a stop
            string or max_new_tokens cut off; EOS itself is not counted), so that
            ``len(tokens) == 1 + sum(step_tokens)`` whenever the prefill's token was emitted.
        accept_depths: per tree step, the candidates acceptance accepted after the root and that were
            emitted: in the step that stopped, none after EOS, a stop string or max_new_tokens (so
            ``accept_depths[i] <= step_tokens[i]``; equal to it less 1 in every step that did not stop).
        prompt_tokens: prompt length.
        engine_seconds / host_seconds: wall time in engine calls / in the loop's own work.
        prefill_seconds: wall time of the prefill call.
        prefilled: the prefill call ran (False only when there was nothing to generate: ``max_new_tokens`` 0).
    """

    tokens: list[int]
    finish_reason: str
    step_tokens: list[int] = field(default_factory=list)
    accept_depths: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    engine_seconds: float = 0.0
    host_seconds: float = 0.0
    prefill_seconds: float = 0.0
    prefilled: bool = False

    @property
    def steps(self) -> int:
        """Tree steps run after the prefill."""
        return len(self.step_tokens)

    @property
    def forward_passes(self) -> int:
        """Step-graph calls that ran: the prefill (when it ran) and the tree steps."""
        return int(self.prefilled) + self.steps

    @property
    def mean_accepted(self) -> float:
        """Mean emitted tokens per tree step (accepted candidates + the bonus token); 0 if no step."""
        return float(np.mean(self.step_tokens)) if self.step_tokens else 0.0


def causal_mask(n: int) -> np.ndarray:
    """bool [n, n] lower-triangular: the prefill's mask over the new tokens."""
    return np.tril(np.ones((n, n), dtype=bool))


def context_capacity(engine: Engine, max_context: int | None) -> int:
    """The KV capacity of a generation: ``max_context``, or the engine's own when None.

    Args:
        engine: the backend (its ``capabilities.max_context``, when it says one, is the artifact's
            ``model.max_context``: the graphs' rotary tables and optimization profiles end there).
        max_context: the capacity asked for, or None.

    Raises:
        InvalidSettingError: ``max_context`` < 1, or None for an engine that does not say its context.
        ContextOverflowError: ``max_context`` exceeds the engine's.
    """
    limit = engine.capabilities.max_context
    if max_context is None:
        if limit is None:
            raise InvalidSettingError("this engine does not say its context length (capabilities.max_context is "
                                      "None): pass max_context")
        return int(limit)
    if isinstance(max_context, bool) or not isinstance(max_context, (int, np.integer)) or max_context < 1:
        raise InvalidSettingError(f"max_context must be an integer >= 1, got {max_context!r}")
    if limit is not None and max_context > limit:
        raise ContextOverflowError(f"max_context {max_context} exceeds the engine's context of {limit} tokens "
                                   f"(the artifact's model.max_context): use 1..{limit}")
    return int(max_context)


def engine_sampling_route(engine: Engine, sampling: SamplingConfig, step_topk: int | None = None) -> str:
    """:func:`~medusa_runtime.decode.acceptance.sampling_route` for an engine ("greedy", "host" or "graph").

    Args:
        engine: the backend (its ``capabilities``: ``step_topk``, ``vocab_size``, ``sampler``).
        sampling: the settings.
        step_topk: k of the step's top-k outputs when the engine does not say it.

    Raises:
        UnsupportedSamplingError: the settings are not exact on this engine.
    """
    caps = engine.capabilities
    k = caps.step_topk or step_topk
    return sampling_route(sampling, step_topk=int(k), vocab_size=caps.vocab_size, graph_sampler=caps.sampler)


def engine_step(engine: Engine, inputs: RowInputs, past) -> StepResult:
    """``engine.step`` on one sequence's :class:`RowInputs` (adds the batch dimension of one)."""
    kwargs = {"sampling": inputs.sampling} if inputs.sampling is not None else {}
    return engine.step(inputs.tokens[None], inputs.positions[None], inputs.mask, inputs.temperature, past, **kwargs)


def check_prompt_ids(prompt_ids: Sequence[int], vocab_size: int | None) -> np.ndarray:
    """The prompt as int64 [n], after checking that every id is a token id.

    A token id is an integer (Python ``int`` or a numpy integer; not ``bool``, not a float even when whole:
    ``int(1.5)`` would silently become 1) in ``0 .. vocab_size - 1``; a negative id would index the
    embedding table from its end (numpy and ONNX Gather wrap), one >= vocab_size fails inside the graph.

    Args:
        prompt_ids: the ids, length >= 1.
        vocab_size: V, the embedding table's rows (``manifest.model.vocab_size``); None: the upper
            bound is not checked.

    Raises:
        InvalidSettingError: the prompt is empty.
        InvalidPromptError: an id out of range or not an integer (the message names it, its index and the range).
    """
    ids = list(prompt_ids)
    if not ids:
        raise InvalidSettingError("the prompt is empty: give at least one token")
    valid = f"token ids are integers in 0..{vocab_size - 1} (vocabulary {vocab_size})" if vocab_size \
        else "token ids are integers >= 0"
    for i, t in enumerate(ids):
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
            raise InvalidPromptError(f"prompt_ids[{i}] = {t!r} ({type(t).__name__}) is not a token id: {valid}")
        if t < 0 or (vocab_size and t >= vocab_size):
            raise InvalidPromptError(f"prompt_ids[{i}] = {t} is out of range: {valid}")
    return np.asarray(ids, dtype=np.int64)


def check_prompt_fits(prompt_tokens: int, capacity: int, used: int = 0) -> None:
    """A prompt of ``prompt_tokens`` must fit the ``capacity - used`` slots a cache has free.

    Raises:
        ContextOverflowError: it does not (the message gives the prompt's tokens, the free slots and the context).
    """
    if used + prompt_tokens > capacity:
        raise ContextOverflowError(f"the prompt has {prompt_tokens} tokens but only {capacity - used} of the "
                                   f"{capacity}-token context are free")


def check_request(engine: Engine, prompt_ids: Sequence[int], tree: StepTree,
                  max_new_tokens: int) -> np.ndarray:
    """The prompt as int64 [n] after checking a generation's settings against the engine.

    Raises:
        InvalidSettingError: empty prompt, max_new_tokens not an integer >= 0.
        InvalidPromptError: a prompt id that is not a token id (:func:`check_prompt_ids`, against the engine's
            ``capabilities.vocab_size`` when it says one).
        InvalidTreeError: a tree deeper than the engine's heads, or one its heads cannot run (:func:`check_heads`).
    """
    prompt = check_prompt_ids(prompt_ids, engine.capabilities.vocab_size)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0:
        raise InvalidSettingError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if tree.max_depth > engine.num_heads:
        raise InvalidTreeError(f"tree depth {tree.max_depth} exceeds the engine's {engine.num_heads} Medusa heads")
    check_heads(engine, tree)
    return prompt


class Decoding:
    """One sequence's decode loop, one engine call at a time: what :func:`generate` runs, and what
    the batch scheduler (:mod:`medusa_runtime.decode.batch`) runs for each of its sequences.

    The driver asks :meth:`inputs` for the next call (the prefill first, then tree steps), runs
    the engine on them over :attr:`cache`'s past, hands the result to :meth:`advance`
    (drawing, acceptance, KV compaction, stops and the ``on_tokens`` callback happen there),
    then, while :attr:`heads_row` is set, runs the heads call :attr:`heads_call` on it
    (:func:`run_heads`) and hands the result to :meth:`set_heads`; until :meth:`inputs` returns
    None. Everything that depends on the sequence (its sampling stream, stops, cache) lives
    here, so sequences never share state.

    The next step's candidates are a :data:`~medusa_runtime.decode.candidates.Plan` of the engine's head
    type and the tree policy (:func:`~medusa_runtime.decode.candidates.plan_for`): Medusa heads need one
    heads call (their top-k, with log-probabilities for a per-step tree); path-conditioned heads
    one call per tree level, each on the paths the level before chose. Whoever drives the
    sequence runs the calls, so the batch scheduler runs a level for all its sequences at once.

    Args: as :func:`generate`, plus ``cache``: the sequence's KV cache (its valid prefix precedes
        ``prompt_ids``).

    Raises:
        InvalidSettingError, InvalidTreeError: as :func:`check_request`.
        UnsupportedSamplingError: sampling settings this engine cannot sample exactly.
        ContextOverflowError: the prompt does not fit the cache.
    """

    def __init__(self, engine: Engine, prompt_ids: Sequence[int], tree: StepTree, *, max_new_tokens: int,
                 cache,
                 eos_token_ids: Sequence[int] = (), sampling: SamplingConfig | None = None,
                 on_tokens: Callable[[list[int]], bool | int | None] | None = None):
        self.sampling = sampling if sampling is not None else SamplingConfig()
        self.prompt = check_request(engine, prompt_ids, tree, max_new_tokens)
        check_prompt_fits(int(self.prompt.size), cache.capacity, cache.length)
        self.engine, self.tree, self.cache = engine, tree, cache
        self.max_new_tokens, self.eos_token_ids, self.on_tokens = max_new_tokens, eos_token_ids, on_tokens
        self.route = engine_sampling_route(engine, self.sampling) if engine.capabilities.step_topk else None
        self.result = GenerationResult([], "length", prompt_tokens=int(self.prompt.size))
        self.done = max_new_tokens == 0
        self.root_tree = make_tree([], num_heads=engine.num_heads, topk=tree.topk)
        self.mode = self.sampling.mode
        self.rule = self.sampling.rule  # medusa_runtime.decode.acceptance.ACCEPTANCE_RULES
        self.rule_params = self.rule.params(self.sampling) if self.rule.params is not None else None
        self.temperature = self.sampling.temperature if self.rule.sampled else 1.0
        self.uniforms = PositionUniforms(self.sampling.seed)
        self.heads_row = None  # the [1, d] hidden row whose heads the next step needs (set by advance)
        self.heads_call: HeadsCall | None = None  # what to run on heads_row (set with it)
        self._root: int | None = None  # the next step's root (None: not prefilled yet)
        self._plan_for = plan_for(engine.capabilities.head_type, tree) if tree.size > 1 else None
        self._plan: Plan | None = None
        self._proposal: Proposal | None = None  # the next step's tree and candidates
        self._pending: tuple | None = None  # (step tree or None for the prefill, tokens, draw positions)

    @property
    def prefilled(self) -> bool:
        return self._root is not None

    def _row_inputs(self, tokens, positions, mask, draw_positions) -> RowInputs:
        sampling = None
        if self.route == "graph":
            u = np.full(len(tokens), -1.0, np.float32)  # < 0: the graph does not sample the row
            rows = draw_positions >= 0
            u[rows] = self.uniforms.at(draw_positions[rows])
            sampling = SamplerInputs(u, self.sampling.top_k, self.sampling.top_p)
        return RowInputs(tokens, positions, mask, self.temperature, sampling)

    def inputs(self) -> RowInputs | None:
        """The next engine call's inputs, or None when the sequence is finished.

        Ends the sequence ("length") when not even a one-token step fits the cache; a tree
        that no longer fits falls back to the root alone.

        Raises:
            RuntimeError: the previous call's result was not handed to :meth:`advance`, or
                :attr:`heads_row` is waiting for :meth:`set_heads`.
        """
        if self._pending is not None or self.heads_row is not None:
            raise RuntimeError("advance() / set_heads() must follow each call's inputs()")
        if self.done:
            return None
        cache = self.cache
        if not self.prefilled:  # the prompt with a causal mask; its last row draws generated position 0
            n = int(self.prompt.size)
            draws = np.full(n, -1, np.int64)
            draws[-1] = 0
            self._pending = (None, self.prompt, draws)
            return self._row_inputs(self.prompt, cache.length + np.arange(n, dtype=np.int64), causal_mask(n), draws)
        proposal, self._proposal = self._proposal, None
        rows = self.engine.capabilities.min_rows  # the engine pads smaller steps to this many rows
        if proposal is None or not fits(cache.length, max(proposal.tree.size, rows), cache.capacity):
            proposal = Proposal(self.root_tree, np.array([self._root], np.int64))
        if not fits(cache.length, max(proposal.tree.size, rows), cache.capacity):
            self.result.finish_reason = "length"  # the context is full
            self.done = True
            return None
        tree, tokens = proposal
        b = tree.buffers()
        draws = len(self.result.tokens) + b.depth  # generated position each node draws (the root is the last emitted)
        self._pending = (tree, tokens, draws)
        return self._row_inputs(tokens, cache.length + b.depth, b.attention_mask, draws)

    def _draw(self, out: StepResult, rows, positions) -> np.ndarray:
        """int64 [len(rows)] the token drawn at each row, with the uniform of its generated position."""
        if self.route == "greedy":
            return np.asarray(out.topk_ids[rows, 0], dtype=np.int64)
        if self.route == "graph":
            return np.asarray(out.sampled_ids[rows], dtype=np.int64)
        return draw_tokens(out.topk_ids[rows], out.topk_logprobs[rows], self.uniforms.at(positions),
                           self.sampling.top_k, self.sampling.top_p)

    def _emit(self, step_tokens: list[int]) -> int:
        """Emit a step's tokens up to a stop; returns how many were emitted (sets :attr:`done`)."""
        result = self.result
        stop = apply_stops(step_tokens, generated=len(result.tokens), max_new_tokens=self.max_new_tokens,
                           eos_token_ids=self.eos_token_ids)
        kept = stop.tokens
        if self.on_tokens and kept:
            ret = self.on_tokens(kept)
            if ret is not None and ret is not False:
                n = len(kept) if ret is True else int(ret)
                if not 0 <= n <= len(kept):
                    raise ValueError(f"on_tokens returned {n} for {len(kept)} tokens")
                result.tokens.extend(kept[:n])
                result.finish_reason = "stop"
                self.done = True
                return n
        result.tokens.extend(kept)
        if stop.finish_reason is not None:
            result.finish_reason = stop.finish_reason
            self.done = True
        return len(kept)

    def advance(self, out: StepResult) -> None:
        """Take the engine's result for the last :meth:`inputs`: draw, accept, compact the KV cache, emit.

        Sets :attr:`done` when the sequence ends, else :attr:`heads_row` when the next step's
        candidates need the heads.
        """
        if self._pending is None:
            raise RuntimeError("advance() without inputs()")
        tree, tokens, draws = self._pending
        self._pending = None
        if tree is None:  # the prefill: all of its K/V are kept
            n = int(tokens.size)
            if self.route is None:  # the engine does not say its k: the prefill's outputs do
                self.route = engine_sampling_route(self.engine, self.sampling, step_topk=out.topk_ids.shape[-1])
            self.cache.keep(out.new_kv, np.arange(n), tokens)
            self.result.prefilled = True
            self._root = int(self._draw(out, [n - 1], [0])[0])
            self._emit([self._root])
            last = n - 1
        else:
            drawn = self._draw(out, np.arange(tree.size), draws)
            acc = self.rule.accept(tree, tokens, drawn, out, self.rule_params)
            self.cache.keep(out.new_kv, acc.accepted, tokens[acc.accepted])
            emitted = self._emit([int(t) for t in tokens[acc.accepted[1:]]] + [acc.next_token])
            self.result.step_tokens.append(emitted)
            # the candidates accepted *and used*: none after EOS, a stop string or max_new_tokens in the step that ended
            self.result.accept_depths.append(min(acc.accept_length, emitted))
            self._root = acc.next_token
            last = int(acc.accepted[-1])
        if not self.done and self._plan_for is not None and fits(self.cache.length, self.tree.size,
                                                                   self.cache.capacity):
            self._plan = self._plan_for(self._root)
            self.heads_row = out.hidden[last : last + 1]
            self._next_call(None)

    def _next_call(self, result) -> None:
        """Send ``result`` into the plan (None: start it); keep its next call, or its proposal when done."""
        try:
            self.heads_call = next(self._plan) if result is None else self._plan.send(result)
        except StopIteration as stop:
            self._proposal, self._plan, self.heads_call, self.heads_row = stop.value, None, None, None

    def set_heads(self, result) -> None:
        """The result of :attr:`heads_call` on :attr:`heads_row` (:func:`run_heads`; for Medusa heads on
        a static tree, ``engine.heads(row, topk)[0]``: int [K, >= topk]). Clears :attr:`heads_row` when
        the next step's candidates are chosen; else :attr:`heads_call` is the next level's call.

        Raises:
            RuntimeError: no heads call is pending.
        """
        if self._plan is None:
            raise RuntimeError("set_heads() without a pending heads call")
        self._next_call(result)


def generate(
    engine: Engine,
    prompt_ids: Sequence[int],
    tree: StepTree,
    *,
    max_new_tokens: int,
    eos_token_ids: Sequence[int] = (),
    max_context: int | None = None,
    sampling: SamplingConfig | None = None,
    on_tokens: Callable[[list[int]], bool | int | None] | None = None,
    cache: KVCache | None = None,
) -> GenerationResult:
    """Generate with Medusa: greedy (lossless vs plain greedy), exact sampling, or typical acceptance.

    Tokens are drawn as :mod:`medusa_runtime.decode.acceptance` describes: the token of generated
    position m with the m-th uniform of one generator seeded with ``sampling.seed``, from the
    step's top-k outputs on the host, or by the in-graph sampler (``sampled_ids``) when the
    settings need the whole vocabulary and the engine has it (:func:`engine_sampling_route`).
    The loop body is :class:`Decoding`; this function drives it with batch-1 engine calls.

    Args:
        engine: the backend.
        prompt_ids: the prompt's token ids (chat template applied), length >= 1. With
            ``cache`` given, these are the tokens *after* the cache's valid prefix.
        tree: the token tree; ``make_tree([])`` (root only) gives plain one-token steps; a
            :class:`~medusa_runtime.trees.dynamic.DynamicTree` chooses a tree of its size every step.
        max_new_tokens: maximum emitted tokens (exact), >= 0.
        eos_token_ids: tokens that end generation (not emitted).
        max_context: KV capacity in tokens (default: the engine's ``max_context``, i.e. the
            artifact's; never more). When the tree no longer fits, steps fall back to the root
            alone; when nothing fits, generation ends with "length". Ignored with ``cache``.
        sampling: temperature, acceptance rule, top-k/top-p, typical's thresholds and the seed
            (default: :class:`SamplingConfig`'s defaults, greedy).
        on_tokens: called with each step's emitted tokens (streaming). Returning True stops
            generation after them (finish_reason "stop"; used for stop strings); returning an
            int n stops after the first n of them; None or False continues.
        cache: a cache to continue from (multi-turn chat; the caller frees it); a new one when None, freed
            (:meth:`~medusa_runtime.engines.kvcache.CacheState.free`) when the generation ends, even by an exception.

    Raises:
        InvalidSettingError: empty prompt, max_new_tokens < 0, a bad max_context.
        UnsupportedSamplingError: sampling settings this engine cannot sample exactly.
        InvalidTreeError: a tree deeper than the engine's heads.
        ContextOverflowError: the prompt does not fit the context, or ``max_context`` exceeds the engine's.
    """
    check_request(engine, prompt_ids, tree, max_new_tokens)
    own = cache is None  # a cache made here is freed here (device caches hold GPU memory until freed)
    if own:
        cache = KVCache.for_engine(engine, context_capacity(engine, max_context))
    try:
        dec = Decoding(engine, prompt_ids, tree, max_new_tokens=max_new_tokens, cache=cache,
                       eos_token_ids=eos_token_ids, sampling=sampling, on_tokens=on_tokens)
        result = dec.result
        t_start = time.perf_counter()
        while (inputs := dec.inputs()) is not None:
            t = time.perf_counter()
            out = engine_step(engine, inputs, cache.past())
            result.engine_seconds += time.perf_counter() - t
            if not dec.prefilled:
                result.prefill_seconds = result.engine_seconds
            dec.advance(out)
            while dec.heads_row is not None:
                t = time.perf_counter()
                dec.set_heads(run_heads(engine, dec.heads_row, dec.heads_call))
                result.engine_seconds += time.perf_counter() - t
    finally:
        if own:
            cache.free()
    if max_new_tokens > 0:
        result.host_seconds = time.perf_counter() - t_start - result.engine_seconds
    return result
