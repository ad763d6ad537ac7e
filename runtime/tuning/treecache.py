"""The default tree: ``--tree auto`` measured once per artifact, machine and backend, and cached.

When no ``--tree`` is given, ``generate``, ``chat``, :class:`~medusa_runtime.front.session.MedusaSession`
and the Triton model run the tree that is fastest on the engine and machine they run on: the
choice of :func:`medusa_runtime.tuning.autotree.auto_tree` (tree step and heads timed at several sizes,
expected tokens per second from the heads' calibration). The timing takes a few seconds, so it is
made once and kept in a small JSON file per artifact in the user cache (:func:`cache_dir`), one
record per key it was measured under: the artifact's identity (the SHA-256 of its checksum table),
the machine (CPU model, cores, host name), the backend (name, ONNX Runtime version, threads), the
context capacity and the tree policy. A run whose key has no record times the sizes and adds one
(the notice says what differs from the newest record); records of an earlier artifact are dropped.

Environment:
    MEDUSA_EXPORT_TREE: the ``--tree`` spec used when none is given (default ``auto``;
        ``artifact``: the tree the artifact was built with).
    MEDUSA_EXPORT_CACHE: the cache folder (default ``$XDG_CACHE_HOME/medusa-export`` or
        ``~/.cache/medusa-export``); the records are in its ``trees/`` subfolder.

Pure parts (keys, records, the choice) are apart from the I/O (:func:`read_records`,
:func:`write_records`, :func:`machine_fingerprint`).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

from .autotree import DEFAULT_MARGIN, DEFAULT_SIZES, TreeTiming
from ..engines import BACKENDS
from ..trees.treespec import AUTO

#: Environment variable: the tree spec used when no ``--tree`` is given.
TREE_ENV = "MEDUSA_EXPORT_TREE"
#: Environment variable: the cache folder.
CACHE_ENV = "MEDUSA_EXPORT_CACHE"
#: The default tree spec: measured on this machine, cached.
DEFAULT_SPEC = AUTO
#: Version of the record format and of the choice it holds (a new version re-times).
RECORD_VERSION = 1
#: Records kept per artifact (one per configuration it was timed under: threads, backend, capacity, ...).
MAX_RECORDS = 8


def default_spec() -> str:
    """The tree spec used when none is given: ``$MEDUSA_EXPORT_TREE``, else ``auto``."""
    return (os.environ.get(TREE_ENV) or "").strip() or DEFAULT_SPEC


def cache_dir() -> Path:
    """The cache folder: ``$MEDUSA_EXPORT_CACHE``, else ``$XDG_CACHE_HOME/medusa-export``, else
    ``~/.cache/medusa-export``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "medusa-export"


def record_path(artifact_dir: str | Path, folder: Path | None = None) -> Path:
    """The record file of an artifact folder: ``trees/<sha256 of its resolved path, 16 hex>.json``."""
    digest = hashlib.sha256(str(Path(artifact_dir).resolve()).encode()).hexdigest()[:16]
    return (folder or cache_dir()) / "trees" / f"{digest}.json"


