#!/usr/bin/env python
"""A roofline projection of the batch curve (plain vs Medusa tokens/s by batch size B) for this CPU and for A100,
H100 and H200 GPUs, checked first against a measured curve of this CPU.

    python scripts/project_batch.py --artifact ARTIFACT --limits limits.json \\
        [--measured docs/benchmark/smollm2-135m-batch.json] [--batch 1 2 4 8 16 32 64 128] [--json OUT]

The model (Williams, Waterman and Patterson, "Roofline", CACM 2009): a step of B sequences with a T-node tree reads
the weights once and each sequence's KV cache, and multiplies B x T rows through every weight product, so it takes

    t(B, T) = max( (W + B * P * kv) / bandwidth,  2 * MACs * B * T / peak )   (+ a fixed per-step cost, see below)

and yields B * E[T] tokens (E[T]: expected tokens per step of the T-node tree, Medusa paper §2.3.3; E[1] = 1). W is
the step graph's weight bytes, MACs its multiply-adds per row (``scripts/bench_limit.py``), P the mean context and kv
the KV bytes per token of context. For each B the best T is kept (plain decoding is T = 1). ``--step-overhead-ms``
adds a fixed cost per step (kernel launches, the host loop); 0 gives the pure roofline, an upper bound.
``--prompt-tokens L --new-tokens N`` projects a whole run as ``bench_batch.py`` measures it (each sequence's
prefill of L rows, then N reply tokens): the form to hold against a measured curve.

The machines: this CPU from ``--limits`` (``bench_limit.py --json``: the triad bandwidth and the fp32 or int8
GEMM peak by how the step graph computes: :func:`compute_precision`); the GPUs from NVIDIA's datasheets
(:data:`GPUS`: dense fp16/bf16 Tensor Core peak and HBM bandwidth; the artifact's weights counted at fp16, 2 bytes a
weight, as a GPU engine would hold them unless the artifact is int4/int8). Everything printed for a GPU is a
projection, never a measurement.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_limit import artifact_traffic  # noqa: E402

#: name -> (HBM bandwidth bytes/s, dense fp16 Tensor Core FLOP/s), from NVIDIA's datasheets: A100 80GB SXM
#: (2,039 GB/s, 312 TFLOPS), H100 SXM (3.35 TB/s, 989 TFLOPS), H200 SXM (4.8 TB/s, 989 TFLOPS).
GPUS = {"A100": (2.039e12, 312e12), "H100": (3.35e12, 989e12), "H200": (4.8e12, 989e12)}


@dataclass(frozen=True)
class Machine:
    """A roofline: memory bandwidth (bytes/s), peak (FLOP/s) and a fixed cost per step (s)."""

    name: str
    bandwidth: float
    peak: float
    step_overhead: float = 0.0


@dataclass(frozen=True)
class ModelCost:
    """One step graph: weight bytes read per step, multiply-adds per row, KV bytes per token of context."""

    weight_bytes: float
    macs_per_row: float
    kv_bytes_per_token: float


def step_seconds(m: Machine, c: ModelCost, batch: int, tree: int, context: float) -> float:
    """t(B, T) of the module's formula, seconds."""
    memory = (c.weight_bytes + batch * context * c.kv_bytes_per_token) / m.bandwidth
    compute = 2.0 * c.macs_per_row * batch * tree / m.peak
    return max(memory, compute) + m.step_overhead


def prefill_seconds(m: Machine, c: ModelCost, prompt_tokens: float) -> float:
    """One sequence's prefill of ``prompt_tokens`` rows in one call: the same roofline as a step, seconds."""
    if prompt_tokens <= 0:
        return 0.0
    return max(c.weight_bytes / m.bandwidth, 2.0 * c.macs_per_row * prompt_tokens / m.peak) + m.step_overhead


def tokens_per_second(m: Machine, c: ModelCost, batch: int, tree: int, expected: float, context: float,
                      prompt_tokens: float = 0.0, new_tokens: int = 0) -> float:
    """Total tokens/s of B sequences decoding together with a T-node tree.

    With ``prompt_tokens`` = 0 the steady state: B * E[T] / t(B, T). Otherwise a whole run as ``bench_batch.py``
    measures it (each sequence prefilled over its own row, then ceil(N / E[T]) steps of all B rows):
    B * N / (B * prefill(L) + ceil(N / E[T]) * t(B, T)), N = ``new_tokens``, L = ``prompt_tokens``.
    """
    t = step_seconds(m, c, batch, tree, context)
    if prompt_tokens <= 0:
        return batch * expected / t
    steps = math.ceil(new_tokens / expected)
    return batch * new_tokens / (batch * prefill_seconds(m, c, prompt_tokens) + steps * t)


