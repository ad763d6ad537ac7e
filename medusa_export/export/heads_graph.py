"""The Medusa heads graph (``heads.onnx``), written node by node from the heads' and the backbone's weights.

``hidden_states [R, d] -> medusa_topk_ids int64 [R, K, topk]``: each head's residual blocks
``h + SiLU(W1 h + b1)`` (seeds/001 §2.1.1), then the vocabulary projection: the heads' own ``[V, d]``
matrices, or the backbone's lm_head shared by the K heads as one ``[K R, d] x [d, V]`` Gemm on the
backbone's own table (stored once in ``weights.bin``). The runtime runs it on the hidden state of the
last accepted node only.

With a vocabulary subset (``--heads-vocab N``, FR-Spec) each projection is an ``[N, d]`` tensor of
gathered rows (its own weights entry, so int8 / int4 quantize the smaller matrix), top-k runs over N
and a ``Gather`` on the int64 ``[N]`` id table maps the indices back to token ids: the contract is unchanged.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..model.heads import HeadsConfig
from .contract import TensorSpec, heads_io
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
    states = []
    for h in range(heads.num_heads):
        y = x
        for layer in range(heads.num_layers):
            n, key = f"heads.{h}.{layer}", f"{h}.{layer}.linear"
            if quant is None:  # Gemm on the [d, d] weight as stored ([out, in], transB), bias inside
                w = b.weight(f"{key}.weight", Recipe("heads", (f"{key}.weight",), "rows", b.dtype))[0].name
                bias = b.weight(f"{key}.bias", Recipe("heads", (f"{key}.bias",), "rows", b.dtype))[0].name
                lin = b.op("Gemm", [y, w, bias], n + "/linear", transB=1)
            else:
                lin = b.linear(y, n + "/linear", (f"{key}.weight",), (f"{key}.bias",), source="heads", quant=quant)
            y = b.op("Add", [y, b.silu(lin, n + "/silu")], n + "/residual")  # [R, d]
        states.append(y)
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
    _, idx = b.op("TopK", [logits, b.const([topk], "int64")], "heads/topk", n_out=2, axis=-1, largest=1, sorted=1)
    out = "medusa_topk_ids"
    if rows_of:
        idx = b.op("Transpose", [idx], "heads/topk_t", perm=[1, 0, 2])  # [R, K, topk] in [0, N)
        b.op("Gather", [rows_of, idx], "heads/token_ids", outputs=[out], axis=0)
    else:
        b.op("Transpose", [idx], "heads/topk_t", perm=[1, 0, 2], outputs=[out])
    return heads_io(heads.hidden_size, heads.num_heads, b.dtype, topk)


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
