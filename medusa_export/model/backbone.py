"""The decoder backbone (Llama, Mistral, Qwen2, Qwen3) written for tree verification and export.

One readable file in the spirit of gpt-fast / nanoGPT ``model.py``, one code path for every
family: the features that tell them apart are switches of
:class:`~medusa_export.model.config.BackboneConfig` (RoPE scaling, q/k/v/o/MLP biases, per-head
q/k RMSNorm, explicit head width, per-layer sliding window, tied embeddings). It computes what
transformers' ``{Llama,Mistral,Qwen2,Qwen3}ForCausalLM`` compute (transformers 4.57
``models/*/modeling_*.py``) and differs only in its interface, which is the export contract:

* past K/V are explicit tensors ``[1, P, H_kv, D]`` (P = valid past length, may be 0),
  sequence-major so that the valid prefix of a runtime-owned ``[1, capacity, H_kv, D]``
  buffer is a contiguous view (no host copy per step); past slot p holds the token at
  position p (the runtime compacts accepted nodes into consecutive slots);
* the step returns only the *new* K/V of its S tokens ``[1, S, H_kv, D]``; the caller
  owns the cache and decides which of them to keep (KV compaction);
* attention over the new tokens uses a bool mask ``[S, S]`` (True = may attend), so the
  same graph runs the causal prefill and a tree step; the past is fully visible except
  where a layer's sliding window hides it;
* position ids are an input, so RoPE is computed from them (never frozen to a traced
  length) and a tree node's position is past length + depth (Medusa paper §2.1.2).

Sliding window (Mistral; Qwen2/Qwen3 layers that ``layer_types`` marks): a query at position
q sees a key at position p iff q - W < p <= q (transformers ``masking_utils``:
``sliding_window_overlay`` on the causal mask). It is applied by *positions*: past slot p
is at position p and a new token at its ``position_ids`` entry, so a tree node (position
P + depth) sees exactly the keys its linear-decoding twin would, and the reference stays
exact beyond the window.

Attention scores for the past and for the new tokens are computed separately and
softmaxed together, so the past K/V are read, never concatenated (no per-step copy of
the cache). RMSNorm variance and softmax run in float32 whatever the weight dtype.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .config import BackboneConfig, rope_cos_sin

#: Additive bias of a masked score (applied to float32 scores, so it cannot overflow in fp16).
MASKED = torch.finfo(torch.float32).min


class RMSNorm(nn.Module):
    """x / rms(x) * weight, the variance in float32 (transformers ``LlamaRMSNorm`` / ``Qwen3RMSNorm``)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, GPT-NeoX "rotate half" convention (transformers ``apply_rotary_pos_emb``)."""
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    """Grouped-query attention with the family switches: q/k/v and o biases, per-head q/k RMSNorm."""

    def __init__(self, cfg: BackboneConfig):
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        d = cfg.hidden_size
        self.q_proj = nn.Linear(d, self.n_heads * self.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(d, self.n_kv * self.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(d, self.n_kv * self.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, d, bias=cfg.o_bias)
        if cfg.qk_norm:  # Qwen3: RMSNorm over D on every head, before RoPE (modeling_qwen3 Qwen3Attention)
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, cos, sin, bias_past, bias_new, past_k, past_v):
        # x: [1, S, d]; bias_past: [S, P] or None (whole past visible) and bias_new: [S, S], float32
        # additive (0 or MASKED); past_*: [1, P, Hkv, D]
        s = x.shape[1]
        g = self.n_heads // self.n_kv
        q = self.q_proj(x).view(1, s, self.n_heads, self.head_dim)  # [1, S, H, D]
        k_new = self.k_proj(x).view(1, s, self.n_kv, self.head_dim)  # [1, S, Hkv, D]
        v_new = self.v_proj(x).view(1, s, self.n_kv, self.head_dim)
        if self.q_norm is not None:
            q, k_new = self.q_norm(q), self.k_norm(k_new)
        q = apply_rope(q.transpose(1, 2), cos, sin)  # [1, H, S, D]
        k_new = apply_rope(k_new, cos.transpose(1, 2), sin.transpose(1, 2))
        # Group queries by KV head: [1, Hkv, G*S, D]; no repeat of K/V.
        qg = q.reshape(1, self.n_kv, g * s, self.head_dim) * (self.head_dim**-0.5)
        p_len = past_k.shape[1]
        s_past = torch.matmul(qg, past_k.permute(0, 2, 3, 1)).float()  # [1, Hkv, G*S, P]
        if bias_past is not None:
            s_past = (s_past.view(1, self.n_kv, g, s, p_len) + bias_past).view(1, self.n_kv, g * s, p_len)
        s_new = torch.matmul(qg, k_new.permute(0, 2, 3, 1)).float()  # [1, Hkv, G*S, S]
        s_new = (s_new.view(1, self.n_kv, g, s, s) + bias_new).view(1, self.n_kv, g * s, s)
        probs = torch.softmax(torch.cat([s_past, s_new], dim=-1), dim=-1).to(x.dtype)
        out = torch.matmul(probs[..., :p_len], past_v.transpose(1, 2)) + torch.matmul(
            probs[..., p_len:], v_new.transpose(1, 2)
        )  # [1, Hkv, G*S, D]
        out = out.view(1, self.n_heads, s, self.head_dim).transpose(1, 2).reshape(1, s, -1)
        return self.o_proj(out), k_new, v_new


class MLP(nn.Module):
    """SwiGLU: down(SiLU(gate(x)) * up(x)), biases when ``mlp_bias``."""

    def __init__(self, cfg: BackboneConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: BackboneConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, bias_past, bias_new, past_k, past_v):
        a, k, v = self.self_attn(self.input_layernorm(x), cos, sin, bias_past, bias_new, past_k, past_v)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), k, v


def mask_to_bias(mask: torch.Tensor) -> torch.Tensor:
    """bool [S, S] (True = may attend) -> float32 additive bias (0 / finfo(float32).min).

    The bias is applied to float32 scores, so it cannot overflow in an fp16 graph; every
    row attends at least to itself, so no row is fully masked.
    """
    return torch.where(mask, 0.0, MASKED).to(torch.float32)


def window_biases(position_ids: torch.Tensor, mask: torch.Tensor, past_len: int, window: int | None):
    """Additive attention biases of one layer: over the past and over the new tokens.

    Args:
        position_ids: int64 [1, S], the new tokens' positions.
        mask: bool [S, S], True where new token i may attend new token j.
        past_len: P; past slot p holds position p.
        window: the layer's sliding window W, or None (the whole past is visible).

    Returns:
        (bias_past float32 [S, P] or None when the whole past is visible, bias_new float32
        [S, S]): 0 where attention is allowed, ``MASKED`` elsewhere. With a window, key position p is visible from query position q
        only when p > q - W (transformers ``masking_utils.sliding_window_overlay``); the
        query itself (p = q) always is, so no row is fully masked.
    """
    if window is None:
        return None, mask_to_bias(mask)
    q = position_ids[0][:, None]  # [S, 1]
    past_visible = torch.arange(past_len)[None, :] > q - window  # [S, P]
    new_visible = mask & (position_ids[0][None, :] > q - window)  # [S, S]
    return mask_to_bias(past_visible), mask_to_bias(new_visible)


class Backbone(nn.Module):
    """Decoder with explicit past K/V and a new-token attention mask, for every supported family.

    Parameter names match transformers' ``*ForCausalLM`` state dicts (``model.`` prefix
    dropped for the decoder), so weights load key-for-key.
    """

    def __init__(self, cfg: BackboneConfig):
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
            past: per layer (key, value), each [1, P, H_kv, D] in the weight dtype; slot p
                holds position p.

        Returns:
            (hidden [1, S, d] after the final norm, new_kv: per layer (key, value) [1, S, H_kv, D]).
        """
        cfg = self.config
        x = self.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(position_ids, cfg, x.dtype)
        past_len = past[0][0].shape[1] if past else 0
        biases = {w: window_biases(position_ids, mask, past_len, w)
                  for w in {cfg.window(i) for i in range(cfg.num_hidden_layers)}}
        new_kv = []
        for i, (layer, (pk, pv)) in enumerate(zip(self.layers, past)):
            x, k, v = layer(x, cos, sin, *biases[cfg.window(i)], pk, pv)
            new_kv.append((k, v))
        return self.norm(x), new_kv

    def empty_past(self, length: int = 0):
        """Zero past K/V of ``length`` slots: per layer ([1, length, H_kv, D], same)."""
        c = self.config
        p = self.embed_tokens.weight
        shape = (1, length, c.num_key_value_heads, c.head_dim)
        return [(p.new_zeros(shape), p.new_zeros(shape)) for _ in range(c.num_hidden_layers)]

