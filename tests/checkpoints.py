"""Writers of tiny checkpoints in each published layout (for the loader, registry and CLI tests).

* an HF model folder of any family (``save_pretrained`` safetensors + the tiny tokenizer);
* FasterDecoding medusa-1.0: heads inside the model folder under ``medusa_head.``, fp16
  ``pytorch_model-0000N-of-0000M.bin`` shards + ``pytorch_model.bin.index.json`` (or the
  safetensors variant), config.json with ``medusa_num_heads`` / ``medusa_num_layers``;
* the "version 2" heads-only layout (philschmid/llama-3-1-8b-instruct-medusa):
  ``medusa_lm_head.safetensors`` in bf16, one block per head, no own projection;
* NVIDIA modelopt FP8 (nvidia/Llama-3.1-8B-Medusa-FP8): every decoder Linear and every head
  tensor in float8_e4m3fn with per-tensor ``weight_scale`` (amax / 448) and ``input_scale``,
  embeddings / norms / lm_head in bf16, heads under ``medusa_heads.``, ``hf_quant_config.json``,
  config.json ``"medusa": {"num_medusa_heads", "num_medusa_layers"}``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from conftest import make_family_hf, make_tiny_tokenizer

FP8_MAX = 448.0  # float8_e4m3fn


def save_tokenizer(path: Path, chat_template: bool = True) -> None:
    tok = make_tiny_tokenizer()
    if not chat_template:
        tok.chat_template = None
    tok.save_pretrained(path)


def save_family_dir(path, family: str, *, vocab=320, seed=0, chat_template=True):
    """A tiny random ``family`` model as an HF folder (safetensors, config, generation config,
    tokenizer). Returns the transformers model."""
    path = Path(path)
    hf = make_family_hf(family, vocab=vocab, seed=seed)
    hf.save_pretrained(path, safe_serialization=True)
    save_tokenizer(path, chat_template)
    return hf


def _rounded(hf, dtype):
    """The model with its parameters rounded to ``dtype`` (kept in float32). Not ``hf.half().float()``:
    that would also round the RoPE ``inv_freq`` buffer, which no checkpoint stores."""
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.to(dtype).float())
    return hf


def random_head_tensors(d: int, v: int, num_heads=3, num_layers=1, own_projection=True, seed=5, dtype=torch.float32):
    """Heads in the FasterDecoding key layout (no prefix)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for h in range(num_heads):
        for lay in range(num_layers):
            out[f"{h}.{lay}.linear.weight"] = (torch.randn(d, d, generator=g) * 0.05).to(dtype)
            out[f"{h}.{lay}.linear.bias"] = (torch.randn(d, generator=g) * 0.05).to(dtype)
        if own_projection:
            out[f"{h}.{num_layers}.weight"] = (torch.randn(v, d, generator=g) * 0.2).to(dtype)
    return out


