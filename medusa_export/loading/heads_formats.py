"""Loaders of the Medusa heads' public file formats, and files kept beside the heads.

File formats (key layout shared by all three, h = head, l = block, N = blocks):
    ``{h}.{l}.linear.weight`` [d, d], ``{h}.{l}.linear.bias`` [d], optional ``{h}.{N}.weight`` [V, d]

* FasterDecoding ``medusa_lm_head.pt`` (loaded with ``torch.load(weights_only=True)``);
* the same tensors as ``medusa_lm_head.safetensors``;
* ours: ``heads.safetensors`` + ``heads.json`` (:data:`~medusa_export.model.heads.HEADS_FORMAT`,
  written by :func:`~medusa_export.model.heads.save_heads`). Its ``head_type`` (absent =
  "medusa") may also say "hydra": path-conditioned heads (:mod:`medusa_export.model.hydra_heads`,
  keys ``{h}.0.res.*`` / ``{h}.0.linear.*`` of width (h + 2) d, then ``{h}.{l}.linear.*``),
  which only our format holds.

Every key and shape is checked against the backbone (strict loading, no key left over).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from torch import nn

from ..errors import HeadsFormatError
from ..model.heads import HEAD_TYPES, HEADS_CONFIG, HEADS_FILE, HeadsConfig, MedusaHeads
from ..model.hydra_heads import HydraHeads

_KEY = re.compile(r"^(\d+)\.(\d+)\.(?:linear\.)?(weight|bias)$")


def file_beside_heads(heads: str | Path, name: str) -> Path | None:
    """``name`` in the heads' folder (``heads`` is that folder or a heads file in it), or None when absent."""
    folder = Path(heads)
    path = (folder.parent if folder.is_file() else folder) / name
    return path if path.is_file() else None


