"""The supported decoder families, one :class:`Family` entry each: the single table that loading, the
reference model's config, both graph writers (through :class:`~.config.BackboneConfig`'s switches),
``scripts/make_random_checkpoint.py`` and the tests' tiny models read.

An entry is data: how the family's ``config.json`` fields turn the backbone's feature switches on
(:meth:`Family.switches`, :meth:`Family.window_layers`), which transformers config class computes the same
model, what its GGUF files call the architecture, and the defaults of a generated checkpoint and of the
tests' tiny models. Adding a family is one entry in :data:`FAMILIES` when its features are switches the
reference and the graphs already implement (see the table in :mod:`.config`); a new feature needs a new
switch in :class:`~.config.BackboneConfig`, the reference (:mod:`.backbone`) and both graph writers first.

Sources: transformers 4.57 ``models/{llama,mistral,qwen2,qwen3}/configuration_*.py`` (field names and
defaults), ``integrations/ggml.py`` and ``modeling_gguf_pytorch_utils.py`` (GGUF architecture names, the
llama Q/K permutation). This module imports neither torch nor transformers (the checkpoint script reads it
before it draws any value).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from ..errors import UnsupportedModelError

#: The boolean feature switches of :class:`~.config.BackboneConfig` a family entry sets.
SWITCHES = ("qkv_bias", "o_bias", "mlp_bias", "qk_norm")
#: How a family's config.json says which layers use a sliding window:
#: "none" (the transformers config has no window field), "every_layer" (``sliding_window`` on every layer or
#: none: Mistral), "layer_types" (``use_sliding_window`` + ``layer_types`` / ``max_window_layers``: Qwen2, Qwen3).
WINDOW_KINDS = ("none", "every_layer", "layer_types")


def _frozen(d: Mapping | None = None) -> Mapping:
    return MappingProxyType(dict(d or {}))


@dataclass(frozen=True)
class Family:
    """One decoder family: its config mapping, defaults, GGUF name and test shapes.

    Attributes:
        model_type: the ``model_type`` of its ``config.json`` (the table's key).
        name: what ``medusa-export models`` and docs/models.md call it ("Llama 1/2/3.x").
        hf_model_type: the transformers ``model_type`` whose config class fills in the defaults of a
            config.json and whose model computes what the backbone computes (the family's own for the
            built-in ones; a variant that renames a model names the original here).
        hf_class: the transformers model class (config.json's ``architectures``, e.g. "LlamaForCausalLM").
        fixed_switches: switches of :data:`SWITCHES` always on in this family (Qwen2: ``qkv_bias``; Qwen3:
            ``qk_norm``); the ones neither fixed nor read from a field are off.
        switch_fields: config.json field -> the switches it turns on (Llama: ``attention_bias`` -> q/k/v and o
            biases). Written back by :func:`~medusa_export.loading.architectures.transformers_config`, so the
            switches of one field must agree there.
        window: one of :data:`WINDOW_KINDS`.
        head_dim_field: the transformers config has a ``head_dim`` field (Qwen2Config has none: its model reads
            the attribute, set only when it differs from hidden / heads).
        explicit_head_dim: the family's config.json states ``head_dim`` (Qwen3), so a generated test shape writes
            hidden / heads there.
        gguf_architecture: ``general.architecture`` of its GGUF files ("llama" for Mistral too), or None.
        gguf_permuted_qk: llama.cpp permuted the Q/K rows of those files (undone on reading, as transformers'
            ``LlamaTensorProcessor``).
        gguf_load_note: a note shown when transformers loads a GGUF file as this family ("" for none).
        gguf_name_note: a note shown when a GGUF file's ``general.name`` mentions this family's model_type but it
            loads as another family ("" for none).
        chat_style: the chat template of a generated test-shape checkpoint (a style of
            ``scripts/make_random_checkpoint.py``: vicuna, mistral, chatml, llama3).
        config_fields: fields every config.json of the family holds (a generated checkpoint writes them).
        test_shape_defaults: config.json fields of a generated test shape (``tiny``, ``small``, ``medium``) of
            this family, beside the shape's sizes.
        fixtures: the tests' tiny models of this family: name -> keyword arguments of the transformers config
            class that switch the family's distinguishing features on (tests/conftest.py ``FAMILIES``).
    """

    model_type: str
    name: str
    hf_model_type: str
    hf_class: str
    fixed_switches: Mapping[str, bool] = field(default_factory=_frozen)
    switch_fields: Mapping[str, tuple[str, ...]] = field(default_factory=_frozen)
    window: str = "none"
    head_dim_field: bool = True
    explicit_head_dim: bool = False
    gguf_architecture: str | None = None
    gguf_permuted_qk: bool = False
    gguf_load_note: str = ""
    gguf_name_note: str = ""
    chat_style: str = "vicuna"
    config_fields: Mapping[str, object] = field(default_factory=_frozen)
    test_shape_defaults: Mapping[str, object] = field(default_factory=_frozen)
    fixtures: Mapping[str, Mapping[str, object]] = field(default_factory=_frozen)

    def __post_init__(self) -> None:
        for name in ("fixed_switches", "switch_fields", "config_fields", "test_shape_defaults", "fixtures"):
            object.__setattr__(self, name, _frozen(getattr(self, name)))
        named = [*self.fixed_switches, *(s for group in self.switch_fields.values() for s in group)]
        bad = sorted(set(named) - set(SWITCHES))
        if bad:
            raise ValueError(f"family {self.model_type}: unknown switch {bad[0]!r}; switches: {', '.join(SWITCHES)}")
        if self.window not in WINDOW_KINDS:
            raise ValueError(f"family {self.model_type}: window {self.window!r}; choose one of "
                             f"{', '.join(WINDOW_KINDS)}")

    def switches(self, cfg: Mapping) -> dict[str, bool]:
        """The feature switches (:data:`SWITCHES`, in that order) of a config.json read through this family.

        Args:
            cfg: the config.json fields (with the transformers class's defaults filled in, or as written).

        Returns:
            switch name -> on.
        """
        out = {s: bool(self.fixed_switches.get(s, False)) for s in SWITCHES}
        for name, group in self.switch_fields.items():
            for s in group:
                out[s] = bool(cfg.get(name, False))
        return out

    def window_layers(self, cfg: Mapping) -> tuple[int | None, tuple[str, ...]]:
        """``(sliding_window, layer_types)`` of :class:`~.config.BackboneConfig` from a config.json read through
        this family's transformers config (its defaults filled in).

        transformers 4.57: Mistral slides every layer when ``sliding_window`` is set; Qwen2/Qwen3 slide only with
        ``use_sliding_window``, on the layers ``layer_types`` names (configs written before that field: the layers
        at index >= ``max_window_layers``).
        """
        if self.window == "none":
            return None, ()
        if self.window == "every_layer":
            return cfg.get("sliding_window"), ()
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
        layer_types = tuple(cfg.get("layer_types") or ())
        if window is None:
            return None, ()
        if not layer_types:
            layers = cfg["num_hidden_layers"]
            first = int(cfg.get("max_window_layers", layers))
            layer_types = tuple("sliding_attention" if i >= first else "full_attention" for i in range(layers))
        return window, layer_types


_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}  # all three bands of inv_freq exercised at D = 16
_LLAMA_DEFAULTS = {"rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}
_QWEN_DEFAULTS = {"rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
                  "use_sliding_window": False, "sliding_window": None}

#: model_type -> its :class:`Family`. The tests' tiny models switch each family's distinguishing feature on
#: (hidden 64, GQA 4/2 from tests/conftest.py): RoPE scaling, a sliding window (8) smaller than the test
#: context, biases, q/k norms, an explicit head_dim, tied embeddings.
FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("llama", "Llama 1/2/3.x", "llama", "LlamaForCausalLM",
           switch_fields={"attention_bias": ("qkv_bias", "o_bias"), "mlp_bias": ("mlp_bias",)},
           gguf_architecture="llama", gguf_permuted_qk=True, chat_style="vicuna",
           config_fields={"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1, "rope_scaling": None},
           test_shape_defaults=_LLAMA_DEFAULTS,
           fixtures={"llama3": {"num_hidden_layers": 2, "rope_theta": 1e4, "rope_scaling": _LLAMA3_ROPE},
                     "llama-linear-bias": {"num_hidden_layers": 2,
                                           "rope_scaling": {"type": "linear", "factor": 2.0},
                                           "attention_bias": True, "mlp_bias": True}}),
    Family("mistral", "Mistral", "mistral", "MistralForCausalLM", window="every_layer",
           gguf_architecture="llama", gguf_permuted_qk=True,
           gguf_load_note="GGUF has no sliding-window field: transformers' Mistral default sliding_window=4096 "
                          "(Mistral 7B v0.1) is applied; load the Hugging Face checkpoint if the model has "
                          "another window or none",
           gguf_name_note="this Mistral GGUF loads as a llama model without a sliding window (GGUF has no field "
                          "for it): exact up to the model's window (4096 tokens for Mistral 7B v0.1; later "
                          "versions have none)",
           chat_style="mistral", config_fields={"sliding_window": 4096}, test_shape_defaults=_LLAMA_DEFAULTS,
           fixtures={"mistral": {"num_hidden_layers": 2, "sliding_window": 8}}),
    Family("qwen2", "Qwen2 / Qwen2.5", "qwen2", "Qwen2ForCausalLM", fixed_switches={"qkv_bias": True},
           window="layer_types", head_dim_field=False, gguf_architecture="qwen2", chat_style="chatml",
           test_shape_defaults=_QWEN_DEFAULTS,
           fixtures={"qwen2": {"num_hidden_layers": 3, "use_sliding_window": True, "sliding_window": 8,
                               "max_window_layers": 1, "tie_word_embeddings": True}}),
    Family("qwen3", "Qwen3", "qwen3", "Qwen3ForCausalLM", fixed_switches={"qk_norm": True},
           switch_fields={"attention_bias": ("qkv_bias", "o_bias")}, window="layer_types", explicit_head_dim=True,
           gguf_architecture="qwen3", chat_style="chatml", config_fields={"attention_bias": False},
           test_shape_defaults=_QWEN_DEFAULTS,
           fixtures={"qwen3": {"num_hidden_layers": 2, "head_dim": 32, "attention_bias": True}}),
)}


def family_of(model_type: object) -> Family:
    """The :class:`Family` of a config.json's ``model_type``.

    Raises:
        UnsupportedModelError: a model_type without an entry in :data:`FAMILIES` (the supported ones named).
    """
    fam = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if fam is None:
        raise UnsupportedModelError(f"model_type {model_type!r} is not supported; supported: {', '.join(FAMILIES)}")
    return fam


def gguf_family(architecture: str) -> Family:
    """The first :class:`Family` whose GGUF files declare ``general.architecture`` = ``architecture``.

    Raises:
        UnsupportedModelError: no family reads that architecture (the supported ones named, with their families).
    """
    by_arch: dict[str, list[Family]] = {}
    for fam in FAMILIES.values():
        if fam.gguf_architecture:
            by_arch.setdefault(fam.gguf_architecture, []).append(fam)
    if architecture not in by_arch:
        choices = ", ".join(f"{a} ({', '.join(f.name for f in fams)})" for a, fams in by_arch.items())
        raise UnsupportedModelError(f"GGUF architecture {architecture!r} is not supported; supported: {choices}")
    return by_arch[architecture][0]
