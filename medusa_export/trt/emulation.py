"""Whether the TensorRT this process imports is the EMULATED test double of ``tests/emulated``, and the name a
report gives a backend accordingly.

The test double (a host-memory TensorRT and CUDA runtime running the ONNX with ONNX Runtime) marks its modules
with ``EMULATED = True``. Reports (``scripts/bench.py``, ``scripts/compare_acceptance.py``, ``medusa-export
doctor``) call such a run "tensorrt (emulated)", never "tensorrt": no GPU has run the TensorRT backend here.
"""

from __future__ import annotations

import importlib

#: What a report calls the tensorrt backend when the imported ``tensorrt`` is the test double.
EMULATED_TENSORRT = "tensorrt (emulated)"


def module_is_emulated(name: str) -> bool:
    """True when the module ``name`` (e.g. ``tensorrt``, ``cuda.bindings.runtime``) imports and is the test double."""
    try:
        mod = importlib.import_module(name)
    except Exception:  # noqa: BLE001 - absent or broken: not the emulation
        return False
    return bool(getattr(mod, "EMULATED", False))


def backend_label(backend: str) -> str:
    """The name a report gives a medusa_runtime ``backend``: "tensorrt (emulated)" for the tensorrt backend on the
    test double, else ``backend`` itself."""
    return EMULATED_TENSORRT if backend == "tensorrt" and module_is_emulated("tensorrt") else backend