def read_head_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Read a heads file: ``.safetensors`` or a torch pickle (``weights_only=True``).

    Raises:
        HeadsFormatError: the file is missing, unreadable or not a flat tensor dict.
    """
    path = Path(path)
    if not path.is_file():
        raise HeadsFormatError(f"heads file {path} does not exist")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            tensors = load_file(str(path))
        else:
            tensors = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any reader failure is a format error here
        raise HeadsFormatError(f"cannot read heads file {path}: {exc}") from exc
    if not isinstance(tensors, dict) or not all(isinstance(v, torch.Tensor) for v in tensors.values()):
        raise HeadsFormatError(f"heads file {path} is not a flat dict of tensors")
    return tensors


def infer_heads_config(
    tensors: dict[str, torch.Tensor],
    *,
    hidden_size: int,
    vocab_size: int,
    num_heads: int | None = None,
    num_layers: int | None = None,
) -> HeadsConfig:
    """Infer and check the head structure from tensor keys and shapes.

    Args:
        tensors: the file's tensors (FasterDecoding layout).
        hidden_size, vocab_size: the backbone's d and V.
        num_heads, num_layers: what a config file claims, if anything (checked).

    Raises:
        HeadsFormatError: an unexpected key, a missing key, inconsistent head/layer counts,
            a shape that does not match the backbone, or a count that contradicts the config.
            The message names the key.
    """
    found: dict[int, dict[int, set[str]]] = {}
    for key in tensors:
        m = _KEY.match(key)
        if not m:
            raise HeadsFormatError(
                f"unexpected key {key!r} in heads file; expected '{{h}}.{{l}}.linear.weight|bias' "
                "and optionally '{h}.{N}.weight'"
            )
        found.setdefault(int(m[1]), {}).setdefault(int(m[2]), set()).add(m[3])
    if not found:
        raise HeadsFormatError("heads file holds no tensors")
    k = max(found) + 1
    if sorted(found) != list(range(k)):
        raise HeadsFormatError(f"heads file has heads {sorted(found)}; expected 0..{k - 1}")
    shapes = set()
    for h, layers in found.items():
        n = max(layers) + 1
        if sorted(layers) != list(range(n)):
            raise HeadsFormatError(f"head {h} has blocks {sorted(layers)}; expected 0..{n - 1}")
        last = layers[n - 1]
        own = last == {"weight"} and f"{h}.{n - 1}.weight" in tensors and f"{h}.{n - 1}.linear.weight" not in tensors
        shapes.add((n - 1 if own else n, own))
    if len(shapes) != 1:
        raise HeadsFormatError(f"heads differ in structure (blocks, own projection): {sorted(shapes)}")
    layers_n, own = shapes.pop()
    if layers_n < 1:
        raise HeadsFormatError("heads have no residual block (key '{h}.0.linear.weight' missing)")
    if num_heads is not None and num_heads != k:
        raise HeadsFormatError(f"config says {num_heads} heads but the weights hold {k}")
    if num_layers is not None and num_layers != layers_n:
        raise HeadsFormatError(f"config says {num_layers} layers per head but the weights hold {layers_n}")
    d, v = hidden_size, vocab_size
    for h in range(k):
        for lay in range(layers_n):
            for name, shape in (("weight", (d, d)), ("bias", (d,))):
                key = f"{h}.{lay}.linear.{name}"
                if key not in tensors:
                    raise HeadsFormatError(f"heads file is missing key {key!r}")
                if tuple(tensors[key].shape) != shape:
                    raise HeadsFormatError(
                        f"key {key!r} has shape {tuple(tensors[key].shape)}, expected {shape} "
                        f"(backbone hidden size {d})"
                    )
        if own:
            key = f"{h}.{layers_n}.weight"
            if tuple(tensors[key].shape) != (v, d):
                raise HeadsFormatError(
                    f"key {key!r} has shape {tuple(tensors[key].shape)}, expected {(v, d)} "
                    f"(backbone vocab {v}, hidden {d})"
                )
    return HeadsConfig(k, layers_n, d, v, own)


def heads_from_tensors(
    tensors: dict[str, torch.Tensor],
    lm_head: nn.Linear,
    *,
    num_heads: int | None = None,
    num_layers: int | None = None,
) -> MedusaHeads:
    """Build :class:`MedusaHeads` from checked tensors (strict: every key used, shapes equal).

    Raises:
        HeadsFormatError: see :func:`infer_heads_config`.
    """
    vocab, hidden = lm_head.weight.shape
    cfg = infer_heads_config(tensors, hidden_size=hidden, vocab_size=vocab, num_heads=num_heads, num_layers=num_layers)
    heads = MedusaHeads(cfg, lm_head)
    dtype = lm_head.weight.dtype
    state = {f"heads.{k}": v.to(dtype) for k, v in tensors.items()}
    result = heads.load_state_dict(state, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    return heads


def hydra_heads_from_tensors(tensors: dict[str, torch.Tensor], lm_head: nn.Linear, embed_tokens: nn.Embedding, *,
                             num_heads: int, num_layers: int) -> HydraHeads:
    """Build :class:`HydraHeads` from checked tensors (strict: every key used, shapes equal).

    Raises:
        HeadsFormatError: a missing or unexpected key, or a shape that does not fit the backbone
            (the message names the key and the expected shape).
    """
    vocab, hidden = lm_head.weight.shape
    cfg = HeadsConfig(num_heads, num_layers, hidden, vocab, False, head_type="hydra")
    heads = HydraHeads(cfg, lm_head, embed_tokens)
    expected = {k.removeprefix("heads."): tuple(v.shape) for k, v in heads.state_dict().items()}
    for key in tensors:
        if key not in expected:
            raise HeadsFormatError(f"unexpected key {key!r} in hydra heads file ({num_heads} heads, {num_layers} "
                                   f"blocks each); expected keys like '0.0.res.weight', '0.1.linear.weight'")
    for key, shape in expected.items():
        if key not in tensors:
            raise HeadsFormatError(f"hydra heads file is missing key {key!r}")
        if tuple(tensors[key].shape) != shape:
            raise HeadsFormatError(f"key {key!r} has shape {tuple(tensors[key].shape)}, expected {shape} "
                                   f"(backbone hidden size {hidden})")
    dtype = lm_head.weight.dtype
    heads.load_state_dict({f"heads.{k}": v.to(dtype) for k, v in tensors.items()}, strict=True)
    return heads.to(dtype)


def load_heads(path: str | Path, lm_head: nn.Linear, embed_tokens: nn.Embedding | None = None) -> nn.Module:
    """Load heads from a directory or file in any supported format.

    Args:
        path: a directory holding ``heads.safetensors`` (+ ``heads.json``),
            ``medusa_lm_head.safetensors`` or ``medusa_lm_head.pt`` (+ optional
            ``config.json`` with ``medusa_num_heads`` / ``medusa_num_layers``), or one of
            those files directly.
        lm_head: the backbone's LM head [V, d]; used for checks and, for heads without
            their own projection, for the projection itself.
        embed_tokens: the backbone's input embedding, needed by path-conditioned heads
            (``head_type`` "hydra" in ``heads.json``).

    Returns:
        :class:`MedusaHeads`, or :class:`HydraHeads` when ``heads.json`` says ``"head_type": "hydra"``.

    Raises:
        HeadsFormatError: nothing loadable at ``path``, a key/shape/count mismatch, an unknown
            head type, or hydra heads without ``embed_tokens``.
    """
    path = Path(path)
    if path.is_dir():
        for name in (HEADS_FILE, "medusa_lm_head.safetensors", "medusa_lm_head.pt"):
            if (path / name).is_file():
                file = path / name
                break
        else:
            raise HeadsFormatError(
                f"no heads file in {path}: expected {HEADS_FILE}, medusa_lm_head.safetensors "
                "or medusa_lm_head.pt"
            )
    else:
        file = path
    num_heads = num_layers = None
    head_type = "medusa"
    for cfg_name in (HEADS_CONFIG, "config.json"):
        cfg_path = file.parent / cfg_name
        if cfg_path.is_file():
            meta = json.loads(cfg_path.read_text())
            num_heads = meta.get("num_heads", meta.get("medusa_num_heads"))
            num_layers = meta.get("num_layers", meta.get("medusa_num_layers"))
            if cfg_name == HEADS_CONFIG:
                head_type = meta.get("head_type", "medusa")
            break
    if head_type not in HEAD_TYPES:
        raise HeadsFormatError(f"{file.parent / HEADS_CONFIG}: unknown head_type {head_type!r}; this version reads "
                               f"{', '.join(HEAD_TYPES)}")
    tensors = read_head_tensors(file)
    if head_type == "hydra":
        if embed_tokens is None:
            raise HeadsFormatError(f"{file}: path-conditioned (hydra) heads need the backbone's input embedding")
        if num_heads is None or num_layers is None:
            raise HeadsFormatError(f"{file.parent / HEADS_CONFIG}: hydra heads need num_heads and num_layers")
        return hydra_heads_from_tensors(tensors, lm_head, embed_tokens, num_heads=num_heads, num_layers=num_layers)
    return heads_from_tensors(tensors, lm_head, num_heads=num_heads, num_layers=num_layers)
