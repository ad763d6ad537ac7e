#!/usr/bin/env python
"""The batch curve: vanilla vs Medusa tokens/s at batch sizes 1..16, tree chosen per B by measurement (issue 16).

    python scripts/bench_batch.py --artifacts artifacts/smollm2-135m-fused-fp32-b16 \\
        artifacts/smollm2-135m-fused-int4-b16 --trees 2,4,8,16 --prompts 8 --max-new-tokens 48 --threads 2

Each artifact (one per precision; the rows are labelled by its manifest's precision and graph) runs
the same greedy replies to MT-Bench first turns (chat template applied) through the in-flight
scheduler (:class:`medusa_runtime.decode.batch.Scheduler`) with at most B sequences per step, on its own
engine (one ONNX Runtime call over all running rows for an artifact built with ``--batch-size N``),
once per tree:

* ``vanilla``: the root-only tree, one token per step (plain greedy decoding through the same graph);
* Medusa with each tree of ``--trees`` (node budgets, presets or ``dynamic:T``, resolved with the
  artifact's calibrated head accuracies, as ``generate --tree`` resolves them): a sub-tree of the
  artifact's heads, so one artifact serves every tree size.

Per B the Medusa figure is the tree with the most total tokens/s (the best tree shrinks as B grows:
a step verifies B x T tokens). Each B uses ``max(--prompts, B)`` sequences (the first MT-Bench
questions), so every row of the batch is filled. Per B all modes alternate ``--repeats`` times, so
drift of a shared machine hits them alike, after one warm-up run each. Picking the best of several
trees from the same runs favours Medusa slightly (the maximum of noisy figures); the table lists
every tree, so the spread is visible.

Reported per artifact and B: total tokens/s (all reply tokens over the wall time of the whole run,
prefills included), per-sequence tokens/s (median over sequences of reply tokens over that
sequence's own time, admission to finish), tokens per tree step, the Medusa/vanilla ratio, and
whether every reply is token-identical to vanilla's (greedy Medusa is lossless; ``differs`` names the
engine and tree of any that is not). ``--looped`` also
runs every mode with one batch-1 call per row (:class:`~medusa_runtime.decode.batch.LoopedBatchEngine`: the
runtime before batched graphs) on the same graph as a batch of one, or on ``--looped-artifacts``
(batch-1 artifacts, one per ``--artifacts`` entry, same order), and reports batched/looped.

Written (``--out``, default docs/benchmark/<model>-batch.json): the JSON record, and beside it a
dated markdown table (.md) and a chart (.png: tokens/s vs B, vanilla vs Medusa per precision, and
the ratio). Exit status 1 when a reply differs from vanilla's (after writing). Benchmarks belong on a
quiet machine: the figures of a shared one measure the neighbours.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import sys
import time
from pathlib import Path

from medusa_runtime.decode.batch import LoopedBatchEngine, Scheduler, SequenceRequest
from medusa_runtime.front.prompts import mt_bench_questions, read_first_turns
from medusa_runtime.front.session import MedusaSession
from medusa_runtime.trees.treespec import tree_from_spec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_int4_ort import host_cpu  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_QUESTIONS = mt_bench_questions()  # $MEDUSA_EXPORT_SHARED, else ../shared
DEFAULT_SIZES = "1,2,4,8,16"
DEFAULT_TREES = "2,4,8,16"
METRICS = ("tokens_per_s", "per_sequence_tokens_per_s", "tokens_per_step", "wall_s")


def run_once(engine, session: MedusaSession, tree, prompt_ids: list[list[int]], max_new_tokens: int,
             batch: int) -> dict:
    """Every prompt through one scheduler of at most ``batch`` rows with ``tree``.

    Returns:
        ``tokens_per_s`` (all reply tokens / wall s), ``per_sequence_tokens_per_s`` (median over
        sequences of tokens / the sequence's admission-to-finish s), ``tokens_per_step`` (mean
        emitted tokens per tree step), ``wall_s``, ``tokens``, ``max_batch_seen`` and ``ids`` (each
        reply's token ids, prompt order).

    Raises:
        MedusaError: whatever ended a sequence (re-raised: a benchmark must not skip rows).
    """
    sched = Scheduler(engine, tree, max_batch=batch, capacity=session.max_context,
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


def artifact_label(session: MedusaSession) -> dict:
    """What a row is labelled by: the manifest's model, precision, step graph (``batch.graph``; for a batch-1
    artifact its ``flavour``) and built batch size (1 for a batch-1 artifact)."""
    m = session.artifact.manifest
    flavour = m.flavour or "portable"
    graph = (m.batch.graph if m.batch else None) or {"ort-fused": "fused"}.get(flavour, flavour)
    return {"model": m.model.name, "precision": m.precision_name, "graph": graph,
            "max_batch_size": int(m.batch.max_batch_size if m.batch else 1)}


def candidate_trees(session: MedusaSession, specs: list[str]) -> dict:
    """``{"vanilla": root-only tree, "T=<n>" (a node budget) or the spec (a preset, "dynamic:T", a JSON file's
    stem): tree, ...}``: ``specs`` resolved against the artifact's heads (its calibrated accuracies)."""
    art = session.artifact
    trees = {"vanilla": session.vanilla_tree}
    for spec in specs:
        tree = tree_from_spec(spec, num_heads=session.engine.num_heads, topk=art.tree.topk,
                              accuracies=art.head_accuracies, calibration=art.calibration)
        name = f"T={tree.size}" if spec.isdigit() else f"{Path(spec).stem if spec.endswith('.json') else spec}"
        if name in trees:
            raise ValueError(f"--trees names the tree {name!r} twice (or the root-only tree, which is vanilla)")
        trees[name] = tree
    return trees


