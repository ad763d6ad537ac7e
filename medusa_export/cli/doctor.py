"""``medusa-export doctor``: which backends, precisions and devices this machine offers.

Imports every optional piece in a guarded way and reports what it found, never failing:
ONNX Runtime (version, execution providers, CUDA through them), TensorRT's Python
package, Polygraphy, cuda-python (CUDA devices), ``trtexec`` and ``nvidia-smi`` on PATH; and the
runtime's backends from their table (:data:`medusa_runtime.engines.BACKENDS`: library version here,
batched step graphs, GPU, fixed tree, and whether it can run here: a GPU backend needs CUDA, which the
report has just looked for). The EMULATED TensorRT and CUDA runtime of ``tests/emulated`` (a test double)
are named as such: "tensorrt (emulated)", never "tensorrt".
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass, field

from medusa_runtime.engines import BACKENDS, BackendSpec

from ..export.precisions import precisions
from ..trt.config import buildable_precisions
from ..trt.emulation import EMULATED_TENSORRT, module_is_emulated


@dataclass
class Check:
    """One line of the report: ``name``, whether it is ``ok``, and ``detail``."""

    name: str
    ok: bool
    detail: str


@dataclass
class DoctorReport:
    checks: list[Check] = field(default_factory=list)
    backends: dict[str, list[str]] = field(default_factory=dict)  # backend -> usable precisions
    devices: list[str] = field(default_factory=list)
    runtime: dict[str, dict] = field(default_factory=dict)  # medusa_runtime backend -> _runtime_backend(spec)

    def to_json(self) -> dict:
        return {"checks": [c.__dict__ for c in self.checks], "backends": self.backends, "devices": self.devices,
                "runtime": self.runtime}

    def render(self) -> str:
        w = max(len(c.name) for c in self.checks)
        lines = [f"{'ok' if c.ok else '--':2s}  {c.name:{w}s}  {c.detail}" for c in self.checks]
        lines.append("")
        lines.append("devices:    " + (", ".join(self.devices) or "CPU only"))
        for b, precs in self.backends.items():
            lines.append(f"{b + ':':11s} " + (", ".join(precs) if precs else "unavailable"))
        lines.append("runtime:    " + ", ".join(f"{r['label']} ({_facts(r)})" for r in self.runtime.values()
                                                if r["here"] == "available"))
        lines.extend(f"{'':11s} {r['label']}: {r['here']}" for r in self.runtime.values() if r["here"] != "available")
        return "\n".join(lines)


def _runtime_backend(spec: BackendSpec, *, ort_cuda: bool = False, cuda_devices: int = 0) -> dict:
    """A runtime backend's entry in the report: its library, that library's version here (None: not
    importable), the facts of its :class:`~medusa_runtime.engines.BackendSpec`, the name the report gives it
    (``label``: "tensorrt (emulated)" on the test double) and ``here``: "available", or "unavailable here"
    and why (its library does not import; a GPU backend without CUDA: ONNX Runtime without its CUDA provider
    (``ort_cuda``), another library with no CUDA device found by cuda-python (``cuda_devices``))."""
    version = spec.version()
    emulated = spec.library == "tensorrt" and version is not None and module_is_emulated("tensorrt")
    if version is None:
        here = f"unavailable here ({spec.library} not importable)"
    elif spec.gpu and spec.library == "onnxruntime" and not ort_cuda:
        here = "unavailable here (no CUDA: this onnxruntime has no CUDA execution provider)"
    elif spec.gpu and spec.library != "onnxruntime" and not cuda_devices:
        here = "unavailable here (no CUDA device)"
    else:
        here = "available"
    return {"library": spec.library, "version": version, "batched": spec.batched, "gpu": spec.gpu,
            "fixed_tree": spec.fixed_tree, "label": EMULATED_TENSORRT if emulated else spec.name, "here": here}


def _facts(r: dict) -> str:
    """``"onnxruntime 1.20.1, batched"``: a runtime backend's line from :func:`_runtime_backend`."""
    names = {"batched": "batched", "gpu": "GPU", "fixed_tree": "fixed tree"}
    found = f"{r['library']} {r['version']}" if r["version"] else f"{r['library']} not importable"
    if r["label"] == EMULATED_TENSORRT:
        found += " EMULATED"
    return ", ".join([found] + [text for key, text in names.items() if r[key]])


