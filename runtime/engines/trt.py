"""TensorRT backend: the artifact's engine plans behind the loop's Engine interface.

NOT EXECUTED in this project's CI or development machines (no TensorRT there, and no
GPU for this backend's development): written against TensorRT 10's Python API
(``Runtime.deserialize_cuda_engine``, ``create_execution_context(USER_MANAGED)``,
``set_optimization_profile_async``, ``set_input_shape``, ``set_tensor_address``,
``execute_async_v3``) and cuda-python's CUDA runtime bindings (``cudaMalloc``,
``cudaMemcpyAsync``, ``cudaMemcpy2DAsync``, streams). The pure parts (profile selection,
shapes, buffer layout, compaction copies) live in :mod:`medusa_runtime.engines.trt_plan` and are
tested without TensorRT.

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
  step writes into a separate buffer of T rows (TensorRT needs aligned output addresses,
  and slot P of a plane is not), and the accepted nodes are then copied into slots
  [P, P + n) with one ``cudaMemcpy2DAsync`` per run of consecutive nodes, all planes at once;
* inputs (tokens, positions, mask, temperature) go host -> device; the acceptance outputs
  (top-k ids and log-probs, entropy, token log-probs: a few KB) come back to the host;
  the hidden states stay on the device and the heads engine reads the accepted row.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np

from ..artifact import Artifact, step_limits
from ..errors import ArtifactError, BackendUnavailableError, ContextOverflowError
from .base import StepResult, sampler_feed
from .trt_plan import (KVLayout, align, compaction_copies, heads_profiles, kv_bindings, model_profiles, plan_files,
                       select_profile)

_HOST_OUTPUTS = ("topk_ids", "topk_logprobs", "entropy", "token_logprobs")


def _import_tensorrt():
    try:
        import tensorrt as trt
    except ImportError:
        raise BackendUnavailableError("the tensorrt backend needs TensorRT's Python package (`import tensorrt` "
                                      "failed); install TensorRT 10.x on a machine with an NVIDIA GPU") from None
    return trt


def _import_cudart():
    try:
        from cuda.bindings import runtime as cudart  # cuda-python >= 12.6
    except ImportError:
        try:
            from cuda import cudart  # older cuda-python
        except ImportError:
            raise BackendUnavailableError("the tensorrt backend needs cuda-python for device memory "
                                          "(pip install cuda-python)") from None
    return cudart


class _Cuda:
    """The few CUDA runtime calls the backend makes, with errors raised (cuda-python returns codes)."""

    def __init__(self, device: int):
        self.rt = _import_cudart()
        self._call(self.rt.cudaSetDevice(device), "cudaSetDevice")
        self.stream = self._call(self.rt.cudaStreamCreate(), "cudaStreamCreate")
        self.D2D = self.rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice
        self.H2D = self.rt.cudaMemcpyKind.cudaMemcpyHostToDevice
        self.D2H = self.rt.cudaMemcpyKind.cudaMemcpyDeviceToHost

    @staticmethod
    def _call(result, what: str):
        err, *rest = result
        if int(err) != 0:
            raise RuntimeError(f"{what} failed: CUDA error {getattr(err, 'name', err)}")
        return rest[0] if len(rest) == 1 else None

    @property
    def stream_handle(self) -> int:
        s = self.stream
        try:
            return int(s)
        except TypeError:
            return int(s.getPtr())

    def malloc(self, nbytes: int) -> int:
        return int(self._call(self.rt.cudaMalloc(max(int(nbytes), 1)), "cudaMalloc"))

    def free(self, ptr: int) -> None:
        self._call(self.rt.cudaFree(ptr), "cudaFree")

    def copy(self, dst: int, src: int, nbytes: int, kind) -> None:
        if nbytes:
            self._call(self.rt.cudaMemcpyAsync(dst, src, nbytes, kind, self.stream), "cudaMemcpyAsync")

    def copy_2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int) -> None:
        self._call(self.rt.cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, self.D2D, self.stream),
                   "cudaMemcpy2DAsync")

    def sync(self) -> None:
        self._call(self.rt.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")

    def close(self) -> None:
        self.rt.cudaStreamDestroy(self.stream)


class _Buffers:
    """Named device buffers that grow on demand (step inputs and outputs of varying S)."""

    def __init__(self, cuda: _Cuda):
        self.cuda, self.ptrs, self.sizes = cuda, {}, {}

    def get(self, key: str, nbytes: int) -> int:
        if self.sizes.get(key, -1) < nbytes:
            if key in self.ptrs:
                self.cuda.sync()  # the old buffer may still be read by queued work
                self.cuda.free(self.ptrs[key])
            self.sizes[key] = align(max(nbytes, 1))
            self.ptrs[key] = self.cuda.malloc(self.sizes[key])
        return self.ptrs[key]

    def free(self) -> None:
        for p in self.ptrs.values():
            self.cuda.free(p)
        self.ptrs.clear()
        self.sizes.clear()


class DeviceRows(NamedTuple):
    """The step's hidden states [S, d] on the device; ``rows[a:b]`` is a [b - a, d] :class:`DeviceSlice`."""

    ptr: int
    rows: int
    width: int
    itemsize: int

    def __getitem__(self, index: slice) -> "DeviceSlice":
        start, stop, _ = index.indices(self.rows)
        return DeviceSlice(self.ptr + start * self.width * self.itemsize, (stop - start, self.width))


