"""The portable backbone step graph (``model.onnx``), written node by node from the checkpoint's weights.

Standard ONNX ops only (opset 18), so ONNX Runtime and TensorRT both run it. One graph serves the
prefill (S = prompt length, causal ``new_token_mask``) and the tree step (S = T, the tree's attention
mask and positions past length + depth, shipped in ``tree.json``); only S and the past length P are
dynamic. The maths is the PyTorch reference's (``model/backbone.py``, Medusa paper §2.1.2), per layer:

* RMSNorm with the variance and the normalisation in float32 (:meth:`.graph.GraphBuilder.rms_norm`);
* q / k / v projections (+ biases: Qwen2, Llama ``attention_bias``), q / k RMSNorm over each head's D
  values before RoPE (Qwen3), RoPE from ``position_ids`` with the config's inverse frequencies
  (``model.config.rope_inv_freq``: default, linear, llama3 scaling; computed in the graph, so any
  position works);
* attention grouped by KV head without repeating K/V: queries ``[1, H_kv, G, S, D]`` against past keys
  ``[1, H_kv, 1, D, P]`` and the step's own keys, scores in float32 with additive masks (0 /
  float32 min, so nothing overflows in fp16), one softmax over past and new keys together; the past is
  read, never concatenated to the new K/V (no per-step copy of the cache);
* sliding window (Mistral; Qwen2/3 per ``layer_types``) applied in the masks by *positions*: past slot p
  holds position p and a tree node sits at past length + depth, so a query at position q sees key position
  p iff q - W < p <= q (transformers ``masking_utils.sliding_window_overlay``);
* SiLU-gated MLP (+ biases: Llama ``mlp_bias``), residual adds;
* final RMSNorm -> ``hidden_states``; the lm_head as ``Gemm(transB=1)`` on the ``[V, d]`` table (the
  embedding itself when tied: stored once) and the acceptance outputs (``model/medusa.py``).

fp16: weights, activations and K/V float16; norms' variance, attention scores, softmax and the output
log-probs float32. int8 / int4: every linear layer (and the lm_head unless ``--no-quantize-lm-head``) a
``com.microsoft::MatMulNBits`` with blocks computed per tensor (ONNX Runtime only; flavour ``ort-contrib``).
"""

from __future__ import annotations

import numpy as np

from ..model.config import BackboneConfig, rope_inv_freq
from ..model.medusa import STEP_TOPK
from .step_outputs import acceptance_outputs, batched_acceptance_outputs
from .contract import TensorSpec, step_io
from .graph import GraphBuilder
from .quantize import WeightOnlyConfig
from .weights import Recipe

_INT64_MAX = np.iinfo(np.int64).max


def layer_key(i: int, name: str) -> str:
    """The HF key of layer ``i``'s tensor ``name`` (``self_attn.q_proj.weight`` -> ``model.layers.{i}.self_attn...``)."""
    return f"model.layers.{i}.{name}"


def lm_head_key(cfg: BackboneConfig) -> str:
    """The checkpoint tensor the lm_head projects with: the embedding when tied."""
    return "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"


