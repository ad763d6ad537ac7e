"""ONNX Runtime on a GPU: CUDA execution provider with I/O binding, KV cache on the device.

Written against ONNX Runtime's documented Python I/O-binding API (``InferenceSession.io_binding``,
``IOBinding.bind_input/bind_output/bind_cpu_input``, ``OrtValue.ortvalue_from_shape_and_type``) and
the CUDA runtime's ``cudaMemcpy2D``. Construction fails with :class:`BackendUnavailableError` where
the provider is missing. No GPU has run it: CI runs the same code with ``io_device="cpu"`` (every
binding on ONNX Runtime's CPU device, the strided copies as host ``memmove``s; tests/test_ort_cuda.py),
token-exact against the CPU backend, which checks the binding offsets and the compaction, not the CUDA
provider.

Layout: one device buffer per K and V, ``[L, capacity, H_kv, D]``. Layer ``l``'s valid
past ``[1, P, H_kv, D]`` is the contiguous block at slot 0 of layer ``l``, bound as the
``past_key_values.{l}.*`` input without a copy; the step's ``new_key_values.{l}.*`` output
is bound to slots ``[P, P + S)`` of the same layer, so the step writes its K/V straight
into the cache. KV compaction then only moves the accepted nodes that are not already in
place (node ``accepted[i]`` -> slot ``P + i``): one strided ``cudaMemcpy2D`` per moved node
covers every layer. The acceptance outputs (top-k, log-probs, entropy; a few KB) are
copied to the host; the hidden states stay on the device and the heads graph reads the
accepted row from there.
"""

from __future__ import annotations

import ctypes
import glob
import os
from typing import NamedTuple

import numpy as np

from ..contract.artifact import Artifact, kv_layout, step_limits
from ..errors import BackendUnavailableError, InvalidSettingError
from .base import Capabilities, StepResult, sampler_feed
from .cuda import DeviceRows, DeviceSlice
from .kvcache import CacheState, compaction_slots, in_place_moves
from .ort import KV_DTYPES, session_options

_HOST_OUTPUTS = ("topk_ids", "topk_logprobs", "entropy", "token_logprobs")
_D2D = 3  # cudaMemcpyDeviceToDevice
#: Where the KV cache and the hidden states are bound: ONNX Runtime's device names (OrtDevice).
IO_DEVICES = ("cuda", "cpu")


def _load_cudart() -> ctypes.CDLL:
    """The CUDA runtime library (the one onnxruntime-gpu loads), for device-to-device copies."""
    names = ["libcudart.so.12", "libcudart.so.11.0", "libcudart.so"]
    try:
        import nvidia.cuda_runtime  # pip wheel that onnxruntime-gpu depends on

        names += glob.glob(os.path.join(list(nvidia.cuda_runtime.__path__)[0], "lib", "libcudart.so*"))
    except ImportError:
        pass
    for name in names:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        lib.cudaMemcpy2D.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                                     ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int]
        return lib
    raise BackendUnavailableError("the CUDA runtime library (libcudart) was not found; install onnxruntime-gpu "
                                  "with its CUDA 12 dependencies")


class _CudaCopies:
    """Strided device-to-device copies with libcudart's ``cudaMemcpy2D`` (``io_device="cuda"``)."""

    def __init__(self):
        self.lib = _load_cudart()

    def copy_2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int) -> None:
        err = self.lib.cudaMemcpy2D(dst, dpitch, src, spitch, width, height, _D2D)
        if err:
            raise RuntimeError(f"cudaMemcpy2D failed with CUDA error {err}")

    def sync(self) -> None:
        self.lib.cudaDeviceSynchronize()


class _HostCopies:
    """The same copies on host memory (``io_device="cpu"``): ``height`` ``memmove``s of ``width`` bytes."""

    @staticmethod
    def copy_2d(dst: int, dpitch: int, src: int, spitch: int, width: int, height: int) -> None:
        for row in range(height):
            ctypes.memmove(dst + row * dpitch, src + row * spitch, width)

    @staticmethod
    def sync() -> None:
        """Nothing queued: host copies are done when they return."""


