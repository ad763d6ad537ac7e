"""Loaders of the Medusa heads' public file formats, and files kept beside the heads.

Key layout shared by every format (h = head, l = block, N = blocks per head):
    ``{h}.{l}.linear.weight`` [d, d], ``{h}.{l}.linear.bias`` [d], optional ``{h}.{N}.weight`` [V, d]
(the head's own vocab projection; without it the backbone's ``lm_head`` projects).

Formats:

* FasterDecoding Medusa-1 ``medusa_lm_head.pt`` (``torch.load(weights_only=True)``) or the same
  tensors as ``medusa_lm_head.safetensors``, with a ``config.json`` whose ``medusa_num_heads`` may
  be wrong (FasterDecoding/Medusa ``medusa/model/medusa_model.py``: "fix the uploaded config");
* the community "version 2" layout of the same file (``medusa_lm_head.safetensors``, e.g.
  philschmid/llama-3-1-8b-instruct-medusa: 3 heads x 1 block, bf16, no own projection; written
  by Medusa's ``medusa/train/train_legacy.py``; TGI ``layers/medusa.py`` ``MedusaHeadV2``);
* heads INSIDE a full model folder, with a prefix: FasterDecoding's medusa-1.0 repositories
  (``medusa_head.`` prefix, fp16 ``pytorch_model-*.bin`` shards, e.g. the ``weight_map`` of
  FasterDecoding/medusa-v1.0-vicuna-7b-v1.5 ``pytorch_model.bin.index.json``; counts in
  config.json ``medusa_num_heads`` / ``medusa_num_layers``, absent from some) and NVIDIA
  TensorRT Model Optimizer checkpoints (``medusa_heads.`` prefix, FP8 weights with per-tensor
  ``weight_scale``, e.g. nvidia/Llama-3.1-8B-Medusa-FP8; TensorRT-LLM
  ``models/medusa/weight.py`` ``load_medusa_hf(is_modelopt_ckpt=True)``; counts in config.json
  ``"medusa": {"num_medusa_heads", "num_medusa_layers"}``);
* a heads-only file of either format whose keys all carry one of those prefixes (heads cut out of
  such a checkpoint): read as the shards' heads are, the prefix removed (:func:`file_prefix`);
* ours: ``heads.safetensors`` + ``heads.json`` (:data:`~medusa_export.model.heads.HEADS_FORMAT`,
  written by :func:`~medusa_export.model.heads.save_heads`). Its ``head_type`` (absent =
  "medusa") may also say "hydra": path-conditioned heads (:mod:`medusa_export.model.hydra_heads`,
  keys ``{h}.0.res.*`` / ``{h}.0.linear.*`` of width (h + 2) d, then ``{h}.{l}.linear.*``),
  which only our format holds.

Loading is strict: counts are inferred from the keys, every key must be one the structure
expects and every expected key must be there (the error names the key), and shapes must match
the backbone. A count our ``heads.json`` states must agree with the weights; one a third-party
``config.json`` states is only checked with a warning (they have been wrong).
"""

from __future__ import annotations

import json
import re
import warnings
from collections import Counter
from pathlib import Path

import torch
from torch import nn

from ..errors import HeadsFormatError, MedusaError, NoteWarning
from ..model.heads import HEAD_TYPES, HEADS_CONFIG, HEADS_FILE, HeadsConfig, MedusaHeads
from ..model.hydra_heads import HydraHeads
from . import fp8, hf_folder

_KEY = re.compile(r"^(\d+)\.(\d+)\.(?:linear\.)?(weight|bias)$")
#: Prefixes of heads stored inside a full model's state dict: FasterDecoding medusa-1.0, modelopt.
HEAD_PREFIXES = ("medusa_head.", "medusa_heads.")
#: Heads-only files, in the order a folder is searched.
HEAD_FILES = (HEADS_FILE, "medusa_lm_head.safetensors", "medusa_lm_head.pt")


def file_beside_heads(heads: str | Path, name: str) -> Path | None:
    """``name`` in the heads' folder (``heads`` is that folder or a heads file in it), or None when absent."""
    folder = Path(heads)
    path = (folder.parent if folder.is_file() else folder) / name
    return path if path.is_file() else None


