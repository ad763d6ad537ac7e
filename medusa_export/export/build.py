"""``medusa-export build``: model + tree -> a validated artifact directory.

Stages (each reads only what the previous wrote): export the two graphs, (quantize their
weights), merge their weights, write tree / tokenizer / manifest, validate, then
move the finished folder into place. Everything is written to a temporary sibling folder
first, so a failed or interrupted build leaves nothing half-written and an old artifact
intact.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import shutil
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from medusa_runtime.acceptance import TypicalConfig
from medusa_runtime.artifact import ARTIFACT_FORMAT, ARTIFACT_VERSION, MANIFEST, load_artifact, sha256_file
from medusa_runtime.tree import Tree

from ..errors import ArtifactError, MedusaError
from ..loading.registry import LoadedMedusa
from ..model.medusa import STEP_TOPK
from ..training.draft_vocab import DRAFT_VOCAB_FILE, HeadsVocabError, subset_ids
from ..trt.readiness import check_artifact
from .fused import FUSED_OPS, export_fused_step, fused_step_io
from .portable import (HEADS_FILE, MODEL_FILE, OPSET, WEIGHTS_FILE, export_heads, export_step, heads_io, merge_weights,
                       step_io)
from .quantize import WEIGHT_ONLY_BITS, WeightOnlyConfig, quantize_graph, uses_contrib_ops

#: Backbone precisions: fp32 / fp16 are portable (standard ONNX ops, the TensorRT path);
#: int8 / int4 are weight-only MatMulNBits graphs (ONNX Runtime only, see :mod:`.quantize`).
PRECISIONS = ("fp32", "fp16", *WEIGHT_ONLY_BITS)
#: Heads-graph precisions: "auto" (portable backbones: same; weight-only ones:
#: :data:`QUANTIZED_HEADS_DEFAULT`), "same" as the backbone, or a weight-only precision.
HEADS_PRECISIONS = ("auto", "same", *WEIGHT_ONLY_BITS)
#: The heads of a weight-only artifact under "auto": on SmolLM2-135M int8 heads cost 1.6 ms per step
#: against fp32's 4.3 ms on an idle machine, with 0.96 top-1 agreement (int4 0.65; see quantize.py).
QUANTIZED_HEADS_DEFAULT = "int8"
FLAVOURS = {"portable": "standard ONNX ops only (ONNX Runtime and TensorRT)",
            "ort-contrib": "uses ONNX Runtime contrib ops (com.microsoft); ONNX Runtime only, not TensorRT",
            "ort-fused": "step graph written with ONNX Runtime's fused contrib ops (com.microsoft), head-major KV cache "
                         "written in place; ONNX Runtime CPU only, not TensorRT"}
#: Backbone step graphs (``--graph``): "portable" traced standard ops (:mod:`.portable`), "fused" ONNX Runtime's
#: fused operators (:mod:`.fused`, flavour ``ort-fused``).
GRAPHS = ("portable", "fused")
#: Precisions the fused graph composes with (weight-only ones quantize its MatMuls; its activations are fp32).
FUSED_PRECISIONS = ("fp32", *WEIGHT_ONLY_BITS)


#: MatMulNBits accuracy level of a weight-only backbone by precision (see BuildConfig.accuracy_level).
BACKBONE_ACCURACY = {"int4": 1, "int8": 4}


class UnknownPrecisionError(MedusaError, ValueError):
    """A precision name is not one of the choices; the message lists them."""


class UnsupportedGraphError(MedusaError, ValueError):
    """A ``--graph`` name, or its combination with ``--precision``, is not supported; the message lists the choices."""


@dataclass(frozen=True)
class BuildConfig:
    """Options of ``build``; the CLI reads its defaults from here.

    Attributes:
        precision: backbone precision, one of :data:`PRECISIONS`.
        heads_precision: heads-graph precision, one of :data:`HEADS_PRECISIONS`; the heads only
            propose candidates the backbone verifies, so their precision never changes the output.
        max_context: KV capacity (None: the model's registered context).
        new_tokens: greedy tokens compared per validation prompt.
        validate: run the validation stage.
        block_size: MatMulNBits block size of the weight-only precisions.
        quantize_lm_head: quantize the (tied) lm_head in the backbone graph too (the embedding
            Gather always reads the float table).
        heads_vocab: 0 (the heads project onto the full vocabulary) or N: they project onto the
            top N ids of the model's draft vocabulary (:mod:`..training.draft_vocab`; topk <= N <= V). The
            heads graph then reads an [N, d] matrix instead of [V, d]; the output never changes
            (the backbone verifies), a correct guess outside the subset is lost.
        graph: backbone step graph, one of :data:`GRAPHS`: "portable" (traced standard ops; TensorRT
            too) or "fused" (ONNX Runtime fused operators, flavour ``ort-fused``; precisions
            :data:`FUSED_PRECISIONS`).
        accuracy_level: MatMulNBits compute type of the weight-only *backbone*: 4 (int8
            activations, VNNI; fastest), 1 (fp32 activations) or None (:data:`BACKBONE_ACCURACY`:
            1 for int4, 4 for int8). Level 4 quantizes activations, so fp32 rounding differences
            of 1e-6 between a tree step and one-token steps (different attention lengths) flip
            quantization steps that then grow through the layers: measured on SmolLM2-135M, a
            tree step's rows differ from one-token steps by up to 0.7 in the hidden state (level
            1: 1e-5), and Medusa diverged from plain greedy of the same graph after ~30 tokens.
            Level 1 keeps int4 lossless; ONNX Runtime has no fast fp32-compute kernel for 8-bit
            weights (468 ms a step), so int8 keeps level 4 and is not lossless. The heads graph
            always uses level 4 (its candidates are verified, so its rounding never changes the output).
    """

    precision: str = "fp32"
    heads_precision: str = "auto"
    max_context: int | None = None
    new_tokens: int = 64
    validate: bool = True
    block_size: int = 32
    quantize_lm_head: bool = True
    accuracy_level: int | None = None
    graph: str = "portable"
    heads_vocab: int = 0

    def __post_init__(self) -> None:
        for what, value, choices in (("precision", self.precision, PRECISIONS),
                                     ("heads precision", self.heads_precision, HEADS_PRECISIONS)):
            if value not in choices:
                raise UnknownPrecisionError(f"unknown {what} {value!r}; choose one of {', '.join(choices)}")
        if self.graph not in GRAPHS:
            raise UnsupportedGraphError(f"unknown graph {self.graph!r}; choose one of {', '.join(GRAPHS)}")
        if self.graph == "fused" and self.precision not in FUSED_PRECISIONS:
            raise UnsupportedGraphError(f"--graph fused does not take --precision {self.precision} (its CPU kernels "
                                        f"compute in fp32); choose --precision {', '.join(FUSED_PRECISIONS)}, or "
                                        f"--graph portable for {self.precision}")
        if self.precision == "fp16" and self.resolved_heads_precision != "fp16":
            raise UnknownPrecisionError(f"heads precision {self.heads_precision!r} needs an fp32 or weight-only "
                                        "backbone (the fp16 graph's hidden states are float16); use same or auto")
        if self.heads_vocab < 0:
            raise HeadsVocabError(f"--heads-vocab must be 0 (the full vocabulary) or a subset size N > 0, "
                                  f"got {self.heads_vocab}")
        if self.max_context is not None and self.max_context < 2:
            raise MedusaError(f"--max-context must be >= 2, got {self.max_context}")

    @property
    def resolved_heads_precision(self) -> str:
        """The heads graph's precision name ("fp32", "fp16", "int8" or "int4")."""
        if self.heads_precision == "same" or (self.heads_precision == "auto" and self.precision not in WEIGHT_ONLY_BITS):
            return self.precision
        return QUANTIZED_HEADS_DEFAULT if self.heads_precision == "auto" else self.heads_precision

    def weight_only(self, precision: str, heads: bool = False) -> WeightOnlyConfig | None:
        """The MatMulNBits settings of ``precision`` (None for fp32 / fp16).

        Args:
            precision: a precision name.
            heads: settings for the heads graph, whose vocabulary projection is always
                quantized (it is their whole cost, and they only propose candidates).
        """
        if precision not in WEIGHT_ONLY_BITS:
            return None
        level = 4 if heads else (self.accuracy_level or BACKBONE_ACCURACY[precision])
        return WeightOnlyConfig.for_precision(precision, block_size=self.block_size, accuracy_level=level,
                                              vocab_projection=heads or self.quantize_lm_head)


