"""Validating a typed graph (:mod:`.typed`) on ONNX Runtime's CPU, before TensorRT sees it.

Two checks per prompt (the project's own validation prompts, or a user's):

1. lossless to its own precision: Medusa decoding of the typed graphs (the artifact's tree) gives exactly the tokens
   of plain greedy decoding (a root-only tree) of the same graphs, up to a near-tie: a tree step and a one-token
   step are products of different shapes, whose accumulation order differs, so where the typed graph's own top-2
   log-prob margin is below the precision's :data:`NEAR_TIE` a low-precision rounding may pick the other token
   (DESIGN.md, "Precision and parity"); the step and margin are reported. This is pass / fail;
2. agreement with float32: the typed graphs' greedy tokens against the artifact's own float32 graphs (which the
   build validated against PyTorch), with the first divergence and the float32 top-2 log-prob margin there
   (a small margin is a near-tie that any rounding may flip); this is reported, not pass / fail.

bfloat16: ONNX Runtime 1.32's CPU has no bfloat16 MatMul, so the bf16 graph runs as
:func:`~.typed.rounded_in_float32` makes it: every node that computes in bfloat16 computes in float32 and rounds its
output to bfloat16, and every cast to bfloat16 rounds. The rounding points are the typed graph's; what differs is
only the accumulation inside a product (float32 here, as on a GPU's tensor cores). The report says so.
"""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx

from medusa_runtime.contract.artifact import load_artifact
from medusa_runtime.contract.tokenizer import RuntimeTokenizer
from medusa_runtime.decode.loop import causal_mask, generate
from medusa_runtime.engines.ort import OrtEngine
from medusa_runtime.trees.tree import make_tree

from ..export.precisions import PRECISION_TABLE
from ..validation.validate import graph_margins
from .typed import TypedReport, rounded_in_float32

#: How each typed precision is run on ONNX Runtime's CPU (the report's ``checked_on``).
CHECKED_ON = {
    "fp16": "ONNX Runtime CPU, the typed float16 graph itself",
    "bf16": "ONNX Runtime CPU, the typed bfloat16 graph with its bfloat16 rounding points computed in float32 "
            "(no bfloat16 MatMul there)",
    "int4": "ONNX Runtime CPU, the typed graph itself (int4 blocked DequantizeLinear feeding float16 MatMuls)",
    "int8": "ONNX Runtime CPU, the typed graph itself (int8 Q/DQ on both inputs of every weight product)",
    "fp8": "ONNX Runtime CPU, the typed graph itself (float8 E4M3 Q/DQ on both inputs of every weight product)",
}


#: The top-2 log-prob margin below which a Medusa-vs-plain divergence of a typed graph is a near-tie. fp16: the fp16
#: artifact's validation margin (``PRECISION_TABLE``); bf16: 8x it, as bfloat16's unit roundoff (2^-8) is 8x
#: float16's (2^-11): at logits of magnitude 16-32 one bf16 ulp is 0.125. int4, int8 and fp8: their Q/DQ graph form's
#: (``PRECISION_TABLE[p].portable.near_tie``: 0, exact, as they run in their row regime here: one-token steps as two
#: rows), the rule the build's validation of the same graph uses.
NEAR_TIE = {"fp16": 0.1, "bf16": 0.8, **{p: PRECISION_TABLE[p].portable.near_tie for p in ("int4", "int8", "fp8")}}


