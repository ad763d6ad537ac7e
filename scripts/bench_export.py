#!/usr/bin/env python
"""Peak resident memory and time per stage of ``medusa-export build``, measured from outside the process.

    python scripts/bench_export.py --checkpoint tiny --checkpoint small --precision fp32 int4 --tree 64
    python scripts/bench_export.py --checkpoint /data/vicuna-7b --heads /data/medusa-vicuna-7b \\
        --precision fp16 int4 --out docs/export-memory.md -- --validate-layers 2

For every checkpoint x precision it runs, as a subprocess,
``medusa-export build --model CKPT [--heads HEADS] --tree N --precision P --out SCRATCH/... [BUILD ARGS]``
(everything after ``--`` is passed to build unchanged, so options the build grows later need no change here)
and measures:

* the resident memory of the build's process tree, sampled every ``--interval`` seconds with psutil (the sum
  of RSS over the build process and any child it starts);
* the kernel's exact high-water mark of the build process (``VmHWM`` in ``/proc/PID/status``), read with each
  sample and at every stage line: it only grows, so a stage during which it rose holds the run's peak so far,
  even a spike shorter than the sampling interval;
* how much of the build process's RSS is its own memory (``RssAnon``) rather than file-backed pages
  (``RssFile``: mmapped checkpoint shards count in RSS while touched, but are page cache the kernel can drop);
* ``/usr/bin/time -v``'s "Maximum resident set size" of the whole run, when GNU time is installed (Debian
  package ``time``); the table says when it is not;
* the time per stage: the build prints ``[n/N] what ...`` when a stage starts and ``[n/N] what: done in Xs``
  when it ends (on stderr); each stderr line is timestamped as it arrives and the samples are attributed to
  the stage running at their timestamp. What runs before the first numbered stage (today: opening the model's
  headers and configs, announced as ``opening NAME (...) ...``) and after the last one (the summary) are stages of their own;
* the artifact's size (then the artifact is deleted unless ``--keep-artifacts``).

``--checkpoint`` takes a model folder or a shape name of ``scripts/make_random_checkpoint.py`` (``tiny``,
``small``, ``llama-3.2-1b``, ``vicuna-7b``, ...; ``./tiny`` is a folder): a shape is generated into
``--scratch`` first (reused when it is there, made with the same ``--make-args``), its generation measured the
same way, and its heads folder (``SHAPE-heads``) used. ``--heads`` after a ``--checkpoint`` pairs with it;
without one, a sibling ``CKPT-heads`` folder is used when it exists, else build uses the registry's default
heads for a path (initialised heads).

Output: a dated markdown table (``--out``, default ``docs/export-memory.md``) and the same figures as JSON
beside it (``.json``); per run, the build's full stderr and the samples (CSV) stay in ``--scratch/logs``.
Figures are only meaningful on a quiet machine: the JSON records the lowest available memory seen.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
GNU_TIME = Path("/usr/bin/time")
START = re.compile(r"^\[(\d+)/(\d+)\] (.*) \.\.\.$")
DONE = re.compile(r"^\[(\d+)/(\d+)\] (.*): done in ([0-9.]+)s$")
#: e.g. "opening tiny (headers and configs; ...) ...", printed before the numbered stages (the parenthesis is dropped)
PRELUDE = re.compile(r"^(\S.*?)(?: \(.*\))? \.\.\.$")
GB = 1e9


def _mrc():
    """scripts/make_random_checkpoint.py as a module (it imports torch only when it draws values)."""
    spec = importlib.util.spec_from_file_location("make_random_checkpoint", HERE / "make_random_checkpoint.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("make_random_checkpoint", mod)
    spec.loader.exec_module(mod)
    return mod


# ---------------------------------------------------------------------------------------------------------
# Measuring one command


@dataclass
class Sample:
    """One look at the process tree: seconds since start, summed RSS (bytes), VmHWM of the main process, and
    the main process's RSS split into anonymous memory (its allocations) and file-backed pages (e.g. mmapped
    safetensors shards: counted in RSS, but page cache the kernel can drop)."""

    t: float
    rss: int
    hwm: int
    anon: int = 0
    file: int = 0


@dataclass
class Measured:
    """What :func:`measure` saw of one command."""

    returncode: int
    wall_s: float
    lines: list[tuple[float, str, int]]  # (seconds since start, stderr line, VmHWM then)
    samples: list[Sample]
    stdout: str
    time_v: dict = field(default_factory=dict)  # parsed /usr/bin/time -v report ({} without GNU time)
    min_available: int = 0  # lowest MemAvailable seen during the run (bytes)


def read_status(pid: int) -> dict[str, int]:
    """``VmHWM`` (peak RSS so far), ``RssAnon`` and ``RssFile`` of a process from ``/proc/PID/status``, in
    bytes; {} when it cannot be read (gone, or not Linux)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key = line.split(":", 1)[0]
                if key in ("VmHWM", "RssAnon", "RssFile"):
                    out[key] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


