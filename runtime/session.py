"""High-level generation over an artifact: text in, text out, torch-free.

``MedusaSession(artifact_dir)`` opens the artifact (manifest, checksums, tree), creates an
engine on the chosen backend and the tokenizer, and offers:

* :meth:`MedusaSession.generate`: one prompt (text, chat messages or token ids) -> a
  :class:`Completion` (text, ids, finish reason, timing), greedy (lossless) or typical
  acceptance, stop strings, ``vanilla=True`` for one token per step through the same
  engine (the root-only tree), and a streaming callback that receives text deltas;
* :meth:`MedusaSession.chat`: multi-turn chat with the chat template. The KV cache is
  kept between turns and reused for the longest prefix of token ids that the new
  conversation shares with what the cache holds (K/V at a slot depend only on the tokens
  up to it, so this is exact); only the rest is prefilled.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from .acceptance import TypicalConfig
from .artifact import Artifact, load_artifact
from .autotree import TreeTiming, auto_policy, auto_tree, is_auto
from .candidates import DynamicTree
from .engines import DEFAULT_BACKEND, create_engine
from .errors import MedusaError
from .loop import GenerationResult, KVCache, generate
from .tokenizer import RuntimeTokenizer
from .tree import Tree, make_tree, tree_from_spec

_TYPICAL = TypicalConfig()


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
        """Mean tokens per tree step (accepted candidates + 1); 1.0 in vanilla mode."""
        return self.result.mean_accepted

    def stats(self) -> dict:
        """Numbers for logs and benchmarks (JSON-able)."""
        r = self.result
        return {"new_tokens": len(self.token_ids), "prompt_tokens": self.prompt_tokens,
                "reused_tokens": self.reused_tokens, "finish_reason": self.finish_reason, "steps": r.steps,
                "tokens_per_step": r.mean_accepted, "tokens_per_second": self.tokens_per_second,
                "seconds": self.seconds, "prefill_seconds": r.prefill_seconds, "engine_seconds": r.engine_seconds,
                "host_seconds": r.host_seconds}


@dataclass
class _Chat:
    messages: list[dict] = field(default_factory=list)
    cache: KVCache | None = None


class MedusaSession:
    """An artifact loaded for generation.

    Args:
        artifact_dir: the artifact directory (``medusa-export build`` output).
        backend: engine backend name (see :mod:`medusa_runtime.engines`).
        threads: intra-op threads for CPU work (None: ONNX Runtime's default).
        max_context: KV capacity in tokens, at most the artifact's (default: the artifact's).
        tree: override the artifact's tree (a :class:`Tree` or a ``--tree`` spec such as "8",
            "chain", "dynamic:6": a 6-node tree chosen every step from the heads' calibrated
            probabilities); backends with a fixed tree shape (TensorRT) may reject it.
            ``"auto"`` times the tree step at several sizes on this engine and keeps the one
            with the most expected tokens per second (:mod:`medusa_runtime.autotree`; the
            table is in :attr:`tree_timings`); ``"auto:dynamic"`` does so for per-step trees.
        full_verify: hash every file, even the large weights, when opening.
        progress: called with a line per measurement of ``tree="auto"`` (default: silent).
        **engine_options: passed to the backend (e.g. ``device_id``).

    Raises:
        ArtifactError: the artifact is missing files, edited, or of an unsupported version.
        BackendUnavailableError: the backend cannot run here.
        MedusaError: bad ``max_context`` or ``tree``.
    """

    def __init__(self, artifact_dir: str | Path, backend: str = DEFAULT_BACKEND, threads: int | None = None,
                 max_context: int | None = None, tree: Tree | str | None = None, full_verify: bool = False,
                 progress: Callable[[str], None] | None = None, **engine_options):
        self.artifact: Artifact = load_artifact(artifact_dir, full_verify=full_verify)
        limit = int(self.artifact.model["max_context"])
        if max_context is not None and not 1 <= max_context <= limit:
            raise MedusaError(f"max_context must be in 1..{limit} (the artifact's), got {max_context}")
        self.max_context = max_context or limit
        self.tokenizer = RuntimeTokenizer.from_artifact(self.artifact)
        self.backend = backend
        self.engine = create_engine(self.artifact, backend, threads=threads, **engine_options)
        self._progress = progress
        self.tree_timings: list[TreeTiming] = []
        self.tree = self._resolve_tree(tree)
        self.vanilla_tree = make_tree([], num_heads=self.engine.num_heads, topk=self.tree.topk)
        self._chat = _Chat()

    def _resolve_tree(self, tree: Tree | DynamicTree | str | None) -> Tree | DynamicTree:
        base = self.artifact.tree
        if tree is None:
            return base
        acc = self.artifact.head_accuracies
        art = self.artifact
        if is_auto(tree):
            tree, self.tree_timings = auto_tree(self.engine, acc, capacity=self.max_context, topk=base.topk,
                                                progress=self._progress, policy=auto_policy(tree),
                                                calibration=art.calibration, simulated=art.simulated)
            return tree
        if not isinstance(tree, (Tree, DynamicTree)):
            tree = tree_from_spec(tree, num_heads=self.engine.num_heads, topk=base.topk, accuracies=acc,
                                  calibration=art.calibration)
        if tree.topk > base.topk or tree.max_depth > self.engine.num_heads:
            raise MedusaError(f"tree (topk {tree.topk}, depth {tree.max_depth}) exceeds the artifact's heads graph "
                              f"(topk {base.topk}, {self.engine.num_heads} heads)")
        return tree

    @property
    def eos_token_ids(self) -> list[int]:
        return self.tokenizer.eos_token_ids

    def encode(self, prompt: str | Sequence[dict], raw: bool = False) -> list[int]:
        """Prompt ids: a user message (or a message list) through the chat template, or ``raw`` text."""
        if isinstance(prompt, str):
            if raw:
                return self.tokenizer.encode(prompt)
            prompt = [{"role": "user", "content": prompt}]
        return self.tokenizer.apply_chat_template(list(prompt))

    def generate(
        self,
        prompt: str | Sequence[dict] | None = None,
        *,
        prompt_ids: Sequence[int] | None = None,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        posterior_threshold: float = _TYPICAL.posterior_threshold,
        posterior_alpha: float = _TYPICAL.posterior_alpha,
        seed: int = 0,
        stop: Sequence[str] = (),
        vanilla: bool = False,
        raw: bool = False,
        stream: Callable[[str], None] | None = None,
        cache: KVCache | None = None,
    ) -> Completion:
        """Generate one reply.

        Args:
            prompt: a user message (chat template applied unless ``raw``) or a list of
                ``{"role", "content"}`` messages; or None with ``prompt_ids``.
            prompt_ids: token ids to use as is (after ``cache``'s valid prefix, if given).
            max_new_tokens: reply budget, exact ("length" when reached).
            temperature: 0 for greedy acceptance (output identical to greedy decoding);
                > 0 for typical acceptance at this temperature (seeds/001 §2.3.1).
            posterior_threshold, posterior_alpha: typical acceptance epsilon and delta.
            seed: seeds the sampling under typical acceptance (reproducible).
            stop: stop strings; the text is cut where the first one starts ("stop").
            vanilla: one token per step (root-only tree) through the same engine.
            raw: encode a string prompt without the chat template.
            stream: called with each newly printable piece of text.
            cache: continue from this cache (its valid prefix precedes ``prompt_ids``).

        Raises:
            ContextOverflowError: the prompt does not fit the context.
            ChatTemplateError: the messages cannot be rendered.
            ValueError: neither or both of ``prompt`` and ``prompt_ids``; bad sampling values.
        """
        if (prompt is None) == (prompt_ids is None):
            raise ValueError("give exactly one of prompt and prompt_ids")
        ids = list(prompt_ids) if prompt_ids is not None else self.encode(prompt, raw=raw)
        typical = TypicalConfig(temperature, posterior_threshold, posterior_alpha) if temperature > 0 else None
        decoder = self.tokenizer.stream(stop)

        def on_tokens(tokens: list[int]) -> bool:
            for t in tokens:
                if decoder.add(t):
                    break
            if stream is not None:
                piece = decoder.take()
                if piece:
                    stream(piece)
            return decoder.stopped

        reused = cache.length if cache is not None else 0
        t = time.perf_counter()
        res = generate(self.engine, ids, self.vanilla_tree if vanilla else self.tree,
                       max_new_tokens=max_new_tokens, eos_token_ids=self.eos_token_ids,
                       max_context=self.max_context, typical=typical, seed=seed,
                       on_tokens=on_tokens if (stop or stream) else None, cache=cache)
        seconds = time.perf_counter() - t
        if stream is not None:
            piece = decoder.finish()
            if piece:
                stream(piece)
        if stop or stream:
            text, tokens = decoder.text, list(decoder.tokens)
        else:
            text, tokens = self.tokenizer.decode(res.tokens), list(res.tokens)
        return Completion(text, tokens, res.finish_reason, res, reused + len(ids), reused, seconds)

    # -- multi-turn chat ----------------------------------------------------------------

    @property
    def messages(self) -> list[dict]:
        """The conversation so far (user and assistant turns)."""
        return list(self._chat.messages)

    def reset(self, system: str | None = None) -> None:
        """Start a new conversation (optionally with a system message); the cache is dropped."""
        self._chat = _Chat([{"role": "system", "content": system}] if system else [])

    def chat(self, message: str, **kwargs) -> Completion:
        """Add a user message, generate the assistant's reply, add it to the conversation.

        Takes :meth:`generate`'s keyword arguments (except prompt/prompt_ids/raw/cache).
        The previous turns' K/V are reused for the longest shared token prefix.

        Raises:
            ContextOverflowError: the conversation no longer fits the context (call :meth:`reset`).
        """
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
