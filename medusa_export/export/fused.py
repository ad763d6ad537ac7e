"""The ``ort-fused`` backbone step: the maths of ``model.onnx`` written with ONNX Runtime's fused operators.

``--graph fused`` replaces the standard-op step graph (:mod:`.portable`) by one built from ONNX Runtime
contrib operators (CPU kernels checked on onnxruntime 1.32), written node by node from the checkpoint's
weights like every graph of the artifact (:mod:`.graph`). Same model (Medusa paper §2.1.2: tree attention,
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
  (by positions, as in :mod:`.portable`) is part of the layer's attention bias. A graph whose steps are all
  chains (int8 activations: ``precision.step_rows.trees = chain``) wires neither ``position_ids`` nor the
  bias: GQA's own positions and causal mask are then the tree's (``write_fused_step``'s ``chain``);
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

Batched (``build --graph fused --batch-size N``, docs/batching.md): GroupQueryAttention refuses several
sequences that each have a past and several new tokens, so the batched variant writes the attention out
(:func:`_write_batched_layers`) over head-major buffers [B, H_kv, C, D] it only reads, masked per row by
``past_sequence_length`` [B], and returns this step's K/V as ``new_key_values.{i}.*`` [B, H_kv, S, D].
"""

from __future__ import annotations

import numpy as np
import torch
from onnx import TensorProto, helper

from ..model.config import BackboneConfig, rope_cos_sin
from ..model.medusa import STEP_TOPK
from .step_outputs import acceptance_outputs, batched_acceptance_outputs
from .contract import TensorSpec, step_token_io
from .graph import GraphBuilder
from .portable import Masks, _rope, attend, layer_key, lm_head_key
from .quantize import CONTRIB_DOMAIN, WeightOnlyConfig
from .weights import Recipe

#: The contrib operators of the fused step (the manifest's flavour note names them).
FUSED_OPS = ("com.microsoft::GroupQueryAttention", "com.microsoft::QuickGelu", "SimplifiedLayerNormalization")


