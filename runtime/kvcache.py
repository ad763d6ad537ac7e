"""KV-cache index compaction after acceptance (Medusa paper Algorithm step 6).

Two layouts, named in the artifact's manifest (``kv_layout.layout``):

* ``sequence-major`` (portable graphs): one buffer per layer and per K/V, shaped [1,
  capacity, KV heads, head_dim], so the valid prefix ``[:, :past_len]`` is a contiguous view
  handed to the engine without a copy. A step returns the K/V of its T tree nodes and the
  accepted ones are copied into the next slots (:func:`write_accepted`).
* ``head-major`` (the ``ort-fused`` graph, whose GroupQueryAttention reads [1, KV heads,
  capacity, head_dim]): the step writes node j's K/V straight into slot ``past_len + j``
  of the whole buffer, and compaction only moves the accepted nodes that are not in place
  (:func:`compact_in_place`, a strided copy along the slot axis 2).

Either way the accepted nodes end in slots ``past_len .. past_len + n - 1`` in root-to-leaf
order, so the cache stays contiguous and equals the cache of feeding the accepted tokens
one by one.

Pure numpy; works on any array type that supports fancy indexing on the slot axis.
"""

from __future__ import annotations

import numpy as np

from .errors import ContextOverflowError


def compaction_slots(past_len: int, accepted: np.ndarray, capacity: int) -> np.ndarray:
    """Destination slots of the accepted nodes: int64 [n] = past_len + arange(n).

    Args:
        past_len: valid slots before the step.
        accepted: int [n] accepted node indices (root first).
        capacity: slots in the buffer.

    Raises:
        ContextOverflowError: the accepted nodes would not fit the buffer.
    """
    n = len(accepted)
    if past_len + n > capacity:
        raise ContextOverflowError(
            f"{n} accepted tokens do not fit: {past_len} of {capacity} cache slots are in use"
        )
    return np.arange(past_len, past_len + n, dtype=np.int64)


def write_accepted(cache: np.ndarray, new: np.ndarray, past_len: int, accepted: np.ndarray) -> int:
    """Copy the accepted nodes' K or V from a step output into the cache, in place.

    Args:
        cache: [1, capacity, H_kv, D] buffer (valid prefix ``[:, :past_len]``).
        new: [1, T, H_kv, D] this step's K or V for every tree node.
        past_len: valid slots before the step.
        accepted: int [n] node indices, root first.

    Returns:
        The new valid length, past_len + n.
    """
    slots = compaction_slots(past_len, accepted, cache.shape[1])
    cache[:, slots[0] : slots[-1] + 1] = new[:, np.asarray(accepted)]
    return past_len + len(accepted)


def fits(past_len: int, step_tokens: int, capacity: int) -> bool:
    """Whether a step of ``step_tokens`` tree nodes fits after ``past_len`` slots."""
    return past_len + step_tokens <= capacity


def in_place_moves(accepted: np.ndarray) -> list[tuple[int, int]]:
    """Row moves that compact a step's K/V written straight into the cache after the past.

    When the step's output rows are the cache slots ``past_len + j`` (node j), compaction
    only has to move node ``accepted[i]`` to row ``i`` where they differ. Node indices on a
    root-to-leaf path increase, so ``accepted[i] >= i`` and moving in order never reads a
    row an earlier move wrote.

    Args:
        accepted: int [n] node indices, root first, increasing.

    Returns:
        (source row, destination row) pairs relative to ``past_len``, in the order to apply.

    Raises:
        ValueError: the indices do not increase.
    """
    acc = [int(a) for a in np.asarray(accepted).reshape(-1)]
    if any(b <= a for a, b in zip(acc, acc[1:])):
        raise ValueError(f"accepted node indices must increase along a path, got {acc}")
    return [(a, i) for i, a in enumerate(acc) if a != i]


def compact_in_place(cache: np.ndarray, past_len: int, accepted: np.ndarray, slot_axis: int = 2) -> int:
    """Compact a step's K or V that the step wrote into the cache itself (node j at slot past_len + j).

    Node ``accepted[i]`` moves to slot ``past_len + i`` (:func:`in_place_moves`); every other
    slot is left as it is. One fancy-indexed copy moves all rows (its source is read before
    it is written).

    Args:
        cache: the buffer, slots along ``slot_axis`` (e.g. [1, H_kv, capacity, D] with axis 2,
            or [L, 1, H_kv, capacity, D] for every layer at once with axis 3).
        past_len: valid slots before the step.
        accepted: int [n] node indices, root first, increasing.
        slot_axis: the slot axis of ``cache``.

    Returns:
        The new valid length, past_len + n.

    Raises:
        ContextOverflowError: the accepted nodes would not fit the buffer.
        ValueError: the indices do not increase.
    """
    compaction_slots(past_len, accepted, cache.shape[slot_axis])
    moves = in_place_moves(accepted)
    if moves:
        src, dst = (past_len + np.array(m, dtype=np.int64) for m in zip(*moves))
        index = (slice(None),) * slot_axis
        cache[index + (dst,)] = cache[index + (src,)]
    return past_len + len(accepted)