def read_hwm(pid: int) -> int:
    """The process's peak resident set size so far (``VmHWM``, bytes); 0 when it cannot be read."""
    return read_status(pid).get("VmHWM", 0) if pid else 0


def tree_rss(root: psutil.Process, skip_root: bool) -> int:
    """Summed RSS (bytes) of ``root``'s descendants (and ``root`` unless ``skip_root``)."""
    procs = [] if skip_root else [root]
    try:
        procs += root.children(recursive=True)
    except psutil.Error:
        pass
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def parse_time_v(text: str) -> dict:
    """The fields of GNU time's ``-v`` report we use: max RSS (bytes), elapsed (s), exit status."""
    out = {}
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    if m:
        out["max_rss"] = int(m[1]) * 1024
    m = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([0-9:.]+)", text)
    if m:
        parts = [float(x) for x in m[1].split(":")]
        out["elapsed_s"] = sum(v * 60 ** i for i, v in enumerate(reversed(parts)))
    m = re.search(r"Exit status: (\d+)", text)
    if m:
        out["exit_status"] = int(m[1])
    return out


def measure(cmd: list[str], *, interval: float = 0.1, use_time: bool = True, time_file: Path | None = None,
            echo: bool = False, env: dict | None = None) -> Measured:
    """Run ``cmd`` and watch it: RSS of its process tree every ``interval`` s, stderr lines timestamped.

    Args:
        cmd: the command (argv).
        interval: sampling period in seconds (0.1-0.2 is cheap: one /proc read per process).
        use_time: wrap the command in ``/usr/bin/time -v -o time_file`` (GNU time must exist).
        time_file: where time writes its report (required with ``use_time``).
        echo: copy the command's stderr to ours as it comes.
        env: the environment (default: ours).

    Returns:
        The samples, timestamped stderr lines, stdout, exit status and wall time. The wrapper's own RSS is not
        counted; VmHWM is the main process's (the command itself, under the wrapper).
    """
    argv = ["/usr/bin/time", "-v", "-o", str(time_file), *cmd] if use_time else list(cmd)
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, env=env)
    root = psutil.Process(proc.pid)
    main_pid: list[int] = [proc.pid] if not use_time else []
    lines: list[tuple[float, str, int]] = []
    samples: list[Sample] = []
    out_chunks: list[str] = []
    done = threading.Event()
    avail = [psutil.virtual_memory().available]

    def find_main() -> int:
        if not main_pid:
            try:
                kids = root.children()
            except psutil.Error:
                kids = []
            if kids:
                main_pid.append(kids[0].pid)
        return main_pid[0] if main_pid else 0

    def read_err():
        # raw bytes: echoed as they come (progress bars keep their \r), cut into lines at \n and at \r
        fd, rest = proc.stderr.fileno(), b""
        while chunk := os.read(fd, 1 << 16):
            if echo:
                sys.stderr.buffer.write(chunk)
                sys.stderr.flush()
            *parts, rest = re.split(rb"\r\n|\r|\n", rest + chunk)
            if parts:
                pid = find_main()
                now, hwm = time.monotonic() - t0, read_hwm(pid)
                lines.extend((now, part.decode(errors="replace"), hwm) for part in parts if part)
        if rest:
            lines.append((time.monotonic() - t0, rest.decode(errors="replace"), 0))

    def read_out():
        out_chunks.append(proc.stdout.read().decode(errors="replace"))

    def sample():
        while not done.is_set():
            pid = find_main()
            st = read_status(pid) if pid else {}
            samples.append(Sample(time.monotonic() - t0, tree_rss(root, skip_root=use_time), st.get("VmHWM", 0),
                                  st.get("RssAnon", 0), st.get("RssFile", 0)))
            avail[0] = min(avail[0], psutil.virtual_memory().available)
            done.wait(interval)

    threads = [threading.Thread(target=f, daemon=True) for f in (read_err, read_out, sample)]
    for th in threads:
        th.start()
    try:
        rc = proc.wait()
    except BaseException:
        os.killpg(proc.pid, signal.SIGTERM)  # the session we started: the wrapper and the build
        proc.wait()
        raise
    finally:
        done.set()
        for th in threads:
            th.join(timeout=5)
    wall = time.monotonic() - t0
    time_v = parse_time_v(time_file.read_text()) if use_time and time_file and time_file.is_file() else {}
    return Measured(rc, wall, lines, samples, "".join(out_chunks), time_v, avail[0])


