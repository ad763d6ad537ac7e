"""The ``ort-fused`` backbone step: the maths of ``model.onnx`` written with ONNX Runtime's fused operators.

``--graph fused`` replaces the standard-op step graph (:mod:`.portable`) by one built from ONNX Runtime
contrib operators (CPU kernels checked on onnxruntime 1.32), written node by node from the checkpoint's
weights like every graph of the artifact (:mod:`.graph`). Same model (seeds/001 §2.1.2: tree attention,
position = past length + depth), same acceptance outputs:

* ``SimplifiedLayerNormalization`` (ONNX Runtime's RMSNorm kernel) after a plain residual ``Add``.
  ``com.microsoft::SkipSimplifiedLayerNormalization`` (the add fused into the norm) was measured
  slower on onnxruntime 1.32 CPU, 2 threads: 13.3 vs 6.1 us per norm at 16 rows (4.7 vs 3.0 at 4,
  equal at 1), and the whole SmolLM2-135M step 0.4 / 0.6 / 1.3 ms slower at T = 1 / 4 / 16;
* one QKV ``MatMul`` per layer ``[d, (H + 2 H_kv) D]`` (+ the concatenated q / k / v biases) feeding
  ``com.microsoft::GroupQueryAttention`` as packed QKV, with rotary embedding inside it (``do_rotary=1``,
  explicit ``position_ids``: a tree node sits at past length + depth, not past length + index; the cos / sin
  caches come from the config's inverse frequencies, so RoPE scaling is honoured) and the tree mask as an
  additive ``attention_bias [1, 1, S, P + S]`` (0 over the past). GQA applies its own causal mask over the
  new tokens (row i sees new tokens 0..i); tree nodes are in topological order (a parent's index is below
  its children's), so causal AND tree mask = tree mask. With q / k norms (Qwen3) the packed projection is
  split, q and k normalised per head, and GQA takes query, key and value separately. A sliding window
  (by positions, as in :mod:`.portable`) is part of the layer's attention bias;
* one gate-up ``MatMul`` ``[d, 2 I]``, ``Split``, ``com.microsoft::QuickGelu`` (alpha 1: SiLU) and
  ``Mul``, then the down projection (+ MLP biases);
* the tied or own lm_head as ``Gemm(transB=1)`` over the embedding-shaped ``[V, d]`` table (no
  transposed copy on disk), then the acceptance outputs of :func:`..model.medusa.acceptance_outputs`.

KV cache: head-major ``[1, H_kv, C, D]`` per layer, the layout GQA reads (no Transpose of the
past). ``past_key_values.{i}.*`` is the runtime's whole buffer of C slots, of which the first
``past_sequence_length`` are valid; GQA writes this step's K/V into slots [P, P + S) of
``present.{i}.*``, which the runtime binds to the same buffer (ONNX Runtime shares it when the
two pointers are equal), so nothing of the past is copied. Bound to a fresh buffer instead,
``present`` is a copy of the past plus the new rows (correct, slower).
"""

from __future__ import annotations

import numpy as np
import torch
from onnx import TensorProto, helper

from ..model.config import BackboneConfig, rope_cos_sin
from ..model.medusa import STEP_TOPK
from .contract import TensorSpec, step_token_io
from .graph import GraphBuilder
from .portable import layer_key, lm_head_key
from .quantize import CONTRIB_DOMAIN, WeightOnlyConfig
from .weights import Recipe

#: The contrib operators of the fused step (the manifest's flavour note names them).
FUSED_OPS = ("com.microsoft::GroupQueryAttention", "com.microsoft::QuickGelu", "SimplifiedLayerNormalization")


def fused_step_io(cfg, k: int = STEP_TOPK) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The fused step's inputs and outputs (names, dtypes, shapes with symbolic S and C, meanings):
    the portable step's token inputs and acceptance outputs, then the past length and the KV buffers."""
    kv = (1, cfg.num_key_value_heads, "C", cfg.head_dim)
    inputs, outputs = step_token_io(cfg, "float32", k)
    inputs.append(TensorSpec("past_sequence_length", "int32", (1,), "P: valid past slots at the start of each KV buffer"))
    for i in range(cfg.num_hidden_layers):
        for n in ("key", "value"):
            inputs.append(TensorSpec(f"past_key_values.{i}.{n}", "float32", kv,
                                     f"layer {i} {n} cache buffer, head-major [1, H_kv, C, D] (C = capacity); "
                                     "slots [0, P) valid"))
            outputs.append(TensorSpec(f"present.{i}.{n}", "float32", kv,
                                      f"layer {i} {n} cache after the step: bind it to the past_key_values.{i}.{n} "
                                      "buffer; slots [P, P + S) then hold this step's K/V (node j at P + j)"))
    return inputs, outputs


