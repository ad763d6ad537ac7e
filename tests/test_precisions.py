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
        # every precision has a TensorRT-ready portable graph; quantized ones (Q/DQ there, MatMulNBits in the
        # contrib / fused graphs) are validated against their own plain decoding
        assert p.tensorrt and p.flavour == "portable"
        assert p.qdq == (p.tolerance.reference == "vanilla") == (p.portable.weights == "qdq")
        assert p.weight_only == any(f.weights == "nbits" for f in p.graphs.values()) == ("contrib" in p.graphs)
        assert (p.accuracy_level is None) == (p.weight_bits is None)
        for graph, form in p.graphs.items():
            assert form.dtype == "float32" or graph == "portable"  # the contrib / fused CPU kernels compute in fp32
            assert (form.flavour == "ort-contrib") == (graph == "contrib")
            assert form.ort_factor >= 1.0  # a session holds at least the weights
        assert p.tolerance.exact == (p.dtype == "float32" and not p.qdq)  # only fp32 must match bit for bit
        assert (p.calibration_prompts > 0) <= p.qdq
    with pytest.raises(dataclasses.FrozenInstanceError):
        PRECISION_TABLE["fp32"].name = "fp16"


def test_every_stage_reads_the_table(monkeypatch):
    """Each stage's view of the table is read at use, not copied at import: a row added to the table (as
    docs/house.md says to add a precision) appears in every one of them, each filtered by the row's fields."""
    forms = dict(PRECISION_TABLE["int8"].graphs)
    forms["portable"] = dataclasses.replace(forms["portable"], ort_factor=1.3)
    row = dataclasses.replace(PRECISION_TABLE["int8"], name="int8-acc1", accuracy_level=1, graphs=forms)
    monkeypatch.setitem(PRECISION_TABLE, "int8-acc1", row)
    assert list(config.PRECISIONS) == ["fp32", "fp16", "int8", "int4", "fp8", "int8-acc1"] == list(precisions())
    assert list(config.FUSED_PRECISIONS) == ["fp32", "int8", "int4", "int8-acc1"]
    assert dict(config.BACKBONE_ACCURACY) == {"int8": 4, "int4": 4, "int8-acc1": 1}
    assert dict(quantize.WEIGHT_ONLY_BITS) == {"int8": 8, "int4": 4, "int8-acc1": 8}
    assert list(config.HEADS_PRECISIONS) == ["auto", "same", "int8", "int4", "int8-acc1"]
    assert "int8-acc1" in config.HEADS_PRECISIONS and "fp16" not in config.HEADS_PRECISIONS
    assert validate.tolerance("int8-acc1") is row.tolerance and plan.ORT_FACTORS["int8-acc1"] == 1.3
    assert list(readiness.TENSORRT_PRECISIONS) == ["fp32", "fp16", "int8", "int4", "fp8", "int8-acc1"]
    with pytest.raises(KeyError):
        quantize.WEIGHT_ONLY_BITS["fp32"]  # a row that does not match the view's filter
    assert quantize.WeightOnlyConfig.for_precision("int8-acc1").bits == 8
    assert config.ExportConfig(precision="fp16").spec is PRECISION_TABLE["fp16"]
    with pytest.raises(config.UnknownPrecisionError, match="needs an fp32 or weight-only backbone"):
        config.ExportConfig(precision="fp16", heads_precision="int8")
    assert config.ExportConfig(precision="fp32", heads_precision="int4").resolved_heads_precision == "int4"