def artifact_identity(sha256s: Mapping[str, str]) -> str:
    """SHA-256 (hex) of an artifact's files' SHA-256s (file -> hex digest, as ``manifest.checksums``
    records them): changes when any file of the artifact changes, not when the folder moves."""
    return hashlib.sha256(json.dumps(sorted(sha256s.items())).encode()).hexdigest()


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_fingerprint() -> dict:
    """What identifies this machine for timing: host name, CPU model, architecture, usable cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"host": platform.node(), "cpu": _cpu_model(), "arch": platform.machine(), "cores": cores}


def backend_fingerprint(backend: str, engine, threads: int | None) -> dict:
    """What identifies the backend for timing: its name, engine class, library version (its
    :class:`~medusa_runtime.engines.BackendSpec`'s), threads, GPU index (the engine's capabilities), and
    ``spin: True`` for an engine whose threads busy-wait (``--spin``; absent otherwise, so earlier records stay
    valid)."""
    spec = BACKENDS.get(backend)
    spin = {"spin": True} if getattr(engine, "spin", False) else {}  # spinning threads change the step times
    return {"backend": backend, "engine": type(engine).__name__, "version": spec.version() if spec else None,
            "threads": threads, "device_id": engine.capabilities.device_id, **spin}


def timing_key(*, artifact: str, machine: Mapping, backend: Mapping, capacity: int, policy: str,
               sizes: Sequence[int] = DEFAULT_SIZES, margin: float = DEFAULT_MARGIN) -> dict:
    """The key a timing is valid under (pure): a record with another key is stale."""
    return {"version": RECORD_VERSION, "artifact": artifact, "machine": dict(machine), "backend": dict(backend),
            "capacity": int(capacity), "policy": policy, "sizes": [int(s) for s in sizes], "margin": float(margin)}


def stale_reason(old: Mapping | None, new: Mapping) -> str:
    """Why a record's key ``old`` does not serve ``new`` (pure): "" when it does."""
    if old is None:
        return "no timing yet"
    names = {"artifact": "the artifact changed", "machine": "another machine",
             "backend": "another backend, threads or --spin", "capacity": "another context capacity",
             "policy": "another tree policy"}
    changed = [text for k, text in names.items() if old.get(k) != new.get(k)]
    if not changed and old != new:
        changed = ["a newer medusa_runtime"]
    return ", ".join(changed)


@dataclass(frozen=True)
class TreeRecord:
    """A cached choice.

    Attributes:
        key: :func:`timing_key` it was measured under.
        chosen: node count of the chosen tree (1 = plain decoding).
        table: every timed size (:class:`~medusa_runtime.tuning.autotree.TreeTiming`).
        seconds: how long the timing took, seconds.
        measured_at: when (Unix time, seconds).
    """

    key: dict
    chosen: int
    table: tuple[TreeTiming, ...]
    seconds: float
    measured_at: float

    def to_json(self) -> dict:
        return {"key": self.key, "chosen": self.chosen, "seconds": round(self.seconds, 3),
                "measured_at": round(self.measured_at, 1), "table": [r.to_json() for r in self.table]}

    @staticmethod
    def from_json(doc: Mapping) -> "TreeRecord":
        """Inverse of :meth:`to_json`. Raises KeyError, TypeError or ValueError on a malformed record."""
        table = tuple(TreeTiming(int(r["size"]), float(r["expected_tokens_per_step"]), float(r["step_ms"]),
                                 float(r["heads_ms"]), float(r["loop_ms"]) if r.get("loop_ms") is not None else None,
                                 float(r.get("overhead_ms") or 0.0), float(r.get("spread") or 0.0))
                      for r in doc["table"])
        chosen = int(doc["chosen"])
        if chosen not in {r.size for r in table}:
            raise ValueError(f"chosen size {chosen} is not in the table")
        return TreeRecord(dict(doc["key"]), chosen, table, float(doc["seconds"]), float(doc["measured_at"]))

    def row(self, size: int) -> TreeTiming | None:
        """The table row of ``size`` (None when it was not timed)."""
        return next((r for r in self.table if r.size == size), None)


def read_records(path: Path) -> list[TreeRecord]:
    """The records in the file at ``path``, newest first; [] when there is none or it cannot be read (a
    malformed record is skipped: it is re-made when needed)."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    out = []
    for item in doc.get("records", []) if isinstance(doc, dict) else []:
        try:
            out.append(TreeRecord.from_json(item))
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
    return out


def write_records(path: Path, records: Sequence[TreeRecord]) -> str | None:
    """Write ``records`` (newest first) to ``path`` atomically (temporary file, then rename).

    Returns:
        None, or why it could not be written (an unwritable cache only costs a re-timing next time).
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"records": [r.to_json() for r in records]}, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    except OSError as exc:
        return f"{path}: {exc.strerror or exc}"
    return None


