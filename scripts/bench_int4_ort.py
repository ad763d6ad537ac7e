#!/usr/bin/env python
"""The two int4 graphs of one model on ONNX Runtime's CPU, side by side in one run: which should its users pick?

    python scripts/bench_int4_ort.py                                   # builds both from the embedded model
    python scripts/bench_int4_ort.py --qdq ART_A --nbits ART_B --rounds 5 --prompts 5 --threads 2

* ``qdq``: ``build --graph portable --precision int4``: standard ONNX, a blocked DequantizeLinear (opset 21) feeding
  each float16 MatMul (the TensorRT graph, flavour ``portable``);
* ``nbits``: ``build --graph contrib --precision int4``: ONNX Runtime's ``com.microsoft::MatMulNBits`` (flavour
  ``ort-contrib``, accuracy level 4: int8 activations, with its row regime, so its tree is a chain, ``--nbits-tree``).

Missing artifacts are built (``--no-validate``: validation is the build's business, not the benchmark's) into
``--work``. Timing: ``--rounds`` rounds, each running every prompt on both artifacts in alternating order (so a load
change on a shared machine hits both), plain greedy (a root-only tree) and Medusa (the artifact's tree); per artifact
and mode the median tokens/s over rounds of the reply tokens over wall time (prefill included). Printed and written
(``--out`` JSON): the medians, the outputs' agreement, the load average before and after, the date (UTC), the host
CPU (``/proc/cpuinfo`` model name, core count) and ONNX Runtime's version.

The fusion question (issue 42): does ONNX Runtime fuse DequantizeLinear + MatMul into MatMulNBits for int4? Each
graph's session is opened once with ``SessionOptions.optimized_model_filepath`` set (``ORT_ENABLE_ALL``, CPU
provider, as the runtime opens it), and the optimized graph's op counts are printed: DequantizeLinear, MatMul,
MatMulNBits and any other com.microsoft op.

Run it alone on an idle machine for numbers anyone quotes (docs/precisions.md); ``--rounds 1 --prompts 1
--max-new-tokens 8`` only proves it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GRAPHS = {"qdq": "portable", "nbits": "contrib"}


def host_cpu() -> str:
    """The CPU's model name and logical core count (``/proc/cpuinfo``; ``platform.processor()`` elsewhere)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        name = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), platform.processor())
        return f"{name}, {sum(ln.startswith('processor') for ln in lines)} logical cores"
    except OSError:
        return platform.processor() or "unknown"


def build(kind: str, out: Path, model: str, tree: str) -> None:
    """``medusa-export build`` of one int4 graph (no validation) into ``out``."""
    cmd = [sys.executable, "-m", "medusa_export.cli.main", "build", "--model", model, "--tree", tree, "--precision",
           "int4", "--graph", GRAPHS[kind], "--out", str(out), "--force", "--no-validate"]
    print("building:", " ".join(cmd[2:]), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)


