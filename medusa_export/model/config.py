"""The backbone's geometry and feature switches: one config for every supported decoder family.

One model code path (the PyTorch reference in :mod:`.backbone` and both exported graphs) with
named switches per feature, in the manner of transformers' ``modeling_rope_utils.py`` and
TensorRT-LLM's ``PretrainedConfig``. Each family's mapping is one entry of
:data:`medusa_export.model.families.FAMILIES`; :mod:`medusa_export.loading.architectures` maps a
checkpoint's ``config.json`` to it through that entry and refuses, by name, whatever is not covered.

=============  ==========  ========================================================================
family         model_type  switches
=============  ==========  ========================================================================
Llama 1/2      llama       none (``attention_bias`` / ``mlp_bias`` when a variant sets them)
Llama 3.x      llama       ``rope_scaling`` "llama3" (3.1+) or "linear"; untied embeddings (8B+)
Mistral        mistral     ``sliding_window`` on every layer (v0.1: 4096; later versions: none)
Qwen2 / 2.5    qwen2       ``qkv_bias``; ``sliding_window`` on the layers ``layer_types`` names
Qwen3          qwen3       ``qk_norm``; explicit ``head_dim`` (not hidden / heads)
=============  ==========  ========================================================================
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

import torch

#: RoPE types the reference and both graphs implement (transformers' ``rope_type`` names).
ROPE_TYPES = ("default", "linear", "llama3")
#: Attention kinds of a layer (transformers' ``layer_types`` values).
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling (transformers 4.57 ``modeling_rope_utils.py``).

    Attributes:
        rope_type: "linear" (``_compute_linear_scaling_rope_parameters``: inv_freq / factor) or
            "llama3" (``_compute_llama3_parameters``: low frequencies / factor, high ones kept,
            smooth interpolation between).
        factor: the scaling factor (both types).
        low_freq_factor, high_freq_factor, original_max_position_embeddings: "llama3" only.
    """

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES[1:]:
            raise ValueError(f"rope_type {self.rope_type!r} is not implemented; implemented: {', '.join(ROPE_TYPES[1:])}")


@dataclass(frozen=True)
class BackboneConfig:
    """Backbone hyper-parameters (names follow transformers' configs) and feature switches.

    Attributes:
        vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
            num_key_value_heads, rms_norm_eps, rope_theta, tie_word_embeddings,
            max_position_embeddings: as in transformers' ``LlamaConfig``.
        head_dim: per-head width D (0: hidden_size // num_attention_heads, filled in; Qwen3 sets
            it explicitly and it differs).
        model_type: the checkpoint's ``model_type`` ("llama", "mistral", "qwen2", "qwen3").
        rope_scaling: None (plain RoPE) or :class:`RopeScaling`.
        qkv_bias: the q/k/v projections have biases (Qwen2; Llama with ``attention_bias``).
        o_bias: the output projection has a bias (Llama with ``attention_bias``).
        mlp_bias: gate/up/down projections have biases (Llama with ``mlp_bias``).
        qk_norm: an RMSNorm over D (weights [D], shared by the heads) on each head's q and k,
            before RoPE (Qwen3: ``q_norm`` / ``k_norm``).
        sliding_window: W or None. In a layer that uses it, a query at position q attends a key
            at position p iff q - W < p <= q (transformers ``masking_utils.sliding_window_overlay``:
            ``kv_idx > q_idx - sliding_window``, on top of the causal mask).
        layer_types: per layer "full_attention" or "sliding_attention"; empty means every layer
            slides when ``sliding_window`` is set (Mistral) and none otherwise.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 0
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    model_type: str = "llama"
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if self.layer_types and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad:
            raise ValueError(f"layer type {bad[0]!r} is not supported; supported: {', '.join(LAYER_TYPES)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"{self.num_attention_heads} attention heads are not a multiple of "
                             f"{self.num_key_value_heads} KV heads")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {self.sliding_window}")

    def window(self, layer: int) -> int | None:
        """The sliding window W of ``layer`` (None: the layer attends the whole past)."""
        if self.sliding_window is None:
            return None
        if not self.layer_types or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def features(self) -> list[str]:
        """The switches that are on, by name (for manifests, summaries and error messages)."""
        out = []
        if self.rope_scaling is not None:
            out.append(f"rope_scaling={self.rope_scaling.rope_type}")
        out += [n for n in ("qkv_bias", "o_bias", "mlp_bias", "qk_norm") if getattr(self, n)]
        if any(self.window(i) is not None for i in range(self.num_hidden_layers)):
            out.append(f"sliding_window={self.sliding_window}")
        if self.tie_word_embeddings:
            out.append("tied_embeddings")
        return out

    def truncated(self, num_layers: int) -> "BackboneConfig":
        """The same model with only its first ``num_layers`` layers (validation that fits in memory).

        Raises:
            ValueError: ``num_layers`` outside [1, num_hidden_layers].
        """
        if not 1 <= num_layers <= self.num_hidden_layers:
            raise ValueError(f"cannot keep {num_layers} of {self.num_hidden_layers} layers")
        return replace(self, num_hidden_layers=num_layers, layer_types=self.layer_types[:num_layers])

    def to_dict(self) -> dict:
        """JSON-ready dict; :meth:`from_dict` reads it back."""
        d = asdict(self)
        d["layer_types"] = list(self.layer_types)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "BackboneConfig":
        """Inverse of :meth:`to_dict` (``rope_scaling`` as a dict or None)."""
        return cls(**d)


def rope_inv_freq(cfg: BackboneConfig) -> torch.Tensor:
    """Rotary inverse frequencies, float32 [D / 2], scaled per ``cfg.rope_scaling``.

    Formulas and float32 operation order follow transformers 4.57 ``modeling_rope_utils.py``
    (``_compute_default_rope_parameters``, ``_compute_linear_scaling_rope_parameters``,
    ``_compute_llama3_parameters``), so the values equal transformers' bit for bit. Every type
    implemented here has an attention scaling of 1.0.
    """
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).to(dtype=torch.float) / d))
    rs = cfg.rope_scaling
    if rs is None:
        return inv_freq
    if rs.rope_type == "linear":
        return inv_freq / rs.factor
    # llama3
    low_freq_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_freq_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / rs.factor, inv_freq)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor)
    smoothed = (1 - smooth) * inv_freq_llama / rs.factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def rope_cos_sin(position_ids: torch.Tensor, cfg: BackboneConfig, dtype: torch.dtype):
    """cos / sin for rotary embeddings, each [1, 1, S, D], from position ids int64 [1, S].

    As transformers' ``LlamaRotaryEmbedding.forward``: freqs = position x inv_freq in float32,
    emb = cat(freqs, freqs), then cos / sin cast to ``dtype``.
    """
    freqs = position_ids[0].float()[:, None] * rope_inv_freq(cfg)[None, :]  # [S, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [S, D]
    return emb.cos().to(dtype)[None, None], emb.sin().to(dtype)[None, None]
