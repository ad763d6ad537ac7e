"""The model registry (``models/registry.json``) and loading a Medusa model by name.

Names are looked up exactly. Weights are resolved offline: from an installed package
(the embedded model), a local path, or the Hugging Face cache.

Entry schema (``models/registry.json``, one object per name)::

    {"description": str, "architecture": model_type,          # "llama", "mistral", "qwen2", "qwen3"
     "backbone": {"source": "package", "package": ..., "file": ..., "install": ...}
               | {"source": "hf", "repo": ...},
     "heads": {"source": "shipped", "path": folder in models/}
            | {"source": "hf", "repo": ...}                     # medusa_lm_head.* / heads.safetensors
            | {"source": "backbone"}                            # inside the backbone's checkpoint
            | {"source": "init", "num_heads": K, "num_layers": N},
     "chat_template": file in models/ (optional; overrides the tokenizer's),
     "default_tree": str, "max_context": int}
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from ..errors import HeadsFormatError, UnknownModelError, WeightsNotFoundError
from ..model.heads import MedusaHeads
from ..model.medusa import MedusaModel
from .accuracies import load_accuracies
from .backbone import LoadedBackbone, find_package_file, hf_cache_snapshot, load_backbone
from .draft_vocab import DraftVocab, load_draft_vocab
from .heads_formats import heads_from_tensors, load_heads

DEFAULT_MODEL = "smollm2-135m"
#: What a model without a chat template (a base model) does, said wherever it matters.
NO_CHAT_TEMPLATE_NOTE = ("the model has no chat template (a base model): prompts are encoded as plain text and "
                         "continued, not answered as a chat")


@dataclass(frozen=True)
class ModelEntry:
    """One registered model.

    Attributes:
        name: the registry key.
        description: one line for ``--help`` and listings.
        architecture: the backbone's ``model_type`` (what ``medusa-export models`` lists; the
            loaded checkpoint's own config.json decides what is built).
        backbone: ``{"source": "package"|"hf", ...}``.
        heads: ``{"source": "init"|"shipped"|"hf"|"backbone", ...}`` ("backbone": the heads are
            stored in the backbone's checkpoint, FasterDecoding medusa-1.0 / modelopt).
        chat_template: file name of a template in ``models/`` (None: the tokenizer's).
        default_tree: the ``--tree`` used when none is given.
        max_context: default context capacity (tokens) for generation and export.
    """

    name: str
    description: str
    backbone: dict
    heads: dict
    architecture: str = "llama"
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
    #: how the checkpoint was stored when not in plain floats (e.g. modelopt FP8, dequantized), else None.
    quantization: str | None = None
    #: FP8 scales dequantization did not apply (``*.input_scale``, KV scales), by checkpoint key.
    kept_scales: dict = field(default_factory=dict)
    #: what the user should know about this checkpoint (GGUF limits, FP8, no chat template); printed by the CLI.
    notes: list = field(default_factory=list)

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


def entry_for(model: str) -> tuple[ModelEntry, str | None]:
    """The registry entry of ``model``, or a local entry when ``model`` is an existing path.

    Returns:
        (the entry, the path when ``model`` is one, else None).

    Raises:
        UnknownModelError: neither a registered name nor an existing path.
    """
    if Path(model).exists() and model not in load_registry():
        return ModelEntry(name=Path(model).name, description="local model", backbone={"source": "path"},
                          heads={"source": "init", "num_heads": 4, "num_layers": 1}, architecture=""), model
    return get_entry(model), None


def load_entry_backbone(entry: ModelEntry, model_path: str | None = None, *, dtype: torch.dtype = torch.float32,
                        trust_remote_code: bool = False) -> LoadedBackbone:
    """The backbone and tokenizer of a registry entry (the entry's chat template file, if any, applied).

    Raises:
        WeightsNotFoundError, UnsupportedModelError: see :func:`~.backbone.load_backbone`.
    """
    path, _ = resolve_backbone(entry, model_path)
    template = (models_dir() / entry.chat_template).read_text() if entry.chat_template else None
    return load_backbone(path, dtype=dtype, trust_remote_code=trust_remote_code, chat_template=template)


def load_entry_heads(entry: ModelEntry, loaded: LoadedBackbone, heads_path: str | None = None,
                     lm_head: torch.nn.Linear | None = None) -> tuple[MedusaHeads | None, str, Path | None]:
    """The Medusa heads of a registry entry (or ``heads_path``) for a loaded backbone.

    Args:
        entry: the registry entry (its ``heads`` source).
        loaded: the loaded backbone (its lm_head; heads stored in its checkpoint).
        heads_path: heads directory/file overriding the entry's.
        lm_head: the LM head the heads check against and share (default: the backbone's).

    Returns:
        (the heads, or None for the entry's §2.1.1 initial heads; where they came from; the folder
        to look for ``accuracies.json`` / ``draft_vocab.json`` in, or None).

    Raises:
        HeadsFormatError: the heads do not fit the backbone, or a "backbone" entry whose
            checkpoint holds none.
        WeightsNotFoundError: an HF heads repo not in the cache.
    """
    lm_head = lm_head if lm_head is not None else loaded.backbone.lm_head
    source, embedded = entry.heads["source"], loaded.embedded_heads
    if heads_path:
        return load_heads(heads_path, lm_head), str(heads_path), Path(heads_path)
    if source == "backbone" or (source == "init" and embedded is not None):
        if embedded is None:
            raise HeadsFormatError(f"{loaded.source} holds no Medusa heads (no key starts with medusa_head. or "
                                   "medusa_heads.); give --heads")
        heads = heads_from_tensors(embedded.tensors, lm_head, num_heads=embedded.num_heads,
                                   num_layers=embedded.num_layers, counts_from=f"{loaded.source}/config.json")
        return heads, f"{loaded.source} ({embedded.prefix}* keys)", Path(loaded.source)
    if source == "init":
        return None, "init (seeds/001 §2.1.1: untrained, each head repeats the base next-token prediction)", None
    if source == "shipped":
        hp = models_dir() / entry.heads["path"]
        return load_heads(hp, lm_head), f"shipped:{entry.heads['path']}", hp
    if source == "hf":
        hp = hf_cache_snapshot(entry.heads["repo"])
        return load_heads(hp, lm_head), entry.heads["repo"], hp
    raise ValueError(f"registry entry {entry.name!r}: unknown heads source {source!r}")


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
        model: a registry name, or a path to an HF model directory / ``.gguf`` file (its heads:
            those stored in the checkpoint, ``medusa_head.`` / ``medusa_heads.`` keys, else the
            §2.1.1 initial heads).
        model_path: local backbone weights overriding the registry's source.
        heads_path: heads directory/file overriding the registry's heads.
        dtype: weight dtype.
        trust_remote_code: passed to transformers.

    Raises:
        UnknownModelError: neither a registered name nor an existing path.
        WeightsNotFoundError: the weights are not on disk (message says what to download).
        HeadsFormatError: the heads do not fit the backbone.
    """
    entry, local = entry_for(model)
    loaded = load_entry_backbone(entry, local or model_path, dtype=dtype, trust_remote_code=trust_remote_code)
    heads, heads_source, hp = load_entry_heads(entry, loaded, heads_path)
    if heads is None:
        medusa = MedusaModel.with_initial_heads(loaded.backbone, entry.heads["num_heads"], entry.heads["num_layers"])
    else:
        medusa = MedusaModel(loaded.backbone, heads)
    medusa.heads.to(dtype)
    notes = list(loaded.notes)
    if not loaded.chat_template:
        notes.append(NO_CHAT_TEMPLATE_NOTE)
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
        quantization=loaded.quantization,
        kept_scales=loaded.kept_scales,
        notes=notes,
    )
