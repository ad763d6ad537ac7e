"""Run the ``tritonserver`` bundled in the PyPI package ``nvidia-pytriton`` on a model repository,
on 127.0.0.1 with free ports (tests, benchmarks, trying a repository out).

Facts about that binary (Triton 2.51, nvidia-pytriton 0.7.0, measured here):

* it ships the Python backend only (``backends/python/libtriton_python.so``) and one backend
  stub per Python version (``python_backend_stubs/X.Y/``); the stub of the running Python is
  copied next to the backend library, into a backend folder of our own;
* the stub links libpython, so ``LD_LIBRARY_PATH`` holds this Python's own lib directory
  (``sysconfig`` LIBDIR) and the package's ``nvidia_pytriton.libs``;
* the stub embeds an *isolated* interpreter (``PYTHONPATH`` is ignored) whose first
  ``sys.path`` entry is its working directory, and it needs numpy < 2: with numpy 2 the
  tensors it returns arrive empty and it hangs at shutdown. Where this Python has numpy 2,
  the server therefore runs in a folder that holds numpy < 2 (:func:`stub_site`), which the
  stub imports first; nothing else of the environment changes. (``pip install
  nvidia-pytriton`` with its dependencies would downgrade numpy for everything, so it is
  installed with ``--no-deps``; it needs none of them to run the server.);
* SIGTERM (or SIGINT) stops it cleanly: models are unloaded and the stubs end within
  ``--exit-timeout-secs``. It runs in a session (process group) of its own, so that
  :meth:`LocalTritonServer.stop` can check that nothing of it is left.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ..errors import MedusaError

#: Where :func:`stub_site` keeps numpy < 2 for the stub (overridden by $MEDUSA_TRITON_STUB_SITE).
STUB_SITE_ENV = "MEDUSA_TRITON_STUB_SITE"
PYTHON_VERSION = f"{sys.version_info.major}.{sys.version_info.minor}"


class TritonUnavailableError(MedusaError):
    """The bundled tritonserver cannot be found or started here; the message says what is missing."""


@dataclass(frozen=True)
class BundledTriton:
    """Paths inside the installed nvidia-pytriton package."""

    binary: Path
    python_backend: Path  # folder of libtriton_python.so and triton_python_backend_utils.py
    stub: Path  # triton_python_backend_stub for this Python version
    libs: Path  # the wheel's bundled shared libraries


def find_bundled() -> BundledTriton:
    """Locate the server, the Python backend and the stub for this Python.

    Raises:
        TritonUnavailableError: nvidia-pytriton is not installed, or has no stub for this Python.
    """
    import importlib.util

    spec = importlib.util.find_spec("pytriton")
    if spec is None or spec.origin is None:
        raise TritonUnavailableError("the tritonserver binary comes with the PyPI package nvidia-pytriton: "
                                     "pip install --no-deps nvidia-pytriton")
    root = Path(spec.origin).parent
    server = root / "tritonserver"
    found = BundledTriton(server / "bin" / "tritonserver", server / "backends" / "python",
                          server / "python_backend_stubs" / PYTHON_VERSION / "triton_python_backend_stub",
                          root.parent / "nvidia_pytriton.libs")
    for what, path in (("server", found.binary), ("Python backend", found.python_backend / "libtriton_python.so"),
                       (f"Python {PYTHON_VERSION} backend stub", found.stub)):
        if not path.is_file():
            raise TritonUnavailableError(f"nvidia-pytriton at {root} has no {what} ({path} is missing)")
    return found


def stub_site() -> Path | None:
    """A folder holding numpy < 2 for the backend stub, or None when this Python's numpy is already < 2.

    The folder is $MEDUSA_TRITON_STUB_SITE, else ~/.cache/medusa-export/triton-stub-site-PY; it
    is filled once with ``pip install --target`` (.ci/run does it ahead of the tests).

    Raises:
        TritonUnavailableError: numpy < 2 could not be installed there.
    """
    import numpy

    if int(numpy.__version__.split(".")[0]) < 2:
        return None
    site = Path(os.environ.get(STUB_SITE_ENV) or
                Path.home() / ".cache" / "medusa-export" / f"triton-stub-site-{PYTHON_VERSION}")
    if not (site / "numpy" / "__init__.py").is_file():
        done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                               "--target", str(site), "numpy<2"], capture_output=True, text=True)
        if done.returncode != 0:
            raise TritonUnavailableError(f"the Triton Python backend stub needs numpy < 2 and installing it into "
                                         f"{site} failed:\n{done.stderr[-2000:]}")
    return site


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group_processes(pgid: int) -> list[str]:
    """Live (non-zombie) processes of process group ``pgid``, as "PID COMMAND" (from /proc)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(f"{d.name} {stat[stat.find('(') + 1:stat.rfind(')')]}")
    return out


