"""Draft vocabularies: the tokens a model's Medusa heads may propose (the FR-Spec idea), read from file.

The heads only propose candidates that the backbone verifies, so their vocabulary projection
may be restricted to the N most frequent tokens: the output stays exactly the backbone's
greedy/typical output, the heads graph reads an [N, d] matrix instead of [V, d] (its whole
cost on a CPU), and a correct guess outside the subset is lost.

``draft_vocab.json`` (beside the heads, e.g. ``models/smollm2-135m/``)::

    {"format": "medusa-export-draft-vocab", "version": 1, "vocab_size": V,
     "source": "...", "total_tokens": n, "coverage": {"2048": 0.89, ...},
     "ids": [most frequent id, ...]}   # every distinct id seen, most frequent first

:func:`load_draft_vocab` reads it (the registry, beside the heads it loads); :func:`subset_ids`
is the pure choice of the heads' subset (``build --heads-vocab N``). The file is made from
self-distillation replies by :mod:`medusa_export.training.draft_vocab`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import MedusaError
from .heads_formats import file_beside_heads

DRAFT_VOCAB_FILE = "draft_vocab.json"
DRAFT_VOCAB_FORMAT = "medusa-export-draft-vocab"


class HeadsVocabError(MedusaError, ValueError):
    """A ``--heads-vocab`` size the model cannot take; the message names the valid choices."""


@dataclass(frozen=True)
class DraftVocab:
    """A model's token ids by frequency.

    Attributes:
        ids: int64 [M], distinct token ids, most frequent first (M <= V).
        source: where the frequencies came from (one line).
        path: the file it was read from ("" when built in memory).
    """

    ids: np.ndarray
    source: str
    path: str = ""


def subset_ids(draft: DraftVocab | None, n: int, vocab_size: int, topk: int, *, model: str = "the model") -> np.ndarray:
    """The heads' token subset: the top-``n`` ids of the draft vocabulary.

    When ``n`` exceeds the ids the draft vocabulary saw, the subset is completed with the
    unseen ids in ascending order (so any n <= V is valid).

    Args:
        draft: the model's draft vocabulary (None: it has none).
        n: subset size, topk <= n <= vocab_size.
        vocab_size: V.
        topk: candidates per head (the heads graph's top-k needs n >= topk).
        model: model name for messages.

    Returns:
        int64 [n], distinct ids in [0, V), most frequent first.

    Raises:
        HeadsVocabError: no draft vocabulary, ``n`` outside [topk, V], or ids outside [0, V).
    """
    if n < topk or n > vocab_size:
        raise HeadsVocabError(f"--heads-vocab {n} is out of range: choose 0 (the full vocabulary of {vocab_size}) "
                              f"or a size from {topk} (the tree's top-k) to {vocab_size}")
    if draft is None:
        raise HeadsVocabError(f"--heads-vocab {n} needs a draft vocabulary ({DRAFT_VOCAB_FILE} beside the heads) and "
                              f"{model} has none; choose --heads-vocab 0 (the full vocabulary)")
    ids = np.asarray(draft.ids, dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise HeadsVocabError(f"draft vocabulary {draft.path or draft.source!r} holds ids outside [0, {vocab_size})")
    if len(np.unique(ids)) != len(ids):
        raise HeadsVocabError(f"draft vocabulary {draft.path or draft.source!r} repeats ids")
    if n > len(ids):
        seen = np.zeros(vocab_size, dtype=bool)
        seen[ids] = True
        ids = np.concatenate([ids, np.flatnonzero(~seen).astype(np.int64)])
    return ids[:n].copy()


def load_draft_vocab(heads_dir: str | Path | None) -> DraftVocab | None:
    """The draft vocabulary beside a set of heads (a folder, or a heads file's folder), or None.

    Raises:
        HeadsVocabError: the file exists but is not a draft vocabulary.
    """
    path = None if heads_dir is None else file_beside_heads(heads_dir, DRAFT_VOCAB_FILE)
    if path is None:
        return None
    data = json.loads(path.read_text())
    if data.get("format") != DRAFT_VOCAB_FORMAT or not isinstance(data.get("ids"), list):
        raise HeadsVocabError(f"{path}: not a draft vocabulary (format {data.get('format')!r}, "
                              f"expected {DRAFT_VOCAB_FORMAT!r})")
    return DraftVocab(np.asarray(data["ids"], dtype=np.int64).reshape(-1), str(data.get("source", "")), str(path))