class DevicePast(NamedTuple):
    """What :meth:`DeviceKVCache.past` hands to the engine: the cache and its valid length."""

    cache: "DeviceKVCache"
    length: int


class DeviceKVCache(CacheState):
    """The KV cache in device memory; same interface as :class:`medusa_runtime.engines.kvcache.KVCache`.

    Args:
        engine: the engine whose geometry (layers, heads, dtype, device) the cache follows.
        capacity: slots (tokens).
    """

    def __init__(self, engine: "OrtCudaEngine", capacity: int):
        import onnxruntime as ort

        super().__init__(capacity)
        shape = [engine.num_layers, capacity, engine.num_kv_heads, engine.head_dim]
        dtype = engine.kv_dtype.type
        self.keys = ort.OrtValue.ortvalue_from_shape_and_type(shape, dtype, engine.io_device, engine.device_id)
        self.values = ort.OrtValue.ortvalue_from_shape_and_type(shape, dtype, engine.io_device, engine.device_id)
        self.num_layers = engine.num_layers
        self.row_bytes = engine.num_kv_heads * engine.head_dim * engine.kv_dtype.itemsize
        self.layer_bytes = capacity * self.row_bytes
        self._copies = engine.copies

    def ptr(self, which: str, layer: int, slot: int) -> int:
        """Device address of ``which`` ("key"/"value") at (layer, slot)."""
        base = (self.keys if which == "key" else self.values).data_ptr()
        return base + layer * self.layer_bytes + slot * self.row_bytes

    def past(self) -> DevicePast:
        return DevicePast(self, self.length)

    def keep(self, new_kv, accepted: np.ndarray, token_ids=None) -> None:
        """Compact: the step wrote node j's K/V to slot length + j; move accepted[i] to length + i."""
        compaction_slots(self.length, accepted, self.capacity)  # raises when it would not fit
        moves = in_place_moves(accepted)
        for src, dst in moves:
            for buf in (self.keys, self.values):
                base = buf.data_ptr()
                self._copies.copy_2d(base + (self.length + dst) * self.row_bytes, self.layer_bytes,
                                     base + (self.length + src) * self.row_bytes, self.layer_bytes,
                                     self.row_bytes, self.num_layers)
        if moves:
            self._copies.sync()
        self._advance(accepted, token_ids)


