"""The source model of an artifact: the checkpoint an artifact was built from, opened again (``verify``, the
``torch`` backend), and checked to have the artifact's geometry.

An artifact records its model's registry name (manifest ``model.name``) and geometry, not its weights; a
registered model is found by that name (``--model-path`` may point at its weights), a model built from a
local path needs that path again.
"""

from __future__ import annotations

from medusa_runtime.errors import ArtifactError
from medusa_runtime.contract.manifest import Manifest

from ..errors import MedusaError

#: The artifact's geometry (manifest ``model`` field) -> the checkpoint config's field that must equal it.
GEOMETRY = {"vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_layers": "num_hidden_layers",
            "num_attention_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads"}


def check_same_geometry(model, config, where: str) -> None:
    """The reference model must have the artifact's geometry (another vocabulary failed inside ONNX Runtime's
    Gather with INVALID_ARGUMENT).

    Args:
        model: the artifact's :class:`medusa_runtime.contract.manifest.ModelInfo`.
        config: the checkpoint's :class:`~medusa_export.model.config.BackboneConfig`.
        where: the checkpoint, for the message.

    Raises:
        ArtifactError: a field differs; the message names each with both values.
    """
    diff = [f"{ours} {getattr(model, ours)} vs {getattr(config, theirs)}" for ours, theirs in GEOMETRY.items()
            if getattr(model, ours) != getattr(config, theirs)]
    if diff:
        raise ArtifactError(f"{where} is not the model this artifact was built from ({', '.join(diff)}; artifact vs "
                            f"checkpoint): give the weights of {model.backbone_source} with --model-path")


def open_source(manifest: Manifest, model_path: str | None = None, heads_path: str | None = None):
    """The artifact's source model as sources (configs, tokenizer, checked headers; no weights read yet), with
    the artifact's geometry.

    Args:
        manifest: the artifact's manifest.
        model_path: the weights (an HF model folder or a .gguf file): of the registered model the manifest
            names, or, for a model built from a local path, that path.
        heads_path: the Medusa heads, when not the registered model's own.

    Returns:
        The :class:`~medusa_export.loading.registry.LoadedMedusa` of :func:`~medusa_export.loading.sources.open_model`.

    Raises:
        MedusaError: the artifact's model is not registered and no ``model_path`` is given.
        ArtifactError: the checkpoint's geometry is not the artifact's (:func:`check_same_geometry`).
        And what :func:`~medusa_export.loading.sources.open_model` raises (weights not found, bad checkpoint).
    """
    from ..loading.registry import load_registry
    from ..loading.sources import open_model

    name = manifest.model.name
    if name in load_registry():
        lm = open_model(name, model_path=model_path, heads_path=heads_path)
    elif model_path:  # a model built from a local path: that path is the model
        lm = open_model(model_path, heads_path=heads_path)
    else:
        raise MedusaError(f"the artifact's model {name!r} is not a registered model: give its weights with "
                          "--model-path (an HF model dir or .gguf file)")
    check_same_geometry(manifest.model, lm.sources.config, model_path or name)
    return lm
