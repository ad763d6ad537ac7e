"""A Medusa model as tensor sources: what ``build`` exports from, without loading the model.

:func:`open_model` resolves a registered name or a path like :func:`~.registry.load_model`, but reads
only headers and configs: the backbone's ``config.json`` (or GGUF metadata) becomes a
:class:`~medusa_export.model.config.BackboneConfig`, the weights stay on disk behind a
:class:`~.checkpoint.TensorSource` checked key by key and shape by shape against it, and the heads
likewise. :func:`reference_model` builds the PyTorch reference (``model/``) from the same sources when a
check needs it, optionally truncated to its first N layers, one tensor at a time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from ..errors import HeadsFormatError, UnsupportedModelError
from ..model.config import BackboneConfig
from ..model.heads import HEADS_CONFIG, HEADS_FILE, HeadsConfig
from .accuracies import load_accuracies
from .architectures import backbone_config
from .checkpoint import (HEAD_PREFIXES, DictSource, PrefixSource, TensorSource, ZeroHeadsSource, backbone_shapes,
                         check_backbone, find_weights, hf_config_dict, open_source)
from .draft_vocab import load_draft_vocab
from .heads_formats import infer_heads_config

#: Heads file names looked for in a heads folder, in order (as :func:`~.heads_formats.load_heads`).
HEADS_FILES = (HEADS_FILE, "medusa_lm_head.safetensors", "medusa_lm_head.pt")


@dataclass
class ModelSources:
    """The export's inputs: backbone and heads tensors by name, and their configs.

    Attributes:
        backbone: HF-named backbone tensors (``model.layers.N.*``, ``lm_head.weight`` unless tied).
        heads: head tensors in the FasterDecoding layout (``{h}.{l}.linear.weight`` ...).
        config: the backbone's geometry and switches.
        heads_config: the heads' structure (checked against ``config``).
    """

    backbone: TensorSource
    heads: TensorSource
    config: BackboneConfig
    heads_config: HeadsConfig

    @property
    def by_name(self) -> dict[str, TensorSource]:
        """The sources by the names weight recipes use."""
        return {"backbone": self.backbone, "heads": self.heads}

    def fp32_bytes(self, num_layers: int | None = None) -> int:
        """Bytes of the model in float32 (backbone truncated to ``num_layers`` when given, heads whole)."""
        cfg = self.config if num_layers is None else self.config.truncated(num_layers)
        n = sum(torch.Size(s).numel() for s in backbone_shapes(cfg).values())
        n += sum(self.heads.info(k).numel for k in self.heads.keys())
        return 4 * n


def config_of(backbone) -> BackboneConfig:
    """The :class:`BackboneConfig` of an in-memory reference backbone (its config, or the older ``LlamaConfig``)."""
    c = backbone.config
    if isinstance(c, BackboneConfig):
        return c
    return BackboneConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                          num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                          num_key_value_heads=c.num_key_value_heads, rms_norm_eps=c.rms_norm_eps,
                          rope_theta=c.rope_theta, tie_word_embeddings=c.tie_word_embeddings,
                          max_position_embeddings=c.max_position_embeddings)


def sources_from_model(model) -> ModelSources:
    """Sources over a :class:`~medusa_export.model.medusa.MedusaModel` already in memory (no copy)."""
    b = model.backbone
    cfg = config_of(b)
    state = {}
    for k, v in b.state_dict().items():
        if k == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                state[k] = v
        else:
            state[f"model.{k}"] = v
    heads = DictSource(model.heads.head_state_dict(), "in-memory heads")
    return ModelSources(DictSource(state, "in-memory backbone"), heads, cfg, model.heads.config)


def sources_of(lm) -> ModelSources:
    """The sources of a :class:`~.registry.LoadedMedusa`: streamed ones from :func:`open_model`, or over its model."""
    if getattr(lm, "sources", None) is not None:
        return lm.sources
    return sources_from_model(lm.model)


def find_heads(path: Path) -> tuple[Path, int | None, int | None]:
    """The heads file at ``path`` (a folder or the file) and the head / block counts its config claims.

    Raises:
        HeadsFormatError: no heads file in the folder (the message lists the names looked for).
    """
    path = Path(path)
    if path.is_dir():
        file = next((path / n for n in HEADS_FILES if (path / n).is_file()), None)
        if file is None:
            raise HeadsFormatError(f"no heads file in {path}: expected {', '.join(HEADS_FILES)}")
    elif path.is_file():
        file = path
    else:
        raise HeadsFormatError(f"heads file {path} does not exist")
    for name in (HEADS_CONFIG, "config.json"):
        if (file.parent / name).is_file():
            meta = json.loads((file.parent / name).read_text())
            return (file, meta.get("num_heads", meta.get("medusa_num_heads")),
                    meta.get("num_layers", meta.get("medusa_num_layers")))
    return file, None, None


def source_of(path: Path, folder: Path, gguf_file: str | None) -> str:
    """Where the backbone weights are, for manifests (the GGUF file, or the folder)."""
    return str(Path(folder) / gguf_file) if gguf_file else str(path)


def heads_config_of(src: TensorSource, cfg: BackboneConfig, num_heads: int | None = None,
                    num_layers: int | None = None) -> HeadsConfig:
    """The heads' structure from their keys and header shapes (strict, nothing read).

    Raises:
        HeadsFormatError: see :func:`~.heads_formats.infer_heads_config`.
    """
    shapes = {k: torch.empty(src.info(k).shape, device="meta") for k in src.keys()}
    return infer_heads_config(shapes, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, num_heads=num_heads,
                              num_layers=num_layers)


def open_heads(path: Path, cfg: BackboneConfig) -> tuple[TensorSource, HeadsConfig]:
    """A heads file as a source, its structure inferred from the header's keys and shapes (strict).

    Raises:
        HeadsFormatError: see :func:`~.heads_formats.infer_heads_config`; or the file cannot be read.
    """
    from ..errors import CheckpointError
    from .checkpoint import SafetensorsSource, TorchBinSource

    file, num_heads, num_layers = find_heads(path)
    try:
        src = SafetensorsSource([file]) if file.suffix == ".safetensors" else TorchBinSource([file])
    except CheckpointError as exc:
        raise HeadsFormatError(f"cannot read heads file {file}: {exc}") from None
    return src, heads_config_of(src, cfg, num_heads, num_layers)


def open_backbone(path: Path, trust_remote_code: bool = False) -> tuple[TensorSource, BackboneConfig, dict, Path, str | None]:
    """The backbone checkpoint at ``path`` as a checked source.

    Returns:
        (source, config, transformers config dict, folder, GGUF file name or None).

    Raises:
        WeightsNotFoundError, CheckpointError, UnsupportedModelError: see :mod:`.checkpoint`.
    """
    kind, files, weight_map = find_weights(Path(path))
    hf = hf_config_dict(Path(path), kind, files, trust_remote_code)
    cfg = backbone_config(hf)
    src = open_source(kind, files, weight_map, cfg)
    check_backbone(src, cfg, "GGUF metadata" if kind == "gguf" else "config.json")
    return src, cfg, hf, files[0].parent, files[0].name if kind == "gguf" else None


def tokenizer_and_eos(folder: Path, gguf_file: str | None, hf: dict, trust_remote_code: bool = False):
    """(tokenizer, EOS ids): the tokenizer beside the weights (or in the GGUF) and the generation config's EOS.

    The generation config comes first, as for a loaded model (:func:`~.backbone.eos_ids`): with
    transformers 4.57 a GGUF tokenizer reports the wrong EOS.
    """
    from transformers import AutoTokenizer, GenerationConfig, PretrainedConfig
    from transformers.utils import logging as hf_logging

    from .backbone import eos_ids

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        tok = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=trust_remote_code, **kwargs)
        if not gguf_file and (folder / "generation_config.json").is_file():
            gen = GenerationConfig.from_pretrained(str(folder))
        else:
            gen = GenerationConfig.from_model_config(PretrainedConfig.from_dict(hf))
    finally:
        hf_logging.set_verbosity(verbosity)
    return tok, eos_ids(SimpleNamespace(generation_config=gen), tok)


def open_model(model: str, *, model_path: str | None = None, heads_path: str | None = None,
               trust_remote_code: bool = False):
    """A registered model (or a path) as sources: configs, tokenizer and checked headers, no weights loaded.

    Same arguments and resolution as :func:`~.registry.load_model`; the result's ``model`` is None and
    its ``sources`` are set (:func:`reference_model` builds the reference from them when needed).

    Raises:
        UnknownModelError, WeightsNotFoundError, CheckpointError, UnsupportedModelError, HeadsFormatError.
    """
    from .registry import LoadedMedusa, hf_cache_snapshot, models_dir, resolve_model

    entry, path = resolve_model(model, model_path)
    backbone, cfg, hf, folder, gguf_file = open_backbone(path, trust_remote_code)
    tok, eos = tokenizer_and_eos(folder, gguf_file, hf, trust_remote_code)
    template = (models_dir() / entry.chat_template).read_text() if entry.chat_template else None
    if template:
        tok.chat_template = template
    template = template or getattr(tok, "chat_template", None)
    hc, hp = entry.heads, None
    in_folder = next((p for p in HEAD_PREFIXES if any(k.startswith(p) for k in backbone.keys())), None)
    heads = hcfg = None
    if heads_path:
        hp = Path(heads_path)
        heads_source = str(heads_path)
    elif hc["source"] == "backbone" or (hc["source"] == "init" and in_folder and entry.backbone["source"] == "path"):
        if in_folder is None:
            raise HeadsFormatError(f"{backbone.description} holds no Medusa heads (no {' / '.join(HEAD_PREFIXES)} keys)")
        heads = PrefixSource(backbone, in_folder)
        hcfg = heads_config_of(heads, cfg)
        heads_source = f"{source_of(path, folder, gguf_file)} ({in_folder}*)"
    elif hc["source"] == "init":
        heads_source = "init (seeds/001 §2.1.1: untrained, each head repeats the base next-token prediction)"
    elif hc["source"] == "shipped":
        hp, heads_source = models_dir() / hc["path"], f"shipped:{hc['path']}"
    elif hc["source"] == "hf":
        hp, heads_source = hf_cache_snapshot(hc["repo"]), hc["repo"]
    else:
        raise ValueError(f"registry entry {entry.name!r}: unknown heads source {hc['source']!r}")
    if hp is not None:
        heads, hcfg = open_heads(hp, cfg)
    elif heads is None:
        heads = ZeroHeadsSource(hc["num_heads"], hc["num_layers"], cfg.hidden_size)
        hcfg = HeadsConfig(hc["num_heads"], hc["num_layers"], cfg.hidden_size, cfg.vocab_size, False)
    source = source_of(path, folder, gguf_file)
    return LoadedMedusa(
        model=None, tokenizer=tok, eos_token_ids=eos, chat_template=template, name=entry.name,
        backbone_source=source, heads_source=heads_source, default_tree=entry.default_tree,
        max_context=entry.max_context, head_accuracies=load_accuracies(hp) if hp is not None else None,
        draft_vocab=load_draft_vocab(hp), sources=ModelSources(backbone, heads, cfg, hcfg))


def reference_config(cfg: BackboneConfig):
    """The config the PyTorch reference (``model/backbone.py``) is built from.

    Raises:
        UnsupportedModelError: a switch the reference does not implement yet (named).
    """
    from ..model import backbone as ref

    if hasattr(ref, "Backbone") or getattr(ref, "LlamaConfig", None) is BackboneConfig:
        return cfg  # the generalised reference (issue 14) takes a BackboneConfig and runs every switch
    missing = [f for f in cfg.features if f != "tied_embeddings"]
    if cfg.head_dim != cfg.hidden_size // cfg.num_attention_heads:
        missing.append(f"head_dim={cfg.head_dim}")
    if missing:
        raise UnsupportedModelError(f"the PyTorch reference (model/backbone.py) does not implement "
                                    f"{', '.join(missing)} yet, so checks against it cannot run for this "
                                    f"{cfg.model_type} model; choose --checks checksums,self (or --no-validate)")
    return ref.LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                           intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
                           num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
                           rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
                           tie_word_embeddings=cfg.tie_word_embeddings,
                           max_position_embeddings=cfg.max_position_embeddings)


def reference_model(sources: ModelSources, num_layers: int | None = None, device: str = "cpu"):
    """The fp32 PyTorch reference (``model/``) built from the sources, tensor by tensor.

    Args:
        sources: backbone and heads.
        num_layers: keep only the first N layers (validation that fits: the final norm, lm_head and
            heads are the real ones); None for the whole model.
        device: where the weights go ("cpu", or "cuda" for the check on a GPU).

    Returns:
        A :class:`~medusa_export.model.medusa.MedusaModel` in eval mode.

    Raises:
        UnsupportedModelError: the reference does not implement one of the model's switches.
        HeadsFormatError: the heads do not fit the backbone.
    """
    from ..model.medusa import MedusaModel
    from .backbone import backbone_from_state_dict
    from .heads_formats import heads_from_tensors

    cfg = sources.config if num_layers is None else sources.config.truncated(num_layers)
    ref_cfg = reference_config(cfg)
    state = {k: sources.backbone.read(k).to(device=device, dtype=torch.float32) for k in backbone_shapes(cfg)}
    backbone = backbone_from_state_dict(ref_cfg, state)
    del state
    tensors = {k: sources.heads.read(k).to(dtype=torch.float32) for k in sources.heads.keys()}
    h = sources.heads_config
    heads = heads_from_tensors(tensors, backbone.lm_head, num_heads=h.num_heads, num_layers=h.num_layers)
    return MedusaModel(backbone, heads.to(device)).eval()