class DeviceSlice(NamedTuple):
    ptr: int
    shape: tuple[int, int]


class TrtPast(NamedTuple):
    """What :meth:`TrtKVCache.past` hands to the engine: the cache and its valid length."""

    cache: "TrtKVCache"
    length: int


class TrtNewKV(NamedTuple):
    """Where a step left its new K/V: in the cache itself (prefill) or the engine's step buffer."""

    in_place: bool
    past_len: int
    rows: int


class TrtKVCache:
    """The KV cache in device memory; same interface as :class:`medusa_runtime.engines.kvcache.KVCache`."""

    def __init__(self, engine: "TrtEngine", capacity: int):
        self.engine = engine
        self.layout = KVLayout(engine.num_layers, engine.num_kv_heads, engine.head_dim, engine.kv_dtype.itemsize,
                               capacity)
        self.ptr = engine.cuda.malloc(self.layout.total_bytes)
        self.capacity = capacity
        self.length = 0
        self.tokens: list[int] = []

    def past(self) -> TrtPast:
        return TrtPast(self, self.length)

    def keep(self, new_kv: TrtNewKV, accepted: np.ndarray, token_ids=None) -> None:
        """KV compaction on the device: accepted node ``accepted[i]`` -> slot ``length + i``."""
        if new_kv.past_len != self.length:
            raise RuntimeError(f"step output was for past length {new_kv.past_len}, the cache holds {self.length}")
        self.engine.compact(self, new_kv, np.asarray(accepted))
        self.length += len(accepted)
        self.tokens.extend([int(t) for t in token_ids] if token_ids is not None else [-1] * len(accepted))

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {length}")
        self.length = length
        del self.tokens[length:]

    def free(self) -> None:
        if self.ptr:
            self.engine.cuda.sync()
            self.engine.cuda.free(self.ptr)
            self.ptr = 0


class _Graph:
    """One deserialized engine with an execution context per optimization profile."""

    def __init__(self, trt, runtime, cuda: _Cuda, path: Path, profiles):
        engine = runtime.deserialize_cuda_engine(path.read_bytes())
        if engine is None:
            raise ArtifactError(f"TensorRT could not load {path}: a plan only runs with the TensorRT version and GPU "
                                f"model it was built for; rebuild it with `medusa-export engine`")
        if engine.num_optimization_profiles != len(profiles):
            raise ArtifactError(f"{path} has {engine.num_optimization_profiles} optimization profiles, the manifest "
                                f"describes {len(profiles)} ({', '.join(p.name for p in profiles)})")
        self.engine, self.profiles = engine, profiles
        self.dtypes = {}
        for i in range(engine.num_io_tensors):
            name = engine.get_tensor_name(i)
            self.dtypes[name] = np.dtype(trt.nptype(engine.get_tensor_dtype(name)))
        self.contexts = []
        for i in range(len(profiles)):
            ctx = engine.create_execution_context(trt.ExecutionContextAllocationStrategy.USER_MANAGED)
            ctx.set_optimization_profile_async(i, cuda.stream_handle)
            self.contexts.append(ctx)

    def scratch_bytes(self) -> int:
        e = self.engine
        if hasattr(e, "get_device_memory_size_for_profile_v2"):  # TensorRT >= 10.1
            return max(e.get_device_memory_size_for_profile_v2(i) for i in range(len(self.profiles)))
        return getattr(e, "device_memory_size_v2", None) or e.device_memory_size

    def share_scratch(self, ptr: int, nbytes: int) -> None:
        for ctx in self.contexts:
            if hasattr(ctx, "set_device_memory"):  # TensorRT >= 10.1
                ctx.set_device_memory(ptr, nbytes)
            else:
                ctx.device_memory = ptr


