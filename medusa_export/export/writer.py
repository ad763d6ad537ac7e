"""Both graphs of an artifact written from the model's tensor sources, weights streamed into ``weights.bin``.

Why the graphs are written and not traced (issue 13):

* memory independent of the model's size: nothing is traced and no model is built; each tensor is read
  from the checkpoint, converted, written and dropped (:mod:`.weights`), so the export's peak is a few
  times its largest tensor, not the model in fp32;
* int8 / int4 quantized per tensor: MatMulNBits blocks computed for each weight with ONNX Runtime's own
  kernels as it is written, no whole-graph quantizer pass that loads every initializer;
* one place implements every family switch (RoPE scaling, biases, q/k norm, head_dim, sliding window,
  tied embeddings) for both step flavours (:mod:`.portable`, :mod:`.fused`);
* node names are ours (the TensorRT float32 layer list finds every RMSNorm chain by name);
* no ``torch.onnx`` export time (minutes for a 7B model).

The PyTorch reference (``model/``) stays what the graphs are checked against.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from ..loading.checkpoint import check_disk
from ..loading.sources import ModelSources
from .config import ExportConfig
from .contract import HEADS_FILE, LEVEL_FILE, MODEL_FILE, level_key
from .fused import write_fused_step
from .graph import GraphBuilder
from .heads_graph import write_heads, write_level
from .precisions import PRECISION_TABLE
from .portable import lm_head_key, write_portable_step
from .weights import WEIGHTS_FILE, WeightsPlan, WeightsWriter


@dataclass
class WrittenGraphs:
    """What :func:`write_graphs` produced.

    Attributes:
        weights: the manifest's ``weights`` fields (``tensors``, ``bytes``, ``deduplicated``, ``records``).
        quantized: MatMulNBits / float MatMul counts per quantized graph file.
        seconds: wall time of the whole write.
    """

    weights: dict
    quantized: dict
    seconds: float


def _lay_out(weights: WeightsPlan, src: ModelSources, cfg: ExportConfig, topk: int, vocab_ids: np.ndarray | None,
             vocab_origin: str, max_context: int) -> dict[str, tuple]:
    """Both graphs' nodes, their weights added to ``weights``; {file: (builder, inputs, outputs, name, producer)}."""
    bc = src.config
    step_q = cfg.weight_only(cfg.precision)
    lm_q = step_q if step_q is not None and step_q.vocab_projection else None
    step = GraphBuilder(weights, cfg.graphs_dtype, step_q)
    if cfg.graph == "fused":
        chain = (cfg.step_rows or {}).get("trees") == "chain"
        ins, outs = write_fused_step(step, bc, max_context, lm_q, batched=cfg.batched, chain=chain)
        graphs = {MODEL_FILE: (step, ins, outs, "medusa_step_fused", "medusa-export (fused)")}
    else:
        ins, outs = write_portable_step(step, bc, lm_q, batched=cfg.batched)
        graphs = {MODEL_FILE: (step, ins, outs, "medusa_step", "medusa-export")}
    hp = cfg.resolved_heads_precision
    hq, hc = cfg.weight_only(hp, True), src.heads_config
    hd = cfg.graphs_dtype if hp == cfg.precision else PRECISION_TABLE[hp].graphs["contrib"].dtype  # MatMulNBits heads
    if hc.head_type == "hydra":  # path-conditioned heads: one graph per tree level
        for j in range(1, hc.num_heads + 1):
            level = GraphBuilder(weights, hd)
            ins, outs = write_level(level, hc, lm_head_key(bc), j, topk, hq, vocab_ids, vocab_origin)
            graphs[LEVEL_FILE.format(j)] = (level, ins, outs, f"medusa_heads_level{j}", "medusa-export")
        return graphs
    heads = GraphBuilder(weights, hd)
    ins, outs = write_heads(heads, hc, lm_head_key(bc), topk, hq, vocab_ids, vocab_origin)
    graphs[HEADS_FILE] = (heads, ins, outs, "medusa_heads", "medusa-export")
    return graphs


def heads_files(head_type: str, num_heads: int) -> dict[str, str]:
    """The heads graphs' manifest keys and file names: ``{"heads": "heads.onnx"}`` for Medusa heads,
    ``{"heads_level{j}": "heads_level{j}.onnx"}`` for j = 1..K for path-conditioned ones."""
    if head_type == "hydra":
        return {level_key(j): LEVEL_FILE.format(j) for j in range(1, num_heads + 1)}
    return {"heads": HEADS_FILE}


def plan_graphs(src: ModelSources, cfg: ExportConfig, topk: int, vocab_ids: np.ndarray | None = None,
                max_context: int = 2048) -> WeightsPlan:
    """The weights both graphs need, from the headers only (names, shapes, bytes): nothing is read."""
    plan = WeightsPlan(src.by_name)
    _lay_out(plan, src, cfg, topk, vocab_ids, "", max_context)
    return plan


def write_graphs(folder: Path, src: ModelSources, cfg: ExportConfig, topk: int, *, vocab_ids: np.ndarray | None = None,
                 vocab_origin: str = "", max_context: int = 2048, progress: bool = True) -> WrittenGraphs:
    """Write ``model.onnx``, the heads graphs (``heads.onnx``, or ``heads_level{j}.onnx`` for path-conditioned
    heads, :func:`heads_files`) and ``weights.bin`` into ``folder`` from ``src``.

    Args:
        folder: an existing, empty folder (the build's temporary one).
        src: backbone and heads sources with their configs (a truncated config writes only its layers).
        cfg: precisions and graph flavour.
        topk: candidates per head in the heads graph.
        vocab_ids: the heads' token subset (None: the whole vocabulary); vocab_origin: where it comes from.
        max_context: the fused graph's rotary tables length.
        progress: a progress bar per tensor, with throughput.

    Raises:
        InsufficientDiskError: the plan's bytes exceed the folder's free space (nothing written).
        CheckpointError: a source tensor cannot be read.
    """
    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    planned = plan_graphs(src, cfg, topk, vocab_ids, max_context).nbytes()
    check_disk(folder, planned, WEIGHTS_FILE)
    bar = tqdm(total=planned, unit="B", unit_scale=True, unit_divisor=1000, desc="writing weights",
               disable=not progress, mininterval=0.5, leave=False)
    last = [""]

    def tick(n: int, name: str) -> None:
        bar.update(n)
        if name != last[0]:
            last[0] = name
            bar.set_postfix_str(name[-48:], refresh=False)

    writer = WeightsWriter(folder / WEIGHTS_FILE, src.by_name, tick)
    try:
        graphs = _lay_out(writer, src, cfg, topk, vocab_ids, vocab_origin, max_context)
        info = writer.close()
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()
    quantized = {}
    for file, (b, ins, outs, name, producer) in graphs.items():
        contrib = any(n.domain for n in b.nodes)
        onnx.save(b.model(name, ins, outs, producer, contrib), str(folder / file))
        n_q = sum(n.op_type == "MatMulNBits" for n in b.nodes)
        if n_q:
            inits = b.weight_names
            n_float = sum(n.op_type in ("MatMul", "Gemm") and len(n.input) > 1 and n.input[1] in inits for n in b.nodes)
            quantized[file] = {"quantized": n_q, "float_matmuls": n_float}
    return WrittenGraphs(info, quantized, time.perf_counter() - t0)