def _version(module: str) -> tuple[bool, str]:
    try:
        mod = __import__(module, fromlist=["__version__"])
    except Exception as exc:  # noqa: BLE001 - a broken install raises OSError etc.
        return False, f"not importable ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    return True, getattr(mod, "__version__", "installed")


def _cuda_devices() -> tuple[bool, str, list[str]]:
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        try:
            from cuda import cudart
        except ImportError:
            return False, "cuda-python not installed (pip install cuda-python)", []
    err, count = cudart.cudaGetDeviceCount()
    if int(err) != 0:
        return False, f"cuda-python installed; no CUDA device ({getattr(err, 'name', err)})", []
    names = []
    for i in range(count):
        e, props = cudart.cudaGetDeviceProperties(i)
        name = props.name if int(e) == 0 else b"?"
        names.append((name.decode(errors="replace") if isinstance(name, bytes) else str(name)).rstrip("\x00"))
    return True, f"{count} CUDA device(s)", names


def _nvidia_smi() -> tuple[bool, str]:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return False, "not on PATH"
    try:
        out = subprocess.run([exe, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"failed: {exc}"
    return out.returncode == 0, (out.stdout.strip().replace("\n", "; ") or out.stderr.strip()[:200])


def run_doctor() -> DoctorReport:
    """Collect the report (a few seconds at most; nothing is built or run on a device)."""
    r = DoctorReport()
    ok, ver = _version("onnxruntime")
    providers: list[str] = []
    if ok:
        import onnxruntime

        providers = onnxruntime.get_available_providers()
        ver = f"{ver}; providers: {', '.join(providers)}"
    r.checks.append(Check("onnxruntime", ok, ver))
    ort_cuda = any(p in providers for p in ("CUDAExecutionProvider", "TensorrtExecutionProvider"))
    r.checks.append(Check("CUDA via onnxruntime", ort_cuda,
                          "CUDA/TensorRT execution provider present" if ort_cuda
                          else "CPU build of onnxruntime (onnxruntime-gpu brings the CUDA provider)"))
    trt_ok, trt_ver = _version("tensorrt")
    trt_emulated = trt_ok and module_is_emulated("tensorrt")
    if trt_emulated:
        trt_ver += " EMULATED (tests/emulated: a test double on host memory, not TensorRT; its timings mean nothing)"
    r.checks.append(Check("tensorrt", trt_ok, trt_ver if trt_ok else
                          f"{trt_ver}; engines cannot be built here: `medusa-export engine` writes trtexec commands"))
    r.checks.append(Check("polygraphy", *_version("polygraphy")))
    cuda_ok, cuda_detail, names = _cuda_devices()
    if cuda_ok and module_is_emulated("cuda.bindings.runtime"):
        cuda_detail += " EMULATED (tests/emulated: host memory, no GPU)"
    r.checks.append(Check("cuda-python", cuda_ok, cuda_detail))
    trtexec = shutil.which("trtexec")
    r.checks.append(Check("trtexec", bool(trtexec), trtexec or "not on PATH"))
    r.checks.append(Check("nvidia-smi", *_nvidia_smi()))
    r.devices = ["CPU"] + [f"cuda:{i} {n}" for i, n in enumerate(names)]
    if ok:
        r.backends["onnxruntime " + ("(CUDA)" if ort_cuda else "(CPU)")] = list(precisions())
    trt_name = EMULATED_TENSORRT if trt_emulated else "tensorrt"
    r.backends[trt_name] = buildable_precisions() if trt_ok and cuda_ok else []
    r.backends["pytorch"] = ["fp32 (reference)"] if _version("torch")[0] else []
    r.runtime = {name: _runtime_backend(spec, ort_cuda=ort_cuda, cuda_devices=len(names))
                 for name, spec in BACKENDS.items()}
    return r


def cmd_doctor(args) -> int:
    """Report backends, precisions and devices."""
    report = run_doctor()
    print(json.dumps(report.to_json(), indent=2) if args.json else report.render())
    return 0


def add_doctor_command(sub) -> None:
    """Add ``doctor`` to the CLI's sub-commands."""
    p = sub.add_parser("doctor", help="report available backends, precisions and devices",
                       description="Which backends (onnxruntime and its providers, TensorRT, Polygraphy), precisions "
                                   "and devices (CUDA via cuda-python or onnxruntime, nvidia-smi) this machine has.")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_doctor)
