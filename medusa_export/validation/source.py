"""The source model of an artifact: the checkpoint an artifact was built from, opened again (``verify``, the
``torch`` backend), and checked to have the artifact's geometry.

An artifact records its model's registry name (manifest ``model.name``), where its backbone and heads came
from (``model.backbone_source``, ``model.heads_source``) and its geometry, not its weights; a registered model
is found by that name (``--model-path`` may point at its weights), a model built from a local path is opened
from the recorded path again (or ``--model-path``), and heads built from a folder or file are the recorded ones
(or ``--heads``).
"""

from __future__ import annotations

from pathlib import Path

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


def recorded_path(recorded: str) -> Path | None:
    """A source the manifest records (``model.backbone_source`` / ``heads_source``) as a path on this machine, or
    None when it names no existing file or folder (a registry source such as ``shipped:...``, a repo id, the
    initial heads' description, or a path that is not here).

    Args:
        recorded: the recorded source.

    Returns:
        The path, or None.
    """
    path = Path(recorded)
    return path if recorded and path.exists() else None


def _looks_like_a_path(recorded: str) -> bool:
    """A recorded source written as a filesystem path (absolute or explicitly relative, no description after it),
    as ``build`` records a local folder or file; a repo id (``org/name``) or ``shipped:...`` is not one."""
    return recorded.startswith(("/", "./", "../", "~")) and " (" not in recorded


def source_lines(lm, model_path: str | None, heads_path: str | None) -> list[str]:
    """What ``verify`` loaded, one line each: the backbone and the heads, and where each choice came from.

    Args:
        lm: the :func:`open_source` result.
        model_path, heads_path: ``--model-path`` and ``--heads`` (None: not given).

    Returns:
        ["backbone: SOURCE (--model-path | as the manifest records)", "heads: SOURCE (...)"].
    """
    return [f"backbone: {lm.backbone_source} ({'--model-path' if model_path else 'as the manifest records'})",
            f"heads: {lm.heads_source} ({'--heads' if heads_path else 'as the manifest records'})"]


def open_source(manifest: Manifest, model_path: str | None = None, heads_path: str | None = None):
    """The artifact's source model as sources (configs, tokenizer, checked headers; no weights read yet), with
    the artifact's geometry: by default what the manifest records.

    Backbone: ``model_path``, else the registered model the manifest names (``model.name``), else the local
    folder or file it was built from (``model.backbone_source``). Heads: ``heads_path``, else the heads folder or
    file the manifest records (``model.heads_source``) when it is a path, else the registered model's heads (or
    those stored in the backbone's checkpoint, or the initial heads) as the build chose them.

    Args:
        manifest: the artifact's manifest.
        model_path: the weights (an HF model folder or a .gguf file), instead of the recorded ones.
        heads_path: the Medusa heads, instead of the recorded ones.

    Returns:
        The :class:`~medusa_export.loading.registry.LoadedMedusa` of :func:`~medusa_export.loading.sources.open_model`.

    Raises:
        MedusaError: the recorded backbone or heads are not on this machine and no ``model_path`` / ``heads_path``
            replaces them (the message names the recorded source and the option).
        ArtifactError: the checkpoint's geometry is not the artifact's (:func:`check_same_geometry`), or the heads
            that would be loaded are the untrained initial heads where the artifact's were not.
        And what :func:`~medusa_export.loading.sources.open_model` raises (weights not found, bad checkpoint).
    """
    from ..loading.registry import INITIAL_HEADS_SOURCE, load_registry
    from ..loading.sources import open_model

    info = manifest.model
    heads = heads_path
    if heads is None and recorded_path(info.heads_source) is not None:
        heads = info.heads_source
    elif heads is None and _looks_like_a_path(info.heads_source):
        raise MedusaError(f"the artifact's heads were {info.heads_source!r} (manifest model.heads_source), which is "
                          "not on this machine: give them with --heads")
    if info.name in load_registry():
        lm = open_model(info.name, model_path=model_path, heads_path=heads)
    else:  # a model built from a local path: that path is the model
        where = model_path or (str(recorded_path(info.backbone_source) or "") or None)
        if where is None:
            raise MedusaError(f"the artifact's model {info.name!r} is not a registered model and was built from "
                              f"{info.backbone_source!r} (manifest model.backbone_source), which is not on this "
                              "machine: give its weights with --model-path (an HF model dir or .gguf file)")
        lm = open_model(where, heads_path=heads)
    check_same_geometry(info, lm.sources.config, model_path or lm.backbone_source)
    initial = INITIAL_HEADS_SOURCE.split(" ")[0]
    if heads_path is None and lm.heads_source.startswith(initial) and not info.heads_source.startswith(initial):
        raise ArtifactError(f"the artifact was built with the heads {info.heads_source!r} (manifest "
                            f"model.heads_source), but {lm.backbone_source} holds none, so verify would compare "
                            "with untrained heads: give the heads with --heads")
    return lm