def measure_artifact(path: str, looped_path: str | None, args) -> dict:
    """Every B, engine and tree of one artifact, side by side (see the module docstring)."""
    session = MedusaSession(path, threads=args.threads, max_context=args.max_context, tree="artifact")
    engines = {"batched": (session.batch_engine, session)}
    if args.looped or looped_path:
        looped = MedusaSession(looped_path, threads=args.threads, max_context=args.max_context,
                               tree="artifact") if looped_path else session
        engines["looped"] = (LoopedBatchEngine(looped.engine), looped)
    trees = candidate_trees(session, args.trees)
    questions = read_first_turns(args.questions, max(args.prompts, max(args.batch_sizes)))
    prompt_ids = [session.encode(q) for q in questions]
    for engine, sess in engines.values():  # warm-up: sessions, allocator, caches, each tree's shapes
        for tree in trees.values():
            run_once(engine, sess, tree, prompt_ids[:1], 4, 1)
    rows = []
    for b in args.batch_sizes:
        ids = prompt_ids[:max(args.prompts, b)]
        runs = {(e, t): [] for e in engines for t in trees}
        for _ in range(args.repeats):
            for (e, t), rs in runs.items():
                engine, sess = engines[e]
                rs.append(run_once(engine, sess, trees[t], ids, args.max_new_tokens, b))
        reference = runs[("batched", "vanilla")][0]["ids"]
        differs = [f"{e} {t}" for (e, t), rs in runs.items() if any(r["ids"] != reference for r in rs)]
        row = {"batch": b, "sequences": len(ids), "identical": not differs, "differs": differs}
        for e in engines:
            modes = {t: {k: statistics.median(r[k] for r in runs[(e, t)]) for k in METRICS}
                     | {"tree_size": trees[t].size, "max_batch_seen": max(r["max_batch_seen"] for r in runs[(e, t)])}
                     for t in trees}
            best = max((t for t in trees if t != "vanilla"), key=lambda t: modes[t]["tokens_per_s"])
            row[e] = {"vanilla": modes["vanilla"], "medusa": modes[best] | {"tree": best}, "trees": modes,
                      "medusa_over_vanilla": modes[best]["tokens_per_s"] / modes["vanilla"]["tokens_per_s"]}
        if "looped" in engines:
            row["batched_over_looped"] = {m: row["batched"][m]["tokens_per_s"] / row["looped"][m]["tokens_per_s"]
                                          for m in ("vanilla", "medusa")}
        rows.append(row)
        print(f"{path}: B={b} done ({row['batched']['medusa']['tree']} best, "
              f"Medusa/vanilla {row['batched']['medusa_over_vanilla']:.2f})", file=sys.stderr)
    return {"artifact": str(path), "looped_artifact": looped_path, **artifact_label(session),
            "trees": {t: {"size": tree.size, "depth": tree.max_depth} for t, tree in trees.items()}, "rows": rows}