class TrtEngine:
    """Runs ``engines/model.PRECISION.plan`` and ``engines/heads.PRECISION.plan`` of an artifact.

    Args:
        artifact: a loaded artifact whose engines were built (``medusa-export engine``).
        precision: which engines ("fp16", "int8", "fp32").
        device_id: the CUDA device.
        **_: options of other backends (``threads``), ignored.

    Raises:
        BackendUnavailableError: TensorRT or cuda-python is missing.
        ArtifactError: the plans are missing or do not load.
    """

    #: The tree's shape is fixed when the plans are built (their optimization profiles): the runtime's
    #: default runs the artifact's tree instead of timing other sizes (:mod:`medusa_runtime.treecache`).
    fixed_tree = True

    def __init__(self, artifact: Artifact, precision: str = "fp16", device_id: int = 0, **_):
        trt = _import_tensorrt()
        manifest = artifact.manifest
        plans = {g: artifact.path / rel for g, rel in plan_files(manifest, precision).items()}
        missing = [str(p) for p in plans.values() if not p.is_file()]
        if missing:
            raise ArtifactError(f"no {precision} TensorRT engine in {artifact.path} ({', '.join(missing)} missing): "
                                f"build it with `medusa-export engine --artifact {artifact.path} --precision {precision}` or "
                                f"`bash engines/build_engine.sh {precision}` on this GPU machine")
        m = artifact.model
        self.num_layers, self.num_kv_heads, self.head_dim = m.num_layers, m.num_kv_heads, m.head_dim
        self.num_heads, self.hidden_size = m.medusa_heads, m.hidden_size
        self.manifest = manifest
        # An in-graph sampler (docs/sampling.md) is fed its defaults, not used: sampling draws from the top-k.
        self.max_context, self.vocab_size, self.step_topk, self._graph_sampler = step_limits(manifest)
        self.has_sampler = False
        self.cuda = _Cuda(device_id)
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        self.model = _Graph(trt, self._runtime, self.cuda, plans["model"], model_profiles(manifest))
        self.heads_graph = _Graph(trt, self._runtime, self.cuda, plans["heads"], heads_profiles(manifest))
        scratch = max(self.model.scratch_bytes(), self.heads_graph.scratch_bytes())
        self._scratch = self.cuda.malloc(scratch)
        self.model.share_scratch(self._scratch, scratch)
        self.heads_graph.share_scratch(self._scratch, scratch)
        self.kv_dtype = self.model.dtypes["past_key_values.0.key"]
        self.hidden_dtype = self.model.dtypes["hidden_states"]
        # Tree / decode steps (P > 0) write new K/V here; a prefill (P = 0) writes into the cache.
        step_rows = max(p.dims["S"][2] for p in self.model.profiles if p.dims["P"][2] > 0)
        self.new_layout = KVLayout(self.num_layers, self.num_kv_heads, self.head_dim, self.kv_dtype.itemsize, step_rows)
        self._new_kv = self.cuda.malloc(self.new_layout.total_bytes)
        self._buf = _Buffers(self.cuda)

    def make_cache(self, capacity: int) -> TrtKVCache:
        """A device KV cache of ``capacity`` tokens (the loop calls this instead of making a numpy one)."""
        return TrtKVCache(self, capacity)

    def _bind_input(self, ctx, key: str, name: str, arr: np.ndarray) -> None:
        arr = np.ascontiguousarray(arr)
        ptr = self._buf.get(key, arr.nbytes)
        self.cuda.copy(ptr, arr.ctypes.data, arr.nbytes, self.cuda.H2D)
        ctx.set_input_shape(name, arr.shape)
        ctx.set_tensor_address(name, ptr)

    def step(self, input_ids, position_ids, mask, temperature, past: TrtPast) -> StepResult:
        if not isinstance(past, TrtPast):
            raise TypeError("TrtEngine keeps the KV cache on the device: use the cache from engine.make_cache()")
        cache, p = past
        s = int(input_ids.shape[1])
        if p + s > cache.capacity:
            raise ContextOverflowError(f"a step of {s} tokens does not fit after {p} of {cache.capacity} slots")
        ctx = self.model.contexts[select_profile(self.model.profiles, {"S": s, "P": p})]
        dt = self.model.dtypes
        feeds = {"input_ids": input_ids, "position_ids": position_ids, "new_token_mask": mask,
                 "temperature": np.array([temperature]), **(sampler_feed(s, None) if self._graph_sampler else {})}
        for name, arr in feeds.items():
            self._bind_input(ctx, f"model.{name}", name, np.asarray(arr, dtype=dt[name]))
        kv_shape = lambda n: (1, n, self.num_kv_heads, self.head_dim)  # noqa: E731
        in_place = p == 0
        # An empty past (prefill) is bound to the step buffer, so that no input aliases the
        # cache planes the prefill writes; zero-volume tensors are never read.
        past_base = self._new_kv if in_place else cache.ptr
        for name, off in kv_bindings(cache.layout, "past_key_values").items():
            ctx.set_input_shape(name, kv_shape(p))
            ctx.set_tensor_address(name, past_base + (0 if in_place else off))
        if not in_place and s > self.new_layout.slots:
            raise ContextOverflowError(f"a step of {s} tokens after a past exceeds the engine's {self.new_layout.slots}-row "
                                       "K/V output buffer")
        base, layout = (cache.ptr, cache.layout) if in_place else (self._new_kv, self.new_layout)
        for name, off in kv_bindings(layout, "new_key_values").items():
            ctx.set_tensor_address(name, base + off)
        missing = ctx.infer_shapes()
        if missing:
            raise RuntimeError(f"TensorRT could not infer the shapes of {missing}")
        host = {}
        for name in (*_HOST_OUTPUTS, "hidden_states"):
            shape = tuple(ctx.get_tensor_shape(name))
            nbytes = int(np.prod(shape)) * dt[name].itemsize
            ptr = self._buf.get(f"model.{name}", nbytes)
            ctx.set_tensor_address(name, ptr)
            if name != "hidden_states":
                host[name] = (np.empty(shape, dt[name]), ptr)
        if not ctx.execute_async_v3(self.cuda.stream_handle):
            raise RuntimeError("TensorRT failed to enqueue the step")
        for arr, ptr in host.values():
            self.cuda.copy(arr.ctypes.data, ptr, arr.nbytes, self.cuda.D2H)
        self.cuda.sync()
        out = {k: v[0][0] for k, v in host.items()}
        hidden = DeviceRows(self._buf.ptrs["model.hidden_states"], s, self.hidden_size, self.hidden_dtype.itemsize)
        return StepResult(out["topk_ids"], out["topk_logprobs"], out["entropy"], out["token_logprobs"], hidden,
                          TrtNewKV(in_place, p, s))

    def compact(self, cache: TrtKVCache, new_kv: TrtNewKV, accepted: np.ndarray) -> None:
        """Queue the device copies of the accepted nodes' K/V into the cache (same stream as the steps)."""
        src_base, src_layout = (cache.ptr, cache.layout) if new_kv.in_place else (self._new_kv, self.new_layout)
        for c in compaction_copies(src_layout, cache.layout, new_kv.past_len, accepted, in_place=new_kv.in_place):
            self.cuda.copy_2d(cache.ptr + c.dst_offset, c.dpitch, src_base + c.src_offset, c.spitch, c.width, c.height)

    def heads(self, hidden, topk: int) -> np.ndarray:
        """hidden: a :class:`DeviceSlice` of a step's hidden states (or a host array [R, d]) -> int64 [R, K, topk]."""
        g = self.heads_graph
        r = int(hidden.shape[0])
        ctx = g.contexts[select_profile(g.profiles, {"R": r})]
        nbytes = r * self.hidden_size * self.hidden_dtype.itemsize
        if isinstance(hidden, DeviceSlice):  # device -> aligned device buffer (a row offset is not 256-aligned)
            ptr = self._buf.get("heads.hidden_states", nbytes)
            self.cuda.copy(ptr, hidden.ptr, nbytes, self.cuda.D2D)
            ctx.set_input_shape("hidden_states", hidden.shape)
            ctx.set_tensor_address("hidden_states", ptr)
        else:
            self._bind_input(ctx, "heads.hidden_states", "hidden_states", np.asarray(hidden, self.hidden_dtype))
        shape = tuple(ctx.get_tensor_shape("medusa_topk_ids"))
        out = np.empty(shape, g.dtypes["medusa_topk_ids"])
        ptr = self._buf.get("heads.medusa_topk_ids", out.nbytes)
        ctx.set_tensor_address("medusa_topk_ids", ptr)
        for name in g.dtypes:  # outputs this loop does not read (medusa_topk_logprobs): every output needs an address
            if name not in ("hidden_states", "medusa_topk_ids"):
                nbytes = int(np.prod(tuple(ctx.get_tensor_shape(name)))) * g.dtypes[name].itemsize
                ctx.set_tensor_address(name, self._buf.get(f"heads.{name}", nbytes))
        if not ctx.execute_async_v3(self.cuda.stream_handle):
            raise RuntimeError("TensorRT failed to enqueue the heads")
        self.cuda.copy(out.ctypes.data, ptr, out.nbytes, self.cuda.D2H)
        self.cuda.sync()
        return out

    def close(self) -> None:
        """Free the device memory (the engine is unusable afterwards)."""
        self.cuda.sync()
        self._buf.free()
        for ptr in (self._new_kv, self._scratch):
            self.cuda.free(ptr)
        self._new_kv = self._scratch = 0
        del self.model, self.heads_graph
        self.cuda.close()
