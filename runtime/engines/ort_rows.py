"""One call of a batched step graph over B rows of possibly different lengths (docs/batching.md).

Artifacts built with ``build --batch-size N`` (N > 1, manifest ``batch``) have a step graph with a
dynamic batch dimension B and per-row past lengths. :func:`run_rows` packs the rows into one call,

* ``input_ids`` / ``position_ids`` [B, S] with S the longest row's new tokens; a shorter row is
  padded (token 0, its last position) and each padding token sees only itself in
  ``new_token_mask`` [B, S, S] while no real token sees it, so the real rows' outputs are those of
  the row alone;
* the past per layer, P the longest row's valid length: [B, P, H_kv, D] (portable graph, each row a
  :class:`~medusa_runtime.engines.kvcache.KVCache`) or [B, H_kv, P, D] (batched fused graph, each row a
  :class:`~medusa_runtime.engines.kvcache.HeadMajorKVCache`): row b's valid slots copied from its own cache, the
  rest zeros that ``past_sequence_length`` [B] masks out;
* ``temperature`` [B], one per row;

then hands each row its own :class:`~medusa_runtime.engines.base.StepResult` (padding cut off), whose K/V
the row's cache keeps (compaction touches that row's buffers only). The batched fused graph returns
the new K/V instead of writing the buffers (GroupQueryAttention is not in it): they are written into
the row's buffer at slots [P_b, P_b + S_b), so its in-place compaction is the batch-1 one.

The packed past is kept between calls (:class:`PackedPast`): while the same rows run, a call copies
only the slots each row kept since the previous call, and the packed length grows in chunks of
:data:`PACK_CHUNK` slots (the graph sees P = the chunk-rounded length; the slots beyond a row's own
length are masked). A row joining or leaving, or the longest row outgrowing the chunk, repacks every
row once (B x P x H_kv x D x 2 x layers elements). A rough measurement on SmolLM2-135M (2 shared, loaded
cores, B = 4, P = 300 and 900) put repacking on every call at 7-26 % of a tree step.

Used by :class:`~.ort.OrtEngine` (a batched graph run as a batch of one) and by
:class:`~.ort_batched.OrtBatchEngine` (every row of a step). Pure numpy + an ``onnxruntime`` session: no torch.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from ..errors import ContextOverflowError
from .base import RowInputs, StepResult
from .kvcache import HeadMajorKVCache


class StepIO(NamedTuple):
    """The step graph's tensor names, as its ``onnxruntime`` session lists them."""

    past_names: list[tuple[str, str]]  # per layer: the (past key, past value) input names
    outputs: list[str]  # every output name, in the session's order
    kv_outputs: list[int]  # indices into ``outputs`` of the new K/V (key, value per layer)

    @property
    def num_layers(self) -> int:
        """Layers (one past pair each)."""
        return len(self.past_names)

    @classmethod
    def of(cls, session, num_layers: int) -> "StepIO":
        """The names of ``session`` (an ``onnxruntime.InferenceSession`` of a step graph of ``num_layers``)."""
        outputs = [o.name for o in session.get_outputs()]
        return cls([(f"past_key_values.{i}.key", f"past_key_values.{i}.value") for i in range(num_layers)], outputs,
                   [i for i, n in enumerate(outputs) if n.startswith("new_key_values.")])


def pack_rows(inputs: Sequence[RowInputs]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[int]]:
    """The batched graph's token inputs for B rows of possibly different lengths.

    Args:
        inputs: each row's tokens int64 [S_b], positions int64 [S_b], mask bool [S_b, S_b], temperature.

    Returns:
        (input_ids int64 [B, S], position_ids int64 [B, S], new_token_mask bool [B, S, S],
        temperature float32 [B], lengths [S_b]) with S = max S_b. Padding: token 0 at the row's last
        position, seeing only itself; the row's own mask is copied to [b, :S_b, :S_b] and no real token
        sees a padding one.
    """
    lengths = [int(len(r.tokens)) for r in inputs]
    b, s = len(inputs), max(lengths)
    ids = np.zeros((b, s), np.int64)
    pos = np.zeros((b, s), np.int64)
    mask = np.zeros((b, s, s), bool)
    temps = np.empty(b, np.float32)
    for i, (r, n) in enumerate(zip(inputs, lengths)):
        ids[i, :n] = r.tokens
        pos[i, :n] = r.positions
        pos[i, n:] = r.positions[-1]
        mask[i, :n, :n] = r.mask
        pad = np.arange(n, s)
        mask[i, pad, pad] = True
        temps[i] = r.temperature
    return ids, pos, mask, temps, lengths


