"""Checkpoint ``config.json`` <-> :class:`~medusa_export.model.config.BackboneConfig`, per family.

Each supported ``model_type`` has an entry in :data:`~medusa_export.model.families.FAMILIES` that maps its
transformers config fields onto the backbone's feature switches (see the table in
:mod:`medusa_export.model.config`); this module reads that entry, and refuses by name, with the supported
choices in the message, whatever the reference and the graphs do not implement.
Field semantics: transformers 4.57 ``models/{llama,mistral,qwen2,qwen3}/configuration_*.py``.

A ``config.json`` is first read through the family's transformers config class, so a field the
file leaves out takes that class's default, as transformers' own model would (Qwen3: ``head_dim``
128; Mistral: ``sliding_window`` 4096 and 8 KV heads; Qwen2/Qwen3: ``layer_types`` derived from
``use_sliding_window`` / ``max_window_layers``). :func:`transformers_config` is the inverse: the
transformers config of a backbone (for a transformers model that shares its weights).
"""

from __future__ import annotations

from ..errors import UnsupportedModelError
from ..model.config import ROPE_TYPES, BackboneConfig, RopeScaling
from ..model.families import SWITCHES, Family, family_of


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


def _with_family_defaults(cfg: dict, fam: Family) -> dict:
    """``cfg`` read through its family's transformers config class (its defaults filled in; the
    ``model_type`` becomes ``fam.hf_model_type``).

    Raises:
        UnsupportedModelError: transformers rejects the config (e.g. a rope_scaling without
            its required fields); its message is kept.
    """
    from transformers import AutoConfig

    try:
        return AutoConfig.for_model(fam.hf_model_type, **{k: v for k, v in cfg.items() if k != "model_type"}).to_dict()
    except (KeyError, ValueError, TypeError) as exc:
        reason = exc.args[0] if exc.args else exc
        raise UnsupportedModelError(f"{cfg['model_type']} config rejected: {reason}") from None


def backbone_config(cfg: dict) -> BackboneConfig:
    """The backbone config of a checkpoint's ``config.json`` (as a dict).

    Raises:
        UnsupportedModelError: an unsupported ``model_type``, RoPE type or feature (named, with
            the supported choices), or inconsistent sizes.
    """
    try:
        return _backbone_config(cfg)
    except UnsupportedModelError:
        raise
    except ValueError as exc:  # BackboneConfig's own checks (head counts, layer types, window)
        raise UnsupportedModelError(f"{cfg.get('model_type')} config: {exc}") from None


#: config.json fields read as integers (checked before use: a string or a float is refused by name).
INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "max_position_embeddings")
#: config.json fields every supported family's config has.
REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def _backbone_config(cfg: dict) -> BackboneConfig:
    fam = family_of(cfg.get("model_type"))
    mt = fam.model_type
    rope_scaling = _rope_scaling(cfg)  # our message names the RoPE type before transformers' validation does
    cfg = _with_family_defaults(cfg, fam)
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act {cfg['hidden_act']!r} is not supported; supported: silu")
    if cfg.get("partial_rotary_factor") not in (None, 1, 1.0):
        raise UnsupportedModelError(f"partial_rotary_factor {cfg['partial_rotary_factor']} is not supported; "
                                    "supported: 1.0 (RoPE on the whole head)")
    for key in INT_FIELDS:  # "hidden_size": "64" failed later with a TypeError, or a shape "[1001, '64']"
        value = cfg.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise UnsupportedModelError(f"config.json: {key} must be a non-negative integer, got {value!r} "
                                        f"({type(value).__name__})")
    missing = [k for k in REQUIRED_FIELDS if cfg.get(k) is None]
    if missing:
        raise UnsupportedModelError(f"config.json: {', '.join(missing)} missing; a {mt} config needs "
                                    f"{', '.join(REQUIRED_FIELDS)}")
    heads = cfg["num_attention_heads"]
    common = dict(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads, head_dim=cfg.get("head_dim") or 0,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=float(cfg.get("rope_theta", 10000.0)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)), model_type=mt,
        rope_scaling=rope_scaling,
    )
    window, layer_types = fam.window_layers(cfg)
    return BackboneConfig(**common, **fam.switches(cfg), sliding_window=window, layer_types=layer_types)


def transformers_config(cfg: BackboneConfig):
    """The transformers config (``LlamaConfig``, ``MistralConfig``, ``Qwen2Config`` or ``Qwen3Config``)
    whose model computes what :class:`~medusa_export.model.backbone.Backbone` computes with ``cfg``.

    Raises:
        UnsupportedModelError: a combination of switches the family's transformers model has no
            field for (e.g. Llama with q/k/v biases but none on o_proj).
    """
    from transformers import AutoConfig

    fam = family_of(cfg.model_type)
    mt = fam.model_type
    rs = cfg.rope_scaling
    common = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_word_embeddings, max_position_embeddings=cfg.max_position_embeddings,
        rope_scaling=None if rs is None else {k: v for k, v in (
            ("rope_type", rs.rope_type), ("factor", rs.factor), ("low_freq_factor", rs.low_freq_factor),
            ("high_freq_factor", rs.high_freq_factor),
            ("original_max_position_embeddings", rs.original_max_position_embeddings))
            if rs.rope_type == "llama3" or k in ("rope_type", "factor")},
    )
    switches = {s: getattr(cfg, s) for s in SWITCHES}
    # what the family's fields can express: a fixed switch its value, a field's switches the field's value
    # (taken from the last of them), every other switch off
    fields = {name: switches[group[-1]] for name, group in fam.switch_fields.items()}
    expressible = {s: bool(fam.fixed_switches.get(s, False)) for s in SWITCHES}
    for name, group in fam.switch_fields.items():
        expressible.update(dict.fromkeys(group, fields[name]))
    bad = [f"{k}={switches[k]}" for k, v in expressible.items() if switches[k] != v]
    if bad:
        raise UnsupportedModelError(f"a {mt} model has no transformers field for {', '.join(bad)}")
    sliding = [cfg.window(i) is not None for i in range(cfg.num_hidden_layers)]
    extra: dict = dict(fields)
    if fam.window == "none":
        if any(sliding):
            raise UnsupportedModelError(f"a {mt} model has no transformers field for a sliding window")
    elif fam.window == "every_layer":
        if any(sliding) and not all(sliding):
            raise UnsupportedModelError(f"a {mt} model slides on every layer or none")
        extra["sliding_window"] = cfg.sliding_window if any(sliding) else None
    else:
        extra.update(use_sliding_window=any(sliding), sliding_window=cfg.sliding_window if any(sliding) else None,
                     layer_types=["sliding_attention" if s else "full_attention" for s in sliding])
    if fam.head_dim_field or cfg.head_dim != cfg.hidden_size // cfg.num_attention_heads:
        extra["head_dim"] = cfg.head_dim  # Qwen2Config has no field; the model reads the attribute
    return AutoConfig.for_model(fam.hf_model_type, **common, **extra)
