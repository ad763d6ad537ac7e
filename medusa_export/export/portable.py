"""Trace the Medusa model to ONNX: the backbone step graph and the heads graph.

Two graphs, one weights file:

* ``model.onnx``, the backbone step. One graph serves the prefill (S = prompt length,
  causal ``new_token_mask``) and the tree step (S = T, the tree's attention mask and
  positions past_len + depth, shipped in ``tree.json``). Only S and the past length P
  are dynamic; a TensorRT build gives the tree step its own optimization profile with
  S fixed at T. No mask is baked in by tracing: attention over the new tokens follows
  ``new_token_mask`` and RoPE is computed from ``position_ids``.
* ``heads.onnx``: Medusa heads on R hidden states -> their top-k token ids. The runtime
  runs it on the one hidden state of the last accepted node (running K vocab
  projections on all T tree rows would double a CPU step's cost).

Both graphs keep their weights in one external-data file, ``weights.bin``, where each
distinct tensor is stored once (the heads' shared lm_head is the backbone's).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import numpy_helper
from torch import nn

from ..model.backbone import LlamaConfig
from ..model.heads import project_stacked
from ..model.medusa import STEP_TOPK, MedusaModel

OPSET = 18  # the lowest opset torch's dynamo exporter writes
WEIGHTS_FILE = "weights.bin"
MODEL_FILE = "model.onnx"
HEADS_FILE = "heads.onnx"
_ALIGN = 4096


@dataclass(frozen=True)
class TensorSpec:
    """One graph input or output of the contract (also written to the manifest)."""

    name: str
    dtype: str
    shape: tuple
    meaning: str

    def to_json(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "meaning": self.meaning}


def step_io(model: MedusaModel, float_dtype: str, k: int = STEP_TOPK) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The backbone step's inputs and outputs: names, dtypes, shapes (symbolic S, P) and meanings."""
    c = model.config
    kv = (1, "P", c.num_key_value_heads, c.head_dim)
    new_kv = (1, "S", c.num_key_value_heads, c.head_dim)
    inputs, outputs = step_token_io(c, float_dtype, k)
    for i in range(c.num_hidden_layers):
        for n in ("key", "value"):
            inputs.append(TensorSpec(f"past_key_values.{i}.{n}", float_dtype, kv,
                                     f"layer {i} {n}s of the P valid past tokens, sequence-major [1, P, H_kv, D]"))
    for i in range(c.num_hidden_layers):
        for n in ("key", "value"):
            outputs.append(TensorSpec(f"new_key_values.{i}.{n}", float_dtype, new_kv,
                                      f"layer {i} {n}s of this step's S tokens only (keep the accepted ones)"))
    return inputs, outputs


def step_token_io(c: LlamaConfig, float_dtype: str, k: int = STEP_TOPK) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The step's inputs and outputs other than the KV cache (shared by the portable and fused graphs)."""
    k = min(k, c.vocab_size)
    inputs = [
        TensorSpec("input_ids", "int64", (1, "S"), "tokens of this step: the prompt (prefill) or the tree's candidates in node order"),
        TensorSpec("position_ids", "int64", (1, "S"), "positions: P + arange(S) for prefill, P + depth for a tree step"),
        TensorSpec("new_token_mask", "bool", ("S", "S"), "[i, j] True if new token i may attend new token j "
                   "(causal for prefill, the tree attention mask for a tree step); the past is always visible"),
        TensorSpec("temperature", "float32", (1,), "softmax temperature of the log-prob outputs (1.0 for greedy)"),
    ]
    outputs = [
        TensorSpec("topk_ids", "int64", (1, "S", k), "the k most likely next tokens at each position, best first"),
        TensorSpec("topk_logprobs", "float32", (1, "S", k), "their log-probabilities at `temperature`"),
        TensorSpec("entropy", "float32", (1, "S"), "entropy (nats) of the next-token distribution at `temperature`"),
        TensorSpec("token_logprobs", "float32", (1, "S", "S"),
                   "[0, i, j] = log P(input_ids[j] | position i) at `temperature`; a node's acceptance reads [parent, node]"),
        TensorSpec("hidden_states", float_dtype, (1, "S", c.hidden_size), "last hidden state (after the final norm), input of heads.onnx"),
    ]
    return inputs, outputs


