"""The batched TensorRT engine: all the rows of a step in one execution of a batched step graph's plan.

Artifacts built with ``build --batch-size N`` (N > 1, manifest ``batch``) have a step graph with a dynamic
batch dimension B and per-row past lengths (docs/batching.md); their plans' profiles cover B in [1, N]
(:func:`~.trt_plan.model_profiles`). :class:`TrtBatchEngine` is the :class:`~medusa_runtime.decode.batch.BatchEngine`
the scheduler drives for them on TensorRT, the device twin of :class:`~.ort_batched.OrtBatchEngine`:

* each sequence owns a :class:`~.trt.TrtKVCache` (one device allocation, freed on ``release``);
* ``step_rows`` over one row is :meth:`~.trt.TrtEngine.step` as a batch of one (a prefill writes its K/V
  straight into the row's cache); over B > 1 rows it pads the token inputs (:func:`~.ort_rows.pack_rows`),
  packs the rows' valid pasts into one [B, P, H_kv, D] buffer per layer with one ``cudaMemcpy2DAsync`` per row
  (:func:`~.trt_plan.pack_copies`; the buffer is zeroed when allocated, so the padding slots the graph masks hold
  finite values), runs one execution, and hands each row its
  :class:`~medusa_runtime.engines.base.StepResult`: host top-k, entropy and token log-probs with the padding
  cut off, its hidden rows on the device, and its new K/V as rows [b * S, b * S + S_b) of the call's
  [B, S, H_kv, D] step buffer, which the row's ``keep`` compacts into its own cache;
* the packed past is kept between calls, as ONNX Runtime's (:class:`~.ort_rows.PackedPast`): while the same rows
  run, a call copies only the slots each row kept since the previous one; P is the longest row's length rounded up
  to :data:`~.ort_rows.PACK_CHUNK` slots (capped by the profiles), and a row joining or leaving, or the longest
  row passing P, repacks every row;
* more rows than the plans' N run as several executions of at most N rows, each with its own output
  buffers (the scheduler reads every row's hidden states and K/V after the call).

Executed in CI against the EMULATED TensorRT and CUDA runtime only (tests/test_trt_batched_emulated.py).
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple, Sequence

import numpy as np

from ..contract.artifact import Artifact, kv_layout, step_batch
from ..errors import ArtifactError
from .base import RowInputs, StepResult
from .cuda import CudaError, DeviceRows
from .ort_rows import PACK_CHUNK, check_rows_fit, pack_rows
from .trt import _HOST_OUTPUTS, TrtEngine, TrtKVCache, TrtNewKV
from .trt_plan import kv_bindings, pack_copies, packed_layout, select_profile


class _Packed(NamedTuple):
    """A packed past kept between calls: its rows' caches (in order), their packed lengths and P per row."""

    caches: tuple
    lengths: list[int]
    slots: int


