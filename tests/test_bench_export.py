"""scripts/bench_export.py: stage timelines from the build's stderr, memory attributed to the stage that used
it (checked with a fake build that allocates a known amount in one stage), the report, and one real build."""

import importlib.util
import json
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import skip_or_fail_in_ci

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "bench_export.py"
_spec = importlib.util.spec_from_file_location("bench_export", _PATH)
be = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("bench_export", be)
_spec.loader.exec_module(be)

MB = 2**20

# A stand-in for `medusa-export build`: the real stage lines, 300 MiB touched in stage 2, the artifact written
# to --out, its argv on stdout; FAKE_EXIT=n makes it die in stage 2 with that status.
FAKE = textwrap.dedent("""
    import os, sys, time
    argv = sys.argv[1:]
    out = argv[argv.index("--out") + 1]
    print("loading fake ...", file=sys.stderr, flush=True)
    time.sleep(0.4)
    print("[1/2] light work ...", file=sys.stderr, flush=True)
    time.sleep(0.5)
    print("[1/2] light work: done in 0.5s", file=sys.stderr, flush=True)
    print("[2/2] heavy work ...", file=sys.stderr, flush=True)
    for i in range(3):
        print(f"progress {i}%\\r", end="", file=sys.stderr, flush=True)
    block = bytearray(b"\\x01") * (300 * 2**20)
    time.sleep(0.6)
    if os.environ.get("FAKE_EXIT"):
        sys.exit(int(os.environ["FAKE_EXIT"]))
    del block
    print("[2/2] heavy work: done in 0.6s", file=sys.stderr, flush=True)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "weights.bin"), "wb") as f:
        f.write(b"\\0" * 123456)
    print("ARGV", " ".join(argv))
""")


@pytest.fixture()
def fake(tmp_path) -> str:
    path = tmp_path / "fake_build.py"
    path.write_text(FAKE)
    return f"{sys.executable} {path}"


def test_split_stages_names_times_and_gaps():
    lines = [(0.2, "loading m ...", 0), (0.3, "Loading checkpoint shards: 100%", 0),
             (5.0, "[1/3] export ...", 100), (9.0, "[1/3] export: done in 3.9s", 200),
             (9.5, "[2/3] quantize ...", 200), (12.0, "[2/3] quantize: done in 2.5s", 300),
             (12.01, "[3/3] validate ...", 300), (20.0, "[3/3] validate: done in 8.0s", 350),
             (21.0, "artifact: x", 350)]
    st = be.split_stages(lines, 22.0)
    assert [s.name for s in st] == ["loading m", "[1/3] export", "between stages", "[2/3] quantize", "[3/3] validate",
                                    "after the last stage"]
    assert [(s.start, s.end, s.seconds) for s in st] == [(0.0, 5.0, 5.0), (5.0, 9.0, 3.9), (9.0, 9.5, 0.5),
                                                         (9.5, 12.0, 2.5), (12.01, 20.0, 8.0), (20.0, 22.0, 2.0)]
    assert all(s.finished for s in st) and [s.hwm_end for s in st] == [0, 200, 0, 300, 350, 0]


def test_split_stages_of_a_failed_run_and_of_no_stages():
    st = be.split_stages([(1.0, "[1/2] export ...", 0), (3.0, "[2/2] quantize ...", 0), (4.0, "Killed", 0)], 4.5)
    assert [(s.name, s.finished, s.end, s.seconds) for s in st] == [
        ("startup", True, 1.0, 1.0), ("[1/2] export", False, 3.0, 2.0), ("[2/2] quantize", False, 4.5, 1.5)]
    st = be.split_stages([(0.5, "error: no model at x", 0)], 0.8)
    assert [(s.name, s.finished, s.seconds) for s in st] == [("startup", False, 0.8)]


def test_attribute_peaks_to_the_stage_that_held_them():
    st = be.split_stages([(1.0, "[1/2] a ...", 10), (2.0, "[1/2] a: done in 1.0s", 50),
                          (2.0, "[2/2] b ...", 50), (2.02, "[2/2] b: done in 0.0s", 90)], 3.0)
    samples = [be.Sample(t, rss, hwm) for t, rss, hwm in
               [(0.5, 10, 10), (1.5, 50, 50), (1.9, 40, 50), (2.5, 30, 90), (2.9, 20, 90)]]
    be.attribute(st, samples, [])
    assert [(s.name, s.peak_rss) for s in st] == [("startup", 10), ("[1/2] a", 50), ("[2/2] b", 40),
                                                  ("after the last stage", 30)]
    # b held no sample: the samples on either side (40 before, 30 after) bound it
    assert [s.hwm_end for s in st] == [10, 50, 90, 90]


def test_parse_time_v():
    text = ('\tCommand being timed: "x"\n\tElapsed (wall clock) time (h:mm:ss or m:ss): 1:02:03.5\n'
            "\tMaximum resident set size (kbytes): 2048\n\tExit status: 3\n")
    assert be.parse_time_v(text) == {"max_rss": 2048 * 1024, "elapsed_s": 3723.5, "exit_status": 3}


