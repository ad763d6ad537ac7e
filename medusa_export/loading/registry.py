"""The model registry (``models/registry.json``) and loading a Medusa model by name.

Names are looked up exactly. Weights are resolved offline: from an installed package
(the embedded model), a local path, or the Hugging Face cache.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from ..errors import UnknownModelError, WeightsNotFoundError
from ..model.medusa import MedusaModel
from .accuracies import load_accuracies
from .backbone import LoadedBackbone, find_package_file, hf_cache_snapshot, load_backbone
from .draft_vocab import DraftVocab, load_draft_vocab
from .heads_formats import load_heads

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class ModelEntry:
    """One registered model.

    Attributes:
        name: the registry key.
        description: one line for ``--help`` and listings.
        backbone: ``{"source": "package"|"hf", ...}``.
        heads: ``{"source": "init"|"shipped"|"hf", ...}``.
        chat_template: file name of a template in ``models/`` (None: the tokenizer's).
        default_tree: the ``--tree`` used when none is given.
        max_context: default context capacity (tokens) for generation and export.
    """

    name: str
    description: str
    backbone: dict
    heads: dict
    chat_template: str | None = None
    default_tree: str = "chain"
    max_context: int = 2048
    extra: dict = field(default_factory=dict)


def models_dir() -> Path:
    """The folder of the installed ``medusa_models`` data package (``models/`` in the repo)."""
    return Path(str(resources.files("medusa_models")))


def load_registry() -> dict[str, ModelEntry]:
    """All registered models by name."""
    data = json.loads((models_dir() / "registry.json").read_text())
    known = set(ModelEntry.__dataclass_fields__) - {"name", "extra"}
    return {
        name: ModelEntry(name=name, **{k: v for k, v in e.items() if k in known},
                         extra={k: v for k, v in e.items() if k not in known})
        for name, e in data.items()
    }


def get_entry(name: str) -> ModelEntry:
    """Exact lookup.

    Raises:
        UnknownModelError: the name is not registered; the message lists the known names.
    """
    reg = load_registry()
    if name not in reg:
        raise UnknownModelError(
            f"unknown model {name!r}; known models: {', '.join(sorted(reg))} "
            "(or pass a path to an HF model directory or a .gguf file)"
        )
    return reg[name]


@dataclass
class LoadedMedusa:
    """A Medusa model ready for the reference decode loop and export."""

    model: MedusaModel
    tokenizer: object
    eos_token_ids: list[int]
    chat_template: str | None
    name: str
    backbone_source: str
    heads_source: str
    default_tree: str
    max_context: int
    #: calibrated a_k^(i) [K, topk] from ``accuracies.json`` beside the heads (None: none).
    head_accuracies: np.ndarray | None = None
    #: token ids by frequency from ``draft_vocab.json`` beside the heads (None: none); ``--heads-vocab N``
    #: projects the heads onto its top N (:mod:`medusa_export.loading.draft_vocab`).
    draft_vocab: DraftVocab | None = None

    @property
    def heads_are_initial(self) -> bool:
        """True when the heads are untrained (§2.1.1 init: they repeat the base prediction)."""
        return self.heads_source.startswith("init")


def resolve_backbone(entry: ModelEntry, model_path: str | None) -> tuple[Path, str | None]:
    """Where a registered model's backbone weights are on disk (offline).

    Args:
        entry: the registry entry (its ``backbone`` source: ``package``, ``hf``).
        model_path: local weights overriding the entry's source (returned as given).

    Returns:
        (the backbone path: an HF model folder or a ``.gguf`` file, None).

    Raises:
        WeightsNotFoundError: the package or the HF cache snapshot is not installed; the message
            says how to get it.
        ValueError: the entry names an unknown backbone source.
    """
    src = entry.backbone
    if model_path:
        return Path(model_path), None
    if src["source"] == "package":
        try:
            return find_package_file(src["package"], src["file"]), None
        except WeightsNotFoundError as exc:
            raise WeightsNotFoundError(f"{exc}. Install it with `{src['install']}`.") from None
    if src["source"] == "hf":
        return hf_cache_snapshot(src["repo"]), None
    raise ValueError(f"registry entry {entry.name!r}: unknown backbone source {src['source']!r}")


def load_model(
    model: str = DEFAULT_MODEL,
    *,
    model_path: str | None = None,
    heads_path: str | None = None,
    dtype: torch.dtype = torch.float32,
    trust_remote_code: bool = False,
) -> LoadedMedusa:
    """Load a registered model (or a path) with its Medusa heads.

    Args:
        model: a registry name, or a path to an HF model directory / ``.gguf`` file.
        model_path: local backbone weights overriding the registry's source.
        heads_path: heads directory/file overriding the registry's heads.
        dtype: weight dtype.
        trust_remote_code: passed to transformers.

    Raises:
        UnknownModelError: neither a registered name nor an existing path.
        WeightsNotFoundError: the weights are not on disk (message says what to download).
        HeadsFormatError: the heads do not fit the backbone.
    """
    if Path(model).exists() and model not in load_registry():
        entry = ModelEntry(name=Path(model).name, description="local model", backbone={"source": "path"},
                           heads={"source": "init", "num_heads": 4, "num_layers": 1})
        model_path = model
    else:
        entry = get_entry(model)
    path, _ = resolve_backbone(entry, model_path)
    template = None
    if entry.chat_template:
        template = (models_dir() / entry.chat_template).read_text()
    loaded: LoadedBackbone = load_backbone(path, dtype=dtype, trust_remote_code=trust_remote_code,
                                           chat_template=template)
    backbone = loaded.backbone
    heads_cfg = entry.heads
    hp = None
    if heads_path:
        hp = Path(heads_path)
        heads = load_heads(hp, backbone.lm_head, backbone.embed_tokens)
        medusa, heads_source = MedusaModel(backbone, heads), str(heads_path)
    elif heads_cfg["source"] == "init":
        medusa = MedusaModel.with_initial_heads(backbone, heads_cfg["num_heads"], heads_cfg["num_layers"])
        heads_source = "init (seeds/001 §2.1.1: untrained, each head repeats the base next-token prediction)"
    elif heads_cfg["source"] == "shipped":
        hp = models_dir() / heads_cfg["path"]
        heads, heads_source = load_heads(hp, backbone.lm_head, backbone.embed_tokens), f"shipped:{heads_cfg['path']}"
        medusa = MedusaModel(backbone, heads)
    elif heads_cfg["source"] == "hf":
        hp = hf_cache_snapshot(heads_cfg["repo"])
        medusa = MedusaModel(backbone, load_heads(hp, backbone.lm_head, backbone.embed_tokens))
        heads_source = heads_cfg["repo"]
    else:
        raise ValueError(f"registry entry {entry.name!r}: unknown heads source {heads_cfg['source']!r}")
    medusa.heads.to(dtype)
    return LoadedMedusa(
        model=medusa.eval(),
        tokenizer=loaded.tokenizer,
        eos_token_ids=loaded.eos_token_ids,
        chat_template=loaded.chat_template,
        name=entry.name,
        backbone_source=loaded.source,
        heads_source=heads_source,
        default_tree=entry.default_tree,
        max_context=entry.max_context,
        head_accuracies=load_accuracies(hp) if hp is not None else None,
        draft_vocab=load_draft_vocab(hp),
    )
