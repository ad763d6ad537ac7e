"""Agreement of quantized typed graphs (trt/typed.py) with the artifact's float32 graphs, on evaluation prompts.

    python scripts/quant_agreement.py --artifact ART [--variants int4:rtn int4:awq int8 int8:sq0.5 fp8] [--prompts 8]
        [--new-tokens 48] [--prompt-file FILE] [--medusa] [--json OUT]

A variant is a precision with its scale method: ``int4:rtn`` / ``int4:awq`` (:func:`~medusa_export.trt.typed.
int4_block_scales`), ``int8`` / ``fp8`` (max calibration), ``int8:sqA`` (SmoothQuant with alpha A).

The evaluation prompts are MT-Bench's first turns from ``../shared/data/eval`` (``$MEDUSA_EXPORT_SHARED``) by default;
the calibration runs on the project's own calibration prompts (never the evaluation ones). Per prompt and variant,
on ONNX Runtime's CPU:

* ``first_divergence``: the first token where the variant's plain greedy decoding leaves the float32 graphs' (None:
  identical over ``--new-tokens``), with the float32 top-2 log-prob margin there;
* ``teacher_forced_top1``: the share of the float32 greedy continuation's tokens that the variant also ranks first,
  each predicted from the float32 prefix (one prefill of prompt + float32 tokens: no compounding of an early
  divergence), and ``mean_abs_dlogp``: mean |log p_variant - log p_fp32| of those tokens where both rank them in the
  top k.

Each variant's typed graphs are written into a shadow folder of symlinks to the artifact (its own ``engines/``), so
variants of one precision sit side by side and the artifact is not modified.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np


def _shadow(art: Path, where: Path) -> Path:
    where.mkdir(parents=True)
    for p in art.iterdir():
        if p.name != "engines":
            (where / p.name).symlink_to(p)
    return where


def _view(art, folder: Path, precision: str, graphs):
    files = {g: str(folder / f"engines/{g}.{precision}.onnx") for g in graphs}
    return replace(art, manifest=replace(art.manifest, files={**art.manifest.files, **files}))


def _teacher_forced(engine, prompt: list[int], tokens: list[int]):
    """(top-1 ids [n], log-prob of each fp32 token or nan where it is outside the top k [n]) from one prefill."""
    from medusa_runtime.decode.loop import causal_mask
    from medusa_runtime.engines.kvcache import KVCache

    seq = list(prompt) + list(tokens)
    out = engine.step(np.asarray(seq, np.int64)[None], np.arange(len(seq), dtype=np.int64)[None],
                      causal_mask(len(seq)), 1.0, KVCache.for_engine(engine, len(seq)).past())
    ids = out.topk_ids[len(prompt) - 1:len(seq) - 1]
    lps = out.topk_logprobs[len(prompt) - 1:len(seq) - 1]
    lp = np.array([lps[i][list(ids[i]).index(t)] if t in ids[i] else np.nan for i, t in enumerate(tokens)])
    return ids[:, 0], lp


def _row_consistency(engine, prompt: list[int], tokens: list[int], cuts: list[int]) -> tuple[float, int]:
    """How much the same row's prediction depends on the step's row count: for each cut c, the log-probs of the
    prediction after ``prompt + tokens[:c]`` from one prefill of all those rows, and from a prefill of all but the
    last row then a one-row step (its past from that prefill). Returns (max |difference| of the top-k log-probs,
    the cuts where the top-1 token differs)."""
    from medusa_runtime.decode.loop import causal_mask
    from medusa_runtime.engines.kvcache import KVCache

    worst, flips = 0.0, 0
    for c in cuts:
        seq = np.asarray(list(prompt) + list(tokens[:c]), np.int64)
        n = len(seq)
        whole = engine.step(seq[None], np.arange(n, dtype=np.int64)[None], causal_mask(n), 1.0,
                            KVCache.for_engine(engine, n).past())
        cache = KVCache.for_engine(engine, n)
        head = engine.step(seq[None, :-1], np.arange(n - 1, dtype=np.int64)[None], causal_mask(n - 1), 1.0,
                           cache.past())
        cache.keep(head.new_kv, np.arange(n - 1), seq[:-1])
        one = engine.step(seq[None, -1:], np.array([[n - 1]], np.int64), causal_mask(1), 1.0, cache.past())
        a, b = whole.topk_logprobs[n - 1], one.topk_logprobs[0]
        worst = max(worst, float(np.abs(a - b).max()))
        flips += int(whole.topk_ids[n - 1][0] != one.topk_ids[0][0])
    return worst, flips


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--artifact", required=True)
    ap.add_argument("--variants", nargs="+", default=["int4:rtn", "int4:awq"])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--prompt-file", default=None, help="evaluation prompts (default: MT-Bench first turns)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--medusa", action="store_true", help="also decode each variant with the artifact's tree: Medusa "
                    "== plain greedy of the same graph, or the token and top-2 margin where it leaves it")
    a = ap.parse_args(argv)

    from medusa_export.trt.ranges import calibrate, default_calibration_prompts
    from medusa_export.trt.typed_check import _margins
    from medusa_export.trt.typed import write_typed_graphs
    from medusa_runtime.contract.artifact import load_artifact
    from medusa_runtime.contract.tokenizer import RuntimeTokenizer
    from medusa_runtime.decode.loop import generate
    from medusa_runtime.engines.ort import OrtEngine
    from medusa_runtime.engines.trt_plan import plan_graphs
    from medusa_runtime.front.prompts import mt_bench_questions, read_first_turns
    from medusa_runtime.trees.tree import make_tree

    folder = Path(a.artifact).resolve()
    art = load_artifact(folder)
    texts = read_first_turns(a.prompt_file or mt_bench_questions(), a.prompts)
    tok = RuntimeTokenizer.from_artifact(art)
    ids = [tok.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    graphs = plan_graphs(art.manifest)
    files = {g: art.manifest.graphs[g].file for g in graphs}
    root = make_tree([], num_heads=art.model.medusa_heads, topk=art.tree.topk)
    kw = dict(max_new_tokens=a.new_tokens, eos_token_ids=[], max_context=art.model.max_context)
    fp32 = OrtEngine(art)
    ref = []
    for p in ids:
        toks = generate(fp32, p, root, **kw).tokens
        top1, lp = _teacher_forced(fp32, p, toks)
        assert list(top1) == toks  # the float32 prefill reproduces its own greedy decoding
        ref.append((toks, lp))
    t0 = time.perf_counter()
    cal = calibrate(folder, files, default_calibration_prompts(), progress=False)
    print(f"calibration: {time.perf_counter() - t0:.1f} s, {cal.record['tokens']} tokens", file=sys.stderr)
    rows = []
    with tempfile.TemporaryDirectory(prefix="quant-agreement-") as tmp:
        for v in a.variants:
            precision, _, method = v.partition(":")
            shadow = _shadow(folder, Path(tmp) / v.replace(":", "-"))
            t0 = time.perf_counter()
            alpha = float(method[2:]) if method.startswith("sq") else None
            write_typed_graphs(shadow, files, precision, calibration=cal,
                               int4_scales=method if precision == "int4" and method else "rtn", smooth_alpha=alpha)
            written = time.perf_counter() - t0
            eng = OrtEngine(_view(art, shadow, precision, graphs))
            for text, p, (toks, lp32) in zip(texts, ids, ref):
                got = generate(eng, p, root, **kw).tokens
                first = next((i for i, (x, y) in enumerate(zip(toks, got)) if x != y), None)
                top1, lp = _teacher_forced(eng, p, toks)
                both = ~np.isnan(lp) & ~np.isnan(lp32)
                medusa = None
                if a.medusa:
                    m = generate(eng, p, art.tree, **kw).tokens
                    j = next((i for i, (x, y) in enumerate(zip(got, m)) if x != y), None)
                    medusa = "equal" if j is None else f"leaves plain greedy at token {j}, margin " \
                        f"{float(_margins(eng, p, got[:j])[-1]):.3f}"
                    rc = _row_consistency(eng, p, toks, list(range(4, len(toks), 8)))
                    medusa += f"; one-row vs many-row step: max |d logp| {rc[0]:.3f}, top-1 flips {rc[1]}"
                rows.append({"variant": v, "prompt": text[:50], "first_divergence": first, "medusa_vs_plain": medusa,
                             "teacher_forced_top1": round(float(np.mean(np.asarray(top1) == np.asarray(toks))), 4),
                             "mean_abs_dlogp": round(float(np.abs(lp - lp32)[both].mean()), 4),
                             "write_seconds": round(written, 1)})
                print(json.dumps(rows[-1]), flush=True)
    summary = {}
    for v in a.variants:
        r = [x for x in rows if x["variant"] == v]
        summary[v] = {"teacher_forced_top1": round(float(np.mean([x["teacher_forced_top1"] for x in r])), 4),
                      "mean_abs_dlogp": round(float(np.mean([x["mean_abs_dlogp"] for x in r])), 4),
                      "identical_prompts": sum(x["first_divergence"] is None for x in r),
                      "median_first_divergence": float(np.median([x["first_divergence"] if x["first_divergence"]
                                                                  is not None else a.new_tokens for x in r]))}
    print(json.dumps(summary, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "summary": summary, "new_tokens": a.new_tokens,
                                            "prompts": len(texts), "calibration": cal.record}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
