#!/usr/bin/env python
"""Exact sampling vs typical acceptance on the same artifact, heads and tree (issue 17; docs/sampling.md).

    python scripts/compare_acceptance.py artifacts/smollm2-135m-t16-fp32 --prompts 20 --threads 2 \\
        --out docs/benchmark/acceptance.json

On MT-Bench first turns (chat template applied), at each ``--temperatures`` T, the runtime
generates with:

* ``plain``: plain sampling (the root-only tree: one token per step) - the reference law;
* ``sample``: Medusa with exact sampling acceptance (same tokens as ``plain`` seed by seed, so
  its drift numbers measure nothing but the method's noise floor);
* ``typical e=<epsilon>``: Medusa with typical acceptance (Medusa paper §2.3.1), epsilon swept
  (``--epsilons``), delta at its default.

All modes share top-k / top-p (``--top-k``, ``--top-p``; defaults: SamplingConfig's) and the seeds.
Reported per T and mode:

* speed: emitted tokens per tree step, and tokens/s (reply tokens over wall time, prefill included)
  over ``--seeds`` replies of ``--max-new-tokens`` per prompt;
* drift from plain sampling, on the same replies: the mean log-probability of the generated tokens
  under the backbone (temperature 1), the backbone's entropy (nats, temperature 1) at each
  generated position (mean, and by position in buckets of 16), distinct-n (n = 1, 2, 3: distinct
  n-grams over all n-grams of a reply, averaged over replies);
* the total-variation distance of next-token choices at matched prefixes: ``--matched-seeds`` short
  runs per prompt and mode (``--matched-depth`` tokens); for every prefix of the generated tokens
  seen at least ``--min-count`` times, TV between the empirical law of the next token and plain
  sampling's exact law there (the step's top-k outputs at that prefix, truncated as plain sampling
  truncates), averaged with the prefix counts as weights. ``sample`` gives the noise floor of this
  estimate at the same counts.

Writes a JSON report (``--out``) and prints a Markdown table for docs/sampling.md. Run it on a quiet
machine for the numbers; ``--prompts 1 --seeds 1 --max-new-tokens 16 --matched-seeds 8`` is a smoke run.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import sys
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

from medusa_runtime.decode.acceptance import SamplingConfig, truncated_probs
from medusa_runtime.engines.kvcache import KVCache
from medusa_runtime.decode.loop import causal_mask, generate
from medusa_runtime.front.prompts import mt_bench_questions, read_first_turns
from medusa_runtime.front.session import MedusaSession

DEFAULT_QUESTIONS = mt_bench_questions()  # $MEDUSA_EXPORT_SHARED, else ../shared
ENTROPY_BUCKET = 16


def modes(temperature: float, epsilons: list[float], top_k: int, top_p: float) -> dict[str, tuple[SamplingConfig, bool]]:
    """name -> (settings without the seed, vanilla) for one temperature."""
    base = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    out = {"plain": (base, True), "sample": (base, False)}
    for e in epsilons:
        out[f"typical e={e:g}"] = (SamplingConfig(temperature, "typical", top_k, top_p, posterior_threshold=e), False)
    return out


def score(session: MedusaSession, prompt: list[int], reply: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Log-probability (temperature 1) of each reply token given what precedes it, and the entropy
    (nats) of the backbone's distribution at each reply position: float64 [len(reply)] each."""
    seq = np.asarray(prompt + reply, np.int64)
    n = len(seq)
    engine = session.engine
    out = engine.step(seq[None], np.arange(n)[None], causal_mask(n), 1.0, KVCache.for_engine(engine, n).past())
    rows = np.arange(len(prompt) - 1, n - 1)  # the position that predicts reply token j
    return (np.asarray(out.token_logprobs, np.float64)[rows, rows + 1],
            np.asarray(out.entropy, np.float64)[rows])


