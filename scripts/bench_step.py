#!/usr/bin/env python
"""Step anatomy of an artifact on ONNX Runtime: backbone step time by tree size and past
length, the heads graph's share of a Medusa step, and output bytes per step compared
with returning full [T, V] logits.

Usage:
    python scripts/bench_step.py ARTIFACT [--sizes 1 4 16 64] [--past 256] [--repeats 20] [--threads 2] [--json OUT]

Prints a table; all times are medians over ``--repeats`` runs measured in this process.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from medusa_runtime.artifact import load_artifact
from medusa_runtime.autotree import median_ms
from medusa_runtime.loop import KVCache, causal_mask
from medusa_runtime.ort_engine import OrtEngine
from medusa_runtime.tree import default_accuracies, greedy_tree, make_tree


def _tree(size: int, heads: int):
    if size == 1:
        return make_tree([], num_heads=heads)
    return greedy_tree(size, default_accuracies(heads))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--past", type=int, default=256, help="past length (tokens) before the step")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    art = load_artifact(args.artifact)
    eng = OrtEngine(art, threads=args.threads)
    m = art.manifest
    vocab, hidden, k = m["model"]["vocab_size"], m["model"]["hidden_size"], m["step_topk"]
    cache = KVCache.for_engine(eng, args.past + max(args.sizes))
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, vocab, args.past, dtype=np.int64)
    out = eng.step(prompt[None], np.arange(args.past)[None], causal_mask(args.past), 1.0, cache.past())
    cache.keep(out.new_kv, np.arange(args.past))
    hidden_row = out.hidden[-1:]
    heads_ms = median_ms(lambda: eng.heads(hidden_row, art.tree.topk), args.repeats)
    kv_bytes_per_token = 2 * eng.num_layers * eng.num_kv_heads * eng.head_dim * np.dtype(eng.kv_dtype).itemsize

    rows = []
    for size in args.sizes:
        tree = _tree(size, eng.num_heads)
        b = tree.buffers()
        tokens = rng.integers(0, vocab, tree.size, dtype=np.int64)
        step_ms = median_ms(lambda: eng.step(tokens[None], (args.past + b.depth)[None], b.attention_mask, 1.0,
                                              cache.past()), args.repeats)
        t = tree.size
        out_bytes = t * k * 8 + t * k * 4 + t * 4 + t * t * 4 + t * hidden * np.dtype(eng.kv_dtype).itemsize + t * kv_bytes_per_token
        logits_bytes = t * vocab * 4 + t * hidden * np.dtype(eng.kv_dtype).itemsize + t * kv_bytes_per_token
        share = heads_ms / (step_ms + heads_ms) if t > 1 else 0.0
        rows.append({"tree_size": t, "step_ms": step_ms, "heads_ms": heads_ms if t > 1 else 0.0, "heads_share": share,
                     "output_bytes": int(out_bytes), "full_logits_output_bytes": int(logits_bytes)})

    print(f"artifact {args.artifact}: {m['model']['name']}, {m['precision']['name']}, past length {args.past}, "
          f"median of {args.repeats}")
    print(f"{'T':>4} {'step ms':>9} {'heads ms':>9} {'heads share':>12} {'out KB/step':>12} {'with [T,V] logits KB':>21}")
    for r in rows:
        print(f"{r['tree_size']:>4} {r['step_ms']:>9.2f} {r['heads_ms']:>9.2f} {r['heads_share']:>11.1%} "
              f"{r['output_bytes'] / 1024:>12.1f} {r['full_logits_output_bytes'] / 1024:>21.1f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"artifact": str(args.artifact), "past": args.past, "rows": rows}, fh, indent=2)


if __name__ == "__main__":
    main()