def _fp32_run(engine, prompt: list[int], root, new_tokens: int, eos: list[int], cap: int) -> tuple[list[int], np.ndarray]:
    """Plain greedy decoding of the float32 graphs and the top-2 margin of each of its predictions (:func:`~medusa_export.validation.validate.graph_margins`)."""
    tokens = generate(engine, prompt, root, max_new_tokens=new_tokens, eos_token_ids=eos, max_context=cap).tokens
    return tokens, graph_margins(engine, prompt, tokens)


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def validate_typed(folder: Path, report: TypedReport, *, prompts: list[str] | None = None, new_tokens: int = 64,
                   progress: bool = True) -> dict:
    """Run the module's two checks on the typed graphs ``report`` lists.

    Args:
        folder: the artifact (its float32 graphs are the reference).
        report: what :func:`~.typed.write_typed_graphs` wrote.
        prompts: user messages (default: the project's validation prompts).
        new_tokens: greedy tokens per prompt.
        progress: print a line per prompt.

    Returns:
        A JSON-able record: ``passed`` (Medusa == plain greedy on every prompt, up to near-ties), ``checked_on``,
        ``near_tie_margin``, and per prompt the
        tokens compared, ``medusa_equals_plain`` (else ``medusa_divergence``, its ``medusa_margin`` and ``near_tie``),
        ``first_divergence_from_fp32`` (None: identical) with the fp32
        token, the typed graph's token and the fp32 ``margin`` there, and the mean accepted tokens per step.
    """
    from ..validation.validate import default_prompts

    folder = Path(folder).resolve()  # the view below names its files by absolute path (a relative folder doubled)
    art = load_artifact(folder)
    texts = prompts or default_prompts()
    tok = RuntimeTokenizer.from_artifact(art)
    ids = [tok.apply_chat_template([{"role": "user", "content": t}]) if tok.has_chat_template else tok.encode(t)
           for t in texts]
    eos = list(tok.eos_token_ids)
    with tempfile.TemporaryDirectory(prefix="typed-check-") as tmp:
        files = {}
        for graph, rec in report.graphs.items():
            path = folder / rec["file"]
            if report.precision == "bf16":
                rounded = rounded_in_float32(onnx.load(str(path), load_external_data=False), path.parent)
                path = Path(tmp) / f"{graph}.rounded.onnx"
                onnx.save(rounded, str(path))
            files[graph] = str(path)
        view = replace(art, manifest=replace(art.manifest, files={**art.manifest.files, **files}))
        reference = OrtEngine(art)
        ref = "fp32" if art.manifest.precision.kv_dtype == "float32" else "fp16"  # an fp16 artifact: its own graphs
        if progress:
            print(f"    the float32 graphs' greedy tokens and margins ({len(ids)} prompts x {new_tokens} tokens) ...",
                  flush=True)
        root = make_tree([], num_heads=art.model.medusa_heads, topk=art.tree.topk)
        cap = art.model.max_context
        runs = [_fp32_run(reference, prompt, root, new_tokens, eos, cap) for prompt in ids]
        typed = OrtEngine(view)
        if report.precision in PRECISION_TABLE and PRECISION_TABLE[report.precision].qdq:
            # the Q/DQ graphs' row regime on ONNX Runtime (ExportConfig.step_rows): one-token steps as two rows
            typed.capabilities = replace(typed.capabilities, min_rows=2)
        kw = dict(max_new_tokens=new_tokens, eos_token_ids=eos, max_context=cap)
        out = []
        for text, prompt, (fp32_tokens, fp32_margins) in zip(texts, ids, runs):
            medusa = generate(typed, prompt, art.tree, **kw)
            plain = generate(typed, prompt, root, **kw)
            i = _first_difference(fp32_tokens, plain.tokens)
            rec = {"prompt": text[:60], "tokens": len(plain.tokens), "medusa_equals_plain": medusa.tokens == plain.tokens,
                   "mean_accepted": round(medusa.mean_accepted, 3), "first_divergence_from_fp32": i}
            if i is not None:
                rec.update(fp32_token=fp32_tokens[i] if i < len(fp32_tokens) else None,
                           typed_token=plain.tokens[i] if i < len(plain.tokens) else None,
                           fp32_margin=round(float(fp32_margins[min(i, len(fp32_margins) - 1)]), 5))
            j = _first_difference(plain.tokens, medusa.tokens)
            rec["passed"] = j is None
            if j is not None:
                margin = float(graph_margins(typed, prompt, plain.tokens[:j])[-1])
                rec.update(medusa_divergence=j, medusa_margin=round(margin, 5),
                           near_tie=margin < NEAR_TIE[report.precision])
                rec["passed"] = rec["near_tie"]
            out.append(rec)
            if progress:
                agree = f"identical to {ref}" if i is None else f"diverges from {ref} at token {i} ({ref} margin " \
                                                                f"{rec['fp32_margin']})"
                same = "Medusa == plain greedy" if j is None else \
                    (f"Medusa leaves plain greedy at token {j} (a near-tie: margin {rec['medusa_margin']})"
                     if rec["near_tie"] else f"Medusa LEAVES plain greedy at token {j} (margin {rec['medusa_margin']})")
                print(f"    {report.precision} typed graph, {text[:40]!r}: {same}; {agree}", flush=True)
    return {"checked_on": CHECKED_ON[report.precision], "passed": all(r["passed"] for r in out),
            "reference": f"the artifact's own {ref} graphs (the fp32_* fields: {ref})",
            "near_tie_margin": NEAR_TIE[report.precision],
            "new_tokens": new_tokens, "prompts": out,
            "agreement_with_fp32": round(float(np.mean([1.0 if r["first_divergence_from_fp32"] is None else
                                                        r["first_divergence_from_fp32"] / max(1, r["tokens"])
                                                        for r in out])), 4)}
