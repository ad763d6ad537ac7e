#!/usr/bin/env python
"""Step anatomy of artifacts on ONNX Runtime: backbone step time by tree size and past
length, the heads' share of a Medusa step, output bytes per step compared with
returning full [T, V] logits, and (``--profile``) which operators take a step's time.

The heads column is what the decode loop runs before each step (:func:`medusa_runtime.decode.loop.proposer`):
one run of the Medusa heads graph, or the level graphs of path-conditioned heads (one run per
level), plus the host's choice of the tree for ``--policy dynamic`` (per-step trees of each size).

Usage:
    python scripts/bench_step.py ARTIFACT [ARTIFACT ...] [--sizes 1 4 16 64] [--past 256] [--repeats 20]
        [--threads 2] [--policy static|dynamic] [--json OUT] [--profile 1 16] [--profile-steps 10]

With several artifacts (e.g. the portable and the ``ort-fused`` graph of one model) the
measurements are interleaved: each repeat times one step of every (size, artifact) in turn,
so load from other processes hits them alike. Times are medians over ``--repeats`` runs
measured in this process. ``--profile`` runs ONNX Runtime's profiler over ``--profile-steps``
steps of each given size per artifact (after the timing, in separate sessions) and prints
the kernel time by operator type.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable, Hashable

import numpy as np

from medusa_runtime.contract.artifact import load_artifact
from medusa_runtime.trees.dynamic import DynamicTree
from medusa_runtime.engines.kvcache import KVCache
from medusa_runtime.engines.ort import OrtEngine
from medusa_runtime.decode.loop import causal_mask, proposer
from medusa_runtime.trees.tree import default_accuracies, greedy_tree, make_tree


def _tree(size: int, heads: int):
    if size == 1:
        return make_tree([], num_heads=heads)
    return greedy_tree(size, default_accuracies(heads))


def interleaved_ms(fns: dict[Hashable, Callable[[], object]], repeats: int, warmup: int = 1) -> dict[Hashable, float]:
    """Median wall time (ms) of each ``fn()``, timed round-robin: one run of every fn per repeat."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = defaultdict(list)
    for _ in range(repeats):
        for key, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t)
    return {key: 1e3 * statistics.median(v) for key, v in times.items()}


def op_shares(events: list[dict], runs: slice) -> tuple[list[tuple[str, float, float]], float, float]:
    """Kernel time by operator type over the selected ``model_run`` calls of an ONNX Runtime profile.

    Args:
        events: the profile's JSON events.
        runs: which ``model_run`` calls (in call order) to count.

    Returns:
        ([(op type, ms per run, share of the kernel time)] largest first, kernel ms per run,
        wall ms per run of the selected calls).
    """
    calls = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"][runs]
    if not calls:
        return [], 0.0, 0.0
    windows = [(c["ts"], c["ts"] + c["dur"]) for c in calls]
    by_op: dict[str, float] = defaultdict(float)
    for e in events:
        if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"):
            if any(a <= e["ts"] <= b for a, b in windows):
                by_op[e["args"]["op_name"]] += e["dur"]
    total = sum(by_op.values())
    n = len(calls)
    rows = sorted(((op, us / n / 1e3, us / total) for op, us in by_op.items()), key=lambda r: -r[1])
    return rows, total / n / 1e3, sum(b - a for a, b in windows) / n / 1e3


class _Bench:
    """One artifact's engine, a cache holding a real prefill of ``past`` random tokens, and its step closures."""

    def __init__(self, path: str, args, prompt: np.ndarray, profile_prefix: str | None = None):
        self.path = path
        self.art = load_artifact(path)
        self.eng = OrtEngine(self.art, threads=args.threads, profile_prefix=profile_prefix)
        self.cache = KVCache.for_engine(self.eng, args.past + max(args.sizes + (args.profile or [])))
        out = self.eng.step(prompt[None], np.arange(args.past)[None], causal_mask(args.past), 1.0, self.cache.past())
        self.cache.keep(out.new_kv, np.arange(args.past))
        self.hidden_row = out.hidden[-1:]
        self.past = args.past

    def step_fn(self, size: int, tokens: np.ndarray) -> Callable[[], object]:
        b = _tree(size, self.eng.num_heads).buffers()
        pos = (self.past + b.depth)[None]
        return lambda: self.eng.step(tokens[None], pos, b.attention_mask, 1.0, self.cache.past())

    def heads_fn(self, size: int, policy: str) -> Callable[[], object]:
        """The heads and candidate choice before a step of ``size`` nodes (a real hidden state, root token 0)."""
        topk = self.art.tree.topk
        tree = (DynamicTree(size, self.eng.num_heads, topk, calibration=self.art.calibration) if policy == "dynamic"
                else greedy_tree(size, default_accuracies(self.eng.num_heads, topk) if self.art.head_accuracies is None
                                 else self.art.head_accuracies[:, :topk], topk=topk))
        propose = proposer(self.eng, tree)
        return lambda: propose(self.hidden_row, 0)


