"""A transformers model that shares a :class:`~medusa_export.model.backbone.Backbone`'s weights.

Head training and calibration generate replies in batches with transformers' ``generate`` (left
padding, its KV cache), which the reference backbone does not do. Building that model from the
reference's tensors (not by loading the checkpoint a second time) means one strict loader for
every layout (medusa-1.0 folders, modelopt FP8, GGUF) and no second copy of the weights.
"""

from __future__ import annotations

import torch

from ..model.backbone import Backbone
from .architectures import transformers_config
from .backbone import LoadedBackbone
from .registry import load_registered_backbone


def transformers_twin(backbone: Backbone):
    """The family's transformers ``*ForCausalLM`` (eval mode) holding ``backbone``'s tensors (no copy).

    Raises:
        UnsupportedModelError: a switch combination the family's transformers model cannot express.
    """
    from transformers import AutoModelForCausalLM

    cfg = transformers_config(backbone.config)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    state = {k if k == "lm_head.weight" else f"model.{k}": v for k, v in backbone.state_dict().items()}
    hf.load_state_dict(state, strict=True, assign=True)
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config=cfg)  # its inv_freq buffer is not in the state dict
    if backbone.config.tie_word_embeddings:
        hf.tie_weights()
    return hf.eval()


def load_transformers_model(model: str, model_path: str | None = None, *, dtype: torch.dtype = torch.float32,
                            device: str = "cpu") -> tuple[object, LoadedBackbone]:
    """A registered model (or a path) as a transformers ``*ForCausalLM``, read by the registry's strict loader.

    :func:`~.registry.load_registered_backbone` reads the checkpoint (every family and layout:
    medusa-1.0 folders, modelopt FP8, GGUF); :func:`transformers_twin` hands its tensors to the
    family's transformers model without a copy. Head training, calibration and the benchmarks'
    transformers reference all load through here. No ``generation_config.json`` is applied: a
    ``generate`` call gets exactly the settings it passes.

    Args:
        model: a registry name, or a path to an HF model folder / ``.gguf`` file.
        model_path: local backbone weights overriding the registry's source.
        dtype: weight dtype.
        device: where the model is moved (``cpu``, ``cuda``, ``cuda:1``).

    Returns:
        (the transformers model, eval mode, gradients off; the loaded backbone it shares its tensors
        with: tokenizer, EOS ids, chat template, source, embedded heads).

    Raises:
        UnknownModelError, WeightsNotFoundError, UnsupportedModelError: as
            :func:`~.registry.load_registered_backbone` and :func:`transformers_twin`.
    """
    _, loaded = load_registered_backbone(model, model_path, dtype=dtype)
    hf_model = transformers_twin(loaded.backbone).to(device)
    hf_model.requires_grad_(False)
    return hf_model, loaded
