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


def _described(path: Path) -> str:
    """``name`` for a file, ``name/ (N files)`` for a folder."""
    if path.is_dir():
        n = sum(1 for p in path.rglob("*") if p.is_file())
        return f"{path.name}/ ({n} file{'' if n == 1 else 's'})"
    return path.name


def _size(nbytes: int) -> str:
    """A file size for a message: ``12 B``, ``4.1 kB``, ``547.8 MB``."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def replaced_files(out: Path) -> str:
    """What replacing the artifact folder ``out`` deletes, for the refusal and for ``--force``'s note.

    The TensorRT files under ``engines/`` (plans, typed graphs, build commands and records that ``medusa-export
    engine`` adds, and lists among the manifest's checksums) are named one by one, plans first, with their sizes:
    a build does not write them, and a plan takes minutes on a GPU to build again. Other entries that are not the
    artifact's own files (added by hand) are named too.

    Args:
        out: an artifact folder (it holds ``manifest.json``).

    Returns:
        ``"an artifact (model M, N files, S)"``, then ``" and what a build does not write: ..."`` when there is any.
    """
    import json

    from medusa_runtime.contract.artifact import MANIFEST
    from medusa_runtime.engines.trt_plan import ENGINE_DIR

    try:
        doc = json.loads((out / MANIFEST).read_text(encoding="utf-8"))
        own = {rel.split("/")[0] for rel in doc.get("checksums", {})} | {MANIFEST}
        model = doc.get("model", {}).get("name", "?")
    except (ValueError, AttributeError):
        own, model = {MANIFEST}, "?"
    own.discard(ENGINE_DIR)  # medusa-export engine's files: in the checksums, never a build's
    files = [p for p in out.rglob("*") if p.is_file()]
    engine = sorted((p for p in files if p.relative_to(out).parts[0] == ENGINE_DIR),
                    key=lambda p: (p.suffix != ".plan", str(p)))
    lost = [f"the TensorRT files of `medusa-export engine`: "
            + ", ".join(f"{p.relative_to(out).as_posix()} ({_size(p.stat().st_size)})" for p in engine)] if engine else []
    other = [_described(p) for p in sorted(out.iterdir()) if p.name not in own and p.name != ENGINE_DIR]
    lost += [f"other files: {', '.join(other)}"] if other else []
    text = f"an artifact (model {model}, {len(files)} files, {_size(sum(p.stat().st_size for p in files))})"
    return text + (f" and what a build does not write: {'; '.join(lost)}" if lost else "")


def check_replaceable(out: Path, *, force: bool, flag: str = "--out", default: bool = False) -> str | None:
    """Refuse to replace an existing artifact folder without ``--force``, naming what would go.

    A build replaces its output folder as a whole, so files it does not write (``engines/`` TensorRT plans of
    ``medusa-export engine``, anything added by hand) would be deleted: the refusal names them
    (:func:`replaced_files`), and with ``force`` the caller says what it replaced.

    Args:
        out: the output folder.
        force: ``--force`` was given: replace an artifact folder anyway.
        flag: the option, for the message.
        default: ``out`` is the option's default (the user gave none): the message says "the default --out".

    Returns:
        With ``force``, what replacing ``out`` deletes (:func:`replaced_files`); None when ``out`` is new or empty.

    Raises:
        ArtifactError: ``out`` is a non-empty artifact folder and ``force`` is False (the message names what a
            build does not write, the ``engines/`` files one by one), or a non-empty folder that is not an
            artifact (never replaced, even with ``force``), or a file.
    """
    from medusa_runtime.contract.artifact import MANIFEST
    from medusa_runtime.errors import ArtifactError

    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return None
    named = f"the default {flag} {out}" if default else f"{flag} {out}"
    if not out.is_dir():
        raise ArtifactError(f"{named} is a file; give a folder path")
    if not (out / MANIFEST).is_file():
        raise ArtifactError(f"{named} is a non-empty folder that is not an artifact (no {MANIFEST}); "
                            "refusing to replace it: give an empty or new folder")
    what = replaced_files(out)
    if force:
        return what
    raise ArtifactError(f"{named} already holds {what}, which would all be deleted. Give --force to replace all of "
                        f"it, or choose another {flag}")