class Stages:
    """Prints numbered stages with their wall time (the build's progress display)."""

    def __init__(self, total: int, out=sys.stderr):
        self.total, self.n, self.out = total, 0, out

    @contextmanager
    def __call__(self, what: str):
        self.n += 1
        print(f"[{self.n}/{self.total}] {what} ...", file=self.out, flush=True)
        t = time.perf_counter()
        yield
        print(f"[{self.n}/{self.total}] {what}: done in {time.perf_counter() - t:.1f}s", file=self.out, flush=True)


def check_output_dir(out: Path) -> None:
    """Refuse an output folder we cannot (or must not) replace.

    Raises:
        ArtifactError: ``out`` is a file, a non-empty folder that is not an artifact, or its
            parent is not writable.
    """
    if out.exists() and not out.is_dir():
        raise ArtifactError(f"output {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / MANIFEST).is_file():
        raise ArtifactError(f"output folder {out} is not empty and is not an artifact; refusing to replace it")
    parent = out.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ArtifactError(f"cannot create the output folder's parent {parent}: {exc.strerror}") from None
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ArtifactError(f"output folder {out} cannot be written: {parent} is not writable")


def _replace_dir(tmp: Path, out: Path) -> None:
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def _precision_json(cfg: BuildConfig, dtype: str, quantized: dict) -> dict:
    def weights(precision: str, heads: bool) -> str:
        wo = cfg.weight_only(precision, heads)
        return {"fp32": "float32", "fp16": "float16"}[precision] if wo is None else wo.describe()

    heads = cfg.resolved_heads_precision
    return {"name": cfg.precision, "weights": weights(cfg.precision, False), "heads": heads,
            "heads_weights": weights(heads, True), "quantized_matmuls": quantized,
            "kv_dtype": dtype, "norm_and_softmax": "float32"}


def _flavour(folder: Path, files: list[str], graph: str) -> tuple[str, list[str]]:
    ops = sorted({op for f in files for op in uses_contrib_ops(folder / f)})
    if graph == "fused":  # SimplifiedLayerNormalization is ONNX Runtime's own op in the default domain
        return "ort-fused", sorted(set(ops) | set(FUSED_OPS))
    return ("ort-contrib" if ops else "portable"), ops


def _step_graph_json(lm: LoadedMedusa, cfg: BuildConfig, dtype: str, max_context: int, tree_size: int,
                     file: str) -> tuple[dict, dict]:
    """The manifest's ``kv_layout`` and ``graphs.model`` entries of the build's step graph."""
    s_dim = "new tokens: prompt length for prefill, tree size T for a tree step"
    if cfg.graph == "fused":
        s_in, s_out = fused_step_io(lm.model.config, STEP_TOPK)
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
    s_in, s_out = step_io(lm.model, dtype, STEP_TOPK)
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


def _heads_vocab_json(lm: LoadedMedusa, vocab_ids: np.ndarray | None) -> dict:
    """The manifest's ``heads_vocab``: how many tokens the heads graph projects onto, and where they came from."""
    v = lm.model.config.vocab_size
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


def _manifest(lm: LoadedMedusa, tree: Tree, cfg: BuildConfig, max_context: int, folder: Path,
              files: dict[str, str], weights_info: dict, dtype: str, quantized: dict,
              vocab_ids: np.ndarray | None = None) -> dict:
    c = lm.model.config
    h = lm.model.heads.config
    layout, step_graph = _step_graph_json(lm, cfg, dtype, max_context, tree.size, files["model"])
    h_in, h_out = heads_io(lm.model, dtype, tree.topk)
    checksums = {}
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = f.relative_to(folder).as_posix()
        checksums[rel] = {"sha256": sha256_file(f), "bytes": f.stat().st_size}
    import onnx
    import onnxruntime

    from .. import __version__

    flavour, contrib = _flavour(folder, [files["model"], files["heads"]], cfg.graph)
    return {
        "format": ARTIFACT_FORMAT,
        "format_version": ARTIFACT_VERSION,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "exporter": {"medusa_export": __version__, "torch": torch.__version__, "onnx": onnx.__version__,
                     "onnxruntime": onnxruntime.__version__, "opset": OPSET},
        "model": {
            "name": lm.name, "backbone_source": lm.backbone_source, "heads_source": lm.heads_source,
            "architecture": "llama", "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
            "num_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
            "num_kv_heads": c.num_key_value_heads, "head_dim": c.head_dim, "rope_theta": c.rope_theta,
            "medusa_heads": h.num_heads, "medusa_layers": h.num_layers,
            "medusa_own_projection": h.own_projection, "max_context": max_context,
        },
        "precision": _precision_json(cfg, dtype, quantized),
        "heads_vocab": _heads_vocab_json(lm, vocab_ids),
        "flavour": flavour,
        "flavour_note": FLAVOURS[flavour] + (f": {', '.join(contrib)}" if contrib else ""),
        "step_topk": min(STEP_TOPK, c.vocab_size),
        "kv_layout": layout,
        "graphs": {
            "model": step_graph,
            "heads": {"file": files["heads"], "inputs": [t.to_json() for t in h_in], "outputs": [t.to_json() for t in h_out],
                      "dims": {"R": "hidden states to evaluate (1 in the decode loop)"}},
        },
        "weights": {"file": files["weights"], **weights_info},
        "tree": {"file": files["tree"], "size": tree.size, "depth": tree.max_depth, "topk": tree.topk},
        "tokenizer": {"dir": "tokenizer", "eos_token_ids": lm.eos_token_ids, "chat_template": files["chat_template"]},
        "typical_defaults": {"temperature": TypicalConfig.temperature, "posterior_threshold": TypicalConfig.posterior_threshold,
                             "posterior_alpha": TypicalConfig.posterior_alpha},
        "files": files,
        "checksums": checksums,
    }


def _choose_tree_here(folder: Path, *, progress: bool) -> tuple[Tree, list]:
    """``--tree auto`` on the artifact being built: time tree steps with ONNX Runtime, pick the best."""
    from medusa_runtime.autotree import auto_tree
    from medusa_runtime.ort_engine import OrtEngine

    artifact = load_artifact(folder)
    say = (lambda line: print(f"    {line}", file=sys.stderr, flush=True)) if progress else None
    return auto_tree(OrtEngine(artifact), artifact.head_accuracies, capacity=artifact.model["max_context"],
                     topk=artifact.tree.topk, progress=say)


def _selection_json(table: list, chosen: int) -> dict:
    return {"method": "--tree auto: greedy trees (seeds/001 §2.3.3) timed on ONNX Runtime CPU on the build machine; "
                      "kept the most expected tokens per second",
            "chosen": chosen, "candidates": [r.to_json() for r in table]}


def build_artifact(lm: LoadedMedusa, tree: Tree, out: str | Path, cfg: BuildConfig = BuildConfig(), *,
                   prompts: list[str] | None = None, progress: bool = True, auto_tree: bool = False) -> Path:
    """Export, validate and write an artifact to ``out`` (atomically).

    Args:
        lm: the loaded fp32 model (reference).
        tree: the validated tree (depth <= the model's heads).
        out: the artifact directory (created or replaced).
        cfg: precisions, context and validation options.
        prompts: validation prompts (user messages); default: the project's own.
        progress: print stage progress.
        auto_tree: ``--tree auto``: ``tree`` is only the largest candidate; after export the tree
            step is timed at several sizes on ONNX Runtime on this machine and the tree with the
            most expected tokens per second is kept (:mod:`medusa_runtime.autotree`; the table
            goes to ``manifest["tree"]["selection"]``).

    Returns:
        The artifact path.

    Raises:
        InvalidTreeError: the tree is deeper than the heads.
        HeadsVocabError: ``cfg.heads_vocab`` is outside [tree.topk, V] or the model has no draft vocabulary.
        ArtifactError: the output folder cannot be written.
        ValidationError: ONNX Runtime disagrees with PyTorch (portable precisions) or Medusa
            disagrees with plain greedy decoding of the same graph (weight-only precisions);
            the first divergence is in the message.
    """
    from medusa_runtime.errors import InvalidTreeError

    from ..chat import apply_chat_template
    from ..validation.validate import ValidationError, default_prompts, validate

    out = Path(out).absolute()
    if tree.max_depth > lm.model.num_heads:
        raise InvalidTreeError(f"tree depth {tree.max_depth} exceeds the model's {lm.model.num_heads} Medusa heads")
    vocab_ids = None
    if cfg.heads_vocab:
        vocab_ids = subset_ids(lm.draft_vocab, cfg.heads_vocab, lm.model.config.vocab_size, tree.topk, model=lm.name)
    check_output_dir(out)
    max_context = cfg.max_context or lm.max_context
    if tree.size > max_context:
        raise MedusaError(f"the tree ({tree.size} nodes) does not fit --max-context {max_context}")
    wos = {MODEL_FILE: cfg.weight_only(cfg.precision), HEADS_FILE: cfg.weight_only(cfg.resolved_heads_precision, True)}
    to_quantize = [(f, wo) for f, wo in wos.items() if wo is not None]
    stages = Stages(5 + cfg.validate + bool(to_quantize) + auto_tree, out=sys.stderr if progress else open(os.devnull, "w"))
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    dtype = "float16" if cfg.precision == "fp16" else "float32"
    tdtype = torch.float16 if cfg.precision == "fp16" else torch.float32
    try:
        model = lm.model
        export_model = model
        if tdtype != torch.float32:
            import copy

            export_model = copy.deepcopy(model).to(tdtype)
            export_model.heads._shared = [export_model.backbone.lm_head]
        if cfg.graph == "fused":
            with stages("writing the fused backbone step graph (ONNX Runtime GroupQueryAttention, RMSNorm, QuickGelu)"):
                export_fused_step(export_model, tmp / MODEL_FILE, max_positions=max_context)
        else:
            with stages("exporting the backbone step graph (prefill + tree step)"):
                export_step(export_model, tmp / MODEL_FILE, tdtype)
        with stages("exporting the Medusa heads graph"):
            export_heads(export_model, tmp / HEADS_FILE, tdtype, tree.topk, vocab_ids)
        quantized = {}
        if to_quantize:
            what = ", ".join(f"{f} int{wo.bits}" for f, wo in to_quantize)
            with stages(f"quantizing weights (MatMulNBits: {what})"):
                for f, wo in to_quantize:
                    quantized[f] = quantize_graph(tmp / f, wo, model.config.vocab_size)
        with stages("merging weights into one file"):
            winfo = merge_weights([tmp / MODEL_FILE, tmp / HEADS_FILE])
        files = {"model": MODEL_FILE, "heads": HEADS_FILE, "weights": WEIGHTS_FILE, "tree": "tree.json",
                 "tokenizer": "tokenizer/tokenizer.json", "chat_template": "chat_template.jinja"}

        def write_files(t: Tree) -> dict:
            (tmp / MANIFEST).unlink(missing_ok=True)  # the manifest's checksums cover every other file
            tree_json = t.to_json_with_buffers()
            if lm.head_accuracies is not None:  # lets runtimes build other trees (--tree N / auto) from the artifact
                tree_json["head_accuracies"] = np.asarray(lm.head_accuracies, dtype=float).round(6).tolist()
            (tmp / "tree.json").write_text(json.dumps(tree_json) + "\n")
            lm.tokenizer.save_pretrained(str(tmp / "tokenizer"))
            (tmp / "chat_template.jinja").write_text(lm.chat_template or "")
            m = _manifest(lm, t, cfg, max_context, tmp, files, winfo, dtype, quantized, vocab_ids)
            (tmp / MANIFEST).write_text(json.dumps(m, indent=2) + "\n")
            return m

        with stages("writing tree, tokenizer and manifest"):
            manifest = write_files(tree)
        if auto_tree:
            with stages("timing tree steps on ONNX Runtime to choose the tree (--tree auto)"):
                tree, table = _choose_tree_here(tmp, progress=progress)
                manifest = write_files(tree)
                manifest["tree"]["selection"] = _selection_json(table, tree.size)
                (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        with stages("checking the ONNX for TensorRT (no TensorRT needed)"):
            manifest["trt_readiness"] = check_artifact(tmp, manifest).to_json()
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        if cfg.validate:
            what = ("Medusa against plain greedy of the same graph" if cfg.precision in WEIGHT_ONLY_BITS
                    else "ONNX Runtime against PyTorch")
            with stages(f"validating: {what}"):
                texts = prompts or default_prompts()
                ids = [apply_chat_template(lm.tokenizer, lm.chat_template, [{"role": "user", "content": t}]) for t in texts]
                report = validate(load_artifact(tmp), model, ids, texts, new_tokens=cfg.new_tokens,
                                  eos_token_ids=lm.eos_token_ids, progress=progress)
                manifest["validation"] = report.to_json()
                (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
                if not report.passed:
                    raise ValidationError("validation failed:\n  " + "\n  ".join(report.failures()))
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