def read_head_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Read a heads file: ``.safetensors`` or a torch pickle (``weights_only=True``).

    Keys that all carry a full model's heads prefix (:func:`file_prefix`) are returned without it.

    Raises:
        HeadsFormatError: the file is missing, unreadable or not a flat tensor dict; keys named two ways
            (:func:`file_prefix`).
    """
    path = Path(path)
    if not path.is_file():
        raise HeadsFormatError(f"heads file {path} does not exist")
    try:
        tensors = hf_folder.read_file(path)
    except MedusaError as exc:
        raise HeadsFormatError(str(exc).replace("weights file", "heads file")) from exc
    prefix = file_prefix(tensors)
    return {k.removeprefix(prefix): v for k, v in tensors.items()} if prefix else tensors


def file_prefix(keys) -> str | None:
    """The model prefix (:data:`HEAD_PREFIXES`) every key of a heads-only file carries, or None when none does.

    Heads cut out of a medusa-1.0 or modelopt checkpoint keep the names its shards give them
    (``medusa_head.0.0.linear.weight``); they load as the shards' heads do, the prefix removed.

    Raises:
        HeadsFormatError: some keys carry a prefix and others do not, or keys carry both prefixes
            (the message names a key of each kind).
    """
    keys = list(keys)
    prefix = heads_prefix(keys)
    if prefix is None:
        return None
    bare = next((k for k in keys if not k.startswith(prefix)), None)
    if bare is not None:
        first = next(k for k in keys if k.startswith(prefix))
        raise HeadsFormatError(f"unexpected key {first!r} in heads file: some keys carry the model prefix {prefix!r} "
                               f"and others ({bare!r}) do not; a heads file names every head one way")
    return prefix


def heads_prefix(keys) -> str | None:
    """The prefix of Medusa heads stored among a full model's tensor names (:data:`HEAD_PREFIXES`), or None.

    Raises:
        HeadsFormatError: keys with both prefixes (two sets of heads).
    """
    found = sorted({p for p in HEAD_PREFIXES if any(k.startswith(p) for k in keys)})
    if len(found) > 1:
        raise HeadsFormatError(f"checkpoint holds keys with both {' and '.join(found)} prefixes")
    return found[0] if found else None


def split_heads(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], str | None]:
    """Separate the Medusa heads from a full model's state dict.

    Args:
        tensors: a checkpoint's state dict.

    Returns:
        (the other tensors, the heads' tensors with the prefix removed, the prefix found or None).

    Raises:
        HeadsFormatError: keys with both prefixes (two sets of heads).
    """
    prefix = heads_prefix(tensors)
    if prefix is None:
        return tensors, {}, None
    rest = {k: v for k, v in tensors.items() if not k.startswith(prefix)}
    heads = {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
    return rest, heads, prefix


def config_head_counts(config: dict) -> tuple[int | None, int | None]:
    """(num_heads, num_layers) a ``config.json`` beside (or of) the heads states, or None for what it does not.

    Reads FasterDecoding's ``medusa_num_heads`` / ``medusa_num_layers`` and modelopt's
    ``"medusa": {"num_medusa_heads", "num_medusa_layers"}``.
    """
    nested = config.get("medusa") if isinstance(config.get("medusa"), dict) else {}
    return (config.get("medusa_num_heads", nested.get("num_medusa_heads")),
            config.get("medusa_num_layers", nested.get("num_medusa_layers")))


def _expected_keys(h: int, layers: int, own: bool) -> list[str]:
    keys = [f"{h}.{lay}.linear.{n}" for lay in range(layers) for n in ("weight", "bias")]
    return keys + ([f"{h}.{layers}.weight"] if own else [])


def _head_structure(h: int, keys: set[str]) -> tuple[int, bool]:
    """(blocks, own projection) that head ``h``'s keys suggest."""
    blocks = {int(k.split(".")[1]) for k in keys}
    n = max(blocks) + 1
    own = f"{h}.{n - 1}.weight" in keys and f"{h}.{n - 1}.linear.weight" not in keys
    return (n - 1 if own else n), own


def _describe(layers: int, own: bool) -> str:
    return f"{layers} block(s) and {'its own projection' if own else 'no own projection'}"


def infer_heads_config(
    tensors: dict[str, torch.Tensor],
    *,
    hidden_size: int,
    vocab_size: int,
    num_heads: int | None = None,
    num_layers: int | None = None,
) -> HeadsConfig:
    """Infer and check the head structure from tensor keys and shapes.

    The structure (blocks per head, own projection or not) is the one most heads have (head 0's
    on a tie); a key another head has beyond it is unexpected, a key it lacks is missing.

    Args:
        tensors: the heads' tensors (FasterDecoding layout, no prefix).
        hidden_size, vocab_size: the backbone's d and V.
        num_heads, num_layers: what a config file claims, if anything (checked).

    Raises:
        HeadsFormatError: an unexpected key, a missing key, a missing head, a shape that does
            not match the backbone, or a count that contradicts the config. The message names the key.
    """
    by_head: dict[int, set[str]] = {}
    for key in tensors:
        m = _KEY.match(key)
        if not m:
            raise HeadsFormatError(
                f"unexpected key {key!r} in heads file; expected '{{h}}.{{l}}.linear.weight|bias' "
                "and optionally '{h}.{N}.weight'"
            )
        by_head.setdefault(int(m[1]), set()).add(key)
    if not by_head:
        raise HeadsFormatError("heads file holds no tensors")
    k = max(by_head) + 1
    if sorted(by_head) != list(range(k)):
        absent = sorted(set(range(k)) - set(by_head))
        raise HeadsFormatError(f"heads file has heads {sorted(by_head)}; expected 0..{k - 1} "
                               f"(missing key {f'{absent[0]}.0.linear.weight'!r})")
    votes = Counter(_head_structure(h, keys) for h, keys in sorted(by_head.items()))
    best = max(votes.values())
    layers_n, own = next(s for s in (_head_structure(h, by_head[h]) for h in range(k)) if votes[s] == best)
    if layers_n < 1:
        raise HeadsFormatError("heads have no residual block (key '0.0.linear.weight' missing)")
    for h in range(k):
        expected = _expected_keys(h, layers_n, own)
        extra = sorted(by_head[h] - set(expected))
        if extra:
            raise HeadsFormatError(f"unexpected key {extra[0]!r} in heads file: the heads have "
                                   f"{_describe(layers_n, own)} each")
        missing = [key for key in expected if key not in by_head[h]]
        if missing:
            raise HeadsFormatError(f"heads file is missing key {missing[0]!r} (the heads have "
                                   f"{_describe(layers_n, own)} each)")
    if num_heads is not None and num_heads != k:
        raise HeadsFormatError(f"config says {num_heads} heads but the weights hold {k}")
    if num_layers is not None and num_layers != layers_n:
        raise HeadsFormatError(f"config says {num_layers} layers per head but the weights hold {layers_n}")
    d, v = hidden_size, vocab_size
    for h in range(k):
        for key in _expected_keys(h, layers_n, own):
            shape = (v, d) if key.endswith(f".{layers_n}.weight") else (d, d) if key.endswith("weight") else (d,)
            if tuple(tensors[key].shape) != shape:
                backbone = f"backbone vocab {v}, hidden {d}" if shape == (v, d) else f"backbone hidden size {d}"
                raise HeadsFormatError(f"key {key!r} has shape {tuple(tensors[key].shape)}, expected {shape} "
                                       f"({backbone})")
    return HeadsConfig(k, layers_n, d, v, own)


def stated_heads_config(
    tensors: dict,
    *,
    hidden_size: int,
    vocab_size: int,
    num_heads: int | None = None,
    num_layers: int | None = None,
    counts_from: str | None = None,
) -> HeadsConfig:
    """:func:`infer_heads_config` with the counts a file states: ours strictly, a third party's with a warning.

    Args:
        tensors: the heads' tensors, or anything with their shapes (meta tensors from headers).
        hidden_size, vocab_size: the backbone's d and V.
        num_heads, num_layers: the counts a config states (None: not stated).
        counts_from: None when they come from our own ``heads.json`` (a disagreement is an error);
            else the third-party file they come from (e.g. ``config.json``), whose counts are known
            to be wrong at times (FasterDecoding's medusa-vicuna-7b-v1.3 says 2 heads for its 5):
            the weights' counts are used and a disagreement is a :class:`~medusa_export.errors.NoteWarning`
            (``medusa-export`` prints it as a ``[note: ...]`` line).

    Raises:
        HeadsFormatError: see :func:`infer_heads_config`.
    """
    strict = counts_from is None
    cfg = infer_heads_config(tensors, hidden_size=hidden_size, vocab_size=vocab_size,
                             num_heads=num_heads if strict else None, num_layers=num_layers if strict else None)
    stated = {"heads": (num_heads, cfg.num_heads), "layers per head": (num_layers, cfg.num_layers)}
    for what, (said, held) in stated.items():
        if not strict and said is not None and said != held:
            warnings.warn(f"{counts_from} says {said} {what} but the weights hold {held}: the weights' count is "
                          "used", NoteWarning, stacklevel=3)
    return cfg


def heads_from_tensors(
    tensors: dict[str, torch.Tensor],
    lm_head: nn.Linear,
    *,
    num_heads: int | None = None,
    num_layers: int | None = None,
    counts_from: str | None = None,
) -> MedusaHeads:
    """Build :class:`MedusaHeads` from the heads' tensors (strict: every key used, shapes equal).

    FP8 weights (modelopt) are dequantized with their ``weight_scale``; activation scales are
    dropped (the loader of a full checkpoint keeps them, see :mod:`.fp8`).

    Args:
        tensors: the heads' tensors (no prefix).
        lm_head: the backbone's LM head [V, d].
        num_heads, num_layers, counts_from: the counts a file states and which file (see
            :func:`stated_heads_config`).

    Raises:
        HeadsFormatError: see :func:`infer_heads_config`; a malformed FP8 scale.
    """
    if any(fp8.is_fp8(t) for t in tensors.values()) or any(k.endswith("_scale") for k in tensors):
        try:
            tensors = fp8.dequantize_state(tensors).tensors
        except MedusaError as exc:
            raise HeadsFormatError(f"FP8 heads: {exc}") from None
    vocab, hidden = lm_head.weight.shape
    cfg = stated_heads_config(tensors, hidden_size=hidden, vocab_size=vocab, num_heads=num_heads,
                              num_layers=num_layers, counts_from=counts_from)
    # Built without storage and given the tensors themselves (assign): the heads are never in memory twice
    # (a 7B model's five own-projection heads are 3 GB in float32).
    with torch.device("meta"):
        heads = MedusaHeads(cfg, lm_head)
    dtype = lm_head.weight.dtype
    state = {f"heads.{k}": v.to(dtype) for k, v in tensors.items()}
    result = heads.load_state_dict(state, strict=True, assign=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert not any(t.is_meta for t in (*heads.parameters(), *heads.buffers()))
    return heads


def config_counts(folder: Path) -> tuple[int | None, int | None, str | None]:
    """The head counts stated beside the heads and where: ours (``heads.json``: None), else ``config.json``'s."""
    if (folder / HEADS_CONFIG).is_file():
        meta = json.loads((folder / HEADS_CONFIG).read_text())
        return meta.get("num_heads"), meta.get("num_layers"), None
    if (folder / "config.json").is_file():
        return (*config_head_counts(json.loads((folder / "config.json").read_text())), str(folder / "config.json"))
    return None, None, None


def _heads_in_model_folder(folder: Path) -> dict[str, torch.Tensor]:
    """The prefixed heads' tensors of a full model folder (prefix removed); only their shards are read."""
    try:
        tensors = hf_folder.read_tensors(folder, keep=lambda k: k.startswith(HEAD_PREFIXES))
    except MedusaError as exc:
        raise HeadsFormatError(f"no heads file in {folder}: expected {', '.join(HEAD_FILES)} or a model folder "
                               f"with {' / '.join(HEAD_PREFIXES)} keys ({exc})") from None
    _, heads, prefix = split_heads(tensors)
    if prefix is None:
        raise HeadsFormatError(f"no Medusa heads in the model folder {folder}: no key starts with "
                               f"{' or '.join(HEAD_PREFIXES)}")
    return heads


def stated_head_type(folder: Path) -> str:
    """The head type our ``heads.json`` in ``folder`` states ("medusa" when absent or without one).

    Raises:
        HeadsFormatError: a head type this version does not read (the valid ones are named).
    """
    cfg = folder / HEADS_CONFIG
    head_type = json.loads(cfg.read_text()).get("head_type", "medusa") if cfg.is_file() else "medusa"
    if head_type not in HEAD_TYPES:
        raise HeadsFormatError(f"{cfg}: unknown head_type {head_type!r}; this version reads {', '.join(HEAD_TYPES)}")
    return head_type


def hydra_expected_shapes(num_heads: int, num_layers: int, hidden: int) -> dict[str, tuple[int, ...]]:
    """Every key of a hydra heads file and its shape (:mod:`medusa_export.model.hydra_heads` docstring)."""
    out: dict[str, tuple[int, ...]] = {}
    for h in range(num_heads):
        for part in ("res", "linear"):
            out[f"{h}.0.{part}.weight"], out[f"{h}.0.{part}.bias"] = (hidden, (h + 2) * hidden), (hidden,)
        for lay in range(1, num_layers):
            out[f"{h}.{lay}.linear.weight"], out[f"{h}.{lay}.linear.bias"] = (hidden, hidden), (hidden,)
    return out


def hydra_heads_config(shapes: dict[str, tuple], *, hidden: int, vocab: int, num_heads: int,
                       num_layers: int) -> HeadsConfig:
    """The structure of hydra heads, checked strictly against their tensors' shapes (every key used, shapes equal).

    Args:
        shapes: key -> shape of the heads file's tensors (no prefix).
        hidden, vocab: the backbone's d and V.
        num_heads, num_layers: what ``heads.json`` states.

    Raises:
        HeadsFormatError: a missing or unexpected key, or a shape that does not fit the backbone
            (the message names the key and the expected shape).
    """
    expected = hydra_expected_shapes(num_heads, num_layers, hidden)
    for key in shapes:
        if key not in expected:
            raise HeadsFormatError(f"unexpected key {key!r} in hydra heads file ({num_heads} heads, {num_layers} "
                                   f"blocks each); expected keys like '0.0.res.weight', '0.1.linear.weight'")
    for key, shape in expected.items():
        if key not in shapes:
            raise HeadsFormatError(f"hydra heads file is missing key {key!r}")
        if tuple(shapes[key]) != shape:
            raise HeadsFormatError(f"key {key!r} has shape {tuple(shapes[key])}, expected {shape} "
                                   f"(backbone hidden size {hidden})")
    return HeadsConfig(num_heads, num_layers, hidden, vocab, False, head_type="hydra")


def hydra_heads_from_tensors(tensors: dict[str, torch.Tensor], lm_head: nn.Linear, embed_tokens: nn.Embedding, *,
                             num_heads: int, num_layers: int) -> HydraHeads:
    """Build :class:`HydraHeads` from checked tensors (strict: every key used, shapes equal).

    Raises:
        HeadsFormatError: see :func:`hydra_heads_config`.
    """
    vocab, hidden = lm_head.weight.shape
    cfg = hydra_heads_config({k: tuple(v.shape) for k, v in tensors.items()}, hidden=hidden, vocab=vocab,
                             num_heads=num_heads, num_layers=num_layers)
    heads = HydraHeads(cfg, lm_head, embed_tokens)
    dtype = lm_head.weight.dtype
    heads.load_state_dict({f"heads.{k}": v.to(dtype) for k, v in tensors.items()}, strict=True)
    return heads.to(dtype)


def load_heads(path: str | Path, lm_head: nn.Linear, embed_tokens: nn.Embedding | None = None) -> nn.Module:
    """Load heads from a directory or file in any supported format.

    Args:
        path: a directory holding ``heads.safetensors`` (+ ``heads.json``),
            ``medusa_lm_head.safetensors`` or ``medusa_lm_head.pt`` (+ optional ``config.json``),
            or a full model folder with ``medusa_head.`` / ``medusa_heads.`` keys (medusa-1.0,
            modelopt; only the shards holding heads are read); or a heads file directly.
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
        file = next((path / n for n in HEAD_FILES if (path / n).is_file()), None)
        folder = path
        tensors = read_head_tensors(file) if file else _heads_in_model_folder(path)
    else:
        folder = path.parent
        tensors = read_head_tensors(path)
    num_heads, num_layers, counts_from = config_counts(folder)
    if stated_head_type(folder) == "hydra":
        if embed_tokens is None:
            raise HeadsFormatError(f"{path}: path-conditioned (hydra) heads need the backbone's input embedding")
        if num_heads is None or num_layers is None:
            raise HeadsFormatError(f"{folder / HEADS_CONFIG}: hydra heads need num_heads and num_layers")
        return hydra_heads_from_tensors(tensors, lm_head, embed_tokens, num_heads=num_heads, num_layers=num_layers)
    return heads_from_tensors(tensors, lm_head, num_heads=num_heads, num_layers=num_layers, counts_from=counts_from)
