"""The artifact's graph contract: file names, opset, and every graph input and output as data.

The manifest lists these (``graphs.model`` / ``graphs.heads``), the runtime checks a session against
them, and the graph writers declare exactly these inputs and outputs.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..model.medusa import STEP_TOPK

OPSET = 18
#: ONNX IR version of the written models (opset 18 needs IR >= 8; TensorRT 10's parser reads IR 10).
IR_VERSION = 10
MODEL_FILE = "model.onnx"
HEADS_FILE = "heads.onnx"
#: Graph file of head j (1-based) of path-conditioned heads (the manifest's ``heads.type`` == "hydra").
LEVEL_FILE = "heads_level{}.onnx"


def level_key(depth: int) -> str:
    """The manifest's ``graphs`` / ``files`` key of the level-``depth`` graph (the runtime's ``artifact.level_graph``)."""
    return f"heads_level{depth}"


@dataclass(frozen=True)
class TensorSpec:
    """One graph input or output of the contract (also written to the manifest)."""

    name: str
    dtype: str
    shape: tuple
    meaning: str

    def to_json(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "meaning": self.meaning}


#: The in-graph sampler's version (manifest ``step_sampler``; docs/sampling.md), written by every step graph.
STEP_SAMPLER_VERSION = 1
SAMPLER_INPUTS = (
    TensorSpec("sample_uniforms", "float32", (1, "S"),
               "row i's uniform in [0, 1) for the inverse-CDF draw of sampled_ids[0, i]; < 0: row i not sampled"),
    TensorSpec("sample_top_k", "int64", (1,),
               "top-k of the draw; 0 = the whole vocabulary; -1 = sampler off (skipped; sampled_ids all -1)"),
    TensorSpec("sample_top_p", "float32", (1,), "top-p inside the top-k, in (0, 1]; 1 = off"),
)
SAMPLER_OUTPUTS = (
    TensorSpec("sampled_ids", "int64", (1, "S"),
               "a token drawn at each row from softmax(logits / temperature) truncated by top-k then top-p, by "
               "inverse CDF over the kept tokens in increasing id order with sample_uniforms; -1 where not sampled"),
)


def step_sampler_json() -> dict:
    """The manifest's ``step_sampler`` entry (the runtime's ``medusa_runtime.contract.artifact.step_sampler`` reads it)."""
    return {"version": STEP_SAMPLER_VERSION, "spec": "docs/sampling.md"}


def step_io(cfg, float_dtype: str, k: int = STEP_TOPK, batched: bool = False) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The portable backbone step's inputs and outputs: names, dtypes, shapes (symbolic S, P; B when batched) and
    meanings.

    Args:
        cfg: the backbone config (``num_hidden_layers``, ``num_key_value_heads``, ``head_dim``, ``hidden_size``,
            ``vocab_size``).
        float_dtype: "float32" or "float16" (K/V and hidden states).
        k: top-k width (capped at the vocabulary).
        batched: the batched step (``build --batch-size N``, N > 1): a leading dynamic batch dimension B on
            every tensor, a per-row ``new_token_mask`` and ``temperature``, and ``past_sequence_length`` [B]
            (each row's valid past; the past tensors are padded to the longest row). False: the batch-1
            contract of every artifact built before.
    """
    b = "B" if batched else 1
    kv = (b, "P", cfg.num_key_value_heads, cfg.head_dim)
    new_kv = (b, "S", cfg.num_key_value_heads, cfg.head_dim)
    inputs, outputs = step_token_io(cfg, float_dtype, k, batched)
    if batched:
        inputs.append(TensorSpec("past_sequence_length", "int32", ("B",),
                                 "P_b: valid past slots of row b (slots [P_b, P) of its past are padding, ignored)"))
    past = ("layer {i} {n}s of the rows' past, sequence-major [B, P, H_kv, D]: row b's valid tokens are slots "
            "[0, past_sequence_length[b]); P is the longest row's") if batched else \
        "layer {i} {n}s of the P valid past tokens, sequence-major [1, P, H_kv, D]"
    for i in range(cfg.num_hidden_layers):
        for n in ("key", "value"):
            inputs.append(TensorSpec(f"past_key_values.{i}.{n}", float_dtype, kv, past.format(i=i, n=n)))
    for i in range(cfg.num_hidden_layers):
        for n in ("key", "value"):
            outputs.append(TensorSpec(f"new_key_values.{i}.{n}", float_dtype, new_kv,
                                      f"layer {i} {n}s of this step's S tokens only (keep the accepted ones)"))
    return inputs, outputs


