"""``accuracies.json``: the calibrated per-head top-i accuracies saved beside a set of heads.

``accuracies[k-1][i]`` = a_k^(i), the probability that head k's i-th choice (0-based) is the
right token (Medusa paper §2.3.3); :mod:`medusa_export.training.calibrate` measures and writes
them, the registry reads them with :func:`load_accuracies` when it loads the heads.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .heads_formats import file_beside_heads

ACCURACIES_FILE = "accuracies.json"
ACCURACIES_FORMAT = "medusa-export-accuracies"


def load_accuracies_doc(heads_dir: str | Path) -> dict | None:
    """The whole ``accuracies.json`` beside a set of heads (its ``calibration`` map and ``simulated``
    tokens/step too, when ``calibrate`` wrote them), or None when there is none.

    ``heads_dir`` may also be a heads file; its folder is searched.
    """
    path = file_beside_heads(heads_dir, ACCURACIES_FILE)
    if path is None:
        return None
    data = json.loads(path.read_text())
    return data if data.get("format") == ACCURACIES_FORMAT else None


def load_accuracies(heads_dir: str | Path) -> np.ndarray | None:
    """The a_k^(i) saved beside a set of heads, or None when there are none.

    ``heads_dir`` may also be a heads file; its folder is searched.
    """
    data = load_accuracies_doc(heads_dir)
    return None if data is None else np.asarray(data["accuracies"], dtype=np.float64)
