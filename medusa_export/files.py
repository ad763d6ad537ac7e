"""File-system helpers shared by the stages that write folders (``build``, ``triton``)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def replace_dir(tmp: Path, out: Path) -> None:
    """Move the finished folder ``tmp`` to ``out``, replacing what was there.

    The old ``out`` is first renamed aside (``.NAME.old-PID`` beside it), then ``tmp`` renamed
    into place, then the old one removed: ``out`` is never half-written, and it is missing only
    between the two renames. ``tmp`` must be on the same file system as ``out`` (a sibling).

    Args:
        tmp: the complete new folder.
        out: the destination (created or replaced).

    Raises:
        OSError: a rename failed (e.g. ``tmp`` on another file system).
    """
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def partial_dir(out: Path) -> Path:
    """The temporary sibling a stage writes ``out`` into before :func:`replace_dir`: ``.NAME.partial-PID``."""
    return out.parent / f".{out.name}.partial-{os.getpid()}"


def _pid_of(leftover: Path) -> int | None:
    """The PID in ``.NAME.partial-PID`` / ``.NAME.old-PID``, or None when the suffix is not a number."""
    suffix = leftover.name.rsplit("-", 1)[-1]
    return int(suffix) if suffix.isdigit() else None


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def remove_stale(out: Path) -> list[Path]:
    """Remove the leftovers of earlier writers of ``out`` that died (SIGKILL, a power cut): ``.NAME.partial-PID``
    and ``.NAME.old-PID`` beside it whose PID is not a running process (this process's own are kept).

    Call it while holding an :class:`OutputLock` of ``out`` (no other writer of ``out`` is then running).

    Returns:
        The folders removed.
    """
    stale = []
    for pattern in (f".{out.name}.partial-*", f".{out.name}.old-*"):
        for leftover in out.parent.glob(pattern):
            pid = _pid_of(leftover)
            if pid is not None and pid != os.getpid() and not _running(pid):
                shutil.rmtree(leftover, ignore_errors=True)
                stale.append(leftover)
    return stale


class OutputBusyError(OSError):
    """Another process holds the lock of the output folder (:func:`output_lock`)."""


class OutputLock:
    """An exclusive lock on an output folder ``out`` (one writer at a time), taken when made: ``fcntl.flock`` of
    ``.NAME.lock`` beside it, which holds the writer's PID and is removed on :meth:`release`.

    Taken without waiting. After taking it the file is checked to still be the one at the path (a writer that
    released it in between removed it), else taken again on the new file. A context manager, or
    :meth:`release` it in a ``finally``.

    Raises:
        OutputBusyError: another process holds it; the message names its PID and the lock file.
    """

    def __init__(self, out: Path):
        import fcntl

        self.path = out.parent / f".{out.name}.lock"
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise OutputBusyError(f"another process (PID {holder}) is writing {out} (it holds {self.path})") \
                    from None
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # released and removed by its holder after we opened it: take the new one
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd: int | None = fd

    def release(self) -> None:
        """Remove the lock file and release the lock (a second call does nothing)."""
        if self._fd is not None:
            os.unlink(self.path)  # while holding it: a writer that opened this file sees it is gone and retries
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "OutputLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()