def curve(m: Machine, c: ModelCost, expected: dict[int, float], batches, context: float,
          prompt_tokens: float = 0.0, new_tokens: int = 0) -> list[dict]:
    """Per B: plain tokens/s (T = 1), the best tree's tokens/s and its size, and which bound holds.

    Args:
        expected: tree size T -> expected tokens per step E[T] (must hold T = 1 -> 1.0).
        prompt_tokens, new_tokens: a whole run's prefill and reply lengths (:func:`tokens_per_second`); 0: the
            steady state of decoding.
    """
    rows = []
    for b in batches:
        tps = {t: tokens_per_second(m, c, b, t, e, context, prompt_tokens, new_tokens) for t, e in expected.items()}
        best = max(tps, key=lambda t: (tps[t], -t))
        memory = (c.weight_bytes + b * context * c.kv_bytes_per_token) / m.bandwidth
        bound = "compute" if 2.0 * c.macs_per_row * b * best / m.peak > memory else "memory"
        rows.append({"batch": b, "plain": tps[1], "medusa": tps[best], "tree": best, "bound": bound})
    return rows


def kv_bytes_per_token(manifest, bytes_per_value: float) -> float:
    """2 (K and V) x layers x KV heads x head dim x bytes per value (``manifest``: a typed Manifest)."""
    m = manifest.model
    return 2.0 * m.num_layers * m.num_kv_heads * m.head_dim * bytes_per_value


def expected_from_heads(folder: Path, sizes) -> dict[int, float]:
    """E[T] of the greedy T-node tree (chains where the artifact's ``precision.step_rows`` asks for them) from the
    artifact's calibrated head accuracies (Medusa paper §2.3.3; tree.json ``head_accuracies``)."""
    from medusa_runtime.contract.artifact import load_artifact, step_limits
    from medusa_runtime.trees.tree import chain_tree, expected_accept_length, greedy_tree

    art = load_artifact(folder)
    acc = art.head_accuracies[: art.tree.num_heads]
    chains = step_limits(art.manifest).chain_trees
    out = {}
    for n in sizes:
        if chains and n > art.tree.num_heads + 1:
            continue
        tree = chain_tree(art.tree.num_heads, art.tree.topk, n) if chains else greedy_tree(n, acc, topk=art.tree.topk)
        out[int(n)] = float(expected_accept_length(tree, acc))
    return out


def compute_precision(model) -> str:
    """Which GEMM peak bounds a step of ``model`` (an ``onnx.ModelProto``) on a CPU: "int8" when every
    ``com.microsoft::MatMulNBits`` computes with int8 activations (``accuracy_level`` 4, ONNX Runtime's contrib op
    documentation, docs/ContribOperators.md), else "fp32" (float products, Q/DQ graphs run as float on ONNX
    Runtime's CPU, MatMulNBits at accuracy level 0 / 1: fp32 compute)."""
    levels = [next((a.i for a in n.attribute if a.name == "accuracy_level"), 0)
              for n in model.graph.node if n.op_type == "MatMulNBits"]
    return "int8" if levels and all(level == 4 for level in levels) else "fp32"