def _write_shards(path: Path, tensors: dict, fmt: str, shards: int) -> None:
    keys = sorted(tensors)
    parts = [keys[i::shards] for i in range(shards)]
    ext, stem = ("bin", "pytorch_model") if fmt == "bin" else ("safetensors", "model")
    weight_map = {}
    for i, part in enumerate(parts):
        name = f"{stem}-{i + 1:05d}-of-{shards:05d}.{ext}"
        chunk = {k: tensors[k].contiguous() for k in part}
        if fmt == "bin":
            torch.save(chunk, path / name)
        else:
            from safetensors.torch import save_file

            save_file(chunk, str(path / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    (path / f"{stem}.{ext}.index.json").write_text(json.dumps({"metadata": {"total_size": size},
                                                               "weight_map": weight_map}))


def write_medusa_1_0(path, family="mistral", *, num_heads=3, num_layers=1, fmt="bin", shards=2, counts=True,
                     seed=0, change=None):
    """A FasterDecoding medusa-1.0 folder: backbone + ``medusa_head.*`` in fp16 shards.

    Args:
        change: called with the full state dict before it is written (to make malformed files).

    Returns:
        (the transformers model with the fp16-rounded weights, the heads' tensors without prefix, fp16).
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hf = _rounded(make_family_hf(family, seed=seed), torch.float16)  # the values the fp16 file holds
    c = hf.config
    heads = random_head_tensors(c.hidden_size, c.vocab_size, num_heads, num_layers, dtype=torch.float16)
    state = {k: v.half() for k, v in hf.state_dict().items()}
    if c.tie_word_embeddings:
        state.pop("lm_head.weight")
    state.update({f"medusa_head.{k}": v for k, v in heads.items()})
    if change:
        change(state)
    _write_shards(path, state, fmt, shards)
    config = {**c.to_dict(), "torch_dtype": "float16"}
    if counts:
        config.update(medusa_num_heads=num_heads, medusa_num_layers=num_layers)
    (path / "config.json").write_text(json.dumps(config))
    hf.generation_config.save_pretrained(path)
    save_tokenizer(path)
    return hf, heads


def write_v2_heads(path, d: int, v: int, *, num_heads=3, change=None):
    """``medusa_lm_head.safetensors`` (bf16, 1 block, no own projection) + its version-2 config.json.
    Returns the heads' tensors (bf16)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    heads = random_head_tensors(d, v, num_heads, 1, own_projection=False, dtype=torch.bfloat16)
    written = dict(heads)
    if change:
        change(written)
    save_file(written, str(path / "medusa_lm_head.safetensors"))
    (path / "config.json").write_text(json.dumps({"base_model_name_or_path": "meta-llama/Meta-Llama-3.1-8B-Instruct",
                                                  "medusa_num_heads": num_heads, "medusa_num_layers": 1,
                                                  "transformers_version": "4.44.2", "version": "2"}))
    return heads


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """modelopt's per-tensor FP8: scale = amax / 448 (float32, shape []), weight = (w / scale) in E4M3."""
    scale = (w.abs().max().float() / FP8_MAX).reshape(())
    return (w.float() / scale).to(torch.float8_e4m3fn), scale


def write_modelopt_fp8(path, family="llama3", *, num_heads=3, seed=0, change=None):
    """A modelopt FP8 folder (backbone + ``medusa_heads.*`` with own projections) in 2 safetensors shards.

    Returns:
        (the transformers model holding the dequantized weights, the heads' dequantized float32
        tensors without prefix, the input scales written, by key).
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hf = _rounded(make_family_hf(family, seed=seed), torch.bfloat16)
    c = hf.config
    heads = random_head_tensors(c.hidden_size, c.vocab_size, num_heads, 1)
    g = torch.Generator().manual_seed(11)
    state, input_scales = {}, {}

    def put(key: str, w: torch.Tensor, quantized: bool) -> torch.Tensor:
        if not quantized:
            state[key] = w.to(torch.bfloat16)
            return state[key].float()
        q, s = quantize_fp8(w)
        stem = key.removesuffix("weight")
        state[key], state[stem + "weight_scale"] = q, s
        input_scales[stem + "input_scale"] = state[stem + "input_scale"] = torch.rand((), generator=g) + 0.01
        return q.float() * s

    with torch.no_grad():
        for key, w in hf.state_dict().items():
            linear = ".layers." in key and key.endswith("proj.weight")
            w.copy_(put(key, w, linear))  # the reference model holds exactly what the file decodes to
        dq_heads = {}
        for key, w in heads.items():
            dq_heads[key] = put(f"medusa_heads.{key}", w, key.endswith("weight"))
    if change:
        change(state)
    _write_shards(path, state, "safetensors", 2)
    config = {**c.to_dict(), "torch_dtype": "bfloat16", "medusa": {"num_medusa_heads": num_heads,
                                                                   "num_medusa_layers": 1}}
    (path / "config.json").write_text(json.dumps(config))
    (path / "hf_quant_config.json").write_text(json.dumps({
        "producer": {"name": "modelopt", "version": "0.23.0"},
        "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}}))
    hf.generation_config.save_pretrained(path)
    save_tokenizer(path)
    return hf, dq_heads, {k: float(v) for k, v in input_scales.items()}
