#!/usr/bin/env python
"""A random-weight checkpoint of a named shape, in the real on-disk formats, written tensor by tensor.

    python scripts/make_random_checkpoint.py vicuna-7b /work/scratch/vicuna-7b        # 13.5 GB + 1.5 GB heads
    python scripts/make_random_checkpoint.py tiny /tmp/tiny --family qwen3 --heads 3
    python scripts/make_random_checkpoint.py llama-3.2-1b /tmp/l1b --set rope_scaling=null --set num_hidden_layers=4

What is written (the formats of a Hugging Face model repo and of FasterDecoding's Medusa heads):

* ``OUT/config.json`` (the family's transformers config fields, ``torch_dtype``), ``generation_config.json``;
* ``OUT/model-0000i-of-0000N.safetensors`` + ``model.safetensors.index.json`` (``metadata.total_size``: the
  tensors' bytes, ``weight_map`` sorted by name), tensors in the module order transformers' ``save_pretrained``
  writes them, split as ``huggingface_hub.split_torch_state_dict_into_shards`` does (a new shard when the next
  tensor would overflow the limit; a tensor above the limit alone). The limit is ``--shard-size``, by default
  HF's 5 GB, but at most half the model so that small checkpoints still have >= 2 shards. A plan of one shard
  is written as HF writes it: ``model.safetensors`` and no index;
* ``OUT/tokenizer.json`` + ``tokenizer_config.json`` (+ ``special_tokens_map.json``): a byte-level BPE built
  offline with the ``tokenizers`` library: the family's special tokens at their real ids, the 256 byte tokens,
  filler tokens ``<|filler_ID|>`` up to the tokenizer size (= the vocab size, except Qwen's, whose embedding is
  padded beyond the tokenizer as in the real checkpoints), and a chat template in the family's style
  (Vicuna, Mistral [INST], Llama 3 headers, ChatML);
* Medusa heads, ``--heads-layout``:
  ``fasterdecoding`` (default): ``medusa_lm_head.safetensors`` + ``config.json`` (``medusa_num_heads``,
  ``medusa_num_layers``, ``base_model_name_or_path`` = OUT) in the sibling folder ``OUT-heads`` (or
  ``--heads-out``), keys ``{h}.{l}.linear.weight|bias`` and ``{h}.{L}.weight`` (the head's own [V, d]
  projection; ``--head-projection shared`` leaves it out, the "legacy v2" layout that uses the backbone's
  lm_head); ``medusa-1.0``: the same tensors inside the model shards with the prefix ``medusa_head.`` and
  ``medusa_num_heads`` / ``medusa_num_layers`` in the model's config.json (FasterDecoding's medusa-1.0 repos
  on the Hugging Face Hub, e.g. ``FasterDecoding/medusa-1.0-vicuna-7b-v1.5``); ``none``: no heads;
* ``OUT/random_checkpoint.json``: how the folder was made (shape, seed, dtype, parameter counts).

Values: weights ~ N(0, 0.02²), norm weights 1 + N(0, 0.02²), biases N(0, 0.02²): activations stay finite in
fp16 through any depth. Deterministic per ``--seed``: each tensor has its own generator, seeded from the seed
and the tensor's name, so a tensor's values do not depend on the shard plan, the layout or the other tensors.

Memory: safetensors' own ``save_file`` needs every tensor of a file in memory at once, so the files are
written by the streaming writer below (the format: an 8-byte little-endian header length, a JSON header
padded with spaces to 8 bytes, then the raw little-endian data in header order; the header is known before
any value is drawn, since shapes come from the config). Each tensor is drawn and written in chunks of at
most ``CHUNK_ELEMENTS`` values into buffers allocated once (:class:`ChunkBuffers`, 64 MiB), so the peak
resident memory is the interpreter + torch + those buffers (~0.3 GB) whatever the shape. Everything is
written into ``.NAME.partial-PID`` folders beside the outputs and renamed into place at the end: an
interrupted run leaves no half-written checkpoint.

Real shapes (transformers' config fields of the public checkpoints; their dtype is the default ``--dtype``):
vicuna-7b (lmsys/vicuna-7b-v1.3 = Llama 7B, 5 heads as FasterDecoding/medusa-vicuna-7b-v1.3, whose own file is
bf16: pass ``--heads-dtype bf16`` to match it), llama-2-13b, llama-3.2-1b, llama-3.2-3b (rope_scaling llama3,
GQA, tied), llama-3.1-8b, mistral-7b (v0.1, sliding window 4096), qwen2.5-0.5b (q/k/v biases, tied),
qwen3-0.6b (q/k norms, head_dim 128 != d/H, tied). Test shapes, any ``--family``: tiny (d 64, 2 layers),
small (~100 MB fp16 without heads), medium (~500 MB fp16 without heads).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shutil
import struct
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from medusa_export.errors import MedusaError
from medusa_export.model.families import FAMILIES as FAMILY_TABLE

# torch (imported when values are drawn) reads this when its OpenMP threads start: spinning threads made each
# chunk's mul/cast ~10x slower whenever the 2 cores here were shared (small: 6.5 s instead of 3.7 s at load 8).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

STD = 0.02
#: values drawn and written per step (32 MiB of fp32): the writer's working memory is ~2 chunks.
CHUNK_ELEMENTS = 8 * 2**20
HF_SHARD_BYTES = 5 * 10**9  # transformers' save_pretrained default max_shard_size="5GB" (decimal)
HEADS_FILE = "medusa_lm_head.safetensors"
INFO_FILE = "random_checkpoint.json"
#: --dtype -> (safetensors dtype, torch / config.json name, bytes per value)
DTYPES = {"fp16": ("F16", "float16", 2), "bf16": ("BF16", "bfloat16", 2), "fp32": ("F32", "float32", 4)}
#: the families a test shape can take (medusa_export.model.families.FAMILIES: model_type -> Family).
FAMILIES = tuple(FAMILY_TABLE)
LAYOUTS = ("fasterdecoding", "medusa-1.0", "none")
#: ``transformers_version`` written into the json files: fixed, so that the files do not depend on what is
#: installed, and not 4.57.3-4.57.x, for which transformers 4.57.6 warns "incorrect regex pattern" about any
#: local tokenizer (tokenization_utils_base.py, the fix_mistral_regex check).
WRITER_VERSION = "4.45.0"


class CheckpointSpecError(MedusaError, ValueError):
    """A shape, family, override or output folder this script cannot make; the message names the choices."""


# ---------------------------------------------------------------------------------------------------------
# Shapes

_LLAMA3_ROPE = {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192, "rope_type": "llama3"}

#: name -> config fields + "family", "dtype", "heads" (default K), "style" (tokenizer), "tokenizer_size".
#: Sources: each model's public config.json on the Hugging Face Hub (lmsys/vicuna-7b-v1.3, meta-llama/Llama-2-13b-hf,
#: meta-llama/Llama-3.2-1B, -3.2-3B, -3.1-8B, mistralai/Mistral-7B-v0.1, Qwen/Qwen2.5-0.5B, Qwen/Qwen3-0.6B).
SHAPES: dict[str, dict] = {
    "vicuna-7b": dict(family="llama", dtype="fp16", heads=5, style="vicuna", hidden_size=4096, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=32, intermediate_size=11008, vocab_size=32000,
                      rms_norm_eps=1e-6, max_position_embeddings=2048, rope_theta=10000.0, tie_word_embeddings=False),
    "llama-2-13b": dict(family="llama", dtype="fp16", heads=5, style="vicuna", hidden_size=5120, num_hidden_layers=40,
                        num_attention_heads=40, num_key_value_heads=40, intermediate_size=13824, vocab_size=32000,
                        rms_norm_eps=1e-5, max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=False),
    "llama-3.2-1b": dict(family="llama", dtype="bf16", heads=4, style="llama3", hidden_size=2048, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, intermediate_size=8192,
                         vocab_size=128256, rms_norm_eps=1e-5, max_position_embeddings=131072, rope_theta=500000.0,
                         rope_scaling=_LLAMA3_ROPE, tie_word_embeddings=True),
    "llama-3.2-3b": dict(family="llama", dtype="bf16", heads=4, style="llama3", hidden_size=3072, num_hidden_layers=28,
                         num_attention_heads=24, num_key_value_heads=8, head_dim=128, intermediate_size=8192,
                         vocab_size=128256, rms_norm_eps=1e-5, max_position_embeddings=131072, rope_theta=500000.0,
                         rope_scaling=_LLAMA3_ROPE, tie_word_embeddings=True),
    "llama-3.1-8b": dict(family="llama", dtype="bf16", heads=4, style="llama3", hidden_size=4096, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=14336,
                         vocab_size=128256, rms_norm_eps=1e-5, max_position_embeddings=131072, rope_theta=500000.0,
                         rope_scaling={**_LLAMA3_ROPE, "factor": 8.0}, tie_word_embeddings=False),
    "mistral-7b": dict(family="mistral", dtype="bf16", heads=4, style="mistral", hidden_size=4096, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336, vocab_size=32000,
                       rms_norm_eps=1e-5, max_position_embeddings=32768, rope_theta=10000.0, sliding_window=4096,
                       tie_word_embeddings=False),
    "qwen2.5-0.5b": dict(family="qwen2", dtype="bf16", heads=4, style="chatml", tokenizer_size=151665,
                         hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864, vocab_size=151936, rms_norm_eps=1e-6, max_position_embeddings=32768,
                         rope_theta=1000000.0, use_sliding_window=False, sliding_window=32768, max_window_layers=24,
                         tie_word_embeddings=True),
    "qwen3-0.6b": dict(family="qwen3", dtype="bf16", heads=4, style="chatml", tokenizer_size=151669,
                       hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, intermediate_size=3072, vocab_size=151936, rms_norm_eps=1e-6,
                       max_position_embeddings=40960, rope_theta=1000000.0, attention_bias=False,
                       use_sliding_window=False, sliding_window=None, max_window_layers=28, tie_word_embeddings=True),
}

#: test shapes: dimensions only; the family (``--family``, default llama) adds its own fields.
TEST_SHAPES: dict[str, dict] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=512, max_position_embeddings=2048),
    "small": dict(hidden_size=512, num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=4,
                  intermediate_size=1408, vocab_size=16384, max_position_embeddings=2048),
    "medium": dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
                   intermediate_size=2816, vocab_size=32000, max_position_embeddings=4096),
}
_HF_IDS = {"vicuna-7b": "lmsys/vicuna-7b-v1.3", "llama-2-13b": "meta-llama/Llama-2-13b-hf",
           "llama-3.2-1b": "meta-llama/Llama-3.2-1B-Instruct", "llama-3.2-3b": "meta-llama/Llama-3.2-3B-Instruct",
           "llama-3.1-8b": "meta-llama/Llama-3.1-8B-Instruct", "mistral-7b": "mistralai/Mistral-7B-v0.1",
           "qwen2.5-0.5b": "Qwen/Qwen2.5-0.5B-Instruct", "qwen3-0.6b": "Qwen/Qwen3-0.6B"}


def shape_names() -> list[str]:
    """Every shape this script makes: the real ones, then the test ones."""
    return [*SHAPES, *TEST_SHAPES]


def parse_override(text: str) -> tuple[str, object]:
    """``KEY=JSON`` (``num_hidden_layers=4``, ``rope_scaling=null``; a bare word is a string).

    Raises:
        CheckpointSpecError: no ``=``.
    """
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise CheckpointSpecError(f"--set expects KEY=VALUE (a JSON value), got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def shape_config(shape: str, family: str | None = None, dtype: str | None = None,
                 overrides: dict | None = None) -> dict:
    """The config.json (a dict) of a named shape.

    Args:
        shape: a name of :func:`shape_names`.
        family: llama | mistral | qwen2 | qwen3: required choice for a test shape (default llama); for a real
            shape it must be the shape's own family (or None).
        dtype: fp16 | bf16 | fp32 (default: the real checkpoint's, fp16 for test shapes).
        overrides: config fields to set after the shape's (``--set``); the tensors follow the final config.

    Returns:
        The config.json fields, plus the private keys ``_family``, ``_dtype``, ``_heads``, ``_style`` and
        ``_tokenizer_size`` (removed before writing).

    Raises:
        CheckpointSpecError: an unknown shape, family or dtype, or a family that contradicts a real shape.
    """
    if shape in SHAPES:
        spec = dict(SHAPES[shape])
        if family not in (None, spec["family"]):
            raise CheckpointSpecError(f"shape {shape!r} is a {spec['family']} model; --family {family} applies "
                                      f"to the test shapes ({', '.join(TEST_SHAPES)}) only")
    elif shape in TEST_SHAPES:
        family = family or "llama"
        if family not in FAMILY_TABLE:
            raise CheckpointSpecError(f"unknown family {family!r}; choose one of {', '.join(FAMILY_TABLE)}")
        fam = FAMILY_TABLE[family]
        spec = dict(TEST_SHAPES[shape], family=family, dtype="fp16", heads=4, style=fam.chat_style,
                    **fam.test_shape_defaults)
        if fam.window == "layer_types":  # the window off, as the real configs write it
            spec["max_window_layers"] = spec["num_hidden_layers"]
        if fam.explicit_head_dim:
            spec["head_dim"] = spec["hidden_size"] // spec["num_attention_heads"]
    else:
        raise CheckpointSpecError(f"unknown shape {shape!r}; choose one of {', '.join(shape_names())}")
    dtype = dtype or spec["dtype"]
    if dtype not in DTYPES:
        raise CheckpointSpecError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    fam = spec.pop("family")
    private = {"_family": fam, "_dtype": dtype, "_heads": spec.pop("heads"), "_style": spec.pop("style"),
               "_tokenizer_size": spec.pop("tokenizer_size", None)}
    spec.pop("dtype")
    cfg = _config_json(fam, spec, dtype)
    for key, value in (overrides or {}).items():
        cfg[key] = value
    private["_tokenizer_size"] = min(private["_tokenizer_size"] or cfg["vocab_size"], cfg["vocab_size"])
    return {**cfg, **private}


def _config_json(family: str, spec: dict, dtype: str) -> dict:
    """The family's config.json fields around the shape's (what the real files hold, in their order)."""
    fam = FAMILY_TABLE[family]
    cfg: dict = {"architectures": [fam.hf_class], "attention_dropout": 0.0, "hidden_act": "silu",
                 "initializer_range": 0.02, "model_type": family, **fam.config_fields}
    cfg.update(spec)
    cfg.update(torch_dtype=DTYPES[dtype][1], transformers_version=WRITER_VERSION, use_cache=True)
    return dict(sorted(cfg.items()))


# ---------------------------------------------------------------------------------------------------------
# Tensors


@dataclass(frozen=True)
class TensorSpec:
    """One tensor to write: its name, shape and how its values are drawn (``normal``, ``norm``, ``bias``)."""

    name: str
    shape: tuple[int, ...]
    kind: str = "normal"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def model_tensors(cfg: dict) -> list[TensorSpec]:
    """The backbone's tensors in the order ``save_pretrained`` writes them (module registration order).

    Shapes follow transformers 4.57 ``modeling_{llama,mistral,qwen2,qwen3}.py``: q_proj [H*hd, d],
    k/v_proj [Hkv*hd, d], o_proj [d, H*hd], gate/up [I, d], down [d, I]; the biases and q_norm/k_norm [hd]
    the family's switches turn on (``Family.switches``: Qwen2 q/k/v biases; ``attention_bias`` q/k/v/o biases;
    Qwen3 q/k norms); ``lm_head`` only when untied.
    """
    d, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    hd = cfg.get("head_dim") or d // heads
    switches = FAMILY_TABLE[cfg["model_type"]].switches(cfg)
    qkv_bias, o_bias, mlp_bias = switches["qkv_bias"], switches["o_bias"], switches["mlp_bias"]
    out = [TensorSpec("model.embed_tokens.weight", (vocab, d))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        for name, rows in (("q_proj", heads * hd), ("k_proj", kv * hd), ("v_proj", kv * hd)):
            out.append(TensorSpec(f"{p}.self_attn.{name}.weight", (rows, d)))
            if qkv_bias:
                out.append(TensorSpec(f"{p}.self_attn.{name}.bias", (rows,), "bias"))
        out.append(TensorSpec(f"{p}.self_attn.o_proj.weight", (d, heads * hd)))
        if o_bias:
            out.append(TensorSpec(f"{p}.self_attn.o_proj.bias", (d,), "bias"))
        if switches["qk_norm"]:
            out += [TensorSpec(f"{p}.self_attn.q_norm.weight", (hd,), "norm"),
                    TensorSpec(f"{p}.self_attn.k_norm.weight", (hd,), "norm")]
        for name, shape in (("gate_proj", (inter, d)), ("up_proj", (inter, d)), ("down_proj", (d, inter))):
            out.append(TensorSpec(f"{p}.mlp.{name}.weight", shape))
            if mlp_bias:
                out.append(TensorSpec(f"{p}.mlp.{name}.bias", (shape[0],), "bias"))
        out += [TensorSpec(f"{p}.input_layernorm.weight", (d,), "norm"),
                TensorSpec(f"{p}.post_attention_layernorm.weight", (d,), "norm")]
    out.append(TensorSpec("model.norm.weight", (d,), "norm"))
    if not cfg.get("tie_word_embeddings", False):
        out.append(TensorSpec("lm_head.weight", (vocab, d)))
    return out


def head_tensors(num_heads: int, num_layers: int, hidden: int, vocab: int, *, own_projection: bool = True,
                 prefix: str = "") -> list[TensorSpec]:
    """Medusa heads in FasterDecoding's key layout (Medusa ``medusa_model.py``: ``[ResBlock(d)] * L`` then
    ``nn.Linear(d, V, bias=False)``): ``{h}.{l}.linear.weight`` [d, d], ``.bias`` [d], ``{h}.{L}.weight`` [V, d].

    Raises:
        CheckpointSpecError: fewer than one head or one block.
    """
    if num_heads < 1 or num_layers < 1:
        raise CheckpointSpecError(f"heads need >= 1 head and >= 1 block, got {num_heads} heads x {num_layers} blocks")
    out = []
    for h in range(num_heads):
        for lay in range(num_layers):
            out += [TensorSpec(f"{prefix}{h}.{lay}.linear.weight", (hidden, hidden)),
                    TensorSpec(f"{prefix}{h}.{lay}.linear.bias", (hidden,), "bias")]
        if own_projection:
            out.append(TensorSpec(f"{prefix}{h}.{num_layers}.weight", (vocab, hidden)))
    return out


def tensor_seed(seed: int, name: str) -> int:
    """The generator seed of one tensor: the first 8 bytes of sha256(seed, name), < 2**63."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class ChunkBuffers:
    """The writer's memory, allocated once: a float32 draw buffer and two output buffers used in turn (one is
    written to the file while the next chunk is drawn into the other). Nothing is allocated per chunk, so the
    allocator's heap does not grow with the number of chunks (with a fresh tensor per chunk, glibc kept ~140 MB
    more resident while one 128M-value tensor was written)."""

    def __init__(self, dtype: str):
        import torch

        tdtype = getattr(torch, DTYPES[dtype][1])
        self.f32 = None if tdtype == torch.float32 else torch.empty(CHUNK_ELEMENTS, dtype=torch.float32)
        self.outs = [torch.empty(CHUNK_ELEMENTS, dtype=tdtype) for _ in range(2)]
        self.turn = 0

    def next_out(self):
        """The output buffer not handed out last time."""
        self.turn ^= 1
        return self.outs[self.turn]