class TrtBatchEngine(TrtEngine):
    """:class:`~.trt.TrtEngine` for a batched artifact, with the :class:`~medusa_runtime.decode.batch.BatchEngine`
    interface (see the module docstring). ``step`` (one sequence) runs the plan as a batch of one.

    Args:
        artifact: a batched artifact (manifest ``batch``) whose engines were built; other arguments as
            :class:`~.trt.TrtEngine`.

    Raises:
        ArtifactError: the artifact's step graph is not batched (:class:`~.trt.TrtEngine` runs it, the scheduler
            looping over the rows), or its KV is head-major (``--graph fused``: ONNX Runtime only); and as
            :class:`~.trt.TrtEngine`.
    """

    def __init__(self, artifact: Artifact, **options):
        if not step_batch(artifact.manifest):
            raise ArtifactError(f"{artifact.path}: the step graph is not batched (no manifest 'batch'): TrtEngine "
                                f"runs it; rebuild with `medusa-export build --batch-size N` to batch on TensorRT")
        if kv_layout(artifact.manifest) != "sequence-major":
            raise ArtifactError(f"{artifact.path}: a batched fused graph (head-major KV, ONNX Runtime's contrib ops) "
                                f"has no TensorRT engine: build with --graph portable")
        super().__init__(artifact, **options)
        self.capabilities = replace(self.capabilities, batched=True)
        self._packs: dict[str, _Packed] = {}  # per execution's buffers: the rows' packed past kept between calls
        self.repacks = 0  # calls that packed every row afresh (tests: the packing is mostly incremental)

    def release(self, cache: TrtKVCache) -> None:
        """Free a row's cache (its sequence left); the packed pasts holding its row are dropped."""
        self._packs = {k: v for k, v in self._packs.items() if not any(c is cache for c in v.caches)}
        super().release(cache)

    def _packing(self, key: str, caches: list[TrtKVCache], lengths: list[int], b: int, s: int
                 ) -> tuple[int, list[int] | None]:
        """(P, the packed past length per row; the slots of each row already packed in buffer ``key``, or None
        for a repack). The packing is kept while the same caches run in the same order, none shorter, the
        longest within P and P inside a profile for (B, S); else P is the longest length rounded up to
        :data:`~.ort_rows.PACK_CHUNK` slots, capped at the largest P a profile for (B, S) admits."""
        g = self.model
        state = self._packs.get(key)
        longest = max(lengths)
        if (state is not None and len(state.caches) == len(caches) and all(a is c for a, c in zip(state.caches, caches))
                and all(n >= m for n, m in zip(lengths, state.lengths)) and longest <= state.slots
                and any(p.contains({"B": b, "S": s, "P": state.slots}) for p in g.profiles)):
            return state.slots, state.lengths
        self.repacks += 1
        if not longest:
            return 0, None
        cap = max((p.dims["P"][2] for p in g.profiles if p.contains({"B": b, "S": s, "P": longest})), default=longest)
        return max(min(-(-longest // PACK_CHUNK) * PACK_CHUNK, cap), longest), None

    def row_cache(self, capacity: int) -> TrtKVCache:
        """One sequence's device KV row of ``capacity`` slots (:meth:`~.trt.TrtEngine.make_cache`), freed by
        :meth:`~.trt.TrtEngine.release`."""
        return self.make_cache(capacity)

    def step_rows(self, caches: Sequence[TrtKVCache], inputs: Sequence[RowInputs]) -> list[StepResult]:
        """One step over ``len(caches)`` rows: row b runs ``inputs[b]`` after ``caches[b]``'s valid past.

        Returns:
            Per row, its :class:`StepResult` (``topk_ids`` [S_b, k], ``topk_logprobs`` [S_b, k], ``entropy``
            [S_b], ``token_logprobs`` [S_b, S_b] ([S_b, 0] for a row without a past), ``hidden`` a
            :class:`~.cuda.DeviceRows` [S_b, d] valid until the next call, ``new_kv`` a :class:`~.trt.TrtNewKV`).

        Raises:
            ValueError: as many caches as inputs are needed.
            ArtifactError: a row asks for the in-graph sampler (batched graphs have none).
            ContextOverflowError: a row's step does not fit its cache (checked before any row runs).
            ShapeOutOfProfileError: no profile covers the call's (B, S, P).
            CudaError: TensorRT refused the execution or a CUDA call failed.
        """
        if len(caches) != len(inputs):
            raise ValueError(f"{len(caches)} caches for {len(inputs)} rows")
        if any(r.sampling is not None for r in inputs):
            raise ArtifactError("a batched step graph has no in-graph sampler: sample on the host")
        check_rows_fit(caches, inputs)
        if len(caches) == 1:
            r = inputs[0]
            return [self.step(r.tokens[None], r.positions[None], r.mask, r.temperature, caches[0].past())]
        out = []
        for call, start in enumerate(range(0, len(caches), self.max_batch)):
            rows = slice(start, start + self.max_batch)
            out += self._execute_rows(f"rows{call}", list(caches[rows]), list(inputs[rows]))
        return out

    def _execute_rows(self, key: str, caches: list[TrtKVCache], inputs: list[RowInputs]) -> list[StepResult]:
        """One execution over at most ``max_batch`` rows; its outputs live in buffers named ``key``."""
        self.cuda.use()
        for c in caches:
            c.past()  # raises on a freed cache
        g = self.model
        ids, pos, mask, temps, lengths = pack_rows(inputs)
        b, s = ids.shape
        past_lens = np.array([c.length for c in caches], np.int32)
        slots, kept = self._packing(key, caches, past_lens.tolist(), b, s)
        p = slots  # the graph attends over the packed slots; each row's beyond its own length are masked
        ctx = g.contexts[select_profile(g.profiles, {"B": b, "S": s, "P": p})]
        feeds = {"input_ids": ids, "position_ids": pos, "new_token_mask": mask, "temperature": temps,
                 "past_sequence_length": past_lens}
        for name, arr in feeds.items():
            self._bind_input(ctx, f"model.{name}", name, np.asarray(arr, dtype=g.dtypes[name]))
        row = caches[0].layout
        if p:
            packed = packed_layout(row, b, p)
            past_key = f"{key}.past"
            fresh = self._buf.sizes.get(past_key, -1) < packed.total_bytes
            past_base = self._buf.get(past_key, packed.total_bytes)
            if fresh:  # the masked padding slots must hold finite values: cudaMalloc leaves memory uncleared
                self.cuda.zero(past_base, self._buf.sizes[past_key])
            for i, c in pack_copies([c.layout for c in caches], past_lens, packed, p, kept):
                self.cuda.copy_2d(past_base + c.dst_offset, c.dpitch, caches[i].ptr + c.src_offset, c.spitch,
                                  c.width, c.height)
            self._packs[key] = _Packed(tuple(caches), past_lens.tolist(), p)
            past_offsets = kv_bindings(packed, "past_key_values")
        else:  # every row a prefill: the empty past is bound to a 1-byte dummy
            past_base = self._buf.get("model.empty_past", 1)
            past_offsets = dict.fromkeys(kv_bindings(row, "past_key_values"), 0)
        for name, off in past_offsets.items():
            ctx.set_input_shape(name, (b, p, self.num_kv_heads, self.head_dim))
            ctx.set_tensor_address(name, past_base + off)
        new_layout = packed_layout(row, b, s)
        new_key = f"{key}.new_kv"
        new_base = self._buf.get(new_key, new_layout.total_bytes)
        new_offsets = kv_bindings(new_layout, "new_key_values")
        for name, off in new_offsets.items():
            ctx.set_tensor_address(name, new_base + off)
        missing = ctx.infer_shapes()
        if missing:
            raise CudaError(f"TensorRT could not infer the shapes of {missing}")
        bound = g.bind_outputs(ctx, self._buf, key, skip=tuple(new_offsets))
        if not ctx.execute_async_v3(self.cuda.stream_handle):
            raise CudaError(f"TensorRT refused the batched step (B={b}, S={s}, P={p}); its log above says why")
        wanted = _HOST_OUTPUTS if p else _HOST_OUTPUTS[:-1]  # token log-probs only where a row has a past
        host = self._fetch(g, bound, wanted, key)
        hidden_ptr, row_bytes = bound["hidden_states"][1], s * self.hidden_size * self.hidden_dtype.itemsize
        results = []
        for i, (c, n) in enumerate(zip(caches, lengths)):
            token_lp = host["token_logprobs"][i, :n, :n].copy() if past_lens[i] else \
                np.zeros((n, 0), g.dtypes["token_logprobs"])
            hidden = DeviceRows(hidden_ptr + i * row_bytes, n, self.hidden_size, self.hidden_dtype.itemsize)
            results.append(StepResult(host["topk_ids"][i, :n].copy(), host["topk_logprobs"][i, :n].copy(),
                                      host["entropy"][i, :n].copy(), token_lp, hidden,
                                      TrtNewKV(False, int(past_lens[i]), n, new_layout, first=i * s, buffer=new_key)))
        return results