class OrtCudaEngine:
    """The artifact's graphs on ONNX Runtime's CUDA provider, with I/O binding.

    Args:
        artifact: a loaded artifact.
        device_id: the CUDA device.
        threads: intra-op threads for the CPU parts.
        io_device: "cuda" (deployment), or "cpu": the same bindings on ONNX Runtime's CPU device and provider,
            so that CI runs this code (:data:`IO_DEVICES`).

    Raises:
        BackendUnavailableError: onnxruntime has no CUDA provider here, or libcudart is missing.
        InvalidSettingError: an unknown ``io_device``.
    """

    def __init__(self, artifact: Artifact, device_id: int = 0, threads: int | None = None, io_device: str = "cuda"):
        import onnxruntime as ort

        if io_device not in IO_DEVICES:
            raise InvalidSettingError(f"io_device must be one of {', '.join(IO_DEVICES)}, got {io_device!r}")
        if io_device == "cuda" and "CUDAExecutionProvider" not in ort.get_available_providers():
            raise BackendUnavailableError(
                "onnxruntime has no CUDAExecutionProvider here (available: "
                f"{', '.join(ort.get_available_providers())}); install onnxruntime-gpu on a machine with an NVIDIA GPU"
            )
        if kv_layout(artifact.manifest) != "sequence-major":
            raise BackendUnavailableError(
                f"{artifact.path} is an {artifact.manifest.flavour} artifact (head-major KV written in place by "
                "ONNX Runtime's CPU kernels); this CUDA engine binds the sequence-major step of the portable graph: "
                "run it with the onnxruntime backend, or build --graph portable")
        m = artifact.model
        self.num_layers, self.num_kv_heads, self.head_dim = m.num_layers, m.num_kv_heads, m.head_dim
        self.num_heads = m.medusa_heads
        self.kv_dtype = np.dtype(KV_DTYPES[artifact.manifest.precision.kv_dtype])
        # An in-graph sampler (docs/sampling.md) is fed its defaults, not used: sampling draws from the top-k.
        limits = step_limits(artifact.manifest)
        self._graph_sampler = limits.has_sampler
        self.hidden_size = m.hidden_size
        self.io_device = io_device
        self.device_id = device_id if io_device == "cuda" else 0
        # precision.step_rows describes ONNX Runtime's CPU kernels (int8 activations); this engine does not pad
        self.capabilities = Capabilities.with_limits(limits._replace(min_rows=1, chain_trees=False), own_cache=True,
                                                     device_id=self.device_id)
        self.copies = _CudaCopies() if io_device == "cuda" else _HostCopies()
        providers = ([("CUDAExecutionProvider", {"device_id": device_id})] if io_device == "cuda" else []) + [
            "CPUExecutionProvider"]
        opts = session_options(threads)
        self.step_session = ort.InferenceSession(str(artifact.file("model")), opts, providers=providers)
        if artifact.head_type != "medusa":
            raise BackendUnavailableError(f"the ort-cuda backend runs Medusa heads (heads.onnx) only; this artifact's "
                                          f"heads are {artifact.head_type!r}: use the ort (CPU) backend")
        self.heads_session = ort.InferenceSession(str(artifact.file("heads")), opts, providers=providers)

    def make_cache(self, capacity: int) -> DeviceKVCache:
        return DeviceKVCache(self, capacity)

    def close(self) -> None:
        """Nothing to free explicitly: the caches' OrtValues free their device memory when dropped."""

    def step(self, input_ids, position_ids, mask, temperature, past: DevicePast) -> StepResult:
        cache, p = past
        s = int(input_ids.shape[1])
        io = self.step_session.io_binding()
        io.bind_cpu_input("input_ids", np.ascontiguousarray(input_ids))
        io.bind_cpu_input("position_ids", np.ascontiguousarray(position_ids))
        io.bind_cpu_input("new_token_mask", np.ascontiguousarray(mask))
        io.bind_cpu_input("temperature", np.array([temperature], dtype=np.float32))
        for name, value in (sampler_feed(s, None) if self._graph_sampler else {}).items():
            io.bind_cpu_input(name, value)
        for name in _HOST_OUTPUTS:
            io.bind_output(name, "cpu")
        io.bind_output("hidden_states", self.io_device, self.device_id)
        shape = lambda n: [1, n, self.num_kv_heads, self.head_dim]  # noqa: E731
        for i in range(self.num_layers):
            for which in ("key", "value"):
                io.bind_input(f"past_key_values.{i}.{which}", self.io_device, self.device_id, self.kv_dtype.type,
                              shape(p), cache.ptr(which, i, 0))
                io.bind_output(f"new_key_values.{i}.{which}", self.io_device, self.device_id, self.kv_dtype.type,
                               shape(s), cache.ptr(which, i, p))
        self.step_session.run_with_iobinding(io)
        outs = io.get_outputs()  # in binding order
        topk_ids, topk_lp, entropy, token_lp = (outs[j].numpy()[0] for j in range(4))
        hidden = DeviceRows(outs[4].data_ptr(), s, self.hidden_size, self.kv_dtype.itemsize, owner=outs[4])
        return StepResult(topk_ids, topk_lp, entropy, token_lp, hidden, [])

    def heads(self, hidden: DeviceSlice, topk: int) -> np.ndarray:
        io = self.heads_session.io_binding()
        io.bind_input("hidden_states", self.io_device, self.device_id, self.kv_dtype.type, list(hidden.shape),
                      hidden.ptr)
        io.bind_output("medusa_topk_ids", "cpu")
        self.heads_session.run_with_iobinding(io)
        return io.get_outputs()[0].numpy()
