"""``medusa-export build``: model + tree -> a validated artifact directory.

Stages (each reads only what the previous wrote): export the two graphs, merge their
weights, (quantize), write tree / tokenizer / manifest, validate against PyTorch, then
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

import torch

from medusa_runtime.acceptance import TypicalConfig
from medusa_runtime.artifact import ARTIFACT_FORMAT, ARTIFACT_VERSION, MANIFEST, load_artifact, sha256_file
from medusa_runtime.tree import Tree

from .errors import ArtifactError, MedusaError
from .export import HEADS_FILE, MODEL_FILE, OPSET, WEIGHTS_FILE, export_heads, export_step, heads_io, merge_weights, step_io
from .model import STEP_TOPK
from .registry import LoadedMedusa
from .trt_readiness import check_artifact

PRECISIONS = ("fp32", "fp16", "int8")


@dataclass(frozen=True)
class BuildConfig:
    """Options of ``build``; the CLI reads its defaults from here."""

    precision: str = "fp32"
    max_context: int | None = None  # None: the model's registered context
    new_tokens: int = 64  # greedy tokens compared per validation prompt
    validate: bool = True

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise MedusaError(f"unknown precision {self.precision!r}; choose one of {', '.join(PRECISIONS)}")
        if self.max_context is not None and self.max_context < 2:
            raise MedusaError(f"--max-context must be >= 2, got {self.max_context}")


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


def _quantize_int8(folder: Path) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    src = folder / MODEL_FILE
    dst = folder / "model.int8.onnx"
    quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul"],
                     per_channel=True, use_external_data_format=True)
    for f in folder.iterdir():
        if f.name.startswith(MODEL_FILE) or f.name == WEIGHTS_FILE:
            f.unlink()
    dst.rename(src)  # its external data keeps its own name; merge_weights rewrites it


def _manifest(lm: LoadedMedusa, tree: Tree, cfg: BuildConfig, max_context: int, folder: Path,
              files: dict[str, str], weights_info: dict, dtype: str) -> dict:
    c = lm.model.config
    h = lm.model.heads.config
    s_in, s_out = step_io(lm.model, dtype, STEP_TOPK)
    h_in, h_out = heads_io(lm.model, dtype, tree.topk)
    checksums = {}
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = f.relative_to(folder).as_posix()
        checksums[rel] = {"sha256": sha256_file(f), "bytes": f.stat().st_size}
    import onnx
    import onnxruntime

    from . import __version__

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
        "precision": {"name": cfg.precision, "weights": {"fp32": "float32", "fp16": "float16", "int8": "int8 (MatMul, per channel, dynamic activations)"}[cfg.precision],
                      "kv_dtype": dtype, "norm_and_softmax": "float32"},
        "flavour": "portable (standard ONNX ops only)",
        "step_topk": min(STEP_TOPK, c.vocab_size),
        "kv_layout": {
            "shape": "[1, P, H_kv, D] per layer, separate key and value tensors (sequence-major)",
            "inputs": "past_key_values.{i}.key / .value: the P valid past tokens",
            "outputs": "new_key_values.{i}.key / .value: K/V of this step's S tokens only",
            "compaction": "after acceptance copy new_key_values[:, accepted] into cache slots [P, P + len(accepted))",
        },
        "graphs": {
            "model": {"file": files["model"], "inputs": [t.to_json() for t in s_in], "outputs": [t.to_json() for t in s_out],
                      "dims": {"S": "new tokens: prompt length for prefill, tree size T for a tree step",
                               "P": "valid past length, 0 .. max_context - S"},
                      "profiles": {"prefill": {"S": [1, max_context], "P": [0, max_context - 1]},
                                   "tree_step": {"S": [tree.size, tree.size], "P": [0, max_context - tree.size]},
                                   "decode": {"S": [1, 1], "P": [0, max_context - 1]}}},
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


def build_artifact(lm: LoadedMedusa, tree: Tree, out: str | Path, cfg: BuildConfig = BuildConfig(), *,
                   prompts: list[str] | None = None, progress: bool = True) -> Path:
    """Export, validate and write an artifact to ``out`` (atomically).

    Args:
        lm: the loaded fp32 model (reference).
        tree: the validated tree (depth <= the model's heads).
        out: the artifact directory (created or replaced).
        cfg: precision, context and validation options.
        prompts: validation prompts (user messages); default: the project's own.
        progress: print stage progress.

    Returns:
        The artifact path.

    Raises:
        InvalidTreeError: the tree is deeper than the heads.
        ArtifactError: the output folder cannot be written.
        ValidationError: ONNX Runtime disagrees with PyTorch (first divergence in the message).
    """
    from medusa_runtime.errors import InvalidTreeError

    from .chat import apply_chat_template
    from .validate import ValidationError, default_prompts, validate

    out = Path(out).absolute()
    if tree.max_depth > lm.model.num_heads:
        raise InvalidTreeError(f"tree depth {tree.max_depth} exceeds the model's {lm.model.num_heads} Medusa heads")
    check_output_dir(out)
    max_context = cfg.max_context or lm.max_context
    if tree.size > max_context:
        raise MedusaError(f"the tree ({tree.size} nodes) does not fit --max-context {max_context}")
    stages = Stages(5 + cfg.validate + (cfg.precision == "int8"), out=sys.stderr if progress else open(os.devnull, "w"))
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
        with stages("exporting the backbone step graph (prefill + tree step)"):
            export_step(export_model, tmp / MODEL_FILE, tdtype)
        with stages("exporting the Medusa heads graph"):
            export_heads(export_model, tmp / HEADS_FILE, tdtype, tree.topk)
        if cfg.precision == "int8":
            with stages("quantizing MatMul weights to int8"):
                _quantize_int8(tmp)
        with stages("merging weights into one file"):
            winfo = merge_weights([tmp / MODEL_FILE, tmp / HEADS_FILE])
        with stages("writing tree, tokenizer and manifest"):
            (tmp / "tree.json").write_text(json.dumps(tree.to_json_with_buffers()) + "\n")
            lm.tokenizer.save_pretrained(str(tmp / "tokenizer"))
            (tmp / "chat_template.jinja").write_text(lm.chat_template or "")
            files = {"model": MODEL_FILE, "heads": HEADS_FILE, "weights": WEIGHTS_FILE, "tree": "tree.json",
                     "tokenizer": "tokenizer/tokenizer.json", "chat_template": "chat_template.jinja"}
            manifest = _manifest(lm, tree, cfg, max_context, tmp, files, winfo, dtype)
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        with stages("checking the ONNX for TensorRT (no TensorRT needed)"):
            manifest["trt_readiness"] = check_artifact(tmp, manifest).to_json()
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        if cfg.validate:
            with stages("validating ONNX Runtime against PyTorch"):
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
