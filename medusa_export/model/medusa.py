"""The PyTorch reference Medusa model: a backbone (any supported family) plus K Medusa (or path-conditioned) heads.

:meth:`MedusaModel.step` is the exported backbone graph: besides the new K/V and the
hidden states (for the heads) it returns only what acceptance needs, not [S, V] logits:

* ``topk_ids`` int64 [1, S, k] and ``topk_logprobs`` float32 [1, S, k]: the k best next
  tokens at each position and their log-probabilities at ``temperature`` (index 0 is the
  argmax, all greedy acceptance needs; typical acceptance samples the bonus token from
  these k);
* ``entropy`` float32 [1, S]: entropy (nats) of the next-token distribution at ``temperature``;
* ``token_logprobs`` float32 [1, S, S]: ``[0, i, j]`` = log P_T(input_ids[j] | position i),
  so the host reads each tree node's probability under its parent at [parent[j], j].
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from .backbone import Backbone
from .config import BackboneConfig
from .heads import HeadsConfig, MedusaHeads


#: k of the step's top-k outputs (and the candidate top-k of the heads by default).
STEP_TOPK = 10


class StepOutput(NamedTuple):
    """What one backbone step returns; shapes in the module docstring."""

    topk_ids: torch.Tensor
    topk_logprobs: torch.Tensor
    entropy: torch.Tensor
    token_logprobs: torch.Tensor
    hidden: torch.Tensor
    new_kv: list


def acceptance_outputs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: torch.Tensor, k: int):
    """Reduce logits [1, S, V] to the acceptance outputs (see module docstring).

    Args:
        logits: [1, S, V], any float dtype (computed in float32).
        input_ids: int64 [1, S], the step's tokens.
        temperature: float32 [1], > 0 (1.0 for greedy: the ids do not depend on it).
        k: top-k width (capped at V).

    Returns:
        (topk_ids [1,S,k] int64, topk_logprobs [1,S,k] f32, entropy [1,S] f32, token_logprobs [1,S,S] f32)
    """
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # [1, S, V]
    top = torch.topk(logp, min(k, logits.shape[-1]), dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    token_logprobs = torch.index_select(logp, 2, input_ids[0])  # [1, S, S]
    return top.indices, top.values, entropy, token_logprobs


class MedusaModel(nn.Module):
    """Backbone + heads. The backbone's lm_head gives head 0 (the next token)."""

    def __init__(self, backbone: Backbone, heads: nn.Module):
        super().__init__()
        if heads.config.hidden_size != backbone.config.hidden_size:
            raise ValueError("heads and backbone hidden sizes differ")
        self.backbone = backbone
        self.heads = heads

    @property
    def config(self) -> BackboneConfig:
        return self.backbone.config

    @property
    def num_heads(self) -> int:
        return self.heads.config.num_heads

    @classmethod
    def with_initial_heads(
        cls, backbone: Backbone, num_heads: int = 4, num_layers: int = 1, own_projection: bool = False
    ) -> "MedusaModel":
        """Heads initialised as in Medusa paper §2.1.1 (they reproduce the base next-token prediction)."""
        c = backbone.config
        cfg = HeadsConfig(num_heads, num_layers, c.hidden_size, c.vocab_size, own_projection)
        return cls(backbone, MedusaHeads(cfg, backbone.lm_head))

    def forward(self, input_ids, position_ids, mask, past):
        """Backbone forward with full logits (for tests and checks): see :meth:`Backbone.forward`.

        Returns:
            (logits [1, S, V] of the backbone, hidden [1, S, d], new_kv per layer [1, S, H_kv, D]).
        """
        hidden, new_kv = self.backbone(input_ids, position_ids, mask, past)
        return self.backbone.lm_head(hidden), hidden, new_kv

    def step(self, input_ids, position_ids, mask, past, temperature=None, k: int = STEP_TOPK) -> StepOutput:
        """The exported backbone step: forward + :func:`acceptance_outputs`.

        Args:
            input_ids, position_ids, mask, past: as :meth:`Backbone.forward`.
            temperature: float32 [1] (default 1.0).
            k: top-k width of the outputs.
        """
        if temperature is None:
            temperature = torch.ones(1)
        logits, hidden, new_kv = self(input_ids, position_ids, mask, past)
        return StepOutput(*acceptance_outputs(logits, input_ids, temperature, k), hidden, new_kv)

    @property
    def head_type(self) -> str:
        """"medusa" or "hydra" (path-conditioned heads, :mod:`medusa_export.model.hydra_heads`)."""
        return self.heads.config.head_type

    @torch.no_grad()
    def heads_topk(self, hidden: torch.Tensor, topk: int) -> torch.Tensor:
        """hidden [d] (one position) -> int64 [K, topk] each Medusa head's best tokens, best first."""
        return self.heads_topk_logprobs(hidden, topk)[0]

    @torch.no_grad()
    def heads_topk_logprobs(self, hidden: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [..., d] -> (ids int64 [K, ..., topk], log-probabilities float32 [K, ..., topk]) of the Medusa heads."""
        top = torch.topk(torch.log_softmax(self.heads(hidden).float(), dim=-1), topk, dim=-1)
        return top.indices, top.values

    @torch.no_grad()
    def level_topk(self, depth: int, hidden: torch.Tensor, path_ids: torch.Tensor, topk: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Path-conditioned head ``depth`` (1-based) on R paths: hidden [1, d], path_ids int64 [R, depth]
        (root first) -> (ids int64 [R, topk], log-probabilities float32 [R, topk])."""
        logits = self.heads.level_logits(depth - 1, hidden, path_ids)
        top = torch.topk(torch.log_softmax(logits.float(), dim=-1), topk, dim=-1)
        return top.indices, top.values