def tensor_chunks(spec: TensorSpec, seed: int, dtype: str, buffers: ChunkBuffers | None = None):
    """Yield the tensor's values, flat, in chunks of at most ``CHUNK_ELEMENTS`` (torch tensors of ``dtype``:
    fp16 | bf16 | fp32).

    ``normal``: N(0, STD²); ``norm``: 1 + N(0, STD²); ``bias``: N(0, STD²). Drawn in float32 by a generator
    seeded with :func:`tensor_seed`, then cast: the same values for a given seed and name every time.

    Args:
        buffers: when given, each chunk is a view of one of its output buffers, valid until the chunk after
            next is drawn (the writer's way); else each chunk is a fresh tensor.
    """
    import torch

    tdtype = getattr(torch, DTYPES[dtype][1])
    gen = torch.Generator().manual_seed(tensor_seed(seed, spec.name))
    left = spec.numel
    while left:
        n = min(left, CHUNK_ELEMENTS)
        if buffers is None:
            out = None
            draw = torch.randn(n, generator=gen, dtype=torch.float32)
        else:
            out = buffers.next_out()[:n]
            draw = torch.randn(n, generator=gen, out=out if buffers.f32 is None else buffers.f32[:n])
        draw.mul_(STD)
        if spec.kind == "norm":
            draw.add_(1.0)
        if out is None:
            out = draw.to(tdtype)
        elif buffers.f32 is not None:
            out.copy_(draw)
        del draw
        yield out
        del out
        left -= n


