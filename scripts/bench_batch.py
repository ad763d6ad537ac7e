#!/usr/bin/env python
"""Looped vs batched step graphs, side by side in one run: tokens/s at batch sizes 1, 2, 4 (issue 16 phase B).

    python scripts/bench_batch.py --batched-artifact artifacts/smollm2-135m-t16-fp32-b4 \\
        --artifact artifacts/smollm2-135m-t16-fp32 --prompts 8 --max-new-tokens 64 --threads 2

Two engines run the same prompts (MT-Bench first turns, chat template applied, greedy) through the
same in-flight scheduler (:class:`medusa_runtime.batch.Scheduler`) with at most B sequences per step:

* ``looped``: one batch-1 call per row per step (:class:`~medusa_runtime.batch.LoopedBatchEngine`),
  on ``--artifact`` (a batch-1 artifact: today's runtime) or, without it, on the batched artifact's
  graph run as a batch of one;
* ``batched``: one call over all running rows per step (:class:`~medusa_runtime.ort_batched.OrtBatchEngine`)
  on ``--batched-artifact`` (built with ``medusa-export build --batch-size N``).

For each B the two modes alternate ``--repeats`` times (so drift of a shared machine hits both) after
one warm-up run each. Printed per B and mode: total tokens/s (all reply tokens over the wall time of
the whole run, prefills included), per-sequence tokens/s (median over sequences of reply tokens over
that sequence's own time, admission to finish), mean tokens per tree step, and whether every reply is
token-identical to the looped run's (greedy: the batched graph must not change a token). ``--json``
writes the same as a dated record. Benchmarks belong on a quiet machine: the figures of a shared one
measure the neighbours.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import statistics
import sys
import time
from pathlib import Path

from medusa_runtime.batch import LoopedBatchEngine, Scheduler, SequenceRequest
from medusa_runtime.session import MedusaSession

DEFAULT_QUESTIONS = Path(__file__).resolve().parents[2] / "shared" / "data" / "eval" / "mt_bench" / "question.jsonl"


def read_first_turns(path: Path, n: int) -> list[str]:
    """The first user turn of the first ``n`` MT-Bench questions."""
    lines = [line for line in path.read_text().splitlines() if line.strip()][:n]
    return [json.loads(line)["turns"][0] for line in lines]


def run_once(engine, session: MedusaSession, prompt_ids: list[list[int]], max_new_tokens: int, batch: int) -> dict:
    """Every prompt through one scheduler of at most ``batch`` rows; tokens/s and each reply's token ids."""
    sched = Scheduler(engine, session.tree, max_batch=batch, capacity=session.max_context,
                      eos_token_ids=session.eos_token_ids)
    states = [sched.submit(SequenceRequest(ids, max_new_tokens, tag=i)) for i, ids in enumerate(prompt_ids)]
    t = time.perf_counter()
    sched.run()
    wall = time.perf_counter() - t
    for s in states:
        if s.error is not None:
            raise s.error
    tokens = sum(len(s.result.tokens) for s in states)
    steps = [n for s in states for n in s.result.step_tokens]
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "per_sequence_tokens_per_s": statistics.median(len(s.result.tokens) / s.seconds for s in states),
            "tokens_per_step": sum(steps) / max(len(steps), 1),
            "max_batch_seen": max(s.max_batch_seen for s in states), "ids": [s.result.tokens for s in states]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batched-artifact", required=True, help="an artifact built with --batch-size N (N > 1)")
    p.add_argument("--artifact", help="a batch-1 artifact of the same model for the looped mode (default: the "
                                      "batched artifact's graph as a batch of one)")
    p.add_argument("--batch-sizes", default="1,2,4", help="comma-separated B (default: %(default)s)")
    p.add_argument("--prompts", type=int, default=8, help="MT-Bench first turns (default: %(default)s)")
    p.add_argument("--questions", type=Path, default=DEFAULT_QUESTIONS, help="MT-Bench question.jsonl")
    p.add_argument("--max-new-tokens", type=int, default=64, help="reply tokens per prompt (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per B and mode (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None, help="ONNX Runtime intra-op threads")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    sizes = [int(b) for b in args.batch_sizes.split(",")]

    batched = MedusaSession(args.batched_artifact, threads=args.threads)
    if not batched.engine.max_batch or not hasattr(batched.engine, "step_rows"):
        p.error(f"{args.batched_artifact} is not a batched artifact (build it with --batch-size N)")
    looped_session = MedusaSession(args.artifact, threads=args.threads) if args.artifact else batched
    engines = {"looped": (LoopedBatchEngine(looped_session.engine), looped_session), "batched": (batched.engine, batched)}
    prompt_ids = [batched.encode(t) for t in read_first_turns(args.questions, args.prompts)]
    for name, (engine, session) in engines.items():  # warm-up: sessions, allocator, caches
        run_once(engine, session, prompt_ids[:1], 4, 1)

    rows = []
    for b in sizes:
        runs: dict[str, list[dict]] = {"looped": [], "batched": []}
        for _ in range(args.repeats):
            for name, (engine, session) in engines.items():
                runs[name].append(run_once(engine, session, prompt_ids, args.max_new_tokens, b))
        row = {"batch": b}
        for name, rs in runs.items():
            row[name] = {k: statistics.median(r[k] for r in rs)
                         for k in ("tokens_per_s", "per_sequence_tokens_per_s", "tokens_per_step", "wall_s")}
            row[name]["max_batch_seen"] = max(r["max_batch_seen"] for r in rs)
        row["identical"] = all(r["ids"] == runs["looped"][0]["ids"] for rs in runs.values() for r in rs)
        row["batched_over_looped"] = row["batched"]["tokens_per_s"] / row["looped"]["tokens_per_s"]
        rows.append(row)

    print(f"{len(prompt_ids)} prompts x {args.max_new_tokens} tokens, greedy, threads {args.threads or 'default'}; "
          f"looped on {args.artifact or args.batched_artifact}, batched on {args.batched_artifact}")
    print(f"{'B':>3} | {'looped tok/s':>12} | {'batched tok/s':>13} | {'batched/looped':>14} | "
          f"{'per-seq looped':>14} | {'per-seq batched':>15} | {'tok/step':>8} | identical")
    for r in rows:
        lo, ba = r["looped"], r["batched"]
        print(f"{r['batch']:>3} | {lo['tokens_per_s']:>12.1f} | {ba['tokens_per_s']:>13.1f} | "
              f"{r['batched_over_looped']:>14.2f} | {lo['per_sequence_tokens_per_s']:>14.1f} | "
              f"{ba['per_sequence_tokens_per_s']:>15.1f} | {ba['tokens_per_step']:>8.2f} | {r['identical']}")
    if args.json:
        record = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                  "batched_artifact": str(args.batched_artifact), "artifact": args.artifact,
                  "prompts": len(prompt_ids), "max_new_tokens": args.max_new_tokens, "threads": args.threads,
                  "repeats": args.repeats, "rows": rows}
        args.json.write_text(json.dumps(record, indent=2) + "\n")
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