def test_measure_sees_the_memory_of_the_stage_that_allocates_it(tmp_path, fake):
    m = be.measure([*fake.split(), "build", "--out", str(tmp_path / "art")], interval=0.05,
                   use_time=be.GNU_TIME.is_file(), time_file=tmp_path / "t.txt")
    assert m.returncode == 0 and "ARGV build --out" in m.stdout
    assert any(line == "progress 1%" for _, line, _ in m.lines)  # \r updates are lines of their own
    st = be.split_stages(m.lines, m.wall_s)
    be.attribute(st, m.samples, m.lines)
    by = {s.name: s for s in st}
    assert list(by) == ["loading fake", "[1/2] light work", "[2/2] heavy work", "after the last stage"]
    assert by["[1/2] light work"].seconds == 0.5 and by["[2/2] heavy work"].seconds == 0.6
    light, heavy = by["[1/2] light work"], by["[2/2] heavy work"]
    assert light.peak_rss < 100 * MB and light.hwm_end < 100 * MB
    assert heavy.peak_rss - light.peak_rss > 280 * MB and heavy.hwm_end > 300 * MB
    assert heavy.peak_anon - light.peak_anon > 280 * MB  # the block is the process's own (anonymous) memory
    if not be.GNU_TIME.is_file():  # everything above is checked; what GNU time reports needs it
        skip_or_fail_in_ci(f"{be.GNU_TIME} (GNU time, apt package 'time') is missing: its max RSS is not checked")
    assert m.time_v["max_rss"] > 300 * MB and m.time_v["exit_status"] == 0


def test_main_writes_the_report_and_passes_build_args_through(tmp_path, fake):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (tmp_path / "ckpt-heads").mkdir()
    out = tmp_path / "docs" / "mem.md"
    rc = be.main(["--checkpoint", str(ckpt), "--precision", "fp16", "int4", "--tree", "8", "--scratch",
                  str(tmp_path / "s"), "--out", str(out), "--command", fake, "--quiet", "--interval", "0.05",
                  "--", "--validate-layers", "2"])
    assert rc == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert [r["precision"] for r in report["runs"]] == ["fp16", "int4"]
    r = report["runs"][0]
    assert r["returncode"] == 0 and r["artifact_bytes"] == 123456 and r["heads"] == str(tmp_path / "ckpt-heads")
    assert r["command"].endswith(f"--tree 8 --precision fp16 --out {tmp_path / 's' / 'artifacts' / 'ckpt-fp16'} "
                                 "--validate-layers 2")
    assert not (tmp_path / "s" / "artifacts" / "ckpt-fp16").exists()  # measured, then removed
    assert [s["name"] for s in r["stages"]] == ["loading fake", "[1/2] light work", "[2/2] heavy work",
                                                "after the last stage"]
    assert r["vmhwm_gb"] > 0.3 and r["peak_rss_gb"] > 0.28
    md = out.read_text()
    assert "| ckpt | int4 | [2/2] heavy work | 0.6 |" in md and "| ckpt | fp16 | **total** |" in md
    assert 0.28 < r["peak_anon_gb"] <= r["peak_rss_gb"]
    assert "0.1 MB |" in md and (tmp_path / "s" / "logs" / "ckpt-int4.samples.csv").is_file()


def test_a_failed_build_is_reported_not_hidden(tmp_path, fake, monkeypatch):
    monkeypatch.setenv("FAKE_EXIT", "137")
    (tmp_path / "ckpt").mkdir()
    out = tmp_path / "mem.md"
    rc = be.main(["--checkpoint", str(tmp_path / "ckpt"), "--precision", "fp16", "--scratch", str(tmp_path / "s"),
                  "--out", str(out), "--command", fake, "--quiet", "--no-time"])
    assert rc == 1
    r = json.loads(out.with_suffix(".json").read_text())["runs"][0]
    assert r["returncode"] == 137 and r["time_v_max_rss_gb"] is None and r["heads"] is None
    assert [(s["name"], s["finished"]) for s in r["stages"]][-1] == ("[2/2] heavy work", False)
    md = out.read_text()
    assert "**failed, exit 137**" in md and "heavy work (unfinished)" in md and "not measured" in md


def test_a_real_build_of_a_generated_tiny_checkpoint(tmp_path):
    out = tmp_path / "mem.md"
    rc = be.main(["--checkpoint", "tiny", "--precision", "fp32", "--tree", "4", "--scratch", str(tmp_path / "s"),
                  "--out", str(out), "--quiet", "--make-args", "--heads 2", "--", "--no-validate"])
    assert rc == 0
    report = json.loads(out.with_suffix(".json").read_text())
    made = report["checkpoints"][0]["made"]
    assert made["bytes"] > 100_000 and made["peak_rss_gb"] > 0.05
    r = report["runs"][0]
    assert r["heads"] == str(tmp_path / "s" / "tiny-heads") and r["artifact_bytes"] > 100_000
    names = [s["name"] for s in r["stages"]]
    assert names[0] == f"opening {tmp_path / 's' / 'tiny'}" and names[-1] == "after the last stage"
    assert any("writing the graphs from the checkpoint" in n for n in names) and all(s["finished"] for s in r["stages"])
    assert 0.1 < r["peak_rss_gb"] <= r["vmhwm_gb"] + 0.05
    if not be.GNU_TIME.is_file():  # everything above is checked; what GNU time reports needs it
        skip_or_fail_in_ci(f"{be.GNU_TIME} (GNU time, apt package 'time') is missing: its max RSS is not checked")
    assert abs(r["time_v_max_rss_gb"] - r["vmhwm_gb"]) < 0.05
