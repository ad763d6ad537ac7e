"""The artifact's ``manifest.json``, as ``build`` writes it: model, precision, graphs, KV layout, files.

Functions of the loaded model, the build options and the files already written into the
artifact folder (their checksums); :func:`build_manifest` returns the whole document as the runtime's
typed :class:`~medusa_runtime.contract.manifest.Manifest` (the contract), :func:`write_manifest` writes it and
:func:`write_schema` the JSON Schema beside it.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
from pathlib import Path

import numpy as np
import torch

from medusa_runtime.decode.acceptance import TypicalConfig
from medusa_runtime.contract.artifact import sha256_file
from medusa_runtime.contract.manifest import (ARTIFACT_FORMAT, ARTIFACT_VERSION, MANIFEST, MANIFEST_SCHEMA, Batch, Checksum,
                                     Exporter, Graph, Heads, HeadsVocab, KvLayout, Manifest, ModelInfo, Precision,
                                     StepSampler, TokenizerInfo, TreeInfo, TypicalDefaults, Weights, schema_text)
from medusa_runtime.trees.tree import Tree

from ..loading.draft_vocab import DRAFT_VOCAB_FILE
from ..loading.registry import LoadedMedusa
from ..loading.sources import ModelSources
from ..model.medusa import STEP_TOPK
from .config import ExportConfig
from .contract import OPSET, heads_io, level_io, level_key, step_io, step_sampler_json
from .fused import FUSED_OPS, fused_step_io
from .precisions import PRECISION_TABLE
from .quantize import uses_contrib_ops

#: The artifact's ``flavour``: which runtimes can run its graphs.
FLAVOURS = {"portable": "standard ONNX ops only (ONNX Runtime and TensorRT)",
            "ort-contrib": "uses ONNX Runtime contrib ops (com.microsoft); ONNX Runtime only, not TensorRT",
            "ort-fused": "step graph written with ONNX Runtime's fused contrib ops (com.microsoft), head-major KV cache "
                         "written in place; ONNX Runtime CPU only, not TensorRT"}


def _precision_json(cfg: ExportConfig, dtype: str, quantized: dict) -> dict:
    def weights(precision: str, heads: bool) -> str:
        wo = cfg.weight_only(precision, heads)
        if wo is not None:
            return wo.describe()
        if cfg.qdq and precision == cfg.precision:
            return PRECISION_TABLE[precision].scheme
        return cfg.graphs_dtype if precision == cfg.precision else PRECISION_TABLE[precision].dtype

    heads = cfg.resolved_heads_precision
    out = {"name": cfg.precision, "weights": weights(cfg.precision, False), "heads": heads,
           "heads_weights": weights(heads, True), "quantized_matmuls": quantized,
           "kv_dtype": dtype, "norm_and_softmax": "float32"}
    if cfg.step_rows is not None:
        out["step_rows"] = cfg.step_rows
    return out


def _flavour(folder: Path, files: list[str], graph: str) -> tuple[str, list[str]]:
    ops = sorted({op for f in files for op in uses_contrib_ops(folder / f)})
    if graph == "fused":  # SimplifiedLayerNormalization is ONNX Runtime's own op in the default domain
        return "ort-fused", sorted(set(ops) | set(FUSED_OPS))
    return ("ort-contrib" if ops else "portable"), ops


def _step_graph_json(src: ModelSources, cfg: ExportConfig, dtype: str, max_context: int, tree_size: int,
                     file: str) -> tuple[dict, dict]:
    """The manifest's ``kv_layout`` and ``graphs.model`` entries of the build's step graph."""
    s_dim = "new tokens: prompt length for prefill, tree size T for a tree step"
    if cfg.graph == "fused" and cfg.batched:
        s_in, s_out = fused_step_io(src.config, STEP_TOPK, batched=True)
        layout = {
            "layout": "head-major",
            "shape": "[B, H_kv, C, D] per layer, separate key and value buffers; row b's valid slots [0, P_b), "
                     "C >= the longest row's past (the runtime passes the rows' pasts packed to C = max P_b)",
            "inputs": "past_key_values.{i}.key / .value: the rows' buffers, read only; past_sequence_length [B]",
            "outputs": "new_key_values.{i}.key / .value [B, H_kv, S, D]: this step's K/V of each row",
            "compaction": "per row b: write new_key_values[b] into slots [P_b, P_b + S) of its buffer, then move "
                          "node accepted[i] to slot P_b + i along axis 2 where they differ",
        }
        dims = {"B": f"sequences in the call, dynamic (built for up to {cfg.batch_size})", "S": s_dim + " (shorter "
                "rows padded)", "C": f"KV slots passed, max_b P_b <= C <= max_context ({max_context}: the rotary "
                "tables end there)"}
        return layout, {"file": file, "inputs": [t.to_json() for t in s_in], "outputs": [t.to_json() for t in s_out],
                        "dims": dims}
    if cfg.graph == "fused":
        s_in, s_out = fused_step_io(src.config, STEP_TOPK)
        layout = {
            "layout": "head-major",
            "shape": "[1, H_kv, C, D] per layer (C = the runtime's cache capacity), separate key and value buffers",
            "inputs": "past_key_values.{i}.key / .value: the whole buffers; past_sequence_length = P valid slots",
            "outputs": "present.{i}.key / .value: bind each to its past_key_values buffer (I/O binding); the step "
                       "writes node j's K/V into slot P + j in place",
            "compaction": "after acceptance move node accepted[i] to slot P + i along axis 2 where they differ",
        }
        dims = {"S": s_dim, "C": f"KV buffer capacity in slots, S + P <= C <= max_context ({max_context}: the "
                                 "rotary tables end there)"}
        graph = {"file": file, "inputs": [t.to_json() for t in s_in], "outputs": [t.to_json() for t in s_out],
                 "dims": dims}
        return layout, graph
    s_in, s_out = step_io(src.config, dtype, STEP_TOPK, cfg.batched)
    if cfg.batched:
        return _batched_step_graph_json(cfg, max_context, tree_size, file, s_in, s_out, s_dim)
    layout = {
        "layout": "sequence-major",
        "shape": "[1, P, H_kv, D] per layer, separate key and value tensors (sequence-major)",
        "inputs": "past_key_values.{i}.key / .value: the P valid past tokens",
        "outputs": "new_key_values.{i}.key / .value: K/V of this step's S tokens only",
        "compaction": "after acceptance copy new_key_values[:, accepted] into cache slots [P, P + len(accepted))",
    }
    graph = {"file": file, "inputs": [t.to_json() for t in s_in], "outputs": [t.to_json() for t in s_out],
             "dims": {"S": s_dim, "P": "valid past length, 0 .. max_context - S"},
             "profiles": {"prefill": {"S": [1, max_context], "P": [0, max_context - 1]},
                          "tree_step": {"S": [tree_size, tree_size], "P": [0, max_context - tree_size]},
                          "decode": {"S": [1, 1], "P": [0, max_context - 1]}}}
    return layout, graph


def _batched_step_graph_json(cfg: ExportConfig, max_context: int, tree_size: int, file: str, s_in, s_out,
                             s_dim: str) -> tuple[dict, dict]:
    """``kv_layout`` and ``graphs.model`` of the batched portable step (``--batch-size`` N > 1)."""
    n = cfg.batch_size
    layout = {
        "layout": "sequence-major",
        "shape": "[B, P, H_kv, D] per layer, separate key and value tensors (sequence-major); row b's valid past is "
                 "slots [0, past_sequence_length[b]), P the longest row's, the rest padding",
        "inputs": "past_key_values.{i}.key / .value: each row's valid past, padded to the longest; "
                  "past_sequence_length [B]: the rows' valid lengths",
        "outputs": "new_key_values.{i}.key / .value: K/V of this step's S tokens of each row only",
        "compaction": "per row b: copy new_key_values[b, accepted_b] into row b's slots [P_b, P_b + len(accepted_b))",
    }
    graph = {"file": file, "inputs": [t.to_json() for t in s_in], "outputs": [t.to_json() for t in s_out],
             "dims": {"B": f"sequences in the call, dynamic (built for up to {n})", "S": s_dim + " (shorter rows "
                      "padded)", "P": "past slots passed, >= the longest row's valid past (the runtime may "
                      "round it up: the slots beyond a row's past_sequence_length are masked), <= max_context"},
             "profiles": {"prefill": {"B": [1, n], "S": [1, max_context], "P": [0, max_context - 1]},
                          "tree_step": {"B": [1, n], "S": [tree_size, tree_size], "P": [0, max_context - tree_size]},
                          "decode": {"B": [1, n], "S": [1, 1], "P": [0, max_context - 1]}}}
    return layout, graph


def batch_json(cfg: ExportConfig) -> dict:
    """The manifest's ``batch`` entry of a batched artifact (absent from batch-1 ones)."""
    return {"version": 1, "dim": "B", "dynamic": True, "max_batch_size": cfg.batch_size,
            "note": "every step graph tensor has a leading batch dimension B; past_sequence_length [B] gives each "
                    "row's valid past (docs/batching.md)", "graph": cfg.graph}


