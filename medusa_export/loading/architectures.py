"""Checkpoint ``config.json`` -> :class:`~medusa_export.model.config.BackboneConfig`, per family.

Each supported ``model_type`` maps its transformers config fields onto the backbone's feature
switches (see the table in :mod:`medusa_export.model.config`); anything the reference and the
graphs do not implement is refused by name, with the supported choices in the message.
Field semantics: transformers 4.57 ``models/{llama,mistral,qwen2,qwen3}/configuration_*.py``.
"""

from __future__ import annotations

from ..errors import UnsupportedModelError
from ..model.config import ROPE_TYPES, BackboneConfig, RopeScaling

#: model_type -> family name (what ``medusa-export models`` and the README table call it).
ARCHITECTURES = {"llama": "Llama 1/2/3.x", "mistral": "Mistral", "qwen2": "Qwen2 / Qwen2.5", "qwen3": "Qwen3"}


def _rope_scaling(cfg: dict) -> RopeScaling | None:
    rs = cfg.get("rope_scaling")
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "default":
        return None
    if kind not in ROPE_TYPES:
        raise UnsupportedModelError(f"rope_scaling type {kind!r} is not supported; supported: "
                                    f"{', '.join(t for t in ROPE_TYPES)} (or none)")
    if kind == "linear":
        return RopeScaling("linear", float(rs["factor"]))
    try:
        return RopeScaling("llama3", float(rs["factor"]), float(rs["low_freq_factor"]), float(rs["high_freq_factor"]),
                           int(rs["original_max_position_embeddings"]))
    except KeyError as exc:
        raise UnsupportedModelError(f"rope_scaling 'llama3' lacks the field {exc.args[0]!r}") from None


def backbone_config(cfg: dict) -> BackboneConfig:
    """The backbone config of a checkpoint's ``config.json`` (as a dict).

    Raises:
        UnsupportedModelError: an unsupported ``model_type``, RoPE type or feature (named, with
            the supported choices).
    """
    mt = cfg.get("model_type")
    if mt not in ARCHITECTURES:
        raise UnsupportedModelError(f"model_type {mt!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
    heads = cfg["num_attention_heads"]
    common = dict(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads, head_dim=cfg.get("head_dim") or 0,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=float(cfg.get("rope_theta", 10000.0)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)), model_type=mt,
        rope_scaling=_rope_scaling(cfg),
    )
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act {cfg['hidden_act']!r} is not supported; supported: silu")
    if mt == "llama":
        bias = bool(cfg.get("attention_bias", False))
        return BackboneConfig(**common, qkv_bias=bias, o_bias=bias, mlp_bias=bool(cfg.get("mlp_bias", False)))
    if mt == "mistral":
        return BackboneConfig(**common, sliding_window=cfg.get("sliding_window"))
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
    layer_types = tuple(cfg.get("layer_types") or ())
    if window is None:
        layer_types = ()
    elif not layer_types:  # configs written before transformers had layer_types: layers >= max_window_layers slide
        first = int(cfg.get("max_window_layers", cfg["num_hidden_layers"]))
        layer_types = tuple("sliding_attention" if i >= first else "full_attention"
                            for i in range(cfg["num_hidden_layers"]))
    if mt == "qwen2":
        return BackboneConfig(**common, qkv_bias=True, sliding_window=window, layer_types=layer_types)
    bias = bool(cfg.get("attention_bias", False))
    return BackboneConfig(**common, qkv_bias=bias, o_bias=bias, qk_norm=True, sliding_window=window,
                          layer_types=layer_types)
