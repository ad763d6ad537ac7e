"""Checkpoints read tensor by tensor: the :class:`TensorSource` behind the streamed export.

A source lists a checkpoint's tensors under their Hugging Face names (``model.layers.0.self_attn.q_proj.weight``),
describes each one from the file headers alone (:meth:`TensorSource.info`: shape, stored dtype, bytes, file)
and reads one tensor, or a range of its rows, at a time (:meth:`TensorSource.read`). Nothing else of the
checkpoint is held in memory, so what the export needs does not grow with the model.

=====================================  ==========================================================================
format                                 how it is read
=====================================  ==========================================================================
sharded safetensors + index, single    the header (8-byte length + JSON) is parsed here; each tensor's byte range is
safetensors                            read with a positioned read. Not ``safe_open``: it memory-maps the whole
                                       shard, whose touched pages then count in the process's resident memory
                                       (measured: reading a 512 MB file tensor by tensor through ``safe_open`` peaked
                                       at 772 MB resident, positioned reads at 234 MB).
FP8 (nvidia modelopt)                  ``X.weight`` float8_e4m3fn + ``X.weight_scale``: read as ``w.float() * scale``
                                       (:func:`.fp8.dequantize`, the loader's too; modelopt ``quant_utils.
                                       to_quantized_weight`` stores ``w / scale``); ``input_scale`` / ``k_scale`` /
                                       ``v_scale`` / ``output_scale`` are not listed (``kept_scales()``).
``pytorch_model*.bin`` (+ index)       ``torch.load(weights_only=True, mmap=True)``, one shard open at a time
                                       (its pages count as resident while it is open: prefer safetensors).
GGUF                                   gguf's ``GGUFReader`` (memory-mapped); one tensor dequantized at a time with
                                       gguf's ``dequantize`` and renamed to its HF name; Q and K of ``llama``
                                       GGUFs reverse-permuted as transformers 4.57 does
                                       (``modeling_gguf_pytorch_utils.LlamaTensorProcessor``), so the values equal
                                       ``from_pretrained(gguf_file=...)``'s.
in memory                              :class:`DictSource` (tests, and models already loaded).
=====================================  ==========================================================================

Bad input raises :class:`~medusa_export.errors.CheckpointError` naming the file and the problem: a shard that
is missing or that the index names but is absent, a truncated shard, a header that disagrees with
``config.json`` (:func:`check_backbone`); :func:`check_disk` refuses a weights file the disk cannot hold.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import shutil
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path

import numpy as np
import torch

from ..errors import CheckpointError, InsufficientDiskError, UnsupportedModelError, WeightsNotFoundError
from ..model.config import BackboneConfig
from ..model.families import FAMILIES, gguf_family
from . import fp8
from .heads_formats import HEAD_PREFIXES

#: safetensors dtype names -> torch dtypes (the ones a checkpoint of a supported model holds).
_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn,
              "F8_E5M2": torch.float8_e5m2, "F64": torch.float64, "I64": torch.int64, "I32": torch.int32}


@dataclass(frozen=True)
class TensorInfo:
    """What the file headers say about one tensor.

    Attributes:
        shape: dims in PyTorch order (``[out, in]`` for a linear weight).
        dtype: the stored dtype's name ("float16", "bfloat16", "float32", "float8_e4m3fn", or a GGUF type
            name such as "q4_1").
        nbytes: bytes on disk.
        file: the file holding it (for messages).
    """

    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    file: str

    @property
    def numel(self) -> int:
        return prod(self.shape)


class TensorSource:
    """A checkpoint's tensors by HF name, read one at a time. Subclasses fill ``_infos`` and implement ``_read``."""

    description = "checkpoint"

    def __init__(self) -> None:
        self._infos: dict[str, TensorInfo] = {}

    def keys(self) -> list[str]:
        """Every tensor name, in file order."""
        return list(self._infos)

    def __contains__(self, key: str) -> bool:
        return key in self._infos

    def info(self, key: str) -> TensorInfo:
        """Shape, stored dtype, bytes and file of ``key`` from the headers (nothing is read).

        Raises:
            CheckpointError: no such tensor (the message names the checkpoint).
        """
        try:
            return self._infos[key]
        except KeyError:
            raise CheckpointError(f"{self.description} has no tensor {key!r}") from None

    def read(self, key: str) -> torch.Tensor:
        """The tensor ``key`` (a new CPU tensor in its stored float dtype; FP8 and GGUF are dequantized to float32).

        Raises:
            CheckpointError: no such tensor, or the file cannot be read.
        """
        self.info(key)
        return self._read(key, None)

    def read_rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` along dim 0 of ``key`` (formats that can read part of a tensor read only those)."""
        self.info(key)
        return self._read(key, (start, stop))

    def _read(self, key: str, rows: tuple[int, int] | None) -> torch.Tensor:
        t = self._read_whole(key)
        return t if rows is None else t[rows[0]:rows[1]]

    def _read_whole(self, key: str) -> torch.Tensor:
        raise NotImplementedError

    def close(self) -> None:
        """Release open files (the source can still be read: files reopen on demand)."""


class DictSource(TensorSource):
    """Tensors already in memory (tests; a model that was loaded anyway)."""

    def __init__(self, tensors: dict[str, torch.Tensor], description: str = "in-memory tensors"):
        super().__init__()
        self.description = description
        self._tensors = tensors
        for k, t in tensors.items():
            self._infos[k] = TensorInfo(tuple(t.shape), str(t.dtype).removeprefix("torch."),
                                        t.numel() * t.element_size(), description)

    def _read(self, key, rows):
        t = self._tensors[key].detach()
        return (t if rows is None else t[rows[0]:rows[1]]).clone()


class PrefixSource(TensorSource):
    """The tensors of ``source`` whose names start with ``prefix``, under the rest of their names (Medusa heads
    stored in the backbone's folder: ``medusa_head.0.0.linear.weight`` -> ``0.0.linear.weight``)."""

    def __init__(self, source: TensorSource, prefix: str):
        super().__init__()
        self.description = f"{source.description} ({prefix}*)"
        self._source, self._prefix = source, prefix
        self._infos = {k[len(prefix):]: source.info(k) for k in source.keys() if k.startswith(prefix)}

    def _read(self, key, rows):
        return self._source._read(self._prefix + key, rows)


class ZeroHeadsSource(TensorSource):
    """The initial Medusa heads of Medusa paper §2.1.1 (residual blocks W1 = 0, b = 0; the backbone's lm_head
    projects), generated on read: ``{h}.{l}.linear.weight`` [d, d] and ``.bias`` [d], all zero."""

    def __init__(self, num_heads: int, num_layers: int, hidden_size: int):
        super().__init__()
        self.description = f"initial heads ({num_heads} x {num_layers} zero residual blocks)"
        for h in range(num_heads):
            for layer in range(num_layers):
                for name, shape in (("weight", (hidden_size, hidden_size)), ("bias", (hidden_size,))):
                    self._infos[f"{h}.{layer}.linear.{name}"] = TensorInfo(shape, "float32", 0, self.description)

    def _read(self, key, rows):
        shape = self._infos[key].shape
        if rows is not None:
            shape = (rows[1] - rows[0], *shape[1:])
        return torch.zeros(shape)


@dataclass(frozen=True)
class _Entry:
    file: Path
    dtype: torch.dtype
    begin: int  # absolute byte offset in the file
    end: int


def read_safetensors_header(path: Path) -> tuple[dict, int]:
    """The JSON header of a safetensors file and the byte offset where its data starts.

    Format: an 8-byte little-endian header length N, N bytes of JSON, then the data; each tensor's
    ``data_offsets`` are relative to the data start (huggingface/safetensors README, "Format").

    Raises:
        CheckpointError: the file is missing, shorter than its header says, or the header is not JSON.
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated: {size} bytes, not even a safetensors header")
            n = struct.unpack("<Q", head)[0]
            if 8 + n > size:
                raise CheckpointError(f"{path}: truncated: the header says {n} bytes of JSON but the file has {size} bytes")
            header = json.loads(fh.read(n))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not a safetensors file (header is not JSON: {exc})") from None
    return header, 8 + n


class SafetensorsSource(TensorSource):
    """One or more safetensors files (a sharded checkpoint with its index, or a single file).

    Args:
        files: the shard files (all of them are opened and their headers checked).
        weight_map: the index's key -> file name map (None: every tensor of every file).
        description: how messages name this checkpoint.

    Raises:
        CheckpointError: a shard missing or truncated, a key the index places in a shard whose header
            lacks it, a dtype no supported model uses, an FP8 weight without its ``weight_scale``.
    """

    def __init__(self, files: list[Path], weight_map: dict[str, str] | None = None, description: str | None = None):
        super().__init__()
        self.description = description or str(files[0] if len(files) == 1 else files[0].parent)
        self._entries: dict[str, _Entry] = {}
        self._scales: dict[str, str] = {}  # FP8 weight key -> its scale key
        hidden: set[str] = set()
        for f in files:
            header, data_start = read_safetensors_header(f)
            size = f.stat().st_size
            for key, meta in header.items():
                if key == "__metadata__":
                    continue
                if meta["dtype"] not in _ST_DTYPES:
                    raise CheckpointError(f"{f}: tensor {key!r} has dtype {meta['dtype']}; readable: "
                                          f"{', '.join(_ST_DTYPES)}")
                dtype = _ST_DTYPES[meta["dtype"]]
                b, e = meta["data_offsets"]
                shape = tuple(int(x) for x in meta["shape"])
                if data_start + e > size:
                    raise CheckpointError(f"{f}: truncated: tensor {key!r} ends at byte {data_start + e} but the file "
                                          f"has {size} bytes (an interrupted download or copy?)")
                if e - b != prod(shape) * dtype.itemsize:
                    raise CheckpointError(f"{f}: tensor {key!r} has {e - b} bytes for shape {list(shape)} "
                                          f"{meta['dtype']}")
                self._entries[key] = _Entry(f, dtype, data_start + b, data_start + e)
                self._infos[key] = TensorInfo(shape, str(dtype).removeprefix("torch."), e - b, str(f))
        if weight_map is not None:
            for key, fname in weight_map.items():
                if key not in self._entries:
                    raise CheckpointError(f"the index places tensor {key!r} in {fname}, but that file's header lacks it")
        for key, e in self._entries.items():
            if e.dtype in fp8.FP8_DTYPES:
                scale = fp8.scale_key(key)
                if scale not in self._entries:
                    raise CheckpointError(f"{e.file}: FP8 tensor {key!r} has no {scale!r} (modelopt layout: weight "
                                          "float8_e4m3fn + weight_scale)")
                fp8.check_scale(scale, self._infos[scale].shape, self._infos[key].shape)
                self._scales[key] = scale
                hidden.add(scale)
        #: scales an FP8 checkpoint holds that dequantization does not apply (activations, KV cache).
        self.kept_scale_keys = [k for k in self._entries if self._scales and k.rsplit(".", 1)[-1]
                                in fp8.KEPT_SCALE_SUFFIXES]
        hidden.update(self.kept_scale_keys)
        for k in hidden:
            self._infos.pop(k, None)

    @property
    def fp8_weights(self) -> int:
        """How many weights are stored in FP8 (dequantized when read)."""
        return len(self._scales)

    def kept_scales(self) -> dict[str, float]:
        """The FP8 scales dequantization does not apply (``*.input_scale``, KV scales), by key (each read: a
        few bytes); what a TensorRT FP8 plan would use.

        Raises:
            UnsupportedModelError: a scale that is not per tensor.
        """
        return {k: fp8.kept_scale(k, self._raw(k, None)) for k in self.kept_scale_keys}

    def _raw(self, key: str, rows: tuple[int, int] | None) -> torch.Tensor:
        e = self._entries[key]
        info = self._infos.get(key)
        begin, end = e.begin, e.end
        shape = info.shape if info is not None else ((end - begin) // e.dtype.itemsize,)  # a hidden scale: flat
        if rows is not None:
            row_bytes = prod(shape[1:]) * e.dtype.itemsize
            begin, end = e.begin + rows[0] * row_bytes, e.begin + rows[1] * row_bytes
            shape = (rows[1] - rows[0], *shape[1:])
        buf = bytearray(end - begin)
        try:
            with open(e.file, "rb") as fh:
                fh.seek(begin)
                got = fh.readinto(buf)
        except OSError as exc:
            raise CheckpointError(f"{e.file}: cannot read tensor {key!r}: {exc.strerror}") from None
        if got != len(buf):
            raise CheckpointError(f"{e.file}: truncated while reading tensor {key!r}")
        if not buf:
            return torch.empty(shape, dtype=e.dtype)
        return torch.frombuffer(buf, dtype=e.dtype).reshape(shape)

    def _read(self, key, rows):
        t = self._raw(key, rows)
        if key in self._scales:
            return fp8.dequantize(t, self._raw(self._scales[key], None), torch.float32, rows)
        return t


class TorchBinSource(TensorSource):
    """``pytorch_model*.bin`` shards read with ``torch.load(weights_only=True, mmap=True)``, one shard open at a time.

    Raises:
        CheckpointError: a shard that ``torch.load`` cannot read (truncated or not a state dict).
    """

    def __init__(self, files: list[Path], description: str | None = None):
        super().__init__()
        self.description = description or str(files[0] if len(files) == 1 else files[0].parent)
        self._where: dict[str, Path] = {}
        self._open: tuple[Path, dict] | None = None
        for f in files:
            sd = self._load(f)
            for k, t in sd.items():
                self._where[k] = f
                self._infos[k] = TensorInfo(tuple(t.shape), str(t.dtype).removeprefix("torch."),
                                            t.numel() * t.element_size(), str(f))
            self._open = (f, sd)

    @staticmethod
    def _load(f: Path) -> dict:
        try:
            try:
                sd = torch.load(str(f), map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as exc:  # a legacy (pre-zipfile) pickle cannot be memory-mapped: read it whole
                if "mmap" not in str(exc):
                    raise
                sd = torch.load(str(f), map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise CheckpointError(f"{f}: missing") from None
        except Exception as exc:  # noqa: BLE001 - a truncated zip, a bad pickle: all are a bad shard
            raise CheckpointError(f"{f}: cannot be read as a PyTorch state dict (truncated?): {exc}") from None
        if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
            raise CheckpointError(f"{f}: not a flat dict of tensors")
        return sd

    def _read(self, key, rows):
        f = self._where[key]
        if self._open is None or self._open[0] != f:
            self._open = None  # unmap the previous shard first
            self._open = (f, self._load(f))
        t = self._open[1][key]
        return (t if rows is None else t[rows[0]:rows[1]]).clone()

    def close(self) -> None:
        self._open = None


#: GGUF tensor names (llama.cpp ``gguf-py`` TensorNameMap for llama / qwen2 / qwen3) -> HF names.
_GGUF_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
_GGUF_LAYER = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
               "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
               "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
               "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def gguf_hf_name(name: str) -> str | None:
    """The HF name of a GGUF tensor name (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``),
    or None when it has none."""
    if name in _GGUF_TOP:
        return _GGUF_TOP[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _GGUF_LAYER:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER[parts[2]]}.{parts[3]}"
    return None


class GGUFSource(TensorSource):
    """A GGUF file: tensors dequantized one at a time (see the module docstring).

    Args:
        path: the ``.gguf`` file.
        num_attention_heads, num_key_value_heads: for the Q/K reverse permutation of the GGUFs whose family
            has ``gguf_permuted_qk`` (``llama``).

    Raises:
        CheckpointError: the file is truncated or not a GGUF file.
        UnsupportedModelError: a tensor without an HF name (``rope_freqs.weight``: Llama 3.1 RoPE scaling that
            transformers' GGUF loader drops too), or an architecture no family's ``gguf_architecture`` names
            (:func:`~medusa_export.model.families.gguf_family`).
    """

    def __init__(self, path: Path, num_attention_heads: int, num_key_value_heads: int):
        super().__init__()
        from gguf import GGUFReader

        self.description = str(path)
        self.path = path
        try:
            self._reader = GGUFReader(str(path))
        except FileNotFoundError:
            raise CheckpointError(f"{path}: missing") from None
        except (ValueError, IndexError, struct.error, OverflowError) as exc:
            raise CheckpointError(f"{path}: not a readable GGUF file (truncated?): {exc}") from None
        arch_field = self._reader.fields.get("general.architecture")
        self.arch = bytes(arch_field.parts[arch_field.data[0]]).decode() if arch_field else "?"
        try:
            self._permuted_qk = gguf_family(self.arch).gguf_permuted_qk
        except UnsupportedModelError as exc:
            raise UnsupportedModelError(f"{path}: {exc}") from None
        self._heads = (num_attention_heads, num_key_value_heads)
        self._tensors = {}
        for t in self._reader.tensors:
            hf = gguf_hf_name(t.name)
            if hf is None:
                raise UnsupportedModelError(
                    f"{path}: tensor {t.name!r} has no Hugging Face counterpart"
                    + (" (llama.cpp's Llama 3 RoPE frequency factors; transformers' GGUF loader drops them, so the "
                       "model would run with unscaled RoPE: export the HF checkpoint instead)"
                       if t.name == "rope_freqs.weight" else ""))
            shape = tuple(int(x) for x in reversed(t.shape.tolist()))
            self._tensors[hf] = t
            self._infos[hf] = TensorInfo(shape, t.tensor_type.name.lower(), int(t.n_bytes), str(path))

    def _read_whole(self, key):
        from gguf import dequantize

        t = self._tensors[key]
        try:
            w = dequantize(t.data, t.tensor_type)
        except (ValueError, NotImplementedError) as exc:
            raise CheckpointError(f"{self.path}: cannot dequantize {t.name!r} ({t.tensor_type.name}): {exc}") from None
        w = w.reshape(self._infos[key].shape)
        if self._permuted_qk and (".attn_q." in t.name or ".attn_k." in t.name):
            n_head = self._heads[0] if ".attn_q." in t.name else self._heads[1]
            w = _reverse_permute(w, n_head)
        out = torch.from_numpy(np.array(w, dtype=w.dtype, copy=True))
        self._release(t)
        return out

    def _release(self, t) -> None:
        """Drop the tensor's mapped pages from this process's resident set (the file stays mapped)."""
        mm = getattr(self._reader.data, "_mmap", None)
        if mm is None or not hasattr(mm, "madvise"):
            return
        start = (t.data_offset // mmap.PAGESIZE) * mmap.PAGESIZE
        try:
            mm.madvise(mmap.MADV_DONTNEED, start, t.data_offset + int(t.n_bytes) - start)
        except (OSError, ValueError):
            pass


def _reverse_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (transformers ``LlamaTensorProcessor._reverse_permute_weights``)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


# ---- finding and opening a checkpoint -----------------------------------------------------------------------


def find_weights(path: Path) -> tuple[str, list[Path], dict | None]:
    """The weights files of a checkpoint at ``path`` (a folder, or one weights file).

    Returns:
        (kind, files, weight_map): kind "safetensors", "bin" or "gguf"; weight_map from the index (None without one).

    Raises:
        WeightsNotFoundError: nothing at ``path`` or no weights file in it (the message lists what was looked for).
        CheckpointError: an index that is not JSON or names a shard that is absent.
    """
    if path.is_file():
        kind = {".gguf": "gguf", ".safetensors": "safetensors", ".bin": "bin", ".pt": "bin"}.get(path.suffix)
        if kind is None:
            raise WeightsNotFoundError(f"{path} is not a weights file (.safetensors, .bin, .gguf)")
        return kind, [path], None
    if not path.is_dir():
        raise WeightsNotFoundError(f"no model at {path}")
    for index, kind in (("model.safetensors.index.json", "safetensors"), ("pytorch_model.bin.index.json", "bin")):
        if (path / index).is_file():
            try:
                weight_map = json.loads((path / index).read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{path / index}: not a shard index ({exc})") from None
            names = sorted(set(weight_map.values()))
            absent = [n for n in names if not (path / n).is_file()]
            if absent:
                raise CheckpointError(f"{path / index} names {len(names)} shard(s); missing: {', '.join(absent)} "
                                      f"(not in {path})")
            return kind, [path / n for n in names], weight_map
    for single, kind in (("model.safetensors", "safetensors"), ("pytorch_model.bin", "bin")):
        if (path / single).is_file():
            return kind, [path / single], None
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return "gguf", ggufs, None
    raise WeightsNotFoundError(f"no weights in {path}: expected model.safetensors(.index.json), "
                               "pytorch_model.bin(.index.json) or one .gguf file"
                               + (f" (found {len(ggufs)} .gguf files: pass one)" if ggufs else ""))


def hf_config_dict(path: Path, kind: str, files: list[Path], trust_remote_code: bool = False) -> dict:
    """The checkpoint's transformers config as a dict (defaults filled in by its config class).

    ``config.json`` beside the weights, or a GGUF file's metadata (transformers' own GGUF mapping). A family
    whose ``model_type`` transformers does not know (its table entry names another ``hf_model_type``) is read
    through that type's config class, its own ``model_type`` kept.

    Raises:
        WeightsNotFoundError: no ``config.json`` beside safetensors / .bin weights.
    """
    from transformers import AutoConfig

    folder = files[0].parent
    try:
        with quiet_transformers():
            if kind == "gguf":
                cfg = AutoConfig.from_pretrained(str(folder), gguf_file=files[0].name,
                                                 trust_remote_code=trust_remote_code)
            else:
                if not (folder / "config.json").is_file():
                    raise WeightsNotFoundError(f"no config.json in {folder} (needed beside the weights)")
                raw = json.loads((folder / "config.json").read_text())
                fam = FAMILIES.get(raw.get("model_type")) if isinstance(raw, dict) else None
                if fam is not None and fam.hf_model_type != fam.model_type:
                    rest = {k: v for k, v in raw.items() if k != "model_type"}
                    return {**AutoConfig.for_model(fam.hf_model_type, **rest).to_dict(), "model_type": fam.model_type}
                cfg = AutoConfig.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        if kind == "gguf" and not isinstance(exc, OSError):  # the metadata and tensor table are parsed together
            raise CheckpointError(f"{files[0]}: not a readable GGUF file (truncated?): {exc}") from None
        raise WeightsNotFoundError(f"cannot read the model config of {path}: {exc}") from None
    return cfg.to_dict()


@contextlib.contextmanager
def quiet_transformers():
    """transformers' log level at "error" inside the block (its warnings about configs and tokenizers are
    noise for our users), restored after."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)


def open_source(kind: str, files: list[Path], weight_map: dict | None, cfg: BackboneConfig) -> TensorSource:
    """A :class:`TensorSource` over ``files`` (what :func:`find_weights` returned)."""
    description = str(files[0] if len(files) == 1 else files[0].parent)
    if kind == "safetensors":
        return SafetensorsSource(files, weight_map, description)
    if kind == "bin":
        return TorchBinSource(files, description)
    return GGUFSource(files[0], cfg.num_attention_heads, cfg.num_key_value_heads)


# ---- checks against the config ------------------------------------------------------------------------------


def backbone_shapes(cfg: BackboneConfig) -> dict[str, tuple[int, ...]]:
    """Every backbone tensor ``cfg`` implies, by HF name, with its shape (``lm_head.weight`` only when untied).

    Shapes follow transformers 4.57's modeling files (``nn.Linear`` weights ``[out, in]``):
    q ``[H D, d]``, k / v ``[H_kv D, d]``, o ``[d, H D]``, gate / up ``[I, d]``, down ``[d, I]``.
    """
    v, d, i, h, kv, hd = (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
                          cfg.num_key_value_heads, cfg.head_dim)
    out = {"model.embed_tokens.weight": (v, d)}
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}."
        out[p + "input_layernorm.weight"] = (d,)
        for name, rows in (("q_proj", h * hd), ("k_proj", kv * hd), ("v_proj", kv * hd)):
            out[f"{p}self_attn.{name}.weight"] = (rows, d)
            if cfg.qkv_bias:
                out[f"{p}self_attn.{name}.bias"] = (rows,)
        out[p + "self_attn.o_proj.weight"] = (d, h * hd)
        if cfg.o_bias:
            out[p + "self_attn.o_proj.bias"] = (d,)
        if cfg.qk_norm:
            out[p + "self_attn.q_norm.weight"] = (hd,)
            out[p + "self_attn.k_norm.weight"] = (hd,)
        out[p + "post_attention_layernorm.weight"] = (d,)
        for name, shape in (("gate_proj", (i, d)), ("up_proj", (i, d)), ("down_proj", (d, i))):
            out[f"{p}mlp.{name}.weight"] = shape
            if cfg.mlp_bias:
                out[f"{p}mlp.{name}.bias"] = shape[:1]
    out["model.norm.weight"] = (d,)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (v, d)
    return out


def check_backbone(source: TensorSource, cfg: BackboneConfig, config_name: str = "config.json") -> None:
    """Every tensor ``cfg`` implies is in ``source`` with that shape, and nothing else is (strict, from headers).

    Ignored: ``*.rotary_emb.inv_freq`` buffers, a tied model's redundant ``lm_head.weight``, and Medusa heads
    stored in the same folder (:data:`HEAD_PREFIXES`).

    Raises:
        CheckpointError: a missing tensor, an unexpected one, or a shape that disagrees with the config;
            the message names the file, the tensor and both shapes.
    """
    expected = backbone_shapes(cfg)
    geometry = (f"{config_name}: hidden_size {cfg.hidden_size}, intermediate_size {cfg.intermediate_size}, "
                f"{cfg.num_attention_heads} heads / {cfg.num_key_value_heads} KV heads of {cfg.head_dim}, "
                f"vocab {cfg.vocab_size}, {cfg.num_hidden_layers} layers")
    for key, shape in expected.items():
        if key not in source:
            raise CheckpointError(f"{source.description}: tensor {key!r} is missing ({geometry})")
        info = source.info(key)
        if info.shape != shape:
            raise CheckpointError(f"{info.file}: tensor {key!r} has shape {list(info.shape)} but {geometry} "
                                  f"implies {list(shape)}")
    extra = [k for k in source.keys() if k not in expected and not k.endswith("rotary_emb.inv_freq")
             and not k.startswith(HEAD_PREFIXES) and not (cfg.tie_word_embeddings and k == "lm_head.weight")]
    if extra:
        raise CheckpointError(f"{source.info(extra[0]).file}: unexpected tensor {extra[0]!r} ({len(extra)} not "
                              f"implied by {config_name}, e.g. a layer beyond num_hidden_layers or a feature the "
                              "config does not switch on)")


def check_disk(folder: Path, need: int, what: str = "weights.bin") -> None:
    """Refuse to write ``need`` bytes into ``folder`` when its file system has less free space.

    Raises:
        InsufficientDiskError: both numbers, and what would help.
    """
    free = shutil.disk_usage(folder).free
    if need > free:
        raise InsufficientDiskError(
            f"not enough disk for {what}: it needs {need / 1e9:.2f} GB but {folder} has {free / 1e9:.2f} GB free. "
            "Free space there, choose another --out, or a smaller --precision (fp16 halves fp32; int4 is ~1/7)")