def pack_past(caches: Sequence, num_layers: int,
              length: int | None = None) -> tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray]:
    """Every row's valid past in one zero-padded array per layer.

    Args:
        caches: the rows' caches, all sequence-major (:class:`~medusa_runtime.engines.kvcache.KVCache`, ``keys[l]``
            [1, capacity, H_kv, D]) or all head-major (:class:`~medusa_runtime.engines.kvcache.HeadMajorKVCache`,
            ``keys[l]`` [1, H_kv, capacity, D]).
        num_layers: layers.
        length: P, the packed length (>= the longest valid length; default: the longest).

    Returns:
        (per layer (key, value): [B, P, H_kv, D] sequence-major or [B, H_kv, P, D] head-major, row b's
        slots [0, length_b) its past and the rest zeros; int32 [B] the lengths).
    """
    lengths = np.array([c.length for c in caches], np.int32)
    p = int(lengths.max()) if length is None else length
    head_major = isinstance(caches[0], HeadMajorKVCache)
    packed = []
    for layer in range(num_layers):
        pair = []
        for bufs in ([c.keys[layer] for c in caches], [c.values[layer] for c in caches]):
            kv_heads, d = (bufs[0].shape[1], bufs[0].shape[3]) if head_major else bufs[0].shape[2:]
            out = np.zeros((len(caches), kv_heads, p, d) if head_major else (len(caches), p, kv_heads, d),
                           bufs[0].dtype)
            for i, (buf, n) in enumerate(zip(bufs, lengths)):
                if head_major:
                    out[i, :, :n] = buf[0, :, :n]
                else:
                    out[i, :n] = buf[0, :n]
            pair.append(out)
        packed.append((pair[0], pair[1]))
    return packed, lengths


#: The packed past's length grows in steps of this many slots (see :class:`PackedPast`).
PACK_CHUNK = 64


