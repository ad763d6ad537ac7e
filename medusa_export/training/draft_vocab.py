"""Making a draft vocabulary (``draft_vocab.json``): token ids by frequency in self-distillation replies.

The file, what it is for (the FR-Spec idea) and its reader are in
:mod:`medusa_export.loading.draft_vocab`; ``scripts/draft_vocab.py`` writes a model's file from the
``replies.jsonl`` of ``medusa-export train-heads`` (training replies, never evaluation data).

Pure logic (:func:`frequency_order`, :func:`coverage`, :func:`draft_vocab_json`) is separate from
the file I/O (:func:`write_draft_vocab`).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from ..loading.draft_vocab import DRAFT_VOCAB_FILE, DRAFT_VOCAB_FORMAT

#: Subset sizes whose coverage the file records.
COVERAGE_SIZES = (2048, 4096, 8192, 16384)


def frequency_order(replies: Iterable[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Count token ids over replies.

    Args:
        replies: token id lists.

    Returns:
        (ids int64 [M], counts int64 [M]): the distinct ids, most frequent first (ties: lower id first).
    """
    counts: Counter[int] = Counter()
    for r in replies:
        counts.update(int(t) for t in r)
    order = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return (np.asarray([k for k, _ in order], dtype=np.int64).reshape(-1),
            np.asarray([v for _, v in order], dtype=np.int64).reshape(-1))


def coverage(counts: np.ndarray, sizes: Sequence[int] = COVERAGE_SIZES) -> dict[str, float]:
    """Share of all counted tokens covered by the top-n ids, for each n in ``sizes``.

    Args:
        counts: int [M], sorted descending (:func:`frequency_order`).
        sizes: subset sizes.
    """
    total = max(int(counts.sum()), 1)
    cum = np.concatenate([[0], np.cumsum(counts)])
    return {str(n): round(float(cum[min(n, len(counts))]) / total, 6) for n in sizes}


def draft_vocab_json(ids: np.ndarray, counts: np.ndarray, *, vocab_size: int, source: str) -> dict:
    """The ``draft_vocab.json`` document (its format: :mod:`medusa_export.loading.draft_vocab`)."""
    return {"format": DRAFT_VOCAB_FORMAT, "version": 1, "vocab_size": int(vocab_size), "source": source,
            "total_tokens": int(counts.sum()), "distinct_ids": int(len(ids)), "coverage": coverage(counts),
            "ids": [int(i) for i in ids]}


def write_draft_vocab(doc: dict, out_dir: str | Path) -> Path:
    """Write ``doc`` (:func:`draft_vocab_json`) as ``out_dir/draft_vocab.json``; returns the path."""
    path = Path(out_dir) / DRAFT_VOCAB_FILE
    head = json.dumps({k: v for k, v in doc.items() if k != "ids"}, indent=1)[:-2]
    path.write_text(head + ',\n "ids": ' + json.dumps(doc["ids"], separators=(",", ":")) + "\n}\n")
    return path
