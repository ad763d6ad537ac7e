"""Engine backends by name: one table of :class:`BackendSpec` (:data:`BACKENDS`), one small interface
(:class:`medusa_runtime.engines.base.Engine`, whose :class:`~medusa_runtime.engines.base.Capabilities`
say what one engine runs).

========================  ==========================================================  =========
name                      what                                                        status
========================  ==========================================================  =========
``onnxruntime``           ONNX Runtime, CPU provider (:class:`~.ort.OrtEngine`;       tested
                          batched artifacts: :class:`~.ort_batched.OrtBatchEngine`)
``onnxruntime-cuda``      ONNX Runtime, CUDA provider, I/O binding, KV on the device  unexecuted here
                          (:class:`~.ort_cuda.OrtCudaEngine`)
``tensorrt``              TensorRT plans of the artifact (:class:`~.trt.TrtEngine`,   emulated here
                          ``TrtEngine(artifact, **options)``; batched artifacts:
                          :class:`~.trt_batched.TrtBatchEngine`)
========================  ==========================================================  =========

A factory takes the loaded :class:`~medusa_runtime.contract.artifact.Artifact` and keyword options (``threads``,
``spin``, ``device_id``; each factory ignores what it does not use) and returns an engine. The facts of a
backend (batched step graphs, GPU, fixed tree, library version, what its Python needs) are its entry's,
read by :func:`create_engine`, the session, the CLIs (``--backend`` choices), the Triton repository, doctor
and the tree cache. A new backend is its engine module here plus one entry (:func:`register_backend`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from ..contract.artifact import Artifact, step_batch
from ..errors import BackendUnavailableError, MedusaError

DEFAULT_BACKEND = "onnxruntime"


@dataclass(frozen=True)
class BackendSpec:
    """One engine backend: how to make its engine and the facts of the backend itself (those of one
    engine are its :class:`~medusa_runtime.engines.base.Capabilities`).

    Attributes:
        name: the ``--backend`` name.
        factory: ``factory(artifact, **options) -> Engine`` (options ``threads``, ``spin``, ``device_id``;
            it ignores those it does not use); raises ``BackendUnavailableError`` when the backend
            cannot run here.
        library: the Python package it runs on: its ``__version__`` is :meth:`version`.
        needs: what a Python environment needs to run it (the Triton repository's README says it).
        batched: it runs batched step graphs (artifacts built with ``--batch-size`` N > 1);
            :func:`create_engine` refuses those on the others.
        gpu: it runs on a CUDA device (option ``device_id``; Triton gives it KIND_GPU instances).
        fixed_tree: the engine is built for the artifact's tree (TensorRT plans' tree-step profile): the
            session runs that tree by default, without timing other sizes; an explicit tree still runs.
    """

    name: str
    factory: Callable
    library: str
    needs: str
    batched: bool = False
    gpu: bool = False
    fixed_tree: bool = False

    def version(self) -> str | None:
        """The library's ``__version__`` here, None when it cannot be imported (part of the tree cache's
        backend fingerprint, :func:`medusa_runtime.tuning.treecache.backend_fingerprint`, and of doctor's report)."""
        try:
            return str(importlib.import_module(self.library).__version__)
        except (ImportError, OSError, AttributeError):  # not installed, a broken install, no version said
            return None


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
    if step_batch(artifact.manifest):
        from .trt_batched import TrtBatchEngine

        return TrtBatchEngine(artifact, **options)
    return module.TrtEngine(artifact, **options)


#: The backends by name (the ``--backend`` choices, in this order).
BACKENDS: dict[str, BackendSpec] = {spec.name: spec for spec in (
    BackendSpec("onnxruntime", _onnxruntime, library="onnxruntime",
                needs="numpy, onnxruntime, tokenizers and jinja2", batched=True),
    BackendSpec("onnxruntime-cuda", _onnxruntime_cuda, library="onnxruntime",
                needs="numpy, onnxruntime-gpu (CUDA provider), tokenizers and jinja2", gpu=True),
    BackendSpec("tensorrt", _tensorrt, library="tensorrt",
                needs=("numpy, tokenizers, jinja2, TensorRT 10.x's Python package `tensorrt` (from NVIDIA, matching "
                       "the version the plans were built with) and `cuda-python` (device memory and streams)"),
                batched=True, gpu=True, fixed_tree=True),
)}


def register_backend(spec: BackendSpec) -> None:
    """Add (or replace) a backend: its entry in :data:`BACKENDS`."""
    BACKENDS[spec.name] = spec


def backend_spec(name: str) -> BackendSpec:
    """The entry of backend ``name``.

    Raises:
        MedusaError: unknown backend name (the message lists the known ones).
    """
    if name not in BACKENDS:
        raise MedusaError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return BACKENDS[name]


def batched_backends() -> list[str]:
    """The names of the backends that run batched step graphs (:attr:`BackendSpec.batched`)."""
    return [name for name, spec in BACKENDS.items() if spec.batched]


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
    spec = backend_spec(backend)
    if not spec.batched and step_batch(artifact.manifest):
        raise BackendUnavailableError(f"the {backend} backend runs batch-1 step graphs only and this artifact's is "
                                      f"batched (built with --batch-size {step_batch(artifact.manifest)}): use "
                                      f"--backend {' or '.join(batched_backends())}, or build with --batch-size 1")
    return spec.factory(artifact, **options)