def measured_curve(path: Path, precision: str) -> list[dict]:
    """The rows of a ``bench_batch.py`` JSON for one precision: batch, vanilla and best Medusa total tokens/s."""
    doc = json.loads(path.read_text())
    for art in doc["artifacts"]:
        if art["precision"] == precision:
            return [{"batch": r["batch"], "plain": r["batched"]["vanilla"]["tokens_per_s"],
                     "medusa": r["batched"]["medusa"]["tokens_per_s"]} for r in art["rows"]]
    return []


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--artifact", required=True)
    p.add_argument("--limits", required=True, help="bench_limit.py --json output (this CPU's roofline)")
    p.add_argument("--expected", default=None,
                   help="JSON {tree size: tokens per step} (default: expected from the artifact's head accuracies)")
    p.add_argument("--trees", type=int, nargs="+", default=[1, 2, 3, 4, 5, 8, 16],
                   help="tree sizes T to consider (default 1 2 3 4 5 8 16)")
    p.add_argument("--measured", default=None, help="bench_batch.py JSON of this CPU to check the projection against")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    p.add_argument("--context", type=float, default=512.0, help="mean context per sequence, tokens (default 512)")
    p.add_argument("--prompt-tokens", type=float, default=0.0,
                   help="mean prompt length L: project a whole run as bench_batch.py measures it (each sequence "
                        "prefilled, then --new-tokens per sequence); 0 (default): the steady state of decoding")
    p.add_argument("--new-tokens", type=int, default=128, help="reply tokens per sequence with --prompt-tokens")
    p.add_argument("--cpu-step-overhead-ms", type=float, default=0.0)
    p.add_argument("--gpu-step-overhead-ms", type=float, default=0.0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    folder = Path(args.artifact)
    from medusa_runtime.contract.artifact import load_artifact

    artifact = load_artifact(folder)
    manifest = artifact.manifest
    precision = manifest.precision_name
    traffic = artifact_traffic(folder)["model"]
    if args.expected:
        expected = {int(k): float(v) for k, v in json.loads(Path(args.expected).read_text()).items()}
    else:
        expected = expected_from_heads(folder, args.trees)
    expected[1] = 1.0
    lim = json.loads(Path(args.limits).read_text())
    kv_cpu = kv_bytes_per_token(manifest, 4.0 if manifest.precision.kv_dtype == "float32" else 2.0)
    import onnx

    compute = compute_precision(onnx.load(str(artifact.file("model")), load_external_data=False))
    gemm = lim["gemm_flops_per_s"][compute]
    machines = [(Machine("this CPU", lim["bandwidth"], gemm, args.cpu_step_overhead_ms / 1e3),
                 ModelCost(traffic.weight_bytes, traffic.macs_per_row, kv_cpu))]
    gpu_weights = traffic.weight_bytes if precision in ("int4", "int8") else 2.0 * traffic.macs_per_row
    for name, (bw, peak) in GPUS.items():
        machines.append((Machine(f"{name} (projection)", bw, peak, args.gpu_step_overhead_ms / 1e3),
                         ModelCost(gpu_weights, traffic.macs_per_row, kv_bytes_per_token(manifest, 2.0))))
    out = {"artifact": str(folder), "precision": precision, "cpu_gemm": compute,
           "expected_tokens_per_step": expected,
           "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens if args.prompt_tokens > 0 else None,
           "context": args.context, "limits": lim.get("host"), "curves": {}}
    for m, c in machines:
        rows = curve(m, c, expected, args.batch, args.context, args.prompt_tokens, args.new_tokens)
        out["curves"][m.name] = rows
        print(f"\n{m.name}: {m.bandwidth / 1e9:.0f} GB/s, {m.peak / 1e12:.2f} TFLOP/s, weights {c.weight_bytes / 1e6:.0f} MB")
        print("| B | plain tokens/s | Medusa tokens/s (tree) | Medusa/plain | bound |")
        print("|---:|---:|---:|---:|---|")
        for r in rows:
            print(f"| {r['batch']} | {r['plain']:.0f} | {r['medusa']:.0f} (T={r['tree']}) | "
                  f"{r['medusa'] / r['plain']:.2f} | {r['bound']} |")
    if args.measured:
        meas = {r["batch"]: r for r in measured_curve(Path(args.measured), precision)}
        cpu = {r["batch"]: r for r in out["curves"]["this CPU"]}
        both = sorted(set(meas) & set(cpu))
        out["check"] = [{"batch": b, "measured_plain": meas[b]["plain"], "projected_plain": cpu[b]["plain"],
                         "measured_medusa": meas[b]["medusa"], "projected_medusa": cpu[b]["medusa"]} for b in both]
        print("\nthis CPU, projected against measured (total tokens/s):")
        print("| B | plain measured | plain projected | ratio | Medusa measured | Medusa projected | ratio |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for r in out["check"]:
            print(f"| {r['batch']} | {r['measured_plain']:.1f} | {r['projected_plain']:.1f} | "
                  f"{r['measured_plain'] / r['projected_plain']:.2f} | {r['measured_medusa']:.1f} | "
                  f"{r['projected_medusa']:.1f} | {r['measured_medusa'] / r['projected_medusa']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
