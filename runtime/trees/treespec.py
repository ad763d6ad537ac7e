"""The ``--tree`` grammar, in one place: what a tree spec may say, and the tree it resolves to.

Pure (no engine, no model); the only I/O is reading a tree JSON file. ``medusa-export build``, the
runtime's CLIs, :class:`~medusa_runtime.front.session.MedusaSession`, Triton and the tree cache all parse a
spec with :func:`parse_tree_spec` and resolve it with :func:`tree_from_spec`; no other module spells a
spec's words.

==================  ===============  ======================================================================
spec                kind             meaning
==================  ===============  ======================================================================
``N`` (e.g. 64)     ``size``         the greedy N-node tree from the heads' accuracies (Medusa paper §2.3.3)
``root``/``chain``  ``preset``       :data:`PRESETS`
``chain:N``         ``chain``        the heads' top-1 guesses in a chain of N nodes, root included (1..K+1)
``dynamic:T``       ``dynamic``      a T-node tree chosen every step (:class:`DynamicTree`)
``auto``            ``auto``         the size with the most expected tokens/s, timed on an engine
``auto:dynamic``    ``auto``         the same over per-step trees
``artifact``        ``artifact``     the tree an artifact was built with
``FILE``            ``file``         a JSON file of ``medusa_choices`` (:func:`~medusa_runtime.trees.tree.load_tree`)
==================  ===============  ======================================================================

``auto`` and ``artifact`` need an artifact (an engine to time, a tree it was built with), so
:func:`tree_from_spec` refuses them; the session and the build resolve them (the session through
:mod:`medusa_runtime.tuning.autotree` and :mod:`medusa_runtime.tuning.treecache`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import InvalidTreeError
from .dynamic import DynamicTree, StepTree
from .tree import DEFAULT_TOPK, chain_tree, default_accuracies, greedy_tree, load_tree, make_tree

#: ``--tree auto``: time the tree step at several sizes on the engine, keep the fastest (medusa_runtime.tuning.autotree).
AUTO = "auto"
#: ``--tree auto:dynamic``: the same over per-step trees.
AUTO_DYNAMIC = f"{AUTO}:dynamic"
#: ``--tree artifact``: the tree the artifact was built with.
ARTIFACT = "artifact"
#: ``--tree dynamic:T``: a T-node tree chosen every step.
DYNAMIC_PREFIX = "dynamic:"
#: Named static trees.
PRESETS = {
    "root": "root only (T=1): plain one-token-per-step decoding through the tree step",
    "chain": "each head's top-1 guess in a chain (T = 1 + num_heads)",
}
#: ``--tree chain:N``: a chain of N nodes (the root and the first N - 1 heads' top-1 guesses).
CHAIN_PREFIX = "chain:"
#: The kinds of spec (:attr:`TreeSpec.kind`).
KINDS = ("size", "preset", "chain", "dynamic", "auto", "artifact", "file")

_FILE_OR_PRESET = f"a JSON file of medusa_choices, or a preset: {', '.join(sorted(PRESETS))}"
#: What a spec may be, for error messages.
CHOICES = (f"a node budget (e.g. 64), {CHAIN_PREFIX}N (a chain of N nodes), {DYNAMIC_PREFIX}T (a T-node tree chosen every step), {AUTO} or "
           f"{AUTO_DYNAMIC} (measured on this machine), {ARTIFACT} (with an artifact: the tree it was built "
           f"with), {_FILE_OR_PRESET}")
#: What build's ``--tree`` may be (all but ``artifact``: build writes the artifact).
BUILD_TREES = (f"a node budget (e.g. 64), {CHAIN_PREFIX}N, {DYNAMIC_PREFIX}T, {AUTO} or {AUTO_DYNAMIC} (timed after the "
               f"export), {_FILE_OR_PRESET}")


@dataclass(frozen=True)
class TreeSpec:
    """A parsed ``--tree`` value.

    Attributes:
        text: the spec as given, stripped.
        kind: one of :data:`KINDS`.
        size: the node count of ``size``, ``chain`` and ``dynamic`` specs, else None.
        policy: "dynamic" for ``dynamic:T`` and ``auto:dynamic`` (a tree chosen every step), else "static".
    """

    text: str
    kind: str
    size: int | None = None
    policy: str = "static"


def parse_tree_spec(spec: str | int) -> TreeSpec:
    """Parse a ``--tree`` value (see the module's table); nothing is read.

    Args:
        spec: the value, a str (surrounding whitespace ignored) or a non-negative int node budget.

    Returns:
        The :class:`TreeSpec`.

    Raises:
        InvalidTreeError: an empty spec, ``dynamic:`` without a positive count, a node budget below 1, a path
            that is a directory, or a word that is none of the above; the message lists :data:`CHOICES`.
    """
    if isinstance(spec, bool) or not isinstance(spec, (str, int, np.integer)):
        raise InvalidTreeError(f"a tree spec is a str or an int, got {type(spec).__name__}: give {CHOICES}")
    text = str(spec).strip()
    if not text:
        raise InvalidTreeError(f"--tree is empty: give {CHOICES}")
    if text.startswith(DYNAMIC_PREFIX):
        n = text[len(DYNAMIC_PREFIX):]
        if not re.fullmatch(r"[0-9]+", n) or int(n) < 1:
            raise InvalidTreeError(f"--tree {DYNAMIC_PREFIX}T takes a node count T >= 1 (e.g. {DYNAMIC_PREFIX}6), "
                                   f"got {text!r}")
        return TreeSpec(text, "dynamic", int(n), "dynamic")
    if text.startswith(CHAIN_PREFIX):
        n = text[len(CHAIN_PREFIX):]
        if not re.fullmatch(r"[0-9]+", n) or int(n) < 1:
            raise InvalidTreeError(f"--tree {CHAIN_PREFIX}N takes a node count N >= 1, root included (e.g. "
                                   f"{CHAIN_PREFIX}3), got {text!r}")
        return TreeSpec(text, "chain", int(n))
    if re.fullmatch(r"-?[0-9]+", text):  # a negative budget gets the same message as 0, not "unknown tree"
        if int(text) < 1:
            raise InvalidTreeError(f"a tree has at least 1 node (the root), got --tree {text}: give {CHOICES}")
        return TreeSpec(text, "size", int(text))
    if text in PRESETS:
        return TreeSpec(text, "preset")
    if text in (AUTO, AUTO_DYNAMIC):
        return TreeSpec(text, "auto", policy="dynamic" if text == AUTO_DYNAMIC else "static")
    if text == ARTIFACT:
        return TreeSpec(text, "artifact")
    path = Path(text)
    if path.is_dir():
        raise InvalidTreeError(f"--tree {text} is a directory; a tree file is a JSON file of medusa_choices. "
                               f"Give {CHOICES}")
    if path.suffix == ".json" or path.exists():
        return TreeSpec(text, "file")
    raise InvalidTreeError(f"unknown tree {text!r}: give {CHOICES}")


def most_nodes(num_heads: int, topk: int) -> int:
    """The largest tree K heads of top-k can make: 1 + topk + topk^2 + ... + topk^K nodes (root included)."""
    return 1 + sum(topk**d for d in range(1, num_heads + 1))


def tree_from_spec(
    spec: str | int | TreeSpec,
    *,
    num_heads: int,
    accuracies: np.ndarray | None = None,
    topk: int = DEFAULT_TOPK,
    calibration=None,
) -> StepTree:
    """Resolve a ``--tree`` value that needs no artifact: a node budget, a preset, ``dynamic:T`` or a JSON file.

    Args:
        spec: a spec (see :func:`parse_tree_spec`) or an already parsed :class:`TreeSpec`.
        num_heads: number of Medusa heads K.
        accuracies: float [K', topk] calibrated a_k^(i), or None (:func:`~medusa_runtime.trees.tree.default_accuracies`).
            Rows beyond K are ignored.
        topk: candidate top-k for presets, budgets and JSON lists without their own.
        calibration: the heads' :class:`~medusa_runtime.trees.calibration.ProbabilityMap` for per-step trees (None:
            raw probabilities).

    Returns:
        A :class:`~medusa_runtime.trees.tree.Tree`, or a :class:`DynamicTree` for ``dynamic:T``.

    Raises:
        InvalidTreeError: everything :func:`parse_tree_spec` raises; ``auto`` or ``artifact`` (they need an
            artifact: the message says where they work); a node budget above :func:`most_nodes` (it would be
            silently smaller); a missing, unreadable or invalid tree file.
    """
    ts = spec if isinstance(spec, TreeSpec) else parse_tree_spec(spec)
    if ts.kind == "dynamic":
        return DynamicTree(ts.size, num_heads, topk, calibration=calibration)
    if ts.kind == "size":
        most = most_nodes(num_heads, topk)
        if ts.size > most:
            raise InvalidTreeError(f"--tree {ts.size}: {num_heads} heads of top-{topk} make at most {most} nodes "
                                   f"(root included); give 1..{most}")
        acc = default_accuracies(num_heads, topk) if accuracies is None else np.asarray(accuracies)
        return greedy_tree(ts.size, acc[:num_heads], topk=topk)
    if ts.text == "root":
        return make_tree([], num_heads=num_heads, topk=topk)
    if ts.text == "chain":
        return chain_tree(num_heads, topk)
    if ts.kind == "chain":
        return chain_tree(num_heads, topk, ts.size)
    if ts.kind == "auto":
        raise InvalidTreeError(f"--tree {ts.text} times the tree step on an engine, so it needs an artifact: "
                               f"medusa-export build --tree {AUTO}, generate/chat --artifact DIR --tree {AUTO}, "
                               f"or MedusaSession(dir, tree='{AUTO}')")
    if ts.kind == "artifact":
        raise InvalidTreeError(f"--tree {ARTIFACT} means the tree an artifact was built with, so it needs an "
                               f"artifact: generate/chat --artifact DIR --tree {ARTIFACT}, or "
                               f"MedusaSession(dir, tree='{ARTIFACT}')")
    return load_tree(Path(ts.text), num_heads=num_heads, topk=topk)
