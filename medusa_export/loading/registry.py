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
from ..model.medusa import MedusaModel
from .accuracies import load_accuracies, load_accuracies_doc
from .backbone import LoadedBackbone, find_package_file, hf_cache_snapshot, load_backbone
from .draft_vocab import DraftVocab, load_draft_vocab
from .heads_formats import HEAD_PREFIXES, heads_from_tensors, load_heads

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
    """A Medusa model ready for the reference decode loop and export.

    ``model`` is the loaded fp32 reference (:func:`load_model`), or None when the model was opened as
    tensor sources for a streamed export (:func:`~.sources.open_model`: ``sources`` set, nothing loaded).
    """

    model: MedusaModel | None
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
    #: the whole ``accuracies.json`` beside the heads (its ``calibration`` and ``simulated`` go into the artifact's
    #: ``tree.json`` for per-step trees and ``--tree auto``), or None.
    accuracies_doc: dict | None = None
    #: token ids by frequency from ``draft_vocab.json`` beside the heads (None: none); ``--heads-vocab N``
    #: projects the heads onto its top N (:mod:`medusa_export.loading.draft_vocab`).
    draft_vocab: DraftVocab | None = None
    #: how the checkpoint was stored when not in plain floats (e.g. modelopt FP8, dequantized), else None.
    quantization: str | None = None
    #: FP8 scales dequantization did not apply (``*.input_scale``, KV scales), by checkpoint key.
    kept_scales: dict = field(default_factory=dict)
    #: what the user should know about this checkpoint (GGUF limits, FP8, no chat template); printed by the CLI.
    notes: list = field(default_factory=list)
    #: the backbone and heads as tensor sources with their configs (:class:`~.sources.ModelSources`), when
    #: opened by :func:`~.sources.open_model`; None for a loaded ``model`` (its sources are made on demand).
    sources: object | None = None

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

    The one resolution of a ``--model`` value, shared by :func:`load_model` (the loaded reference)
    and :func:`~.sources.open_model` (the streamed export's sources) through :func:`resolve_model`.

    Returns:
        (the entry, the path when ``model`` is one, else None).

    Raises:
        UnknownModelError: neither a registered name nor an existing path.
    """
    if Path(model).exists() and model not in load_registry():
        return ModelEntry(name=Path(model).name, description="local model", backbone={"source": "path"},
                          heads={"source": "init", "num_heads": 4, "num_layers": 1}, architecture=""), model
    return get_entry(model), None


def resolve_model(model: str, model_path: str | None = None) -> tuple[ModelEntry, Path]:
    """A registry name or a path -> (its entry, where its backbone weights are on disk).

    A path that is not a registered name gets an entry of its own (:func:`entry_for`: initial heads,
    4 x 1 block, unless the folder holds heads).

    Raises:
        UnknownModelError, WeightsNotFoundError: as :func:`entry_for` / :func:`resolve_backbone`.
    """
    entry, local = entry_for(model)
    path, _ = resolve_backbone(entry, local or model_path)
    return entry, path


#: How initial heads are described (``LoadedMedusa.heads_source``; :attr:`LoadedMedusa.heads_are_initial` reads it).
INITIAL_HEADS_SOURCE = "init (Medusa paper §2.1.1: untrained, each head repeats the base next-token prediction)"


@dataclass(frozen=True)
class HeadsChoice:
    """Where a model's Medusa heads come from (:func:`choose_heads`).

    Attributes:
        kind: ``"path"`` (a heads folder or file, or a model folder holding heads), ``"backbone"``
            (stored in the backbone's own checkpoint under ``prefix``) or ``"init"`` (§2.1.1 initial heads).
        path: the heads folder/file (``"path"``) or the backbone folder (``"backbone"``): where
            ``accuracies.json`` / ``draft_vocab.json`` are looked for; None for ``"init"``.
        description: where they came from, for messages and manifests.
        prefix: the key prefix of heads stored in the backbone (``"backbone"`` only).
    """

    kind: str
    path: Path | None
    description: str
    prefix: str | None = None


def choose_heads(entry: ModelEntry, heads_path: str | None, *, embedded_prefix: str | None,
                 backbone_source: str) -> HeadsChoice:
    """Where the heads of ``entry`` (or ``heads_path``) are: the one decision behind :func:`load_entry_heads`
    and :func:`~.sources.open_model`.

    Args:
        entry: the registry entry (its ``heads`` source: ``shipped``, ``hf``, ``backbone``, ``init``).
        heads_path: heads folder/file given by the user (overrides the entry).
        embedded_prefix: the prefix of heads stored in the backbone's checkpoint (``medusa_head.`` or
            ``medusa_heads.``), or None when it holds none. An ``init`` entry (a local folder) uses them.
        backbone_source: the backbone's folder or file (messages; ``accuracies.json`` beside stored heads).

    Raises:
        HeadsFormatError: a ``backbone`` entry whose checkpoint holds no heads.
        WeightsNotFoundError: an HF heads repo not in the cache.
        ValueError: the entry names an unknown heads source.
    """
    source = entry.heads["source"]
    if heads_path:
        return HeadsChoice("path", Path(heads_path), str(heads_path))
    if source == "backbone" or (source == "init" and embedded_prefix is not None):
        if embedded_prefix is None:
            raise HeadsFormatError(f"{backbone_source} holds no Medusa heads (no key starts with "
                                   f"{' or '.join(HEAD_PREFIXES)}); give --heads")
        return HeadsChoice("backbone", Path(backbone_source), f"{backbone_source} ({embedded_prefix}* keys)",
                           embedded_prefix)
    if source == "init":
        return HeadsChoice("init", None, INITIAL_HEADS_SOURCE)
    if source == "shipped":
        return HeadsChoice("path", models_dir() / entry.heads["path"], f"shipped:{entry.heads['path']}")
    if source == "hf":
        return HeadsChoice("path", hf_cache_snapshot(entry.heads["repo"]), entry.heads["repo"])
    raise ValueError(f"registry entry {entry.name!r}: unknown heads source {source!r}")


def load_entry_backbone(entry: ModelEntry, model_path: str | None = None, *, dtype: torch.dtype = torch.float32,
                        trust_remote_code: bool = False) -> LoadedBackbone:
    """The backbone and tokenizer of a registry entry (the entry's chat template file, if any, applied).

    Raises:
        WeightsNotFoundError, UnsupportedModelError: see :func:`~.backbone.load_backbone`.
    """
    path, _ = resolve_backbone(entry, model_path)
    return load_backbone(path, dtype=dtype, trust_remote_code=trust_remote_code, chat_template=entry_template(entry))


def load_registered_backbone(model: str, model_path: str | None = None, *, dtype: torch.dtype = torch.float32,
                             trust_remote_code: bool = False) -> tuple[ModelEntry, LoadedBackbone]:
    """The one "registry name or path -> loaded backbone" loader (build, train-heads, calibrate, benchmarks).

    Args:
        model: a registry name, or a path to an HF model folder / ``.gguf`` file (:func:`entry_for`).
        model_path: local backbone weights overriding the registry's source.
        dtype: weight dtype (GGUF and FP8 weights are dequantized to it).
        trust_remote_code: passed to transformers.

    Returns:
        (the entry, its backbone and tokenizer with the entry's chat template applied).

    Raises:
        UnknownModelError: neither a registered name nor an existing path.
        WeightsNotFoundError, UnsupportedModelError: see :func:`~.backbone.load_backbone`.
    """
    entry, local = entry_for(model)
    return entry, load_entry_backbone(entry, local or model_path, dtype=dtype, trust_remote_code=trust_remote_code)


def entry_template(entry: ModelEntry) -> str | None:
    """The chat template file an entry ships (overriding the tokenizer's), or None."""
    return (models_dir() / entry.chat_template).read_text() if entry.chat_template else None


def load_entry_heads(entry: ModelEntry, loaded: LoadedBackbone, heads_path: str | None = None,
                     lm_head: torch.nn.Linear | None = None, embed_tokens: torch.nn.Embedding | None = None
                     ) -> tuple[torch.nn.Module | None, str, Path | None]:
    """The heads of a registry entry (or ``heads_path``) for a loaded backbone.

    Medusa heads, or path-conditioned ones (:class:`~..model.hydra_heads.HydraHeads`, our heads
    format with ``head_type`` "hydra", which read the backbone's input embedding).

    Args:
        entry: the registry entry (its ``heads`` source).
        loaded: the loaded backbone (its lm_head; heads stored in its checkpoint).
        heads_path: heads directory/file overriding the entry's.
        lm_head: the LM head the heads check against and share (default: the backbone's).
        embed_tokens: the input embedding path-conditioned heads read (default: the backbone's).

    Returns:
        (the heads, or None for the entry's §2.1.1 initial heads; where they came from; the folder
        to look for ``accuracies.json`` / ``draft_vocab.json`` in, or None).

    Raises:
        HeadsFormatError: the heads do not fit the backbone, or a "backbone" entry whose
            checkpoint holds none.
        WeightsNotFoundError: an HF heads repo not in the cache.
    """
    lm_head = lm_head if lm_head is not None else loaded.backbone.lm_head
    embedded = loaded.embedded_heads
    choice = choose_heads(entry, heads_path, embedded_prefix=embedded.prefix if embedded else None,
                          backbone_source=loaded.source)
    if choice.kind == "init":
        return None, choice.description, None
    if choice.kind == "backbone":
        heads = heads_from_tensors(embedded.tensors, lm_head, num_heads=embedded.num_heads,
                                   num_layers=embedded.num_layers, counts_from=f"{loaded.source}/config.json")
    else:
        embed = embed_tokens if embed_tokens is not None else loaded.backbone.embed_tokens
        heads = load_heads(choice.path, lm_head, embed)
    return heads, choice.description, choice.path


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
    entry, loaded = load_registered_backbone(model, model_path, dtype=dtype, trust_remote_code=trust_remote_code)
    heads, heads_source, hp = load_entry_heads(entry, loaded, heads_path)
    if heads is None:
        medusa = MedusaModel.with_initial_heads(loaded.backbone, entry.heads["num_heads"], entry.heads["num_layers"])
    else:
        medusa = MedusaModel(loaded.backbone, heads)
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
        accuracies_doc=load_accuracies_doc(hp) if hp is not None else None,
        draft_vocab=load_draft_vocab(hp),
        quantization=loaded.quantization,
        kept_scales=loaded.kept_scales,
        notes=model_notes(loaded.notes, loaded.chat_template),
    )


def model_notes(checkpoint_notes: list[str], chat_template: str | None) -> list[str]:
    """What the user should know about a model (printed by the CLI): the checkpoint's notes (GGUF limits,
    FP8 dequantization), and :data:`NO_CHAT_TEMPLATE_NOTE` for a model without a chat template."""
    return list(checkpoint_notes) + ([] if chat_template else [NO_CHAT_TEMPLATE_NOTE])
