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
