"""High-level generation over an artifact: text in, text out, torch-free.

``MedusaSession(artifact_dir)`` opens the artifact (manifest, checksums, tree), creates an
engine on the chosen backend and the tokenizer, and offers:

* :meth:`MedusaSession.generate`: one prompt (text, chat messages or token ids) -> a
  :class:`Completion` (text, ids, finish reason, timing), greedy (lossless), exact sampling
  (plain sampling's law) or typical acceptance (:class:`SamplingConfig`), stop strings,
  ``vanilla=True`` for one token per step through the same engine (the root-only tree), and
  a streaming callback that receives text deltas;
* :meth:`MedusaSession.generate_batch`: many prompts, up to ``batch_size`` sequences sharing
  each step (in-flight batching, :mod:`medusa_runtime.decode.batch`), each decoded exactly as
  :meth:`~MedusaSession.generate` decodes it alone;
* :meth:`MedusaSession.chat`: multi-turn chat with the chat template. The KV cache is
  kept between turns and reused for the longest prefix of token ids that the new
  conversation shares with what the cache holds (K/V at a slot depend only on the tokens
  up to it, so this is exact); only the rest is prefilled.
"""

from __future__ import annotations

import numbers
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from ..contract.artifact import Artifact, load_artifact
from ..contract.tokenizer import NO_TEMPLATE_MESSAGE, RuntimeTokenizer
from ..decode.acceptance import SamplingConfig, sampling_config
from ..decode.batch import DEFAULT_BATCH_SIZE, Scheduler, SequenceRequest, batch_engine, check_row_fits
from ..decode.loop import GenerationResult, check_prompt_fits, engine_sampling_route, generate
from ..engines import DEFAULT_BACKEND, create_engine
from ..engines.kvcache import KVCache
from ..errors import ChatTemplateError, MedusaError
from ..trees.tree import Tree, make_tree
from ..tuning.autotree import TreeTiming
from ..tuning.resolve import ResolvedTree, TreeContext, resolve_tree
from ..tuning.treecache import DefaultTree

#: Reply budget when none is given (generate, the CLIs, Triton requests).
DEFAULT_MAX_NEW_TOKENS = 128


