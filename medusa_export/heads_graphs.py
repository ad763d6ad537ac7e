"""Heads graphs with log-probabilities, and the level graphs of path-conditioned heads (issue 18).

Traced with torch.onnx (opset 18) on their own, beside the artifact's step graph; until the
exporter's graph builder writes them (issue 13), ``scripts/attach_heads.py`` puts them into an
artifact built by ``medusa-export build``. The contract, as the runtime reads it:

**Medusa heads** (``manifest["heads"]["type"] == "medusa"``, or no ``heads`` entry),
``heads.onnx``:

=========================  ==============  =====================================================
``hidden_states``          float [R, d]    hidden states of R positions (1 in the decode loop)
``medusa_topk_ids``        int64 [R, K, k] head k's k best next tokens, best first
``medusa_topk_logprobs``   float [R, K, k] their log-probabilities (log-softmax over the heads'
                                           vocabulary: all V ids, or the ``heads_vocab`` subset);
                                           added output: per-step trees (``--tree dynamic:T``)
                                           score candidates with them
=========================  ==============  =====================================================

**Path-conditioned heads** (``manifest["heads"]["type"] == "hydra"``): one graph per depth,
``heads_level{j}.onnx`` for j = 1..K, run once per tree level (a level's R rows at once):

=========================  ==============  =====================================================
``hidden_states``          float [1, d]    h_t, the last accepted node's hidden state
``path_ids``               int64 [R, j]    R paths: the root (the backbone's next token) and the
                                           j - 1 candidate tokens below it, down to the parent of
                                           the nodes this level proposes
``level_topk_ids``         int64 [R, k]    head j's k best tokens under each path, best first
``level_topk_logprobs``    float [R, k]    their log-probabilities (as above)
=========================  ==============  =====================================================

Inside a level graph: Gather the paths' embeddings (the backbone's input embedding table,
tied to the lm_head in SmolLM2, so stored once), scale each to RMS 1, concatenate
[h_t, n(e(root)), ..., n(e(x_{j-1}))]
per row, head j's blocks (:class:`~medusa_export.model.hydra_heads.HydraHeads`), the shared
projection (or its ``heads_vocab`` rows), LogSoftmax, TopK (and a Gather of the subset's ids).
The runtime (:func:`medusa_runtime.loop.proposer`) runs level 1 on the root, then each level on
the nodes it expands: for a static tree the nodes that have children, for a per-step tree the
W best candidates of the level before.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from .model.heads import project_stacked
from .model.hydra_heads import rms_normalized

#: Graph file of the level-``j`` heads of path-conditioned heads.
LEVEL_FILE = "heads_level{}.onnx"
OPSET = 18


def _tensor(name: str, dtype: str, shape: tuple, meaning: str) -> dict:
    return {"name": name, "dtype": dtype, "shape": list(shape), "meaning": meaning}


def medusa_heads_io(hidden_size: int, num_heads: int, topk: int, float_dtype: str = "float32"
                    ) -> tuple[list[dict], list[dict]]:
    """The Medusa heads graph's inputs and outputs (manifest entries), log-probabilities included."""
    return ([_tensor("hidden_states", float_dtype, ("R", hidden_size), "hidden states to run the Medusa heads on")],
            [_tensor("medusa_topk_ids", "int64", ("R", num_heads, topk),
                     "[r, k-1, i]: head k's i-th best guess for the token k+1 positions after row r's next token"),
             _tensor("medusa_topk_logprobs", "float32", ("R", num_heads, topk),
                     "their log-probabilities (log-softmax over the heads' vocabulary)")])


def level_io(hidden_size: int, depth: int, topk: int, float_dtype: str = "float32") -> tuple[list[dict], list[dict]]:
    """The level-``depth`` graph's inputs and outputs (manifest entries)."""
    return ([_tensor("hidden_states", float_dtype, (1, hidden_size), "h_t: the last accepted node's hidden state"),
             _tensor("path_ids", "int64", ("R", depth),
                     f"R paths: the root and the {depth - 1} candidate tokens below it (root first)")],
            [_tensor("level_topk_ids", "int64", ("R", topk), f"head {depth}'s best tokens under each path, best first"),
             _tensor("level_topk_logprobs", "float32", ("R", topk),
                     "their log-probabilities (log-softmax over the heads' vocabulary)")])


