"""A Medusa model as tensor sources: what ``build`` exports from, without loading the model.

:func:`open_model` resolves a registered name or a path like :func:`~.registry.load_model`, but reads
only headers and configs: the backbone's ``config.json`` (or GGUF metadata) becomes a
:class:`~medusa_export.model.config.BackboneConfig`, the weights stay on disk behind a
:class:`~.checkpoint.TensorSource` checked key by key and shape by shape against it, and the heads
likewise. :func:`reference_model` builds the PyTorch reference (``model/``) from the same sources when a
check needs it, optionally truncated to its first N layers, one tensor at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from ..errors import CheckpointError, HeadsFormatError, MedusaError
from ..model.config import BackboneConfig
from ..model.heads import HeadsConfig
from . import fp8
from .accuracies import load_accuracies, load_accuracies_doc
from .architectures import backbone_config
from .checkpoint import (DictSource, PrefixSource, SafetensorsSource, TensorSource, TorchBinSource, ZeroHeadsSource,
                         backbone_shapes, check_backbone, find_weights, hf_config_dict, open_source)
from .draft_vocab import load_draft_vocab
from .heads_formats import (HEAD_FILES, HEAD_PREFIXES, HEADS_CONFIG, config_counts, config_head_counts, file_prefix,
                            heads_prefix, hydra_heads_config, stated_head_type, stated_heads_config)


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


def sources_from_model(model) -> ModelSources:
    """Sources over a :class:`~medusa_export.model.medusa.MedusaModel` already in memory (no copy)."""
    b = model.backbone
    cfg = b.config
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


def source_of(path: Path, folder: Path, gguf_file: str | None) -> str:
    """Where the backbone weights are, for manifests (the GGUF file, or the folder)."""
    return str(Path(folder) / gguf_file) if gguf_file else str(path)


def heads_config_of(src: TensorSource, cfg: BackboneConfig, num_heads: int | None = None,
                    num_layers: int | None = None, counts_from: str | None = None) -> HeadsConfig:
    """The heads' structure from their keys and header shapes (strict, nothing read).

    Args:
        src: the heads' tensors (FasterDecoding layout, no prefix).
        cfg: the backbone's config (hidden and vocab sizes).
        num_heads, num_layers, counts_from: counts a file states and which file (None: our ``heads.json``,
            checked strictly; a third party's ``config.json`` only warns): see
            :func:`~.heads_formats.stated_heads_config`.

    Raises:
        HeadsFormatError: see :func:`~.heads_formats.infer_heads_config`.
    """
    shapes = {k: torch.empty(src.info(k).shape, device="meta") for k in src.keys()}
    return stated_heads_config(shapes, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, num_heads=num_heads,
                               num_layers=num_layers, counts_from=counts_from)


def open_heads(path: Path, cfg: BackboneConfig) -> tuple[TensorSource, HeadsConfig]:
    """Heads as a source, their structure inferred from the headers' keys and shapes (strict), as
    :func:`~.heads_formats.load_heads` reads them.

    Args:
        path: a heads folder (:data:`~.heads_formats.HEAD_FILES`) or file, or a model folder whose
            checkpoint holds ``medusa_head.`` / ``medusa_heads.`` tensors.
        cfg: the backbone's config (hidden and vocab sizes).

    Raises:
        HeadsFormatError: nothing loadable at ``path``, an unreadable file, or a key / shape / count
            mismatch (see :func:`~.heads_formats.infer_heads_config`).
    """
    path = Path(path)
    if not path.exists():
        raise HeadsFormatError(f"heads file {path} does not exist")
    folder = path if path.is_dir() else path.parent
    file = next((path / n for n in HEAD_FILES if (path / n).is_file()), None) if path.is_dir() else path
    try:
        if file is not None:
            src = SafetensorsSource([file]) if file.suffix == ".safetensors" else TorchBinSource([file])
            prefix = file_prefix(src.keys())  # heads cut out of a medusa-1.0 / modelopt checkpoint keep its names
            src = PrefixSource(src, prefix) if prefix else src
        else:  # a model folder with its heads inside (medusa-1.0, modelopt)
            kind, files, weight_map = find_weights(path)
            whole = open_source(kind, files, weight_map, cfg)
            prefix = heads_prefix(whole.keys())
            if prefix is None:
                raise HeadsFormatError(f"no heads file in {path}: expected {', '.join(HEAD_FILES)} or a model folder "
                                       f"with {' / '.join(HEAD_PREFIXES)} tensors")
            src = PrefixSource(whole, prefix)
    except HeadsFormatError:
        raise
    except MedusaError as exc:  # CheckpointError, WeightsNotFoundError, UnsupportedModelError (FP8 scales)
        raise HeadsFormatError(f"cannot read heads at {file or path}: {exc}") from None
    if stated_head_type(folder) == "hydra":  # path-conditioned heads: their heads.json states the counts
        num_heads, num_layers, _ = config_counts(folder)
        if num_heads is None or num_layers is None:
            raise HeadsFormatError(f"{folder / HEADS_CONFIG}: hydra heads need num_heads and num_layers")
        shapes = {k: tuple(src.info(k).shape) for k in src.keys()}
        return src, hydra_heads_config(shapes, hidden=cfg.hidden_size, vocab=cfg.vocab_size, num_heads=num_heads,
                                       num_layers=num_layers)
    return src, heads_config_of(src, cfg, *config_counts(folder))


def open_backbone(path: Path, trust_remote_code: bool = False) -> tuple[TensorSource, BackboneConfig, dict, Path, str | None]:
    """The backbone checkpoint at ``path`` as a checked source.

    Refused before any weight is read (as :func:`~.backbone.load_backbone` refuses them): a GGUF file
    with RoPE scaling that transformers' GGUF loader would drop (its header read, not the whole file),
    and a quantization other than modelopt FP8 (``hf_quant_config.json`` / ``quantization_config``).

    Returns:
        (source, config, transformers config dict, folder, GGUF file name or None).

    Raises:
        WeightsNotFoundError, CheckpointError, UnsupportedModelError: see :mod:`.checkpoint`; the
            refusals above (named).
    """
    from .backbone import check_gguf_rope
    from .gguf_meta import read_gguf_header

    kind, files, weight_map = find_weights(Path(path))
    if kind == "gguf":
        try:
            header = read_gguf_header(files[0])
        except (MedusaError, OSError, ValueError) as exc:
            raise CheckpointError(f"{files[0]}: not a readable GGUF file (truncated?): {exc}") from None
        check_gguf_rope(header)
    hf = hf_config_dict(Path(path), kind, files, trust_remote_code)
    cfg = backbone_config(hf)
    if kind != "gguf":
        fp8.read_quant_config(files[0].parent, hf)
    src = open_source(kind, files, weight_map, cfg)
    check_backbone(src, cfg, "GGUF metadata" if kind == "gguf" else "config.json")
    return src, cfg, hf, files[0].parent, files[0].name if kind == "gguf" else None


def checkpoint_notes(source: TensorSource, folder: Path, gguf_file: str | None,
                     model_type: str) -> tuple[list[str], str | None, dict[str, float]]:
    """What an opened backbone checkpoint tells the user, as :func:`~.backbone.load_backbone` says it.

    Returns:
        (notes: GGUF limits or the FP8 note; quantization: :func:`~.fp8.describe` of a modelopt FP8
        checkpoint, else None; kept_scales: its scales dequantization does not apply, by key).

    Raises:
        UnsupportedModelError: an FP8 activation / KV scale that is not per tensor.
    """
    from .backbone import gguf_notes
    from .gguf_meta import read_gguf_header

    if gguf_file:
        return gguf_notes(read_gguf_header(Path(folder) / gguf_file), model_type), None, {}
    if not isinstance(source, SafetensorsSource) or not source.fp8_weights:
        return [], None, {}
    return [fp8.TENSORRT_FP8_NOTE], fp8.describe(source.fp8_weights), source.kept_scales()


#: Tokenizer files transformers reads from a model folder (fast JSON, SentencePiece, byte-level BPE, tiktoken).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer.tiktoken")


def tokenizer_and_eos(folder: Path, gguf_file: str | None, hf: dict, trust_remote_code: bool = False):
    """(tokenizer, EOS ids): the tokenizer beside the weights (or in the GGUF) and the generation config's EOS.

    The generation config comes first, as for a loaded model (:func:`~.backbone.eos_ids`): with
    transformers 4.57 a GGUF tokenizer reports the wrong EOS.

    Raises:
        CheckpointError: the folder has none of :data:`TOKENIZER_FILES` (and no GGUF), or transformers cannot
            read the tokenizer (its message quoted).
    """
    from transformers import AutoTokenizer, GenerationConfig, PretrainedConfig

    from .backbone import eos_ids
    from .checkpoint import quiet_transformers

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    if not gguf_file and not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise CheckpointError(f"{folder} has no tokenizer: expected one of {', '.join(TOKENIZER_FILES)} beside "
                              "config.json (copy them from the model's repository)")
    with quiet_transformers():
        try:
            tok = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=trust_remote_code, **kwargs)
        except (OSError, ValueError, TypeError, AttributeError, KeyError) as exc:
            raise CheckpointError(f"the tokenizer in {folder} cannot be read ({type(exc).__name__}: {exc})") from None
        if not gguf_file and (folder / "generation_config.json").is_file():
            gen = GenerationConfig.from_pretrained(str(folder))
        else:
            gen = GenerationConfig.from_model_config(PretrainedConfig.from_dict(hf))
    return tok, eos_ids(SimpleNamespace(generation_config=gen), tok)


def open_model(model: str, *, model_path: str | None = None, heads_path: str | None = None,
               trust_remote_code: bool = False):
    """A registered model (or a path) as sources: configs, tokenizer and checked headers, no weights loaded.

    Same arguments and resolution as :func:`~.registry.load_model`; the result's ``model`` is None and
    its ``sources`` are set (:func:`reference_model` builds the reference from them when needed).

    Raises:
        UnknownModelError, WeightsNotFoundError, CheckpointError, UnsupportedModelError, HeadsFormatError.
    """
    from .registry import LoadedMedusa, choose_heads, entry_template, model_notes, resolve_model

    entry, path = resolve_model(model, model_path)
    backbone, cfg, hf, folder, gguf_file = open_backbone(path, trust_remote_code)
    tok, eos = tokenizer_and_eos(folder, gguf_file, hf, trust_remote_code)
    template = entry_template(entry)
    if template:
        tok.chat_template = template
    template = template or getattr(tok, "chat_template", None)
    source = source_of(path, folder, gguf_file)
    choice = choose_heads(entry, heads_path, embedded_prefix=heads_prefix(backbone.keys()), backbone_source=source)
    if choice.kind == "backbone":
        heads = PrefixSource(backbone, choice.prefix)
        hcfg = heads_config_of(heads, cfg, *config_head_counts(hf), f"{Path(folder) / 'config.json'}")
    elif choice.kind == "init":
        hc = entry.heads
        heads = ZeroHeadsSource(hc["num_heads"], hc["num_layers"], cfg.hidden_size)
        hcfg = HeadsConfig(hc["num_heads"], hc["num_layers"], cfg.hidden_size, cfg.vocab_size, False)
    else:
        heads, hcfg = open_heads(choice.path, cfg)
    notes, quantization, kept = checkpoint_notes(backbone, folder, gguf_file, cfg.model_type)
    hp = choice.path
    return LoadedMedusa(
        model=None, tokenizer=tok, eos_token_ids=eos, chat_template=template, name=entry.name,
        backbone_source=source, heads_source=choice.description, default_tree=entry.default_tree,
        max_context=entry.max_context, head_accuracies=load_accuracies(hp) if hp is not None else None,
        accuracies_doc=load_accuracies_doc(hp) if hp is not None else None,
        draft_vocab=load_draft_vocab(hp), quantization=quantization, kept_scales=kept,
        notes=model_notes(notes, template), sources=ModelSources(backbone, heads, cfg, hcfg))


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
        HeadsFormatError: the heads do not fit the backbone.
    """
    from ..model.medusa import MedusaModel
    from .backbone import backbone_from_state_dict
    from .heads_formats import heads_from_tensors, hydra_heads_from_tensors

    cfg = sources.config if num_layers is None else sources.config.truncated(num_layers)
    state = {k: sources.backbone.read(k).to(device=device, dtype=torch.float32) for k in backbone_shapes(cfg)}
    backbone = backbone_from_state_dict(cfg, state)
    del state
    tensors = {k: sources.heads.read(k).to(dtype=torch.float32) for k in sources.heads.keys()}
    h = sources.heads_config
    if h.head_type == "hydra":
        heads = hydra_heads_from_tensors(tensors, backbone.lm_head, backbone.embed_tokens, num_heads=h.num_heads,
                                         num_layers=h.num_layers)
    else:
        heads = heads_from_tensors(tensors, backbone.lm_head, num_heads=h.num_heads, num_layers=h.num_layers)
    return MedusaModel(backbone, heads.to(device)).eval()
