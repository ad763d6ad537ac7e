"""``medusa-export build``: model + tree -> a validated artifact directory.

Stages (each reads only what the previous wrote): pre-flight (each stage's memory estimated from the
headers, the validation checks that fit chosen), write the two graphs with their weights streamed from
the checkpoint into ``weights.bin`` (:mod:`.writer`), write tree / tokenizer / manifest, check the ONNX
for TensorRT, validate, then move the finished folder into place. Everything is written to a temporary
sibling folder first, so a failed or interrupted build (Ctrl-C, SIGTERM, SIGHUP) leaves nothing half-written
and an old artifact intact; what a SIGKILL'd build leaves is removed by the next build into the same folder,
and a lock file beside the folder keeps two builds from writing it at once. The model is never materialised for the export; the checks that need the PyTorch reference
build it from the same sources (truncated when the whole one does not fit).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import numpy as np

from medusa_runtime.artifact import MANIFEST, load_artifact
from medusa_runtime.manifest import MANIFEST_SCHEMA, Manifest
from medusa_runtime.tree import Tree

from ..errors import ArtifactError, InvalidTreeError, MedusaError
from ..files import OutputBusyError, OutputLock, partial_dir, remove_stale, replace_dir
from ..loading.draft_vocab import subset_ids
from ..loading.registry import LoadedMedusa
from ..loading.sources import ModelSources, sources_of
from ..trt.readiness import check_artifact
from .config import BuildConfig
from .contract import HEADS_FILE, MODEL_FILE
from .manifest import build_manifest, selection_json, write_manifest, write_schema
from .weights import WEIGHTS_FILE
from .writer import WrittenGraphs, heads_files, plan_graphs, write_graphs


class Stages:
    """Prints numbered stages with their wall time (the build's progress display) and keeps the times."""

    def __init__(self, total: int, out=sys.stderr):
        self.total, self.n, self.out = total, 0, out
        self.times: list[dict] = []

    @contextmanager
    def __call__(self, what: str):
        self.n += 1
        print(f"[{self.n}/{self.total}] {what} ...", file=self.out, flush=True)
        t = time.perf_counter()
        yield
        dt = time.perf_counter() - t
        self.times.append({"stage": what, "seconds": round(dt, 2)})
        print(f"[{self.n}/{self.total}] {what}: done in {dt:.1f}s", file=self.out, flush=True)


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


def _choose_tree_here(folder: Path, *, progress: bool, policy: str = "static") -> tuple[Tree, list, str]:
    """``--tree auto`` (``auto:dynamic``) on the artifact being built: time tree steps with ONNX Runtime, pick the
    best; (the static tree, the table, the tree policy to record: "" or "dynamic:T")."""
    from medusa_runtime.autotree import auto_tree
    from medusa_runtime.treespec import DynamicTree
    from medusa_runtime.engines.ort import OrtEngine
    from medusa_runtime.treespec import DynamicTree, tree_from_spec

    artifact = load_artifact(folder)
    say = (lambda line: print(f"    {line}", file=sys.stderr, flush=True)) if progress else None
    tree, table = auto_tree(OrtEngine(artifact), artifact.head_accuracies, capacity=artifact.model.max_context,
                            topk=artifact.tree.topk, progress=say, policy=policy, calibration=artifact.calibration,
                            simulated=artifact.simulated)
    if isinstance(tree, DynamicTree):
        static = tree_from_spec(str(tree.size), num_heads=tree.num_heads, accuracies=artifact.head_accuracies,
                                topk=artifact.tree.topk)
        return static, table, f"dynamic:{tree.size}"
    return tree, table, ""


def write_artifact(folder: Path, lm: LoadedMedusa, src: ModelSources, tree: Tree, cfg: BuildConfig,
                   max_context: int, vocab_ids: np.ndarray | None = None, progress: bool = True) -> tuple[Manifest, WrittenGraphs]:
    """Graphs, weights, tree, tokenizer and manifest of an artifact in ``folder`` (no validation).

    Also used for the truncated check's artifact (``src`` with a truncated config).

    Returns:
        (the manifest written, what :func:`~.writer.write_graphs` returned).
    """
    written = write_graphs(folder, src, cfg, tree.topk, vocab_ids=vocab_ids, vocab_origin=vocab_origin(lm, vocab_ids),
                           max_context=max_context, progress=progress)
    manifest = write_files(folder, lm, src, tree, cfg, max_context, written, vocab_ids)
    return manifest, written


def vocab_origin(lm: LoadedMedusa, vocab_ids: np.ndarray | None) -> str:
    """Where the heads' vocabulary subset comes from (recorded with its tensor in ``weights.bin``)."""
    if vocab_ids is None:
        return ""
    return f"--heads-vocab {len(vocab_ids)}: the top ids of the draft vocabulary beside {lm.heads_source}"


FILES = {"model": MODEL_FILE, "heads": HEADS_FILE, "weights": WEIGHTS_FILE, "tree": "tree.json",
         "tokenizer": "tokenizer/tokenizer.json", "chat_template": "chat_template.jinja",
         "manifest_schema": MANIFEST_SCHEMA}
#: What ``tree.json`` carries over from the heads' ``accuracies.json`` (``medusa-export calibrate``): the
#: probability map of per-step trees, the simulated tokens per step of each policy (``--tree auto``).
CALIBRATION_KEYS = ("calibration", "simulated", "head_type")


def artifact_files(src: ModelSources) -> dict[str, str]:
    """The artifact's file names by role; the heads' by head type (:func:`~.writer.heads_files`)."""
    files = {k: v for k, v in FILES.items() if k != "heads"}
    return {**files, **heads_files(src.heads_config.head_type, src.heads_config.num_heads)}


def write_files(folder: Path, lm: LoadedMedusa, src: ModelSources, tree: Tree, cfg: BuildConfig, max_context: int,
                written: WrittenGraphs, vocab_ids: np.ndarray | None, policy: str = "",
                graphs_checksums: dict | None = None) -> Manifest:
    """tree.json, the tokenizer, the chat template and the manifest (last: it checksums the others).

    ``policy`` "dynamic:T" records per-step trees (``tree.json`` / ``manifest.tree`` ``policy``; ``tree`` is then
    the T-node static tree fixed-tree engines use); "" a static tree. ``graphs_checksums``: the graphs' and
    weights' checksums when they were already taken (a second call, after ``--tree auto``): not hashed again."""
    (folder / MANIFEST).unlink(missing_ok=True)
    tree_json = tree.to_json_with_buffers()
    if lm.head_accuracies is not None:  # lets runtimes build other trees (--tree N / auto) from the artifact
        tree_json["head_accuracies"] = np.asarray(lm.head_accuracies, dtype=float).round(6).tolist()
    doc = lm.accuracies_doc or {}
    tree_json.update({k: doc[k] for k in CALIBRATION_KEYS if doc.get(k) is not None})
    if policy:
        tree_json["policy"] = policy
    (folder / "tree.json").write_text(json.dumps(tree_json) + "\n")
    lm.tokenizer.save_pretrained(str(folder / "tokenizer"))
    (folder / "chat_template.jinja").write_text(lm.chat_template or "")
    write_schema(folder)
    m = build_manifest(lm, src, tree, cfg, max_context, folder, artifact_files(src), written.weights, cfg.spec.dtype,
                       written.quantized, vocab_ids, unchanged=graphs_checksums)
    if policy:
        m = replace(m, tree=replace(m.tree, policy=policy))
    write_manifest(folder, m)
    return m


def _peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def build_artifact(lm: LoadedMedusa, tree: Tree, out: str | Path, cfg: BuildConfig = BuildConfig(), *,
                   prompts: list[str] | None = None, progress: bool = True, auto_tree: bool = False,
                   tree_policy: str = "static") -> Path:
    """Export, validate and write an artifact to ``out`` (atomically).

    Args:
        lm: the model: opened as sources (:func:`~medusa_export.loading.sources.open_model`, nothing loaded),
            or loaded (its ``model`` is then exported from memory).
        tree: the validated tree (depth <= the model's heads).
        out: the artifact directory (created or replaced).
        cfg: precisions, context, validation options (``checks``, ``validate_layers``).
        prompts: validation prompts (user messages); default: the project's own.
        progress: print stage progress and progress bars.
        auto_tree: ``--tree auto``: ``tree`` is only the largest candidate; after export the tree
            step is timed at several sizes on ONNX Runtime on this machine and the tree with the
            most expected tokens per second is kept (:mod:`medusa_runtime.autotree`; the table
            goes to the manifest's ``tree.selection``).
        tree_policy: "static", or "dynamic" (``--tree dynamic:T`` / ``auto:dynamic``): the runtime chooses a
            ``tree.size``-node tree every step from the heads' log-probabilities; recorded as
            the manifest's ``tree.policy`` = "dynamic:T" (``tree`` stays the static tree of fixed-tree engines).

    Returns:
        The artifact path.

    Raises:
        InvalidTreeError: the tree is deeper than the heads.
        HeadsVocabError: ``cfg.heads_vocab`` is outside [tree.topk, V] or the model has no draft vocabulary.
        ArtifactError: the output folder cannot be written, or another build is writing it (a lock file
            ``.NAME.lock`` beside it; two builds into one folder never interleave).
        InsufficientMemoryError: the pre-flight estimate of the export, or of a check asked for by name,
            exceeds the memory available (both numbers and the options in the message).
        InsufficientDiskError: the weights do not fit on the output's file system.
        CheckpointError: a checkpoint file is missing, truncated or disagrees with its config.
        ValidationError: a check failed (the first divergence is in the message).
    """
    from ..validation.checks import run_checks
    from ..validation.plan import plan_validation
    from ..validation.validate import ValidationError

    t_start = time.perf_counter()
    out = Path(out).absolute()
    src = sources_of(lm)
    num_heads = src.heads_config.num_heads
    if tree.max_depth > num_heads:
        raise InvalidTreeError(f"tree depth {tree.max_depth} exceeds the model's {num_heads} Medusa heads")
    vocab_ids = None
    if cfg.heads_vocab:
        vocab_ids = subset_ids(lm.draft_vocab, cfg.heads_vocab, src.config.vocab_size, tree.topk, model=lm.name)
    check_output_dir(out)
    max_context = cfg.max_context or lm.max_context
    if tree.size > max_context:
        raise MedusaError(f"the tree ({tree.size} nodes) does not fit --max-context {max_context}")
    say = (lambda line: print(line, file=sys.stderr, flush=True)) if progress else (lambda line: None)
    weights_plan = plan_graphs(src, cfg, tree.topk, vocab_ids, max_context)
    plan = plan_validation(src, cfg.precision, weights_plan.nbytes(), graph=cfg.graph, checks=cfg.checks,
                           layers=cfg.validate_layers, validate=cfg.validate)
    say(f"pre-flight: {plan.available / 1e9:.1f} GB available; estimated peaks: "
        + ", ".join(f"{k} {v / 1e9:.1f} GB" for k, v in plan.estimates.items()
                    if k == "export" or k in plan.checks or (k.startswith("gpu") and "gpu" in plan.checks)))
    for line in plan.describe() if cfg.validate else ["validation: skipped (--no-validate)"]:
        say(f"  {line}")
    stages = Stages(3 + bool(plan.checks) + auto_tree, out=sys.stderr if progress else open(os.devnull, "w"))
    tmp = partial_dir(out)
    try:
        lock = OutputLock(out)
    except OutputBusyError as exc:
        raise ArtifactError(f"{exc}; wait for it to finish or choose another output folder") from None
    try:
        for stale in remove_stale(out):  # left by a build that was killed (SIGKILL)
            say(f"removed {stale.name}, left by a build that did not finish")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        flavour = "fused step (ONNX Runtime GroupQueryAttention, RMSNorm, QuickGelu)" if cfg.graph == "fused" \
            else "portable step (standard ONNX ops)"
        heads = "Medusa heads" if src.heads_config.head_type == "medusa" else "path-conditioned heads (a graph per level)"
        with stages(f"writing the graphs from the checkpoint: {flavour} + {heads}, weights streamed to "
                    f"{WEIGHTS_FILE} ({cfg.precision})"):
            written = write_graphs(tmp, src, cfg, tree.topk, vocab_ids=vocab_ids, vocab_origin=vocab_origin(lm, vocab_ids),
                                   max_context=max_context, progress=progress)
            say(f"    {written.weights['bytes'] / 1e9:.2f} GB in {written.seconds:.1f}s "
                f"({written.weights['bytes'] / 1e9 / max(written.seconds, 1e-9):.2f} GB/s), "
                f"{written.weights['tensors']} tensors")
        with stages("writing tree, tokenizer and manifest"):
            policy = f"dynamic:{tree.size}" if tree_policy == "dynamic" and not auto_tree else ""
            manifest = write_files(tmp, lm, src, tree, cfg, max_context, written, vocab_ids, policy)
        if auto_tree:
            with stages("timing tree steps on ONNX Runtime to choose the tree (--tree auto)"):
                tree, table, policy = _choose_tree_here(tmp, progress=progress, policy=tree_policy)
                graphs = {rel: c for rel, c in manifest.checksums.items() if rel.endswith((".onnx", WEIGHTS_FILE))}
                manifest = write_files(tmp, lm, src, tree, cfg, max_context, written, vocab_ids, policy, graphs)
                manifest = replace(manifest, tree=replace(manifest.tree, selection=selection_json(table, tree.size)))
        with stages("checking the ONNX for TensorRT (no TensorRT needed)"):
            manifest = replace(manifest, trt_readiness=check_artifact(tmp, manifest).to_json())
            write_manifest(tmp, manifest)
        if plan.checks:
            with stages(f"validating: {', '.join(plan.checks)}"):
                validation = run_checks(plan, tmp, lm, src, cfg, prompts=prompts, vocab_ids=vocab_ids,
                                        progress=progress)
                manifest = replace(manifest, validation=validation)
                write_manifest(tmp, manifest)
                if not validation["passed"]:
                    raise ValidationError("validation failed:\n  " + "\n  ".join(validation["failures"]))
        stages.times.append({"stage": "total", "seconds": round(time.perf_counter() - t_start, 2)})
        manifest = replace(manifest, build={
            "stages": stages.times, "peak_rss_bytes": _peak_rss(),
            "weights_gb_per_s": round(written.weights["bytes"] / 1e9 / max(written.seconds, 1e-9), 3),
            "preflight": {"available_bytes": plan.available, "estimates": plan.estimates}})
        write_manifest(tmp, manifest)
        replace_dir(tmp, out)
    except BaseException:  # Ctrl-C, and SIGTERM / SIGHUP (medusa_runtime.cli.run_command makes them one)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        lock.release()
    return out