@dataclass(frozen=True)
class DefaultTree:
    """How the default tree was obtained.

    Attributes:
        record: the timing used.
        path: its cache file.
        timed: True when it was measured now, False when read from the cache.
        reason: why it was measured now ("no timing yet", "the artifact changed", ...); "" when cached.
        cache_error: why the record could not be written ("" when it was).
    """

    record: TreeRecord
    path: Path
    timed: bool
    reason: str = ""
    cache_error: str = ""

    def notice(self) -> str:
        """The one line printed when the sizes were timed now (first run, or a stale record)."""
        r = self.record
        best, root = r.row(r.chosen), r.row(1)
        pick = ("plain decoding (no tree beats it here)" if r.chosen == 1 else
                f"a {r.chosen}-node tree, {best.tokens_per_second:.1f} expected tokens/s"
                + (f" vs {root.tokens_per_second:.1f} plain" if root else ""))
        why = "" if self.reason == "no timing yet" else f" ({self.reason})"
        return (f"timing tree sizes on this machine{why}: {r.seconds:.1f} s; fastest: {pick} "
                f"[{self.where()}; --tree overrides]")

    def where(self) -> str:
        """Where the timing is kept: "read from the cache PATH" (reused), "cached in PATH" (written now) or
        "not cached: WHY" (a noisy timing, an unwritable cache folder)."""
        if not self.timed:
            return f"read from the cache {self.path}"
        return f"cached in {self.path}" if not self.cache_error else f"not cached: {self.cache_error}"

    def describe(self) -> str:
        """Short source of the tree for summaries: "fastest here, timed now" / "fastest here, cached"."""
        return "fastest here, timed now" if self.timed else "fastest here, cached"


def cached_choice(artifact_dir: str | Path, key: dict, measure: Callable[[], tuple[int, Sequence[TreeTiming]]],
                  *, folder: Path | None = None, clock: Callable[[], float] = time.perf_counter,
                  cacheable: Callable[[Sequence[TreeTiming]], bool] = lambda table: True) -> DefaultTree:
    """The cached choice for ``key``, or a new one from ``measure()`` written to the cache.

    Args:
        artifact_dir: the artifact folder (names the record file).
        key: :func:`timing_key` of this artifact, machine and backend.
        measure: times the sizes; returns (chosen size, the table).
        folder: the cache folder (default :func:`cache_dir`).
        clock: seconds counter for the timing's duration.
        cacheable: whether a new table may be written to the cache (False: it is used once and not kept,
            e.g. a timing too noisy to trust: :func:`medusa_runtime.tuning.autotree.timing_noise`).

    Returns:
        A :class:`DefaultTree` (``timed`` False when a record of ``key`` was reused). The file keeps the
        newest :data:`MAX_RECORDS` records of the artifact as it is now (other threads, backends,
        capacities, policies, machines sharing the cache); records of an earlier artifact are dropped.
    """
    path = record_path(artifact_dir, folder)
    records = read_records(path)
    same = next((r for r in records if r.key == key), None)
    if same is not None:
        return DefaultTree(same, path, timed=False)
    reason = stale_reason(records[0].key if records else None, key)
    t = clock()
    chosen, table = measure()
    # as it is stored (rounded), so that a reused record equals the one timed now
    record = TreeRecord.from_json(TreeRecord(key, int(chosen), tuple(table), clock() - t, time.time()).to_json())
    if not cacheable(record.table):
        return DefaultTree(record, path, timed=True, reason=reason, cache_error="the timing was noisy")
    kept = [r for r in records if r.key.get("artifact") == key.get("artifact")][: MAX_RECORDS - 1]
    error = write_records(path, [record, *kept])
    return DefaultTree(record, path, timed=True, reason=reason, cache_error=error or "")