@dataclass
class Completion:
    """One reply.

    Attributes:
        text: the reply, cut where a stop string starts; special tokens skipped.
        token_ids: the reply's ids (EOS excluded; up to the token that completed a stop string).
        finish_reason: "stop" (EOS or a stop string) or "length" (max_new_tokens or the context).
        result: the decode loop's record (steps, accepted tokens per step and depth, timing).
        prompt_tokens: tokens of the prompt (the whole rendered conversation in a chat).
        reused_tokens: prompt tokens whose K/V came from the previous turn's cache.
        seconds: wall time of the generation, prefill included.
    """

    text: str
    token_ids: list[int]
    finish_reason: str
    result: GenerationResult
    prompt_tokens: int
    reused_tokens: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        """Reply tokens per second of wall time, prefill included."""
        return len(self.token_ids) / self.seconds if self.seconds > 0 else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Mean tokens emitted per tree step (accepted candidates + 1): 1.0 in vanilla mode, except that the step
        whose token is EOS emits nothing (the stop token is not part of the reply), which lowers the mean."""
        return self.result.mean_accepted

    def stats(self) -> dict:
        """Numbers for logs and benchmarks (JSON-able)."""
        r = self.result
        return {"new_tokens": len(self.token_ids), "prompt_tokens": self.prompt_tokens,
                "reused_tokens": self.reused_tokens, "finish_reason": self.finish_reason, "steps": r.steps,
                "tokens_per_step": r.mean_accepted, "tokens_per_second": self.tokens_per_second,
                "seconds": self.seconds, "prefill_seconds": r.prefill_seconds, "engine_seconds": r.engine_seconds,
                "host_seconds": r.host_seconds}


class ReplyText:
    """The text side of one reply: stop strings cut it, ``on_step`` receives each step's ids and text.

    Args:
        tokenizer: the session's tokenizer.
        stop: stop strings.
        on_step: called after each step that emitted something with the step's token ids (EOS
            excluded, cut at a stop string) and the newly printable text; a last call with no
            ids may carry text held back until the end. None: not called.
    """

    def __init__(self, tokenizer: RuntimeTokenizer, stop: Sequence[str],
                 on_step: Callable[[list[int], str], None] | None = None):
        self.tokenizer, self.on_step = tokenizer, on_step
        self.decoder = tokenizer.stream(stop)
        self.fed = False

    @property
    def on_tokens(self) -> Callable[[list[int]], int | None] | None:
        """The decode loop's callback (:meth:`feed`), or None when neither stops nor ``on_step`` need it."""
        return self.feed if (self.decoder.stop_strings or self.on_step) else None

    def feed(self, tokens: list[int]) -> int | None:
        """A step's emitted tokens; returns how many to keep when a stop string completed, else None."""
        self.fed = True
        start = len(self.decoder.tokens)
        kept = self.decoder.add_all(tokens)  # stops the loop after the token that completed a stop string
        if self.on_step is not None:
            ids, piece = self.decoder.tokens[start:], self.decoder.take()
            if ids or piece:
                self.on_step(ids, piece)
        return kept

    def completion(self, res: GenerationResult, prompt_tokens: int, reused: int = 0, seconds: float = 0.0,
                   finish_reason: str | None = None) -> "Completion":
        """The :class:`Completion` of a finished generation (hands the text held back to ``on_step``)."""
        reason = finish_reason or res.finish_reason
        if not self.fed:
            return Completion(self.tokenizer.decode(res.tokens), list(res.tokens), reason, res, prompt_tokens, reused,
                              seconds)
        tail = self.decoder.finish()
        if tail and self.on_step is not None:
            self.on_step([], tail)
        return Completion(self.decoder.text, list(self.decoder.tokens), reason, res, prompt_tokens, reused, seconds)


def _text_stream(stream: Callable[[str], None] | None) -> Callable[[list[int], str], None] | None:
    """``stream(text)`` as an ``on_step(ids, text)`` callback (text pieces only)."""
    return None if stream is None else (lambda ids, piece: stream(piece) if piece else None)


def _stderr_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _per_prompt(value, n: int, name: str, kind: type) -> list:
    """``value`` for each of n prompts: a single value repeated, or a list of n values.

    Raises:
        ValueError: a list whose length is not n.
    """
    if value is None or isinstance(value, kind):
        return [value] * n
    values = list(value)
    if len(values) != n:
        raise ValueError(f"{name} has {len(values)} values for {n} prompts: give one, or one per prompt")
    return values


def session_capacity(artifact: Artifact, max_context: int | None) -> int:
    """The KV capacity a session over ``artifact`` runs with: ``max_context``, else the artifact's.

    Raises:
        MedusaError: ``max_context`` outside 1 .. the artifact's.
    """
    limit = int(artifact.model.max_context)
    if max_context is not None and not 1 <= max_context <= limit:
        raise MedusaError(f"max_context must be in 1..{limit} (the artifact's), got {max_context}")
    return max_context or limit


