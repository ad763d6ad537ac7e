"""Engine backends by name: one registry, one small interface (:class:`medusa_runtime.engines.base.Engine`).

========================  ==========================================================  =========
name                      what                                                        status
========================  ==========================================================  =========
``onnxruntime``           ONNX Runtime, CPU provider (:class:`~.ort.OrtEngine`;       tested
                          batched artifacts: :class:`~.ort_batched.OrtBatchEngine`)
``onnxruntime-cuda``      ONNX Runtime, CUDA provider, I/O binding, KV on the device  unexecuted here
                          (:class:`~.ort_cuda.OrtCudaEngine`)
``tensorrt``              TensorRT plans of the artifact (:class:`~.trt.TrtEngine`,   hook
                          ``TrtEngine(artifact, **options)``; the TensorRT issue)
========================  ==========================================================  =========

A factory takes the loaded :class:`~medusa_runtime.artifact.Artifact` and keyword options (``threads``,
``spin``, ``device_id``; each factory ignores what it does not use) and returns an engine. Other
backends plug in with :func:`register_backend`.
"""

from __future__ import annotations

import importlib
from typing import Callable

from ..artifact import Artifact, step_batch
from ..errors import BackendUnavailableError, MedusaError

DEFAULT_BACKEND = "onnxruntime"
#: Backends that run batched step graphs (artifacts built with ``--batch-size`` N > 1).
BATCHED_BACKENDS = ("onnxruntime",)


def _onnxruntime(artifact: Artifact, *, threads: int | None = None, spin: bool = False, **_):
    if step_batch(artifact.manifest):
        from .ort_batched import OrtBatchEngine

        return OrtBatchEngine(artifact, threads=threads, spin=spin)
    from .ort import OrtEngine

    return OrtEngine(artifact, threads=threads, spin=spin)


def _onnxruntime_cuda(artifact: Artifact, *, threads: int | None = None, device_id: int = 0, **_):
    from .ort_cuda import OrtCudaEngine

    return OrtCudaEngine(artifact, device_id=device_id, threads=threads)


def _tensorrt(artifact: Artifact, **options):
    try:
        importlib.import_module("tensorrt")
    except ImportError:
        raise BackendUnavailableError("the tensorrt backend needs TensorRT's Python package (`import tensorrt` "
                                      "failed); build and run the engines on a machine with TensorRT") from None
    try:
        module = importlib.import_module(".trt", __package__)
    except ModuleNotFoundError:
        raise BackendUnavailableError("this version of medusa_runtime has no TensorRT engine "
                                      "(medusa_runtime.engines.trt is missing)") from None
    return module.TrtEngine(artifact, **options)


BACKENDS: dict[str, Callable] = {
    "onnxruntime": _onnxruntime,
    "onnxruntime-cuda": _onnxruntime_cuda,
    "tensorrt": _tensorrt,
}


def register_backend(name: str, factory: Callable) -> None:
    """Add (or replace) a backend: ``factory(artifact, **options) -> Engine``."""
    BACKENDS[name] = factory


def create_engine(artifact: Artifact, backend: str = DEFAULT_BACKEND, **options):
    """An engine for ``artifact`` on ``backend``.

    Args:
        artifact: the loaded artifact.
        backend: a name in :data:`BACKENDS`.
        **options: ``threads`` (CPU intra-op threads), ``spin`` (busy-waiting CPU threads),
            ``device_id`` (GPU).

    Raises:
        MedusaError: unknown backend name (the message lists the known ones).
        BackendUnavailableError: the backend cannot run on this machine, or cannot run the artifact's
            batched step graph (the message names the backends that can).
    """
    if backend not in BACKENDS:
        raise MedusaError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend not in BATCHED_BACKENDS and step_batch(artifact.manifest):
        raise BackendUnavailableError(f"the {backend} backend runs batch-1 step graphs only and this artifact's is "
                                      f"batched (built with --batch-size {step_batch(artifact.manifest)}): use "
                                      f"--backend {' or '.join(BATCHED_BACKENDS)}, or build with --batch-size 1")
    return BACKENDS[backend](artifact, **options)
