"""CUDA runtime helpers shared by the device backends: cuda-python's runtime module, calls with their
errors raised, the device set in each thread that touches it, device and pinned host buffers, and
views of device rows.

cuda-python (NVIDIA's bindings, the ones TensorRT's samples use) returns ``(cudaError_t, value...)``
tuples; :meth:`Cuda.call` turns a non-zero code into :class:`CudaError`. Its rules, as cited:

* the current device is per host thread (CUDA Runtime API, ``cudaSetDevice``: "Sets device as the
  current device for the calling host thread"), so every entry point that may run on another thread
  than the constructor's (a batch server's, Triton's) calls :meth:`Cuda.use` first;
* page-locked host memory (``cudaMallocHost``) is what ``cudaMemcpyAsync`` needs to be asynchronous
  and what avoids the driver's staging copy (CUDA C++ Best Practices Guide, "Pinned Memory").

Under ``tests/emulated`` the same module names resolve to the test double (host memory; see there).
"""

from __future__ import annotations

import ctypes
import threading
from typing import NamedTuple

import numpy as np

from ..errors import BackendUnavailableError, InvalidSettingError, MedusaError


class CudaError(MedusaError, RuntimeError):
    """A CUDA runtime call failed; the message names the call and the error code."""


def import_cudart(backend: str):
    """cuda-python's runtime module (``cuda.bindings.runtime``, cuda-python >= 12.6; ``cuda.cudart`` before).

    Raises:
        BackendUnavailableError: cuda-python is not installed (the message names ``backend``).
    """
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        try:
            from cuda import cudart
        except ImportError:
            raise BackendUnavailableError(f"the {backend} backend needs cuda-python for device memory "
                                          "(pip install cuda-python)") from None
    return cudart


def device_key(cudart, device: int) -> dict:
    """{"gpu": name, "compute_capability": "major.minor"} of CUDA device ``device`` (``cudaGetDeviceProperties``):
    the GPU part of a TensorRT plan's key; "unknown" for both where the call fails."""
    err, *props = cudart.cudaGetDeviceProperties(device)
    if int(err) != 0:
        return {"gpu": "unknown", "compute_capability": "unknown"}
    name = props[0].name
    name = (name.decode(errors="replace") if isinstance(name, bytes) else str(name)).rstrip("\x00")
    return {"gpu": name, "compute_capability": f"{props[0].major}.{props[0].minor}"}


def _code_name(err) -> str:
    return getattr(err, "name", str(int(err)))


