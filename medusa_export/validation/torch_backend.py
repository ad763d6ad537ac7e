"""The ``torch`` engine backend: an artifact's source model run by the PyTorch reference
(:class:`~medusa_export.model.decode.TorchEngine`), on a CUDA device or on the CPU.

For machines that have PyTorch with CUDA but neither TensorRT nor onnxruntime-gpu (``scripts/bench.py
--backend torch``, ``scripts/gpu_check.sh``): the same decode loop, trees and acceptance as the deployed
backends, with the reference's kernels. It is not one of the runtime's own backends (the runtime imports
neither torch nor ``medusa_export``): :func:`register` adds :data:`TORCH_BACKEND` to
:data:`medusa_runtime.engines.BACKENDS` where it is wanted.

Weights: the artifact's source model (:func:`~.source.open_source`: its registered name, or ``model_path``),
or a :class:`~medusa_export.model.medusa.MedusaModel` given as ``model``. An fp16 artifact runs in float16 on
a CUDA device (its graphs' dtype); everything else, and every run on the CPU, in float32 (weight-only
int8 / int4 artifacts run as the fp32 reference they were quantized from).
"""

from __future__ import annotations

from medusa_runtime.contract.artifact import Artifact, step_limits
from medusa_runtime.engines import BackendSpec, register_backend
from medusa_runtime.errors import BackendUnavailableError


def torch_device(device_id: int | None) -> str:
    """The torch device of ``--device-id``: "cpu" for None, else ``cuda:N``.

    Raises:
        BackendUnavailableError: a device id given where PyTorch sees no CUDA device, or past the device count
            (the message says how many there are).
    """
    import torch

    if device_id is None:
        return "cpu"
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not 0 <= device_id < count:
        seen = f"{count} CUDA device{'s' if count != 1 else ''} (ids 0..{count - 1})" if count else "no CUDA device"
        raise BackendUnavailableError(f"--device-id {device_id}: PyTorch sees {seen}; give one of those, or leave "
                                      "--device-id out to run the torch backend on the CPU")
    return f"cuda:{device_id}"


def run_dtype(kv_dtype: str, device: str) -> str:
    """The torch dtype name the reference runs in: the artifact's graph dtype (manifest
    ``precision.kv_dtype``, "float32" or "float16") on a CUDA device, "float32" on the CPU (its fp16 kernels
    are slow and not what the artifact's CPU graphs compute)."""
    return kv_dtype if device != "cpu" else "float32"


def torch_engine(artifact: Artifact, *, device_id: int | None = None, model=None, model_path: str | None = None,
                 heads_path: str | None = None, **_):
    """A :class:`~medusa_export.model.decode.TorchEngine` for ``artifact`` (the :data:`TORCH_BACKEND` factory).

    Args:
        artifact: the loaded artifact (its manifest names the model, its step top-k and context).
        device_id: the CUDA device (None: the CPU).
        model: the reference model to run (it is moved to the device); None: built from the artifact's source
            weights (:func:`~.source.open_source` with ``model_path`` / ``heads_path``).
        model_path, heads_path: where the source weights are, as ``verify --model-path`` / ``--heads``.

    Returns:
        The engine: step top-k = the manifest's ``step_topk``, context = its ``model.max_context``, the
        in-graph sampler when the artifact's step graph has one; float16 for an fp16 artifact on CUDA.

    Raises:
        BackendUnavailableError: PyTorch cannot import, or the device id is not a CUDA device here.
        And what :func:`~.source.open_source` raises (model not found, another model's weights).
    """
    try:
        import torch
    except ImportError as exc:  # the runtime installs without torch
        raise BackendUnavailableError(f"the torch backend needs PyTorch ({exc})") from exc
    from ..model.decode import TorchEngine
    from ..model.medusa import STEP_TOPK

    device = torch_device(device_id)
    m, limits = artifact.manifest, step_limits(artifact.manifest)
    if model is None:
        from ..loading.sources import reference_model
        from .source import open_source

        model = reference_model(open_source(m, model_path, heads_path).sources, device=device)
    model = model.to(device=device, dtype=getattr(torch, run_dtype(m.precision.kv_dtype, device))).eval()
    return TorchEngine(model, limits.step_topk or STEP_TOPK, max_context=limits.max_context, sampler=limits.has_sampler,
                       device=device)


#: The backend's entry (not in :data:`medusa_runtime.engines.BACKENDS` until :func:`register`).
TORCH_BACKEND = BackendSpec("torch", torch_engine, library="torch",
                            needs="torch, medusa-export and the artifact's source weights (the PyTorch reference)")


def register() -> None:
    """Add :data:`TORCH_BACKEND` to the runtime's backends (idempotent)."""
    register_backend(TORCH_BACKEND)
