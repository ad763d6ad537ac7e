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