class Cuda:
    """One device's stream and the CUDA runtime calls a backend makes, errors raised.

    Args:
        device: the CUDA device ordinal.
        backend: the backend's name, for error messages.

    Raises:
        BackendUnavailableError: cuda-python is missing.
        InvalidSettingError: ``device`` is not in [0, the device count) (the message gives the count).
        CudaError: a CUDA call failed.
    """

    def __init__(self, device: int, backend: str = "tensorrt"):
        self.rt = rt = import_cudart(backend)
        self.device = int(device)
        count = self.call(rt.cudaGetDeviceCount(), "cudaGetDeviceCount")
        if not 0 <= self.device < count:
            raise InvalidSettingError(f"CUDA device {device} does not exist: this machine has {count} device(s); "
                                      f"give --device-id in 0..{count - 1}")
        self._local = threading.local()
        self.use()
        self.stream = self.call(rt.cudaStreamCreate(), "cudaStreamCreate")
        self.D2D = rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice
        self.H2D = rt.cudaMemcpyKind.cudaMemcpyHostToDevice
        self.D2H = rt.cudaMemcpyKind.cudaMemcpyDeviceToHost

    @staticmethod
    def call(result, what: str):
        """The value of a cuda-python call's ``(err, value...)`` tuple (None when it has none).

        Raises:
            CudaError: ``err`` is not cudaSuccess.
        """
        err, *rest = result
        if int(err) != 0:
            raise CudaError(f"{what} failed: CUDA error {_code_name(err)}")
        return rest[0] if len(rest) == 1 else None

    def use(self) -> None:
        """Make this device current in the calling thread (once per thread; cheap afterwards)."""
        if getattr(self._local, "device", None) != self.device:
            self.call(self.rt.cudaSetDevice(self.device), "cudaSetDevice")
            self._local.device = self.device

    @property
    def stream_handle(self) -> int:
        """The stream as the integer TensorRT's ``execute_async_v3`` takes."""
        s = self.stream
        try:
            return int(s)
        except TypeError:
            return int(s.getPtr())

    def device_name(self) -> dict:
        """:func:`device_key` of this device."""
        return device_key(self.rt, self.device)

    def malloc(self, nbytes: int) -> int:
        """Device memory of ``nbytes`` (at least 1) bytes on this device."""
        self.use()
        return int(self.call(self.rt.cudaMalloc(max(int(nbytes), 1)), "cudaMalloc"))

    def free(self, ptr: int) -> None:
        """Free a :meth:`malloc` pointer (0: nothing)."""
        if ptr:
            self.use()
            self.call(self.rt.cudaFree(ptr), "cudaFree")

    def copy(self, dst: int, src: int, nbytes: int, kind) -> None:
        """Queue ``cudaMemcpyAsync`` of ``nbytes`` on the stream (nothing for 0 bytes)."""
        if nbytes:
            self.call(self.rt.cudaMemcpyAsync(dst, src, nbytes, kind, self.stream), "cudaMemcpyAsync")

    def copy_2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int) -> None:
        """Queue a device-to-device ``cudaMemcpy2DAsync``: ``height`` rows of ``width`` bytes (pitches in bytes)."""
        self.call(self.rt.cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, self.D2D, self.stream),
                  "cudaMemcpy2DAsync")

    def zero(self, ptr: int, nbytes: int) -> None:
        """Queue ``cudaMemsetAsync`` of ``nbytes`` zero bytes at ``ptr`` on the stream (nothing for 0 bytes):
        device memory is not cleared when allocated (``cudaMalloc``: "The memory is not cleared")."""
        if nbytes:
            self.call(self.rt.cudaMemsetAsync(ptr, 0, nbytes, self.stream), "cudaMemsetAsync")

    def sync(self) -> None:
        """Wait for the stream's queued work."""
        self.call(self.rt.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")

    def close(self) -> None:
        """Destroy the stream (after its work is done)."""
        if self.stream is not None:
            self.use()
            self.sync()
            self.call(self.rt.cudaStreamDestroy(self.stream), "cudaStreamDestroy")
            self.stream = None


class Buffers:
    """Named device buffers (``pinned=False``) or page-locked host arrays (``pinned=True``) that grow on demand.

    :meth:`get` reuses a buffer while it is large enough, so steps of varying size allocate only when a
    larger one comes; :meth:`free` releases them all.
    """

    def __init__(self, cuda: Cuda, pinned: bool = False):
        self.cuda, self.pinned = cuda, pinned
        self.ptrs: dict[str, int] = {}
        self.sizes: dict[str, int] = {}

    def get(self, key: str, nbytes: int) -> int:
        """The address of buffer ``key``, at least ``nbytes`` bytes (256-byte aligned on the device)."""
        if self.sizes.get(key, -1) < nbytes:
            if key in self.ptrs:
                self.cuda.sync()  # the old buffer may still be read by queued work
                self._release(self.ptrs.pop(key))
            size = -(-max(int(nbytes), 1) // 256) * 256
            self.ptrs[key] = self._alloc(size)
            self.sizes[key] = size
        return self.ptrs[key]

    def host_array(self, key: str, shape: tuple, dtype) -> np.ndarray:
        """A pinned host array of ``shape`` and ``dtype`` (``pinned=True`` only), valid until the buffer grows."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        ptr = self.get(key, nbytes)
        raw = (ctypes.c_uint8 * max(nbytes, 1)).from_address(ptr)
        return np.frombuffer(raw, np.uint8, nbytes).view(dtype).reshape(shape)

    def _alloc(self, size: int) -> int:
        if self.pinned:
            return int(self.cuda.call(self.cuda.rt.cudaMallocHost(size), "cudaMallocHost"))
        return self.cuda.malloc(size)

    def _release(self, ptr: int) -> None:
        if self.pinned:
            self.cuda.call(self.cuda.rt.cudaFreeHost(ptr), "cudaFreeHost")
        else:
            self.cuda.free(ptr)

    def free(self) -> None:
        """Free every buffer."""
        for p in self.ptrs.values():
            self._release(p)
        self.ptrs.clear()
        self.sizes.clear()


class DeviceRows(NamedTuple):
    """A step's hidden states [S, d] on the device; ``rows[a:b]`` is a [b - a, d] :class:`DeviceSlice`.

    ``owner`` keeps the memory alive while a view exists (onnxruntime-cuda: the step's ``OrtValue``); None
    where the engine owns the buffer (TensorRT: valid until the next step).
    """

    ptr: int
    rows: int
    width: int
    itemsize: int
    owner: object = None

    def __getitem__(self, index: slice) -> "DeviceSlice":
        start, stop, _ = index.indices(self.rows)
        return DeviceSlice(self.ptr + start * self.width * self.itemsize, (stop - start, self.width), self)


class DeviceSlice(NamedTuple):
    """Rows of a :class:`DeviceRows`: the first row's device address and the [rows, d] shape (``rows`` keeps
    its owner alive)."""

    ptr: int
    shape: tuple[int, int]
    rows: object = None