def _rows(bench: _Bench, times: dict, sizes: list[int]) -> list[dict]:
    m = bench.art.manifest
    eng = bench.eng
    vocab, hidden, k = m.model.vocab_size, m.model.hidden_size, m.step_topk
    kv_bytes_per_token = 2 * eng.num_layers * eng.num_kv_heads * eng.head_dim * np.dtype(eng.kv_dtype).itemsize
    rows = []
    for t in sizes:
        step_ms = times[(bench.path, t)]
        heads_ms = times.get((bench.path, "heads", t), 0.0)
        out_bytes = t * k * 8 + t * k * 4 + t * 4 + t * t * 4 + t * hidden * np.dtype(eng.kv_dtype).itemsize + t * kv_bytes_per_token
        logits_bytes = t * vocab * 4 + t * hidden * np.dtype(eng.kv_dtype).itemsize + t * kv_bytes_per_token
        share = heads_ms / (step_ms + heads_ms) if t > 1 else 0.0
        rows.append({"tree_size": t, "step_ms": step_ms, "heads_ms": heads_ms if t > 1 else 0.0, "heads_share": share,
                     "output_bytes": int(out_bytes), "full_logits_output_bytes": int(logits_bytes)})
    return rows


def _profile(path: str, args, prompt: np.ndarray, vocab: int, folder: str) -> dict:
    """Profile ``--profile-steps`` steps of each ``--profile`` size on a fresh session of ``path``."""
    bench = _Bench(path, args, prompt, profile_prefix=str(Path(folder) / Path(path).name))
    rng = np.random.default_rng(1)
    warm, n = 2, args.profile_steps
    for size in args.profile:
        fn = bench.step_fn(size, rng.integers(0, vocab, _tree(size, bench.eng.num_heads).size, dtype=np.int64))
        for _ in range(warm + n):
            fn()
    events = json.loads(Path(bench.eng.step_session.end_profiling()).read_text())
    out = {}
    for j, size in enumerate(args.profile):
        first = 1 + j * (warm + n) + warm  # run 0 is the prefill
        rows, kernel_ms, wall_ms = op_shares(events, slice(first, first + n))
        out[size] = {"kernel_ms": kernel_ms, "wall_ms": wall_ms,
                     "ops": [{"op": op, "ms": ms, "share": sh} for op, ms, sh in rows]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifacts", nargs="+", metavar="ARTIFACT")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--past", type=int, default=256, help="past length (tokens) before the step")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--policy", choices=("static", "dynamic"), default="static",
                    help="time the heads for static trees or per-step trees of each size")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--profile", type=int, nargs="*", help="tree sizes to profile with ONNX Runtime's profiler")
    ap.add_argument("--profile-steps", type=int, default=10, help="profiled steps per size (after 2 warm-up steps)")
    args = ap.parse_args()

    benches = []
    prompt = None
    for path in args.artifacts:
        vocab = load_artifact(path).model.vocab_size
        if prompt is None:
            prompt = np.random.default_rng(0).integers(0, vocab, args.past, dtype=np.int64)
        benches.append(_Bench(path, args, prompt))
    rng = np.random.default_rng(0)
    fns = {}
    for size in args.sizes:
        tokens = rng.integers(0, vocab, _tree(size, benches[0].eng.num_heads).size, dtype=np.int64)
        for b in benches:  # the same tokens for every artifact
            fns[(b.path, size)] = b.step_fn(size, tokens)
    for b in benches:
        for size in args.sizes:
            if size > 1:
                fns[(b.path, "heads", size)] = b.heads_fn(size, args.policy)
    times = interleaved_ms(fns, args.repeats)

    report = {"past": args.past, "repeats": args.repeats, "threads": args.threads, "artifacts": []}
    for b in benches:
        m = b.art.manifest
        rows = _rows(b, times, args.sizes)
        report["artifacts"].append({"artifact": str(b.path), "flavour": m.flavour, "heads": b.art.head_type,
                                    "policy": args.policy, "rows": rows})
        print(f"artifact {b.path}: {m.model.name}, {m.precision_name}, flavour {m.flavour}, "
              f"{b.art.head_type} heads, {args.policy} trees, "
              f"past length {args.past}, median of {args.repeats}" + (" (interleaved)" if len(benches) > 1 else ""))
        print(f"{'T':>4} {'step ms':>9} {'heads ms':>9} {'heads share':>12} {'out KB/step':>12} {'with [T,V] logits KB':>21}")
        for r in rows:
            print(f"{r['tree_size']:>4} {r['step_ms']:>9.2f} {r['heads_ms']:>9.2f} {r['heads_share']:>11.1%} "
                  f"{r['output_bytes'] / 1024:>12.1f} {r['full_logits_output_bytes'] / 1024:>21.1f}")
    if len(benches) > 1:
        base = report["artifacts"][0]["rows"]
        for other in report["artifacts"][1:]:
            ratios = ", ".join(f"T={a['tree_size']}: {b_['step_ms'] / a['step_ms']:.2f}x" for a, b_ in zip(base, other["rows"]))
            print(f"step time of {other['artifact']} / {args.artifacts[0]}: {ratios}")
    del benches
    if args.profile:
        with tempfile.TemporaryDirectory() as folder:
            for entry in report["artifacts"]:
                prof = _profile(entry["artifact"], args, prompt, vocab, folder)
                entry["profile"] = prof
                for size, p in prof.items():
                    top = ", ".join(f"{o['op']} {o['share']:.1%}" for o in p["ops"][:8])
                    print(f"profile {entry['artifact']} T={size}: kernels {p['kernel_ms']:.2f} ms of {p['wall_ms']:.2f} "
                          f"ms per run; {top}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)


if __name__ == "__main__":
    main()