def rope_tables(cfg: BackboneConfig, max_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """GQA's cos/sin caches, float32 [max_positions, D / 2]: the reference's own values
    (:func:`..model.config.rope_cos_sin`, whose two halves are equal)."""
    cos, sin = rope_cos_sin(torch.arange(max_positions)[None], cfg, torch.float32)
    half = cfg.head_dim // 2
    return cos[0, 0, :, :half].numpy().copy(), sin[0, 0, :, :half].numpy().copy()


def _attention_biases(b: GraphBuilder, cfg: BackboneConfig) -> dict[int | None, str]:
    """attention_bias [1, 1, S, P + S] per distinct window (None: no window): the tree mask over the new
    tokens, 0 over the past (or the window's mask by positions)."""
    zero, low = b.const(np.float32(0.0)), b.const(np.float32(np.finfo(np.float32).min))
    s64 = b.op("Shape", ["input_ids"], "bias/s", start=1, end=2)  # [1]
    p64 = b.cast("past_sequence_length", "int64", "bias/p")  # [1]
    axes01 = b.const([0, 1], "int64")
    out = {}
    zeros = b.op("ConstantOfShape", [b.op("Concat", [s64, p64], "bias/past_shape", axis=0)], "bias/past_zeros",
                 value=helper.make_tensor("value", TensorProto.FLOAT, [1], [0.0]))  # [S, P]
    new = b.op("Where", ["new_token_mask", zero, low], "bias/new")  # [S, S]
    out[None] = b.op("Unsqueeze", [b.op("Concat", [zeros, new], "bias/full", axis=1), axes01], "bias")
    windows = sorted({w for i in range(cfg.num_hidden_layers) if (w := cfg.window(i)) is not None})
    if windows:
        q = b.op("Reshape", ["position_ids", b.const([-1], "int64")], "bias/q_pos")
        q_col = b.op("Unsqueeze", [q, b.const([1], "int64")], "bias/q_col")
        k_row = b.op("Unsqueeze", [q, b.const([0], "int64")], "bias/k_row")
        p = b.op("Squeeze", [p64, b.const([0], "int64")], "bias/p_scalar")
        p_row = b.op("Unsqueeze", [b.op("Range", [b.const(np.int64(0)), p, b.const(np.int64(1))], "bias/slots"),
                                   b.const([0], "int64")], "bias/p_row")
    for w in windows:
        n, lim = f"bias/window{w}", b.const(np.int64(w))
        near_new = b.op("Less", [b.op("Sub", [q_col, k_row], n + "/new_dist"), lim], n + "/new_near")
        new_w = b.op("Where", [b.op("And", ["new_token_mask", near_new], n + "/new_and"), zero, low], n + "/new")
        near_past = b.op("Less", [b.op("Sub", [q_col, p_row], n + "/past_dist"), lim], n + "/past_near")
        past_w = b.op("Where", [near_past, zero, low], n + "/past")
        out[w] = b.op("Unsqueeze", [b.op("Concat", [past_w, new_w], n + "/full", axis=1), axes01], n)
    return out


def write_fused_step(b: GraphBuilder, cfg: BackboneConfig, max_positions: int,
                     lm_head_quant: WeightOnlyConfig | None = None,
                     k: int = STEP_TOPK) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Add the fused step's nodes and weights to ``b`` (float32 activations; see the module docstring).

    Args:
        b: the builder (float32; its MatMulNBits settings apply to the QKV, o, gate-up and down projections).
        cfg: the backbone.
        max_positions: rows of the rotary cos/sin caches; position ids must stay below it (the artifact's
            max context).
        lm_head_quant: MatMulNBits settings of the lm_head (None: float ``Gemm``).
        k: width of the top-k outputs (capped at the vocabulary).

    Returns:
        (inputs, outputs) as :func:`fused_step_io`.
    """
    from .config import UnsupportedGraphError

    if b.dtype != "float32":
        raise ValueError("the fused graph computes in float32")
    if cfg.head_dim % 16:
        raise UnsupportedGraphError(f"--graph fused needs a head_dim that is a multiple of 16 (ONNX Runtime's "
                                    f"GroupQueryAttention); this model's is {cfg.head_dim}: use --graph portable")
    eps, d, hd = cfg.rms_norm_eps, cfg.hidden_size, cfg.head_dim
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    k = min(k, cfg.vocab_size)
    embed = "model.embed_tokens.weight"
    cos, sin = rope_tables(cfg, max_positions)
    cos = b.array("rope.cos", cos, f"rope cos cache of the config, {max_positions} positions")
    sin = b.array("rope.sin", sin, f"rope sin cache of the config, {max_positions} positions")
    # Sequence lengths for GQA: total = P + S, seqlens_k = total - 1 (int32).
    s32 = b.cast(b.op("Shape", ["input_ids"], "lengths/s", start=1, end=2), "int32", "lengths/s32")
    total = b.op("Add", ["past_sequence_length", s32], "lengths/total")  # [1]
    seqlens_k = b.op("Sub", [total, b.const([1], "int32")], "lengths/seqlens_k")
    total_scalar = b.op("Squeeze", [total, b.const([0], "int64")], "lengths/total_scalar")
    biases = _attention_biases(b, cfg)

    def norm(x: str, key: str, name: str, out: str | None = None) -> str:
        w = b.weight(key, Recipe("backbone", (key,), "rows", "float32"))[0].name
        return b.op("SimplifiedLayerNormalization", [x, w], name, outputs=[out] if out else None,
                    axis=-1, epsilon=eps, stash_type=1)

    table = b.weight(embed, Recipe("backbone", (embed,), "rows", "float32"))[0].name
    residual = b.op("Gather", [table, "input_ids"], "embed", axis=0)  # [1, S, d]
    for i in range(cfg.num_hidden_layers):
        n = f"layers.{i}"
        h = norm(residual, layer_key(i, "input_layernorm.weight"), f"{n}.input_norm")
        qkv_keys = tuple(layer_key(i, f"self_attn.{p}.weight") for p in ("q_proj", "k_proj", "v_proj"))
        qkv_bias = tuple(layer_key(i, f"self_attn.{p}.bias") for p in ("q_proj", "k_proj", "v_proj")) if cfg.qkv_bias else ()
        qkv = b.linear(h, f"{n}.qkv", qkv_keys, qkv_bias)  # [1, S, (H + 2 H_kv) D]
        if cfg.qk_norm:
            q, key, value = b.op("Split", [qkv, b.const([heads * hd, kv * hd, kv * hd], "int64")], f"{n}.qkv/split",
                                 n_out=3, axis=-1)

            def head_norm(x: str, count: int, which: str) -> str:
                x = b.op("Reshape", [x, b.const([1, -1, count, hd], "int64")], f"{n}.{which}_heads")
                x = norm(x, layer_key(i, f"self_attn.{which}_norm.weight"), f"{n}.{which}_norm")
                return b.op("Reshape", [x, b.const([1, -1, count * hd], "int64")], f"{n}.{which}_flat")

            gqa_in = [head_norm(q, heads, "q"), head_norm(key, kv, "k"), value]
        else:
            gqa_in = [qkv, "", ""]
        attn = b.op("GroupQueryAttention",
                    [*gqa_in, f"past_key_values.{i}.key", f"past_key_values.{i}.value", seqlens_k, total_scalar,
                     cos, sin, "position_ids", biases[cfg.window(i)]],
                    f"{n}.attn", n_out=3, domain=CONTRIB_DOMAIN,
                    outputs=[f"{n}.attn/out", f"present.{i}.key", f"present.{i}.value"],
                    num_heads=heads, kv_num_heads=kv, do_rotary=1, rotary_interleaved=0)[0]
        o_bias = (layer_key(i, "self_attn.o_proj.bias"),) if cfg.o_bias else ()
        residual = b.op("Add", [residual, b.linear(attn, f"{n}.o_proj", (layer_key(i, "self_attn.o_proj.weight"),),
                                                   o_bias)], f"{n}.attn/residual")
        h = norm(residual, layer_key(i, "post_attention_layernorm.weight"), f"{n}.post_norm")
        gu_bias = ((layer_key(i, "mlp.gate_proj.bias"), layer_key(i, "mlp.up_proj.bias")) if cfg.mlp_bias else ())
        gate_up = b.linear(h, f"{n}.gate_up", (layer_key(i, "mlp.gate_proj.weight"), layer_key(i, "mlp.up_proj.weight")),
                           gu_bias)
        gate, up = b.op("Split", [gate_up], f"{n}.gate_up/split", n_out=2, axis=-1, num_outputs=2)  # [1, S, I] each
        act = b.op("Mul", [b.op("QuickGelu", [gate], f"{n}.silu", domain=CONTRIB_DOMAIN, alpha=1.0), up], f"{n}.act")
        down_bias = (layer_key(i, "mlp.down_proj.bias"),) if cfg.mlp_bias else ()
        residual = b.op("Add", [residual, b.linear(act, f"{n}.down_proj", (layer_key(i, "mlp.down_proj.weight"),),
                                                   down_bias)], f"{n}.mlp/residual")
    norm(residual, "model.norm.weight", "norm", out="hidden_states")
    rows = b.op("Reshape", ["hidden_states", b.const([-1, d], "int64")], "lm_head/rows")
    b.acceptance_outputs(b.projection(rows, "lm_head", lm_head_key(cfg), quant=lm_head_quant), k)
    return fused_step_io(cfg, k)
