"""Strongly typed graphs for TensorRT: an artifact's float32 graphs rewritten in float16 or bfloat16 (or float16
with int4 weight-only products: a blocked DequantizeLinear before each weight MatMul) with float32 islands of
explicit Casts, so that TensorRT 10 (``NetworkDefinitionCreationFlag.STRONGLY_TYPED``) and 11 (every
network strongly typed: NVIDIA's "TensorRT 10.x to 11.x" migration pages) build exactly the precision the ONNX
says, with no builder precision flag.

Each node is one of three kinds (:data:`HEAVY_OPS`, :func:`island`, else *follow*):

==========  ===================================================================  ===========================
kind        which nodes                                                          computes in
==========  ===================================================================  ===========================
heavy       the weight products: MatMul, Gemm, and Gather from a weight table    the low type (fp16 / bf16)
island      every RMSNorm chain (``*/rmsnorm/*``: q/k norms too), the attention  float32
            softmax (``*/softmax``), the output tail's ops (:data:`FP32_OPS`:
            log-softmax, exp, the entropy's sum, top-k) and subgraphs (the
            in-graph sampler's ``If``: its arithmetic stays float32)
follow      everything else (adds, the residual stream, reshapes, RoPE, masks)   float32 if any input computed
                                                                                 so (never silently lowered),
                                                                                 else the low type
==========  ===================================================================  ===========================

An explicit Cast is inserted wherever a tensor meets a node of the other type (one Cast per tensor and type), so
the attention scores meet their mask and the softmax in float32 (the mask's float32 minimum is never cast down),
the logits are divided by the temperature in float32, and the graph's inputs and outputs keep the artifact's types
(the runtime, the manifest and the C++ contract are unchanged; the past K/V are cast inside the step). Weights feed
their consumers in the consumer's type: those of heavy nodes are stored in the low type in ``engines/weights.<p>.bin``
(read and converted one tensor at a time: memory stays at one tensor), those of islands (norm weights) stay float32;
a weight whose magnitude exceeds the low type's range stays float32 and is cast by a node (as ModelOpt AutoCast's
``init_max``).

Why our own pass rather than ModelOpt's AutoCast (``modelopt.onnx.autocast.convert_to_mixed_precision``, the field's
tool for the same conversion): run on the embedded model's step graph (539 MB of fp32 weights) with
``keep_io_types=True`` and the same islands excluded, AutoCast took 162 s and 15.0 GB of memory (it loads the
whole model and runs a reference inference to classify nodes), which does not scale to the 7B graphs we export in
6 GB; this pass streams the weights. Measured 2026-12-07 on the 2-core development host; the islands are the same
by construction (AutoCast was given them as ``nodes_to_exclude`` / ``op_types_to_exclude``).
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from ..errors import MedusaError
from ..export.graph import RMSNORM_MARK, SOFTMAX_MARK
from .config import FP32_OPS

#: The low types a typed graph computes its heavy nodes in, by engine precision (int4: weight-only, fp16 activations).
LOW_TYPES = {"fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16, "int4": TensorProto.FLOAT16,
             "int8": TensorProto.FLOAT16, "fp8": TensorProto.FLOAT16}
#: W8A8 (TensorRT's explicit quantization, NvInfer.h IQuantizeLayer / IDequantizeLayer): the quantized type and its
#: largest magnitude. Weights per output channel, activations per tensor from calibrated ranges, symmetric (zero
#: points of zeros), Q/DQ pairs on both inputs of every weight product (TensorRT's placement for a quantized GEMM).
W8A8 = {"int8": (TensorProto.INT8, 127.0), "fp8": (TensorProto.FLOAT8E4M3FN, 448.0)}
#: int4 weight-only (TensorRT's explicit quantization: a blocked DequantizeLinear, ONNX opset 21, feeding the
#: MatMul; symmetric, as TensorRT's IDequantizeLayer takes no zero point for INT4): the block sizes along the input
#: dimension K, largest first (each weight takes the largest that divides its K: SmolLM2's 576 takes 64), the values'
#: range and the opset it needs.
INT4_BLOCKS = (128, 64, 32, 16)
INT4_MAX = 7
QDQ_OPSET = 21
#: The largest finite magnitude of each low type: a weight beyond it stays float32.
LOW_MAX = {TensorProto.FLOAT16: 65504.0, TensorProto.BFLOAT16: 3.3895313892515355e38}
#: Ops that compute in the low type (their float inputs are cast to it).
HEAVY_OPS = frozenset({"MatMul", "Gemm", "Conv", "Einsum"})
#: Ops that always compute in float32 (with the nodes :func:`island` names).
ISLAND_OPS = frozenset(FP32_OPS) | {"If", "Loop", "Scan"}
#: Alignment of each tensor in the typed weights file (as the artifact's ``weights.bin``).
ALIGN = 4096
_NP = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16}


class TypedGraphError(MedusaError):
    """A typed graph cannot be written (an op whose float inputs would disagree), or breaks strong typing."""


def island(node: onnx.NodeProto) -> bool:
    """True for the nodes that stay float32: :data:`ISLAND_OPS`, every RMSNorm chain node, every attention softmax."""
    return node.op_type in ISLAND_OPS or RMSNORM_MARK in node.name or node.name.endswith(SOFTMAX_MARK)


def _low_array(arr: np.ndarray, low: int) -> np.ndarray:
    if low == TensorProto.FLOAT16:
        return arr.astype(np.float16)
    import ml_dtypes

    return arr.astype(ml_dtypes.bfloat16)  # round to nearest even


@dataclass
class TypedReport:
    """What :func:`write_typed_graphs` wrote: per graph the node counts by type and the Casts it inserted."""

    precision: str
    graphs: dict = field(default_factory=dict)
    weights_file: str = ""
    weights_bytes: int = 0
    kept_fp32_weights: list = field(default_factory=list)

    def to_json(self) -> dict:
        return {"precision": self.precision, "graphs": self.graphs, "weights": self.weights_file,
                "weights_bytes": self.weights_bytes, "fp32_weights": self.kept_fp32_weights[:20]}


class _Weights:
    """The typed weights file: converted tensors appended one at a time, deduplicated by (source, type)."""

    def __init__(self, path: Path):
        self.path = path
        self.fh = open(path, "wb")
        self.sha = hashlib.sha256()
        self.done: dict[tuple, tuple[int, int]] = {}

    def add(self, key: tuple, data: bytes) -> tuple[int, int]:
        if key in self.done:
            return self.done[key]
        pad = (-self.fh.tell()) % ALIGN
        if pad:
            self.fh.write(b"\0" * pad)
            self.sha.update(b"\0" * pad)
        offset = self.fh.tell()
        self.fh.write(data)
        self.sha.update(data)
        self.done[key] = (offset, len(data))
        return self.done[key]

    def close(self) -> int:
        size = self.fh.tell()
        self.fh.close()
        return size


def _read_initializer(t: TensorProto, base: Path) -> np.ndarray:
    """An initializer's values (external data read from ``base``, memory-mapped), float32 or int."""
    if t.data_location == TensorProto.EXTERNAL:
        info = {e.key: e.value for e in t.external_data}
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type))
        n = int(np.prod(t.dims, dtype=np.int64))
        return np.memmap(base / info["location"], dtype=dtype, mode="r", offset=int(info.get("offset", 0)),
                         shape=(n,)).reshape(tuple(t.dims))
    return numpy_helper.to_array(t)