class PackedPast:
    """The rows' pasts packed for a batched call, kept up to date between calls.

    Valid while the same caches (same objects, same order) run and each only grows: a call then copies
    the slots [previous length, length) of each row. Anything else (another set of rows, a row whose
    length went down, the longest row beyond the packed length) repacks every row
    (:func:`pack_past`) into a length rounded up to :data:`PACK_CHUNK`. The packed slots beyond a row's
    own length hold zeros or older values, masked by ``past_sequence_length``.

    The caches are only read; holding them keeps their ids from being reused while packed.
    """

    def __init__(self):
        self.caches: list = []
        self.lengths: list[int] = []
        self.arrays: list[tuple[np.ndarray, np.ndarray]] = []
        self.repacks = 0

    def update(self, caches: Sequence, num_layers: int) -> tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray]:
        """The packed past of ``caches`` (per layer (key, value), [B, P', H_kv, D] sequence-major or
        [B, H_kv, P', D] head-major, P' >= the longest length) and the int32 [B] valid lengths."""
        lengths = [c.length for c in caches]
        head_major = isinstance(caches[0], HeadMajorKVCache)
        axis = 2 if head_major else 1
        packed = self.arrays[0][0].shape[axis] if self.arrays else -1
        same = len(caches) == len(self.caches) and all(a is b for a, b in zip(caches, self.caches))
        if not same or max(lengths) > packed or any(n < m for n, m in zip(lengths, self.lengths)):
            chunked = max(min(-(-max(lengths) // PACK_CHUNK) * PACK_CHUNK, max(c.capacity for c in caches)),
                          max(lengths))
            self.arrays, _ = pack_past(caches, num_layers, chunked)
            self.caches, self.repacks = list(caches), self.repacks + 1
        else:
            for b, (c, old, new) in enumerate(zip(caches, self.lengths, lengths)):
                if new == old:
                    continue
                for layer, (k, v) in enumerate(self.arrays):
                    if head_major:
                        k[b, :, old:new] = c.keys[layer][0, :, old:new]
                        v[b, :, old:new] = c.values[layer][0, :, old:new]
                    else:
                        k[b, old:new] = c.keys[layer][0, old:new]
                        v[b, old:new] = c.values[layer][0, old:new]
        self.lengths = lengths
        return self.arrays, np.array(lengths, np.int32)

    def forget(self, cache) -> None:
        """Drop the packed rows if ``cache`` is one of them (its sequence left)."""
        if any(c is cache for c in self.caches):
            self.caches, self.lengths, self.arrays = [], [], []


def check_rows_fit(caches: Sequence, inputs: Sequence[RowInputs]) -> None:
    """Every row's step fits its cache (the batched engines check before any row runs).

    Raises:
        ContextOverflowError: a row's ``length + S_b`` exceeds its ``capacity``.
    """
    for c, r in zip(caches, inputs):
        if c.length + len(r.tokens) > c.capacity:
            raise ContextOverflowError(f"a step of {len(r.tokens)} tokens does not fit: {c.length} of "
                                       f"{c.capacity} cache slots are in use")


def run_rows(session, io: StepIO, caches: Sequence, inputs: Sequence[RowInputs],
             packed: PackedPast | None = None) -> list[StepResult]:
    """One call of a batched step graph over ``len(caches)`` rows (see the module docstring).

    One sequence-major row is fed its cache's views (no copy) and one head-major row its whole buffers
    (the graph reads the first P slots); several rows are packed (:func:`pack_rows`, :func:`pack_past`).
    A head-major row's new K/V are written into its buffer at slots [P_b, P_b + S_b), where the fused
    batch-1 graph writes them, so its ``keep`` compacts them in place.

    Args:
        session: the batched step graph's ``onnxruntime.InferenceSession``.
        io: its tensor names.
        caches: each row's cache (its valid past); inputs: each row's :class:`~medusa_runtime.engines.base.RowInputs`.
        packed: the rows' packed past kept between calls (None: packed afresh).

    Returns:
        Per row, its :class:`~medusa_runtime.engines.base.StepResult` (padding cut off: [S_b, ...]; ``new_kv``
        [1, S_b, H_kv, D] per layer).

    Raises:
        ContextOverflowError: a row's step does not fit its cache.
    """
    check_rows_fit(caches, inputs)
    head_major = isinstance(caches[0], HeadMajorKVCache)
    ids, pos, mask, temps, lengths = pack_rows(inputs)
    if len(caches) > 1:
        past, past_lengths = (packed or PackedPast()).update(caches, io.num_layers)
    else:
        c = caches[0]
        past = list(zip(c.keys, c.values)) if head_major else c.past()
        past_lengths = np.array([c.length], np.int32)
    feed = {"input_ids": ids, "position_ids": pos, "new_token_mask": mask, "temperature": temps,
            "past_sequence_length": past_lengths}
    for (kn, vn), (k, v) in zip(io.past_names, past):
        feed[kn], feed[vn] = k, v
    outs = dict(zip(io.outputs, session.run(io.outputs, feed)))
    new = [outs[io.outputs[i]] for i in io.kv_outputs]
    results = []
    for b, (c, n) in enumerate(zip(caches, lengths)):
        if head_major:
            start = c.length
            for layer in range(io.num_layers):
                c.keys[layer][0, :, start : start + n] = new[2 * layer][b, :, :n]
                c.values[layer][0, :, start : start + n] = new[2 * layer + 1][b, :, :n]
            kv = c.new_kv(start, n)
        else:
            kv = [(new[2 * i][b : b + 1, :n], new[2 * i + 1][b : b + 1, :n]) for i in range(io.num_layers)]
        results.append(StepResult(outs["topk_ids"][b, :n], outs["topk_logprobs"][b, :n], outs["entropy"][b, :n],
                                  outs["token_logprobs"][b, :n, :n], outs["hidden_states"][b, :n], kv))
    return results
