"""The PyTorch reference Medusa decode loop, batch size 1 (seeds/001, Algorithm).

The loop itself is ``medusa_runtime.loop.generate`` (written once, shared with the
deployed runtime); here it drives a :class:`TorchEngine`, which runs
:meth:`MedusaModel.step` and the heads in PyTorch. Tree buffers, acceptance, KV
compaction and stops are the pure functions of ``medusa_runtime``.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from medusa_runtime.acceptance import TypicalConfig
from medusa_runtime.loop import GenerationResult, KVCache, StepResult, causal_mask, generate
from medusa_runtime.candidates import DynamicTree
from medusa_runtime.tree import Tree

from .medusa import STEP_TOPK, MedusaModel

__all__ = ["GenerationResult", "KVCache", "TorchEngine", "causal_mask", "medusa_generate"]

_NP_DTYPES = {torch.float32: np.float32, torch.float16: np.float16}


class TorchEngine:
    """:class:`medusa_runtime.loop.Engine` over the PyTorch reference model."""

    def __init__(self, model: MedusaModel, k: int = STEP_TOPK):
        c = model.config
        self.model = model
        self.k = k
        self.num_layers = c.num_hidden_layers
        self.num_kv_heads = c.num_key_value_heads
        self.head_dim = c.head_dim
        self.num_heads = model.num_heads
        self.head_type = model.head_type
        self.kv_dtype = np.dtype(_NP_DTYPES[model.backbone.embed_tokens.weight.dtype])

    @torch.no_grad()
    def step(self, input_ids, position_ids, mask, temperature, past) -> StepResult:
        out = self.model.step(
            torch.from_numpy(input_ids), torch.from_numpy(position_ids), torch.from_numpy(mask),
            [(torch.from_numpy(k), torch.from_numpy(v)) for k, v in past],
            torch.tensor([temperature], dtype=torch.float32), self.k,
        )
        return StepResult(out.topk_ids[0].numpy(), out.topk_logprobs[0].numpy(), out.entropy[0].numpy(),
                          out.token_logprobs[0].numpy(), out.hidden[0].numpy(),
                          [(k.numpy(), v.numpy()) for k, v in out.new_kv])

    @torch.no_grad()
    def heads(self, hidden: np.ndarray, topk: int) -> np.ndarray:
        return self.model.heads_topk(torch.from_numpy(hidden), topk).transpose(0, 1).numpy()

    @torch.no_grad()
    def heads_logprobs(self, hidden: np.ndarray, topk: int) -> tuple[np.ndarray, np.ndarray]:
        ids, lp = self.model.heads_topk_logprobs(torch.from_numpy(hidden), topk)
        return ids.transpose(0, 1).numpy(), lp.transpose(0, 1).numpy()

    @torch.no_grad()
    def heads_level(self, depth: int, hidden: np.ndarray, path_ids: np.ndarray, topk: int
                    ) -> tuple[np.ndarray, np.ndarray]:
        ids, lp = self.model.level_topk(depth, torch.from_numpy(hidden), torch.from_numpy(path_ids), topk)
        return ids.numpy(), lp.numpy()


def medusa_generate(
    model: MedusaModel,
    prompt_ids: Sequence[int],
    tree: Tree | DynamicTree,
    *,
    max_new_tokens: int,
    eos_token_ids: Sequence[int] = (),
    max_context: int = 2048,
    typical: TypicalConfig | None = None,
    seed: int = 0,
    on_tokens: Callable[[list[int]], bool | None] | None = None,
) -> GenerationResult:
    """Generate with the PyTorch reference; see :func:`medusa_runtime.loop.generate`.

    Greedy when ``typical`` is None: the output equals plain greedy decoding of the backbone.

    Raises:
        ValueError: empty prompt, negative max_new_tokens, or a tree deeper than the heads.
        ContextOverflowError: the prompt alone exceeds ``max_context``.
    """
    return generate(TorchEngine(model), prompt_ids, tree, max_new_tokens=max_new_tokens,
                    eos_token_ids=eos_token_ids, max_context=max_context, typical=typical, seed=seed,
                    on_tokens=on_tokens)
