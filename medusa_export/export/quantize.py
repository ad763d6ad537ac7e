"""Weight-only quantization of the exported graphs with ONNX Runtime's MatMulNBits.

``int8`` / ``int4`` artifacts replace each constant-weight MatMul by the contrib operator
``com.microsoft::MatMulNBits`` (``onnxruntime.quantization.matmul_nbits_quantizer``):
weights stored blockwise (``block_size`` values share one scale and zero point along the
input dimension), activations stay float. With ``accuracy_level=4`` the CPU kernel
quantizes each activation row to int8 per block and multiplies in int8 (AVX512-VNNI /
AVX-VNNI where present). Such a graph is ONNX Runtime only (the artifact's flavour is
``ort-contrib``); the portable fp32 / fp16 graphs are the TensorRT path.

The graph writers emit MatMulNBits directly (:meth:`.graph.GraphBuilder.linear`); each weight is
quantized on its own, block of rows by block of rows, as it is written (:func:`quantize_rows`), with
ONNX Runtime's own quantization kernels: no whole-graph quantizer pass that loads every initializer.
Projections keep the ``nn.Linear`` layout ``[out, in]`` that MatMulNBits stores (one row of blocks per
output), so nothing is transposed. The embedding keeps reading a float table, so token lookup is exact.

Whether the vocabulary projection (``[d, V]``, the lm_head) is quantized is a parameter:
it is the largest matrix of a small model and the heads' whole cost.

Measured on SmolLM2-135M (this 2-core CPU shared with other work, ORT 1 thread, past 256,
round-robin medians; top-1 agreement with fp32 over 256 prefill positions of plain text):

=================  =======  ===========  ============  =========  ==============  ===========
graphs             weights  decode step  tree-16 step  heads R=1  backbone top-1  heads top-1
=================  =======  ===========  ============  =========  ==============  ===========
fp32               544 MB   54.0 ms      100.8 ms      11.3 ms    1                1
int8, block 32     269 MB   22.8 ms      70.1 ms       3.8 ms     0.926            0.960
int8, lm_head fp   236 MB   24.9 ms      75.9 ms       3.7 ms     0.949            0.960
int4, block 32     200 MB   19.5 ms      73.6 ms       3.2 ms     0.621            0.646
int4, lm_head fp   181 MB   23.5 ms      80.8 ms       3.1 ms     0.727            0.646
int4, block 128    192 MB   13.8 ms      58.1 ms       2.4 ms     0.570            0.619
=================  =======  ===========  ============  =========  ==============  ===========

So the lm_head is quantized by default (faster decode step, a few points of agreement), the
embedding stays a float ``Gather`` (quantizing it with ``GatherBlockQuantized`` saves ~95 MB
but needs the quantizer's forced opset-21 upgrade and makes token lookup approximate), and
the heads default to int8 (3x cheaper than fp32 in the table above, which was measured with other jobs
on the cores; 1.6 vs 4.3 ms, 2.7x, on an idle machine; top-1 agreement 0.96 against int4's 0.65).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from ..errors import MedusaError
from .precisions import Column

#: weight-only precision name -> bits per weight (MatMulNBits), from :data:`.precisions.PRECISION_TABLE`.
WEIGHT_ONLY_BITS = Column("weight_bits", weight_only=True)
CONTRIB_DOMAIN = "com.microsoft"


class QuantizationError(MedusaError):
    """A graph could not be quantized (bad settings or an unexpected graph)."""


@dataclass(frozen=True)
class WeightOnlyConfig:
    """Settings of one MatMulNBits pass.

    Attributes:
        bits: 8 or 4 bits per weight.
        block_size: weights per scale along the input dimension (a power of two >= 16).
        accuracy_level: MatMulNBits compute type (0 unset, 1 fp32, 2 fp16, 3 bf16, 4 int8).
        symmetric: symmetric blocks (no zero points) instead of asymmetric ones.
        vocab_projection: also quantize MatMuls whose output width is the vocabulary (the lm_head).
    """

    bits: int
    block_size: int = 32
    accuracy_level: int = 4
    symmetric: bool = False
    vocab_projection: bool = True

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise QuantizationError(f"MatMulNBits bits must be 4 or 8, got {self.bits}")
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise QuantizationError(f"block_size must be a power of two >= 16, got {self.block_size}")
        if self.accuracy_level not in (0, 1, 2, 3, 4):
            raise QuantizationError(f"accuracy_level must be 0-4, got {self.accuracy_level}")

    @classmethod
    def for_precision(cls, precision: str, **kw) -> "WeightOnlyConfig":
        """The config of a weight-only precision name ("int8" or "int4").

        Raises:
            QuantizationError: ``precision`` is not a weight-only precision (the message lists them).
        """
        if precision not in WEIGHT_ONLY_BITS:
            raise QuantizationError(f"{precision!r} is not a weight-only precision; choose one of "
                                    f"{', '.join(WEIGHT_ONLY_BITS)}")
        return cls(bits=WEIGHT_ONLY_BITS[precision], **kw)

    def describe(self) -> str:
        """One line for the manifest, e.g. "int4 MatMulNBits, block 32, accuracy_level 4 (int8 compute), asymmetric"."""
        comp = {0: "default", 1: "fp32", 2: "fp16", 3: "bf16", 4: "int8"}[self.accuracy_level]
        return (f"int{self.bits} weight-only (com.microsoft MatMulNBits), block {self.block_size}, "
                f"accuracy_level {self.accuracy_level} ({comp} compute), "
                f"{'symmetric' if self.symmetric else 'asymmetric'}, "
                f"lm_head {'quantized' if self.vocab_projection else 'float'}; embedding Gather float")


def nbits_geometry(k: int, bits: int, block_size: int) -> tuple[int, int, int]:
    """(blocks per row, bytes per block, zero-point bytes per row) of MatMulNBits over K inputs
    (onnxruntime ``DefaultWeightOnlyQuantizer.qbits_block_quant``, QOperator format)."""
    kpack = 8 // bits
    blocks = (k + block_size - 1) // block_size
    return blocks, (block_size + kpack - 1) // kpack, (blocks + kpack - 1) // kpack


def quantize_rows(w: np.ndarray, bits: int, block_size: int, symmetric: bool):
    """MatMulNBits blocks of the rows of ``w`` float32 ``[n, K]`` (row j = output column j of the MatMul).

    onnxruntime's own kernels (``quantize_matmul_4bits`` / ``quantize_matmul_8bits``) on the ``[K, n]``
    transpose, zero-padded to whole blocks along K, exactly as ``MatMulNBitsQuantizer`` calls them
    (``DefaultWeightOnlyQuantizer.qbits_block_quant``): the same bytes as a whole-graph pass. Rows are
    quantized independently, so blocks of rows concatenate to the bytes of the whole matrix.

    Args:
        w: float32 [n, K] (an ``nn.Linear`` weight as stored: output rows).
        bits: 4 or 8.
        block_size: weights per block along K.
        symmetric: no zero points (the kernel still fills the array; the caller drops it).

    Returns:
        (packed uint8 [n, blocks, blob], scales float32 [n, blocks], zero points uint8 [n, zp bytes]).
    """
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits

    import torch

    n, k = w.shape
    blocks, blob, zp_bytes = nbits_geometry(k, bits, block_size)
    wt = torch.from_numpy(np.ascontiguousarray(w, np.float32)).t()  # torch's blocked transpose: ~4x numpy's
    if k % block_size:
        wt = torch.nn.functional.pad(wt, (0, 0, 0, blocks * block_size - k))
    wt = wt.contiguous().numpy()
    packed = np.zeros((n, blocks, blob), np.uint8)
    scales = np.zeros((n, blocks), np.float32)
    zp = np.zeros((n, zp_bytes), np.uint8)
    (quantize_matmul_4bits if bits == 4 else quantize_matmul_8bits)(packed, wt, scales, zp, block_size, n, k, symmetric)
    return packed, scales, zp


def uses_contrib_ops(path: Path) -> list[str]:
    """Sorted ``domain::op`` names of the non-standard (com.microsoft) ops in an ONNX file."""
    m = onnx.load(str(path), load_external_data=False)
    return sorted({f"{n.domain}::{n.op_type}" for n in m.graph.node if n.domain not in ("", "ai.onnx")})