# ---------------------------------------------------------------------------------------------------------
# Stages


@dataclass
class Stage:
    """One stage of a run: its label, wall interval (s since start), the build's own seconds, and memory."""

    name: str
    start: float
    end: float
    seconds: float  # the build's "done in Xs" when printed, else end - start
    finished: bool
    index: int = 0  # n of "[n/N]" (0: not a numbered stage)
    peak_rss: int = 0  # max sampled tree RSS within [start, end] (bytes)
    peak_anon: int = 0  # max sampled RssAnon of the build process within [start, end] (bytes)
    hwm_end: int = 0  # VmHWM when the stage ended: the exact kernel peak of the run so far (bytes)

    def to_json(self) -> dict:
        return {**asdict(self), "wall_s": round(self.end - self.start, 3), "peak_rss_gb": round(self.peak_rss / GB, 3),
                "peak_anon_gb": round(self.peak_anon / GB, 3), "hwm_end_gb": round(self.hwm_end / GB, 3)}


def split_stages(lines: list[tuple[float, str, int]], wall: float) -> list[Stage]:
    """Cut a run's timeline into stages from its timestamped stderr lines.

    ``[n/N] what ...`` starts stage n, ``[n/N] what: done in Xs`` ends it. Before the first numbered stage:
    one stage named after the first ``something ...`` line (``opening NAME``), else ``startup``; between a
    done line and the next start: ``between stages`` (when it lasts >= 0.05 s); after the last one: ``after
    the last stage`` (summary, exit). A stage without its done line ends where the next begins, or at the exit
    (a failed run), and is marked unfinished.
    """
    starts = [t for t, line, _ in lines if START.match(line)]
    first = starts[0] if starts else wall
    prelude = next((m[1] for t, line, _ in lines
                    if t <= first and not START.match(line) and (m := PRELUDE.match(line))), None)
    stages = [Stage(prelude or "startup", 0.0, first, first, bool(starts))]
    current: Stage | None = None
    last_end = first
    for t, line, hwm in lines:
        if (m := DONE.match(line)) and current is not None and int(m[1]) == current.index:
            current.end, current.seconds, current.finished, current.hwm_end = t, float(m[4]), True, hwm
            current, last_end = None, t
        elif m := START.match(line):
            if current is not None:
                current.end, current.seconds = t, t - current.start
            elif t - last_end >= 0.05:
                stages.append(Stage("between stages", last_end, t, t - last_end, True))
            current = Stage(f"[{m[1]}/{m[2]}] {m[3]}", t, wall, wall - t, False, index=int(m[1]))
            stages.append(current)
    if current is not None:
        current.end, current.seconds = wall, wall - current.start
    elif starts:
        stages.append(Stage("after the last stage", last_end, wall, wall - last_end, True))
    return stages