def heads_io(model: MedusaModel, float_dtype: str, topk: int) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The heads graph's inputs and outputs."""
    c = model.config
    return (
        [TensorSpec("hidden_states", float_dtype, ("R", c.hidden_size), "hidden states to run the Medusa heads on")],
        [TensorSpec("medusa_topk_ids", "int64", ("R", model.num_heads, topk),
                    "[r, k-1, i]: head k's i-th best guess for the token k+1 positions after row r's next token")],
    )


class _StepGraph(nn.Module):
    def __init__(self, model: MedusaModel, k: int):
        super().__init__()
        self.model, self.k = model, k

    def forward(self, input_ids, position_ids, new_token_mask, temperature, past):
        out = self.model.step(input_ids, position_ids, new_token_mask, list(past), temperature, self.k)
        flat = [t for kv in out.new_kv for t in kv]
        return (out.topk_ids, out.topk_logprobs, out.entropy, out.token_logprobs, out.hidden, *flat)


class _HeadsGraph(nn.Module):
    """hidden_states [R, d] -> medusa_topk_ids int64 [R, K, topk] (token ids, best first).

    With ``vocab_ids`` (int64 [N], N >= topk) the heads project onto those N tokens only: each
    projection is an [N, d] weight of gathered rows (an initializer of its own, so a
    quantizer quantizes the smaller matrix), top-k runs over N, and a Gather on the int64 [N]
    table maps the indices back to token ids. The contract is unchanged.
    """

    def __init__(self, model: MedusaModel, topk: int, vocab_ids: np.ndarray | None = None):
        super().__init__()
        self.model, self.topk = model, topk
        self.subset = vocab_ids is not None
        if self.subset:
            ids = torch.as_tensor(np.asarray(vocab_ids, dtype=np.int64))
            self.register_buffer("vocab_ids", ids)
            self.sub_weights = nn.ParameterList(
                nn.Parameter(w.detach()[ids].clone(), requires_grad=False) for w in model.heads.projection_weights())

    def forward(self, hidden_states):
        if not self.subset:
            logits = self.model.heads(hidden_states)  # [K, R, V]
            return torch.topk(logits, self.topk, dim=-1).indices.transpose(0, 1)  # [R, K, topk]
        states = self.model.heads.head_states(hidden_states)  # [K, R, d]
        if len(self.sub_weights) == 1:  # shared lm_head: one 2-D Gemm for all K heads, weight read once
            logits = project_stacked(states, self.sub_weights[0])  # [K, R, N]
        else:
            logits = torch.stack([nn.functional.linear(s, w) for s, w in zip(states, self.sub_weights)])
        idx = torch.topk(logits, self.topk, dim=-1).indices.transpose(0, 1)  # [R, K, topk] in [0, N)
        return self.vocab_ids.index_select(0, idx.reshape(-1)).reshape(idx.shape)  # Gather -> token ids


def _export(module: nn.Module, args: tuple, dynamic_shapes, names_in, names_out, path: Path) -> None:
    import logging
    import warnings

    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        prog = torch.onnx.export(module, args, dynamic_shapes=dynamic_shapes, input_names=names_in,
                                 output_names=names_out, dynamo=True, opset_version=OPSET, verbose=False)
    prog.save(str(path), external_data=True)


