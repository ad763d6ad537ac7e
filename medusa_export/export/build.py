"""``medusa-export build``: model + tree -> a validated artifact directory.

Stages (each reads only what the previous wrote): export the two graphs, (quantize their
weights), merge their weights, write tree / tokenizer / manifest, validate, then
move the finished folder into place. Everything is written to a temporary sibling folder
first, so a failed or interrupted build leaves nothing half-written and an old artifact
intact.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from medusa_runtime.artifact import MANIFEST, load_artifact
from medusa_runtime.tree import Tree

from ..errors import ArtifactError, MedusaError
from ..files import replace_dir
from ..loading.draft_vocab import subset_ids
from ..loading.registry import LoadedMedusa
from ..trt.readiness import check_artifact
from .config import BuildConfig
from .fused import export_fused_step
from .manifest import manifest_json, selection_json
from .portable import HEADS_FILE, MODEL_FILE, WEIGHTS_FILE, export_heads, export_step, merge_weights
from .quantize import WEIGHT_ONLY_BITS, quantize_graph


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



def _choose_tree_here(folder: Path, *, progress: bool) -> tuple[Tree, list]:
    """``--tree auto`` on the artifact being built: time tree steps with ONNX Runtime, pick the best."""
    from medusa_runtime.autotree import auto_tree
    from medusa_runtime.ort_engine import OrtEngine

    artifact = load_artifact(folder)
    say = (lambda line: print(f"    {line}", file=sys.stderr, flush=True)) if progress else None
    return auto_tree(OrtEngine(artifact), artifact.head_accuracies, capacity=artifact.model["max_context"],
                     topk=artifact.tree.topk, progress=say)



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
            m = manifest_json(lm, t, cfg, max_context, tmp, files, winfo, dtype, quantized, vocab_ids)
            (tmp / MANIFEST).write_text(json.dumps(m, indent=2) + "\n")
            return m

        with stages("writing tree, tokenizer and manifest"):
            manifest = write_files(tree)
        if auto_tree:
            with stages("timing tree steps on ONNX Runtime to choose the tree (--tree auto)"):
                tree, table = _choose_tree_here(tmp, progress=progress)
                manifest = write_files(tree)
                manifest["tree"]["selection"] = selection_json(table, tree.size)
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
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
