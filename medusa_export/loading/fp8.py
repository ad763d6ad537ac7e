"""FP8 checkpoints of NVIDIA TensorRT Model Optimizer (modelopt): detection and dequantization.

Pure helpers (no file reading beyond the small quantization config), shared by the loader of the
PyTorch reference (:mod:`.backbone`, :mod:`.heads_formats`) and by the export's streaming tensor
source (:class:`~.checkpoint.SafetensorsSource`), so both dequantize the same way (:func:`dequantize`).

Layout (modelopt's unified Hugging Face export, ``modelopt/torch/export/quant_utils.py``; read by
TensorRT-LLM ``models/medusa/weight.py`` and ``examples/medusa/convert_checkpoint.py``):

* ``hf_quant_config.json``: ``{"producer": {"name": "modelopt", ...}, "quantization": {"quant_algo":
  "FP8", "kv_cache_quant_algo": null | "FP8", "exclude_modules": [...]}}``; newer exports also
  write ``quantization_config`` with ``"quant_method": "modelopt"`` into ``config.json``;
* every quantized Linear ``X``: ``X.weight`` float8_e4m3fn, ``X.weight_scale`` float32 per-tensor
  (shape [] or [1]; a per-output-channel scale, one per row, is read too) with ``weight = fp8 * weight_scale`` (``to_quantized_weight``:
  ``(w / scale).to(float8_e4m3fn)``, scale = amax / 448), and ``X.input_scale``, the static
  activation scale a TensorRT FP8 GEMM would use;
* optional KV-cache scales (``kv_cache_quant_algo`` FP8): ``*.k_scale`` / ``*.v_scale``
  (older exports: ``*.output_scale``).

For ONNX the weights are dequantized (``w.float() * weight_scale``, in float32, then cast); the
activation and KV scales are kept aside (:attr:`Dequantized.kept_scales`), not applied. A
TensorRT FP8 plan would need, per quantized Linear, ``QuantizeLinear``/``DequantizeLinear``
pairs carrying ``input_scale`` on the activation and ``weight_scale`` on the FP8 weight
(ONNX opset >= 19 for FLOAT8E4M3FN, explicit quantization, an SM 8.9+ GPU): see
:data:`TENSORRT_FP8_NOTE`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from math import prod
from pathlib import Path

import torch

from ..errors import UnsupportedModelError

#: The FP8 format modelopt writes (E4M3, max 448).
FP8_DTYPE = torch.float8_e4m3fn
#: Storage dtypes read as FP8 (E4M3, and E5M2).
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
WEIGHT_SCALE = "weight_scale"
INPUT_SCALE = "input_scale"
#: Scales that are not needed to dequantize the weights (activations, KV cache); kept aside.
KEPT_SCALE_SUFFIXES = (INPUT_SCALE, "k_scale", "v_scale", "output_scale")
QUANT_CONFIG_FILE = "hf_quant_config.json"
#: What the build summary says about an FP8 checkpoint.
TENSORRT_FP8_NOTE = ("FP8 (modelopt) checkpoint dequantized to the export precision for ONNX; a TensorRT FP8 "
                     "plan would need QuantizeLinear/DequantizeLinear pairs per quantized Linear (weight_scale on "
                     "the FP8 weight, input_scale on the activation; opset >= 19, explicit quantization, SM 8.9+)")


@dataclass(frozen=True)
class QuantConfig:
    """A checkpoint's quantization, as declared beside it.

    Attributes:
        producer: "modelopt".
        quant_algo: "FP8" (the only algorithm read).
        kv_cache_quant_algo: None or "FP8" (KV scales are kept aside, the KV cache stays in the
            export precision).
        exclude_modules: modules left unquantized (e.g. ``lm_head``); information only: the
            loader dequantizes exactly the tensors stored as FP8.
    """

    producer: str
    quant_algo: str
    kv_cache_quant_algo: str | None = None
    exclude_modules: tuple[str, ...] = ()


def read_quant_config(folder: str | Path, config: dict | None = None) -> QuantConfig | None:
    """The quantization a checkpoint folder declares, or None for an unquantized one.

    Args:
        folder: the checkpoint folder (``hf_quant_config.json`` is looked for there).
        config: its ``config.json`` as a dict (its ``quantization_config`` is read), if already read.

    Raises:
        UnsupportedModelError: a quantization other than modelopt FP8 (named, with what is supported).
    """
    path = Path(folder) / QUANT_CONFIG_FILE
    if path.is_file():
        data = json.loads(path.read_text())
        producer = str((data.get("producer") or {}).get("name", "unknown"))
        q = data.get("quantization") or {}
    elif config and config.get("quantization_config"):
        q = config["quantization_config"]
        producer = str(q.get("quant_method", "unknown"))
    else:
        return None
    algo = q.get("quant_algo")
    if producer != "modelopt" or algo != "FP8":
        raise UnsupportedModelError(
            f"quantized checkpoint ({producer}, {algo or q.get('quant_method') or 'unknown algorithm'}) is not "
            "supported; supported: unquantized, or TensorRT Model Optimizer (modelopt) FP8")
    return QuantConfig(producer, algo, q.get("kv_cache_quant_algo"), tuple(q.get("exclude_modules") or ()))


def is_fp8(t: torch.Tensor) -> bool:
    """True for a tensor stored in FP8 (E4M3 or E5M2)."""
    return t.dtype in FP8_DTYPES


def scale_key(weight_key: str, scale: str = WEIGHT_SCALE) -> str:
    """``a.b.weight`` -> ``a.b.weight_scale`` (or ``a.b.input_scale`` ...)."""
    return weight_key.removesuffix("weight") + scale


def check_scale(key: str, scale_shape: tuple[int, ...], weight_shape: tuple[int, ...]) -> None:
    """Refuse a ``weight_scale`` that is neither per tensor (one value) nor per output channel (one per row).

    Raises:
        UnsupportedModelError: the scale's key, shape and what is supported.
    """
    n = prod(scale_shape)
    if n != 1 and not (weight_shape and n == weight_shape[0]):
        raise UnsupportedModelError(
            f"FP8 scale {key!r} has shape {tuple(scale_shape)} for a weight of shape {tuple(weight_shape)}: only "
            "per-tensor scales (one value) or per-output-channel scales (one per row) are supported")


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
               rows: tuple[int, int] | None = None) -> torch.Tensor:
    """An FP8 weight times its scale: ``(weight.float() * scale.float()).to(dtype)``.

    The one dequantization of the project: the loaded reference (:func:`dequantize_state`) and the
    export's streaming source (:class:`~.checkpoint.SafetensorsSource`) both call it.

    Args:
        weight: float8 [out, in] (any shape), or rows ``[start, stop)`` of it when ``rows`` is given.
        scale: float32 with one element (per tensor, shape [] or [1]; modelopt FP8) or one per output
            row of the whole weight (per channel, shape [out] or [out, 1]).
        dtype: the result's dtype (the product is formed in float32).
        rows: the rows of the whole weight that ``weight`` holds (a per-channel scale is sliced to them).

    Raises:
        UnsupportedModelError: a scale that is neither (its shape named).
    """
    s = scale.to(torch.float32)
    if s.numel() == 1:
        s = s.reshape(())
    elif weight.dim():
        s = s.reshape(-1, *([1] * (weight.dim() - 1)))
        s = s if rows is None else s[rows[0]:rows[1]]
    if s.numel() != 1 and (weight.dim() == 0 or s.shape[0] != weight.shape[0]):
        raise UnsupportedModelError(f"FP8 weight scale of shape {tuple(scale.shape)} for a weight of shape "
                                    f"{tuple(weight.shape)}: only per-tensor scales (one value) or per-output-channel "
                                    "scales (one per row) are supported")
    return (weight.to(torch.float32) * s).to(dtype)


def describe(quantized: int, dtype: torch.dtype = torch.float32) -> str:
    """How a build summary and ``LoadedMedusa.quantization`` name a dequantized modelopt FP8 checkpoint."""
    return f"modelopt FP8 ({quantized} weights dequantized to {str(dtype).removeprefix('torch.')})"


def kept_scale(key: str, value: torch.Tensor) -> float:
    """An activation or KV scale set aside (not applied), as a float.

    Raises:
        UnsupportedModelError: a scale that is not per tensor.
    """
    if value.numel() != 1:
        raise UnsupportedModelError(f"{key!r} has shape {tuple(value.shape)}; only per-tensor scales are supported")
    return float(value.float().reshape(()))


@dataclass
class Dequantized:
    """The result of :func:`dequantize_state`.

    Attributes:
        tensors: the state dict with every FP8 weight replaced by its dequantized value and no
            scale left in it.
        kept_scales: the scales not needed for that (``input_scale``, KV scales), by key, as floats.
        quantized: how many FP8 weights were dequantized.
    """

    tensors: dict[str, torch.Tensor]
    kept_scales: dict[str, float] = field(default_factory=dict)
    quantized: int = 0


def dequantize_state(tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> Dequantized:
    """Dequantize every FP8 weight of a state dict with its ``weight_scale``; set other scales aside.

    Args:
        tensors: a modelopt FP8 state dict (or part of one); unquantized tensors pass unchanged.
        dtype: dtype of the dequantized weights.

    Raises:
        UnsupportedModelError: an FP8 weight without its ``weight_scale``, a ``weight_scale`` with
            no FP8 weight, or a scale that is not per-tensor (the key is named).
    """
    out: dict[str, torch.Tensor] = {}
    kept: dict[str, float] = {}
    n = 0
    for key, t in tensors.items():
        if key.endswith("." + WEIGHT_SCALE):
            weight = key.removesuffix(WEIGHT_SCALE) + "weight"
            if weight not in tensors or not is_fp8(tensors[weight]):
                raise UnsupportedModelError(f"{key!r} scales no FP8 weight ({weight!r} is missing or not FP8)")
            continue
        if key.rsplit(".", 1)[-1] in KEPT_SCALE_SUFFIXES:
            kept[key] = kept_scale(key, t)
            continue
        if is_fp8(t):
            sk = scale_key(key)
            if sk not in tensors:
                raise UnsupportedModelError(f"FP8 tensor {key!r} has no {sk!r}")
            check_scale(sk, tuple(tensors[sk].shape), tuple(t.shape))
            out[key] = dequantize(t, tensors[sk], dtype)
            n += 1
        else:
            out[key] = t
    return Dequantized(out, kept, n)
