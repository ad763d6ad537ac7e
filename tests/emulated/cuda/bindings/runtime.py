"""EMULATED CUDA runtime (cuda-python's ``cuda.bindings.runtime``) on host memory, for tests only.

This is a test double for the calls this project makes, NOT CUDA: "device" memory is numpy
byte buffers keyed by fake device addresses (above 2**48, so that no real host address can
be mistaken for one), copies are synchronous ``memmove``s, and a stream is a handle that only
remembers its device. It is never shipped (it lives under tests/ and is not a package of
pyproject.toml); put ``tests/emulated`` first on ``PYTHONPATH`` to use it.

Every call returns cuda-python's tuple: ``(cudaError_t,)`` or ``(cudaError_t, value)``.
Where the real runtime's behaviour would be undefined (a read of freed memory, a copy past
an allocation) the emulation returns an error code instead, and the reason is kept in
:func:`emulator_last_error`. Each rule below cites the CUDA Runtime API reference
(https://docs.nvidia.com/cuda/cuda-runtime-api/) or the CUDA C++ Programming Guide.

Emulator-only helpers (not cuda-python API): :func:`emulator_live_device_bytes`,
:func:`emulator_live_host_bytes`, :func:`emulator_last_error`; the TensorRT emulation uses
:func:`emulator_device_view` and :func:`emulator_check_stream`.

Environment: ``EMULATED_CUDA_DEVICES`` (default 2) emulated devices, each named
"Emulated GPU (host memory)" (``EMULATED_CUDA_NAME``) with compute capability 9.0 (``EMULATED_CUDA_CC``, e.g. 7.5).
"""

from __future__ import annotations

import bisect
import ctypes
import enum
import os
import threading
from dataclasses import dataclass

import numpy as np

__all__ = [
    "cudaError_t", "cudaMemcpyKind", "cudaStream_t", "cudaDeviceProp", "cudaGetDeviceCount", "cudaGetDevice",
    "cudaSetDevice", "cudaGetDeviceProperties", "cudaGetErrorString", "cudaGetErrorName", "cudaMalloc", "cudaFree",
    "cudaMallocHost", "cudaHostAlloc", "cudaFreeHost", "cudaMemcpy", "cudaMemcpyAsync", "cudaMemcpy2D",
    "cudaMemcpy2DAsync", "cudaMemset", "cudaStreamCreate", "cudaStreamCreateWithFlags", "cudaStreamDestroy",
    "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemGetInfo",
    "emulator_live_device_bytes", "emulator_live_host_bytes", "emulator_last_error", "emulator_device_view",
    "emulator_check_stream", "EmulatedCudaError",
]

EMULATED = True
DEVICE_COUNT = int(os.environ.get("EMULATED_CUDA_DEVICES", "2"))
#: The emulated devices' model name (cudaDeviceProp.name): ``EMULATED_CUDA_NAME``.
NAME = os.environ.get("EMULATED_CUDA_NAME", "Emulated GPU (host memory)")
#: The emulated devices' compute capability (cudaDeviceProp.major / minor): ``EMULATED_CUDA_CC``.
CC = tuple(int(x) for x in os.environ.get("EMULATED_CUDA_CC", "9.0").split("."))
#: Bytes of device memory per emulated device (what cudaMemGetInfo reports as total).
DEVICE_BYTES = 8 << 30
#: cudaMalloc: "The allocated memory is suitably aligned for any kind of variable" (256 bytes in practice).
_ALIGN = 256
#: Fake device addresses start above 2**48 (no user-space host address on x86-64 / aarch64 Linux reaches it).
_DEVICE_BASE = 1 << 48
_DEVICE_SPAN = 1 << 44
#: Unused bytes left after every allocation, so that a copy one byte past the end hits no other allocation.
_GUARD = 4096


class cudaError_t(enum.IntEnum):  # noqa: N801 - cuda-python's name
    """The codes this emulation returns (values as in driver_types.h)."""

    cudaSuccess = 0
    cudaErrorInvalidValue = 1
    cudaErrorMemoryAllocation = 2
    cudaErrorInvalidDevicePointer = 17
    cudaErrorInvalidMemcpyDirection = 21
    cudaErrorInvalidDevice = 101
    cudaErrorInvalidResourceHandle = 400
    cudaErrorIllegalAddress = 700


