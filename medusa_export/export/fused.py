"""The ``ort-fused`` backbone step: the maths of ``model.onnx`` written with ONNX Runtime's fused operators.

``--graph fused`` replaces the traced, standard-op step graph (:mod:`.portable`) by one written
directly with ``onnx.helper`` from the backbone's weights. Same model (seeds/001 §2.1.2: tree
attention, position = past length + depth), same acceptance outputs, built from
ONNX Runtime contrib operators (CPU kernels checked on onnxruntime 1.32):

* ``SimplifiedLayerNormalization`` (ONNX Runtime's RMSNorm kernel) after a plain residual ``Add``.
  ``com.microsoft::SkipSimplifiedLayerNormalization`` (the add fused into the norm) was measured
  slower on onnxruntime 1.32 CPU, 2 threads: 13.3 vs 6.1 us per norm at 16 rows (4.7 vs 3.0 at 4,
  equal at 1), and the whole SmolLM2-135M step 0.4 / 0.6 / 1.3 ms slower at T = 1 / 4 / 16;
* one QKV ``MatMul`` per layer ``[d, (H + 2 H_kv) D]`` feeding ``com.microsoft::GroupQueryAttention``
  as packed QKV, with rotary embedding inside it (``do_rotary=1``, explicit ``position_ids``:
  a tree node sits at past length + depth, not past length + index) and the tree mask as an
  additive ``attention_bias [1, 1, S, P + S]`` (0 over the past). GQA applies its own causal
  mask over the new tokens (row i sees new tokens 0..i); tree nodes are in topological order
  (a parent's index is below its children's), so causal AND tree mask = tree mask;
* one gate-up ``MatMul`` ``[d, 2 I]``, ``Split``, ``com.microsoft::QuickGelu`` (alpha 1: SiLU) and
  ``Mul``, then the down projection;
* the tied or own lm_head as ``Gemm(transB=1)`` over the embedding-shaped ``[V, d]`` table (no
  transposed copy on disk), then the acceptance reductions of :func:`..model.medusa.acceptance_outputs`.

KV cache: head-major ``[1, H_kv, C, D]`` per layer, the layout GQA reads (no Transpose of the
past). ``past_key_values.{i}.*`` is the runtime's whole buffer of C slots, of which the first
``past_sequence_length`` are valid; GQA writes this step's K/V into slots [P, P + S) of
``present.{i}.*``, which the runtime binds to the same buffer (ONNX Runtime shares it when the
two pointers are equal), so nothing of the past is copied. Bound to a fresh buffer instead,
``present`` is a copy of the past plus the new rows (correct, slower).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from ..model.backbone import LlamaConfig, rope_cos_sin
from ..model.medusa import STEP_TOPK, MedusaModel
from .portable import TensorSpec, step_token_io

OPSET = 18
MS_DOMAIN = "com.microsoft"
#: The contrib operators of the fused step (the manifest's flavour note names them).
FUSED_OPS = ("com.microsoft::GroupQueryAttention", "com.microsoft::QuickGelu", "SimplifiedLayerNormalization")


def fused_step_io(cfg: LlamaConfig, k: int = STEP_TOPK) -> tuple[list[TensorSpec], list[TensorSpec]]:
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


def backbone_arrays(model: MedusaModel) -> dict[str, np.ndarray]:
    """The backbone's weights as float32 numpy arrays, laid out for the fused graph.

    Returns:
        ``embed`` [V, d]; ``lm_head`` [V, d] (the same array object as ``embed`` when tied);
        ``norm`` [d]; per layer i: ``{i}.input_norm`` / ``{i}.post_norm`` [d], ``{i}.qkv``
        [d, (H + 2 H_kv) D] (q, k, v columns), ``{i}.o`` [H D, d], ``{i}.gate_up`` [d, 2 I]
        (gate columns first), ``{i}.down`` [I, d].
    """
    b = model.backbone

    def arr(t: torch.Tensor) -> np.ndarray:
        return t.detach().to(torch.float32).cpu().numpy()

    embed = arr(b.embed_tokens.weight)
    tied = b.lm_head.weight is b.embed_tokens.weight
    out = {"embed": embed, "lm_head": embed if tied else arr(b.lm_head.weight), "norm": arr(b.norm.weight)}
    for i, layer in enumerate(b.layers):
        a, m = layer.self_attn, layer.mlp
        out[f"{i}.input_norm"] = arr(layer.input_layernorm.weight)
        out[f"{i}.post_norm"] = arr(layer.post_attention_layernorm.weight)
        out[f"{i}.qkv"] = np.ascontiguousarray(np.concatenate([arr(a.q_proj.weight), arr(a.k_proj.weight),
                                                               arr(a.v_proj.weight)]).T)
        out[f"{i}.o"] = np.ascontiguousarray(arr(a.o_proj.weight).T)
        out[f"{i}.gate_up"] = np.ascontiguousarray(np.concatenate([arr(m.gate_proj.weight), arr(m.up_proj.weight)]).T)
        out[f"{i}.down"] = np.ascontiguousarray(arr(m.down_proj.weight).T)
    return out


def rope_tables(cfg: LlamaConfig, max_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """GQA's cos/sin caches, float32 [max_positions, D / 2]: the reference's own values
    (:func:`..model.backbone.rope_cos_sin`, whose two halves are equal)."""
    cos, sin = rope_cos_sin(torch.arange(max_positions)[None], cfg.head_dim, cfg.rope_theta, torch.float32)
    half = cfg.head_dim // 2
    return cos[0, 0, :, :half].numpy().copy(), sin[0, 0, :, :half].numpy().copy()


class _Graph:
    """Collects nodes and initializers; ``op`` returns the output name(s)."""

    def __init__(self):
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._n = 0

    def const(self, name: str, value) -> str:
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, name: str | None = None, outputs=None,
           domain: str = "", **attrs):
        self._n += 1
        name = name or f"{op_type}_{self._n}"
        outputs = outputs or [f"{name}/out{j}" if n_out > 1 else f"{name}/out" for j in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outputs, name=name, domain=domain, **attrs))
        return outputs[0] if len(outputs) == 1 else outputs


def fused_step_graph(cfg: LlamaConfig, weights: dict[str, np.ndarray], max_positions: int,
                     k: int = STEP_TOPK) -> onnx.ModelProto:
    """The fused step graph (weights inside the returned model; see the module docstring).

    Args:
        cfg: the backbone's geometry.
        weights: :func:`backbone_arrays`.
        max_positions: rows of the rotary cos/sin caches; position ids must stay below it
            (the artifact's max context).
        k: width of the top-k outputs (capped at the vocabulary).

    Returns:
        The ONNX model (opset 18 + com.microsoft 1), inputs and outputs as :func:`fused_step_io`.
    """
    g = _Graph()
    eps, d = cfg.rms_norm_eps, cfg.hidden_size
    k = min(k, cfg.vocab_size)
    embed = g.const("embed_tokens.weight", weights["embed"])
    lm_head = embed if weights["lm_head"] is weights["embed"] else g.const("lm_head.weight", weights["lm_head"])
    cos, sin = rope_tables(cfg, max_positions)
    g.const("rope.cos", cos)
    g.const("rope.sin", sin)
    g.const("one_i32", np.array([1], np.int32))
    g.const("zero_f", np.array(0.0, np.float32))
    g.const("mask_min", np.array(np.finfo(np.float32).min, np.float32))
    g.const("axes_01", np.array([0, 1], np.int64))
    g.const("axis_0", np.array([0], np.int64))
    g.const("axis_m1", np.array([-1], np.int64))
    g.const("flat", np.array([-1], np.int64))
    g.const("rows_d", np.array([-1, d], np.int64))
    g.const("k", np.array([k], np.int64))

    # Sequence lengths for GQA: total = P + S, seqlens_k = total - 1 (int32).
    s64 = g.op("Shape", ["input_ids"], start=1, end=2)  # [1]
    total = g.op("Add", ["past_sequence_length", g.op("Cast", [s64], to=TensorProto.INT32)])  # [1]
    seqlens_k = g.op("Sub", [total, "one_i32"])
    total_scalar = g.op("Squeeze", [total, "axis_0"])
    # attention_bias [1, 1, S, P + S]: 0 over the past, the tree mask over the new tokens.
    p64 = g.op("Cast", ["past_sequence_length"], to=TensorProto.INT64)
    zeros = g.op("ConstantOfShape", [g.op("Concat", [s64, p64], axis=0)],
                 value=helper.make_tensor("value", TensorProto.FLOAT, [1], [0.0]))  # [S, P]
    new_bias = g.op("Where", ["new_token_mask", "zero_f", "mask_min"])  # [S, S]
    bias = g.op("Unsqueeze", [g.op("Concat", [zeros, new_bias], axis=1), "axes_01"])

    def rms_norm(x: str, weight: str, name: str, out: str | None = None) -> str:
        return g.op("SimplifiedLayerNormalization", [x, weight], name=name, outputs=[out] if out else None,
                    axis=-1, epsilon=eps, stash_type=1)

    residual = g.op("Gather", [embed, "input_ids"], name="embed")  # [1, S, d]
    for i in range(cfg.num_hidden_layers):
        w = {n: g.const(f"layers.{i}.{n}", weights[f"{i}.{n}"])
             for n in ("input_norm", "qkv", "o", "post_norm", "gate_up", "down")}
        h = rms_norm(residual, w["input_norm"], f"layers.{i}.input_norm")
        qkv = g.op("MatMul", [h, w["qkv"]], name=f"layers.{i}.qkv")  # [1, S, (H + 2 H_kv) D]
        attn, _, _ = g.op("GroupQueryAttention",
                          [qkv, "", "", f"past_key_values.{i}.key", f"past_key_values.{i}.value", seqlens_k,
                           total_scalar, "rope.cos", "rope.sin", "position_ids", bias],
                          name=f"layers.{i}.attn", domain=MS_DOMAIN,
                          outputs=[f"layers.{i}.attn/out", f"present.{i}.key", f"present.{i}.value"],
                          num_heads=cfg.num_attention_heads, kv_num_heads=cfg.num_key_value_heads,
                          do_rotary=1, rotary_interleaved=0)
        residual = g.op("Add", [residual, g.op("MatMul", [attn, w["o"]], name=f"layers.{i}.o_proj")])
        h = rms_norm(residual, w["post_norm"], f"layers.{i}.post_norm")
        gate, up = g.op("Split", [g.op("MatMul", [h, w["gate_up"]], name=f"layers.{i}.gate_up")], n_out=2,
                        axis=-1, num_outputs=2)  # [1, S, I] each
        act = g.op("Mul", [g.op("QuickGelu", [gate], domain=MS_DOMAIN, alpha=1.0), up])  # SiLU(gate) * up
        residual = g.op("Add", [residual, g.op("MatMul", [act, w["down"]], name=f"layers.{i}.down_proj")])
    rms_norm(residual, g.const("norm.weight", weights["norm"]), "norm", out="hidden_states")

    # Acceptance outputs (model.acceptance_outputs): log-softmax at temperature over [S, V].
    logits = g.op("Gemm", [g.op("Reshape", ["hidden_states", "rows_d"]), lm_head], name="lm_head", transB=1)
    logp = g.op("LogSoftmax", [g.op("Div", [logits, "temperature"])], axis=-1)  # [S, V]
    top_lp, top_ids = g.op("TopK", [logp, "k"], n_out=2, axis=-1, largest=1, sorted=1)
    g.op("Unsqueeze", [top_ids, "axis_0"], outputs=["topk_ids"])
    g.op("Unsqueeze", [top_lp, "axis_0"], outputs=["topk_logprobs"])
    plogp = g.op("Mul", [g.op("Exp", [logp]), logp])
    ent = g.op("Neg", [g.op("ReduceSum", [plogp, "axis_m1"], keepdims=0)])  # [S]
    g.op("Unsqueeze", [ent, "axis_0"], outputs=["entropy"])
    tok = g.op("Gather", [logp, g.op("Reshape", ["input_ids", "flat"])], axis=1)  # [S, S]
    g.op("Unsqueeze", [tok, "axis_0"], outputs=["token_logprobs"])

    ins, outs = fused_step_io(cfg, k)
    graph = helper.make_graph(g.nodes, "medusa_step_fused", [_value_info(t) for t in ins],
                              [_value_info(t) for t in outs], g.inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS_DOMAIN, 1)],
                             producer_name="medusa-export (fused)")


_ONNX_TYPES = {"float32": TensorProto.FLOAT, "int64": TensorProto.INT64, "int32": TensorProto.INT32,
               "bool": TensorProto.BOOL}


def _value_info(t: TensorSpec) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(t.name, _ONNX_TYPES[t.dtype], list(t.shape))


def export_fused_step(model: MedusaModel, path: Path, max_positions: int, k: int = STEP_TOPK) -> None:
    """Write the fused step graph to ``path`` with its weights in ``<name>.data`` beside it
    (``merge_weights`` folds that into the artifact's weights file)."""
    proto = fused_step_graph(model.config, backbone_arrays(model), max_positions, k)
    path = Path(path)
    onnx.save(proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
              location=path.name + ".data", size_threshold=1024)