def attribute(stages: list[Stage], samples: list[Sample], lines: list[tuple[float, str, int]]) -> None:
    """Fill each stage's sampled peak RSS and its VmHWM at the end (from stage lines, else samples).

    A stage shorter than the sampling period may hold no sample: it gets the larger of the last sample before
    it and the first one after it (the memory around it).
    """
    for st in stages:
        inside = [s for s in samples if st.start <= s.t <= st.end]
        if not inside:
            inside = [s for s in samples if s.t < st.start][-1:] + [s for s in samples if s.t > st.end][:1]
        st.peak_rss = max((s.rss for s in inside), default=0)
        st.peak_anon = max((s.anon for s in inside), default=0)
        if not st.hwm_end:
            seen = [h for t, _, h in lines if t <= st.end and h] + [s.hwm for s in samples if s.t <= st.end and s.hwm]
            later = [s.hwm for s in samples if s.t >= st.end and s.hwm]
            # the first sample after the end bounds it from above; use it only for the last stage
            st.hwm_end = max(seen, default=0) if st is not stages[-1] else max(seen + later[:1], default=0)


# ---------------------------------------------------------------------------------------------------------
# Checkpoints


@dataclass
class Checkpoint:
    """A model folder to build, its heads, and how it was made (when this script made it)."""

    model: Path
    heads: Path | None
    label: str
    made: dict | None = None  # generation figures when generated here


def describe(folder: Path) -> str:
    """``shape family dtype, N params`` from random_checkpoint.json, else the folder name and its size."""
    info = folder / "random_checkpoint.json"
    if info.is_file():
        d = json.loads(info.read_text())
        n = d["parameters"]
        return f"{d['shape']} ({d['family']} {d['dtype']}, {n / 1e9:.2f}B)" if n >= 1e8 else \
            f"{d['shape']} ({d['family']} {d['dtype']}, {n / 1e6:.1f}M)"
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return f"{folder.name} ({json.loads(index.read_text())['metadata']['total_size'] / GB:.1f} GB)"
    return folder.name


def resolve_checkpoints(pairs: list[dict], scratch: Path, *, make_args: list[str], interval: float,
                        use_time: bool, regenerate: bool) -> list[Checkpoint]:
    """Model folders for the ``--checkpoint``/``--heads`` pairs; shape names are generated into ``scratch``.

    Raises:
        SystemExit: neither a folder nor a known shape (the message lists the shapes).
    """
    mrc = _mrc()
    out = []
    for pair in pairs:
        name, heads = pair["checkpoint"], pair.get("heads")
        path = Path(name)
        if name not in mrc.shape_names() and path.is_dir():  # a shape name wins: ./NAME for a folder called so
            sibling = path.parent / f"{path.name}-heads"
            hp = Path(heads) if heads else (sibling if sibling.is_dir() else None)
            out.append(Checkpoint(path.absolute(), hp.absolute() if hp else None, describe(path)))
            continue
        if name not in mrc.shape_names():
            raise SystemExit(f"--checkpoint {name!r} is neither a folder nor a shape; shapes: "
                             f"{', '.join(mrc.shape_names())}")
        folder = scratch / name
        made = None
        info, made_with = folder / mrc.INFO_FILE, scratch / "logs" / f"make-{name}.args.json"
        same = info.is_file() and made_with.is_file() and json.loads(made_with.read_text()) == make_args
        if regenerate or not same:
            cmd = [sys.executable, str(HERE / "make_random_checkpoint.py"), name, str(folder), "--force", "--quiet",
                   *make_args]
            print(f"making {name} in {folder} ...", file=sys.stderr, flush=True)
            m = measure(cmd, interval=interval, use_time=use_time, time_file=scratch / "logs" / f"make-{name}.time")
            if m.returncode:
                raise SystemExit(f"make_random_checkpoint.py {name} failed ({m.returncode}):\n"
                                 + "\n".join(line for _, line, _ in m.lines[-20:]))
            size = sum(p.stat().st_size for d in (folder, scratch / f"{name}-heads") if d.is_dir()
                       for p in d.iterdir())
            made = {"seconds": round(m.wall_s, 1), "bytes": size, "peak_rss_gb": round(max(
                (s.rss for s in m.samples), default=0) / GB, 3),
                "time_v_max_rss_gb": round(m.time_v["max_rss"] / GB, 3) if "max_rss" in m.time_v else None,
                "command": shlex.join(cmd)}
            made_with.write_text(json.dumps(make_args) + "\n")
            print(f"  {size / GB:.2f} GB in {m.wall_s:.1f}s", file=sys.stderr, flush=True)
        hp = Path(heads) if heads else scratch / f"{name}-heads"
        out.append(Checkpoint(folder, hp if hp.is_dir() else None, describe(folder), made))
    return out


