"""The heads graphs, written node by node from the heads' and the backbone's weights.

Medusa heads, ``heads.onnx``: ``hidden_states [R, d] -> medusa_topk_ids int64 [R, K, topk],
medusa_topk_logprobs float32 [R, K, topk]``: each head's residual blocks ``h + SiLU(W1 h + b1)``
(Medusa paper §2.1.1), then the vocabulary projection: the heads' own ``[V, d]`` matrices, or the
backbone's lm_head shared by the K heads as one ``[K R, d] x [d, V]`` Gemm on the backbone's own
table (stored once in ``weights.bin``), then a float32 LogSoftmax and TopK. The runtime runs it on
the hidden state of the last accepted node only; per-step trees (``--tree dynamic:T``) score the
candidates with the log-probabilities.

Path-conditioned heads (:mod:`medusa_export.model.hydra_heads`), one graph per depth,
``heads_level{j}.onnx``: ``hidden_states [H, d] (H = 1 or R), path_ids int64 [R, j] ->
level_topk_ids int64 [R, topk], level_topk_logprobs float32 [R, topk]``. Inside: Gather the paths'
rows of the backbone's input embedding (the same weights entry as the step graph's), each scaled
to RMS 1 in float32 (``rms_normalized``), ``[h_t, n(e(root)), .., n(e(x_{j-1}))]`` per row, head
j's first block ``R x + SiLU(W x + b)`` and its further residual blocks, the shared projection,
LogSoftmax, TopK. The runtime runs level 1 on the root and each later level on the paths it expands
(:mod:`medusa_runtime.decode.candidates`).

With a vocabulary subset (``--heads-vocab N``, FR-Spec) each projection is an ``[N, d]`` tensor of
gathered rows (its own weights entry, so int8 / int4 quantize the smaller matrix), top-k runs over N
and a ``Gather`` on the int64 ``[N]`` id table maps the indices back to token ids: the contract is unchanged.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..model.heads import HeadsConfig
from ..model.hydra_heads import PATH_NORM_EPS
from .contract import TensorSpec, heads_io, level_io
from .graph import GraphBuilder
from .quantize import WeightOnlyConfig
from .weights import Recipe

#: Name of the heads' vocabulary-subset id table in ``weights.bin``.
VOCAB_IDS = "heads.vocab_ids"


def write_heads(b: GraphBuilder, heads: HeadsConfig, lm_head: str, topk: int,
                quant: WeightOnlyConfig | None = None, vocab_ids: np.ndarray | None = None,
                vocab_origin: str = "") -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Add the heads graph's nodes and weights to ``b``.

    Args:
        b: the builder (its dtype is the graph's).
        heads: the heads' structure (K heads, N blocks, own projections or not).
        lm_head: the backbone tensor of the shared projection (the embedding's key when tied).
        topk: candidates per head.
        quant: MatMulNBits settings (blocks and projections), or None for float.
        vocab_ids: int64 [N] token ids the heads project onto (None: the whole vocabulary).
        vocab_origin: where ``vocab_ids`` come from (recorded with the tensor).

    Returns:
        (inputs, outputs) of the contract (:func:`~.contract.heads_io`).
    """
    x = "hidden_states"
    rows_of = b.array(VOCAB_IDS, np.asarray(vocab_ids, np.int64), vocab_origin) if vocab_ids is not None else ""
    axis0 = b.const([0], "int64")
    states = [_blocks(b, x, h, 0, heads.num_layers, quant) for h in range(heads.num_heads)]
    if heads.own_projection:
        logits = [b.op("Unsqueeze", [b.projection(s, f"heads.{h}.proj", f"{h}.{heads.num_layers}.weight", "heads",
                                                  quant, rows_of), axis0], f"heads.{h}.proj/unsqueeze")
                  for h, s in enumerate(states)]
        logits = b.op("Concat", logits, "heads/logits", axis=0)  # [K, R, N]
    else:  # one Gemm for all K heads: the [V, d] table is read once per call
        stacked = b.op("Concat", [b.op("Unsqueeze", [s, axis0], f"heads.{h}/unsqueeze") for h, s in enumerate(states)],
                       "heads/states", axis=0)  # [K, R, d]
        flat = b.op("Reshape", [stacked, b.const([-1, heads.hidden_size], "int64")], "heads/states_flat")
        proj = b.projection(flat, "heads/proj", lm_head, "backbone", quant, rows_of)  # [K R, N]
        n_out = len(vocab_ids) if vocab_ids is not None else heads.vocab_size
        logits = b.op("Reshape", [proj, b.const([heads.num_heads, -1, n_out], "int64")], "heads/logits")
    _topk_outputs(b, logits, topk, rows_of, "heads", "medusa_topk_ids", "medusa_topk_logprobs", perm=[1, 0, 2])
    return heads_io(heads.hidden_size, heads.num_heads, b.dtype, topk)