def markdown(report: dict) -> str:
    """The dated markdown tables: the curve (chosen tree per B) and every tree's tokens/s."""
    lines = [f"## Batch curve, {report['date'][:10]}", "",
             f"{report['model']}, {report['prompts']}+ first turns of {report.get('questions', 'MT-Bench')} "
             f"(at least B) x {report['max_new_tokens']} "
             f"greedy tokens, {report['threads'] or 'default'} threads, median of {report['repeats']} run(s); "
             f"Medusa: the best of trees {', '.join(report['tree_specs'])} at each B. Measured {report['date']} on "
             f"{report.get('host_cpu', 'an unrecorded CPU')}, load average (1/5/15 min) "
             f"{report.get('load_average_before', '?')} before, {report.get('load_average_after', '?')} after.", "",
             "| precision | graph | B | seqs | vanilla tok/s | Medusa tok/s | tree | Medusa/vanilla | "
             "vanilla tok/s/seq | Medusa tok/s/seq | Medusa tok/step | identical |",
             "|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---|"]
    for a in report["artifacts"]:
        for r in a["rows"]:
            v, m = r["batched"]["vanilla"], r["batched"]["medusa"]
            lines.append(f"| {a['precision']} | {a['graph']} | {r['batch']} | {r['sequences']} | "
                         f"{v['tokens_per_s']:.1f} | {m['tokens_per_s']:.1f} | {m['tree']} | "
                         f"{r['batched']['medusa_over_vanilla']:.2f} | {v['per_sequence_tokens_per_s']:.1f} | "
                         f"{m['per_sequence_tokens_per_s']:.1f} | {m['tokens_per_step']:.2f} | "
                         f"{'yes' if r['identical'] else 'NO: ' + ', '.join(r['differs'])} |")
    lines += ["", "Total tokens/s of every tree (batched engine):", ""]
    names = list(report["artifacts"][0]["trees"])
    lines += ["| precision | B | " + " | ".join(names) + " |", "|---|---:|" + "---:|" * len(names)]
    for a in report["artifacts"]:
        for r in a["rows"]:
            cells = [f"{r['batched']['trees'][n]['tokens_per_s']:.1f}" if n in r["batched"]["trees"] else "-"
                     for n in names]
            lines.append(f"| {a['precision']} | {r['batch']} | " + " | ".join(cells) + " |")
    if any("looped" in r for a in report["artifacts"] for r in a["rows"]):
        lines += ["", "Looped (one batch-1 call per row) vs batched (one call for all rows), total tokens/s:", "",
                  "| precision | B | looped vanilla | batched vanilla | batched/looped | looped Medusa | "
                  "batched Medusa | batched/looped |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for a in report["artifacts"]:
            for r in a["rows"]:
                lo, ba, q = r["looped"], r["batched"], r["batched_over_looped"]
                lines.append(f"| {a['precision']} | {r['batch']} | {lo['vanilla']['tokens_per_s']:.1f} | "
                             f"{ba['vanilla']['tokens_per_s']:.1f} | {q['vanilla']:.2f} | "
                             f"{lo['medusa']['tokens_per_s']:.1f} ({lo['medusa']['tree']}) | "
                             f"{ba['medusa']['tokens_per_s']:.1f} ({ba['medusa']['tree']}) | {q['medusa']:.2f} |")
    return "\n".join(lines) + "\n"


def chart(report: dict, path: Path) -> None:
    """Three panels over B (log 2): total tokens/s, per-sequence tokens/s, Medusa/vanilla ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(15, 4.4))
    for i, a in enumerate(report["artifacts"]):
        color, label = f"C{i}", f"{a['precision']} {a['graph']}"
        bs = [r["batch"] for r in a["rows"]]
        for j, key in enumerate(("tokens_per_s", "per_sequence_tokens_per_s")):
            ax[j].plot(bs, [r["batched"]["vanilla"][key] for r in a["rows"]], "o--", color=color,
                       label=f"{label}, vanilla")
            ax[j].plot(bs, [r["batched"]["medusa"][key] for r in a["rows"]], "o-", color=color,
                       label=f"{label}, Medusa")
        ratios = [r["batched"]["medusa_over_vanilla"] for r in a["rows"]]
        ax[2].plot(bs, ratios, "o-", color=color, label=label)
        for b, q, r in zip(bs, ratios, a["rows"]):
            ax[2].annotate(r["batched"]["medusa"]["tree"], (b, q), textcoords="offset points", xytext=(0, 6),
                           ha="center", fontsize="x-small", color=color)
    ax[2].axhline(1.0, color="grey", lw=0.8)
    ax[2].margins(y=0.15)
    titles = ("total tokens/s", "tokens/s per sequence (median)", "Medusa / vanilla (label: chosen tree)")
    for a_, title, ylabel in zip(ax, titles, ("tokens/s", "tokens/s", "ratio")):
        a_.set_xscale("log", base=2)
        a_.set_xticks(report["batch_sizes"], [str(b) for b in report["batch_sizes"]])
        a_.set(title=title, xlabel="batch size B (sequences per step)", ylabel=ylabel, ylim=(0, None))
        a_.legend(fontsize="x-small")
    fig.suptitle(f"{report['model']} · onnxruntime CPU · {report['threads'] or 'default'} threads · "
                 f"{report['max_new_tokens']} tokens · {report['date'][:10]}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def positive_ints(text: str) -> list[int]:
    """``"1,2,4"`` -> [1, 2, 4] (argparse type; each >= 1)."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every batch size must be >= 1")
    return values


