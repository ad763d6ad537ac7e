#!/usr/bin/env python
"""What the exact int4 row regime costs: one decode step of our int4 artifact against ONNX Runtime GenAI's int4
model at one and at two rows, interleaved in one process.

    python scripts/bench_row_regime.py ARTIFACT --genai DIR [--past 200] [--repeats 100] [--rounds 3] [--threads 2]
        [--json OUT]

Our int4 default (MatMulNBits accuracy level 4, int8 activations) runs every step as at least two rows (the
manifest's ``precision.step_rows``): ONNX Runtime's one-row kernel rounds differently from its multi-row one, and
Medusa's tree rows must round as plain decoding's do. GenAI runs a one-token step as one row. This script times,
after ``--past`` cached tokens (a real prefill of random tokens for ours; GenAI's buffers hold random values of the
same size: the cost of the kernels does not depend on them):

* ``ours, plain step``: :meth:`OrtEngine.step <medusa_runtime.engines.ort.OrtEngine.step>` of one token (padded to
  two rows, as the decode loop runs it), host feeds and outputs included;
* ``ours, graph only``: the same two-row step's ``run_with_iobinding`` alone (inputs already bound);
* ``genai, 1 row`` and ``genai, 2 rows``: GenAI's ``model.onnx`` (the one ``scripts/bench_peers.py`` builds with
  ``onnxruntime_genai.models.builder -p int4 -e cpu``) on ONNX Runtime with its KV buffers bound in place
  (``past_present_share_buffer``, as GenAI runs it), ``attention_mask`` of the past plus the new rows.

Each round times every case ``--repeats`` times, one run of each per repeat in a shuffled order (so drift of the
machine, and the cost of following another session's step, hit them alike), and prints medians in ms.
``genai 2 rows / genai 1 row`` is what a two-row step costs GenAI's own graph; ``ours graph /
genai 2 rows`` compares the two graphs at equal rows. GenAI's ``--genai`` folder: bench_peers' cache
(``--cache-dir``, ``genai-<model>-int4``). Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_limit import host_record  # noqa: E402


def interleaved(fns: dict, repeats: int, rng) -> dict:
    """Median ms of each ``fn()``, one run of every fn per repeat in a shuffled order, after one warm-up run each.

    The order is shuffled because a case run right after another session's step pays for it (its weights and
    threads are cold): in a fixed order that was ~0.6 ms of a ~8 ms step, charged to whichever case came first.
    """
    for fn in fns.values():
        fn()
    times = {k: [] for k in fns}
    keys = list(fns)
    for _ in range(repeats):
        for i in rng.permutation(len(keys)):
            k, fn = keys[i], fns[keys[i]]
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def ours(path: str, past: int, threads: int, rng) -> dict:
    """The plain step of ``path`` through the engine, and its graph alone."""
    from medusa_runtime.contract.artifact import load_artifact
    from medusa_runtime.decode.loop import causal_mask
    from medusa_runtime.engines.kvcache import KVCache
    from medusa_runtime.engines.ort import OrtEngine

    art = load_artifact(path)
    eng = OrtEngine(art, threads=threads)
    if eng.capabilities.min_rows < 2:
        raise SystemExit(f"{path} has no row regime (manifest precision.step_rows): build it with --precision int4 "
                         "--graph fused")
    cache = KVCache.for_engine(eng, past + 8)
    vocab = art.model.vocab_size
    out = eng.step(rng.integers(0, vocab, (1, past)), np.arange(past)[None], causal_mask(past), 1.0, cache.past())
    cache.keep(out.new_kv, np.arange(past))
    token = rng.integers(0, vocab, (1, 1))

    def step():
        eng.step(token, np.array([[past]]), causal_mask(1), 1.0, cache.past())

    step()
    io = eng._binding[1]  # the binding the step just ran (two rows, outputs bound)
    return {"ours, plain step": step, "ours, graph only": lambda: eng.step_session.run_with_iobinding(io)}


def genai(folder: str, past: int, threads: int, rng) -> dict:
    """GenAI's int4 step at 1 and 2 rows, its KV bound in place."""
    import onnx
    import onnxruntime as ort

    model = Path(folder) / "model.onnx"
    if not model.exists():
        raise SystemExit(f"no {model}: give --genai the folder bench_peers.py's GenAI int4 build wrote")
    graph = onnx.load(str(model), load_external_data=False).graph
    kv = [i for i in graph.input if i.name.startswith("past_key_values.")]
    heads = kv[0].type.tensor_type.shape.dim[1].dim_value
    dim = kv[0].type.tensor_type.shape.dim[3].dim_value or 64
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(model), so, providers=["CPUExecutionProvider"])
    buffers = {i.name: ort.OrtValue.ortvalue_from_numpy(
        (0.1 * rng.standard_normal((1, heads, past + 8, dim))).astype(np.float32)) for i in kv}
    fns = {}
    for rows in (1, 2):
        io = sess.io_binding()
        for name, buf in buffers.items():
            io.bind_ortvalue_input(name, buf)
            io.bind_ortvalue_output(name.replace("past_key_values", "present"), buf)
        io.bind_cpu_input("input_ids", rng.integers(0, 1000, (1, rows)).astype(np.int64))
        io.bind_cpu_input("attention_mask", np.ones((1, past + rows), np.int64))
        io.bind_output("logits")
        fns[f"genai, {rows} row{'s' if rows > 1 else ''}"] = lambda io=io: sess.run_with_iobinding(io)
    return fns


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact", help="an artifact of `medusa-export build --precision int4 --graph fused` (its "
                                     "row regime, manifest precision.step_rows: one-token steps run as two rows)")
    ap.add_argument("--genai", required=True,
                    help="folder holding ONNX Runtime GenAI's int4 model.onnx: the one scripts/bench_peers.py builds, "
                         "CACHE_DIR/genai-<model>-int4 (--cache-dir, default .cache/peers). Run alone on the machine")
    ap.add_argument("--past", type=int, default=200, help="cached tokens before the step (default 200)")
    ap.add_argument("--repeats", type=int, default=100, help="timed runs of each case per round (default 100)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, each printed (default 3)")
    ap.add_argument("--threads", type=int, default=2, help="intra-op threads of every session (default 2)")
    ap.add_argument("--json", help="write the record here")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    fns = {**ours(args.artifact, args.past, args.threads, rng), **genai(args.genai, args.past, args.threads, rng)}
    record = {"host_before": host_record(), "args": vars(args), "rounds": []}
    for r in range(args.rounds):
        ms = interleaved(fns, args.repeats, rng)
        record["rounds"].append(ms)
        print(f"round {r + 1}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in ms.items())
              + f"; genai 2 rows / 1 row {ms['genai, 2 rows'] / ms['genai, 1 row']:.3f}"
              + f", ours graph / genai 2 rows {ms['ours, graph only'] / ms['genai, 2 rows']:.3f}"
              + f", ours plain step / genai 1 row {ms['ours, plain step'] / ms['genai, 1 row']:.3f}", flush=True)
    record["host_after"] = host_record()
    ratios = {name: statistics.median(fn(r) for r in record["rounds"]) for name, fn in (
        ("genai_2_over_1", lambda r: r["genai, 2 rows"] / r["genai, 1 row"]),
        ("ours_graph_over_genai_2", lambda r: r["ours, graph only"] / r["genai, 2 rows"]),
        ("ours_step_over_genai_1", lambda r: r["ours, plain step"] / r["genai, 1 row"]))}
    record["median_ratios"] = ratios
    print("median over rounds: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
    print(f"host: {record['host_before']}")
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
