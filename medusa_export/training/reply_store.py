"""Self-distillation replies stored as token ids: small, resumable, the one thing worth keeping.

Hidden states and teacher targets are recomputed from the ids in batched teacher-forced passes
(:mod:`medusa_export.training.features`), so heads of any type are retrained without
regenerating: 820k reply tokens take 1.6 MB here instead of ~0.95 GB of bf16 hidden states.

A store is a folder:

* ``store.json``: format tag, version, the token dtype, and what made the replies (model source,
  ``max_new_tokens``, EOS ids); written once, checked on every later append;
* ``chunk-[<part>-]NNNNN.npz`` (compressed numpy): one chunk per flush, each holding
  ``ids`` (str [R], the reply ids), ``temperature`` (float32 [R], 0 = greedy),
  ``prompt_offsets`` / ``reply_offsets`` (int64 [R + 1]) and ``prompt_tokens`` /
  ``reply_tokens`` (uint16 when the vocabulary has fewer than 65,536 ids, else uint32; the
  prompts and replies concatenated). A chunk is written to a temporary name and renamed, so a
  store is consistent after any interruption and a restart skips the ids it holds.

Replies are r_0..r_{n-1}, the EOS included when one was generated (the alignment of
:mod:`medusa_export.training.distill`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from ..errors import MedusaError

STORE_FORMAT = "medusa-export-replies"
STORE_VERSION = 1
STORE_META = "store.json"


@dataclass(frozen=True)
class StoredReply:
    """One reply and its prompt, as token ids.

    Attributes:
        id: the reply id (``<prompt id>`` for the greedy reply, ``<prompt id>~s<j>`` for sampled ones).
        prompt: int [P], the prompt's tokens (chat template applied).
        reply: int [n], r_0..r_{n-1}.
        temperature: 0.0 for greedy, else the sampling temperature.
    """

    id: str
    prompt: np.ndarray
    reply: np.ndarray
    temperature: float = 0.0


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 for vocabularies below 65,536 ids, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


class ReplyStore:
    """A folder of stored replies (see the module docstring).

    Args:
        folder: the store's folder (created on the first append).
        vocab_size: the model's vocabulary size (sets the token dtype).
        meta: what made the replies (model source, max_new_tokens, eos ids); recorded in
            ``store.json`` by the first append and compared with it by later ones.
        part: the chunk-name tag of this writer (``p0of2``) when several processes fill one store.

    Raises:
        MedusaError: ``store.json`` of another format, or a different token dtype or meta.
    """

    def __init__(self, folder: str | Path, *, vocab_size: int, meta: dict | None = None, part: str = ""):
        self.folder = Path(folder)
        self.dtype = token_dtype(vocab_size)
        self.meta = {"format": STORE_FORMAT, "version": STORE_VERSION, "token_dtype": self.dtype.name,
                     "vocab_size": int(vocab_size), **(meta or {})}
        self.part = part
        path = self.folder / STORE_META
        if path.is_file():
            have = json.loads(path.read_text())
            if have.get("format") != STORE_FORMAT:
                raise MedusaError(f"{path} is not a reply store (format {have.get('format')!r})")
            diff = {k: (have.get(k), v) for k, v in self.meta.items() if have.get(k) != v}
            if diff:
                raise MedusaError(f"the reply store {self.folder} was made with other settings: "
                                  + ", ".join(f"{k} {a!r} there, {b!r} now" for k, (a, b) in diff.items())
                                  + "; use another --cache folder or the same settings")

    def chunks(self) -> list[Path]:
        """Every chunk file of the store, in name order."""
        return sorted(self.folder.glob("chunk-*.npz"))

    def read(self) -> list[StoredReply]:
        """All stored replies, chunk by chunk (each chunk in its write order)."""
        out = []
        for path in self.chunks():
            with np.load(path, allow_pickle=False) as z:
                po, ro = z["prompt_offsets"], z["reply_offsets"]
                pt, rt = z["prompt_tokens"], z["reply_tokens"]
                for i, (rid, t) in enumerate(zip(z["ids"].tolist(), z["temperature"].tolist())):
                    out.append(StoredReply(str(rid), pt[po[i]:po[i + 1]], rt[ro[i]:ro[i + 1]], float(t)))
        return out

    def ids(self) -> set[str]:
        """The ids of every stored reply."""
        out: set[str] = set()
        for path in self.chunks():
            with np.load(path, allow_pickle=False) as z:
                out.update(str(i) for i in z["ids"].tolist())
        return out

    def append(self, replies: Sequence[StoredReply]) -> Path | None:
        """Write ``replies`` as one new chunk (atomically); returns its path (None when empty).

        Raises:
            MedusaError: a token id outside the store's dtype.
        """
        if not replies:
            return None
        self.folder.mkdir(parents=True, exist_ok=True)
        meta_path = self.folder / STORE_META
        if not meta_path.is_file():
            tmp = meta_path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(self.meta, indent=1) + "\n")
            tmp.replace(meta_path)
        limit = np.iinfo(self.dtype).max

        def pack(arrays: Iterable[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
            arrays = [np.asarray(a, dtype=np.int64).reshape(-1) for a in arrays]
            if any(a.size and (a.min() < 0 or a.max() > limit) for a in arrays):
                raise MedusaError(f"a token id does not fit the store's {self.dtype.name} tokens")
            offsets = np.concatenate([[0], np.cumsum([a.size for a in arrays])]).astype(np.int64)
            flat = np.concatenate(arrays) if arrays else np.zeros(0)
            return offsets, flat.astype(self.dtype)

        po, pt = pack(r.prompt for r in replies)
        ro, rt = pack(r.reply for r in replies)
        tag = f"{self.part}-" if self.part else ""
        existing = list(self.folder.glob(f"chunk-{tag}[0-9]*.npz"))
        path = self.folder / f"chunk-{tag}{len(existing):05d}.npz"
        tmp = self.folder / f".tmp-{path.stem}-{os.getpid()}.npz"
        np.savez_compressed(tmp, ids=np.asarray([r.id for r in replies], dtype=np.str_),
                            temperature=np.asarray([r.temperature for r in replies], dtype=np.float32),
                            prompt_offsets=po, prompt_tokens=pt, reply_offsets=ro, reply_tokens=rt)
        tmp.replace(path)
        return path


def reply_token_count(replies: Sequence[StoredReply]) -> int:
    """Total reply tokens."""
    return int(sum(len(r.reply) for r in replies))