def fused_step_io(cfg, k: int = STEP_TOPK, batched: bool = False) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The fused step's inputs and outputs (names, dtypes, shapes with symbolic S and C, meanings):
    the portable step's token inputs and acceptance outputs, then the past length and the KV buffers.

    ``batched``: the batched variant (:func:`_write_batched_layers`): B rows, ``past_sequence_length`` [B],
    KV buffers [B, H_kv, C, D] read only (C >= every row's past length), and this step's K/V returned as
    ``new_key_values.{i}.*`` [B, H_kv, S, D] instead of written into the buffers."""
    if batched:
        return _batched_fused_io(cfg, k)
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


def _batched_fused_io(cfg, k: int) -> tuple[list[TensorSpec], list[TensorSpec]]:
    kv = ("B", cfg.num_key_value_heads, "C", cfg.head_dim)
    new_kv = ("B", cfg.num_key_value_heads, "S", cfg.head_dim)
    inputs, outputs = step_token_io(cfg, "float32", k, batched=True)
    inputs.append(TensorSpec("past_sequence_length", "int32", ("B",), "P_b: valid past slots of row b"))
    for i in range(cfg.num_hidden_layers):
        for n in ("key", "value"):
            inputs.append(TensorSpec(f"past_key_values.{i}.{n}", "float32", kv,
                                     f"layer {i} {n}s of the rows' past, head-major [B, H_kv, C, D]: row b's valid "
                                     "slots are [0, past_sequence_length[b]); C >= the longest row's (read only)"))
    for i in range(cfg.num_hidden_layers):
        for n in ("key", "value"):
            outputs.append(TensorSpec(f"new_key_values.{i}.{n}", "float32", new_kv,
                                      f"layer {i} {n}s of this step's S tokens per row, head-major [B, H_kv, S, D] "
                                      "(write them to slots [P_b, P_b + S) of row b, then compact the accepted)"))
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


def _mlp_block(b: GraphBuilder, cfg: BackboneConfig, i: int, residual: str, norm) -> str:
    """Post-attention norm, gate-up MatMul, Split, QuickGelu (SiLU) * up, down projection, residual add."""
    n = f"layers.{i}"
    h = norm(residual, layer_key(i, "post_attention_layernorm.weight"), f"{n}.post_norm")
    gu_bias = ((layer_key(i, "mlp.gate_proj.bias"), layer_key(i, "mlp.up_proj.bias")) if cfg.mlp_bias else ())
    gate_up = b.linear(h, f"{n}.gate_up", (layer_key(i, "mlp.gate_proj.weight"), layer_key(i, "mlp.up_proj.weight")),
                       gu_bias)
    gate, up = b.op("Split", [gate_up], f"{n}.gate_up/split", n_out=2, axis=-1, num_outputs=2)  # [B, S, I] each
    act = b.op("Mul", [b.op("QuickGelu", [gate], f"{n}.silu", domain=CONTRIB_DOMAIN, alpha=1.0), up], f"{n}.act")
    down_bias = (layer_key(i, "mlp.down_proj.bias"),) if cfg.mlp_bias else ()
    return b.op("Add", [residual, b.linear(act, f"{n}.down_proj", (layer_key(i, "mlp.down_proj.weight"),),
                                           down_bias)], f"{n}.mlp/residual")


def _write_batched_layers(b: GraphBuilder, cfg: BackboneConfig, norm, cos_table: str, sin_table: str) -> None:
    """The batched fused step's layers, embedding to ``hidden_states`` [B, S, d].

    The fused graph's norms, packed QKV and gate-up MatMuls and QuickGelu MLP, with the attention written
    out as :mod:`.portable` writes it (ONNX Runtime's GroupQueryAttention refuses several sequences that
    each have a past and several new tokens, which is what a batched tree step is): RoPE from the fused
    graph's cos / sin tables gathered at ``position_ids``; scores of each row's queries against its past
    (the buffers' first P = max_b P_b slots, masked beyond ``past_sequence_length[b]``) and its new keys
    (its ``new_token_mask``), one float32 softmax, the weighted values. The step's K/V leave the graph as
    ``new_key_values.{i}.*`` [B, H_kv, S, D]; the buffers are only read.
    """
    hd, heads, kv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    g = heads // kv
    axis2 = b.const([2], "int64")

    def rope_rows(table: str, name: str) -> str:  # [max_positions, D/2] -> [B, S, 1, D] at position_ids
        half = b.op("Gather", [table, "position_ids"], f"rope/{name}_half", axis=0)  # [B, S, D/2]
        return b.op("Unsqueeze", [b.op("Concat", [half, half], f"rope/{name}_full", axis=-1), axis2], f"rope/{name}")

    cos, sin = rope_rows(cos_table, "cos"), rope_rows(sin_table, "sin")
    longest = b.op("ReduceMax", ["past_sequence_length", b.const([0], "int64")], "lengths/longest", keepdims=1)
    past_len = b.cast(longest, "int64", "past_len")  # [1], P
    masks = Masks(b, cfg, past_len, batched=True)
    zero = b.const([0], "int64")
    table = b.weight("model.embed_tokens.weight", Recipe("backbone", ("model.embed_tokens.weight",), "rows",
                                                         "float32"))[0].name
    residual = b.op("Gather", [table, "input_ids"], "embed", axis=0)  # [B, S, d]
    for i in range(cfg.num_hidden_layers):
        n = f"layers.{i}"
        h = norm(residual, layer_key(i, "input_layernorm.weight"), f"{n}.input_norm")
        qkv_keys = tuple(layer_key(i, f"self_attn.{p}.weight") for p in ("q_proj", "k_proj", "v_proj"))
        qkv_bias = tuple(layer_key(i, f"self_attn.{p}.bias") for p in ("q_proj", "k_proj", "v_proj")) if cfg.qkv_bias else ()
        qkv = b.linear(h, f"{n}.qkv", qkv_keys, qkv_bias)  # [B, S, (H + 2 H_kv) D]
        q, key, value = b.op("Split", [qkv, b.const([heads * hd, kv * hd, kv * hd], "int64")], f"{n}.qkv/split",
                             n_out=3, axis=-1)
        q = b.op("Reshape", [q, b.const([0, -1, heads, hd], "int64")], f"{n}.q_heads")  # [B, S, H, D]
        key = b.op("Reshape", [key, b.const([0, -1, kv, hd], "int64")], f"{n}.k_heads")  # [B, S, H_kv, D]
        value = b.op("Reshape", [value, b.const([0, -1, kv, hd], "int64")], f"{n}.v_heads")
        if cfg.qk_norm:
            q = norm(q, layer_key(i, "self_attn.q_norm.weight"), f"{n}.q_norm")
            key = norm(key, layer_key(i, "self_attn.k_norm.weight"), f"{n}.k_norm")
        q = _rope(b, q, cos, sin, hd // 2, hd, f"{n}/q_rope")
        key = _rope(b, key, cos, sin, hd // 2, hd, f"{n}/k_rope")
        new_k = b.op("Transpose", [key], f"{n}/new_k", perm=[0, 2, 1, 3], outputs=[f"new_key_values.{i}.key"])
        new_v = b.op("Transpose", [value], f"{n}/new_v", perm=[0, 2, 1, 3], outputs=[f"new_key_values.{i}.value"])
        q = b.op("Mul", [q, b.const(np.float32(hd ** -0.5))], f"{n}/q_scale")
        q = b.op("Reshape", [q, b.const([0, -1, kv, g, hd], "int64")], f"{n}/q_groups")  # [B, S, H_kv, G, D]
        q = b.op("Transpose", [q], f"{n}/q_t", perm=[0, 2, 3, 1, 4])  # [B, H_kv, G, S, D]

        def past(name: str) -> str:  # the buffers' first P slots: [B, H_kv, 1, P, D]
            x = b.op("Slice", [f"past_key_values.{i}.{name}", zero, past_len, axis2], f"{n}/past_{name}")
            return b.op("Unsqueeze", [x, axis2], f"{n}/past_{name}_g")

        def keys_t(x: str, name: str) -> str:  # [B, H_kv, 1, L, D] -> [B, H_kv, 1, D, L]
            return b.op("Transpose", [x], name, perm=[0, 1, 2, 4, 3])

        s_past = b.op("MatMul", [q, keys_t(past("key"), f"{n}/past_k_t")], f"{n}/scores_past")  # [B, H_kv, G, S, P]
        new_k_g = b.op("Unsqueeze", [new_k, axis2], f"{n}/new_k_g")
        s_new = b.op("MatMul", [q, keys_t(new_k_g, f"{n}/new_k_t")], f"{n}/scores_new")  # [B, H_kv, G, S, S]
        o = attend(b, f"{n}.attn", s_past, s_new, lambda: past("value"),
                   lambda: b.op("Unsqueeze", [new_v, axis2], f"{n}/new_v_g"), masks, past_len, cfg.window(i))
        o = b.op("Transpose", [o], f"{n}/out_t", perm=[0, 3, 1, 2, 4])  # [B, S, H_kv, G, D]
        o = b.op("Reshape", [o, b.const([0, -1, heads * hd], "int64")], f"{n}/out_flat")
        o_bias = (layer_key(i, "self_attn.o_proj.bias"),) if cfg.o_bias else ()
        residual = b.op("Add", [residual, b.linear(o, f"{n}.o_proj", (layer_key(i, "self_attn.o_proj.weight"),),
                                                   o_bias)], f"{n}.attn/residual")
        residual = _mlp_block(b, cfg, i, residual, norm)
    norm(residual, "model.norm.weight", "norm", out="hidden_states")


def write_fused_step(b: GraphBuilder, cfg: BackboneConfig, max_positions: int,
                     lm_head_quant: WeightOnlyConfig | None = None,
                     k: int = STEP_TOPK, batched: bool = False,
                     chain: bool = False) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Add the fused step's nodes and weights to ``b`` (float32 activations; see the module docstring).

    Args:
        b: the builder (float32; its MatMulNBits settings apply to the QKV, o, gate-up and down projections).
        cfg: the backbone.
        max_positions: rows of the rotary cos/sin caches; position ids must stay below it (the artifact's
            max context).
        lm_head_quant: MatMulNBits settings of the lm_head (None: float ``Gemm``).
        k: width of the top-k outputs (capped at the vocabulary).
        batched: the batched variant: B rows, explicit attention instead of GroupQueryAttention (which takes
            one sequence when it has a past and several new tokens), see :func:`_write_batched_layers`.
        chain: every step is a chain (the manifest's ``precision.step_rows.trees`` is ``chain``: prefill, plain
            steps padded to two rows, chain trees). Row i of such a step sits at position P + i and sees the
            new rows 0..i, which is what GroupQueryAttention does without ``position_ids`` and
            ``attention_bias`` (positions from ``seqlens_k``, its own causal mask; ONNX Runtime contrib op
            docs, GroupQueryAttention), so they are not wired (without a sliding window; with one the bias
            stays): the outputs are bit for bit those of the wired graph (tests/test_fused.py), and the embedded
            int4 model's step takes 0.99x (1 node) / 0.97x (2 nodes) of the wired graph's (scripts/bench_step.py,
            interleaved, 2-core EPYC, ONNX Runtime 1.32, 2026-12-07). The step still declares both inputs (one
            contract for every fused graph); they are unused.

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

    def norm(x: str, key: str, name: str, out: str | None = None) -> str:
        w = b.weight(key, Recipe("backbone", (key,), "rows", "float32"))[0].name
        return b.op("SimplifiedLayerNormalization", [x, w], name, outputs=[out] if out else None,
                    axis=-1, epsilon=eps, stash_type=1)

    if batched:
        _write_batched_layers(b, cfg, norm, cos, sin)
        rows = b.op("Reshape", ["hidden_states", b.const([-1, d], "int64")], "lm_head/rows")
        batched_acceptance_outputs(b, b.projection(rows, "lm_head", lm_head_key(cfg), quant=lm_head_quant), k)
        return fused_step_io(cfg, k, batched=True)
    # Sequence lengths for GQA: total = P + S, seqlens_k = total - 1 (int32).
    s32 = b.cast(b.op("Shape", ["input_ids"], "lengths/s", start=1, end=2), "int32", "lengths/s32")
    total = b.op("Add", ["past_sequence_length", s32], "lengths/total")  # [1]
    seqlens_k = b.op("Sub", [total, b.const([1], "int32")], "lengths/seqlens_k")
    total_scalar = b.op("Squeeze", [total, b.const([0], "int64")], "lengths/total_scalar")
    chain = chain and all(cfg.window(i) is None for i in range(cfg.num_hidden_layers))
    biases = {None: ""} if chain else _attention_biases(b, cfg)
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
                     cos, sin, "" if chain else "position_ids", biases[cfg.window(i)]],
                    f"{n}.attn", n_out=3, domain=CONTRIB_DOMAIN,
                    outputs=[f"{n}.attn/out", f"present.{i}.key", f"present.{i}.value"],
                    num_heads=heads, kv_num_heads=kv, do_rotary=1, rotary_interleaved=0)[0]
        o_bias = (layer_key(i, "self_attn.o_proj.bias"),) if cfg.o_bias else ()
        residual = b.op("Add", [residual, b.linear(attn, f"{n}.o_proj", (layer_key(i, "self_attn.o_proj.weight"),),
                                                   o_bias)], f"{n}.attn/residual")
        residual = _mlp_block(b, cfg, i, residual, norm)
    norm(residual, "model.norm.weight", "norm", out="hidden_states")
    rows = b.op("Reshape", ["hidden_states", b.const([-1, d], "int64")], "lm_head/rows")
    acceptance_outputs(b, b.projection(rows, "lm_head", lm_head_key(cfg), quant=lm_head_quant), k)
    return fused_step_io(cfg, k)
