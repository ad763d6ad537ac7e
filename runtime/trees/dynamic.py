"""Per-step trees (``--tree dynamic:T``), and :data:`StepTree`: what the decode loop runs, a static or a per-step tree.

Both kinds answer the same questions, so callers need not branch on the type (issue 38):

==================  ======================================  ==========================================
                    :class:`~medusa_runtime.trees.tree.Tree`  :class:`DynamicTree`
==================  ======================================  ==========================================
``size``            nodes T, root included                  T, the same every step
``topk``            candidates per head                     candidates per head and parent
``max_depth``       its deepest node                        K (the heads), 0 when T = 1
``policy``          "static"                                "dynamic"
``policy_spec``     "" (the manifest's ``tree.policy``)     ``dynamic:T``
``static_shape()``  itself                                  the greedy T-node tree (fixed-tree engines)
==================  ======================================  ==========================================

Only the candidate choice (:func:`medusa_runtime.decode.candidates.plan_for`) reads ``policy``; everything else
reads the common attributes. Pure numpy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union

import numpy as np

from ..errors import InvalidTreeError
from .tree import DEFAULT_TOPK, Tree, default_accuracies, greedy_tree

#: Beam width W of per-step trees for path-conditioned heads (EAGLE-2 uses 10 on a GPU).
DEFAULT_WIDTH = 8


def raw_probability(depth: int, logprobs: np.ndarray) -> np.ndarray:
    """The uncalibrated estimate of a candidate being right: P(right) = exp(log-probability), float64, any shape."""
    return np.exp(np.asarray(logprobs, dtype=np.float64))


@dataclass(frozen=True)
class DynamicTree:
    """A per-step tree of fixed size: what ``--tree dynamic:T`` asks for (chosen each step by
    :mod:`medusa_runtime.decode.candidates`).

    Attributes:
        size: T, nodes per step (root included), the same every step.
        num_heads: heads K (the depth limit).
        topk: candidates taken per head and parent.
        width: W, nodes expanded per level by path-conditioned heads (the beam; EAGLE-2 uses 10).
        calibration: the heads' calibration map ``(depth, logprobs) -> P(right)`` (a
            :class:`~medusa_runtime.trees.calibration.ProbabilityMap`), or None for raw probabilities.

    Raises:
        InvalidTreeError: size < 1, width/topk/num_heads < 1, or more nodes than K heads of top-k with
            beam W can give (the message names the most).
    """

    size: int
    num_heads: int
    topk: int = DEFAULT_TOPK
    width: int = DEFAULT_WIDTH
    calibration: Callable[[int, np.ndarray], np.ndarray] | None = None

    def __post_init__(self) -> None:
        if self.size < 1:
            raise InvalidTreeError(f"a per-step tree needs at least 1 node (the root), got {self.size}")
        if self.width < 1 or self.topk < 1 or self.num_heads < 1:
            raise InvalidTreeError(f"width, topk and num_heads must be >= 1, got {self.width}, {self.topk}, "
                                   f"{self.num_heads}")
        most, level = 0, 1
        for _ in range(self.num_heads):  # each level expands at most W of the previous level's nodes
            level = min(level, self.width) * self.topk
            most += level
        if self.size - 1 > most:
            raise InvalidTreeError(f"a per-step tree of {self.size} nodes needs more candidates than {self.num_heads} "
                                   f"heads x top-{self.topk} (beam {self.width}) give ({most}); choose at most "
                                   f"{most + 1} nodes")

    @property
    def max_depth(self) -> int:
        return self.num_heads if self.size > 1 else 0

    #: Per-step trees (:data:`StepTree`'s "dynamic").
    policy = "dynamic"

    @property
    def policy_spec(self) -> str:
        """The ``--tree`` word that asks for it (``dynamic:T``; the manifest's ``tree.policy``)."""
        return f"dynamic:{self.size}"

    def static_shape(self, accuracies: np.ndarray | None = None) -> Tree:
        """The static tree of the same size: what a fixed-tree engine (TensorRT plans) is built for and what step
        timings measure. The greedy T-node tree of ``accuracies`` (float [K', topk] a_k^(i), Medusa paper §2.3.3;
        None: :func:`~medusa_runtime.trees.tree.default_accuracies`), rows beyond K ignored."""
        acc = default_accuracies(self.num_heads, self.topk) if accuracies is None else np.asarray(accuracies)
        return greedy_tree(self.size, acc[:self.num_heads], topk=min(self.topk, acc.shape[1]))

    def probability(self) -> Callable[[int, np.ndarray], np.ndarray]:
        """The map log-probability -> P(right) it uses (calibrated, or :func:`raw_probability`)."""
        return self.calibration if self.calibration is not None else raw_probability


#: What the decode loop runs: a static tree or a per-step one (the module's table lists what both answer).
StepTree = Union[Tree, DynamicTree]
