"""The PyTorch reference Medusa decode loop, batch size 1 (seeds/001, Algorithm).

prefill -> candidates from the heads -> one forward over the tree (tree mask,
position = past length + depth) -> acceptance -> KV compaction -> stops, repeated.
Acceptance, KV compaction, tree buffers and stops are the pure functions of
``medusa_runtime``, so this loop and the deployed runtime share one definition.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from medusa_runtime.acceptance import TypicalConfig, accept_greedy, accept_typical, sample_topk
from medusa_runtime.errors import ContextOverflowError
from medusa_runtime.kvcache import fits, write_accepted
from medusa_runtime.stops import apply_stops
from medusa_runtime.tree import Tree, gather_candidates, make_tree

from .model import MedusaModel


@dataclass
class GenerationResult:
    """Output of one generation.

    Attributes:
        tokens: emitted token ids (EOS excluded).
        finish_reason: "stop" (EOS), "length" (max_new_tokens, or the context is full).
        step_tokens: tokens produced by each tree step (accepted candidates + 1), before stops.
        prompt_tokens: prompt length.
    """

    tokens: list[int]
    finish_reason: str
    step_tokens: list[int] = field(default_factory=list)
    prompt_tokens: int = 0

    @property
    def steps(self) -> int:
        """Tree steps run after the prefill."""
        return len(self.step_tokens)

    @property
    def mean_accepted(self) -> float:
        """Mean tokens per tree step (acceptance length incl. the bonus token); 0 if no step."""
        return float(np.mean(self.step_tokens)) if self.step_tokens else 0.0


class TorchKVCache:
    """Per-layer K/V buffers [1, capacity, H_kv, D] owned by the loop and reused across steps."""

    def __init__(self, model: MedusaModel, capacity: int):
        cfg = model.config
        w = model.backbone.embed_tokens.weight
        shape = (1, capacity, cfg.num_key_value_heads, cfg.head_dim)
        self.keys = [w.new_zeros(shape) for _ in range(cfg.num_hidden_layers)]
        self.values = [w.new_zeros(shape) for _ in range(cfg.num_hidden_layers)]
        self.capacity = capacity
        self.length = 0

    def past(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Views of the valid prefix, per layer ([1, length, H_kv, D] each); no copy."""
        n = self.length
        return [(k[:, :n], v[:, :n]) for k, v in zip(self.keys, self.values)]

    def keep(self, new_kv, accepted: np.ndarray) -> None:
        """Write the accepted nodes' K/V (root first) into the next slots (KV compaction)."""
        for cache_k, cache_v, (k, v) in zip(self.keys, self.values, new_kv):
            write_accepted(cache_k, k, self.length, accepted)
            write_accepted(cache_v, v, self.length, accepted)
        self.length += len(accepted)


def causal_mask(n: int) -> torch.Tensor:
    """bool [n, n] lower-triangular: the prefill's mask over the new tokens."""
    return torch.ones(n, n, dtype=torch.bool).tril()


@torch.no_grad()
def medusa_generate(
    model: MedusaModel,
    prompt_ids: Sequence[int],
    tree: Tree,
    *,
    max_new_tokens: int,
    eos_token_ids: Sequence[int] = (),
    max_context: int = 2048,
    typical: TypicalConfig | None = None,
    seed: int = 0,
    on_tokens: Callable[[list[int]], None] | None = None,
) -> GenerationResult:
    """Generate with Medusa; greedy when ``typical`` is None (lossless vs plain greedy).

    Args:
        model: backbone + heads, eval mode.
        prompt_ids: the prompt's token ids (chat template already applied), length >= 1.
        tree: the token tree (its depth must not exceed the model's heads).
        max_new_tokens: maximum emitted tokens (exact).
        eos_token_ids: tokens that end generation (not emitted).
        max_context: KV capacity in tokens (prompt + generated). When the tree no longer
            fits, steps fall back to the root alone; when nothing fits, generation ends
            with finish_reason "length".
        typical: typical acceptance settings (temperature > 0), or None for greedy.
        seed: seeds the sampling of bonus tokens under typical acceptance.
        on_tokens: called with each step's emitted tokens (streaming).

    Returns:
        The :class:`GenerationResult`.

    Raises:
        ValueError: empty prompt, negative max_new_tokens, or a tree deeper than the heads.
        ContextOverflowError: the prompt alone exceeds ``max_context``.
    """
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("the prompt is empty: give at least one token")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if tree.max_depth > model.num_heads:
        raise ValueError(f"tree depth {tree.max_depth} exceeds the model's {model.num_heads} Medusa heads")
    if len(prompt) > max_context:
        raise ContextOverflowError(f"the prompt has {len(prompt)} tokens but the context holds {max_context}")
    rng = np.random.default_rng(seed)
    result = GenerationResult([], "length", prompt_tokens=len(prompt))
    if max_new_tokens == 0:
        return result
    root_tree = make_tree([], num_heads=model.num_heads, topk=tree.topk)
    cache = TorchKVCache(model, max_context)

    temperature = torch.tensor([typical.temperature if typical else 1.0], dtype=torch.float32)

    def run(tokens, positions, mask):
        out = model.step(torch.as_tensor(tokens)[None], torch.as_tensor(positions)[None], torch.as_tensor(mask),
                         cache.past(), temperature)
        return out, out.topk_ids[0].numpy(), out.topk_logprobs[0].numpy()

    def emit(step_tokens: list[int]) -> bool:
        stop = apply_stops(step_tokens, generated=len(result.tokens), max_new_tokens=max_new_tokens,
                           eos_token_ids=eos_token_ids)
        result.tokens.extend(stop.tokens)
        if on_tokens and stop.tokens:
            on_tokens(stop.tokens)
        if stop.finish_reason:
            result.finish_reason = stop.finish_reason
            return True
        return False

    # Prefill: the prompt with a causal mask; all of its K/V are kept.
    n = len(prompt)
    out, ids, lps = run(np.asarray(prompt, dtype=np.int64), np.arange(n), causal_mask(n))
    cache.keep(out.new_kv, np.arange(n))
    root = int(ids[-1, 0]) if typical is None else sample_topk(ids[-1], lps[-1], rng)
    heads_topk = model.heads_topk(out.hidden[0, -1], tree.topk).numpy()
    if emit([root]):
        return result
    while True:
        step_tree = tree if fits(cache.length, tree.size, max_context) else root_tree
        if not fits(cache.length, step_tree.size, max_context):
            result.finish_reason = "length"  # the context is full
            return result
        b = step_tree.buffers()
        tokens = gather_candidates(root, heads_topk, step_tree)
        out, ids, lps = run(tokens, cache.length + b.depth, b.attention_mask)
        if typical is None:
            acc = accept_greedy(step_tree, tokens, ids[:, 0])
        else:
            acc = accept_typical(step_tree, tokens, out.token_logprobs[0].numpy(), out.entropy[0].numpy(),
                                 ids, lps, typical, rng)
        cache.keep(out.new_kv, acc.accepted)
        step_tokens = [int(t) for t in tokens[acc.accepted[1:]]] + [acc.next_token]
        result.step_tokens.append(len(step_tokens))
        if emit(step_tokens):
            return result
        root = acc.next_token
        heads_topk = model.heads_topk(out.hidden[0, int(acc.accepted[-1])], tree.topk).numpy()
