"""The table of precisions (medusa_export.export.precisions) is what build, validation and trt read."""

from __future__ import annotations

import dataclasses

import pytest

from medusa_export.export import config, quantize
from medusa_export.export.precisions import PRECISION_TABLE, precisions
from medusa_export.trt import readiness
from medusa_export.validation import plan, validate


def test_the_rows_are_consistent():
    """What each row implies about the others (a row edited in one field but not its consequences fails here);
    the rows' behaviour is tested where it acts: test_export (fp16: float16 KV, measured diffs), test_quantized
    (int8/int4: MatMulNBits, not TensorRT-ready, Medusa == plain greedy on the same graph)."""
    for name, p in PRECISION_TABLE.items():
        assert p.name == name
        # weight-only <=> MatMulNBits <=> ONNX Runtime only, validated against its own plain decoding
        assert p.weight_only == (p.flavour == "ort-contrib") == (not p.tensorrt) == (p.tolerance.reference == "vanilla")
        assert (p.accuracy_level is None) == (p.weight_bits is None)
        assert p.dtype == "float32" or not p.fused  # the fused graph's CPU kernels compute in fp32
        assert p.tolerance.exact == (p.dtype == "float32" and not p.weight_only)  # only fp32 must match bit for bit
        assert p.ort_factor >= 1.0  # a session holds at least the weights
    with pytest.raises(dataclasses.FrozenInstanceError):
        PRECISION_TABLE["fp32"].dtype = "float16"


def test_every_stage_reads_the_table():
    table = PRECISION_TABLE.items()
    assert config.PRECISIONS == tuple(PRECISION_TABLE) == precisions()
    assert config.FUSED_PRECISIONS == tuple(n for n, p in table if p.fused)
    assert config.BACKBONE_ACCURACY == {n: p.accuracy_level for n, p in table if p.weight_only}
    assert quantize.WEIGHT_ONLY_BITS == {n: p.weight_bits for n, p in table if p.weight_only}
    assert validate.TOLERANCES == {n: p.tolerance for n, p in table}
    assert validate.tolerance("fp16") is PRECISION_TABLE["fp16"].tolerance
    assert plan.ORT_FACTORS == {n: p.ort_factor for n, p in table}
    assert readiness.TENSORRT_PRECISIONS == " or ".join(n for n, p in table if p.tensorrt)
    assert config.ExportConfig(precision="fp16").spec is PRECISION_TABLE["fp16"]
    with pytest.raises(config.UnknownPrecisionError, match="needs an fp32 or weight-only backbone"):
        config.ExportConfig(precision="fp16", heads_precision="int8")
    assert config.ExportConfig(precision="fp32", heads_precision="int4").resolved_heads_precision == "int4"