class _Projection(nn.Module):
    """The shared projection, or its rows of a token subset (+ the table mapping subset indices to ids)."""

    def __init__(self, weight: torch.Tensor, vocab_ids: np.ndarray | None):
        super().__init__()
        self.subset = vocab_ids is not None
        if self.subset:
            ids = torch.as_tensor(np.asarray(vocab_ids, dtype=np.int64))
            self.register_buffer("vocab_ids", ids)
            self.weight = nn.Parameter(weight.detach()[ids].clone(), requires_grad=False)
        else:
            self.weight = nn.Parameter(weight.detach(), requires_grad=False)

    def topk(self, states: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """states [..., d] -> (ids int64 [..., k], log-probabilities [..., k])."""
        logp = torch.log_softmax(project_stacked(states, self.weight), dim=-1)
        top = torch.topk(logp, k, dim=-1)
        ids = top.indices
        if self.subset:
            ids = self.vocab_ids.index_select(0, ids.reshape(-1)).reshape(ids.shape)
        return ids, top.values


class MedusaHeadsGraph(nn.Module):
    """hidden_states [R, d] -> (medusa_topk_ids int64 [R, K, k], medusa_topk_logprobs [R, K, k])."""

    def __init__(self, heads: nn.Module, topk: int, vocab_ids: np.ndarray | None = None):
        super().__init__()
        self.heads, self.k = heads, topk
        self.proj = _Projection(heads.projection_weights()[0], vocab_ids)

    def forward(self, hidden_states):
        states = self.heads.head_states(hidden_states)  # [K, R, d]
        ids, logp = self.proj.topk(states, self.k)  # [K, R, k]
        return ids.transpose(0, 1), logp.transpose(0, 1)


class LevelGraph(nn.Module):
    """Path-conditioned head ``depth``: (hidden_states [1, d], path_ids [R, depth]) -> ids, log-probs [R, k]."""

    def __init__(self, heads: nn.Module, depth: int, topk: int, vocab_ids: np.ndarray | None = None):
        super().__init__()
        self.block = heads.heads[depth - 1]
        self.embed = nn.Parameter(heads._embed[0].weight.detach(), requires_grad=False)
        self.depth, self.k = depth, topk
        self.proj = _Projection(heads.projection_weights()[0], vocab_ids)

    def forward(self, hidden_states, path_ids):
        r = path_ids.shape[0]
        e = rms_normalized(nn.functional.embedding(path_ids, self.embed)).reshape(r, -1)  # [R, depth d]
        x = torch.cat([hidden_states.expand(r, -1), e], dim=-1)  # [R, (depth + 1) d]
        return self.proj.topk(self.block(x), self.k)


def _export(module: nn.Module, args: tuple, dynamic_shapes, names_in, names_out, path: Path) -> None:
    # The tracing call of export.portable, repeated rather than imported privately while that module is being
    # replaced by the graph builder (issue 13); these graphs move into the builder with it.
    import logging
    import warnings

    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        prog = torch.onnx.export(module, args, dynamic_shapes=dynamic_shapes, input_names=names_in,
                                 output_names=names_out, dynamo=True, opset_version=OPSET, verbose=False)
    prog.save(str(path), external_data=True)


def export_medusa_heads(heads: nn.Module, path: Path, topk: int, vocab_ids: np.ndarray | None = None) -> None:
    """Write the Medusa heads graph with log-probabilities (fp32) to ``path`` (+ external data)."""
    from torch.export import Dim

    d = heads.config.hidden_size
    ins, outs = medusa_heads_io(d, heads.config.num_heads, topk)
    _export(MedusaHeadsGraph(heads, topk, vocab_ids).eval(), (torch.zeros(2, d),),
            {"hidden_states": {0: Dim("R", min=1, max=1 << 16)}}, [t["name"] for t in ins], [t["name"] for t in outs],
            path)


def export_levels(heads: nn.Module, folder: Path, topk: int, vocab_ids: np.ndarray | None = None) -> list[str]:
    """Write the K level graphs of path-conditioned heads (fp32) into ``folder``; returns their file names."""
    from torch.export import Dim

    d = heads.config.hidden_size
    files = []
    for depth in range(1, heads.config.num_heads + 1):
        ins, outs = level_io(d, depth, topk)
        name = LEVEL_FILE.format(depth)
        _export(LevelGraph(heads, depth, topk, vocab_ids).eval(),
                (torch.zeros(1, d), torch.zeros(3, depth, dtype=torch.long)),
                {"hidden_states": None, "path_ids": {0: Dim("R", min=1, max=1 << 16)}},
                [t["name"] for t in ins], [t["name"] for t in outs], folder / name)
        files.append(name)
    return files


def attach_heads(artifact: str | Path, lm, heads_dir: str | Path, out: str | Path, *, heads_vocab: int = 0,
                 precision: str = "fp32", tree: str | None = None) -> Path:
    """A copy of ``artifact`` whose heads are ``lm``'s heads, in the graphs of this module.

    The step graph and its weights are hard-linked (or copied; linked files are never written to);
    the new heads graphs get their own weights file (``heads_weights.bin``, tied tensors stored once); ``tree.json`` gets the
    heads' accuracies, probability map and simulated tokens/step (``accuracies.json`` beside
    them), the tree is rebuilt from the new accuracies at the artifact's size (or ``tree``), and
    the manifest's ``heads`` entry, graphs, files and checksums are rewritten. Written to a
    temporary sibling of ``out`` and moved into place.

    Args:
        artifact: an artifact built by ``medusa-export build`` (any step graph, any heads).
        lm: the :class:`~medusa_export.loading.registry.LoadedMedusa` with the heads to attach
            (same backbone as the artifact).
        heads_dir: the folder ``lm``'s heads came from (its ``accuracies.json`` goes into ``tree.json``).
        out: the new artifact folder.
        heads_vocab: project the heads onto the draft vocabulary's top N ids (0: all V).
        precision: "fp32" or "int8" (MatMulNBits weight-only) heads.
        tree: a ``--tree`` spec for the artifact's static tree (default: its current size).

    Raises:
        ArtifactError: ``artifact`` is not an artifact or ``out`` cannot be written.
        HeadsVocabError: ``heads_vocab`` outside [topk, V] or no draft vocabulary.
    """
    import json
    import os
    import shutil

    from medusa_runtime.artifact import MANIFEST, load_artifact, sha256_file
    from medusa_runtime.tree import tree_from_spec

    from .export.portable import merge_weights
    from .export.quantize import WeightOnlyConfig, quantize_graph
    from .files import replace_dir
    from .loading.accuracies import load_accuracies_doc
    from .loading.draft_vocab import subset_ids

    src = load_artifact(artifact)
    out = Path(out).absolute()
    heads = lm.model.heads
    c = heads.config
    topk = src.tree.topk
    vocab_ids = None
    if heads_vocab:
        vocab_ids = subset_ids(lm.draft_vocab, heads_vocab, lm.model.config.vocab_size, topk, model=lm.name)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        manifest = json.loads((src.path / MANIFEST).read_text())
        old_heads = [manifest["files"].pop(k) for k in list(manifest["files"]) if k.startswith("heads")]
        for k in [k for k in manifest["graphs"] if k.startswith("heads")]:
            del manifest["graphs"][k]
        for f in src.path.rglob("*"):
            rel = f.relative_to(src.path)
            if f.is_dir() or rel.as_posix() in old_heads or rel.name == MANIFEST:
                continue
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(f, tmp / rel)
            except OSError:
                shutil.copy2(f, tmp / rel)
        heads = heads.float().eval()
        d = c.hidden_size
        if c.head_type == "hydra":
            files = export_levels(heads, tmp, topk, vocab_ids)
            keys = [f"heads_level{j}" for j in range(1, c.num_heads + 1)]
            ios = [level_io(d, j, topk) for j in range(1, c.num_heads + 1)]
            dims = {"R": "paths evaluated at this level (the nodes it expands)"}
        else:
            files = ["heads.onnx"]
            export_medusa_heads(heads, tmp / files[0], topk, vocab_ids)
            keys = ["heads"]
            ios = [medusa_heads_io(d, c.num_heads, topk)]
            dims = {"R": "hidden states to evaluate (1 in the decode loop)"}
        quantized = {}
        if precision == "int8":
            for f in files:
                quantized[f] = quantize_graph(tmp / f, WeightOnlyConfig.for_precision("int8"),
                                              lm.model.config.vocab_size)
        winfo = merge_weights([tmp / f for f in files], weights_name="heads_weights.bin")
        for key, f, (ins, outs) in zip(keys, files, ios):
            manifest["files"][key] = f
            manifest["graphs"][key] = {"file": f, "inputs": ins, "outputs": outs, "dims": dims}
        manifest["files"]["heads_weights"] = "heads_weights.bin"
        manifest["heads"] = {"type": c.head_type, "num_heads": c.num_heads, "num_layers": c.num_layers,
                             "source": lm.heads_source, "weights": {"file": "heads_weights.bin", **winfo},
                             "precision": precision, "quantized_matmuls": quantized,
                             "runs": ("one run of heads.onnx per step" if c.head_type == "medusa" else
                                      "heads_level{j}.onnx per tree level j = 1..K, on that level's paths")}
        manifest["model"]["medusa_heads"] = c.num_heads
        manifest["model"]["medusa_layers"] = c.num_layers
        manifest["heads_vocab"] = {"size": int(len(vocab_ids)) if vocab_ids is not None else lm.model.config.vocab_size,
                                   "vocab_size": lm.model.config.vocab_size, "subset": vocab_ids is not None}
        acc_doc = load_accuracies_doc(heads_dir)
        accuracies = lm.head_accuracies
        spec = tree or str(src.tree.size)
        new_tree = tree_from_spec(spec, num_heads=c.num_heads, accuracies=accuracies, topk=topk)
        tree_json = new_tree.to_json_with_buffers()
        if accuracies is not None:
            tree_json["head_accuracies"] = np.asarray(accuracies, dtype=float).round(6).tolist()
        for key in ("calibration", "simulated", "head_type"):
            if acc_doc and key in acc_doc:
                tree_json[key] = acc_doc[key]
        tree_file = tmp / manifest["files"]["tree"]
        tree_file.unlink()  # a hard link to the source artifact's file: never write through it
        tree_file.write_text(json.dumps(tree_json) + "\n")
        manifest["tree"].update({"size": new_tree.size, "depth": new_tree.max_depth, "topk": new_tree.topk})
        manifest.pop("validation", None)
        manifest["checksums"] = {f.relative_to(tmp).as_posix(): {"sha256": sha256_file(f), "bytes": f.stat().st_size}
                                 for f in sorted(p for p in tmp.rglob("*") if p.is_file())}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        load_artifact(tmp)  # the result must load
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