def tensor_values(spec: TensorSpec, seed: int, dtype: str):
    """The whole tensor (for tests and small tensors): the chunks of :func:`tensor_chunks`, reshaped."""
    import torch

    return torch.cat(list(tensor_chunks(spec, seed, dtype))).reshape(spec.shape)


# ---------------------------------------------------------------------------------------------------------
# Files


def safetensors_header(specs: list[TensorSpec], dtype_name: str, itemsize: int,
                       metadata: dict | None = None) -> bytes:
    """The 8-byte length + JSON header of a safetensors file holding ``specs`` in this order.

    Format (github.com/huggingface/safetensors README): u64 little-endian N, then N bytes of JSON
    ``{"__metadata__": {...}, NAME: {"dtype", "shape", "data_offsets": [begin, end]}}`` (offsets relative to
    the end of the header), padded with spaces so that the data starts 8-byte aligned; then the data.
    """
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for s in specs:
        nbytes = s.numel * itemsize
        header[s.name] = {"dtype": dtype_name, "shape": list(s.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_safetensors(path: Path, specs: list[TensorSpec], dtype: str, seed: int, progress=None) -> int:
    """Stream ``specs`` into one safetensors file, one chunk at a time.

    Args:
        path: the file to write.
        specs: the tensors, in file order.
        dtype: fp16 | bf16 | fp32 (every tensor).
        seed: the checkpoint's seed (:func:`tensor_seed`).
        progress: a tqdm bar updated with bytes written, or None.

    Returns:
        The file size in bytes.
    """
    import torch

    name, _, itemsize = DTYPES[dtype]
    view = {2: torch.int16, 4: torch.int32}[itemsize]  # numpy has no bfloat16: write the raw bits
    buffers = ChunkBuffers(dtype)
    with open(path, "wb") as f, ThreadPoolExecutor(1) as writer:
        f.write(safetensors_header(specs, name, itemsize))
        pending = None
        for s in specs:
            for chunk in tensor_chunks(s, seed, dtype, buffers):
                if pending is not None:
                    pending.result()
                # the next chunk is drawn while this one is written (both release the GIL): one chunk in flight.
                # Native byte order: little-endian on every platform torch supports.
                pending = writer.submit(f.write, chunk.view(view).numpy())
                if progress is not None:
                    progress.update(chunk.numel() * itemsize)
        if pending is not None:
            pending.result()
    return path.stat().st_size


def plan_shards(specs: list[TensorSpec], itemsize: int, max_bytes: int) -> list[list[TensorSpec]]:
    """Split tensors into shards the way ``huggingface_hub.split_torch_state_dict_into_shards`` does.

    In order: a tensor larger than ``max_bytes`` gets a shard of its own; otherwise a new shard starts when
    the tensor would push the current one over ``max_bytes``.
    """
    shards: list[list[TensorSpec]] = []
    current: list[TensorSpec] = []
    size = 0
    for s in specs:
        nbytes = s.numel * itemsize
        if nbytes > max_bytes:
            shards.append([s])
            continue
        if current and size + nbytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(s)
        size += nbytes
    if current:
        shards.append(current)
    return shards


def parse_size(text: str) -> int:
    """``5GB`` / ``500MB`` / ``2GiB`` / a byte count -> bytes (decimal units as HF's ``max_shard_size``).

    Raises:
        CheckpointSpecError: not a size.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise CheckpointSpecError(f"not a size: {text!r} (e.g. 5GB, 500MB, 2GiB or a byte count)")
    unit = (m[2] or "B").upper()
    scale = 1 if unit == "B" else (1024 if "I" in unit else 1000) ** ("KMGT".index(unit[0]) + 1)
    return int(float(m[1]) * scale)


def default_shard_bytes(total_bytes: int) -> int:
    """HF's 5 GB, but at most half the model (rounded up): a small model still gets >= 2 shards."""
    return min(HF_SHARD_BYTES, max(1, -(-total_bytes // 2)))


# ---------------------------------------------------------------------------------------------------------
# Tokenizer

_TEMPLATES = {
    "vicuna": ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + ' ' }}"
               "{% set loop_messages = messages[1:] %}{% else %}{{ 'A chat between a curious user and an artificial "
               "intelligence assistant. The assistant gives helpful, detailed, and polite answers to the user\\'s "
               "questions. ' }}{% set loop_messages = messages %}{% endif %}{% for message in loop_messages %}"
               "{% if message['role'] == 'user' %}{{ 'USER: ' + message['content'] + ' ' }}{% else %}"
               "{{ 'ASSISTANT: ' + message['content'] + eos_token }}{% endif %}{% endfor %}"
               "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"),
    "mistral": ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
                "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
                "{{ message['content'] + eos_token }}{% endif %}{% endfor %}"),
    "llama3": ("{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
               "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"),
    "chatml": ("{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
               "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
               "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"),
}


def special_tokens(style: str, vocab_size: int) -> dict[str, object]:
    """The family's special tokens and their ids, plus bos / eos (ids, eos a list when several end a turn).

    Real ids for the real vocab sizes: Llama 2 / Mistral ``<unk>`` 0, ``<s>`` 1, ``</s>`` 2; Llama 3
    ``<|begin_of_text|>`` 128000 ... ``<|eot_id|>`` 128009 and reserved tokens up to 128255; Qwen
    ``<|endoftext|>`` 151643, ``<|im_start|>`` 151644, ``<|im_end|>`` 151645. For a smaller vocab the same
    block sits at the end of the vocabulary (Llama 3: 16 ids instead of 256; Qwen: 32 ids before the end).

    Returns:
        ``{"tokens": {id: text}, "bos": id | None (what encoding prepends), "config_bos": id (config.json's
        bos_token_id: Qwen names <|endoftext|> there but never prepends it), "eos": [ids], "eos_token": text,
        "bos_token": text | None, "unk_token": text | None}``
    """
    if style in ("vicuna", "mistral"):
        return {"tokens": {0: "<unk>", 1: "<s>", 2: "</s>"}, "bos": 1, "config_bos": 1, "eos": [2], "bos_token": "<s>",
                "eos_token": "</s>", "unk_token": "<unk>"}
    if style == "llama3":
        reserved = 256 if vocab_size >= 128256 else 16
        base = vocab_size - reserved
        names = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                 "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>",
                 "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
        names += [f"<|reserved_special_token_{i}|>" for i in range(3, 3 + reserved - len(names))]
        return {"tokens": {base + i: t for i, t in enumerate(names)}, "bos": base, "config_bos": base,
                "eos": [base + 1, base + 8, base + 9],
                "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "unk_token": None}
    if style == "chatml":
        base = 151643 if vocab_size == 151936 else vocab_size - 32
        names = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        return {"tokens": {base + i: t for i, t in enumerate(names)}, "bos": None, "config_bos": base,
                "eos": [base + 2],
                "bos_token": None, "eos_token": "<|im_end|>", "unk_token": None}
    raise CheckpointSpecError(f"unknown tokenizer style {style!r}; choose one of {', '.join(_TEMPLATES)}")


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character map, indexed by byte value (openai/gpt-2 ``encoder.py``)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


def make_tokenizer(style: str, vocab_size: int, tokenizer_size: int, max_length: int):
    """A byte-level BPE tokenizer of ``tokenizer_size`` tokens and its tokenizer_config.json.

    Ids: the special tokens at :func:`special_tokens`' ids, the 256 byte tokens at the first free ids (byte
    order), ``<|filler_ID|>`` on every other id below ``tokenizer_size``. No merges: text encodes byte by byte,
    every id decodes. Llama-style tokenizers add bos when encoding (a TemplateProcessing post-processor, as the
    real tokenizer.json files do); the chat templates write it themselves.

    Returns:
        (``tokenizers.Tokenizer``, tokenizer_config dict, special_tokens_map dict).

    Raises:
        CheckpointSpecError: the vocabulary cannot hold the special and byte tokens.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    sp = special_tokens(style, vocab_size)
    specials: dict[int, str] = {i: t for i, t in sp["tokens"].items() if i < tokenizer_size}
    if len(specials) != len(sp["tokens"]) or tokenizer_size < len(specials) + 256:
        raise CheckpointSpecError(f"a vocabulary of {tokenizer_size} tokens cannot hold the {len(sp['tokens'])} "
                                  f"special tokens of style {style!r} and 256 byte tokens")
    byte_chars = iter(_bytes_to_unicode())
    vocab: dict[str, int] = {}
    for i in range(tokenizer_size):
        if i in specials:
            vocab[specials[i]] = i
        else:
            vocab[next(byte_chars, None) or f"<|filler_{i}|>"] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials.values()])
    if sp["bos"] is not None and style != "chatml":
        bos = sp["bos_token"]
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, sp["bos"])])
    tcfg = {
        "add_bos_token": sp["bos"] is not None and style != "chatml",
        "add_eos_token": False,
        "added_tokens_decoder": {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": True} for i, t in sorted(specials.items())},
        "bos_token": sp["bos_token"],
        "chat_template": _TEMPLATES[style],
        "clean_up_tokenization_spaces": False,
        "eos_token": sp["eos_token"],
        "model_max_length": max_length,
        "pad_token": None,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": sp["unk_token"],
    }
    smap = {k: tcfg[k] for k in ("bos_token", "eos_token", "unk_token") if tcfg[k] is not None}
    return tok, tcfg, smap


# ---------------------------------------------------------------------------------------------------------
# The checkpoint


def _partial(path: Path) -> Path:
    return path.parent / f".{path.name}.partial-{os.getpid()}"


def _check_out(path: Path, force: bool) -> None:
    if path.exists() and not force and (not path.is_dir() or any(path.iterdir())):
        raise CheckpointSpecError(f"{path} exists and is not empty; pass --force to replace it")


def make_checkpoint(shape: str, out: str | Path, *, dtype: str | None = None, family: str | None = None,
                    heads: int | None = None, head_layers: int = 1, head_projection: str = "own",
                    heads_layout: str = "fasterdecoding", heads_out: str | Path | None = None,
                    heads_dtype: str | None = None, heads_config_count: int | None = None, seed: int = 0,
                    shard_size: int | None = None,
                    overrides: dict | None = None, force: bool = False, progress: bool = True) -> dict:
    """Write a random-weight checkpoint (and its heads) of ``shape``; see the module docstring for the files.

    Args:
        shape: a name of :func:`shape_names`.
        out: the model folder to create.
        dtype: fp16 | bf16 | fp32 (default: the real checkpoint's dtype; fp16 for test shapes).
        family: the family of a test shape (llama, mistral, qwen2, qwen3).
        heads: number of Medusa heads K (default: the shape's, 5 for vicuna-7b / llama-2-13b, else 4).
        head_layers: residual blocks per head L.
        head_projection: ``own`` (each head has its own [V, d] projection) or ``shared`` (the backbone's lm_head).
        heads_layout: ``fasterdecoding`` (a heads folder), ``medusa-1.0`` (inside the shards) or ``none``.
        heads_out: the heads folder (default: ``OUT-heads`` beside ``out``).
        heads_dtype: dtype of the heads file (default: ``dtype``).
        heads_config_count: the ``medusa_num_heads`` written in the heads' config.json (default: the real
            count ``heads``). FasterDecoding's medusa-vicuna-7b-v1.3 says 2 for its 5 heads (Medusa
            ``medusa_model.py``: "TODO: fix the uploaded config (only include 2 heads)"): 2 reproduces it.
        seed: the seed of every tensor's generator.
        shard_size: max bytes per shard (default :func:`default_shard_bytes`).
        overrides: config.json fields set after the shape's (the tensors follow them).
        force: replace existing output folders.
        progress: a tqdm bar (bytes written, GB/s) on stderr.

    Returns:
        What :data:`INFO_FILE` holds: shape, seed, dtypes, file names and sizes, parameter counts, paths.

    Raises:
        CheckpointSpecError: an unknown choice, an output folder that exists (without ``force``), or a
            vocabulary too small for the tokenizer.
    """
    from tqdm import tqdm

    if heads_layout not in LAYOUTS:
        raise CheckpointSpecError(f"unknown heads layout {heads_layout!r}; choose one of {', '.join(LAYOUTS)}")
    if head_projection not in ("own", "shared"):
        raise CheckpointSpecError(f"unknown head projection {head_projection!r}; choose own or shared")
    cfg = shape_config(shape, family, dtype, overrides)
    private = {k: cfg.pop(k) for k in list(cfg) if k.startswith("_")}
    dtype = private["_dtype"]
    heads_dtype = heads_dtype or dtype
    if heads_dtype not in DTYPES:
        raise CheckpointSpecError(f"unknown heads dtype {heads_dtype!r}; choose one of {', '.join(DTYPES)}")
    if heads_layout == "medusa-1.0" and heads_dtype != dtype:
        raise CheckpointSpecError("medusa-1.0 heads live in the model shards: --heads-dtype must equal --dtype")
    k = private["_heads"] if heads is None else heads
    out = Path(out).absolute()
    hout = Path(heads_out).absolute() if heads_out else out.parent / f"{out.name}-heads"
    _check_out(out, force)
    if heads_layout == "fasterdecoding":
        _check_out(hout, force)
    d, vocab = cfg["hidden_size"], cfg["vocab_size"]
    specs = model_tensors(cfg)
    hspecs = [] if heads_layout == "none" else head_tensors(
        k, head_layers, d, vocab, own_projection=head_projection == "own",
        prefix="medusa_head." if heads_layout == "medusa-1.0" else "")
    if heads_layout == "medusa-1.0":
        cfg.update(medusa_num_heads=k, medusa_num_layers=head_layers)
        specs = specs + hspecs
    itemsize, hitemsize = DTYPES[dtype][2], DTYPES[heads_dtype][2]
    total = sum(s.numel for s in specs) * itemsize
    shards = plan_shards(specs, itemsize, shard_size or default_shard_bytes(total))
    heads_bytes = sum(s.numel for s in hspecs) * hitemsize if heads_layout == "fasterdecoding" else 0

    tmp, htmp = _partial(out), _partial(hout)
    made = [tmp] + ([htmp] if heads_layout == "fasterdecoding" else [])
    for p in made:
        shutil.rmtree(p, ignore_errors=True)
        p.mkdir(parents=True)
    info = {"shape": shape, "family": private["_family"], "seed": seed, "dtype": dtype,
            "parameters": sum(s.numel for s in model_tensors(cfg)), "heads_layout": heads_layout,
            "heads": {"num_heads": k, "num_layers": head_layers, "own_projection": head_projection == "own",
                      "parameters": sum(s.numel for s in hspecs), "dtype": heads_dtype},
            "model_dir": str(out), "heads_dir": str(hout) if heads_layout == "fasterdecoding" else None,
            "files": {}, "overrides": overrides or {}}
    try:
        bar = tqdm(total=total + heads_bytes, unit="B", unit_scale=True, unit_divisor=1000, disable=not progress,
                   desc=f"{shape} {dtype}", file=sys.stderr, smoothing=0.1)
        with bar:
            weight_map = {}
            n = len(shards)
            for i, shard in enumerate(shards, 1):
                name = "model.safetensors" if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors"
                info["files"][name] = write_safetensors(tmp / name, shard, dtype, seed, bar)
                weight_map.update({s.name: name for s in shard})
            if heads_layout == "fasterdecoding":
                info["files"][f"heads/{HEADS_FILE}"] = write_safetensors(htmp / HEADS_FILE, hspecs, heads_dtype,
                                                                        seed, bar)
        if n > 1:
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        sp = special_tokens(private["_style"], vocab)
        eos = sp["eos"] if len(sp["eos"]) > 1 else sp["eos"][0]
        cfg_ids = {"bos_token_id": sp["config_bos"], "eos_token_id": eos}
        for key, value in cfg_ids.items():
            if value is not None and key not in (overrides or {}):
                cfg[key] = value
        _write_json(tmp / "config.json", dict(sorted(cfg.items())))
        gen = {"_from_model_config": True, **{k2: v for k2, v in cfg_ids.items() if v is not None},
               "transformers_version": cfg["transformers_version"]}
        if private["_style"] == "vicuna":
            gen["pad_token_id"] = 0
        _write_json(tmp / "generation_config.json", gen)
        tok, tcfg, smap = make_tokenizer(private["_style"], vocab, private["_tokenizer_size"],
                                         cfg["max_position_embeddings"])
        tok.save(str(tmp / "tokenizer.json"))
        _write_json(tmp / "tokenizer_config.json", tcfg)
        _write_json(tmp / "special_tokens_map.json", smap)
        if heads_layout == "fasterdecoding":
            said = k if heads_config_count is None else heads_config_count
            _write_json(htmp / "config.json", {"base_model_name_or_path": str(out), "medusa_num_heads": said,
                                               "medusa_num_layers": head_layers,
                                               "transformers_version": cfg["transformers_version"]})
        info["hf_id_of_shape"] = _HF_IDS.get(shape)
        info["chunk_elements"] = CHUNK_ELEMENTS
        _write_json(tmp / INFO_FILE, info)
        from medusa_export.files import replace_dir

        replace_dir(tmp, out)
        if heads_layout == "fasterdecoding":
            replace_dir(htmp, hout)
    except BaseException:
        for p in made:
            shutil.rmtree(p, ignore_errors=True)
        raise
    return info


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="shapes: " + ", ".join(shape_names()))
    p.add_argument("shape", help="a named shape (see below)")
    p.add_argument("out", help="the model folder to create")
    p.add_argument("--dtype", choices=DTYPES,
                   help="weights' dtype (default: the real checkpoint's; fp16 for test shapes)")
    p.add_argument("--family", choices=FAMILIES, help="family of a test shape (default llama)")
    p.add_argument("--heads", type=int, help="Medusa heads K (default: 5 for vicuna-7b and llama-2-13b, else 4)")
    p.add_argument("--head-layers", type=int, default=1, help="residual blocks per head (default 1)")
    p.add_argument("--head-projection", choices=("own", "shared"), default="own",
                   help="own: each head has its own [V, d] projection (FasterDecoding Medusa-1); shared: none, the "
                        "backbone's lm_head projects (the 'legacy v2' layout) (default own)")
    p.add_argument("--heads-layout", choices=LAYOUTS, default="fasterdecoding",
                   help="fasterdecoding: medusa_lm_head.safetensors + config.json in OUT-heads; medusa-1.0: inside "
                        "the model shards with the medusa_head. prefix; none (default fasterdecoding)")
    p.add_argument("--heads-out", help="heads folder for --heads-layout fasterdecoding (default: OUT-heads)")
    p.add_argument("--heads-dtype", choices=DTYPES, help="heads file dtype (default: --dtype)")
    p.add_argument("--heads-config-count", type=int, metavar="N",
                   help="medusa_num_heads written in the heads' config.json (default: --heads; FasterDecoding's "
                        "medusa-vicuna-7b-v1.3 says 2 for its 5 heads)")
    p.add_argument("--seed", type=int, default=0, help="seed of every tensor's generator (default 0)")
    p.add_argument("--shard-size", help="max shard size, e.g. 5GB (default: 5GB, at most half the model)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                   help="override a config.json field; the tensors follow "
                        "(e.g. num_hidden_layers=4, rope_scaling=null)")
    p.add_argument("--force", action="store_true", help="replace existing output folders")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    import time

    args = build_parser().parse_args(argv)
    try:
        overrides = dict(parse_override(s) for s in args.set)
        t0 = time.perf_counter()
        info = make_checkpoint(args.shape, args.out, dtype=args.dtype, family=args.family, heads=args.heads,
                               head_layers=args.head_layers, head_projection=args.head_projection,
                               heads_layout=args.heads_layout, heads_out=args.heads_out, heads_dtype=args.heads_dtype,
                               heads_config_count=args.heads_config_count,
                               seed=args.seed, shard_size=parse_size(args.shard_size) if args.shard_size else None,
                               overrides=overrides, force=args.force, progress=not args.quiet)
    except MedusaError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    dt = time.perf_counter() - t0
    size = sum(info["files"].values())
    shards = len([f for f in info["files"] if not f.startswith("heads/")])
    print(f"{info['model_dir']}: {info['shape']} {info['family']} {info['dtype']}, "
          f"{info['parameters'] / 1e6:,.1f}M parameters, {shards} weight file(s)")
    if info["heads_dir"]:
        print(f"{info['heads_dir']}: {info['heads']['num_heads']} heads x {info['heads']['num_layers']} block(s), "
              f"{info['heads']['parameters'] / 1e6:,.1f}M parameters ({info['heads']['dtype']})")
    print(f"{size / 1e9:.3f} GB written in {dt:.1f}s ({size / 1e9 / max(dt, 1e-9):.2f} GB/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
