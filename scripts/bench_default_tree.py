"""The README's flow, measured: the main job, then the README's ``generate`` with the default tree against
``--tree root`` (plain decoding) of the same artifact, side by side in one run.

    python scripts/bench_default_tree.py --build --repeats 5

Steps (each a real ``medusa-export`` process, as a user runs it):

1. ``--build``: the README's main job (``medusa-export build --model smollm2-135m --tree 64``), which times the
   tree sizes on this machine and caches the choice;
2. the cache: the record is removed, then ``generate`` runs twice: the first run must print the one-line
   timing notice, the second must not (it reuses the record);
3. ``repeats`` rounds of the README's ``generate`` with the default tree and with ``--tree root``, the order
   alternating per round; tokens/s as each run's summary line prints it (the reply's tokens over the
   generation's wall time, prefill included).

Prints each run, the medians and the ratio default / root. The cache folder is a temporary one (the user's is
not touched) unless ``--cache`` names one. Exit 1 when the notice or the cache did not behave.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARTIFACT = "artifacts/smollm2-135m-t64-fp32"
PROMPT = "Explain speculative decoding in two sentences."
SUMMARY = re.compile(r"([\d.]+) tokens/step; ([\d.]+) tokens/s \(\S+, Medusa tree of (\d+) nodes?"
                     r"(?: = plain decoding)? \(([^)]*)\)")


def run(argv: list[str], env: dict) -> tuple[str, str, float]:
    t = time.perf_counter()
    p = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode:
        sys.exit(f"{' '.join(argv)} failed ({p.returncode}):\n{p.stderr[-2000:]}")
    return p.stdout, p.stderr, time.perf_counter() - t


def generate(artifact: str, env: dict, tree: str | None) -> dict:
    argv = ["medusa-export", "generate", "--artifact", artifact, "--prompt", PROMPT] + (["--tree", tree] if tree else [])
    out, err, wall = run(argv, env)
    m = SUMMARY.search(err)
    if not m:
        sys.exit(f"no summary line in generate's output:\n{err[-2000:]}")
    return {"tokens_per_step": float(m[1]), "tokens_per_s": float(m[2]), "nodes": int(m[3]), "source": m[4],
            "wall_s": wall, "notice": next((line for line in err.splitlines() if line.startswith("timing tree sizes")), ""),
            "text": out}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifact", default=ARTIFACT, help=f"the artifact (default: the main job's, {ARTIFACT})")
    p.add_argument("--build", action="store_true", help="run the README's main job first (about 1-2 minutes)")
    p.add_argument("--repeats", type=int, default=5, help="rounds of default vs --tree root (default: 5)")
    p.add_argument("--cache", help="cache folder (default: a temporary one)")
    args = p.parse_args()

    env = dict(os.environ)
    env.pop("MEDUSA_EXPORT_TREE", None)
    env["MEDUSA_EXPORT_CACHE"] = args.cache or tempfile.mkdtemp(prefix="bench-default-tree-")
    ok = True
    if args.build:
        out, _, wall = run(["medusa-export", "build", "--model", "smollm2-135m", "--tree", "64", "--force"], env)
        print(f"main job: {wall:.0f} s")
        for line in out.splitlines():
            if line.startswith(("  tree:", "  on this machine", "        ")):
                print(line)
    records = list(Path(env["MEDUSA_EXPORT_CACHE"]).glob("trees/*.json"))
    if args.build and not records:
        print("FAIL: the build cached no timing")
        ok = False
    for r in records:
        r.unlink()
    first, second = generate(args.artifact, env, None), generate(args.artifact, env, None)
    print(f"cache: first run {'printed' if first['notice'] else 'did NOT print'} the notice: {first['notice']!r}")
    print(f"cache: second run {'did not print' if not second['notice'] else 'PRINTED'} it; tree source "
          f"{second['source']!r}")
    ok &= bool(first["notice"]) and not second["notice"] and second["source"] == "fastest here, cached"

    runs: dict[str, list[dict]] = {"default": [], "root": []}
    for i in range(args.repeats):
        order = ("default", "root") if i % 2 == 0 else ("root", "default")
        for name in order:
            r = generate(args.artifact, env, None if name == "default" else "root")
            runs[name].append(r)
            print(f"round {i + 1} {name:7s}: {r['nodes']:2d} node(s) ({r['source']}), {r['tokens_per_step']:.2f} "
                  f"tokens/step, {r['tokens_per_s']:.1f} tokens/s, process {r['wall_s']:.1f} s")
    med = {k: statistics.median(r["tokens_per_s"] for r in v) for k, v in runs.items()}
    same = all(a["text"] == b["text"] for a, b in zip(runs["default"], runs["root"]))
    print(f"\nmedian tokens/s: default ({runs['default'][0]['nodes']} node(s)) {med['default']:.1f}, --tree root "
          f"{med['root']:.1f}; ratio default/root {med['default'] / med['root']:.3f}; replies identical: {same}")
    return 0 if ok and same else 1


if __name__ == "__main__":
    sys.exit(main())
