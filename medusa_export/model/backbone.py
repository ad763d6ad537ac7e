"""A Llama-architecture backbone written for tree verification and export.

One readable file in the spirit of gpt-fast / nanoGPT ``model.py``. It differs from
transformers' ``LlamaForCausalLM`` only in its interface, which is the export contract:

* past K/V are explicit tensors ``[1, P, H_kv, D]`` (P = valid past length, may be 0),
  sequence-major so that the valid prefix of a runtime-owned ``[1, capacity, H_kv, D]``
  buffer is a contiguous view (no host copy per step);
* the step returns only the *new* K/V of its S tokens ``[1, S, H_kv, D]``; the caller
  owns the cache and decides which of them to keep (KV compaction);
* attention over the new tokens uses a bool mask ``[S, S]`` (True = may attend), so the
  same graph runs the causal prefill and a tree step; the past is always fully visible;
* position ids are an input, so RoPE is computed from them (never frozen to a traced
  length) and a tree node's position is past length + depth (seeds/001 §2.1.2).

Attention scores for the past and for the new tokens are computed separately and
softmaxed together, so the past K/V are read, never concatenated (no per-step copy of
the cache). RMSNorm variance and softmax run in float32 whatever the weight dtype.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class LlamaConfig:
    """Backbone hyper-parameters (names follow transformers' LlamaConfig)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin for rotary embeddings: [1, 1, S, D] each, computed from position ids [1, S]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = position_ids[0].float()[:, None] * inv_freq[None, :]  # [S, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [S, D]
    return emb.cos().to(dtype)[None, None], emb.sin().to(dtype)[None, None]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        d = cfg.hidden_size
        self.q_proj = nn.Linear(d, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, d, bias=False)

    def forward(self, x, cos, sin, bias, past_k, past_v):
        # x: [1, S, d]; bias: [S, S] float32 additive (0 or -inf-safe); past_*: [1, P, Hkv, D]
        s = x.shape[1]
        g = self.n_heads // self.n_kv
        q = self.q_proj(x).view(1, s, self.n_heads, self.head_dim).transpose(1, 2)  # [1, H, S, D]
        k_new = self.k_proj(x).view(1, s, self.n_kv, self.head_dim)  # [1, S, Hkv, D]
        v_new = self.v_proj(x).view(1, s, self.n_kv, self.head_dim)
        q = apply_rope(q, cos, sin)
        k_new = apply_rope(k_new, cos.transpose(1, 2), sin.transpose(1, 2))
        # Group queries by KV head: [1, Hkv, G*S, D]; no repeat of K/V.
        qg = q.reshape(1, self.n_kv, g * s, self.head_dim) * (self.head_dim**-0.5)
        s_past = torch.matmul(qg, past_k.permute(0, 2, 3, 1)).float()  # [1, Hkv, G*S, P]
        s_new = torch.matmul(qg, k_new.permute(0, 2, 3, 1)).float()  # [1, Hkv, G*S, S]
        s_new = (s_new.view(1, self.n_kv, g, s, s) + bias).view(1, self.n_kv, g * s, s)
        probs = torch.softmax(torch.cat([s_past, s_new], dim=-1), dim=-1).to(x.dtype)
        p_len = past_k.shape[1]
        out = torch.matmul(probs[..., :p_len], past_v.transpose(1, 2)) + torch.matmul(
            probs[..., p_len:], v_new.transpose(1, 2)
        )  # [1, Hkv, G*S, D]
        out = out.view(1, self.n_heads, s, self.head_dim).transpose(1, 2).reshape(1, s, -1)
        return self.o_proj(out), k_new, v_new


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, bias, past_k, past_v):
        a, k, v = self.self_attn(self.input_layernorm(x), cos, sin, bias, past_k, past_v)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), k, v


def mask_to_bias(mask: torch.Tensor) -> torch.Tensor:
    """bool [S, S] (True = may attend) -> float32 additive bias (0 / finfo(float32).min).

    The bias is applied to float32 scores, so it cannot overflow in an fp16 graph; every
    row attends at least to itself, so no row is fully masked.
    """
    return torch.where(mask, 0.0, torch.finfo(torch.float32).min).to(torch.float32)


class LlamaBackbone(nn.Module):
    """Llama decoder with explicit past K/V and a new-token attention mask.

    Parameter names match transformers' ``LlamaForCausalLM`` state dict (``model.`` prefix
    dropped for the decoder), so weights load key-for-key.
    """

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        mask: torch.Tensor,
        past: list[tuple[torch.Tensor, torch.Tensor]],
    ):
        """Run S new tokens after a past of P tokens.

        Args:
            input_ids: int64 [1, S].
            position_ids: int64 [1, S]; for a tree node, past length + depth.
            mask: bool [S, S]; ``mask[i, j]`` True when new token i may attend new token j.
            past: per layer (key, value), each [1, P, H_kv, D] in the weight dtype.

        Returns:
            (hidden [1, S, d] after the final norm, new_kv: per layer (key, value) [1, S, H_kv, D]).
        """
        x = self.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta, x.dtype)
        bias = mask_to_bias(mask)
        new_kv = []
        for layer, (pk, pv) in zip(self.layers, past):
            x, k, v = layer(x, cos, sin, bias, pk, pv)
            new_kv.append((k, v))
        return self.norm(x), new_kv

    def empty_past(self, length: int = 0):
        """Zero past K/V of ``length`` slots: per layer ([1, length, H_kv, D], same)."""
        c = self.config
        p = self.embed_tokens.weight
        shape = (1, length, c.num_key_value_heads, c.head_dim)
        return [(p.new_zeros(shape), p.new_zeros(shape)) for _ in range(c.num_hidden_layers)]