def _heads_vocab_json(lm: LoadedMedusa, v: int, vocab_ids: np.ndarray | None) -> dict:
    """The manifest's ``heads_vocab``: how many tokens the heads graph projects onto, and where they came from."""
    if vocab_ids is None:
        return {"size": v, "vocab_size": v, "subset": False, "source": "the full vocabulary"}
    draft = lm.draft_vocab
    seen = len(draft.ids)
    return {"size": int(len(vocab_ids)), "vocab_size": v, "subset": True,
            "source": f"--heads-vocab {len(vocab_ids)}: the top {len(vocab_ids)} ids of the draft vocabulary "
                      f"({DRAFT_VOCAB_FILE} beside the heads {lm.heads_source}; {seen} ids by frequency in: "
                      f"{draft.source})" + (f"; the {len(vocab_ids) - seen} ids it never saw follow in id order"
                                            if len(vocab_ids) > seen else ""),
            "draft_vocab_ids": seen}


def recorded_source(source: str) -> str:
    """A model source as the manifest records it: a local file or folder as its absolute path (``verify`` opens it
    again from another working directory), anything else (a registry source, a repo id, a description) as is."""
    return os.path.abspath(source) if source and os.path.exists(source) else source


def build_manifest(lm: LoadedMedusa, src: ModelSources, tree: Tree, cfg: ExportConfig, max_context: int, folder: Path,
                   files: dict[str, str], weights_info: dict, dtype: str, quantized: dict,
                   vocab_ids: np.ndarray | None = None, unchanged: dict | None = None) -> Manifest:
    """The manifest of the artifact being written in ``folder``.

    Args:
        lm: the model the graphs were exported from (names, tokenizer, sources of the weights).
        src: its tensor sources and configs.
        tree: the artifact's tree.
        cfg: the build options (precisions, graph).
        max_context: KV capacity in tokens the graphs were built for.
        folder: the artifact folder; every file in it is checksummed (sha256, bytes), so the
            manifest is written last (the schema, :func:`write_schema`, before it).
        files: the artifact's file names by role (``model``, ``heads`` or ``heads_level{j}``, ``weights``, ``tree``,
            ``tokenizer``, ``chat_template``).
        weights_info: what :meth:`~medusa_export.export.weights.WeightsWriter.close` returned (``records``: each
            tensor's offset, length, SHA-256 and recipe).
        dtype: the graphs' float dtype name (``float32`` / ``float16``).
        quantized: MatMulNBits counts by graph file (empty for fp32 / fp16).
        vocab_ids: int64 [N], the heads' token subset (None: the full vocabulary).
        unchanged: file -> its :class:`Checksum` for files known not to have changed since they were last
            checksummed (not hashed again: ``weights.bin`` may be many GB).

    Returns:
        The manifest, without ``trt_readiness``, ``validation`` or ``tree.selection``, which later build
        stages add (``dataclasses.replace``).

    Raises:
        ArtifactError: a value of the wrong type (a bug of the writer: the runtime would refuse the artifact).
    """
    c = src.config
    h = src.heads_config
    layout, step_graph = _step_graph_json(src, cfg, dtype, max_context, tree.size, files["model"])
    heads_graphs = _heads_graphs_json(h, c.hidden_size, dtype, tree.topk, files)
    checksums = {}
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = f.relative_to(folder).as_posix()
        known = (unchanged or {}).get(rel)
        checksums[rel] = known or Checksum(sha256=sha256_file(f), bytes=f.stat().st_size)
    import onnx
    import onnxruntime

    from .. import __version__

    flavour, contrib = _flavour(folder, [files["model"], *(g["file"] for g in heads_graphs.values())], cfg.graph)
    return Manifest(
        format=ARTIFACT_FORMAT,
        format_version=ARTIFACT_VERSION,
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        exporter=Exporter(medusa_export=__version__, torch=torch.__version__, onnx=onnx.__version__,
                          onnxruntime=onnxruntime.__version__, opset=OPSET),
        model=ModelInfo(
            name=lm.name, backbone_source=recorded_source(lm.backbone_source),
            heads_source=recorded_source(lm.heads_source),
            architecture=c.model_type, features=c.features, vocab_size=c.vocab_size, hidden_size=c.hidden_size,
            num_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
            num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, rope_theta=c.rope_theta,
            medusa_heads=h.num_heads, medusa_layers=h.num_layers,
            medusa_own_projection=h.own_projection, max_context=max_context,
        ),
        precision=Precision.from_json(_precision_json(cfg, dtype, quantized), "precision"),
        heads_vocab=HeadsVocab.from_json(_heads_vocab_json(lm, c.vocab_size, vocab_ids), "heads_vocab"),
        flavour=flavour,
        flavour_note=FLAVOURS[flavour] + (f": {', '.join(contrib)}" if contrib else ""),
        step_topk=min(STEP_TOPK, c.vocab_size),
        step_sampler=None if cfg.batched else StepSampler.from_json(step_sampler_json(), "step_sampler"),
        batch=Batch.from_json(batch_json(cfg), "batch") if cfg.batched else None,
        kv_layout=KvLayout.from_json(layout, "kv_layout"),
        graphs={"model": Graph.from_json(step_graph, "graphs.model"),
                **{k: Graph.from_json(g, f"graphs.{k}") for k, g in heads_graphs.items()}},
        heads=Heads(type=h.head_type, num_heads=h.num_heads, num_layers=h.num_layers, runs=HEADS_RUNS[h.head_type]),
        weights=Weights.from_json({"file": files["weights"], **weights_info}, "weights"),
        tree=TreeInfo(file=files["tree"], size=tree.size, depth=tree.max_depth, topk=tree.topk),
        tokenizer=TokenizerInfo(dir="tokenizer", eos_token_ids=list(lm.eos_token_ids),
                                chat_template=files["chat_template"]),
        typical_defaults=TypicalDefaults(temperature=TypicalConfig.temperature,
                                         posterior_threshold=TypicalConfig.posterior_threshold,
                                         posterior_alpha=TypicalConfig.posterior_alpha),
        files=files,
        checksums=checksums,
    ).checked()


