"""The step graph's acceptance outputs from its logits (``model/medusa.py`` ``acceptance_outputs``): log-softmax
at the step's ``temperature`` in float32, top-k, entropy, each node's log-prob of every input token and, in the
batch-1 graph, the in-graph sampler's ``sampled_ids`` (:mod:`.sampler`).

Written by both step writers (:mod:`.portable`, :mod:`.fused`) with a :class:`~.graph.GraphBuilder`.
"""

from __future__ import annotations

from .graph import GraphBuilder
from .sampler import write_sampler


def acceptance_outputs(b: GraphBuilder, logits: str, k: int) -> None:
    """The step's acceptance outputs from logits [S, V] (``model/medusa.py`` ``acceptance_outputs``):
    log-softmax at ``temperature`` in float32, top-k, entropy, each node's log-prob of every input token,
    and the in-graph sampler's ``sampled_ids`` (:mod:`.sampler`, docs/sampling.md, ``step_sampler`` v1),
    which reads the probabilities the entropy computes."""
    lf = b.to_float32(logits, "logits/cast")
    logp = b.op("LogSoftmax", [b.op("Div", [lf, "temperature"], "logits/temperature")], "logprobs", axis=-1)
    top_lp, top_ids = b.op("TopK", [logp, b.const([k], "int64")], "topk", n_out=2, axis=-1, largest=1,
                           sorted=1)
    axis0 = b.const([0], "int64")
    b.op("Unsqueeze", [top_ids, axis0], "topk_ids/unsqueeze", outputs=["topk_ids"])
    b.op("Unsqueeze", [top_lp, axis0], "topk_logprobs/unsqueeze", outputs=["topk_logprobs"])
    probs = b.op("Exp", [logp], "entropy/exp")  # [S, V]
    plogp = b.op("Mul", [probs, logp], "entropy/plogp")
    ent = b.op("Neg", [b.op("ReduceSum", [plogp, b.const([-1], "int64")], "entropy/sum", keepdims=0)],
               "entropy/neg")
    b.op("Unsqueeze", [ent, axis0], "entropy/unsqueeze", outputs=["entropy"])
    ids = b.op("Reshape", ["input_ids", b.const([-1], "int64")], "token_logprobs/ids")
    tok = b.op("Gather", [logp, ids], "token_logprobs/gather", axis=1)  # [S, S]
    b.op("Unsqueeze", [tok, axis0], "token_logprobs/unsqueeze", outputs=["token_logprobs"])
    write_sampler(b, probs)


def batched_acceptance_outputs(b: GraphBuilder, logits: str, k: int) -> None:
    """The batched step's acceptance outputs from logits [B * S, V]: those of
    :func:`acceptance_outputs` (``model/medusa.py`` ``acceptance_outputs``) per row, at the
    row's ``temperature`` [B]: log-softmax in float32, top-k, entropy, and ``token_logprobs`` [b, i, j] =
    logp[b, i, input_ids[b, j]], all [B, S, ...]."""
    lf = b.to_float32(logits, "logits/cast")
    bsv = b.op("Concat", [b.op("Shape", ["input_ids"], "logits/bs"), b.const([-1], "int64")], "logits/bsv_shape", axis=0)
    lf = b.op("Reshape", [lf, bsv], "logits/bsv")  # [B, S, V]
    t = b.op("Reshape", ["temperature", b.const([-1, 1, 1], "int64")], "logits/temperature_rows")  # [B, 1, 1]
    logp = b.op("LogSoftmax", [b.op("Div", [lf, t], "logits/temperature")], "logprobs", axis=-1)
    b.op("TopK", [logp, b.const([k], "int64")], "topk", n_out=2, outputs=["topk_logprobs", "topk_ids"], axis=-1,
         largest=1, sorted=1)
    plogp = b.op("Mul", [b.op("Exp", [logp], "entropy/exp"), logp], "entropy/plogp")
    b.op("Neg", [b.op("ReduceSum", [plogp, b.const([-1], "int64")], "entropy/sum", keepdims=0)], "entropy/neg",
         outputs=["entropy"])
    ids = b.op("Unsqueeze", ["input_ids", b.const([1], "int64")], "token_logprobs/ids")  # [B, 1, S]
    bss = b.op("Concat", [b.op("Shape", ["input_ids"], "token_logprobs/bs"),
                          b.op("Shape", ["input_ids"], "token_logprobs/s", start=1, end=2)], "token_logprobs/bss", axis=0)
    ids = b.op("Expand", [ids, bss], "token_logprobs/ids_rows")  # [B, S, S]
    b.op("GatherElements", [logp, ids], "token_logprobs/gather", outputs=["token_logprobs"], axis=2)