def encode_prompt(tokenizer: RuntimeTokenizer, prompt: str | Sequence[dict], raw: bool = False) -> list[int]:
    """Prompt ids: a user message (or a message list) through the chat template, or ``raw`` text.

    Without a chat template (a base model's artifact) a string prompt is encoded as plain text, as with ``raw``; a
    message list raises :class:`ChatTemplateError`.
    """
    if isinstance(prompt, str):
        if raw or not tokenizer.has_chat_template:
            return tokenizer.encode(prompt)
        prompt = [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(list(prompt))


def check_prompts_fit(artifact: Artifact, prompts: Sequence[str | Sequence[dict]], *, raw: bool = False,
                      max_context: int | None = None, batched: bool = False) -> None:
    """Refuse a prompt the context cannot hold before a session makes its engine or times its tree (the CLIs'
    ``generate``: timing the default tree takes seconds and writes a cache record).

    Args:
        artifact: the loaded artifact (its tokenizer and context).
        prompts: what :meth:`MedusaSession.generate` (or ``generate_batch``, with ``batched``) would be given.
        raw, max_context: as the session and its generation take them.
        batched: the prompts are a batch (each one a row of the context; the message names its index).

    Raises:
        ContextOverflowError: the first prompt that does not fit, as the generation would raise it.
        ChatTemplateError: a message list for an artifact without a chat template.
        MedusaError: a bad ``max_context``.
    """
    capacity = session_capacity(artifact, max_context)
    tokenizer = RuntimeTokenizer.from_artifact(artifact)
    for i, prompt in enumerate(prompts):
        size = len(encode_prompt(tokenizer, prompt, raw))
        if not batched:
            check_prompt_fits(size, capacity)
            continue
        try:
            check_row_fits(size, capacity)
        except MedusaError as exc:
            raise type(exc)(f"prompt {i}: {exc}") from None  # as generate_batch names it


@dataclass
class _Chat:
    messages: list[dict] = field(default_factory=list)
    cache: KVCache | None = None


class MedusaSession:
    """An artifact loaded for generation.

    Args:
        artifact_dir: the artifact directory (``medusa-export build`` output), or that artifact already loaded
            (:func:`~medusa_runtime.contract.artifact.load_artifact`; e.g. after :func:`check_prompts_fit`).
        backend: engine backend name (see :mod:`medusa_runtime.engines`).
        threads: intra-op threads for CPU work (None: ONNX Runtime's default).
        max_context: KV capacity in tokens, at most the artifact's (default: the artifact's).
        tree: the tree to run. Default (None): ``$MEDUSA_EXPORT_TREE``, else the tree that is fastest
            on this engine and machine, timed once and cached (:mod:`medusa_runtime.tuning.treecache`; per-step
            trees when the artifact was built with ``--tree dynamic:T``; :attr:`default_tree` says how
            it was obtained); engines built for the artifact's tree (TensorRT plans) run that tree. Else a
            :class:`Tree` or a ``--tree`` spec: "artifact" (the tree it was built with, per-step when built
            with ``--tree dynamic:T``), "8", "root", "chain", "dynamic:6" (a 6-node tree chosen every step
            from the heads' calibrated probabilities); on TensorRT plans a tree of another size runs on the
            prefill profile. ``"auto"`` times the tree step
            at several sizes now, uncached, and keeps the one with the most expected tokens per second
            (:mod:`medusa_runtime.tuning.autotree`); ``"auto:dynamic"`` does so for per-step trees. The timed
            table is in :attr:`tree_timings`.
        full_verify: hash every file, even the large weights, when opening.
        progress: called with a line per measurement of ``tree="auto"`` (default: silent).
        notice: called with one line when the default tree is timed (the first time on this
            machine, or when the cached timing is stale) or when the engine is built for the artifact's tree
            (default: printed to standard error; None: silent).
        **engine_options: passed to the backend (e.g. ``device_id``).

    Raises:
        ArtifactError: the artifact is missing files, edited, or of an unsupported version.
        BackendUnavailableError: the backend cannot run here.
        MedusaError: bad ``max_context`` or ``tree``.
    """

    def __init__(self, artifact_dir: str | Path | Artifact, backend: str = DEFAULT_BACKEND, threads: int | None = None,
                 max_context: int | None = None, tree: Tree | str | None = None, full_verify: bool = False,
                 progress: Callable[[str], None] | None = None,
                 notice: Callable[[str], None] | None = _stderr_line, **engine_options):
        self.artifact: Artifact = artifact_dir if isinstance(artifact_dir, Artifact) else \
            load_artifact(artifact_dir, full_verify=full_verify)
        self.max_context = session_capacity(self.artifact, max_context)
        self.tokenizer = RuntimeTokenizer.from_artifact(self.artifact)
        self.backend = backend
        self.engine = create_engine(self.artifact, backend, threads=threads, **engine_options)
        ctx = TreeContext.of_artifact(self.artifact, self.engine, backend=backend, threads=threads,
                                      capacity=self.max_context, progress=progress, notice=notice)
        #: The resolved tree: where it came from, the timed table (``auto``), how the default was obtained.
        self.tree_resolution: ResolvedTree = resolve_tree(tree, ctx)
        self.tree = self.tree_resolution.tree
        #: How the default tree was obtained (timed now or cached); None when a tree was given.
        self.default_tree: DefaultTree | None = self.tree_resolution.default
        #: Where the tree comes from, for summaries ("fastest here, cached", "given", ...).
        self.tree_source = self.tree_resolution.source
        self.tree_timings: list[TreeTiming] = list(self.tree_resolution.timings)
        self.vanilla_tree = make_tree([], num_heads=self.engine.num_heads, topk=self.tree.topk)
        self._chat = _Chat()
        self._batch_engine = None
        self._closed = False

    @property
    def eos_token_ids(self) -> list[int]:
        return self.tokenizer.eos_token_ids

    def encode(self, prompt: str | Sequence[dict], raw: bool = False) -> list[int]:
        """Prompt ids: a user message (or a message list) through the chat template, or ``raw`` text
        (:func:`encode_prompt`)."""
        return encode_prompt(self.tokenizer, prompt, raw)

    def sampling(self, sampling: SamplingConfig | None = None, **overrides) -> SamplingConfig:
        """The settings a generation would use, checked against this artifact.

        Args:
            sampling: a base (default: :class:`SamplingConfig`'s defaults).
            **overrides: :class:`SamplingConfig` fields by name (e.g. ``seed=``); None keeps the base's.

        Raises:
            InvalidSettingError: a value out of its range.
            UnsupportedSamplingError: settings this artifact cannot sample exactly (the message
                names the exact ones: top-k up to its step_topk, or its in-graph sampler).
            TypeError: ``sampling`` is not a :class:`SamplingConfig`, or an override that is not one
                of its fields (the message names them).
        """
        if sampling is not None and not isinstance(sampling, SamplingConfig):
            raise TypeError(f"sampling must be a SamplingConfig (or None: greedy), got {type(sampling).__name__}")
        cfg = sampling_config(sampling, **overrides)
        engine_sampling_route(self.engine, cfg)
        return cfg

    def generate(
        self,
        prompt: str | Sequence[dict] | None = None,
        *,
        prompt_ids: Sequence[int] | None = None,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        sampling: SamplingConfig | None = None,
        stop: Sequence[str] = (),
        vanilla: bool = False,
        raw: bool = False,
        stream: Callable[[str], None] | None = None,
        cache: KVCache | None = None,
        **settings,
    ) -> Completion:
        """Generate one reply.

        Args:
            prompt: a user message (chat template applied unless ``raw``) or a list of
                ``{"role", "content"}`` messages; or None with ``prompt_ids``.
            prompt_ids: token ids to use as is (after ``cache``'s valid prefix, if given).
            max_new_tokens: reply budget, exact ("length" when reached), >= 0.
            sampling: the sampling settings (default: :class:`SamplingConfig`'s: greedy): temperature
                (0: output identical to greedy decoding), acceptance rule ("sample" is exact: the same
                tokens as ``vanilla`` with the same seed; "typical", Medusa paper §2.3.1, is lossy),
                top-k/top-p truncation as plain sampling applies it, each rule's parameters, seed.
            stop: stop strings; the text is cut where the first one starts ("stop").
            vanilla: one token per step (root-only tree) through the same engine.
            raw: encode a string prompt without the chat template.
            stream: called with each newly printable piece of text.
            cache: continue from this cache (its valid prefix precedes ``prompt_ids``).
            **settings: :class:`SamplingConfig` fields by name (``temperature=0.7, seed=3``), each
                overriding ``sampling``'s; None keeps it (docs/sampling.md's shorthand).

        Raises:
            ContextOverflowError: the prompt does not fit the context.
            ChatTemplateError: the messages cannot be rendered.
            InvalidSettingError: a sampling value or max_new_tokens out of range.
            UnsupportedSamplingError: settings this artifact cannot sample exactly.
            ValueError: neither or both of ``prompt`` and ``prompt_ids``.
            TypeError: a keyword that is none of these arguments nor a :class:`SamplingConfig` field.
        """
        if (prompt is None) == (prompt_ids is None):
            raise ValueError("give exactly one of prompt and prompt_ids")
        cfg = self.sampling(sampling, **settings)
        ids = list(prompt_ids) if prompt_ids is not None else self.encode(prompt, raw=raw)
        text = ReplyText(self.tokenizer, stop, _text_stream(stream))
        reused = cache.length if cache is not None else 0
        t = time.perf_counter()
        res = generate(self.engine, ids, self.vanilla_tree if vanilla else self.tree,
                       max_new_tokens=max_new_tokens, eos_token_ids=self.eos_token_ids,
                       max_context=self.max_context, sampling=cfg, on_tokens=text.on_tokens, cache=cache)
        seconds = time.perf_counter() - t
        return text.completion(res, reused + len(ids), reused, seconds)

    def generate_batch(
        self,
        prompts: Sequence[str | Sequence[dict]] | None = None,
        *,
        prompt_ids: Sequence[Sequence[int]] | None = None,
        max_new_tokens: int | Sequence[int] = DEFAULT_MAX_NEW_TOKENS,
        sampling: SamplingConfig | Sequence[SamplingConfig] | None = None,
        stop: Sequence[str] = (),
        vanilla: bool = False,
        raw: bool = False,
        batch_size: int = DEFAULT_BATCH_SIZE,
        stream: Callable[[int, str], None] | None = None,
        on_done: Callable[[int, Completion], None] | None = None,
        **settings,
    ) -> list[Completion]:
        """Generate replies to many prompts, up to ``batch_size`` sequences sharing each step.

        Sequences join as rows free up and leave when they finish (in-flight batching,
        :class:`~medusa_runtime.decode.batch.Scheduler`). Each sequence decodes exactly as
        :meth:`generate` would decode it alone (its own seed, stops and KV row): the same
        tokens for the same prompt and settings.

        Args:
            prompts: user messages (chat template applied unless ``raw``) or message lists; or
                None with ``prompt_ids``.
            prompt_ids: token id lists, used as they are.
            max_new_tokens: one budget for all, or one per prompt.
            sampling: one :class:`SamplingConfig` for all, or one per prompt (e.g. per-prompt
                seeds); default: its defaults (greedy).
            stop: stop strings (every prompt).
            vanilla: one token per step (root-only tree) through the same engine.
            raw: encode string prompts without the chat template.
            batch_size: at most this many sequences run at once (>= 1).
            stream: called with (prompt index, newly printable text).
            on_done: called with (prompt index, its :class:`Completion`) as each one finishes.
            **settings: :class:`SamplingConfig` fields by name, overriding each prompt's ``sampling``
                (as :meth:`generate`).

        Returns:
            One :class:`Completion` per prompt, in the prompts' order (``seconds``: from the
            sequence's prefill to its end).

        Raises:
            InvalidSettingError, UnsupportedSamplingError, ContextOverflowError, ChatTemplateError:
                a bad prompt or setting (the message names the prompt's index), before any work.
            ValueError: neither or both of ``prompts`` and ``prompt_ids``, or a per-prompt list of
                the wrong length.
            TypeError: a keyword that is none of these arguments nor a :class:`SamplingConfig` field,
                or a per-prompt ``sampling`` that is not a :class:`SamplingConfig`.
            Exception: whatever a callback (``stream``, ``on_done``) raised.
        """
        if (prompts is None) == (prompt_ids is None):
            raise ValueError("give exactly one of prompts and prompt_ids")
        n = len(prompts if prompts is not None else prompt_ids)
        budgets = _per_prompt(max_new_tokens, n, "max_new_tokens", numbers.Integral)
        bases = _per_prompt(sampling, n, "sampling", SamplingConfig)
        sched = Scheduler(self.batch_engine, self.tree, max_batch=batch_size, capacity=self.max_context,
                          eos_token_ids=self.eos_token_ids)
        texts, states = [], []
        for i in range(n):
            try:
                cfg = self.sampling(bases[i], **settings)
                ids = list(prompt_ids[i]) if prompt_ids is not None else self.encode(prompts[i], raw=raw)
                text = ReplyText(self.tokenizer, stop, _text_stream(stream and (lambda piece, i=i: stream(i, piece))))
                states.append(sched.submit(SequenceRequest(ids, budgets[i], cfg, text.on_tokens,
                                                           self.vanilla_tree if vanilla else None, tag=i)))
            except MedusaError as exc:
                raise type(exc)(f"prompt {i}: {exc}") from None
            texts.append(text)
        out: list[Completion | None] = [None] * n
        while not sched.idle:
            for s in sched.step():
                if s.error is not None:
                    raise s.error
                i = s.request.tag
                out[i] = texts[i].completion(s.result, len(s.request.prompt_ids), 0, s.seconds)
                if on_done is not None:
                    on_done(i, out[i])
        return out

    @property
    def batch_engine(self):
        """The engine as a :class:`~medusa_runtime.decode.batch.BatchEngine` (one batch-1 call per row for
        artifacts whose step graphs take one sequence)."""
        if self._batch_engine is None:
            self._batch_engine = batch_engine(self.engine)
        return self._batch_engine

    # -- multi-turn chat ----------------------------------------------------------------

    @property
    def messages(self) -> list[dict]:
        """The conversation so far (user and assistant turns)."""
        return list(self._chat.messages)

    def reset(self, system: str | None = None) -> None:
        """Start a new conversation (optionally with a system message); the cache is freed."""
        self._free_chat_cache()
        self._chat = _Chat([{"role": "system", "content": system}] if system else [])

    def _free_chat_cache(self) -> None:
        if self._chat.cache is not None:
            self._chat.cache.free()
            self._chat.cache = None

    def close(self) -> None:
        """Free what the session holds: the chat's KV cache, then the engine's memory (a device backend's
        buffers and any cache still live). Generations free their own caches when they end. The session is
        unusable afterwards; closing twice does nothing. Also on leaving a ``with`` block."""
        if self._closed:
            return
        self._closed = True
        self._free_chat_cache()
        self.engine.close()

    def __enter__(self) -> "MedusaSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def chat(self, message: str, **kwargs) -> Completion:
        """Add a user message, generate the assistant's reply, add it to the conversation.

        Takes :meth:`generate`'s keyword arguments (except prompt/prompt_ids/raw/cache).
        The previous turns' K/V are reused for the longest shared token prefix.

        Raises:
            ContextOverflowError: the conversation no longer fits the context (call :meth:`reset`).
            ChatTemplateError: the artifact has no chat template (a base model).
        """
        if not self.tokenizer.has_chat_template:
            raise ChatTemplateError(NO_TEMPLATE_MESSAGE)
        chat = self._chat
        messages = chat.messages + [{"role": "user", "content": message}]
        ids = self.tokenizer.apply_chat_template(messages)
        if chat.cache is None:
            chat.cache = KVCache.for_engine(self.engine, self.max_context)
        cache = chat.cache
        common = 0
        for a, b in zip(cache.tokens, ids[:-1]):  # keep >= 1 token to prefill
            if a != b:
                break
            common += 1
        cache.truncate(common)
        try:
            out = self.generate(prompt_ids=ids[common:], cache=cache, **kwargs)
        except BaseException:
            cache.truncate(common)  # the cache stays consistent with its tokens
            raise
        chat.messages = messages + [{"role": "assistant", "content": out.text}]
        return out