#: int4 scale methods (``write_typed_graphs(int4_scales=...)``): round-to-nearest of max |w| per block, or AWQ's clip
#: search (Lin et al., AWQ, MLSys 2024, §3.3 and its ``auto_clip``: 20-point grid, clip ratios 1.0 down to 0.55).
INT4_SCALES = ("rtn", "awq")
AWQ_GRID, AWQ_MAX_SHRINK = 20, 0.5
#: The int4 scale method ``engine --precision int4`` uses (docs/tensorrt.md gives the measurement that chose it).
DEFAULT_INT4_SCALES = "awq"
#: SmoothQuant's alpha per W8A8 precision for ``engine`` (None: no smoothing), and the max/mean ratio of a smoothed
#: product input above which that product stays float16 (64: its mean |x| would be under 2 of int8's 127 steps).
#: Measured on the embedded model (docs/tensorrt.md, "int8: the cause"): every product above it is an MLP down_proj.
SMOOTH_ALPHA = {"int8": 0.5, "fp8": None}
OUTLIER_RATIO = {"int8": 64.0, "fp8": None}


def int4_block_scales(wk: np.ndarray, block: int, gram: np.ndarray | None = None) -> np.ndarray:
    """Symmetric int4 scales of a weight in blocks along K.

    Round-to-nearest (``gram`` None): ``max |w| / 7`` per block and output column. Activation-aware (``gram``: the
    calibration's block diagonal of X^T X / N, :class:`~.ranges.ProductStats`): AWQ's clip search, each block and
    column clipped at ``r max |w|`` for the r of ``1, 0.95, ..., 0.55`` (AWQ ``auto_clip``: ``n_grid`` 20,
    ``max_shrink`` 0.5) that minimises the block's output error on the calibration activations,
    ``dW^T G dW = ||X_b (W_b - Q(W_b))||^2 / N`` (AWQ §3.3), the scale rounded to float16 as stored before it is tried.
    r = 1 is a candidate, so the chosen error never exceeds round-to-nearest's.

    Args:
        wk: float32 [K, N] (input dimension first).
        block: B, dividing K.
        gram: float64 [K / B, B, B] or None.

    Returns:
        float16 [K / B, N], strictly positive (NvInfer.h IDequantizeLayer: scales > 0).
    """
    k, n = wk.shape
    blocks = wk.reshape(k // block, block, n)
    amax = np.abs(blocks).max(axis=1)  # [K/B, N]
    if gram is None:
        scale = (amax / INT4_MAX).astype(np.float16)
        return np.where(scale > 0, scale, np.float16(1))
    g = torch.from_numpy(np.asarray(gram, np.float32))  # [K/B, B, B]
    out = np.empty((k // block, n), np.float16)
    for c0 in range(0, n, 4096):  # columns in chunks: memory of a few [K, 4096] float32 arrays
        wb = torch.from_numpy(np.array(blocks[:, :, c0:c0 + 4096], dtype=np.float32))  # a writable copy
        mx = torch.from_numpy(amax[:, c0:c0 + 4096])
        best = torch.full(mx.shape, float("inf"))
        chosen = torch.ones(mx.shape, dtype=torch.float16)
        for i in range(int(AWQ_MAX_SHRINK * AWQ_GRID)):
            s16 = (mx * (1 - i / AWQ_GRID) / INT4_MAX).to(torch.float16)
            s16 = torch.where(s16 > 0, s16, torch.ones_like(s16))
            s = s16.float()[:, None, :]
            dw = torch.clamp(torch.round(wb / s), -INT4_MAX - 1, INT4_MAX) * s - wb  # [K/B, B, n]
            loss = (dw * torch.bmm(g, dw)).sum(1)  # [K/B, n]
            better = loss < best
            best = torch.where(better, loss, best)
            chosen = torch.where(better, s16, chosen)
        out[:, c0:c0 + 4096] = chosen.numpy()
    return out


class _Typer:
    """One graph's rewrite (the module docstring's rules)."""

    def __init__(self, model: onnx.ModelProto, base: Path, low: int, weights: _Weights, weights_rel: str,
                 kept: list, quant: str | None = None, act_amax: dict[str, float] | None = None, keep: bool = False,
                 stats: dict | None = None, int4_scales: str = "rtn", smooth_alpha: float | None = None,
                 keep_float: tuple[str, ...] = (), outlier_ratio: float | None = None):
        self.model, self.base, self.low, self.weights, self.weights_rel, self.kept = model, base, low, weights, \
            weights_rel, kept
        self.keep = keep  # an already typed (float16) graph: only its weight products are rewritten
        self.int4_blocks = INT4_BLOCKS  # or the one block size asked for (write_typed_graphs' int4_block)
        self.quant, self.act_amax, self.stats, self.int4_scales = quant, act_amax or {}, stats or {}, int4_scales
        self.keep_float = keep_float
        self.outlier_ratio, self.outliers = outlier_ratio, {}
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
        g = inferred.graph
        self.floats = {v.name for v in [*g.input, *g.output, *g.value_info] if v.type.tensor_type.elem_type == TensorProto.FLOAT}
        self.floats |= {t.name for t in g.initializer if t.data_type == TensorProto.FLOAT}
        self.inits = {t.name: t for t in model.graph.initializer}
        self.cur: dict[str, int] = {i.name: i.type.tensor_type.elem_type for i in model.graph.input}
        self.alias: dict[str, str] = {}
        self.casts: dict[tuple[str, int], str] = {}
        self.init_as: dict[tuple[str, int], str] = {}
        self.new_inits: list[TensorProto] = []
        self.nodes: list[onnx.NodeProto] = []
        self.counts = {"float32_nodes": 0, "low_nodes": 0, "casts": 0, **({f"{quant}_products": 0} if quant else {})}
        self.smooth = self._smoothing(smooth_alpha) if smooth_alpha is not None and quant in W8A8 else {}

    def _smoothing(self, alpha: float) -> dict[str, np.ndarray]:
        """SmoothQuant's per-input-channel factors (Xiao et al., *SmoothQuant*, ICML 2023, §4, eq. 4), one per
        activation, shared by the products reading it (q/k/v; gate/up; SmoothQuant takes max|W_j| over them):
        ``s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)``, the activation's per-channel max from the calibration
        (:class:`~.ranges.ProductStats`), stored as ``1 / fp16(1 / s_j)`` so the weights are scaled by exactly what
        the graph's Mul divides by. Returns {weight initializer: float32 [K]}.

        Raises:
            TypedGraphError: a product without calibration statistics.
        """
        groups: dict[str, list[tuple[str, int]]] = {}
        for n in self.model.graph.node:
            if n.op_type in ("MatMul", "Gemm") and len(n.input) > 1 and n.input[1] in self.inits:
                k_axis = 1 if any(a.name == "transB" and a.i for a in n.attribute) else 0
                if (n.input[1], k_axis) not in groups.setdefault(n.input[0], []):
                    groups[n.input[0]].append((n.input[1], k_axis))
        out = {}
        for _, members in groups.items():
            st = self.stats.get(members[0][0])
            if st is None or st.channel_max is None:
                raise TypedGraphError(f"{members[0][0]}: no calibration statistics for SmoothQuant's factors")
            wmax = np.zeros(len(st.channel_max))
            for w, k_axis in members:
                arr = np.asarray(_read_initializer(self.inits[w], self.base), dtype=np.float32)
                wmax = np.maximum(wmax, np.abs(arr).max(axis=1 - k_axis))
            xmax = st.channel_max
            ok = (xmax > 0) & (wmax > 0)
            sm = np.ones(len(xmax))
            sm[ok] = np.clip(xmax[ok] ** alpha / wmax[ok] ** (1 - alpha), 1e-4, 1e4)
            sm = (1.0 / (1.0 / sm).astype(np.float16).astype(np.float64)).astype(np.float32)
            mean = float((st.mean_abs / sm).mean())
            ratio = float((xmax / sm).max()) / mean if mean > 0 else float("inf")
            for w, _ in members:
                out[w] = sm
                if self.outlier_ratio is not None and ratio > self.outlier_ratio:
                    self.outliers[w] = round(ratio, 1)
        return out

    # -- tensors in a type -------------------------------------------------------------------

    def _initializer(self, name: str, want: int) -> str:
        key = (name, want)
        if key in self.init_as:
            return self.init_as[key]
        t = self.inits[name]
        if t.data_type != TensorProto.FLOAT:  # integer constants (shapes, axes) are kept as they are
            self.new_inits.append(t)
            out = name
        elif want == TensorProto.FLOAT:
            out = name  # kept float32 (copied into the typed weights file when external)
            if t.data_location == TensorProto.EXTERNAL:
                out = self._store(name, np.asarray(_read_initializer(t, self.base), dtype=np.float32),
                                  TensorProto.FLOAT, name)
            else:
                self.new_inits.append(t)
        else:
            arr = np.asarray(_read_initializer(t, self.base), dtype=np.float32)
            if arr.size and float(np.abs(arr).max()) > LOW_MAX[want]:  # would overflow: keep fp32, cast by a node
                self.kept.append(name)
                out = self._cast(self._initializer(name, TensorProto.FLOAT), want)
            else:
                out = self._store(name, _low_array(arr, want), want, f"{name}.{_short(want)}")
        self.init_as[key] = out
        return out

    def _store(self, src: str, arr: np.ndarray, dtype: int, name: str) -> str:
        if arr.nbytes < 1024:  # small constants stay inline
            t = numpy_helper.from_array(np.asarray(arr), name) if dtype != TensorProto.BFLOAT16 else \
                helper.make_tensor(name, dtype, arr.shape, arr.view(np.uint16).tobytes(), raw=True)
            self.new_inits.append(t)
            return name
        data = np.ascontiguousarray(arr).view(np.uint8).tobytes() if dtype == TensorProto.BFLOAT16 else \
            np.ascontiguousarray(arr).tobytes()
        return self._external(name, dtype, arr.shape, data, key=(src, dtype)).name

    def _int4_weight(self, name: str, k_axis: int) -> str:
        """The int4 weight-only form of weight ``name`` (float32 [K, N] of a MatMul, k_axis 0, or [N, K] of a Gemm with
        transB, k_axis 1): symmetric int4 in blocks of the largest of :data:`INT4_BLOCKS` dividing K, float16 scales
        (:func:`int4_block_scales`: max |w| / 7 per block, or AWQ's clip search on the calibration's block Grams), and
        the blocked DequantizeLinear that feeds the product in float16.

        Raises:
            TypedGraphError: no block size of :data:`INT4_BLOCKS` divides K (they are named).
        """
        key = (name, "int4")
        if key in self.init_as:
            return self.init_as[key]
        w = np.asarray(_read_initializer(self.inits[name], self.base), dtype=np.float32)
        k = w.shape[k_axis]
        block = next((b for b in self.int4_blocks if k % b == 0), None)
        if block is None:
            raise TypedGraphError(f"{name}: its input dimension {k} is a multiple of no int4 block size "
                                  f"({', '.join(map(str, INT4_BLOCKS))}): this model cannot be int4-quantized for TensorRT")
        wk = np.moveaxis(w, k_axis, 0)  # [K, N]
        stats = self.stats.get(name) if self.int4_scales == "awq" else None
        if self.int4_scales == "awq" and (stats is None or stats.block != block):
            raise TypedGraphError(f"{name}: no calibration statistics in blocks of {block} for its input: int4 "
                                  f"--int4-scales awq needs the calibration (trt/ranges.py) of this artifact")
        scale = int4_block_scales(wk, block, stats.gram_mean if stats is not None else None)  # [K / B, N] float16
        blocks = wk.reshape(k // block, block, -1)
        q = np.clip(np.rint(blocks / scale.astype(np.float32)[:, None, :]), -INT4_MAX - 1, INT4_MAX)
        q = q.astype(np.int8).reshape(wk.shape)
        q = np.moveaxis(q, 0, k_axis)
        scale = np.moveaxis(scale, 0, k_axis)
        nib = (q.reshape(-1) & 0xF).astype(np.uint8)
        if nib.size % 2:
            nib = np.append(nib, np.uint8(0))
        packed = (nib[0::2] | (nib[1::2] << 4)).astype(np.uint8)  # ONNX INT4: the first element in the low nibble
        qt = self._external(f"{name}.int4", TensorProto.INT4, q.shape, packed.tobytes())
        scale_name = self._store(f"{name}.scale", scale, TensorProto.FLOAT16, f"{name}.int4_scale")
        out = f"{name}/dq"
        self.nodes.append(helper.make_node("DequantizeLinear", [qt.name, scale_name], [out], name=f"{name}/dequantize",
                                           axis=k_axis, block_size=block))
        self.cur[out] = TensorProto.FLOAT16
        self.init_as[key] = out
        return out

    def _external(self, name: str, dtype: int, dims, data: bytes, key: tuple | None = None) -> TensorProto:
        """An initializer of ``data`` appended to the typed weights file (once per ``key``, default its name and type)."""
        offset, length = self.weights.add(key or (name, dtype), data)
        t = TensorProto(name=name, data_type=dtype, dims=list(dims), data_location=TensorProto.EXTERNAL)
        for kk, v in (("location", self.weights_rel), ("offset", str(offset)), ("length", str(length))):
            e = t.external_data.add()
            e.key, e.value = kk, v
        self.new_inits.append(t)
        return t

    def _w8_weight(self, name: str, k_axis: int) -> str:
        """The W8A8 weight of ``name`` (MatMul [K, N], k_axis 0; Gemm with transB [N, K], k_axis 1): per output channel
        scales max|w| / qmax (float16, strictly positive), int8 round-to-nearest or float8 E4M3 round-to-nearest-even
        (ml_dtypes), and its DequantizeLinear (axis = the output channel)."""
        key = (name, self.quant)
        if key in self.init_as:
            return self.init_as[key]
        qtype, qmax = W8A8[self.quant]
        w = np.asarray(_read_initializer(self.inits[name], self.base), dtype=np.float32)
        smooth, tag = self.smooth.get(name), ""
        if smooth is not None:  # SmoothQuant: W' = diag(s) W along K, the activation divided by s (_w8_activation)
            w = w * np.expand_dims(smooth, 1 - k_axis)
            tag = "." + hashlib.sha256(smooth.tobytes()).hexdigest()[:12]  # graphs may smooth a shared table apart
        scale = (np.abs(w).max(axis=k_axis) / qmax).astype(np.float16)
        scale = np.where(scale > 0, scale, np.float16(1))
        ratio = w / np.expand_dims(scale.astype(np.float32), k_axis)
        if qtype == TensorProto.INT8:
            data = np.clip(np.rint(ratio), -qmax, qmax).astype(np.int8).tobytes()
        else:
            import ml_dtypes

            data = np.clip(ratio, -qmax, qmax).astype(ml_dtypes.float8_e4m3fn).view(np.uint8).tobytes()
        q = self._external(f"{name}.{self.quant}{tag}", qtype, w.shape, data)
        s = self._store(f"{name}.wscale{tag}", scale, TensorProto.FLOAT16, f"{name}.{self.quant}_scale{tag}")
        zp = self._zero(qtype, list(scale.shape))
        out = f"{name}/dq"
        self.nodes.append(helper.make_node("DequantizeLinear", [q.name, s, zp], [out], name=f"{name}/dequantize",
                                           axis=1 - k_axis))
        self.cur[out] = TensorProto.FLOAT16
        self.init_as[key] = out
        return out

    def _zero(self, qtype: int, dims: list[int]) -> str:
        name = f"zero_point.{_short_q(qtype)}.{'x'.join(map(str, dims)) or 'scalar'}"
        if name not in {t.name for t in self.new_inits}:
            n = int(np.prod(dims)) if dims else 1
            self.new_inits.append(helper.make_tensor(name, qtype, dims, bytes(n), raw=True))
        return name

    def _w8_activation(self, x_low: str, source: str, node_name: str, weight: str | None = None) -> str:
        """A Q/DQ pair on an activation (float16) with the per-tensor scale of its calibrated range (max |x| over the
        calibration prompts / qmax), looked up by the product's weight initializer (:func:`~.ranges.calibrate`'s keys)
        or by the activation's own name.

        Raises:
            TypedGraphError: no calibrated range for the activation (the calibration did not reach it).
        """
        key = (x_low, self.quant)
        if key in self.casts:
            return self.casts[key]
        found = weight if weight in self.act_amax else source
        if found not in self.act_amax:
            raise TypedGraphError(f"{node_name}: no calibrated range for its input {source} (weight {weight}); "
                                  f"calibrate on prompts that run the whole step graph")
        qtype, qmax = W8A8[self.quant]
        amax = float(self.act_amax[found])
        smooth = self.smooth.get(weight)
        if smooth is not None:  # x / s by an explicit Mul (float16 1 / s), its range max_j max|x_j| / s_j
            inv = f"{source}/smooth_inv"
            self.new_inits.append(numpy_helper.from_array((1.0 / smooth).astype(np.float16), inv))
            smoothed = f"{source}/smoothed"
            self.nodes.append(helper.make_node("Mul", [x_low, inv], [smoothed], name=f"{source}/smooth"))
            self.cur[smoothed] = TensorProto.FLOAT16
            self.counts["smoothed_inputs"] = self.counts.get("smoothed_inputs", 0) + 1
            x_low = smoothed
            amax = float(np.max(self.stats[weight].channel_max / smooth))
        scale = np.array(amax / qmax if amax > 0 else 1.0, dtype=np.float16)
        s = f"{source}/ascale"
        self.new_inits.append(numpy_helper.from_array(scale, s))
        zp = self._zero(qtype, [])
        q, out = f"{source}/q", f"{source}/qdq"
        self.nodes += [helper.make_node("QuantizeLinear", [x_low, s, zp], [q], name=f"{source}/quantize"),
                       helper.make_node("DequantizeLinear", [q, s, zp], [out], name=f"{source}/dequantize")]
        self.cur[out] = TensorProto.FLOAT16
        self.casts[key] = out
        return out

    def _cast(self, name: str, to: int) -> str:
        key = (name, to)
        if key not in self.casts:
            out = f"{name}/as_{_short(to)}"
            self.nodes.append(helper.make_node("Cast", [name], [out], name=f"{name}/cast_{_short(to)}", to=to))
            self.counts["casts"] += 1
            self.cur[out] = to
            self.casts[key] = out
        return self.casts[key]

    def _as(self, name: str, want: int) -> str:
        name = self.alias.get(name, name)
        if name in self.inits:
            return self._initializer(name, want)
        return name if self.cur.get(name) == want else self._cast(name, want)

    # -- nodes ------------------------------------------------------------------------------

    def _kind_type(self, node: onnx.NodeProto) -> int:
        if island(node):
            return TensorProto.FLOAT
        data = [x for x in node.input if x in self.floats]
        if node.op_type in HEAVY_OPS or (node.op_type == "Gather" and node.input[0] in self.inits):
            return self.low
        computed = [self.cur.get(self.alias.get(x, x)) for x in data if x not in self.inits]
        if any(t == TensorProto.FLOAT for t in computed):
            return TensorProto.FLOAT  # never lower what another node computed in float32
        return self.low if computed else TensorProto.FLOAT

    def _outer_refs(self, node: onnx.NodeProto) -> set[str]:
        """Names a node's subgraphs read from the enclosing graph."""
        out = set()
        for a in node.attribute:
            for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                made = {o for n in sub.node for o in n.output} | {i.name for i in sub.input} | \
                    {t.name for t in sub.initializer}
                for n in sub.node:
                    out |= {x for x in n.input if x and x not in made}
                    out |= self._outer_refs(n) - made
        return out

    def _rename_in_subgraphs(self, node: onnx.NodeProto, names: dict[str, str]) -> None:
        for a in node.attribute:
            for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                for n in sub.node:
                    for i, x in enumerate(n.input):
                        if x in names:
                            n.input[i] = names[x]
                    self._rename_in_subgraphs(n, names)

    def _as_is(self, name: str) -> str:
        """An initializer of an already typed graph, in its own type (copied into the new weights file when external)."""
        key = (name, "as_is")
        if key not in self.init_as:
            t = self.inits[name]
            if t.data_location == TensorProto.EXTERNAL:
                self._store(name, np.asarray(_read_initializer(t, self.base)), t.data_type, name)
            else:
                self.new_inits.append(t)
            self.init_as[key] = name
        return name

    def _quantize_only(self, node: onnx.NodeProto) -> None:
        """``keep`` mode: the node as it is, but a weight product's weight through its DequantizeLinear and (W8A8) its
        activation through a Q/DQ pair, in the activation's own (float16) type."""
        quantized = node.op_type in ("MatMul", "Gemm") and len(node.input) > 1 and node.input[1] in self.inits \
            and not any(re.search(p, node.input[1]) for p in self.keep_float) and node.input[1] not in self.outliers
        source, weight = node.input[0], (node.input[1] if quantized else None)
        if quantized:
            k_axis = 1 if any(a.name == "transB" and a.i for a in node.attribute) else 0
            node.input[1] = (self._int4_weight if self.quant == "int4" else self._w8_weight)(node.input[1], k_axis)
            self.counts[f"{self.quant}_products"] += 1
        for i, x in enumerate(node.input):
            if x and x in self.inits:
                node.input[i] = self._as_is(x)
        for x in self._outer_refs(node):
            if x in self.inits:
                self._as_is(x)
        if quantized and self.quant in W8A8:
            node.input[0] = self._w8_activation(source, source, node.name, weight)
        self.nodes.append(node)

    def run(self) -> onnx.ModelProto:
        g = self.model.graph
        outputs = {o.name for o in g.output}
        for node in g.node:
            node = onnx.NodeProto.FromString(node.SerializeToString())
            if self.keep:
                self._quantize_only(node)
                continue
            want = self._kind_type(node)
            if node.op_type == "Cast":  # an explicit cast keeps its target (the step's positions to float32)
                node.input[0] = self.alias.get(node.input[0], node.input[0])
                if node.input[0] in self.inits:
                    node.input[0] = self._initializer(node.input[0], self.inits[node.input[0]].data_type)
                to = next(a.i for a in node.attribute if a.name == "to")
                self.cur[node.output[0]] = to
                self.nodes.append(node)
                continue
            quantized = self.quant and node.op_type in ("MatMul", "Gemm") and len(node.input) > 1 \
                and node.input[1] in self.inits and not any(re.search(p, node.input[1]) for p in self.keep_float) \
                and node.input[1] not in self.outliers
            weight = node.input[1] if quantized else None
            if quantized:
                k_axis = 1 if any(a.name == "transB" and a.i for a in node.attribute) else 0
                node.input[1] = (self._int4_weight if self.quant == "int4" else self._w8_weight)(node.input[1], k_axis)
                self.counts[f"{self.quant}_products"] += 1
            source = node.input[0]
            for i, x in enumerate(node.input):
                if x and x in self.floats:
                    node.input[i] = self._as(x, want)
                elif x and x in self.inits:
                    node.input[i] = self._initializer(x, self.inits[x].data_type)  # an integer constant
            if quantized and self.quant in W8A8:
                node.input[0] = self._w8_activation(node.input[0], source, node.name, weight)
            refs = self._outer_refs(node)
            renames = {x: self._as(x, TensorProto.FLOAT) if x in self.floats else
                       self._initializer(x, self.inits[x].data_type) for x in refs if x in self.floats or x in self.inits}
            renames = {k: v for k, v in renames.items() if k != v}
            if renames:
                self._rename_in_subgraphs(node, renames)
            for i, out in enumerate(node.output):
                if out not in self.floats:
                    self.cur[out] = -1
                    continue
                if out in outputs and want != TensorProto.FLOAT:  # the graph's outputs keep their float32 type
                    node.output[i] = f"{out}/{_short(want)}"
                    self.alias[out] = node.output[i]
                self.cur[node.output[i]] = want
            self.counts["float32_nodes" if want == TensorProto.FLOAT else "low_nodes"] += 1
            self.nodes.append(node)
        for out in g.output:
            if out.name in self.alias:
                self.nodes.append(helper.make_node("Cast", [self.alias[out.name]], [out.name],
                                                   name=f"{out.name}/cast_f32", to=TensorProto.FLOAT))
                self.counts["casts"] += 1
        new = helper.make_graph(self.nodes, g.name, list(g.input), list(g.output), initializer=self.new_inits)
        opsets = list(self.model.opset_import)
        if self.quant:  # blocked DequantizeLinear, float8 / int4 types: opset 21 (ONNX Operators.md); IR 10
            opsets = [helper.make_opsetid(o.domain, max(o.version, QDQ_OPSET)) if o.domain in ("", "ai.onnx") else o
                      for o in opsets]
        model = helper.make_model(new, opset_imports=opsets, ir_version=max(self.model.ir_version, 10),
                                  producer_name="medusa-export typed graph")
        return model


def _short_q(t: int) -> str:
    return {TensorProto.INT8: "i8", TensorProto.FLOAT8E4M3FN: "f8"}[t]


def _short(t: int) -> str:
    return {TensorProto.FLOAT: "f32", TensorProto.FLOAT16: "f16", TensorProto.BFLOAT16: "bf16"}[t]


def typed_paths(precision: str, graphs: list[str]) -> dict[str, str]:
    """Artifact-relative paths of the typed graph files: ``engines/<graph>.<precision>.onnx`` by graph, and
    ``weights`` -> ``engines/weights.<precision>.bin`` (one file the graphs share)."""
    out = {g: f"engines/{g}.{precision}.onnx" for g in graphs}
    out["weights"] = f"engines/weights.{precision}.bin"
    return out


def write_typed_graphs(folder: Path, files: dict[str, str], precision: str,
                       act_amax: dict[str, dict[str, float]] | None = None,
                       paths: dict[str, str] | None = None, int4_block: int | None = None, *, calibration=None,
                       int4_scales: str = "rtn", smooth_alpha: float | None = None,
                       keep_float: tuple[str, ...] = (), outlier_ratio: float | None = None) -> TypedReport:
    """Write the typed graphs of an artifact's float32 graphs (the module docstring's rules), or the Q/DQ graphs of its
    float16 graphs.

    A float16 graph (an fp16 artifact's, or the float16 graph ``build --graph portable --precision int8|fp8|int4`` writes
    first) is already typed: its float32 islands and Casts are the exporter's. For int4 / int8 / fp8 only its weight
    products are rewritten (the same DequantizeLinear / Q/DQ as from float32, weights read from float16), every other
    node and initializer kept as it is; the graph's I/O stay float16. So ``engine --precision int4`` of an fp16 artifact
    and ``build --graph portable --precision int4`` give the same graph from the same weights.

    Args:
        folder: the artifact.
        files: graph name -> artifact-relative ONNX file (the model graph, the heads graph or level graphs).
        precision: a key of :data:`LOW_TYPES`.
        act_amax: W8A8 (int8, fp8) only: per graph, the calibrated max |x| of each weight product's activation input
            (:func:`~.ranges.calibrate`), keyed by the products' weight initializers.
        paths: graph name -> artifact-relative output file, and ``weights`` -> the weights file (default
            :func:`typed_paths`; ``build`` gives the artifact's own ``model.onnx`` / ``heads.onnx`` / ``weights.bin``,
            replaced once every graph is written).
        int4_block: int4 only: the block size of every weight (None: per weight the largest of :data:`INT4_BLOCKS`
            dividing its K).

    Returns:
        The :class:`TypedReport`. Each file is written beside its final name and renamed into place, so an interrupted
        run leaves no half-written graph.

    Raises:
        TypedGraphError: a float16 graph asked for fp16 / bf16 (already typed: build its engine from it), or a written
            graph that breaks strong typing (:func:`check_strong_typing`).
    """
    if int4_scales not in INT4_SCALES:
        raise TypedGraphError(f"unknown int4 scale method {int4_scales!r}; known: {', '.join(INT4_SCALES)}")
    low = LOW_TYPES[precision]
    paths = paths or typed_paths(precision, list(files))
    for rel in paths.values():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
    weights_path = folder / paths["weights"]
    tmp_weights = weights_path.with_name(f".{weights_path.name}.tmp-{os.getpid()}")
    weights = _Weights(tmp_weights)
    report, written = TypedReport(precision, weights_file=paths["weights"]), []
    try:
        for graph, rel in files.items():
            src = folder / rel
            model = onnx.load(str(src), load_external_data=False)
            quant = precision if precision in ("int4", *W8A8) else None
            keep = any(t.data_type == TensorProto.FLOAT16 for t in model.graph.initializer)
            if keep and not quant:
                raise TypedGraphError(f"{rel} is already a float16 graph: build its engines from it (--precision fp16)")
            weights_rel = os.path.relpath(folder / paths["weights"], (folder / paths[graph]).parent)
            amax = (act_amax or (calibration.amax() if calibration is not None else {})).get(graph)
            typer = _Typer(model, src.parent, low, weights, weights_rel, report.kept_fp32_weights, quant=quant,
                           act_amax=amax, keep=keep,
                           stats=calibration.stats.get(graph) if calibration is not None else None,
                           int4_scales=int4_scales if precision == "int4" else "rtn",
                           smooth_alpha=smooth_alpha if precision in W8A8 else None, keep_float=keep_float,
                           outlier_ratio=outlier_ratio if precision in W8A8 else None)
            typer.int4_blocks = (int4_block,) if int4_block else INT4_BLOCKS
            typed = typer.run()
            check_strong_typing(typed, where=paths[graph])
            out = folder / paths[graph]
            tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
            onnx.save(typed, str(tmp))
            written.append((tmp, out))
            report.graphs[graph] = {"file": paths[graph], **typer.counts,
                                    **({"float_outlier_products": typer.outliers} if typer.outliers else {})}
        report.weights_bytes = weights.close()
        os.replace(tmp_weights, weights_path)
        for tmp, out in written:
            os.replace(tmp, out)
    finally:
        if not weights.fh.closed:
            weights.fh.close()
        tmp_weights.unlink(missing_ok=True)
        for tmp, _ in written:
            tmp.unlink(missing_ok=True)
    return report


#: Ops whose float inputs must all have one type (ONNX's type constraint ``T`` over these inputs).
_SAME_TYPE_INPUTS = {"Add": None, "Sub": None, "Mul": None, "Div": None, "Pow": (0,), "MatMul": None, "Gemm": None,
                     "Concat": None, "Where": (1, 2), "Max": None, "Min": None, "Sum": None, "Equal": None}


def check_strong_typing(model: onnx.ModelProto, where: str = "the typed graph") -> None:
    """Check a typed graph before any build: every op's same-typed float inputs agree (a strongly typed network
    takes each tensor's type as given and has no implicit cast), by ONNX's own type inference.

    Raises:
        TypedGraphError: the first op whose inputs disagree, naming the node, its input types and the fix.
    """
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    g = inferred.graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*g.input, *g.output, *g.value_info]}
    types |= {t.name: t.data_type for t in g.initializer}
    for node in g.node:
        if node.op_type not in _SAME_TYPE_INPUTS:
            continue
        idx = _SAME_TYPE_INPUTS[node.op_type] or range(len(node.input))
        seen = {node.input[i]: types.get(node.input[i]) for i in idx if i < len(node.input) and node.input[i]}
        kinds = {t for t in seen.values() if t}
        if len(kinds) > 1:
            named = ", ".join(f"{k}: {TensorProto.DataType.Name(v)}" for k, v in seen.items() if v)
            raise TypedGraphError(f"{where}: node {node.name or node.op_type} ({node.op_type}) mixes input types "
                                  f"({named}); a strongly typed network has no implicit cast: insert a Cast")


def rounded_in_float32(model: onnx.ModelProto, base: Path) -> onnx.ModelProto:
    """A bfloat16 typed graph computed in float32 with a bfloat16 rounding after every node that computes in
    bfloat16 and at every cast to it: what ONNX Runtime's CPU can run (it has no bfloat16 MatMul), and the same
    rounding points as the typed graph; only the accumulation inside a product differs (float32 here, as GPUs
    accumulate). Weights are read from ``base`` and held in memory (a validation-size model).

    Args:
        model: the typed graph (its external data not loaded).
        base: the folder its external data is relative to.

    Returns:
        A float32 model with inline weights.
    """
    g = model.graph
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False).graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*inferred.input, *inferred.output, *inferred.value_info]}
    inits = []
    for t in g.initializer:
        if t.data_type == TensorProto.BFLOAT16:
            arr = _read_initializer(t, base).astype(np.float32)  # exact: bf16 values are float32 values
            inits.append(numpy_helper.from_array(arr, t.name))
        elif t.data_location == TensorProto.EXTERNAL:
            inits.append(numpy_helper.from_array(np.asarray(_read_initializer(t, base)), t.name))
        else:
            inits.append(t)
    nodes = []
    for node in g.node:
        node = onnx.NodeProto.FromString(node.SerializeToString())
        if node.op_type == "Cast" and any(a.name == "to" and a.i == TensorProto.BFLOAT16 for a in node.attribute):
            out = node.output[0]
            node.output[0] = f"{out}/bf16"
            nodes += [node, helper.make_node("Cast", [node.output[0]], [out], to=TensorProto.FLOAT)]
            continue
        rounded = [o for o in node.output if types.get(o) == TensorProto.BFLOAT16]
        nodes.append(node)
        for i, out in enumerate(node.output):
            if out in rounded:
                node.output[i] = f"{out}/f32"
                nodes += [helper.make_node("Cast", [node.output[i]], [f"{out}/bf16"], to=TensorProto.BFLOAT16),
                          helper.make_node("Cast", [f"{out}/bf16"], [out], to=TensorProto.FLOAT)]
    new = helper.make_graph(nodes, g.name, list(g.input), list(g.output), initializer=inits)
    return helper.make_model(new, opset_imports=list(model.opset_import), ir_version=model.ir_version)