def write_level(b: GraphBuilder, heads: HeadsConfig, lm_head: str, depth: int, topk: int,
                quant: WeightOnlyConfig | None = None, vocab_ids: np.ndarray | None = None,
                vocab_origin: str = "") -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Add the level-``depth`` graph of path-conditioned heads to ``b`` (module docstring).

    The maths is :meth:`~medusa_export.model.hydra_heads.HydraHeads.head_state` followed by the shared
    projection (Ankner et al. 2024, arXiv 2402.05109, §3; the RMS scaling of the path embeddings is ours).

    Args:
        b: the builder (its dtype is the graph's).
        heads: the heads' structure (``head_type`` "hydra": K heads, N blocks, the backbone's projection).
        lm_head: the backbone tensor of the shared projection (the embedding's key when tied).
        depth: j, 1-based: the head that proposes the nodes at depth j (it reads j path tokens).
        topk, quant, vocab_ids, vocab_origin: as :func:`write_heads`.

    Returns:
        (inputs, outputs) of the contract (:func:`~.contract.level_io`).
    """
    d, h = heads.hidden_size, depth - 1
    rows_of = b.array(VOCAB_IDS, np.asarray(vocab_ids, np.int64), vocab_origin) if vocab_ids is not None else ""
    n = f"level{depth}"
    embed = "model.embed_tokens.weight"
    table = b.weight(embed, Recipe("backbone", (embed,), "rows", b.dtype))[0].name
    e = b.to_float32(b.op("Gather", [table, "path_ids"], n + "/embed", axis=0), n + "/embed_f32")  # [R, j, d]
    mean = b.op("ReduceMean", [b.op("Mul", [e, e], n + "/embed_sq"), b.const([-1], "int64")], n + "/embed_ms",
                keepdims=1)
    inv = b.op("Reciprocal", [b.op("Sqrt", [b.op("Add", [mean, b.const(np.float32(PATH_NORM_EPS))], n + "/embed_eps")],
                                   n + "/embed_rms")], n + "/embed_inv")
    normed = b.from_float32(b.op("Mul", [e, inv], n + "/embed_norm"), n + "/embed_cast")
    flat = b.op("Reshape", [normed, b.const([0, depth * d], "int64")], n + "/path")  # [R, j d]
    rows = b.op("Shape", ["path_ids"], n + "/rows", start=0, end=1)  # [1] = R
    hidden = b.op("Expand", ["hidden_states", b.op("Concat", [rows, b.const([d], "int64")], n + "/hidden_shape",
                                                    axis=0)], n + "/hidden")  # [R, d]
    x = b.op("Concat", [hidden, flat], n + "/input", axis=-1)  # [R, (j + 1) d]
    first = f"heads.{h}.0"
    res = _dense(b, x, f"{h}.0.res", first + "/res", quant)
    y = b.op("Add", [res, b.silu(_dense(b, x, f"{h}.0.linear", first + "/linear", quant), first + "/silu")],
             first + "/residual")  # [R, d]
    y = _blocks(b, y, h, 1, heads.num_layers, quant)
    logits = b.projection(y, n + "/proj", lm_head, "backbone", quant, rows_of)  # [R, N]
    _topk_outputs(b, logits, topk, rows_of, n, "level_topk_ids", "level_topk_logprobs")
    return level_io(d, depth, b.dtype, topk)


def _dense(b: GraphBuilder, x: str, key: str, name: str, quant: WeightOnlyConfig | None) -> str:
    """``x W^T + b`` of the heads' ``key.weight`` [out, in] / ``key.bias``: a float Gemm on the weight as
    stored (transB, bias inside), or MatMulNBits."""
    if quant is None:
        w = b.weight(f"{key}.weight", Recipe("heads", (f"{key}.weight",), "rows", b.dtype))[0].name
        bias = b.weight(f"{key}.bias", Recipe("heads", (f"{key}.bias",), "rows", b.dtype))[0].name
        return b.op("Gemm", [x, w, bias], name, transB=1)
    return b.linear(x, name, (f"{key}.weight",), (f"{key}.bias",), source="heads", quant=quant)


def _blocks(b: GraphBuilder, y: str, h: int, start: int, stop: int, quant: WeightOnlyConfig | None) -> str:
    """Head ``h``'s residual blocks ``start..stop-1``: ``y + SiLU(W y + b)`` each ([R, d])."""
    for layer in range(start, stop):
        n = f"heads.{h}.{layer}"
        y = b.op("Add", [y, b.silu(_dense(b, y, f"{h}.{layer}.linear", n + "/linear", quant), n + "/silu")],
                 n + "/residual")
    return y


def _topk_outputs(b: GraphBuilder, logits: str, topk: int, rows_of: str, n: str, ids_out: str, lp_out: str,
                  perm: list[int] | None = None) -> None:
    """TopK over the last axis of ``logits`` (the ids exactly as the logits rank them), their float32
    log-softmax values gathered beside, the ids mapped through ``rows_of`` (a vocabulary subset), both
    optionally transposed by ``perm``; written to ``ids_out`` / ``lp_out``."""
    direct = perm is None and not rows_of  # the TopK indices are the output
    _, idx = b.op("TopK", [logits, b.const([topk], "int64")], n + "/topk", n_out=2, axis=-1, largest=1, sorted=1,
                  outputs=[n + "/topk/out0", ids_out if direct else n + "/topk/out1"])
    logp = b.op("LogSoftmax", [b.to_float32(logits, n + "/logits_f32")], n + "/logprobs", axis=-1)
    b.op("GatherElements", [logp, idx], n + "/topk_logprobs", axis=-1,
         outputs=[lp_out] if perm is None else None)
    if perm is not None:
        b.op("Transpose", [f"{n}/topk_logprobs/out"], n + "/topk_logprobs_t", perm=perm, outputs=[lp_out])
        idx = b.op("Transpose", [idx], n + "/topk_t", perm=perm, outputs=None if rows_of else [ids_out])
    if rows_of:
        b.op("Gather", [rows_of, idx], n + "/token_ids", outputs=[ids_out], axis=0)


def write_heads_only(folder: Path, sources, topk: int, vocab_ids: np.ndarray | None = None,
                     dtype: str = "float32", quant: WeightOnlyConfig | None = None) -> Path:
    """A standalone heads graph: ``heads.onnx`` + its own ``weights.bin`` in ``folder`` (tests, experiments).

    Args:
        folder: an existing folder.
        sources: a :class:`~medusa_export.loading.sources.ModelSources`.
        topk, vocab_ids, quant: as :func:`write_heads`; dtype: the graph's float dtype.

    Returns:
        The ``heads.onnx`` path.
    """
    import onnx

    from .contract import HEADS_FILE
    from .portable import lm_head_key
    from .weights import WEIGHTS_FILE, WeightsWriter

    writer = WeightsWriter(Path(folder) / WEIGHTS_FILE, sources.by_name)
    b = GraphBuilder(writer, dtype)
    ins, outs = write_heads(b, sources.heads_config, lm_head_key(sources.config), topk, quant, vocab_ids, "caller")
    writer.close()
    path = Path(folder) / HEADS_FILE
    onnx.save(b.model("medusa_heads", ins, outs, "medusa-export", quant is not None), str(path))
    return path
