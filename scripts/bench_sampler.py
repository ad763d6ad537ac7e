#!/usr/bin/env python
"""Cost of the in-graph sampler (docs/sampling.md, ``step_sampler`` v1) on ONNX Runtime.

Two measurements, interleaved repeat by repeat so that load from other processes hits the
settings alike; times are medians over ``--repeats`` runs:

* the sampler alone: the nodes ``export/sampler.py`` writes into every step graph, on a graph
  whose input is the step's probabilities [S, V] (softmax of random logits, temperature 1),
  for each ``--rows`` S and each setting (off = ``sample_top_k`` -1, what a greedy or host-sampled
  step feeds; top-k; the whole vocabulary with and without top-p);
* with ``--artifact``: the whole step of a built artifact at S = 1 and S = the tree size
  (past ``--past``), the sampler off against on.

Usage:
    python scripts/bench_sampler.py [--vocab 49152] [--rows 1 16 64] [--repeats 30] [--threads 2]
        [--artifact DIR] [--past 256] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

#: (label, sample_top_k, sample_top_p): off, host-exact top-k, wider top-k, whole vocabulary.
SETTINGS = [("off (greedy / host draw)", -1, 1.0), ("top-k 10", 10, 1.0), ("top-k 50, top-p 0.9", 50, 0.9),
            ("whole vocabulary", 0, 1.0), ("whole vocabulary, top-p 0.9", 0, 0.9)]


def sampler_model(vocab: int):
    """An ONNX model of the sampler alone: ``probs`` float32 [S, V] and the sampler's inputs -> ``sampled_ids``."""
    from onnx import TensorProto, helper

    from medusa_export.export.contract import IR_VERSION, OPSET, SAMPLER_INPUTS, SAMPLER_OUTPUTS
    from medusa_export.export.graph import GraphBuilder, value_info
    from medusa_export.export.sampler import write_sampler

    b = GraphBuilder(weights=None)
    write_sampler(b, "probs")
    inputs = [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["S", vocab])]
    graph = helper.make_graph(b.nodes, "sampler", inputs + [value_info(t) for t in SAMPLER_INPUTS],
                              [value_info(t) for t in SAMPLER_OUTPUTS], b._inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = IR_VERSION
    return model


def _median_ms(fns: dict, repeats: int) -> dict:
    times = {k: [] for k in fns}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(repeats):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[k].append((time.perf_counter() - t) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def bench_alone(vocab: int, rows: list[int], repeats: int, threads: int) -> list[dict]:
    import onnxruntime as ort

    from medusa_runtime.engines.ort import session_options

    sess = ort.InferenceSession(sampler_model(vocab).SerializeToString(), session_options(threads, False),
                                providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    fns, meta = {}, {}
    for s in rows:
        logits = rng.standard_normal((s, vocab)).astype(np.float32) * 3
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        u = rng.random((1, s)).astype(np.float32)
        for label, k, p in SETTINGS:
            feed = {"probs": probs, "sample_uniforms": u, "sample_top_k": np.array([k], np.int64),
                    "sample_top_p": np.array([p], np.float32)}
            fns[(s, label)] = (lambda f=feed: sess.run(["sampled_ids"], f))
            meta[(s, label)] = {"rows": s, "setting": label}
    ms = _median_ms(fns, repeats)
    return [{**meta[k], "ms": round(v, 3)} for k, v in ms.items()]


def bench_artifact(path: str, past: int, repeats: int, threads: int) -> list[dict]:
    from medusa_runtime.contract.artifact import load_artifact
    from medusa_runtime.engines.base import SamplerInputs
    from medusa_runtime.engines.kvcache import KVCache
    from medusa_runtime.engines.ort import OrtEngine
    from medusa_runtime.decode.loop import causal_mask

    art = load_artifact(path)
    eng = OrtEngine(art, threads=threads)
    if not eng.capabilities.sampler:
        raise SystemExit(f"{path}: no step_sampler in the manifest (built before the in-graph sampler)")
    rng = np.random.default_rng(0)
    fns, meta = {}, {}
    for s in sorted({1, int(art.manifest.tree.size)}):
        cache = KVCache.for_engine(eng, past + s)
        cache.length = past
        ids = rng.integers(0, eng.capabilities.vocab_size, (1, s), dtype=np.int64)
        pos = past + np.arange(s, dtype=np.int64)[None]
        mask = causal_mask(s)
        for label, k, p in SETTINGS:
            sampling = SamplerInputs(rng.random(s).astype(np.float32), k, p) if k >= 0 else None
            fns[(s, label)] = (lambda a=(ids, pos, mask, sampling): eng.step(a[0], a[1], a[2], 1.0, cache.past(),
                                                                              sampling=a[3]))
            meta[(s, label)] = {"rows": s, "setting": label, "past": past}
    ms = _median_ms(fns, repeats)
    return [{**meta[k], "ms": round(v, 3)} for k, v in ms.items()]


def _table(title: str, rows: list[dict]) -> str:
    sizes = sorted({r["rows"] for r in rows})
    lines = [title, "| setting | " + " | ".join(f"S = {s} (ms)" for s in sizes) + " |",
             "|---|" + "---|" * len(sizes)]
    for label, _, _ in SETTINGS:
        vals = {r["rows"]: r["ms"] for r in rows if r["setting"] == label}
        lines.append(f"| {label} | " + " | ".join(f"{vals[s]:.2f}" for s in sizes) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=49152, help="V of the sampler-alone graph (SmolLM2's by default)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--artifact", help="also time a built artifact's whole step, the sampler off and on")
    ap.add_argument("--past", type=int, default=256)
    ap.add_argument("--json", help="write the measurements here")
    args = ap.parse_args(argv)
    out = {"sampler_alone": bench_alone(args.vocab, args.rows, args.repeats, args.threads)}
    print(_table(f"sampler alone, V = {args.vocab}, {args.threads} threads, median of {args.repeats}",
                 out["sampler_alone"]))
    if args.artifact:
        out["step"] = bench_artifact(args.artifact, args.past, args.repeats, args.threads)
        print(_table(f"\nwhole step of {args.artifact}, past {args.past}", out["step"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