def distinct_n(tokens: list[int], n: int) -> float:
    """Distinct n-grams / n-grams of one reply (0 when shorter than n)."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def speed_and_drift(session: MedusaSession, prompts: list[list[int]], cfg: SamplingConfig, vanilla: bool,
                    seeds: int, max_new_tokens: int) -> dict:
    """Full replies of one mode: speed, and the drift measures computed on them."""
    replies, steps, emitted, seconds, logps, entropy_by_pos = [], 0, 0, 0.0, [], defaultdict(list)
    for ids in prompts:
        for seed in range(seeds):
            c = session.generate(prompt_ids=ids, max_new_tokens=max_new_tokens, sampling=cfg, seed=seed,
                                 vanilla=vanilla)
            replies.append(c.token_ids)
            steps += c.result.steps
            emitted += sum(c.result.step_tokens)
            seconds += c.seconds
            if c.token_ids:
                lp, ent = score(session, ids, c.token_ids)
                logps.append(lp)
                for j, h in enumerate(ent):
                    entropy_by_pos[j // ENTROPY_BUCKET].append(h)
    tokens = sum(len(r) for r in replies)
    all_lp = np.concatenate(logps) if logps else np.zeros(0)
    return {
        "replies": len(replies), "tokens": tokens,
        "tokens_per_step": emitted / steps if steps else 1.0,
        "tokens_per_second": tokens / seconds if seconds else 0.0,
        "mean_logprob": float(all_lp.mean()) if all_lp.size else 0.0,
        "mean_entropy": float(np.mean([h for v in entropy_by_pos.values() for h in v])) if entropy_by_pos else 0.0,
        "entropy_by_position": {f"{ENTROPY_BUCKET * b}-{ENTROPY_BUCKET * (b + 1) - 1}": float(np.mean(v))
                                for b, v in sorted(entropy_by_pos.items())},
        **{f"distinct_{n}": float(np.mean([distinct_n(r, n) for r in replies])) if replies else 0.0
           for n in (1, 2, 3)},
    }


def matched_prefix_tv(session: MedusaSession, prompts: list[list[int]], cfg: SamplingConfig, vanilla: bool,
                      runs: int, depth: int, min_count: int) -> dict:
    """Count-weighted TV between each frequent prefix's empirical next-token law and plain sampling's exact one.

    Short runs reuse the prompt's K/V (the cache truncated to the prompt's first n - 1 tokens; the
    last is prefilled again), exactly as a fresh prefill would compute them.
    """
    engine, tree = session.engine, (session.vanilla_tree if vanilla else session.tree)
    total_tv, total_count, prefixes = 0.0, 0, 0
    for ids in prompts:
        cache = KVCache.for_engine(engine, session.max_context)
        nexts: dict[tuple, Counter] = defaultdict(Counter)
        for seed in range(runs):
            cache.truncate(min(cache.length, len(ids) - 1))
            r = generate(engine, ids[cache.length:], tree, max_new_tokens=depth, max_context=session.max_context,
                         sampling=dataclasses.replace(cfg, seed=seed), cache=cache)
            for j, tok in enumerate(r.tokens):
                nexts[tuple(r.tokens[:j])][tok] += 1
        frequent = {p: c for p, c in nexts.items() if sum(c.values()) >= min_count}
        for prefix, counts in frequent.items():
            exact = exact_next(engine, cache, ids, list(prefix), cfg)
            n = sum(counts.values())
            support = set(counts) | set(exact)
            total_tv += n * 0.5 * sum(abs(counts.get(t, 0) / n - exact.get(t, 0.0)) for t in support)
            total_count += n
            prefixes += 1
    return {"tv": total_tv / total_count if total_count else float("nan"), "prefixes": prefixes,
            "samples": total_count}


def exact_next(engine, cache: KVCache, prompt: list[int], prefix: list[int], cfg: SamplingConfig) -> dict[int, float]:
    """Plain sampling's law of the next token after prompt + prefix: the step's top-k outputs at the last
    row, truncated as plain sampling truncates (``cache`` holds the prompt's K/V; it is left truncated)."""
    cache.truncate(len(prompt) - 1)
    seq = np.asarray(prompt[-1:] + prefix, np.int64)
    n = len(seq)
    out = engine.step(seq[None], (cache.length + np.arange(n))[None], causal_mask(n), cfg.temperature, cache.past())
    p = truncated_probs(out.topk_logprobs[-1:], cfg.top_k, cfg.top_p)[0]
    return {int(t): float(q) for t, q in zip(out.topk_ids[-1], p) if q > 0}


def run(args) -> dict:
    session = MedusaSession(args.artifact, threads=args.threads, tree=args.tree)
    texts = read_first_turns(Path(args.questions), args.prompts)
    prompts = [session.encode(t) for t in texts]
    session.generate(prompt_ids=prompts[0], max_new_tokens=4)  # warm-up
    m = session.artifact.manifest
    report = {
        "date": dt.date.today().isoformat(), "model": m.model.name, "heads_source": m.model.heads_source,
        "artifact": str(args.artifact), "precision": m.precision_name, "backend": session.backend,
        "threads": args.threads, "tree": {"size": session.tree.size, "depth": session.tree.max_depth},
        "prompts": len(texts), "seeds": args.seeds, "max_new_tokens": args.max_new_tokens,
        "top_k": args.top_k, "top_p": args.top_p, "posterior_alpha": SamplingConfig.posterior_alpha,
        "matched": {"seeds": args.matched_seeds, "depth": args.matched_depth, "min_count": args.min_count},
        "results": {},
    }
    for t in args.temperatures:
        rows = {}
        for name, (cfg, vanilla) in modes(t, args.epsilons, args.top_k, args.top_p).items():
            row = speed_and_drift(session, prompts, cfg, vanilla, args.seeds, args.max_new_tokens)
            row["matched_prefix"] = matched_prefix_tv(session, prompts, cfg, vanilla, args.matched_seeds,
                                                      args.matched_depth, args.min_count)
            rows[name] = row
            print(f"T={t:g} {name:16s} {row['tokens_per_step']:.2f} tokens/step {row['tokens_per_second']:6.1f} tokens/s "
                  f"logp {row['mean_logprob']:.3f} H {row['mean_entropy']:.3f} TV {row['matched_prefix']['tv']:.3f}",
                  file=sys.stderr)
        report["results"][f"{t:g}"] = rows
    return report


def markdown(report: dict) -> str:
    """The table for docs/sampling.md."""
    lines = [f"{report['date']}: {report['model']} ({report['precision']}, {report['backend']}, "
             f"{report['threads'] or 'default'} threads), tree of {report['tree']['size']} nodes, {report['prompts']} "
             f"MT-Bench first turns x {report['seeds']} seeds x {report['max_new_tokens']} tokens; top-k "
             f"{report['top_k'] or 'off'}, top-p {report['top_p']:g}; matched prefixes: {report['matched']['seeds']} "
             f"runs of {report['matched']['depth']} tokens per prompt, prefixes seen >= {report['matched']['min_count']} times.",
             "",
             "| T | mode | tokens/step | tokens/s | mean log p | mean entropy | distinct-1/2/3 | TV at matched prefixes |",
             "|---|---|---|---|---|---|---|---|"]
    for t, rows in report["results"].items():
        for name, r in rows.items():
            mp = r["matched_prefix"]
            lines.append(f"| {t} | {name} | {r['tokens_per_step']:.2f} | {r['tokens_per_second']:.1f} | "
                         f"{r['mean_logprob']:.3f} | {r['mean_entropy']:.3f} | {r['distinct_1']:.3f} / "
                         f"{r['distinct_2']:.3f} / {r['distinct_3']:.3f} | {mp['tv']:.3f} ({mp['prefixes']} prefixes, "
                         f"{mp['samples']} draws) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("artifact", help="artifact directory (medusa-export build output)")
    p.add_argument("--questions", default=str(DEFAULT_QUESTIONS), help="MT-Bench question.jsonl")
    p.add_argument("--prompts", type=int, default=10, help="first turns of the first N questions (default: 10)")
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.3, 0.7, 1.0])
    p.add_argument("--epsilons", type=float, nargs="+", default=[0.05, 0.09, 0.2, 0.3],
                   help="typical acceptance thresholds to sweep (delta stays at its default)")
    p.add_argument("--top-k", type=int, default=SamplingConfig.top_k, help="top-k of every mode (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=SamplingConfig.top_p, help="top-p of every mode (default: %(default)s)")
    p.add_argument("--seeds", type=int, default=3, help="replies per prompt and mode (default: 3)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--matched-seeds", type=int, default=64, help="short runs per prompt and mode (default: 64)")
    p.add_argument("--matched-depth", type=int, default=4, help="tokens per short run (default: 4)")
    p.add_argument("--min-count", type=int, default=16, help="a prefix counts when seen this often (default: 16)")
    p.add_argument("--tree", help="tree override (default: the artifact's)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", help="write the JSON report here")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    report = run(args)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
