"""Activation ranges for W8A8 typed graphs (int8, fp8): the max |x| each weight product's input reaches while the
artifact's own float32 graphs decode calibration prompts on ONNX Runtime.

A copy of each graph with the products' inputs added as outputs is written beside it (so its external weights
resolve) and removed afterwards; the copies run through the runtime's own ONNX Runtime engine and decode loop (the
artifact's tree: prefills, tree steps and the heads), so the ranges cover every shape the step sees. Per-tensor
max-abs (TensorRT's "max" calibration); the prompts' SHA-256 goes into the record.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from medusa_runtime.contract.artifact import load_artifact
from medusa_runtime.contract.tokenizer import RuntimeTokenizer
from medusa_runtime.decode.loop import generate
from medusa_runtime.engines.ort import OrtEngine

from ..errors import MedusaError


def product_inputs(model: onnx.ModelProto) -> list[str]:
    """The activation input (input 0) of every MatMul / Gemm whose second input is a weight (an initializer), in
    graph order, each once."""
    inits = {t.name for t in model.graph.initializer}
    out = []
    for n in model.graph.node:
        if n.op_type in ("MatMul", "Gemm") and len(n.input) > 1 and n.input[1] in inits and n.input[0] not in out:
            out.append(n.input[0])
    return out


def activation_ranges(folder: Path, files: dict[str, str], prompts: list[str], *, new_tokens: int = 16,
                      progress: bool = True) -> tuple[dict[str, dict[str, float]], dict]:
    """Calibrate: max |x| of every weight product's input, per graph.

    Args:
        folder: the artifact (float32 graphs).
        files: graph name -> artifact-relative ONNX (the model and heads graphs).
        prompts: calibration prompts (user messages), at least one.
        new_tokens: tokens decoded per prompt (prefill plus tree steps).
        progress: print a line per prompt.

    Returns:
        ({graph: {tensor: max |x|}}, a record: method, prompts, their SHA-256, tokens).

    Raises:
        MedusaError: no prompt, or a product whose input the prompts never reached (a zero range).
    """
    if not prompts:
        raise MedusaError("W8A8 calibration needs at least one prompt (--prompt-file FILE with one or more records)")
    folder = Path(folder).resolve()  # the copies are named by absolute path in the view below
    art = load_artifact(folder)
    tok = RuntimeTokenizer.from_artifact(art)
    ids = [tok.apply_chat_template([{"role": "user", "content": t}]) if tok.has_chat_template else tok.encode(t)
           for t in prompts]
    amax: dict[str, dict[str, float]] = {g: {} for g in files}
    names: dict[str, list[str]] = {}
    copies = {}
    try:
        for graph, rel in files.items():
            model = onnx.load(str(folder / rel), load_external_data=False)
            names[graph] = product_inputs(model)
            graph_inputs = {i.name for i in model.graph.input}
            inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False).graph.value_info
            elem = {v.name: v.type.tensor_type.elem_type for v in inferred}  # float16 in a float16 graph
            for x in names[graph]:
                if x not in graph_inputs:
                    model.graph.output.append(helper.make_tensor_value_info(x, elem.get(x, TensorProto.FLOAT), None))
            copy = folder / f".{Path(rel).stem}.ranges-{os.getpid()}.onnx"
            onnx.save(model, str(copy))
            copies[graph] = copy
        view = replace(art, manifest=replace(art.manifest, files={**art.manifest.files,
                                                                  **{g: str(p) for g, p in copies.items()}}))
        engine = OrtEngine(view)
        sessions = {"model": engine.step_session, "heads": engine.heads_session}
        for graph, session in sessions.items():
            if session is None or graph not in names:
                continue
            run = session.run

            def spy(outputs, feed, *rest, _run=run, _graph=graph):
                wanted = [x for x in names[_graph] if x not in feed]
                values = _run(list(outputs) + wanted, feed, *rest)
                seen = {**{x: feed[x] for x in names[_graph] if x in feed}, **dict(zip(wanted, values[len(outputs):]))}
                for x, v in seen.items():
                    amax[_graph][x] = max(amax[_graph].get(x, 0.0), float(np.abs(np.asarray(v, np.float32)).max()))
                return values[:len(outputs)]

            session.run = spy
        for text, prompt in zip(prompts, ids):
            generate(engine, prompt, art.tree, max_new_tokens=new_tokens, eos_token_ids=list(tok.eos_token_ids),
                     max_context=art.model.max_context)
            if progress:
                print(f"    calibrated on {text[:40]!r}", flush=True)
    finally:
        for copy in copies.values():
            copy.unlink(missing_ok=True)
    missing = [f"{g}:{x}" for g in names for x in names[g] if amax[g].get(x, 0.0) <= 0.0]
    if missing:
        raise MedusaError(f"the calibration prompts never reached {', '.join(missing[:5])}: give prompts that run the "
                          f"whole step graph")
    digest = hashlib.sha256("\n".join(prompts).encode()).hexdigest()
    record = {"method": "max |x| per tensor over the decode of the calibration prompts (float32 graphs, ONNX Runtime)",
              "prompts": len(prompts), "prompts_sha256": digest, "new_tokens": new_tokens}
    return amax, record