def export_step(model: MedusaModel, path: Path, dtype: torch.dtype, k: int = STEP_TOPK) -> None:
    """Export the backbone step graph to ``path`` (+ its own external data, merged later)."""
    from torch.export import Dim

    c = model.config
    s_dim, p_dim = Dim("S", min=1, max=1 << 20), Dim("P", min=0, max=1 << 20)
    s, p = 3, 5  # example sizes (not 0/1, which torch.export would specialise)
    # Distinct example tensors: torch.export would merge aliased inputs (one tensor as key and value).
    kv_shape = (1, p, c.num_key_value_heads, c.head_dim)
    past = [(torch.randn(kv_shape).to(dtype), torch.randn(kv_shape).to(dtype)) for _ in range(c.num_hidden_layers)]
    args = (torch.zeros(1, s, dtype=torch.int64), torch.arange(p, p + s)[None],
            torch.ones(s, s, dtype=torch.bool).tril(), torch.ones(1), past)
    ds = {"input_ids": {1: s_dim}, "position_ids": {1: s_dim}, "new_token_mask": {0: s_dim, 1: s_dim},
          "temperature": None, "past": [({1: p_dim}, {1: p_dim}) for _ in range(c.num_hidden_layers)]}
    ins, outs = step_io(model, "float32", k)
    _export(_StepGraph(model, k), args, ds, [t.name for t in ins], [t.name for t in outs], path)


def export_heads(model: MedusaModel, path: Path, dtype: torch.dtype, topk: int,
                 vocab_ids: np.ndarray | None = None) -> None:
    """Export the heads graph to ``path``.

    Args:
        model: the model (its heads and, when shared, its lm_head).
        path: the ONNX file to write (external data beside it).
        dtype: the example input's float dtype (the graph's float dtype).
        topk: candidates per head.
        vocab_ids: None for the full vocabulary, or int64 [N]: the token subset the heads
            project onto (:func:`medusa_export.loading.draft_vocab.subset_ids`).
    """
    from torch.export import Dim

    args = (torch.zeros(2, model.config.hidden_size, dtype=dtype),)
    ins, outs = heads_io(model, "float32", topk)
    _export(_HeadsGraph(model, topk, vocab_ids), args, {"hidden_states": {0: Dim("R", min=1, max=1 << 16)}},
            [t.name for t in ins], [t.name for t in outs], path)


def merge_weights(model_paths: list[Path], weights_name: str = WEIGHTS_FILE) -> dict:
    """Rewrite ONNX models so all their initializers live in one shared external-data file.

    Identical tensors (same dtype, shape and bytes) are stored once. Locations are relative
    to the models' folder, so the artifact loads from any working directory. The models'
    previous external-data files are deleted.

    Args:
        model_paths: ONNX files in the same directory.
        weights_name: the shared data file's name.

    Returns:
        {"tensors": stored tensor count, "bytes": data file size, "deduplicated": count}.
    """
    folder = model_paths[0].parent
    old_data = set()  # whatever external data files the models reference now (exporter's, quantizer's)
    for p in model_paths:
        for t in onnx.load(str(p), load_external_data=False).graph.initializer:
            old_data.update(folder / e.value for e in t.external_data if e.key == "location")
    models = [onnx.load(str(p), load_external_data=True) for p in model_paths]
    offsets: dict[str, tuple[int, int]] = {}
    stored = dedup = 0
    with open(folder / weights_name, "wb") as fh:
        for m in models:
            for t in m.graph.initializer:
                arr = numpy_helper.to_array(t)
                raw = np.ascontiguousarray(arr).tobytes()
                if len(raw) < 1024:
                    continue  # small constants stay inside the graph
                key = hashlib.sha256(raw).hexdigest() + f"{arr.dtype}{arr.shape}"
                if key not in offsets:
                    pad = (-fh.tell()) % _ALIGN
                    fh.write(b"\0" * pad)
                    offsets[key] = (fh.tell(), len(raw))
                    fh.write(raw)
                    stored += 1
                else:
                    dedup += 1
                off, length = offsets[key]
                dims, dtype, name = list(t.dims), t.data_type, t.name
                t.Clear()
                t.name, t.data_type = name, dtype
                t.dims.extend(dims)
                t.data_location = onnx.TensorProto.EXTERNAL
                for k, v in (("location", weights_name), ("offset", str(off)), ("length", str(length))):
                    e = t.external_data.add()
                    e.key, e.value = k, v
        size = fh.tell()
    for f in old_data:
        if f.name != weights_name and f.exists():
            f.unlink()
    for m, p in zip(models, model_paths):
        onnx.save(m, str(p))
    return {"tensors": stored, "bytes": size, "deduplicated": dedup}
