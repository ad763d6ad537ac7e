"""The export stage's artifact: the graphs with their weights (:mod:`.writer`), tree, tokenizer, chat template
and manifest written into a folder, and the checks of the output folder.

:mod:`medusa_export.pipeline` runs this stage inside ``build`` (then the TensorRT readiness check and the
validation, and moves the finished folder into place); the validation's truncated check runs it on a
truncated config. The model is never materialised: every tensor is streamed from the checkpoint.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import numpy as np

from medusa_runtime.contract.artifact import MANIFEST
from medusa_runtime.contract.manifest import MANIFEST_SCHEMA, Manifest
from medusa_runtime.trees.tree import Tree

from ..errors import ArtifactError
from ..loading.registry import LoadedMedusa
from ..loading.sources import ModelSources
from .config import ExportConfig
from .contract import HEADS_FILE, MODEL_FILE
from .manifest import build_manifest, write_manifest, write_schema
from .weights import WEIGHTS_FILE
from .writer import WrittenGraphs, heads_files, write_graphs


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


def write_artifact(folder: Path, lm: LoadedMedusa, src: ModelSources, tree: Tree, cfg: ExportConfig,
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


def write_files(folder: Path, lm: LoadedMedusa, src: ModelSources, tree: Tree, cfg: ExportConfig, max_context: int,
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
    m = build_manifest(lm, src, tree, cfg, max_context, folder, artifact_files(src), written.weights, cfg.graphs_dtype,
                       written.quantized, vocab_ids, unchanged=graphs_checksums)
    if policy:
        m = replace(m, tree=replace(m.tree, policy=policy))
    write_manifest(folder, m)
    return m
