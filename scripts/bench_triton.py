"""Request latency and tokens/s through Triton vs the runtime directly, on the same prompts.

Writes a Triton repository for ARTIFACT (``medusa-export triton``), starts the tritonserver
bundled in nvidia-pytriton on 127.0.0.1 (medusa_export.triton.local) and, prompt by prompt,
interleaves one direct ``MedusaSession.generate`` and one request through Triton (gRPC,
streaming: first-response latency too), both greedy with the same thread count, so machine
noise hits both alike. Checks that the tokens are identical and prints a table and a JSON line.

    python scripts/bench_triton.py ARTIFACT [--prompts 5] [--max-new-tokens 64] [--threads 2]

Prompts: the first MT-Bench questions from $MEDUSA_EXPORT_SHARED/data, else ../shared/data (or --prompts-file, JSONL with
"prompt" or "turns").
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from medusa_runtime.front.prompts import mt_bench_questions, read_first_turns

MT_BENCH = mt_bench_questions()  # $MEDUSA_EXPORT_SHARED, else ../shared


def triton_request(grpc, url: str, prompt: str, max_new_tokens: int) -> tuple[list[int], float, float]:
    """(token ids, seconds to the first response, seconds to the final one), streaming over gRPC."""
    client = grpc.InferenceServerClient(url)
    got: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((result, error, time.perf_counter())))
    inputs = []
    for name, dtype, arr in (("text_input", "BYTES", np.array([prompt.encode()], dtype=object)),
                             ("max_new_tokens", "INT32", np.array([max_new_tokens], np.int32)),
                             ("stream", "BOOL", np.array([True]))):
        x = grpc.InferInput(name, list(arr.shape), dtype)
        x.set_data_from_numpy(arr)
        inputs.append(x)
    ids, first = [], None
    t0 = time.perf_counter()
    try:
        client.async_stream_infer("medusa", inputs, enable_empty_final_response=True)
        while True:
            result, error, t = got.get(timeout=600)
            if error is not None:
                raise RuntimeError(str(error))
            if first is None:
                first = t - t0
            if result.get_response().outputs:
                ids += result.as_numpy("output_ids").tolist()
            if result.get_response().parameters["triton_final_response"].bool_param:
                return ids, first, t - t0
    finally:
        client.stop_stream()
        client.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact")
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--prompts-file", type=Path, default=MT_BENCH)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import tritonclient.grpc as grpc

    from medusa_export.triton.local import LocalTritonServer
    from medusa_export.triton.repository import TritonConfig, write_repository
    from medusa_runtime import MedusaSession

    prompts = read_first_turns(args.prompts_file, args.prompts)
    session = MedusaSession(args.artifact, threads=args.threads, tree="artifact")  # the tree the server runs
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-triton-") as tmp:
        repo = write_repository(args.artifact, Path(tmp) / "repo",
                                TritonConfig(threads=args.threads, engine_models=False, tree="artifact"))
        t = time.perf_counter()
        with LocalTritonServer(repo, Path(tmp) / "server", models=["medusa"]) as srv:
            print(f"server ready in {time.perf_counter() - t:.1f}s", file=sys.stderr)
            session.generate(prompts[0], max_new_tokens=8)  # warm-up, both sides
            triton_request(grpc, srv.grpc_url, prompts[0], 8)
            for i, prompt in enumerate(prompts):
                direct = session.generate(prompt, max_new_tokens=args.max_new_tokens)
                ids, first, total = triton_request(grpc, srv.grpc_url, prompt, args.max_new_tokens)
                if ids != direct.token_ids:
                    raise SystemExit(f"prompt {i}: Triton's tokens differ from the runtime's")
                rows.append({"prompt": i, "tokens": len(ids), "tokens_per_step": round(direct.tokens_per_step, 2),
                             "direct_s": round(direct.seconds, 3), "triton_s": round(total, 3),
                             "triton_first_s": round(first, 3),
                             "direct_tps": round(len(ids) / direct.seconds, 1), "triton_tps": round(len(ids) / total, 1)})
                print(json.dumps(rows[-1]), file=sys.stderr)
    tokens = sum(r["tokens"] for r in rows)
    direct_s, triton_s = sum(r["direct_s"] for r in rows), sum(r["triton_s"] for r in rows)
    summary = {"artifact": str(args.artifact), "prompts": len(rows), "max_new_tokens": args.max_new_tokens,
               "threads": args.threads, "tokens": tokens,
               "direct_tokens_per_s": round(tokens / direct_s, 1), "triton_tokens_per_s": round(tokens / triton_s, 1),
               "direct_latency_median_s": statistics.median(r["direct_s"] for r in rows),
               "triton_latency_median_s": statistics.median(r["triton_s"] for r in rows),
               "triton_first_response_median_s": statistics.median(r["triton_first_s"] for r in rows),
               "triton_overhead_per_request_s": round((triton_s - direct_s) / len(rows), 3)}
    print(f"{'prompt':>6} {'tokens':>6} {'direct s':>9} {'triton s':>9} {'first s':>8} {'direct t/s':>10} {'triton t/s':>10}")
    for r in rows:
        print(f"{r['prompt']:>6} {r['tokens']:>6} {r['direct_s']:>9.3f} {r['triton_s']:>9.3f} {r['triton_first_s']:>8.3f} "
              f"{r['direct_tps']:>10.1f} {r['triton_tps']:>10.1f}")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