class Masks:
    """The additive attention masks of one step, float32 (0 = may attend, float32 min = may not), shaped to
    broadcast over the scores [B, H_kv, G, S, *].

    Batch-1 graph: the new tokens' [S, S]; the past is all valid (no mask) except in a sliding-window layer
    ([S, P] by positions). Batched graph: the new tokens' [B, 1, 1, S, S] and the past's [B, 1, 1, 1, P]
    (slots at or beyond the row's ``past_sequence_length`` masked); a sliding-window layer's per query
    ([B, 1, 1, S, P] and [B, 1, 1, S, S]).

    Args:
        b: the builder; cfg: the backbone (its windows).
        past_len: int64 [1], P (the past slots the scores cover); None: its own Shape node (batch-1 graph).
        batched: the batched contract (:func:`~.contract.step_io`).
    """

    def __init__(self, b: GraphBuilder, cfg: BackboneConfig, past_len: str | None, batched: bool = False):
        self.b, self.batched = b, batched
        self.zero, self.min = b.const(np.float32(0.0)), b.const(np.float32(np.finfo(np.float32).min))
        new = b.op("Where", ["new_token_mask", self.zero, self.min], "mask/new")  # [S, S] or [B, S, S]
        self.new = b.op("Unsqueeze", [new, b.const([1, 2], "int64")], "mask/new_rows") if batched else new
        self.past = None
        self._windows: dict[int, tuple[str, str]] = {}
        self.windows = sorted({w for i in range(cfg.num_hidden_layers) if (w := cfg.window(i)) is not None})
        if batched:
            self.p_row = self._past_row(past_len)
            lengths = b.op("Unsqueeze", [b.cast("past_sequence_length", "int64", "mask/lengths64"),
                                         b.const([1], "int64")], "mask/lengths")  # [B, 1]
            self.valid = b.op("Less", [self.p_row, lengths], "mask/past_valid")  # [B, P]
            self.past = b.op("Reshape", [b.op("Where", [self.valid, self.zero, self.min], "mask/past_bP"),
                                         b.const([0, 1, 1, 1, -1], "int64")], "mask/past")  # [B, 1, 1, 1, P]
            if self.windows:
                self.q_col = b.op("Unsqueeze", ["position_ids", b.const([2], "int64")], "mask/q_col")  # [B, S, 1]
                self.k_row = b.op("Unsqueeze", ["position_ids", b.const([1], "int64")], "mask/k_row")  # [B, 1, S]
                self.valid_rows = b.op("Unsqueeze", [self.valid, b.const([1], "int64")], "mask/past_valid_rows")
        elif self.windows:
            q = b.op("Reshape", ["position_ids", b.const([-1], "int64")], "mask/q_pos")  # [S]
            self.q_col = b.op("Unsqueeze", [q, b.const([1], "int64")], "mask/q_col")  # [S, 1]
            self.k_row = b.op("Unsqueeze", [q, b.const([0], "int64")], "mask/k_row")  # [1, S]
            self.p_row = self._past_row(past_len)

    def _past_row(self, past_len: str | None) -> str:
        """int64 [1, P]: the past slots 0 .. P - 1."""
        b = self.b
        if past_len is None:
            past_len = b.op("Shape", ["past_key_values.0.key"], "mask/past_len", start=1, end=2)
        p = b.op("Squeeze", [past_len, b.const([0], "int64")], "mask/past_len_scalar")
        slots = b.op("Range", [b.const(np.int64(0)), p, b.const(np.int64(1))], "mask/past_pos")  # [P]
        return b.op("Unsqueeze", [slots, b.const([0], "int64")], "mask/past_row")  # [1, P]

    def window(self, w: int) -> tuple[str, str]:
        """(past, new) masks of a sliding window of ``w`` positions: [S, P] and [S, S] (batch-1 graph), or
        [B, 1, 1, S, P] and [B, 1, 1, S, S] (batched: the past's padding masked too)."""
        if w not in self._windows:
            b, n = self.b, f"mask/window{w}"
            lim = b.const(np.int64(w))
            near_new = b.op("Less", [b.op("Sub", [self.q_col, self.k_row], n + "/new_dist"), lim], n + "/new_near")
            new = b.op("Where", [b.op("And", ["new_token_mask", near_new], n + "/new_and"), self.zero, self.min],
                       n + "/new")
            near_past = b.op("Less", [b.op("Sub", [self.q_col, self.p_row], n + "/past_dist"), lim], n + "/past_near")
            if self.batched:
                near_past = b.op("And", [near_past, self.valid_rows], n + "/past_and")  # [B, S, P]
            past = b.op("Where", [near_past, self.zero, self.min], n + "/past")
            if self.batched:
                axes12 = b.const([1, 2], "int64")
                past = b.op("Unsqueeze", [past, axes12], n + "/past_rows")
                new = b.op("Unsqueeze", [new, axes12], n + "/new_rows")
            self._windows[w] = (past, new)
        return self._windows[w]

    def layer(self, w: int | None) -> tuple[str | None, str]:
        """(past mask or None, new-token mask) of a layer with sliding window ``w`` (None: no window)."""
        return self.window(w) if w is not None else (self.past, self.new)