class cudaMemcpyKind(enum.IntEnum):  # noqa: N801
    cudaMemcpyHostToHost = 0
    cudaMemcpyHostToDevice = 1
    cudaMemcpyDeviceToHost = 2
    cudaMemcpyDeviceToDevice = 3
    cudaMemcpyDefault = 4


class EmulatedCudaError(RuntimeError):
    """Raised by the emulator-only helpers (the cuda-python API returns codes instead)."""

    def __init__(self, code: cudaError_t, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code = code


class cudaStream_t:  # noqa: N801
    """A stream handle; ``getPtr()`` / ``int()`` give its address as cuda-python's object does."""

    def __init__(self, ptr: int = 0):
        self._ptr = int(ptr)

    def getPtr(self) -> int:  # noqa: N802
        return self._ptr

    def __int__(self) -> int:
        return self._ptr

    def __repr__(self) -> str:
        return f"<cudaStream_t 0x{self._ptr:x}>"


@dataclass
class cudaDeviceProp:  # noqa: N801
    name: bytes
    major: int
    minor: int
    totalGlobalMem: int  # noqa: N815
    multiProcessorCount: int = 132  # noqa: N815


@dataclass
class _Alloc:
    base: int
    size: int
    device: int
    buf: np.ndarray  # uint8 [size]


_lock = threading.RLock()
_thread = threading.local()
_allocs: dict[int, _Alloc] = {}
_bases: list[int] = []  # sorted live bases
_freed: dict[int, int] = {}  # base -> size of freed allocations (for the error message)
_next = [_DEVICE_BASE + d * _DEVICE_SPAN for d in range(DEVICE_COUNT)]
_streams: dict[int, int] = {}  # stream handle -> device
_next_stream = [0x5000]
_pinned: dict[int, ctypes.Array] = {}
_last_error = [""]


def _fail(code: cudaError_t, message: str) -> tuple:
    _last_error[0] = f"{code.name}: {message}"
    return (code,)


def _ok(*value) -> tuple:
    return (cudaError_t.cudaSuccess, *value)


def _current() -> int | None:
    """The calling thread's device, or None when this thread never called cudaSetDevice.

    The CUDA runtime keeps the current device per host thread (CUDA Runtime API, cudaSetDevice: "Sets device
    as the current device for the calling host thread"); a thread that never sets one would silently use
    device 0. The emulation is stricter: a device call from such a thread is an error, so that a thread
    the backend starts (the batch server's) must set its device.
    """
    return getattr(_thread, "device", None)


def _need_device(what: str) -> int:
    dev = _current()
    if dev is None:
        raise EmulatedCudaError(cudaError_t.cudaErrorInvalidDevice,
                                f"{what} from thread {threading.current_thread().name!r}, which never called "
                                "cudaSetDevice (the current device is per host thread: CUDA Runtime API, cudaSetDevice)")
    return dev


def emulator_last_error() -> str:
    """The reason for the last error code this emulation returned (emulator only)."""
    return _last_error[0]


def emulator_live_device_bytes(device: int | None = None) -> int:
    """Bytes of emulated device memory allocated and not freed (on ``device``, or on all)."""
    with _lock:
        return sum(a.size for a in _allocs.values() if device is None or a.device == device)


def emulator_live_host_bytes() -> int:
    """Bytes of pinned host memory (cudaMallocHost / cudaHostAlloc) not freed."""
    with _lock:
        return sum(ctypes.sizeof(b) for b in _pinned.values())


def _find(ptr: int, nbytes: int) -> tuple[_Alloc, int]:
    """The live allocation holding [ptr, ptr + nbytes) and the offset of ptr in it.

    A device address that lies in no live allocation, or a range that runs past its allocation's end, is an
    error (cudaMemcpy: "dst/src: destination/source memory address"; an address outside any allocation is
    undefined behaviour in CUDA, usually cudaErrorIllegalAddress; the emulation always reports it).
    """
    with _lock:
        i = bisect.bisect_right(_bases, ptr) - 1
        if i >= 0:
            a = _allocs[_bases[i]]
            if ptr < a.base + a.size:
                if ptr + nbytes > a.base + a.size:
                    raise EmulatedCudaError(cudaError_t.cudaErrorInvalidValue,
                                            f"{nbytes} bytes at 0x{ptr:x} run {ptr + nbytes - a.base - a.size} bytes "
                                            f"past the end of the {a.size}-byte allocation at 0x{a.base:x}")
                return a, ptr - a.base
        for base, size in _freed.items():
            if base <= ptr < base + size:
                raise EmulatedCudaError(cudaError_t.cudaErrorIllegalAddress,
                                        f"0x{ptr:x} lies in the freed {size}-byte allocation at 0x{base:x}")
        raise EmulatedCudaError(cudaError_t.cudaErrorIllegalAddress, f"0x{ptr:x} is not in any device allocation")


def _is_device(ptr: int) -> bool:
    return int(ptr) >= _DEVICE_BASE


def emulator_device_view(ptr: int, nbytes: int, device: int) -> np.ndarray:
    """A writable uint8 view of [ptr, ptr + nbytes) of ``device``'s memory (emulator only; for the TensorRT emulation).

    Raises:
        EmulatedCudaError: the range is not inside one live allocation of ``device``.
    """
    a, off = _find(int(ptr), int(nbytes))
    if a.device != device:
        raise EmulatedCudaError(cudaError_t.cudaErrorInvalidDevicePointer,
                                f"0x{ptr:x} is memory of device {a.device}, used on device {device}")
    return a.buf[off:off + int(nbytes)]


def _stream_device(stream) -> int:
    handle = int(stream.getPtr() if isinstance(stream, cudaStream_t) else stream or 0)
    dev = _need_device("a stream operation")
    if handle == 0:  # the legacy default stream of the current device
        return dev
    with _lock:
        if handle not in _streams:
            raise EmulatedCudaError(cudaError_t.cudaErrorInvalidResourceHandle,
                                    f"stream 0x{handle:x} does not exist (never created, or destroyed)")
        sdev = _streams[handle]
    # CUDA C++ Programming Guide, "Stream and Event Behavior": "A kernel launch will fail if it is issued to a
    # stream that is not associated to the current device".
    if sdev != dev:
        raise EmulatedCudaError(cudaError_t.cudaErrorInvalidResourceHandle,
                                f"stream 0x{handle:x} belongs to device {sdev}; this thread's current device is {dev}")
    return dev


def emulator_check_stream(stream) -> int:
    """The device of ``stream`` (an int handle or :class:`cudaStream_t`), checked against the calling thread's
    current device (emulator only). Raises :class:`EmulatedCudaError`."""
    return _stream_device(stream)


def _guarded(fn):
    """Turn the emulator's exceptions into cuda-python's error tuples."""
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except EmulatedCudaError as e:
            return _fail(e.code, str(e))
    call.__name__ = fn.__name__
    call.__doc__ = fn.__doc__
    return call


# ---------------------------------------------------------------- devices


def cudaGetDeviceCount():  # noqa: N802
    return _ok(DEVICE_COUNT)


def cudaSetDevice(device: int):  # noqa: N802
    """cudaSetDevice: "Sets device as the current device for the calling host thread"; an ordinal outside
    [0, count) is cudaErrorInvalidDevice."""
    if not 0 <= int(device) < DEVICE_COUNT:
        return _fail(cudaError_t.cudaErrorInvalidDevice, f"device {device}; this machine has {DEVICE_COUNT}")
    _thread.device = int(device)
    return _ok()


@_guarded
def cudaGetDevice():  # noqa: N802
    return _ok(_need_device("cudaGetDevice"))


def cudaGetDeviceProperties(device: int):  # noqa: N802
    if not 0 <= int(device) < DEVICE_COUNT:
        return _fail(cudaError_t.cudaErrorInvalidDevice, f"device {device}; this machine has {DEVICE_COUNT}")
    # Every emulated device is the same model (as the GPUs of one machine usually are): one name for all.
    return _ok(cudaDeviceProp(name=NAME.encode(), major=CC[0], minor=CC[1],
                              totalGlobalMem=DEVICE_BYTES))


def cudaGetErrorString(err):  # noqa: N802
    return _ok(cudaError_t(int(err)).name.encode())


def cudaGetErrorName(err):  # noqa: N802
    return _ok(cudaError_t(int(err)).name.encode())


@_guarded
def cudaMemGetInfo():  # noqa: N802
    dev = _need_device("cudaMemGetInfo")
    return _ok(DEVICE_BYTES - emulator_live_device_bytes(dev), DEVICE_BYTES)


@_guarded
def cudaDeviceSynchronize():  # noqa: N802
    _need_device("cudaDeviceSynchronize")
    return _ok()


# ---------------------------------------------------------------- memory


@_guarded
def cudaMalloc(size: int):  # noqa: N802
    """cudaMalloc: "Allocates size bytes of linear memory on the device" (the calling thread's current device).

    A size of 0 gives success and a null pointer here (the emulation does not model the releases that differ).
    """
    dev = _need_device("cudaMalloc")
    size = int(size)
    if size < 0:
        return _fail(cudaError_t.cudaErrorInvalidValue, f"cudaMalloc({size})")
    if size == 0:
        return _ok(0)
    with _lock:
        if emulator_live_device_bytes(dev) + size > DEVICE_BYTES:
            return _fail(cudaError_t.cudaErrorMemoryAllocation, f"{size} bytes: device {dev} has "
                         f"{DEVICE_BYTES - emulator_live_device_bytes(dev)} free")
        base = _next[dev]
        _next[dev] = base + -(-(size + _GUARD) // _ALIGN) * _ALIGN
        # Fresh device memory is not zeroed (cudaMalloc: "The memory is not cleared"): poison it (0xFF bytes are
        # NaN as float, -1 as int) so that a read of memory nothing wrote shows.
        _allocs[base] = _Alloc(base, size, dev, np.full(size, 0xFF, np.uint8))
        bisect.insort(_bases, base)
        _freed.pop(base, None)
    return _ok(base)


@_guarded
def cudaFree(ptr: int):  # noqa: N802
    """cudaFree: "Frees the memory space pointed to by devPtr, which must have been returned by a previous call to
    cudaMalloc() ... Otherwise, or if cudaFree(devPtr) has already been called before, an error is returned. If
    devPtr is 0, no operation is performed." A pointer inside (not at the start of) an allocation is an error."""
    ptr = int(ptr)
    if ptr == 0:
        return _ok()
    _need_device("cudaFree")
    with _lock:
        if ptr not in _allocs:
            if ptr in _freed:
                return _fail(cudaError_t.cudaErrorInvalidValue, f"0x{ptr:x} was already freed")
            return _fail(cudaError_t.cudaErrorInvalidValue, f"0x{ptr:x} was not returned by cudaMalloc")
        a = _allocs.pop(ptr)
        _bases.remove(ptr)
        _freed[ptr] = a.size
    return _ok()


def cudaMallocHost(size: int):  # noqa: N802
    """cudaMallocHost: page-locked host memory ("Allocates size bytes of host memory that is page-locked and
    accessible to the device"); here an ordinary host buffer whose address stays valid until cudaFreeHost."""
    size = int(size)
    if size < 0:
        return _fail(cudaError_t.cudaErrorInvalidValue, f"cudaMallocHost({size})")
    buf = (ctypes.c_uint8 * max(size, 1))()
    ptr = ctypes.addressof(buf)
    with _lock:
        _pinned[ptr] = buf
    return _ok(ptr)


def cudaHostAlloc(size: int, flags: int = 0):  # noqa: N802
    return cudaMallocHost(size)


def cudaFreeHost(ptr: int):  # noqa: N802
    """cudaFreeHost: frees memory from cudaMallocHost/cudaHostAlloc; any other pointer is an error."""
    with _lock:
        if int(ptr) not in _pinned:
            return _fail(cudaError_t.cudaErrorInvalidValue, f"0x{int(ptr):x} is not pinned host memory")
        del _pinned[int(ptr)]
    return _ok()


def _span(ptr: int, nbytes: int, on_device: bool, what: str):
    """Address of [ptr, ptr + nbytes) in this process: a device range is checked against its allocation and the
    current device; a host range is taken as the caller's (cudaMemcpy: the caller guarantees host memory)."""
    if _is_device(ptr) != on_device:
        # cudaMemcpy: "Calling cudaMemcpy() with dst and src pointers that do not match the direction of the copy
        # results in an undefined behavior." The emulation reports it.
        raise EmulatedCudaError(cudaError_t.cudaErrorInvalidMemcpyDirection,
                                f"{what} 0x{ptr:x} is {'device' if _is_device(ptr) else 'host'} memory, the copy "
                                f"kind says {'device' if on_device else 'host'}")
    if not on_device:
        return int(ptr)
    view = emulator_device_view(ptr, nbytes, _need_device("a copy"))
    return view.ctypes.data


def _sides(kind) -> tuple[bool, bool]:
    kind = cudaMemcpyKind(int(kind))
    if kind == cudaMemcpyKind.cudaMemcpyDefault:
        raise EmulatedCudaError(cudaError_t.cudaErrorInvalidMemcpyDirection,
                                "the emulation takes explicit copy kinds (this project passes them)")
    return {cudaMemcpyKind.cudaMemcpyHostToHost: (False, False), cudaMemcpyKind.cudaMemcpyHostToDevice: (True, False),
            cudaMemcpyKind.cudaMemcpyDeviceToHost: (False, True),
            cudaMemcpyKind.cudaMemcpyDeviceToDevice: (True, True)}[kind]


def _copy(dst: int, src: int, count: int, kind) -> None:
    count = int(count)
    if count < 0:
        raise EmulatedCudaError(cudaError_t.cudaErrorInvalidValue, f"count {count}")
    if count == 0:
        return
    dst_dev, src_dev = _sides(kind)
    d = _span(int(dst), count, dst_dev, "dst")
    s = _span(int(src), count, src_dev, "src")
    ctypes.memmove(d, s, count)


@_guarded
def cudaMemcpy(dst, src, count, kind):  # noqa: N802
    """cudaMemcpy: "Copies count bytes from the memory area pointed to by src to the memory area pointed to by dst"."""
    _copy(dst, src, count, kind)
    return _ok()


@_guarded
def cudaMemcpyAsync(dst, src, count, kind, stream=0):  # noqa: N802
    """cudaMemcpyAsync: as cudaMemcpy, queued on ``stream`` (done at once here: streams are in order)."""
    _stream_device(stream)
    _copy(dst, src, count, kind)
    return _ok()


def _copy_2d(dst, dpitch, src, spitch, width, height, kind) -> None:
    dpitch, spitch, width, height = int(dpitch), int(spitch), int(width), int(height)
    # cudaMemcpy2D: "dpitch and spitch ... width must not exceed either dpitch or spitch" (else
    # cudaErrorInvalidPitchValue; reported here as an invalid value).
    if width > dpitch or width > spitch or min(width, height) < 0:
        raise EmulatedCudaError(cudaError_t.cudaErrorInvalidValue,
                                f"width {width} exceeds a pitch (dpitch {dpitch}, spitch {spitch}) or is negative")
    for row in range(height):
        _copy(int(dst) + row * dpitch, int(src) + row * spitch, width, kind)


@_guarded
def cudaMemcpy2D(dst, dpitch, src, spitch, width, height, kind):  # noqa: N802
    """cudaMemcpy2D: copies ``height`` rows of ``width`` bytes, rows ``dpitch`` / ``spitch`` bytes apart."""
    _copy_2d(dst, dpitch, src, spitch, width, height, kind)
    return _ok()


@_guarded
def cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, kind, stream=0):  # noqa: N802
    _stream_device(stream)
    _copy_2d(dst, dpitch, src, spitch, width, height, kind)
    return _ok()


@_guarded
def cudaMemset(ptr, value, count):  # noqa: N802
    """cudaMemset: "Fills the first count bytes of the memory area pointed to by devPtr with the constant byte
    value value" (device memory only: a host pointer or a span past the allocation is an error)."""
    emulator_device_view(int(ptr), int(count), _need_device("cudaMemset"))[:] = int(value) & 0xFF
    return _ok()


@_guarded
def cudaMemsetAsync(ptr, value, count, stream=0):  # noqa: N802
    """cudaMemsetAsync: as cudaMemset, queued on ``stream`` (done at once here: streams are in order); the
    stream must belong to the current device, as for the copies."""
    _stream_device(stream)
    emulator_device_view(int(ptr), int(count), _need_device("cudaMemsetAsync"))[:] = int(value) & 0xFF
    return _ok()


# ---------------------------------------------------------------- streams


@_guarded
def cudaStreamCreate():  # noqa: N802
    """cudaStreamCreate: "Creates a new asynchronous stream" on the current device."""
    dev = _need_device("cudaStreamCreate")
    with _lock:
        handle = _next_stream[0] = _next_stream[0] + 0x100
        _streams[handle] = dev
    return _ok(cudaStream_t(handle))


def cudaStreamCreateWithFlags(flags: int = 0):  # noqa: N802
    return cudaStreamCreate()


@_guarded
def cudaStreamDestroy(stream):  # noqa: N802
    _stream_device(stream)
    with _lock:
        _streams.pop(int(stream), None)
    return _ok()


@_guarded
def cudaStreamSynchronize(stream):  # noqa: N802
    _stream_device(stream)
    return _ok()
