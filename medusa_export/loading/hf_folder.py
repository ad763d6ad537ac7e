"""The weight files of a Hugging Face checkpoint folder, and reading tensors from them.

A folder holds ``model.safetensors``, or shards listed by ``model.safetensors.index.json``, or
the same as PyTorch pickles (``pytorch_model.bin`` / ``pytorch_model.bin.index.json``, read with
``torch.load(weights_only=True)``: the FasterDecoding medusa-1.0 shards hold only
``OrderedDict``, ``HalfStorage`` and ``_rebuild_tensor_v2``). safetensors are preferred when
both exist. A shard index's ``weight_map`` tells which file holds which key, so a few tensors
(the Medusa heads inside a full model) are read without loading the others' files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch

from ..errors import WeightsNotFoundError

#: (single file, shard index) in order of preference.
LAYOUTS = (("model.safetensors", "model.safetensors.index.json"),
           ("pytorch_model.bin", "pytorch_model.bin.index.json"))


def weight_map(folder: str | Path) -> dict[str, Path] | None:
    """Which file holds each tensor, from the folder's shard index (None: no index).

    Raises:
        WeightsNotFoundError: the index names a shard that is not in the folder.
    """
    folder = Path(folder)
    for _, index in LAYOUTS:
        path = folder / index
        if path.is_file():
            wm = json.loads(path.read_text())["weight_map"]
            files = {name: folder / name for name in set(wm.values())}
            missing = sorted(n for n, p in files.items() if not p.is_file())
            if missing:
                raise WeightsNotFoundError(f"{path.name} lists {missing[0]}, which is not in {folder}")
            return {key: files[name] for key, name in wm.items()}
    return None


def weight_files(folder: str | Path) -> list[Path]:
    """The files holding the weights of a checkpoint folder, in reading order.

    Raises:
        WeightsNotFoundError: none of the layouts is present (the message names them).
    """
    folder = Path(folder)
    wm = weight_map(folder)
    if wm is not None:
        return sorted(set(wm.values()))
    for single, _ in LAYOUTS:
        if (folder / single).is_file():
            return [folder / single]
    names = ", ".join(n for pair in LAYOUTS for n in pair)
    raise WeightsNotFoundError(f"no weights in {folder}: expected one of {names}")


def read_file(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of one ``.safetensors`` file or PyTorch pickle (``weights_only=True``).

    Raises:
        WeightsNotFoundError: the file cannot be read or is not a flat dict of tensors.
    """
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            tensors = load_file(str(path))
        else:
            tensors = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any reader failure means an unreadable file here
        raise WeightsNotFoundError(f"cannot read weights file {path}: {exc}") from exc
    if not isinstance(tensors, dict) or not all(isinstance(v, torch.Tensor) for v in tensors.values()):
        raise WeightsNotFoundError(f"weights file {path} is not a flat dict of tensors")
    return dict(tensors)


def read_tensors(folder: str | Path, keep: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint folder (those ``keep`` accepts; all by default).

    With a shard index only the shards holding a kept key are opened.

    Raises:
        WeightsNotFoundError: no weights, or a file that cannot be read.
    """
    folder = Path(folder)
    wm = weight_map(folder)
    if wm is not None and keep is not None:
        files = sorted({f for k, f in wm.items() if keep(k)})
    else:
        files = weight_files(folder)
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update({k: v for k, v in read_file(f).items() if keep is None or keep(k)})
    return out