def fused_ops(artifact: Path, threads: int | None) -> dict:
    """Op counts of the step graph after ONNX Runtime's optimizations (``optimized_model_filepath``).

    Returns:
        {"optimized": {op: count} of the ops the question is about, "before": the same of the graph on disk,
        "fused": whether a MatMulNBits appears that the graph on disk did not have}.
    """
    import onnx
    import onnxruntime as ort

    src = artifact / "model.onnx"
    with tempfile.TemporaryDirectory(prefix="ort-opt-") as tmp:
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.optimized_model_filepath = str(Path(tmp) / "optimized.onnx")
        if threads:
            opts.intra_op_num_threads = threads
        ort.InferenceSession(str(src), opts, providers=["CPUExecutionProvider"])
        optimized = onnx.load(opts.optimized_model_filepath, load_external_data=False)

    def count(model) -> dict:
        c = Counter(f"{n.domain + '::' if n.domain else ''}{n.op_type}" for n in model.graph.node)
        keep = {k: v for k, v in c.items() if k in ("DequantizeLinear", "MatMul", "Gemm") or k.startswith("com.microsoft")}
        return dict(sorted(keep.items()))

    before, after = count(onnx.load(str(src), load_external_data=False)), count(optimized)
    return {"before": before, "optimized": after,
            "fused": after.get("com.microsoft::MatMulNBits", 0) > before.get("com.microsoft::MatMulNBits", 0)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--qdq", type=Path, help="a --graph portable --precision int4 artifact (default: built)")
    ap.add_argument("--nbits", type=Path, help="a --graph contrib --precision int4 artifact (default: built)")
    ap.add_argument("--model", default="smollm2-135m", help="model the missing artifacts are built from")
    ap.add_argument("--tree", default="16", help="--tree of the missing Q/DQ artifact (default: 16)")
    ap.add_argument("--nbits-tree", default="chain",
                    help="--tree of the missing MatMulNBits artifact (default: chain; its int8 activations take chains)")
    ap.add_argument("--work", type=Path, default=ROOT / "artifacts", help="where missing artifacts are built")
    ap.add_argument("--prompts", type=int, default=5, help="MT-Bench first turns (tests/data; default 5)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, help="also write the report as JSON here")
    args = ap.parse_args(argv)

    import onnxruntime as ort

    from medusa_runtime.contract.artifact import load_artifact
    from medusa_runtime.contract.tokenizer import RuntimeTokenizer
    from medusa_runtime.decode.loop import generate
    from medusa_runtime.engines.ort import OrtEngine
    from medusa_runtime.front.prompts import read_first_turns
    from medusa_runtime.trees.tree import make_tree

    arts = {}
    for kind in GRAPHS:
        tree = args.nbits_tree if kind == "nbits" else args.tree
        path = getattr(args, kind) or args.work / f"{args.model}-t{tree}-int4-{kind}"
        if not (path / "manifest.json").is_file():
            build(kind, path, args.model, tree)
        arts[kind] = load_artifact(path)
    load_before = os.getloadavg()
    report = {"date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"), "host_cpu": host_cpu(),
              "onnxruntime": ort.__version__, "threads": args.threads, "rounds": args.rounds,
              "max_new_tokens": args.max_new_tokens, "load_average_before": [round(x, 2) for x in load_before],
              "artifacts": {k: {"path": str(a.path), "flavour": a.manifest.flavour,
                                "weights_bytes": a.manifest.weights.bytes} for k, a in arts.items()}}
    report["fusion"] = {k: fused_ops(a.path, args.threads) for k, a in arts.items()}
    for k, f in report["fusion"].items():
        print(f"{k}: step graph ops on disk {f['before']} -> after ONNX Runtime {ort.__version__}'s optimizations "
              f"{f['optimized']} (DequantizeLinear+MatMul fused into MatMulNBits: {'yes' if f['fused'] else 'no'})")
    texts = read_first_turns(ROOT / "tests" / "data" / "mt_bench_questions.jsonl", args.prompts)
    engines = {k: OrtEngine(a, threads=args.threads) for k, a in arts.items()}
    tok = RuntimeTokenizer.from_artifact(arts["qdq"])
    ids = [tok.apply_chat_template([{"role": "user", "content": t}]) if tok.has_chat_template else tok.encode(t)
           for t in texts]
    eos = list(tok.eos_token_ids)
    speeds = {(k, m): [] for k in arts for m in ("plain", "medusa")}
    outputs: dict = {}
    for r in range(args.rounds):
        order = list(arts) if r % 2 == 0 else list(arts)[::-1]
        for kind in order:
            a, eng = arts[kind], engines[kind]
            root = make_tree([], num_heads=a.model.medusa_heads, topk=a.tree.topk)
            for mode, tree in (("plain", root), ("medusa", a.tree)):
                n, t = 0, 0.0
                for i, prompt in enumerate(ids):
                    t0 = time.perf_counter()
                    res = generate(eng, prompt, tree, max_new_tokens=args.max_new_tokens, eos_token_ids=eos,
                                   max_context=a.model.max_context)
                    t += time.perf_counter() - t0
                    n += len(res.tokens)
                    outputs[(kind, mode, i)] = res.tokens
                speeds[(kind, mode)].append(n / t)
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {m} {v[-1]:.1f}" for (k, m), v in speeds.items()),
              file=sys.stderr, flush=True)
    report["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    report["tokens_per_s_median"] = {f"{k} {m}": round(statistics.median(v), 2) for (k, m), v in speeds.items()}
    report["tokens_per_s_rounds"] = {f"{k} {m}": [round(x, 2) for x in v] for (k, m), v in speeds.items()}
    report["medusa_equals_plain"] = {k: all(outputs[(k, "medusa", i)] == outputs[(k, "plain", i)] for i in range(len(ids)))
                                     for k in arts}
    report["qdq_equals_nbits_plain"] = sum(outputs[("qdq", "plain", i)] == outputs[("nbits", "plain", i)]
                                           for i in range(len(ids)))
    print(f"{report['date_utc']}  {report['host_cpu']}  onnxruntime {ort.__version__}  {args.threads} threads  "
          f"load {report['load_average_before']} -> {report['load_average_after']}")
    print(f"{'graph':8s} {'plain tok/s':>12s} {'medusa tok/s':>13s}  (medians of {args.rounds} interleaved rounds, "
          f"{len(ids)} prompts x {args.max_new_tokens} tokens)")
    for k in arts:
        print(f"{k:8s} {report['tokens_per_s_median'][f'{k} plain']:12.1f} {report['tokens_per_s_median'][f'{k} medusa']:13.1f}"
              f"  Medusa == plain: {report['medusa_equals_plain'][k]}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
