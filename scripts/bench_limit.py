#!/usr/bin/env python
"""The memory-bandwidth limit of decoding on this machine, and how close each decoder comes to it.

    python scripts/bench_limit.py --artifact artifacts/smollm2-135m-tauto-fp32-fused --threads 2

A decoding step at batch size 1 streams every weight of the step graph from memory once (the Medusa paper, §1:
"memory-bandwidth-bound"), so no plain decoder can run faster than ``bandwidth / bytes_per_step`` tokens/s; a tree
step reads the same weights for its T rows, so Medusa's ceiling is that figure times its accepted tokens per step.
This script measures the two machine figures and each artifact's bytes and FLOPs per step:

* bandwidth: a STREAM-like copy (``a = b``: 2 arrays of traffic) and triad (``a = b + s * c``: 3) over 256 MiB
  arrays at ``--threads`` threads (numpy releases the GIL in its loops; the triad runs chunk by chunk so its
  ``s * c`` temporary stays in cache and the traffic is STREAM's 3 arrays), best of ``--repeats`` (STREAM's rule,
  J. McCalpin, "STREAM: Sustainable Memory Bandwidth in High Performance Computers", reports the best time);
* the GEMM peak: ONNX Runtime's fp32 MatMul and its int8 MatMulInteger at M = 256, K = N = 2048, ``--threads``
  intra-op threads, best of ``--repeats``;
* per artifact: the bytes of weights one step reads (every initializer a weight product or a norm consumes; an
  embedding table only by the rows a step gathers, unless it is also a product's weight: the tied lm_head) and the
  multiply-adds per row (2 FLOPs each), from the step graph (``model.onnx``) and the heads graph.

:func:`graph_traffic` and :func:`limit_tokens_per_second` are pure (tests/test_bench_limit.py checks them against
hand-counted graphs); ``scripts/bench_peers.py`` prints each decoder's fraction of the limit with them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

#: Ops whose weight input is read whole every step, and the index of that input. MatMulNBits' packed weight
#: (input 1) comes with its scales (2) and zero points (3), which are initializers too and are counted as read.
PRODUCT_OPS = {"MatMul": 1, "Gemm": 1, "MatMulNBits": 1, "MatMulInteger": 1, "Conv": 1}
#: Bytes per element of each ONNX TensorProto data type (int4 / uint4 pack two to a byte).
_ELEM_BYTES = {1: 4, 2: 1, 3: 1, 4: 2, 5: 2, 6: 4, 7: 8, 9: 1, 10: 2, 11: 8, 12: 4, 13: 8, 16: 2, 17: 1, 18: 1,
               19: 1, 20: 1, 21: 0.5, 22: 0.5}


@dataclass(frozen=True)
class Traffic:
    """What one step of a graph reads and computes.

    Attributes:
        weight_bytes: bytes of initializers read per step (whole weights; embedding tables by ``gather_rows``).
        macs_per_row: multiply-adds of the weight products per row (token) of the step.
        products: number of weight products counted.
    """

    weight_bytes: float
    macs_per_row: float
    products: int


def _numel(dims) -> int:
    n = 1
    for d in dims:
        n *= int(d)
    return n


def graph_traffic(model, gather_rows: int = 1) -> Traffic:
    """Bytes read and multiply-adds per row of one step of ``model`` (an ``onnx.ModelProto``, external data not
    loaded: only the initializers' dims and types are read).

    Rules: a weight product's weight (:data:`PRODUCT_OPS`) is read whole; MatMulNBits' weight is ``N x K`` at
    ``bits`` per element plus its scales and zero points, and costs ``K * N`` MACs a row; a MatMul / Gemm on a
    ``[K, N]`` weight (Gemm ``transB=1``: ``[N, K]``) costs ``K * N`` MACs a row; a DequantizeLinear on an
    initializer is read at the quantized type (its scales too) and its output's product costs ``K * N``; a Gather
    from an initializer table that is not also read whole reads ``gather_rows`` rows; every other initializer (norm
    weights, constants) is read whole. Subgraphs are not visited (the in-graph sampler's If reads no weights).

    Returns:
        :class:`Traffic`.
    """
    inits = {t.name: t for t in model.graph.initializer}
    produced_by = {o: n for n in model.graph.node for o in n.output}

    def nbytes(name: str) -> float:
        t = inits[name]
        return _numel(t.dims) * _ELEM_BYTES.get(t.data_type, 4)

    whole: set[str] = set()
    gathered: dict[str, float] = {}
    macs, products = 0.0, 0
    for n in model.graph.node:
        if n.op_type in PRODUCT_OPS and len(n.input) > PRODUCT_OPS[n.op_type]:
            w = n.input[PRODUCT_OPS[n.op_type]]
            src = produced_by.get(w)
            if src is not None and src.op_type == "DequantizeLinear" and src.input[0] in inits:
                whole.update(i for i in src.input if i in inits)
                dims = list(inits[src.input[0]].dims)
            elif w in inits:
                dims = list(inits[w].dims)
                whole.add(w)
            else:
                continue  # an activation product (attention): no weights
            products += 1
            if n.op_type == "MatMulNBits":
                a = {x.name: x for x in n.attribute}
                macs += int(a["K"].i) * int(a["N"].i)
                whole.update(i for i in n.input[2:] if i in inits)
            else:
                macs += _numel(dims)  # K * N (either orientation)
        elif n.op_type == "Gather" and n.input and n.input[0] in inits:
            t = inits[n.input[0]]
            row = _numel(t.dims[1:]) * _ELEM_BYTES.get(t.data_type, 4)
            gathered[n.input[0]] = max(gathered.get(n.input[0], 0.0), row * gather_rows)
    used = {i for n in model.graph.node for i in n.input if i in inits}
    total = sum(nbytes(w) for w in whole)
    total += sum(b for name, b in gathered.items() if name not in whole)
    total += sum(nbytes(name) for name in used - whole - set(gathered))
    return Traffic(float(total), float(macs), products)


def limit_tokens_per_second(bandwidth: float, bytes_per_step: float, tokens_per_step: float = 1.0) -> float:
    """The bandwidth ceiling in tokens/s: ``tokens_per_step * bandwidth / bytes_per_step`` (bytes/s over bytes).

    Raises:
        ValueError: a non-positive bandwidth or bytes per step.
    """
    if bandwidth <= 0 or bytes_per_step <= 0:
        raise ValueError(f"bandwidth ({bandwidth}) and bytes per step ({bytes_per_step}) must be positive")
    return tokens_per_step * bandwidth / bytes_per_step


def artifact_traffic(folder: str | Path) -> dict[str, Traffic]:
    """:func:`graph_traffic` of an artifact's step graph (``model``) and heads graph (``heads``), from its manifest."""
    import onnx

    folder = Path(folder)
    files = json.loads((folder / "manifest.json").read_text())["files"]
    out = {}
    for key, graph in (("model", "model"), ("heads", "heads")):
        if key in files:
            out[graph] = graph_traffic(onnx.load(str(folder / files[key]), load_external_data=False))
    return out


# -- measurements ---------------------------------------------------------------------------------------------------


def _parallel(threads: int, work) -> float:
    """Seconds for ``threads`` Python threads each running ``work(i)`` (numpy releases the GIL inside its loops)."""
    ts = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    start = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return time.perf_counter() - start


def measure_bandwidth(threads: int, repeats: int = 5, mib: int = 256) -> dict[str, float]:
    """STREAM-like copy and triad bandwidth in bytes/s (best of ``repeats``), ``threads`` threads over halves."""
    n = mib * 2**20 // 8
    a, b, c = (np.full(n, v, np.float64) for v in (0.0, 1.0, 2.0))
    parts = np.array_split(np.arange(n), threads)
    bounds = [(p[0], p[-1] + 1) for p in parts]
    chunk = 32768  # 256 KiB of float64: the triad's temporary stays in L2

    def copy(i):
        lo, hi = bounds[i]
        np.copyto(a[lo:hi], b[lo:hi])

    def triad(i):
        lo, hi = bounds[i]
        tmp = np.empty(chunk)
        for s in range(lo, hi, chunk):
            e = min(s + chunk, hi)
            t = tmp[: e - s]
            np.multiply(c[s:e], 3.0, out=t)
            np.add(b[s:e], t, out=a[s:e])

    best = {}
    for name, fn, arrays in (("copy", copy, 2), ("triad", triad, 3)):
        fn_times = [_parallel(threads, fn) for _ in range(repeats + 1)][1:]  # the first run faults the pages in
        best[name] = arrays * n * 8 / min(fn_times)
    return best


def measure_gemm(threads: int, repeats: int = 5, m: int = 256, k: int = 2048, n: int = 2048) -> dict[str, float]:
    """ONNX Runtime's fp32 MatMul and int8 MatMulInteger peak at [m, k] x [k, n], FLOP/s (2 per multiply-add)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    out = {}
    for name, op, xt, w in (
            ("fp32", "MatMul", TensorProto.FLOAT, rng.standard_normal((k, n)).astype(np.float32)),
            ("int8", "MatMulInteger", TensorProto.UINT8, rng.integers(-127, 127, (k, n)).astype(np.int8))):
        yt = TensorProto.FLOAT if op == "MatMul" else TensorProto.INT32
        g = helper.make_graph([helper.make_node(op, ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", xt, [m, k])],
                              [helper.make_tensor_value_info("y", yt, [m, n])], [numpy_helper.from_array(w, "w")])
        so = ort.SessionOptions()
        so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
        sess = ort.InferenceSession(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString(),
                                    so, providers=["CPUExecutionProvider"])
        x = (rng.standard_normal((m, k)).astype(np.float32) if op == "MatMul"
             else rng.integers(0, 255, (m, k)).astype(np.uint8))
        sess.run(None, {"x": x})
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            sess.run(None, {"x": x})
            times.append(time.perf_counter() - t)
        out[name] = 2.0 * m * k * n / min(times)
    return out


def host_record() -> dict:
    """Date, CPU model, cores and the load average, for every figure's record."""
    cpu = platform.processor() or ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu, "cores": os.cpu_count(),
            "load_average": os.getloadavg()}


def machine_limits(threads: int, repeats: int = 5) -> dict:
    """:func:`measure_bandwidth` and :func:`measure_gemm` with the host record; ``bandwidth``: the triad figure."""
    bw = measure_bandwidth(threads, repeats)
    return {"host": host_record(), "threads": threads, "bandwidth_bytes_per_s": bw, "bandwidth": bw["triad"],
            "gemm_flops_per_s": measure_gemm(threads, repeats)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifact", action="append", default=[], help="artifact folder (repeatable)")
    p.add_argument("--threads", type=int, default=2, help="threads for the measurements (default: 2)")
    p.add_argument("--repeats", type=int, default=5, help="repeats; the best counts (default: 5)")
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = p.parse_args(argv)
    lim = machine_limits(args.threads, args.repeats)
    h = lim["host"]
    print(f"{h['date']}, {h['cpu']}, {args.threads} threads, load average {h['load_average'][0]:.2f}")
    for k, v in lim["bandwidth_bytes_per_s"].items():
        print(f"  bandwidth {k:5s}: {v / 1e9:6.1f} GB/s")
    for k, v in lim["gemm_flops_per_s"].items():
        print(f"  GEMM {k}:       {v / 1e9:6.1f} GFLOP/s (ONNX Runtime, M=256, K=N=2048)")
    lim["artifacts"] = {}
    for a in args.artifact:
        t = artifact_traffic(a)
        step = t["model"].weight_bytes
        lim["artifacts"][a] = {g: asdict(x) for g, x in t.items()}
        print(f"{a}: step graph {step / 1e6:.1f} MB, {t['model'].macs_per_row / 1e6:.1f} M MACs a row; "
              f"heads graph {t['heads'].weight_bytes / 1e6:.1f} MB" if "heads" in t else "")
        print(f"  plain decoding cannot beat {limit_tokens_per_second(lim['bandwidth'], step):.1f} tokens/s here; "
              f"compute bound at one row: {lim['gemm_flops_per_s']['fp32'] / (2 * t['model'].macs_per_row):.0f} tokens/s (fp32)")
    if args.json:
        Path(args.json).write_text(json.dumps(lim, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
