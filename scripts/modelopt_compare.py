"""Our W8A8 placements and activation scales beside NVIDIA ModelOpt's ``modelopt.onnx.quantization`` on one step graph.

    python scripts/modelopt_compare.py --artifact ART [--mode int8|fp8] [--json OUT]

ModelOpt (0.47) quantizes the artifact's float32 step graph (``model.onnx``) with its max calibration on ONNX Runtime's
CPU, fed one prefill of the first of the project's calibration prompts (past length 0); ours calibrates the same prompt
(:func:`medusa_export.trt.ranges.calibrate`) and writes the typed graph (:func:`medusa_export.trt.typed.
write_typed_graphs`). Printed: the weight products each quantizes, the ops ModelOpt puts Q/DQ on that we do not, and
per product the ratio of ModelOpt's activation scale to ours (1.0: the same max |x| / qmax). ModelOpt loads the whole
graph into memory: an embedded-model-size check, not a 7B one.
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def _feed(art, ids: list[int]) -> dict[str, np.ndarray]:
    n = len(ids)
    feed = {"input_ids": np.asarray([ids], np.int64), "position_ids": np.arange(n, dtype=np.int64)[None],
            "new_token_mask": np.tril(np.ones((n, n), bool)), "temperature": np.ones(1, np.float32),
            "sample_uniforms": np.zeros((1, n), np.float32), "sample_top_k": np.ones(1, np.int64),
            "sample_top_p": np.ones(1, np.float32)}
    m = art.model
    for i in range(m.num_layers):
        for kv in ("key", "value"):
            feed[f"past_key_values.{i}.{kv}"] = np.zeros((1, 0, m.num_kv_heads, m.head_dim), np.float32)
    return feed


def _qdq_products(model, inits: set[str]) -> dict[str, dict]:
    """{weight initializer: {"act_scale": float or None}} for every MatMul / Gemm whose inputs come through DQ."""
    import onnx
    from onnx import numpy_helper

    producer = {o: n for n in model.graph.node for o in n.output}
    values = {t.name: t for t in model.graph.initializer}
    out = {}
    for n in model.graph.node:
        if n.op_type not in ("MatMul", "Gemm") or len(n.input) < 2:
            continue
        w = producer.get(n.input[1])
        a = producer.get(n.input[0])
        if w is None or w.op_type != "DequantizeLinear":
            continue
        src = w.input[0]
        if src in producer and producer[src].op_type == "QuantizeLinear":  # ModelOpt: Q -> DQ of the float weight
            src = producer[src].input[0]
        wname = src
        # ModelOpt names the quantized weight after the float one; ours appends .int8 / .fp8
        for suffix in (".int8", ".fp8", "_quantized", "_i8", "_f8"):
            wname = wname.removesuffix(suffix)
        scale = None
        if a is not None and a.op_type == "DequantizeLinear" and a.input[1] in values:
            scale = float(numpy_helper.to_array(values[a.input[1]]).astype(np.float64).reshape(-1)[0])
        out[wname] = {"act_scale": scale}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--artifact", required=True)
    ap.add_argument("--mode", default="int8", choices=["int8", "fp8"])
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)

    import onnx
    from modelopt.onnx.quantization import quantize

    from medusa_export.trt.ranges import calibrate, default_calibration_prompts, prompt_ids
    from medusa_export.trt.typed import write_typed_graphs
    from medusa_runtime.contract.artifact import load_artifact
    from medusa_runtime.contract.tokenizer import RuntimeTokenizer

    folder = Path(a.artifact).resolve()
    art = load_artifact(folder)
    prompt = default_calibration_prompts()[:1]
    ids = prompt_ids(RuntimeTokenizer.from_artifact(art), prompt)[0]
    with tempfile.TemporaryDirectory(prefix="modelopt-", dir=folder.parent) as tmp:
        tmp = Path(tmp)
        for p in folder.iterdir():  # copies: onnx's checker refuses external data behind a symbolic link, and
            if p.is_dir():          # ModelOpt rewrites model.onnx in place (a hard link would change the artifact)
                if p.name != "engines":
                    shutil.copytree(p, tmp / p.name)
            else:
                shutil.copy2(p, tmp / p.name)
        cal = calibrate(folder, {"model": "model.onnx"}, prompt, progress=False)
        (tmp / "engines").mkdir()
        write_typed_graphs(tmp, {"model": "model.onnx"}, a.mode, calibration=cal)
        ours = onnx.load(str(tmp / f"engines/model.{a.mode}.onnx"), load_external_data=False)
        t0 = time.perf_counter()
        out = tmp / f"model.modelopt.{a.mode}.onnx"
        quantize(str(tmp / "model.onnx"), quantize_mode=a.mode, calibration_data=_feed(art, ids),
                 calibration_method="max", calibration_eps=["cpu"], high_precision_dtype="fp32",
                 use_external_data_format=True, output_path=str(out), log_level="WARNING")
        mo_seconds = time.perf_counter() - t0
        mo = onnx.load(str(out), load_external_data=True)
        if a.json:  # the graph without its weights, for a look node by node
            onnx.save(onnx.load(str(out), load_external_data=False), str(Path(a.json).with_suffix(".graph.onnx")))
        fp32 = onnx.load(str(folder / "model.onnx"), load_external_data=False)
        inits = {t.name for t in fp32.graph.initializer}
        theirs_q = _qdq_products(mo, inits)
        ours_q = _qdq_products(ours, inits)
        qmax = 127.0 if a.mode == "int8" else 448.0
        ratios = {w: theirs_q[w]["act_scale"] / ours_q[w]["act_scale"] for w in ours_q
                  if w in theirs_q and theirs_q[w]["act_scale"] and ours_q[w]["act_scale"]}
        q_inputs = collections.Counter()
        producer = {o: n for n in mo.graph.node for o in n.output}
        for n in mo.graph.node:
            if any(producer.get(x) is not None and producer[x].op_type == "DequantizeLinear" for x in n.input):
                q_inputs[n.op_type] += 1
        report = {"mode": a.mode, "modelopt_seconds": round(mo_seconds, 1), "calibration_tokens": len(ids),
                  "our_products": len(ours_q), "modelopt_products": len(theirs_q),
                  "only_ours": sorted(set(ours_q) - set(theirs_q))[:20],
                  "only_modelopt": sorted(set(theirs_q) - set(ours_q))[:20],
                  "modelopt_ops_reading_dq": dict(q_inputs),
                  "scale_ratio_modelopt_over_ours": {"min": min(ratios.values()) if ratios else None,
                                                     "max": max(ratios.values()) if ratios else None,
                                                     "median": float(np.median(list(ratios.values()))) if ratios
                                                     else None, "n": len(ratios)},
                  "qmax": qmax}
        print(json.dumps(report, indent=1))
        if a.json:
            Path(a.json).write_text(json.dumps({**report, "ratios": ratios}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
