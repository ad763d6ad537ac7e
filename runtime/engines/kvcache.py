"""The KV caches (:class:`KVCache`, :class:`HeadMajorKVCache`, the base :class:`CacheState` of the device
caches) and their index compaction after acceptance (Medusa paper Algorithm step 6).

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

from collections import abc
from typing import NamedTuple, Sequence

import numpy as np

from ..errors import ContextOverflowError
from .base import Engine


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


class CacheState:
    """What every KV cache tracks besides its buffers (base of :class:`KVCache` and the device caches).

    Attributes:
        capacity: slots (tokens).
        length: valid slots (the past length P).
        tokens: the token id whose K/V is in each valid slot (len == length; -1 if unknown),
            so that a later prompt sharing a prefix can reuse the cache (multi-turn chat).
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.length = 0
        self.tokens: list[int] = []

    def _advance(self, accepted: np.ndarray, token_ids: Sequence[int] | None) -> None:
        """Count ``len(accepted)`` newly kept slots and record their tokens."""
        self.length += len(accepted)
        self.tokens.extend([int(t) for t in token_ids] if token_ids is not None else [-1] * len(accepted))

    def free(self) -> None:
        """Return the cache's memory now. Host caches have nothing to do (the garbage collector frees numpy
        buffers); device caches (:class:`~.trt.TrtKVCache`) free their allocation. Whoever made a cache frees
        it: the loop for the cache of a generation, the batch scheduler's ``release`` for a row,
        ``MedusaSession.close`` for the chat cache."""

    def truncate(self, length: int) -> None:
        """Keep only the first ``length`` slots (no copy; later steps overwrite the rest).

        Raises:
            ValueError: ``length`` is negative or beyond the valid length.
        """
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {length}")
        self.length = length
        del self.tokens[length:]


class KVCache(CacheState):
    """Per-layer K and V numpy buffers [1, capacity, H_kv, D], reused across steps."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int, dtype=np.float32):
        super().__init__(capacity)
        shape = (1, capacity, num_kv_heads, head_dim)
        self.keys = [np.zeros(shape, dtype) for _ in range(num_layers)]
        self.values = [np.zeros(shape, dtype) for _ in range(num_layers)]

    @classmethod
    def for_engine(cls, engine: Engine, capacity: int):
        """The engine's own cache type when it declares one (``capabilities.own_cache``: ``make_cache``),
        else a numpy :class:`KVCache` of its geometry."""
        if engine.capabilities.own_cache:
            return engine.make_cache(capacity)
        return cls(engine.num_layers, engine.num_kv_heads, engine.head_dim, capacity, engine.kv_dtype)

    def past(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Contiguous views of the valid prefix, per layer ([1, length, H_kv, D] each); no copy."""
        n = self.length
        return [(k[:, :n], v[:, :n]) for k, v in zip(self.keys, self.values)]

    def keep(self, new_kv, accepted: np.ndarray, token_ids: Sequence[int] | None = None) -> None:
        """Copy the accepted nodes' K/V (root first) into the next slots (KV compaction).

        Args:
            new_kv: per layer (key, value) [1, S, H_kv, D], the step's K/V.
            accepted: int [n] node indices, root first.
            token_ids: the n accepted tokens (recorded in :attr:`tokens`); -1 when unknown.
        """
        for ck, cv, (k, v) in zip(self.keys, self.values, new_kv):
            write_accepted(ck, np.asarray(k), self.length, accepted)
            write_accepted(cv, np.asarray(v), self.length, accepted)
        self._advance(accepted, token_ids)


class LayerKV(abc.Sequence):
    """A step's new K/V as a sequence of per-layer ``(key, value)`` views, made when read.

    ``keys`` / ``values``: [L, 1, S, H_kv, D] views of a :class:`HeadMajorKVCache`. The decode loop of an
    in-place cache never reads them (:meth:`HeadMajorKVCache.keep` ignores ``new_kv``), so building the
    2 L per-layer views at every step was host time spent for nothing: 41 us per step for the embedded
    model's 30 layers (57 us with a padded step's row slicing), 1.7 us as two views (timeit, 2-core EPYC,
    2026-12-07).
    """

    def __init__(self, keys: np.ndarray, values: np.ndarray):
        self.keys, self.values = keys, values

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        return self.keys[layer], self.values[layer]

    def rows(self, count: int) -> "LayerKV":
        """The first ``count`` rows of every layer (views)."""
        return LayerKV(self.keys[:, :, :count], self.values[:, :, :count])


class InPlacePast(NamedTuple):
    """What :meth:`HeadMajorKVCache.past` hands to the engine: the cache and its valid length."""

    cache: "HeadMajorKVCache"
    length: int


class HeadMajorKVCache(CacheState):
    """Head-major K and V numpy buffers that the engine's step writes into (``ort-fused`` artifacts).

    ``keys`` / ``values`` are [L, 1, H_kv, capacity, D]; layer l's buffer ``keys[l]`` is the
    contiguous [1, H_kv, capacity, D] array GroupQueryAttention reads and writes in place: a
    step of S tokens after P valid slots writes node j's K/V into slot P + j. :meth:`keep`
    then only moves the accepted nodes that are not in place (strided copy on the slot axis).
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int, dtype=np.float32):
        super().__init__(capacity)
        shape = (num_layers, 1, num_kv_heads, capacity, head_dim)
        self.keys = np.zeros(shape, dtype)
        self.values = np.zeros(shape, dtype)

    def past(self) -> InPlacePast:
        """The cache and its current valid length (the engine binds the whole buffers)."""
        return InPlacePast(self, self.length)

    def new_kv(self, start: int, count: int) -> "LayerKV":
        """Views of slots [start, start + count) per layer, as [1, count, H_kv, D] (no copy; valid
        until the next step or :meth:`keep` changes those slots)."""
        sl = slice(start, start + count)
        order = (0, 1, 3, 2, 4)  # [L, 1, H_kv, count, D] -> [L, 1, count, H_kv, D]
        return LayerKV(self.keys[:, :, :, sl].transpose(order), self.values[:, :, :, sl].transpose(order))

    def keep(self, new_kv, accepted: np.ndarray, token_ids: Sequence[int] | None = None) -> None:
        """Compact after a step that wrote node j to slot length + j (``new_kv`` is not read).

        Args:
            new_kv: the step's ``StepResult.new_kv`` (views of this cache; ignored).
            accepted: int [n] node indices, root first, increasing.
            token_ids: the n accepted tokens (recorded in :attr:`tokens`); -1 when unknown.
        """
        for buf in (self.keys, self.values):
            compact_in_place(buf, self.length, accepted, slot_axis=3)
        self._advance(accepted, token_ids)