# ---------------------------------------------------------------------------------------------------------
# Runs and the report


def folder_bytes(path: Path) -> int:
    """Total size of the files under ``path`` (0 when absent)."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def run_one(ckpt: Checkpoint, precision: str, args, build_args: list[str], logs: Path) -> dict:
    """One build, measured; returns the run's JSON record."""
    tag = f"{ckpt.model.name}-{precision}"
    art = Path(args.scratch) / "artifacts" / tag
    cmd = [*shlex.split(args.command), "build", "--force", "--model", str(ckpt.model)]  # reruns replace
    if ckpt.heads:
        cmd += ["--heads", str(ckpt.heads)]
    cmd += ["--tree", str(args.tree), "--precision", precision]
    if "--out" not in build_args:
        cmd += ["--out", str(art)]
    cmd += build_args
    print(f"\n== {ckpt.label} {precision}: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    m = measure(cmd, interval=args.interval, use_time=args.use_time, time_file=logs / f"{tag}.time",
                echo=not args.quiet)
    stages = split_stages(m.lines, m.wall_s)
    attribute(stages, m.samples, m.lines)
    (logs / f"{tag}.stderr.log").write_text("\n".join(f"{t:9.2f}  {line}" for t, line, _ in m.lines) + "\n")
    (logs / f"{tag}.stdout.log").write_text(m.stdout)
    with open(logs / f"{tag}.samples.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["seconds", "tree_rss_bytes", "vmhwm_bytes"])
        w.writerows((round(s.t, 3), s.rss, s.hwm) for s in m.samples)
    size = folder_bytes(art)
    if not args.keep_artifacts:
        shutil.rmtree(art, ignore_errors=True)
    peak = max((s.rss for s in m.samples), default=0)
    anon = max((s.anon for s in m.samples), default=0)
    hwm = max([s.hwm for s in m.samples] + [h for _, _, h in m.lines], default=0)
    rec = {"checkpoint": str(ckpt.model), "label": ckpt.label, "heads": str(ckpt.heads) if ckpt.heads else None,
           "precision": precision, "command": shlex.join(cmd), "returncode": m.returncode,
           "wall_s": round(m.wall_s, 2), "peak_rss_gb": round(peak / GB, 3), "peak_anon_gb": round(anon / GB, 3),
           "vmhwm_gb": round(hwm / GB, 3),
           "time_v_max_rss_gb": round(m.time_v["max_rss"] / GB, 3) if "max_rss" in m.time_v else None,
           "time_v_elapsed_s": m.time_v.get("elapsed_s"), "artifact_bytes": size,
           "min_available_gb": round(m.min_available / GB, 2), "samples": len(m.samples),
           "stages": [s.to_json() for s in stages], "logs": str(logs / f"{tag}.stderr.log")}
    if m.returncode:
        rec["error_tail"] = [line for _, line, _ in m.lines[-5:]]
    print(f"== {ckpt.label} {precision}: rc {m.returncode}, {m.wall_s:.1f}s, peak RSS {peak / GB:.2f} GB sampled, "
          f"VmHWM {hwm / GB:.2f} GB" + (f", time -v {rec['time_v_max_rss_gb']:.2f} GB" if rec["time_v_max_rss_gb"]
                                         is not None else ""), file=sys.stderr, flush=True)
    return rec


def _gb(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _size(n: int) -> str:
    return "-" if not n else (f"{n / GB:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB")


def markdown(report: dict) -> str:
    """The dated markdown table of a report (see the module docstring for what each column means)."""
    h = report["host"]
    lines = [
        "# `medusa-export build`: peak memory and time per stage",
        "",
        f"Measured {report['date']} on {h['cpus']} CPUs, {h['memory_gb']:.1f} GB RAM ({h['platform']}), by",
        f"`{report['command']}`.",
        "",
        f"Peak RSS: the build's process tree, sampled every {report['interval_s']} s (psutil). VmHWM: the kernel's",
        "high-water mark of the build process at the end of the stage (exact; it only grows, so the stage where it",
        "rises holds the peak). Anon: the build process's RssAnon (its own allocations; the rest of RSS is",
        "file-backed pages, e.g. mmapped checkpoint shards, which the kernel can drop under pressure).",
        "`/usr/bin/time -v`: \"Maximum resident set size\" of the whole run"
        + ("." if report["gnu_time"] else " (not measured: /usr/bin/time is not installed; `apt-get install time`)."),
        "Seconds: the build's own \"done in\" figure per stage; the total is the wall time of the command.",
        "",
        "| checkpoint | precision | stage | seconds | peak RSS GB (sampled) | of it anon GB | VmHWM GB | artifact |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in report["runs"]:
        for s in r["stages"]:
            mark = "" if s["finished"] else " (unfinished)"
            lines.append(f"| {r['label']} | {r['precision']} | {s['name']}{mark} | {s['seconds']:.1f} | "
                         f"{s['peak_rss_gb']:.2f} | {s['peak_anon_gb']:.2f} | {s['hwm_end_gb']:.2f} | |")
        status = "total" if r["returncode"] == 0 else f"**failed, exit {r['returncode']}**"
        tv = f" (time -v {_gb(r['time_v_max_rss_gb'])})" if r["time_v_max_rss_gb"] is not None else ""
        lines.append(f"| {r['label']} | {r['precision']} | **{status}** | **{r['wall_s']:.1f}** | "
                     f"**{r['peak_rss_gb']:.2f}** | **{r['peak_anon_gb']:.2f}** | **{r['vmhwm_gb']:.2f}**{tv} | "
                     f"{_size(r['artifact_bytes'])} |")
    made = [c for c in report["checkpoints"] if c.get("made")]
    if made:
        lines += ["", "Random checkpoints made for this run (`scripts/make_random_checkpoint.py`, heads included):", "",
                  "| checkpoint | size | seconds | peak RSS GB (sampled) | time -v GB |", "|---|---:|---:|---:|---:|"]
        for c in made:
            m = c["made"]
            lines.append(f"| {c['label']} | {_size(m['bytes'])} | {m['seconds']:.1f} | {m['peak_rss_gb']:.2f} | "
                         f"{_gb(m['time_v_max_rss_gb'])} |")
    lines += ["", f"Lowest available memory seen during the builds: "
                  f"{min((r['min_available_gb'] for r in report['runs']), default=0):.1f} GB. Logs: "
                  f"`{report['logs']}`.", ""]
    return "\n".join(lines)


class _PairAction(argparse.Action):
    """``--checkpoint X [--heads H]``: a list of pairs, ``--heads`` attaching to the last checkpoint."""

    def __call__(self, parser, namespace, value, option_string=None):
        pairs = getattr(namespace, "pairs", None) or []
        if option_string == "--checkpoint":
            pairs.append({"checkpoint": value})
        elif not pairs or "heads" in pairs[-1]:
            parser.error("--heads must follow its --checkpoint")
        else:
            pairs[-1]["heads"] = value
        namespace.pairs = pairs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                usage="%(prog)s --checkpoint DIR|SHAPE [--heads DIR] ... [options] [-- BUILD ARGS]")
    p.add_argument("--checkpoint", action=_PairAction, dest="pairs", metavar="DIR|SHAPE",
                   help="a model folder, or a shape of make_random_checkpoint.py generated into --scratch (repeatable)")
    p.add_argument("--heads", action=_PairAction, dest="pairs", metavar="DIR",
                   help="the heads of the preceding --checkpoint (default: CKPT-heads when it exists)")
    p.add_argument("--precision", nargs="+", default=["fp16", "int4"], help="build precisions (default: fp16 int4)")
    p.add_argument("--tree", default="64", help="build's --tree (default 64)")
    p.add_argument("--scratch", default="/tmp/bench-export",
                   help="generated checkpoints, artifacts and logs (default /tmp/bench-export)")
    p.add_argument("--make-args", default="", help="extra arguments for make_random_checkpoint.py (one string)")
    p.add_argument("--regenerate", action="store_true", help="make shape checkpoints again even when present")
    p.add_argument("--out", default="docs/export-memory.md", help="markdown report; the JSON goes beside it")
    p.add_argument("--interval", type=float, default=0.1, help="RSS sampling period in seconds (default 0.1)")
    p.add_argument("--command", default=f"{shlex.quote(sys.executable)} -m medusa_export.cli",
                   help="the medusa-export command (default: this Python's)")
    p.add_argument("--no-time", dest="use_time", action="store_false",
                   help="do not wrap the build in /usr/bin/time -v")
    p.add_argument("--keep-artifacts", action="store_true", help="keep the built artifacts in --scratch")
    p.add_argument("--quiet", action="store_true", help="do not echo the build's stderr")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    given = list(argv)
    build_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, build_args = argv[:i], argv[i + 1:]
    args = build_parser().parse_args(argv)
    if not args.pairs:
        build_parser().error("give at least one --checkpoint")
    gnu_time = GNU_TIME.is_file() and os.access(GNU_TIME, os.X_OK)
    if args.use_time and not gnu_time:
        print("note: /usr/bin/time is not installed (Debian: apt-get install time); measuring with psutil only",
              file=sys.stderr)
    args.use_time = args.use_time and gnu_time
    scratch = Path(args.scratch).absolute()
    logs = scratch / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    ckpts = resolve_checkpoints(args.pairs, scratch, make_args=shlex.split(args.make_args), interval=args.interval,
                                use_time=args.use_time, regenerate=args.regenerate)
    mem = psutil.virtual_memory()
    runs: list[dict] = []
    report = {
        "date": datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "command": shlex.join(["python", "scripts/bench_export.py", *given]),
        "host": {"cpus": os.cpu_count(), "memory_gb": mem.total / GB, "platform": platform.platform(terse=True),
                 "python": platform.python_version()},
        "interval_s": args.interval, "gnu_time": args.use_time, "logs": str(logs), "build_args": build_args,
        "checkpoints": [{"model": str(c.model), "heads": str(c.heads) if c.heads else None, "label": c.label,
                         "made": c.made} for c in ckpts],
        "runs": runs,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for c in ckpts:
        for precision in args.precision:
            runs.append(run_one(c, precision, args, build_args, logs))
            # rewritten after every run: a long benchmark interrupted midway keeps what it measured
            out.write_text(markdown(report))
            out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {out} and {out.with_suffix('.json')}", file=sys.stderr)
    return 0 if all(r["returncode"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