def step_token_io(cfg, float_dtype: str, k: int = STEP_TOPK,
                  batched: bool = False) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The step's inputs and outputs other than the KV cache (shared by the portable and fused graphs).

    ``batched``: B rows (sequences) per call, each with S new tokens after its own past, its own tree mask and
    temperature (see :func:`step_io`); else the batch-1 contract.
    """
    k = min(k, cfg.vocab_size)
    if not batched:
        inputs = [
            TensorSpec("input_ids", "int64", (1, "S"), "tokens of this step: the prompt (prefill) or the tree's candidates in node order"),
            TensorSpec("position_ids", "int64", (1, "S"), "positions: P + arange(S) for prefill, P + depth for a tree step"),
            TensorSpec("new_token_mask", "bool", ("S", "S"), "[i, j] True if new token i may attend new token j "
                       "(causal for prefill, the tree attention mask for a tree step); the past is always visible "
                       "(in a sliding-window layer: the keys whose position p satisfies q - W < p)"),
            TensorSpec("temperature", "float32", (1,), "softmax temperature of the log-prob outputs (1.0 for greedy)"),
            *SAMPLER_INPUTS,
        ]
        b = 1
    else:
        inputs = [
            TensorSpec("input_ids", "int64", ("B", "S"), "tokens of this step per row: the prompt (prefill) or the "
                       "tree's candidates in node order (a row shorter than S is padded: see new_token_mask)"),
            TensorSpec("position_ids", "int64", ("B", "S"), "positions: P_b + arange(S) for prefill, P_b + depth for "
                       "a tree step (P_b = past_sequence_length[b])"),
            TensorSpec("new_token_mask", "bool", ("B", "S", "S"), "[b, i, j] True if row b's new token i may attend "
                       "its new token j (causal for prefill, the tree attention mask for a tree step; a padding token "
                       "sees itself only and no real token sees it); the row's valid past is always visible (in a "
                       "sliding-window layer: the keys whose position p satisfies q - W < p)"),
            TensorSpec("temperature", "float32", ("B",), "softmax temperature of each row's log-prob outputs (1.0 "
                       "for greedy)"),
        ]
        b = "B"
    outputs = [
        TensorSpec("topk_ids", "int64", (b, "S", k), "the k most likely next tokens at each position, best first"),
        TensorSpec("topk_logprobs", "float32", (b, "S", k), "their log-probabilities at `temperature`"),
        TensorSpec("entropy", "float32", (b, "S"), "entropy (nats) of the next-token distribution at `temperature`"),
        TensorSpec("token_logprobs", "float32", (b, "S", "S"),
                   "[b, i, j] = log P(input_ids[b, j] | position i of row b) at `temperature`; a node's acceptance "
                   "reads [b, parent, node]" if batched else
                   "[0, i, j] = log P(input_ids[j] | position i) at `temperature`; a node's acceptance reads [parent, node]"),
        TensorSpec("hidden_states", float_dtype, (b, "S", cfg.hidden_size), "last hidden state (after the final norm), input of heads.onnx"),
        *(() if batched else SAMPLER_OUTPUTS),
    ]
    return inputs, outputs


def heads_io(hidden_size: int, num_heads: int, float_dtype: str, topk: int) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The Medusa heads graph's inputs and outputs (``heads.onnx``)."""
    return (
        [TensorSpec("hidden_states", float_dtype, ("R", hidden_size), "hidden states to run the Medusa heads on")],
        [TensorSpec("medusa_topk_ids", "int64", ("R", num_heads, topk),
                    "[r, k-1, i]: head k's i-th best guess for the token k+1 positions after row r's next token"),
         TensorSpec("medusa_topk_logprobs", "float32", ("R", num_heads, topk),
                    "their log-probabilities (log-softmax over the heads' vocabulary: all V ids, or the heads_vocab "
                    "subset); per-step trees (--tree dynamic:T) score candidates with them")],
    )


def level_io(hidden_size: int, depth: int, float_dtype: str, topk: int) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The level-``depth`` graph of path-conditioned heads (``heads_level{depth}.onnx``): its inputs and outputs."""
    return (
        [TensorSpec("hidden_states", float_dtype, ("H", hidden_size),
                    "h_t, the last accepted node's hidden state: one row for every path (H = 1) or one per path (H = R)"),
         TensorSpec("path_ids", "int64", ("R", depth),
                    f"R paths: the root (the backbone's next token) and the {depth - 1} candidate tokens below it, "
                    f"down to the parent of the nodes this level proposes")],
        [TensorSpec("level_topk_ids", "int64", ("R", topk), f"head {depth}'s best tokens under each path, best first"),
         TensorSpec("level_topk_logprobs", "float32", ("R", topk),
                    "their log-probabilities (log-softmax over the heads' vocabulary: all V ids, or the heads_vocab "
                    "subset)")],
    )