class LocalTritonServer:
    """The bundled tritonserver on ``repository``, listening on 127.0.0.1 only.

    Args:
        repository: the model repository.
        workdir: a folder for the backend copy and the log.
        models: load only these models (explicit model control), or all when None.
        exit_timeout: seconds the server gives models to unload on SIGTERM.

    Use as a context manager (started on entry, stopped on exit), or call
    :meth:`start` and :meth:`stop`.
    """

    def __init__(self, repository: str | Path, workdir: str | Path, models: list[str] | None = None,
                 exit_timeout: int = 15):
        self.repository = Path(repository).absolute()
        self.workdir = Path(workdir).absolute()
        self.models = models
        self.exit_timeout = exit_timeout
        self.log_path = self.workdir / "tritonserver.log"
        self.http_port = self.grpc_port = 0
        self.proc: subprocess.Popen | None = None

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def _backends(self, b: BundledTriton) -> Path:
        backends = self.workdir / "backends"
        python = backends / "python"
        shutil.rmtree(backends, ignore_errors=True)
        shutil.copytree(b.python_backend, python, ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy2(b.stub, python / "triton_python_backend_stub")
        return backends

    def start(self, timeout: float = 180.0) -> "LocalTritonServer":
        """Start the server and wait until it (and every model) is ready.

        Raises:
            TritonUnavailableError: no bundled server, or it exited or was not ready within
                ``timeout`` seconds (the message ends with its log).
        """
        bundled = find_bundled()
        self.workdir.mkdir(parents=True, exist_ok=True)
        backends = self._backends(bundled)
        self.http_port, self.grpc_port = free_port(), free_port()
        while self.grpc_port == self.http_port:
            self.grpc_port = free_port()
        cmd = [str(bundled.binary), f"--model-repository={self.repository}", f"--backend-directory={backends}",
               "--http-address=127.0.0.1", f"--http-port={self.http_port}",
               "--grpc-address=127.0.0.1", f"--grpc-port={self.grpc_port}",
               "--allow-metrics=false", "--allow-gpu-metrics=false", f"--exit-timeout-secs={self.exit_timeout}",
               "--strict-readiness=true"]
        if self.models is not None:
            cmd.append("--model-control-mode=explicit")
            cmd += [f"--load-model={m}" for m in self.models]
        env = dict(os.environ)
        libdirs = [str(bundled.libs), sysconfig.get_config_var("LIBDIR") or ""]
        env["LD_LIBRARY_PATH"] = ":".join(p for p in libdirs + [env.get("LD_LIBRARY_PATH", "")] if p)
        cwd = stub_site() or self.workdir  # the stub's first sys.path entry (see the module docstring)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            self._wait_ready(timeout)
        except BaseException:  # never leave a server behind (a timeout, an interrupt, a bug here)
            self.stop()
            raise
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise TritonUnavailableError(f"tritonserver exited with code {self.proc.returncode} while "
                                             f"starting; its log:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise TritonUnavailableError(f"tritonserver was not ready after {timeout:.0f}s; its log:\n{self.log_tail()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float | None = None) -> int:
        """Signal the server, wait for it to exit, and return its exit code.

        Falls back to SIGKILL of its whole process group if it has not exited within
        ``timeout`` seconds (default: its exit timeout + 20 s).

        Raises:
            TritonUnavailableError: processes of the server's group are still alive afterwards.
        """
        if self.proc is None:
            return 0
        proc, self.proc = self.proc, None
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(timeout=timeout or self.exit_timeout + 20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        deadline = time.monotonic() + 10
        while (left := group_processes(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.2)
        if left:
            os.killpg(proc.pid, signal.SIGKILL)
            raise TritonUnavailableError(f"processes of tritonserver were still running after it exited: {left}")
        return proc.returncode

    def __enter__(self) -> "LocalTritonServer":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