def tree_specs(text: str) -> list[str]:
    """``"2,4,dynamic:8"`` -> ["2", "4", "dynamic:8"] (argparse type; each once, no root-only tree)."""
    specs = [t.strip() for t in text.split(",") if t.strip()]
    if not specs or len(set(specs)) != len(specs) or {"root", "1"} & set(specs):
        raise argparse.ArgumentTypeError(f"{text!r}: give each Medusa tree once (vanilla, the root-only tree, "
                                         "always runs)")
    return specs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--artifacts", nargs="+", required=True,
                   help="artifacts to measure, one per precision (best built with --batch-size 16)")
    p.add_argument("--looped-artifacts", nargs="+",
                   help="batch-1 artifacts for the looped mode, one per --artifacts entry (implies --looped)")
    p.add_argument("--looped", action="store_true",
                   help="also run one batch-1 call per row (the runtime before batched graphs)")
    p.add_argument("--batch-sizes", type=positive_ints, default=DEFAULT_SIZES, help="comma-separated B (default: %(default)s)")
    p.add_argument("--trees", type=tree_specs, default=DEFAULT_TREES,
                   help="comma-separated Medusa trees to choose from per B (default: %(default)s)")
    p.add_argument("--prompts", type=int, default=8,
                   help="MT-Bench first turns per B, at least B are used (default: %(default)s)")
    p.add_argument("--questions", type=Path, default=DEFAULT_QUESTIONS, help="MT-Bench question.jsonl")
    p.add_argument("--max-new-tokens", type=int, default=48, help="reply tokens per prompt (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per B, engine and tree (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None, help="ONNX Runtime intra-op threads")
    p.add_argument("--max-context", type=int, default=None,
                   help="KV slots per sequence (default: the artifact's; less memory at B = 16)")
    p.add_argument("--out", type=Path, help="JSON record (default: docs/benchmark/<model>-batch.json); the .md "
                                            "table and .png chart are written beside it")
    args = p.parse_args(argv)
    if min(args.prompts, args.repeats, args.max_new_tokens) < 1:
        p.error("--prompts, --repeats and --max-new-tokens must be >= 1")
    if args.looped_artifacts and len(args.looped_artifacts) != len(args.artifacts):
        p.error(f"--looped-artifacts has {len(args.looped_artifacts)} entries for {len(args.artifacts)} --artifacts")
    looped = args.looped_artifacts or [None] * len(args.artifacts)

    date = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    load_before = [round(x, 2) for x in os.getloadavg()]
    measured = [measure_artifact(a, lo, args) for a, lo in zip(args.artifacts, looped)]
    report = {"date": date, "model": measured[0]["model"], "backend": "onnxruntime", "threads": args.threads,
              "max_context": args.max_context,
              "cpu_count": os.cpu_count(), "prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
              "repeats": args.repeats, "batch_sizes": args.batch_sizes, "tree_specs": args.trees,
              "questions": str(args.questions), "host_cpu": host_cpu(), "load_average_before": load_before,
              "load_average_after": [round(x, 2) for x in os.getloadavg()], "artifacts": measured}
    out = args.out or ROOT / "docs" / "benchmark" / f"{report['model']}-batch.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    table = markdown(report)
    out.write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(table)
    chart(report, out.with_suffix(".png"))
    print(table)
    print(f"wrote {out}, {out.with_suffix('.md')} and {out.with_suffix('.png')}")
    return 0 if all(r["identical"] for a in measured for r in a["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
