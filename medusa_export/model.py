"""The PyTorch reference Medusa model: a Llama backbone plus K Medusa heads."""

from __future__ import annotations

import torch
from torch import nn

from .heads import HeadsConfig, MedusaHeads
from .llama import LlamaBackbone, LlamaConfig


class MedusaModel(nn.Module):
    """Backbone + heads. The backbone's lm_head gives head 0 (the next token)."""

    def __init__(self, backbone: LlamaBackbone, heads: MedusaHeads):
        super().__init__()
        if heads.config.hidden_size != backbone.config.hidden_size:
            raise ValueError("heads and backbone hidden sizes differ")
        self.backbone = backbone
        self.heads = heads

    @property
    def config(self) -> LlamaConfig:
        return self.backbone.config

    @property
    def num_heads(self) -> int:
        return self.heads.config.num_heads

    @classmethod
    def with_initial_heads(
        cls, backbone: LlamaBackbone, num_heads: int = 4, num_layers: int = 1, own_projection: bool = False
    ) -> "MedusaModel":
        """Heads initialised as in seeds/001 §2.1.1 (they reproduce the base next-token prediction)."""
        c = backbone.config
        cfg = HeadsConfig(num_heads, num_layers, c.hidden_size, c.vocab_size, own_projection)
        return cls(backbone, MedusaHeads(cfg, backbone.lm_head))

    def forward(self, input_ids, position_ids, mask, past):
        """One step: see :meth:`LlamaBackbone.forward`.

        Returns:
            (logits float [1, S, V] of the backbone, hidden [1, S, d], new_kv per layer).
        """
        hidden, new_kv = self.backbone(input_ids, position_ids, mask, past)
        return self.backbone.lm_head(hidden), hidden, new_kv

    @torch.no_grad()
    def heads_topk(self, hidden: torch.Tensor, topk: int) -> torch.Tensor:
        """hidden [d] (one position) -> int64 [K, topk] each head's best tokens, best first."""
        return torch.topk(self.heads(hidden), topk, dim=-1).indices
