"""TensorRT backend: the artifact's engine plans behind the loop's Engine interface.

Written against TensorRT 10's Python API (``Runtime.deserialize_cuda_engine``,
``create_execution_context(USER_MANAGED)``, ``set_optimization_profile_async``, ``set_input_shape``,
``set_tensor_address``, ``infer_shapes``, ``execute_async_v3``) and cuda-python's CUDA runtime
bindings (:mod:`.cuda`). CI executes it against the EMULATED TensorRT and CUDA runtime under
``tests/emulated`` (a test double on host memory running the ONNX with ONNX Runtime:
tests/test_trt_emulated.py), never against TensorRT itself; no GPU has run it. The pure parts
(profile selection, shapes, buffer layout, compaction copies, the plan key) live in
:mod:`medusa_runtime.engines.trt_plan`.

Device memory: cuda-python (NVIDIA's own bindings, used by TensorRT's samples) rather than
a tensor library: the backend needs only malloc, async copies (including the strided 2-D
copy that compacts every layer's KV in one call) and a stream, and must not pull in torch.

Layout and data flow per step:

* one execution context per optimization profile (prefill, tree step, decode), all
  sharing one scratch allocation (``USER_MANAGED``; steps run one at a time on one
  stream), so a step only picks a context: :func:`~.trt_plan.select_profile` on (S, P);
* the KV cache is one allocation, a plane per layer and K/V (:class:`~.trt_plan.KVLayout`,
  planes 256-byte aligned as TensorRT requires): a layer's past ``[1, P, H_kv, D]`` is the
  plane's start, bound without a copy;
* a prefill (P = 0) writes its new K/V straight into the cache planes; a tree or decode
  step writes into a separate buffer of S rows (the step's own size, grown on demand;
  TensorRT needs aligned output addresses, and slot P of a plane is not), and the accepted
  nodes are then copied into slots
  [P, P + n) with one ``cudaMemcpy2DAsync`` per run of consecutive nodes, all planes at once;
* inputs (tokens, positions, mask, temperature) go host -> device from pinned host buffers; the
  acceptance outputs (top-k ids and log-probs, entropy; token log-probs [S, S] only after a past,
  where a tree step's typical acceptance reads them, never for a prefill) come back into pinned
  host buffers; every other output (``sampled_ids``) gets a device address, as ``enqueueV3``
  requires, and stays there; the hidden states stay on the device and the heads engine reads
  the accepted row (path-conditioned heads: one plan per tree level, ``heads_level``, fed that row and the
  level's paths).

Ownership: a :class:`TrtKVCache` owns its device allocation until :meth:`TrtKVCache.free`
(called by the loop when a generation it started ends, by :meth:`TrtEngine.release` for the
batch scheduler's rows, by ``MedusaSession.close`` for the chat cache); :meth:`TrtEngine.close`
frees what is still live. Every entry point sets the engine's device in the calling thread
(:meth:`.cuda.Cuda.use`), so a batch server's or Triton's thread works on the engine's GPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np

from ..contract.artifact import Artifact, step_batch, step_limits
from ..errors import ArtifactError, BackendUnavailableError, ContextOverflowError, InvalidSettingError, MedusaError
from .base import Capabilities, StepResult, sampler_feed
from .cuda import Buffers, Cuda, CudaError, DeviceRows, DeviceSlice
from .kvcache import CacheState
from .trt_plan import (ENGINE_PRECISIONS, KVLayout, PlanMismatchError, built_precisions, compaction_copies,
                       default_precision, graph_profiles, heads_graphs,
                       kv_bindings, plan_files, plan_key_mismatches, plan_sources, profiles_json, select_profile)

__all__ = ["TrtEngine", "TrtKVCache", "DeviceRows", "DeviceSlice", "PlanMismatchError"]

#: Step outputs copied to the host; ``token_logprobs`` only after a past (:meth:`TrtEngine.step`).
_HOST_OUTPUTS = ("topk_ids", "topk_logprobs", "entropy", "token_logprobs")


def _import_tensorrt():
    try:
        import tensorrt as trt
    except ImportError:
        raise BackendUnavailableError("the tensorrt backend needs TensorRT's Python package (`import tensorrt` "
                                      "failed); install TensorRT 10.x on a machine with an NVIDIA GPU") from None
    return trt


class TrtPast(NamedTuple):
    """What :meth:`TrtKVCache.past` hands to the engine: the cache and its valid length."""

    cache: "TrtKVCache"
    length: int


class TrtNewKV(NamedTuple):
    """Where a step left its new K/V: in the cache itself (prefill, ``layout`` None) or the engine's step
    buffer ``buffer`` (laid out as ``layout``: S rows per plane; a batched call's B x S rows, this row's from
    row ``first``)."""

    in_place: bool
    past_len: int
    rows: int
    layout: KVLayout | None
    first: int = 0
    buffer: str = "model.new_kv"


class TrtKVCache(CacheState):
    """The KV cache in device memory (one allocation, :class:`~.trt_plan.KVLayout`), owned until :meth:`free`.

    Same interface as :class:`medusa_runtime.engines.kvcache.KVCache` (a :class:`CacheState` with
    ``past()`` and ``keep()``). :meth:`free` returns the memory (idempotent); the engine frees the caches
    still live when it is closed.
    """

    def __init__(self, engine: "TrtEngine", capacity: int):
        super().__init__(capacity)
        self.engine = engine
        self.layout = KVLayout(engine.num_layers, engine.num_kv_heads, engine.head_dim, engine.kv_dtype.itemsize,
                               capacity)
        self.ptr = engine.cuda.malloc(self.layout.total_bytes)
        engine._caches.add(self)

    def past(self) -> TrtPast:
        if not self.ptr:
            raise RuntimeError("this TensorRT KV cache was freed")
        return TrtPast(self, self.length)

    def keep(self, new_kv: TrtNewKV, accepted: np.ndarray, token_ids=None) -> None:
        """KV compaction on the device: accepted node ``accepted[i]`` -> slot ``length + i``.

        Raises:
            RuntimeError: ``new_kv`` came from a step over another past length.
            ContextOverflowError: the accepted nodes do not fit.
        """
        if new_kv.past_len != self.length:
            raise RuntimeError(f"step output was for past length {new_kv.past_len}, the cache holds {self.length}")
        self.engine.compact(self, new_kv, np.asarray(accepted))
        self._advance(accepted, token_ids)

    def free(self) -> None:
        """Return the device memory (after the queued work that may read it); the cache is unusable afterwards."""
        if self.ptr:
            cuda = self.engine.cuda
            cuda.use()
            cuda.sync()
            cuda.free(self.ptr)
            self.ptr = 0
            self.engine._caches.discard(self)


class _Graph:
    """One deserialized engine with an execution context per optimization profile."""

    def __init__(self, trt, runtime, cuda: Cuda, path: Path, profiles):
        engine = runtime.deserialize_cuda_engine(path.read_bytes())
        if engine is None:
            raise ArtifactError(f"TensorRT could not load {path} (truncated, corrupt, or built by another TensorRT "
                                f"version or for another GPU model; TensorRT's log above says which): rebuild it "
                                f"with `medusa-export engine` on this machine")
        if engine.num_optimization_profiles != len(profiles):
            raise ArtifactError(f"{path} has {engine.num_optimization_profiles} optimization profiles, the manifest "
                                f"describes {len(profiles)} ({', '.join(p.name for p in profiles)}): rebuild it "
                                f"with `medusa-export engine`")
        self.engine, self.profiles = engine, profiles
        self.dtypes, self.inputs, self.outputs = {}, [], []
        for i in range(engine.num_io_tensors):
            name = engine.get_tensor_name(i)
            self.dtypes[name] = np.dtype(trt.nptype(engine.get_tensor_dtype(name)))
            is_input = engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT
            (self.inputs if is_input else self.outputs).append(name)
        self.contexts = []
        for i in range(len(profiles)):
            ctx = engine.create_execution_context(trt.ExecutionContextAllocationStrategy.USER_MANAGED)
            if not ctx.set_optimization_profile_async(i, cuda.stream_handle):
                raise ArtifactError(f"{path}: TensorRT refused optimization profile {i} ({profiles[i].name})")
            self.contexts.append(ctx)

    def scratch_bytes(self) -> int:
        e = self.engine
        if hasattr(e, "get_device_memory_size_for_profile_v2"):  # TensorRT >= 10.1 (device_memory_size: gone in 11)
            return max(e.get_device_memory_size_for_profile_v2(i) for i in range(len(self.profiles)))
        return e.device_memory_size

    def share_scratch(self, ptr: int, nbytes: int) -> None:
        for ctx in self.contexts:
            if hasattr(ctx, "set_device_memory"):  # TensorRT >= 10.1 (setDeviceMemoryV2)
                ctx.set_device_memory(ptr, nbytes)
            else:
                ctx.device_memory = ptr

    def bind_outputs(self, ctx, buf: Buffers, prefix: str, skip: tuple[str, ...] = ()) -> dict[str, tuple]:
        """Give every output not in ``skip`` a device buffer of its inferred shape (setTensorAddress: "each
        output must have a non-null address or an IOutputAllocator" before enqueueV3); name -> (shape, ptr)."""
        out = {}
        for name in self.outputs:
            if name in skip:
                continue
            shape = tuple(ctx.get_tensor_shape(name))
            ptr = buf.get(f"{prefix}.{name}", int(np.prod(shape, dtype=np.int64)) * self.dtypes[name].itemsize)
            ctx.set_tensor_address(name, ptr)
            out[name] = (shape, ptr)
        return out


def _check_plan_key(record: dict, current: dict, folder: Path, precision: str) -> None:
    """Raise :class:`PlanMismatchError` when the plans' build record differs from this machine or artifact."""
    diffs = plan_key_mismatches(record, current)
    if diffs:
        raise PlanMismatchError(
            f"the {precision} TensorRT plans in {folder / 'engines'} were built for another machine or artifact: "
            f"{'; '.join(diffs)}. A plan runs only with the TensorRT version, GPU model, precision, profiles and "
            f"graphs it was built for: rebuild it here with `medusa-export engine --artifact {folder} --precision "
            f"{precision}` (or `bash engines/build_engine.sh {precision}`)")


class TrtEngine:
    """Runs ``engines/model.PRECISION.plan`` and ``engines/heads.PRECISION.plan`` of an artifact (path-conditioned
    heads: ``engines/heads_level{j}.PRECISION.plan``, one per tree level, instead of the heads plan).

    Args:
        artifact: a loaded artifact whose engines were built (``medusa-export engine``).
        precision: which engines ("fp16", "bf16", "fp32"; None: the first built, :func:`~.trt_plan.default_precision`).
        device_id: the CUDA device.
        **_: options of other backends (``threads``), ignored.

    Raises:
        BackendUnavailableError: TensorRT or cuda-python is missing.
        InvalidSettingError: ``device_id`` is not a device of this machine, or ``precision`` is not one of
            :data:`~.trt_plan.ENGINE_PRECISIONS` (the message lists them and the precisions built).
        PlanMismatchError: the plans' record names another TensorRT version, GPU, precision, profiles or graph
            checksums than this machine and artifact (the message says what and how to rebuild).
        ArtifactError: the plans are missing or do not load (truncated, corrupt).

    The plans' ``tree_step`` profile is built for the artifact's tree (S = T): the backend's entry says so
    (``BackendSpec.fixed_tree``) and the session runs that tree by default instead of timing others; a tree
    step of another size runs on the ``prefill`` profile (S in [1, C]).
    """

    def __init__(self, artifact: Artifact, precision: str | None = None, device_id: int = 0, **_):
        trt = _import_tensorrt()
        manifest = artifact.manifest
        precision = precision or default_precision(manifest)
        if precision not in ENGINE_PRECISIONS:
            built = ", ".join(built_precisions(manifest)) or "none yet"
            raise InvalidSettingError(f"unknown TensorRT engine precision {precision!r}: choose one of "
                                      f"{', '.join(ENGINE_PRECISIONS)} (built in {artifact.path}: {built})")
        plans = {g: artifact.path / rel for g, rel in plan_files(manifest, precision).items()}
        missing = [str(p) for p in plans.values() if not p.is_file()]
        if missing:
            raise ArtifactError(f"no {precision} TensorRT engine in {artifact.path} ({', '.join(missing)} missing): "
                                f"build it with `medusa-export engine --artifact {artifact.path} --precision "
                                f"{precision}` or `bash engines/build_engine.sh {precision}` on this GPU machine")
        m = artifact.model
        self.num_layers, self.num_kv_heads, self.head_dim = m.num_layers, m.num_kv_heads, m.head_dim
        self.num_heads, self.hidden_size = m.medusa_heads, m.hidden_size
        self.manifest = manifest
        #: The batched step graph's built batch size (manifest ``batch``; 0: a batch-1 graph). :meth:`step` runs
        #: a batched graph as a batch of one; :class:`~.trt_batched.TrtBatchEngine` runs its rows together.
        self.max_batch = step_batch(manifest)
        # An in-graph sampler (docs/sampling.md) is fed its defaults, not used: sampling draws from the top-k.
        limits = step_limits(manifest)
        self._graph_sampler = limits.has_sampler
        self.cuda = Cuda(device_id, "tensorrt")
        self._caches: set[TrtKVCache] = set()
        self._buf = Buffers(self.cuda)
        self._host = Buffers(self.cuda, pinned=True)
        self._scratch = 0
        try:  # the stream is destroyed when the plans are refused
            current = {"tensorrt": trt.__version__, **self.cuda.device_name(), "precision": precision,
                       "profiles": profiles_json(manifest), "sources": plan_sources(manifest, precision)}
            _check_plan_key((manifest.engines or {}).get(precision, {}), current, artifact.path, precision)
            self._logger = trt.Logger(trt.Logger.WARNING)
            self._runtime = trt.Runtime(self._logger)
            self._graphs = {g: _Graph(trt, self._runtime, self.cuda, plans[g], graph_profiles(manifest, g))
                            for g in plans}
            scratch = max(g.scratch_bytes() for g in self._graphs.values())
            self._scratch = self.cuda.malloc(scratch)
        except BaseException:
            self.cuda.close()
            raise
        for g in self._graphs.values():
            g.share_scratch(self._scratch, scratch)
        self.model = self._graphs["model"]
        self.heads_graph = self._graphs.get("heads")  # None for path-conditioned heads
        self.level_graphs = [self._graphs[g] for g in heads_graphs(manifest) if g != "heads"]
        self.kv_dtype = self.model.dtypes["past_key_values.0.key"]
        self.hidden_dtype = self.model.dtypes["hidden_states"]
        self.capabilities = Capabilities.with_limits(  # step_rows: ONNX Runtime CPU kernels' regime, not TensorRT's
            limits._replace(min_rows=1, chain_trees=False), head_type=manifest.head_type, own_cache=True, device_id=device_id,
            heads_logprobs=self.heads_graph is not None and "medusa_topk_logprobs" in self.heads_graph.outputs)

    def make_cache(self, capacity: int) -> TrtKVCache:
        """A device KV cache of ``capacity`` tokens (the loop calls this instead of making a numpy one)."""
        self.cuda.use()
        return TrtKVCache(self, capacity)

    def release(self, cache: TrtKVCache) -> None:
        """Free a cache of :meth:`make_cache` (its sequence has ended)."""
        cache.free()

    @property
    def live_caches(self) -> int:
        """Caches of :meth:`make_cache` not freed yet."""
        return len(self._caches)

    def _bind_input(self, ctx, key: str, name: str, arr: np.ndarray) -> None:
        """Stage ``arr`` in a pinned host buffer, queue its copy to a device buffer and bind it as ``name``."""
        host = self._host.host_array(key, arr.shape, arr.dtype)
        host[...] = arr
        ptr = self._buf.get(key, arr.nbytes)
        self.cuda.copy(ptr, host.ctypes.data, arr.nbytes, self.cuda.H2D)
        ctx.set_input_shape(name, arr.shape)
        ctx.set_tensor_address(name, ptr)

    def step(self, input_ids, position_ids, mask, temperature, past: TrtPast) -> StepResult:
        """One step of S tokens after the cache's P valid slots (see the module docstring for the data flow).

        Returns:
            :class:`StepResult` with host arrays (topk_ids [S, k], topk_logprobs [S, k], entropy [S];
            token_logprobs [S, S] after a past, [S, 0] for a prefill (P = 0), which the loop never reads),
            ``hidden`` a :class:`DeviceRows` [S, d] valid until the next step, ``new_kv`` a :class:`TrtNewKV`.

        Raises:
            TypeError: ``past`` is not a :class:`TrtKVCache`'s.
            ContextOverflowError: the step does not fit the cache.
            ShapeOutOfProfileError: no profile covers (S, P).
            CudaError: TensorRT refused the step (its log says why) or a CUDA call failed.
        """
        if not isinstance(past, TrtPast):
            raise TypeError("TrtEngine keeps the KV cache on the device: use the cache from engine.make_cache()")
        self.cuda.use()
        cache, p = past
        s = int(input_ids.shape[1])
        if p + s > cache.capacity:
            raise ContextOverflowError(f"a step of {s} tokens does not fit after {p} of {cache.capacity} slots")
        g = self.model
        sizes = {"S": s, "P": p, **({"B": 1} if self.max_batch else {})}
        ctx = g.contexts[select_profile(g.profiles, sizes)]
        feeds = {"input_ids": input_ids, "position_ids": position_ids, "new_token_mask": mask,
                 "temperature": np.array([temperature]), **(sampler_feed(s, None) if self._graph_sampler else {})}
        if self.max_batch:  # a batched graph as a batch of one: the row's mask [1, S, S] and past length [1]
            feeds.update(new_token_mask=np.asarray(mask)[None], past_sequence_length=np.array([p]))
        for name, arr in feeds.items():
            self._bind_input(ctx, f"model.{name}", name, np.asarray(arr, dtype=g.dtypes[name]))
        kv_shape = (1, p, self.num_kv_heads, self.head_dim)
        in_place = p == 0
        if in_place:  # new K/V straight into the cache; the empty past is bound to a 1-byte-sized dummy
            layout, base, past_base = None, cache.ptr, self._buf.get("model.empty_past", 1)
            past_offsets = dict.fromkeys(kv_bindings(cache.layout, "past_key_values"), 0)
            new_offsets = kv_bindings(cache.layout, "new_key_values")
        else:  # new K/V into a step buffer of S rows per plane, then the accepted rows are compacted
            layout = KVLayout(self.num_layers, self.num_kv_heads, self.head_dim, self.kv_dtype.itemsize, s)
            base, past_base = self._buf.get("model.new_kv", layout.total_bytes), cache.ptr
            past_offsets = kv_bindings(cache.layout, "past_key_values")
            new_offsets = kv_bindings(layout, "new_key_values")
        for name, off in past_offsets.items():
            ctx.set_input_shape(name, kv_shape)
            ctx.set_tensor_address(name, past_base + off)
        for name, off in new_offsets.items():
            ctx.set_tensor_address(name, base + off)
        missing = ctx.infer_shapes()
        if missing:
            raise CudaError(f"TensorRT could not infer the shapes of {missing}")
        wanted = _HOST_OUTPUTS if not in_place else _HOST_OUTPUTS[:-1]
        bound = g.bind_outputs(ctx, self._buf, "model", skip=tuple(new_offsets))
        if not ctx.execute_async_v3(self.cuda.stream_handle):
            raise CudaError(f"TensorRT refused the step (S={s}, P={p}); its log above says why")
        host = self._fetch(g, bound, wanted, "model")
        out = {k: v[0].copy() for k, v in host.items()}  # the pinned buffers are reused by the next step
        token_lp = out.get("token_logprobs", np.zeros((s, 0), g.dtypes["token_logprobs"]))
        hidden = DeviceRows(bound["hidden_states"][1], s, self.hidden_size, self.hidden_dtype.itemsize)
        return StepResult(out["topk_ids"], out["topk_logprobs"], out["entropy"], token_lp, hidden,
                          TrtNewKV(in_place, p, s, layout))

    def _fetch(self, g: _Graph, bound: dict[str, tuple], wanted: tuple[str, ...], key: str) -> dict[str, np.ndarray]:
        """Copy the ``wanted`` outputs of ``bound`` (name -> (shape, device pointer)) into pinned host arrays named
        after ``key`` and wait for the stream; the arrays are reused by the next call with the same ``key``."""
        host = {}
        for name in wanted:
            shape, ptr = bound[name]
            host[name] = self._host.host_array(f"{key}.out.{name}", shape, g.dtypes[name])
            self.cuda.copy(host[name].ctypes.data, ptr, host[name].nbytes, self.cuda.D2H)
        self.cuda.sync()
        return host

    def compact(self, cache: TrtKVCache, new_kv: TrtNewKV, accepted: np.ndarray) -> None:
        """Queue the device copies of the accepted nodes' K/V into the cache (same stream as the steps)."""
        self.cuda.use()
        if new_kv.in_place:
            src_base, src_layout = cache.ptr, cache.layout
        else:
            src_base, src_layout = self._buf.ptrs[new_kv.buffer], new_kv.layout
        nodes = np.asarray(accepted) + new_kv.first  # a batched call's row b: its nodes from row b * S on
        for c in compaction_copies(src_layout, cache.layout, new_kv.past_len, nodes, in_place=new_kv.in_place):
            self.cuda.copy_2d(cache.ptr + c.dst_offset, c.dpitch, src_base + c.src_offset, c.spitch, c.width, c.height)

    def heads(self, hidden, topk: int) -> np.ndarray:
        """hidden: a :class:`DeviceSlice` of a step's hidden states (or a host array [R, d]) -> int64 [R, K, topk].

        Raises:
            MedusaError: the artifact's heads are path-conditioned (they run level by level: :meth:`heads_level`).
        """
        return self._run_heads(self._medusa_heads(), hidden, {}, ("medusa_topk_ids",))[0]

    def heads_logprobs(self, hidden, topk: int) -> tuple[np.ndarray, np.ndarray]:
        """hidden as for :meth:`heads` -> (ids int64 [R, K, topk], log-probabilities float32 [R, K, topk]): what a
        per-step tree (``--tree dynamic:T``, :func:`~medusa_runtime.decode.candidates.dynamic_medusa`) reads.

        Raises:
            ArtifactError: the heads plan has no ``medusa_topk_logprobs`` output (its graph was built before it).
        """
        if "medusa_topk_logprobs" not in self._medusa_heads().outputs:
            raise ArtifactError("per-step trees need the heads' log-probabilities, and this artifact's heads plan "
                                "has no medusa_topk_logprobs output: rebuild the artifact (or use a static --tree)")
        ids, lp = self._run_heads(self.heads_graph, hidden, {}, ("medusa_topk_ids", "medusa_topk_logprobs"))
        return ids, lp

    def heads_level(self, depth: int, hidden, path_ids: np.ndarray, topk: int) -> tuple[np.ndarray, np.ndarray]:
        """Path-conditioned head ``depth`` (1-based, plan ``heads_level{depth}``): hidden a :class:`DeviceSlice`
        [1, d] (or a host array [H, d], H = 1 or R), path_ids int64 [R, depth] -> (ids int64 [R, topk],
        log-probabilities float32 [R, topk]), as :meth:`medusa_runtime.engines.ort.OrtEngine.heads_level`.

        Raises:
            MedusaError: the artifact's heads are Medusa heads (no level plans), or ``depth`` is not 1..K.
            ShapeOutOfProfileError: more paths or rows than the plans' tree has nodes.
        """
        if not 1 <= depth <= len(self.level_graphs):
            raise MedusaError(f"heads_level depth {depth}: this artifact has {len(self.level_graphs)} level plans "
                              f"(path-conditioned heads only; Medusa heads run with heads())")
        paths = np.ascontiguousarray(path_ids, np.int64)
        ids, lp = self._run_heads(self.level_graphs[depth - 1], hidden, {"path_ids": paths},
                                  ("level_topk_ids", "level_topk_logprobs"), rows="H", sizes={"R": len(paths)})
        return ids, lp

    def _medusa_heads(self) -> _Graph:
        if self.heads_graph is None:
            raise MedusaError("this artifact's heads are path-conditioned (hydra): they run level by level "
                              "(heads_level), not as one heads plan")
        return self.heads_graph

    def _run_heads(self, g: _Graph, hidden, extra: dict[str, np.ndarray], wanted: tuple[str, ...], rows: str = "R",
                   sizes: dict[str, int] | None = None) -> list[np.ndarray]:
        """Run a heads plan (``heads`` or a level plan) on the hidden states (symbol ``rows`` their count) and the
        host inputs ``extra`` (symbols ``sizes``); the ``wanted`` outputs as host arrays, in order."""
        self.cuda.use()
        r = int(hidden.shape[0])
        ctx = g.contexts[select_profile(g.profiles, {rows: r, **(sizes or {})})]
        for name, arr in extra.items():
            self._bind_input(ctx, f"heads.{name}", name, arr)
        nbytes = r * self.hidden_size * self.hidden_dtype.itemsize
        if isinstance(hidden, DeviceSlice):  # device -> aligned device buffer (a row offset is not 256-aligned)
            ptr = self._buf.get("heads.hidden_states", nbytes)
            self.cuda.copy(ptr, hidden.ptr, nbytes, self.cuda.D2D)
            ctx.set_input_shape("hidden_states", hidden.shape)
            ctx.set_tensor_address("hidden_states", ptr)
        else:
            self._bind_input(ctx, "heads.hidden_states", "hidden_states", np.asarray(hidden, self.hidden_dtype))
        bound = g.bind_outputs(ctx, self._buf, "heads")  # every output needs an address, read or not
        if not ctx.execute_async_v3(self.cuda.stream_handle):
            raise CudaError(f"TensorRT refused the heads ({rows}={r}); its log above says why")
        host = []
        for name in wanted:
            shape, ptr = bound[name]
            host.append(self._host.host_array(f"heads.out.{name}", shape, g.dtypes[name]))
            self.cuda.copy(host[-1].ctypes.data, ptr, host[-1].nbytes, self.cuda.D2H)
        self.cuda.sync()
        return [a.copy() for a in host]  # the pinned buffers are reused by the next call

    def close(self) -> None:
        """Free every device and pinned buffer, the caches still live included (the engine is unusable afterwards)."""
        if self.cuda.stream is None:
            return
        self.cuda.use()
        self.cuda.sync()
        for cache in list(self._caches):
            cache.free()
        self._buf.free()
        self._host.free()
        self.cuda.free(self._scratch)
        self._scratch = 0
        del self.model, self.heads_graph, self.level_graphs, self._graphs
        self.cuda.close()
