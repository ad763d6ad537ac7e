#!/usr/bin/env python
"""Where a decode step's time goes, by tree size: the step graph timed alone against the same step inside the
decode loop, the heads, and the host's work.

    python scripts/bench_step_overhead.py ARTIFACT [--sizes 1 2 4 8] [--prompts 3] [--max-new-tokens 96] [--threads 2]

For each tree size the decode loop (:class:`medusa_runtime.decode.loop.Decoding`, driven here exactly as
:func:`~medusa_runtime.decode.loop.generate` drives it) decodes ``--prompts`` MT-Bench first turns, timing each
phase of each step:

* ``step in loop``: the engine call (feeds, the graph, outputs), as ``generate`` times it;
* ``heads``: the heads call(s) for the next step's candidates;
* ``host``: the rest (tree buffers, acceptance, KV compaction, stops, candidate choice).

Then the same step is timed alone (:func:`medusa_runtime.tuning.autotree.time_tree_steps`: the tree's real mask and
positions after the loop's mean past length, warmed up, interleaved rounds, median), and ``unexplained`` is the step
in the loop minus the step alone: what running inside the loop adds to the engine call itself (caches evicted by
the heads and host work, thread-pool wake-ups, allocation). Figures are medians over steps (ms), with the host CPU,
date and load average. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_limit import host_record  # noqa: E402

from medusa_runtime.contract.artifact import load_artifact  # noqa: E402
from medusa_runtime.contract.tokenizer import RuntimeTokenizer  # noqa: E402
from medusa_runtime.decode.loop import Decoding, engine_step, run_heads  # noqa: E402
from medusa_runtime.engines.kvcache import KVCache  # noqa: E402
from medusa_runtime.engines.ort import OrtEngine  # noqa: E402
from medusa_runtime.front.prompts import mt_bench_questions, read_first_turns  # noqa: E402
from medusa_runtime.trees.tree import greedy_tree, make_tree  # noqa: E402
from medusa_runtime.tuning.autotree import time_tree_steps  # noqa: E402


def decode_timed(engine, ids, tree, max_new_tokens: int, eos) -> dict:
    """One generation with per-step phase times (s): lists ``step``, ``heads``, ``host`` (one entry per tree step,
    the prefill excluded) and ``past`` (the cache length before each step)."""
    cache = KVCache.for_engine(engine, len(ids) + max_new_tokens + tree.size + 1)
    try:
        dec = Decoding(engine, ids, tree, max_new_tokens=max_new_tokens, cache=cache, eos_token_ids=eos)
        rec = {"step": [], "heads": [], "host": [], "past": []}
        while True:
            t0 = time.perf_counter()
            inputs = dec.inputs()
            if inputs is None:
                break
            prefill = not dec.prefilled
            past = cache.length
            t1 = time.perf_counter()
            out = engine_step(engine, inputs, cache.past())
            t2 = time.perf_counter()
            dec.advance(out)
            heads = 0.0
            while dec.heads_row is not None:
                h = time.perf_counter()
                dec.set_heads(run_heads(engine, dec.heads_row, dec.heads_call))
                heads += time.perf_counter() - h
            t3 = time.perf_counter()
            if not prefill:
                rec["step"].append(t2 - t1)
                rec["heads"].append(heads)
                rec["host"].append((t3 - t0) - (t2 - t1) - heads)
                rec["past"].append(past)
        rec["tokens"] = list(dec.result.tokens)
        return rec
    finally:
        cache.free()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("artifact")
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=15, help="timed runs of the step alone per size (median)")
    p.add_argument("--spin", action="store_true",
                   help="the step session's threads busy-wait (OrtEngine spin=True, the runtime's --spin); compare with "
                        "a run without it in another process")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    art = load_artifact(args.artifact)
    engine = OrtEngine(art, threads=args.threads, spin=args.spin)
    tok = RuntimeTokenizer.from_artifact(art)
    eos = list(tok.eos_token_ids)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}])
               for q in read_first_turns(mt_bench_questions(), args.prompts)]
    acc = art.head_accuracies
    trees = {n: (make_tree([], num_heads=engine.num_heads, topk=art.tree.topk) if n == 1
                 else greedy_tree(n, acc[: engine.num_heads], topk=art.tree.topk))
             for n in args.sizes}
    before = host_record()
    decode_timed(engine, prompts[0], trees[max(trees)], 16, eos)  # warm-up
    loop = {n: {"step": [], "heads": [], "host": [], "past": [], "tokens": 0} for n in trees}
    for ids in prompts:
        for n, tree in trees.items():  # interleaved: every size on each prompt in turn
            rec = decode_timed(engine, ids, tree, args.max_new_tokens, eos)
            for k in ("step", "heads", "host", "past"):
                loop[n][k] += rec[k]
            loop[n]["tokens"] += len(rec["tokens"])
    past = int(statistics.fmean(x for n in loop for x in loop[n]["past"]))
    alone, heads_alone = time_tree_steps(engine, trees, past_length=past, repeats=args.repeats, warmup=2)
    rows = []
    for n in trees:
        med = {k: 1e3 * statistics.median(loop[n][k]) for k in ("step", "heads", "host")}
        rows.append({"size": n, "graph_alone_ms": alone[n], "step_in_loop_ms": med["step"], "heads_ms": med["heads"],
                     "heads_alone_ms": heads_alone[n], "host_ms": med["host"],
                     "unexplained_ms": med["step"] - alone[n], "steps": len(loop[n]["step"]),
                     "tokens_per_step": loop[n]["tokens"] / max(1, len(loop[n]["step"]) + len(prompts))})
    after = host_record()
    print(f"{args.artifact}: {before['date']}, {before['cpu']}, {args.threads} threads"
          f"{' (spinning)' if args.spin else ''}, load average "
          f"{before['load_average'][0]:.2f} before / {after['load_average'][0]:.2f} after; mean past {past} tokens")
    print("| tree nodes | graph alone ms | step in loop ms | unexplained ms | heads ms (alone) | host ms | steps |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['size']} | {r['graph_alone_ms']:.2f} | {r['step_in_loop_ms']:.2f} | {r['unexplained_ms']:+.2f} | "
              f"{r['heads_ms']:.2f} ({r['heads_alone_ms']:.2f}) | {r['host_ms']:.2f} | {r['steps']} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"host_before": before, "host_after": after, "past": past,
                                               "rows": rows, "args": vars(args)}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
