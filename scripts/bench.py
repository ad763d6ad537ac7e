#!/usr/bin/env python
"""Vanilla vs Medusa on the same artifact and runtime, side by side, over MT-Bench first turns.

    python scripts/bench.py artifacts/smollm2-135m-t16-fp32 --prompts 5 --threads 2
    python scripts/bench.py ART --backend tensorrt --device-id 0     # a GPU machine (never run on one yet)

``--backend`` picks the medusa_runtime engine (onnxruntime, onnxruntime-cuda, tensorrt, or torch: the
PyTorch reference on the artifact's source weights, for machines with PyTorch and CUDA but neither TensorRT
nor onnxruntime-gpu; medusa_export.validation.torch_backend); vanilla and Medusa always share it. CI runs
``--backend tensorrt`` only against the EMULATED TensorRT (tests/test_trt_emulated.py), whose timings mean
nothing; its report names the backend "tensorrt (emulated)".

For each prompt (chat template applied) the runtime generates ``--max-new-tokens`` greedy
tokens twice, one token per step (vanilla: the root-only tree) and with the Medusa tree,
through the same engine. Reported (JSON + PNG chart):

* median tokens/s of each mode (reply tokens over wall time, prefill included) and the
  speedup ratio Medusa / vanilla; whether the two outputs are identical (greedy is lossless);
* mean accepted tokens per tree step, and the accept rate per tree depth (the fraction of
  tree steps that accepted at least d candidates, d = 1 .. depth);
* step time split into engine work (graph runs) and host work (everything else in the
  loop: candidates, acceptance, KV compaction, stops), per step and as a share;
* how a step's time grows with the context: one tree step and one vanilla step timed at
  past lengths ``--past-lengths`` (medians of ``--repeats`` runs), and the heads graph;
* plain transformers ``generate`` (greedy, same prompt ids and threads) as the outside
  reference; skipped with a note when it cannot run (e.g. the backbone is not on disk).

Only the transformers reference imports torch, after every runtime measurement. Both sides
wait passively for work (ONNX Runtime without spinning threads unless ``--spin``; OpenMP with
``OMP_WAIT_POLICY=PASSIVE`` unless set): on the shared 2-core machines here, busy-waiting
threads made steps up to 2-5x slower whenever other processes ran.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from medusa_export.trt.emulation import backend_label  # "tensorrt (emulated)" on the test double
from medusa_runtime.engines.kvcache import KVCache
from medusa_runtime.decode.loop import causal_mask, proposer
from medusa_runtime.front.prompts import mt_bench_questions, read_first_turns
from medusa_runtime.engines import BACKENDS, DEFAULT_BACKEND
from medusa_runtime.front.session import MedusaSession

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read when torch's OpenMP starts (transformers reference)

DEFAULT_QUESTIONS = mt_bench_questions()  # $MEDUSA_EXPORT_SHARED, else ../shared


def accept_rates(depths: list[int], max_depth: int) -> list[float]:
    """Fraction of tree steps that accepted >= d candidates, for d = 1 .. max_depth."""
    if not depths:
        return [0.0] * max_depth
    d = np.asarray(depths)
    return [float((d >= k).mean()) for k in range(1, max_depth + 1)]


def summarize(runs: list, max_depth: int) -> dict:
    """Aggregate the Completions of one mode."""
    steps = sum(c.result.steps for c in runs)
    engine = sum(c.result.engine_seconds - c.result.prefill_seconds for c in runs)
    host = sum(c.result.host_seconds for c in runs)
    depths = [d for c in runs for d in c.result.accept_depths]
    tps = [c.tokens_per_second for c in runs]
    return {
        "tokens_per_second": tps,
        "median_tokens_per_second": statistics.median(tps),
        "new_tokens": [len(c.token_ids) for c in runs],
        "mean_tokens_per_step": float(np.mean([t for c in runs for t in c.result.step_tokens])) if steps else 0.0,
        "accept_rate_per_depth": accept_rates(depths, max_depth),
        "steps": steps,
        "engine_ms_per_step": 1e3 * engine / max(steps, 1),
        "host_ms_per_step": 1e3 * host / max(steps, 1),
        "host_share": host / (engine + host) if engine + host else 0.0,
        "prefill_seconds": [c.result.prefill_seconds for c in runs],
    }


def time_steps(session: MedusaSession, past_lengths: list[int], repeats: int) -> dict:
    """Wall time (ms, median and best of ``repeats``) of one engine step, tree and vanilla, at each
    past length; and the heads graph."""
    engine = session.engine
    tree = session.tree
    shape = tree.static_shape()
    b = shape.buffers()  # a per-step tree is timed on a fixed tree of its size: the same shapes
    cap = session.max_context
    cache = KVCache.for_engine(engine, cap)
    rng = np.random.default_rng(0)
    # Realistic K/V: the cache of a real prefill over random tokens, long enough for every length.
    longest = min(max(past_lengths), cap - tree.size)
    ids = rng.integers(0, session.tokenizer.vocab_size, longest, dtype=np.int64)
    if longest:
        out = engine.step(ids[None], np.arange(longest)[None], causal_mask(longest), 1.0, cache.past())
        cache.keep(out.new_kv, np.arange(longest), ids)
    points = [p for p in past_lengths if p + tree.size <= cap]
    kinds = {"tree_step": (tree.size, b.depth, b.attention_mask),
             "vanilla_step": (1, np.zeros(1, np.int64), causal_mask(1))}
    times = {(p, k): [] for p in points for k in kinds}
    full = cache.length
    for r in range(repeats + 1):  # round-robin over every point, so load drifts hit all alike; run 0 warms up
        for p in points:
            for name, (t, depth, mask) in kinds.items():
                tokens = rng.integers(0, session.tokenizer.vocab_size, t, dtype=np.int64)[None]
                cache.length = p  # the first p slots hold a real prefill's K/V; only timing reads them
                past = cache.past()
                cache.length = full
                start = time.perf_counter()
                engine.step(tokens, (p + depth)[None], mask, 1.0, past)
                if r:
                    times[(p, name)].append(time.perf_counter() - start)
    rows = []
    for p in points:
        row = {"past_length": p}
        for name in kinds:
            row[f"{name}_ms"] = 1e3 * statistics.median(times[(p, name)])
            row[f"{name}_min_ms"] = 1e3 * min(times[(p, name)])
        rows.append(row)
    one = KVCache.for_engine(engine, 1)
    hidden = engine.step(np.ones((1, 1), np.int64), np.zeros((1, 1), np.int64), causal_mask(1), 1.0, one.past()).hidden
    heads = []
    propose = proposer(engine, tree)  # the heads as the loop runs them, with the per-step tree choice
    for _ in range(repeats + 1):
        start = time.perf_counter()
        propose(hidden[0:1], 0)
        heads.append(time.perf_counter() - start)
    for c in (one, cache):  # a device backend's caches hold device memory until freed
        c.free()
    return {"tree_size": tree.size, "by_past_length": rows, "heads_ms": 1e3 * statistics.median(heads[1:])}


def load_transformers_model(model_name: str, threads: int | None):
    """The registered backbone as a transformers model, fp32, eval mode (imports torch).

    Loaded as our exporter loads it (:func:`medusa_export.loading.transformers_twin.load_transformers_model`:
    the registry's loader, its tensors in the family's transformers model).
    """
    import torch

    from medusa_export.loading.backbone import align_parameters
    from medusa_export.loading.transformers_twin import load_transformers_model as load_twin

    if threads:
        torch.set_num_threads(threads)
    model, _ = load_twin(model_name, dtype=torch.float32)
    align_parameters(model)  # GEMMs on the GGUF loader's unaligned tensors crawl
    return model


def transformers_reference(model_name: str, prompt_ids: list[list[int]], max_new_tokens: int,
                           threads: int | None, eos: list[int]) -> dict:
    """Plain transformers greedy ``generate`` on the same prompt ids (imports torch)."""
    import torch

    model = load_transformers_model(model_name, threads)
    tps, outputs = [], []
    for ids in prompt_ids:
        x = torch.tensor([ids])
        with torch.no_grad():
            model.generate(x, max_new_tokens=4, do_sample=False, eos_token_id=eos, pad_token_id=eos[0])  # warm-up
            start = time.perf_counter()
            out = model.generate(x, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                                 pad_token_id=eos[0])
            seconds = time.perf_counter() - start
        new = [int(t) for t in out[0, len(ids):] if int(t) not in eos]
        outputs.append(new)
        tps.append(len(new) / seconds)
    return {"tokens_per_second": tps, "median_tokens_per_second": statistics.median(tps), "outputs": outputs}


def chart(report: dict, path: Path) -> None:
    """Three panels: tokens/s per prompt, accept rate per depth, step time vs past length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    modes = [("vanilla", report["vanilla"]), ("Medusa", report["medusa"])]
    if "tokens_per_second" in report.get("transformers", {}):
        modes.append(("transformers", report["transformers"]))
    n = len(report["prompts"])
    width = 0.8 / len(modes)
    for i, (name, m) in enumerate(modes):
        ax[0].bar(np.arange(n) + i * width, m["tokens_per_second"], width, label=name)
    ax[0].set_xticks(np.arange(n) + width * (len(modes) - 1) / 2, [str(i + 1) for i in range(n)])
    ax[0].set(title=f"tokens/s per prompt (speedup {report['speedup']:.2f}x)", xlabel="MT-Bench prompt",
              ylabel="tokens/s")
    ax[0].legend(loc="lower left", fontsize="small")
    rates = report["medusa"]["accept_rate_per_depth"]
    ax[1].bar(np.arange(1, len(rates) + 1), rates)
    ax[1].set_xticks(np.arange(1, len(rates) + 1))
    ax[1].set(title=f"accept rate per depth ({report['medusa']['mean_tokens_per_step']:.2f} tokens/step)",
              xlabel="tree depth", ylabel="fraction of steps", ylim=(0, 1))
    rows = report["step_time"]["by_past_length"]
    past = [r["past_length"] for r in rows]
    for key, label, color in (("tree_step", f"tree step (T={report['step_time']['tree_size']})", "C0"),
                              ("vanilla_step", "vanilla step (T=1)", "C1")):
        ax[2].plot(past, [r[f"{key}_ms"] for r in rows], "o-", color=color, label=f"{label}, median")
        ax[2].plot(past, [r[f"{key}_min_ms"] for r in rows], "o--", color=color, alpha=0.6, label=f"{label}, best")
    ax[2].set(title="step time vs context", xlabel="past length (tokens)", ylabel="ms", ylim=(0, None))
    ax[2].legend(loc="lower right", fontsize="small")
    fig.suptitle(f"{report['model']} · {report['backend']} · {report['threads'] or 'default'} threads · "
                 f"heads: {report['heads_source'].split(' (')[0]}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run(args) -> dict:
    device = {} if args.device_id is None else {"device_id": args.device_id}
    if args.backend == "torch" and args.model_path:
        device["model_path"] = args.model_path
    session = MedusaSession(args.artifact, backend=args.backend, threads=args.threads, tree=args.tree,
                            spin=args.spin, **device)
    try:
        return _run(session, args)
    finally:
        session.close()  # frees a device backend's memory


def _run(session: MedusaSession, args) -> dict:
    texts = read_first_turns(Path(args.questions), args.prompts)
    prompt_ids = [session.encode(t) for t in texts]
    session.generate(prompt_ids=prompt_ids[0], max_new_tokens=8)  # warm-up
    vanilla, medusa = [], []
    for i, ids in enumerate(prompt_ids):
        vanilla.append(session.generate(prompt_ids=ids, max_new_tokens=args.max_new_tokens, vanilla=True))
        medusa.append(session.generate(prompt_ids=ids, max_new_tokens=args.max_new_tokens))
        print(f"prompt {i + 1}/{len(texts)}: vanilla {vanilla[-1].tokens_per_second:.1f} tokens/s, Medusa "
              f"{medusa[-1].tokens_per_second:.1f} tokens/s, {medusa[-1].tokens_per_step:.2f} tokens/step",
              file=sys.stderr)
    m = session.artifact.manifest
    report = {
        "model": m.model.name, "heads_source": m.model.heads_source, "artifact": str(args.artifact),
        "precision": m.precision_name, "backend": backend_label(session.backend), "threads": args.threads, "spin": args.spin,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "tree": {"size": session.tree.size, "depth": session.tree.max_depth,
                 "medusa_choices": [list(c) for c in getattr(session.tree, "choices", ())],
                 "policy": session.tree.policy},
        "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "prompts": texts,
        "vanilla": summarize(vanilla, session.tree.max_depth),
        "medusa": summarize(medusa, session.tree.max_depth),
        "identical_outputs": sum(v.token_ids == c.token_ids for v, c in zip(vanilla, medusa)),
    }
    report["speedup"] = report["medusa"]["median_tokens_per_second"] / report["vanilla"]["median_tokens_per_second"]
    report["step_time"] = time_steps(session, args.past_lengths, args.repeats)
    if args.transformers:
        try:
            ref = transformers_reference(report["model"], prompt_ids, args.max_new_tokens, args.threads,
                                         session.eos_token_ids)
            ref["identical_to_runtime"] = sum(o == v.token_ids for o, v in zip(ref.pop("outputs"), vanilla))
            report["transformers"] = ref
        except Exception as exc:  # an outside reference: report, do not fail the benchmark
            report["transformers"] = {"skipped": f"{type(exc).__name__}: {exc}"}
    else:
        report["transformers"] = {"skipped": "--no-transformers"}
    return report


def print_table(r: dict) -> None:
    v, m = r["vanilla"], r["medusa"]
    print(f"\n{r['model']} ({r['precision']}, {r['backend']}, {r['threads'] or 'default'} threads), tree of "
          f"{r['tree']['size']} nodes, {len(r['prompts'])} MT-Bench prompts x {r['max_new_tokens']} tokens")
    print(f"{'':26s}{'vanilla':>10s}{'Medusa':>10s}")
    print(f"{'median tokens/s':26s}{v['median_tokens_per_second']:10.1f}{m['median_tokens_per_second']:10.1f}"
          f"   speedup {r['speedup']:.2f}x")
    print(f"{'tokens per step':26s}{v['mean_tokens_per_step']:10.2f}{m['mean_tokens_per_step']:10.2f}")
    print(f"{'engine ms / step':26s}{v['engine_ms_per_step']:10.1f}{m['engine_ms_per_step']:10.1f}")
    print(f"{'host ms / step':26s}{v['host_ms_per_step']:10.2f}{m['host_ms_per_step']:10.2f}")
    print(f"{'host share':26s}{100 * v['host_share']:9.1f}%{100 * m['host_share']:9.1f}%")
    print("accept rate per depth:", ", ".join(f"d{i + 1} {a:.2f}" for i, a in enumerate(m["accept_rate_per_depth"])))
    print(f"identical outputs: {r['identical_outputs']}/{len(r['prompts'])}")
    st = r["step_time"]
    print(f"step time (ms, median / best of {r['repeats']}) by past length:")
    for row in st["by_past_length"]:
        print(f"  {row['past_length']:5d}: tree (T={st['tree_size']}) {row['tree_step_ms']:6.1f} / "
              f"{row['tree_step_min_ms']:6.1f}   vanilla {row['vanilla_step_ms']:6.1f} / "
              f"{row['vanilla_step_min_ms']:6.1f}")
    print(f"  heads graph: {st['heads_ms']:.1f}")
    t = r["transformers"]
    print("transformers generate:", f"{t['median_tokens_per_second']:.1f} tokens/s (median), same tokens as the "
          f"runtime on {t['identical_to_runtime']}/{len(r['prompts'])}" if "tokens_per_second" in t else t["skipped"])


def main(argv: list[str] | None = None) -> int:
    from medusa_export.validation import torch_backend

    torch_backend.register()  # --backend torch: the PyTorch reference (CUDA with --device-id, else the CPU)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("artifact", help="artifact directory (medusa-export build output)")
    p.add_argument("--prompts", type=int, default=5, help="MT-Bench first turns to use (default: 5)")
    p.add_argument("--questions", default=str(DEFAULT_QUESTIONS), help="MT-Bench question.jsonl")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per reply (default: 128)")
    p.add_argument("--threads", type=int, help="CPU threads (default: ONNX Runtime's choice)")
    p.add_argument("--backend", choices=sorted(BACKENDS), default=DEFAULT_BACKEND,
                   help=f"medusa_runtime backend, vanilla and Medusa on the same engine (default: {DEFAULT_BACKEND})")
    p.add_argument("--device-id", type=int, metavar="N", help="GPU of the onnxruntime-cuda, tensorrt and torch backends (torch without it: the CPU)")
    p.add_argument("--model-path", help="torch backend: the artifact's source weights, when not its registered model's")
    p.add_argument("--tree", help="override the artifact's tree (e.g. 8, chain, dynamic:6, a JSON file)")
    p.add_argument("--spin", action="store_true", help="let ONNX Runtime's idle threads busy-wait (dedicated machines)")
    p.add_argument("--past-lengths", type=lambda s: [int(x) for x in s.split(",")], default=[0, 256, 512, 1024],
                   help="past lengths for the step-time scan (default: 0,256,512,1024)")
    p.add_argument("--repeats", type=int, default=7, help="timed runs per step-time point (default: 7)")
    p.add_argument("--no-transformers", dest="transformers", action="store_false",
                   help="skip the plain transformers reference")
    p.add_argument("--out", default="bench.json",
                   help="JSON report (default: bench.json); the chart is written beside it as .png")
    args = p.parse_args(argv)
    report = run(args)
    out = Path(args.out)
    out.write_text(json.dumps(report, indent=2) + "\n")
    chart(report, out.with_suffix(".png"))
    print_table(report)
    print(f"\nwrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