def write_manifest(folder: Path, manifest: Manifest) -> None:
    """Write ``manifest.json`` into ``folder`` (``to_json``, 2-space indented)."""
    (folder / MANIFEST).write_text(json.dumps(manifest.to_json(), indent=2) + "\n")


def write_schema(folder: Path) -> None:
    """Write the manifest's JSON Schema (``manifest.schema.json``) into ``folder``."""
    (folder / MANIFEST_SCHEMA).write_text(schema_text())


#: The manifest's ``heads.runs``: how a runtime runs each head type's graphs.
HEADS_RUNS = {"medusa": "heads.onnx once per step, on the last accepted node's hidden state",
              "hydra": "heads_level{j}.onnx once per tree level j = 1..K, on the paths that level expands"}


def _heads_graphs_json(h, hidden_size: int, dtype: str, topk: int, files: dict[str, str]) -> dict:
    """The manifest's ``graphs`` entries of the heads: ``heads`` (Medusa) or ``heads_level{j}`` (hydra)."""
    if h.head_type == "hydra":
        out = {}
        for j in range(1, h.num_heads + 1):
            ins, outs = level_io(hidden_size, j, dtype, topk)
            out[level_key(j)] = {"file": files[level_key(j)], "inputs": [t.to_json() for t in ins],
                                 "outputs": [t.to_json() for t in outs],
                                 "dims": {"R": "paths evaluated at this level (the nodes it expands)",
                                          "H": "1 (every path shares h_t) or R (one hidden row per path)"}}
        return out
    ins, outs = heads_io(hidden_size, h.num_heads, dtype, topk)
    return {"heads": {"file": files["heads"], "inputs": [t.to_json() for t in ins], "outputs": [t.to_json() for t in outs],
                      "dims": {"R": "hidden states to evaluate (1 in the decode loop)"}}}


def selection_json(table: list, chosen: int) -> dict:
    """The manifest's ``tree.selection`` for ``--tree auto``: the timed candidates and the chosen size."""
    from medusa_runtime.tuning.autotree import DEFAULT_MARGIN

    return {"method": "--tree auto: greedy trees (Medusa paper §2.3.3) timed on ONNX Runtime CPU on the build machine "
                      "(the tree step; plain decoding and the leading sizes also through the decode loop: loop_ms); "
                      "kept the most expected tokens per second, plain decoding unless a tree beats it by "
                      f"{DEFAULT_MARGIN:.0%}",
            "chosen": chosen, "candidates": [r.to_json() for r in table]}
