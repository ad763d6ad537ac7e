"""The heads' calibration map: P(a head's candidate is right | its log-probability), per head.

Written by ``medusa-export calibrate`` into ``accuracies.json`` and the artifact's ``tree.json``; read
by the artifact loader and by the per-step trees (:mod:`medusa_runtime.decode.candidates`) and their
timing (:mod:`medusa_runtime.tuning.autotree`). Pure numpy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import InvalidTreeError


@dataclass(frozen=True)
class ProbabilityMap:
    """Per head, a monotone map from the head's log-probability of a candidate to P(the candidate is right).

    Fitted on held-out replies by ``medusa-export calibrate`` (isotonic regression over
    log-probability bins); stored as ``calibration`` in ``accuracies.json`` and the artifact's
    ``tree.json``.

    Attributes:
        logprobs: float64 [B], increasing bin centres (log-probabilities <= 0).
        p_right: float64 [K, B], non-decreasing along B, in [0, 1]; head k's P(right) at each centre.
    """

    logprobs: np.ndarray
    p_right: np.ndarray

    def __call__(self, depth: int, logprobs: np.ndarray) -> np.ndarray:
        """P(right) of candidates of the head at ``depth`` (1-based) given their log-probabilities (any shape)."""
        row = self.p_right[min(depth, len(self.p_right)) - 1]
        return np.interp(np.asarray(logprobs, dtype=np.float64), self.logprobs, row)

    def to_json(self) -> dict:
        return {"logprobs": [round(float(x), 5) for x in self.logprobs],
                "p_right": [[round(float(p), 6) for p in row] for row in self.p_right]}

    @classmethod
    def from_json(cls, data: dict) -> "ProbabilityMap":
        """Inverse of :meth:`to_json`.

        Raises:
            InvalidTreeError: shapes that do not match, bins not increasing, or values outside [0, 1].
        """
        x = np.asarray(data["logprobs"], dtype=np.float64)
        p = np.asarray(data["p_right"], dtype=np.float64)
        if x.ndim != 1 or p.ndim != 2 or p.shape[1] != x.size or np.any(np.diff(x) <= 0) \
                or np.any((p < 0) | (p > 1)):
            raise InvalidTreeError(f"bad calibration map: logprobs {x.shape} must increase and p_right "
                                   f"{p.shape} be [heads, {x.size}] probabilities")
        return cls(x, p)