def _rope(b: GraphBuilder, x: str, cos: str, sin: str, half: int, d: int, name: str, out: str | None = None) -> str:
    """``x * cos + rotate_half(x) * sin`` over the last axis (GPT-NeoX halves; transformers ``apply_rotary_pos_emb``)."""
    axis = b.const([-1], "int64")
    first = b.op("Slice", [x, b.const([0], "int64"), b.const([half], "int64"), axis], name + "/first")
    second = b.op("Slice", [x, b.const([half], "int64"), b.const([d], "int64"), axis], name + "/second")
    rot = b.op("Concat", [b.op("Neg", [second], name + "/neg"), first], name + "/rotate", axis=-1)
    return b.op("Add", [b.op("Mul", [x, cos], name + "/cos"), b.op("Mul", [rot, sin], name + "/sin")], name,
                outputs=[out] if out else None)


def _attention(b: GraphBuilder, cfg: BackboneConfig, i: int, h: str, cos: str, sin: str, masks: Masks,
               past_len: str) -> str:
    n, hd, heads, kv = f"layers.{i}.attn", cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    g = heads // kv
    lead = 0 if masks.batched else 1  # Reshape's leading dim: B copied (batched), or the batch-1 graph's 1

    def proj(name: str) -> str:
        bias = (layer_key(i, f"self_attn.{name}.bias"),) if cfg.qkv_bias else ()
        return b.linear(h, f"{n}.{name}", (layer_key(i, f"self_attn.{name}.weight"),), bias)

    q = b.op("Reshape", [proj("q_proj"), b.const([lead, -1, heads, hd], "int64")], f"{n}/q_heads")  # [B, S, H, D]
    k = b.op("Reshape", [proj("k_proj"), b.const([lead, -1, kv, hd], "int64")], f"{n}/k_heads")  # [B, S, Hkv, D]
    v = b.op("Reshape", [proj("v_proj"), b.const([lead, -1, kv, hd], "int64")], f"{n}/v_heads",
             outputs=[f"new_key_values.{i}.value"])
    if cfg.qk_norm:
        q = b.rms_norm(q, layer_key(i, "self_attn.q_norm.weight"), cfg.rms_norm_eps, f"{n}.q_norm")
        k = b.rms_norm(k, layer_key(i, "self_attn.k_norm.weight"), cfg.rms_norm_eps, f"{n}.k_norm")
    q = _rope(b, q, cos, sin, hd // 2, hd, f"{n}/q_rope")
    k = _rope(b, k, cos, sin, hd // 2, hd, f"{n}/k_rope", out=f"new_key_values.{i}.key")
    scale = b.const(np.asarray(hd ** -0.5, dtype=b.dtype))
    q = b.op("Mul", [q, scale], f"{n}/q_scale")
    q = b.op("Reshape", [q, b.const([lead, -1, kv, g, hd], "int64")], f"{n}/q_groups")  # [B, S, Hkv, G, D]
    q = b.op("Transpose", [q], f"{n}/q_t", perm=[0, 2, 3, 1, 4])  # [B, Hkv, G, S, D]
    axis2 = b.const([2], "int64")

    def keys_t(x: str, name: str) -> str:  # [B, L, Hkv, D] -> [B, Hkv, 1, D, L]
        return b.op("Unsqueeze", [b.op("Transpose", [x], name + "_t", perm=[0, 2, 3, 1]), axis2], name + "_g")

    def values_t(x: str, name: str) -> str:  # [B, L, Hkv, D] -> [B, Hkv, 1, L, D]
        return b.op("Unsqueeze", [b.op("Transpose", [x], name + "_t", perm=[0, 2, 1, 3]), axis2], name + "_g")

    s_past = b.to_float32(b.op("MatMul", [q, keys_t(f"past_key_values.{i}.key", f"{n}/past_k")], f"{n}/scores_past"),
                          f"{n}/scores_past_f32")  # [B, Hkv, G, S, P]
    s_new = b.to_float32(b.op("MatMul", [q, keys_t(k, f"{n}/new_k")], f"{n}/scores_new"),
                         f"{n}/scores_new_f32")  # [B, Hkv, G, S, S]
    o = attend(b, n, s_past, s_new, lambda: values_t(f"past_key_values.{i}.value", f"{n}/past_v"),
               lambda: values_t(v, f"{n}/new_v"), masks, past_len, cfg.window(i))  # [B, Hkv, G, S, D]
    o = b.op("Transpose", [o], f"{n}/out_t", perm=[0, 3, 1, 2, 4])  # [B, S, Hkv, G, D]
    o = b.op("Reshape", [o, b.const([lead, -1, heads * hd], "int64")], f"{n}/out_flat")
    bias = (layer_key(i, "self_attn.o_proj.bias"),) if cfg.o_bias else ()
    return b.linear(o, f"{n}.o_proj", (layer_key(i, "self_attn.o_proj.weight"),), bias)


def attend(b: GraphBuilder, n: str, s_past: str, s_new: str, v_past, v_new, masks: Masks, past_len: str,
           window: int | None) -> str:
    """One softmax over a layer's past and new keys together (masked), then the weighted values.

    Args:
        b: the builder; n: the layer's node name prefix (the softmax is ``<n>/softmax``).
        s_past, s_new: float32 scores [B, H_kv, G, S, P] and [B, H_kv, G, S, S] (already scaled).
        v_past, v_new: callables adding and returning the values [B, H_kv, 1, P, D] and [B, H_kv, 1, S, D]
            (called where the values are first needed, which keeps the batch-1 graph's node order).
        masks: the step's masks; past_len: int64 [1], P; window: the layer's sliding window or None.

    Returns:
        The attention output [B, H_kv, G, S, D] in the graph's dtype.
    """
    past_mask, new_mask = masks.layer(window)
    s_new = b.op("Add", [s_new, new_mask], f"{n}/mask_new")
    if past_mask is not None:
        s_past = b.op("Add", [s_past, past_mask], f"{n}/mask_past")
    probs = b.op("Softmax", [b.op("Concat", [s_past, s_new], f"{n}/scores", axis=-1)], f"{n}/softmax", axis=-1)
    probs = b.from_float32(probs, f"{n}/probs")
    axis = b.const([-1], "int64")
    p_past = b.op("Slice", [probs, b.const([0], "int64"), past_len, axis], f"{n}/probs_past")
    p_new = b.op("Slice", [probs, past_len, b.const([_INT64_MAX], "int64"), axis], f"{n}/probs_new")
    return b.op("Add", [b.op("MatMul", [p_past, v_past()], f"{n}/out_past"), b.op("MatMul", [p_new, v_new()], f"{n}/out_new")],
                f"{n}/out")


def _mlp(b: GraphBuilder, cfg: BackboneConfig, i: int, h: str) -> str:
    n = f"layers.{i}.mlp"

    def proj(name: str, x: str) -> str:
        bias = (layer_key(i, f"mlp.{name}.bias"),) if cfg.mlp_bias else ()
        return b.linear(x, f"{n}.{name}", (layer_key(i, f"mlp.{name}.weight"),), bias)

    act = b.op("Mul", [b.silu(proj("gate_proj", h), f"{n}/silu"), proj("up_proj", h)], f"{n}/gate_up")
    return proj("down_proj", act)


def write_portable_step(b: GraphBuilder, cfg: BackboneConfig, lm_head_quant: WeightOnlyConfig | None = None,
                        k: int = STEP_TOPK, batched: bool = False) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Add the portable step's nodes and weights to ``b`` (the module docstring says what they compute).

    Args:
        b: the builder (its dtype and MatMulNBits settings apply to every linear layer).
        cfg: the backbone, every switch of :class:`~medusa_export.model.config.BackboneConfig` honoured.
        lm_head_quant: MatMulNBits settings of the lm_head (None: float ``Gemm``).
        k: width of the top-k outputs (capped at the vocabulary).
        batched: the batched contract (dynamic B rows, per-row past lengths, tree masks and temperatures;
            :func:`~.contract.step_io`); False writes the batch-1 graph of every artifact built before.

    Returns:
        (inputs, outputs): the contract (:func:`~.contract.step_io`) the graph declares.
    """
    eps, d = cfg.rms_norm_eps, cfg.hidden_size
    k = min(k, cfg.vocab_size)
    embed = "model.embed_tokens.weight"
    table = b.weight(embed, Recipe("backbone", (embed,), "rows", b.dtype))[0].name
    x = b.op("Gather", [table, "input_ids"], "embed", axis=0)  # [B, S, d]
    # RoPE tables for this step's positions: [B, S, 1, D] (float32 maths, cast to the graph dtype).
    pos = b.op("Unsqueeze", [b.cast("position_ids", "float32", "rope/positions"), b.const([2], "int64")],
               "rope/positions_col")  # [B, S, 1]
    freqs = b.op("Mul", [pos, b.const(rope_inv_freq(cfg).numpy().astype(np.float32))], "rope/freqs")  # [B, S, D/2]
    emb = b.op("Concat", [freqs, freqs], "rope/emb", axis=-1)  # [B, S, D]
    axis2 = b.const([2], "int64")
    cos = b.op("Unsqueeze", [b.from_float32(b.op("Cos", [emb], "rope/cos_f32"), "rope/cos_cast"), axis2], "rope/cos")
    sin = b.op("Unsqueeze", [b.from_float32(b.op("Sin", [emb], "rope/sin_f32"), "rope/sin_cast"), axis2], "rope/sin")
    if batched:
        past_len = b.op("Shape", ["past_key_values.0.key"], "past_len", start=1, end=2)  # [1]
        masks = Masks(b, cfg, past_len, batched)
    else:  # the batch-1 graph's node order of every artifact built before
        masks = Masks(b, cfg, None, batched)
        past_len = b.op("Shape", ["past_key_values.0.key"], "past_len", start=1, end=2)  # [1]
    for i in range(cfg.num_hidden_layers):
        h = b.rms_norm(x, layer_key(i, "input_layernorm.weight"), eps, f"layers.{i}.input_norm")
        x = b.op("Add", [x, _attention(b, cfg, i, h, cos, sin, masks, past_len)], f"layers.{i}.attn/residual")
        h = b.rms_norm(x, layer_key(i, "post_attention_layernorm.weight"), eps, f"layers.{i}.post_norm")
        x = b.op("Add", [x, _mlp(b, cfg, i, h)], f"layers.{i}.mlp/residual")
    b.rms_norm(x, "model.norm.weight", eps, "norm", out="hidden_states")
    rows = b.op("Reshape", ["hidden_states", b.const([-1, d], "int64")], "lm_head/rows")  # [B * S, d]
    logits = b.projection(rows, "lm_head", lm_head_key(cfg), quant=lm_head_quant)  # [B * S, V]
    if batched:
        batched_acceptance_outputs(b, logits, k)
    else:
        acceptance_outputs(b, logits, k)
    return step_io(cfg, b.dtype, k, batched)
