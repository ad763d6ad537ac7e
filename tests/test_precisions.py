"""The table of precisions (medusa_export.export.precisions) is what build, validation and trt read."""

from __future__ import annotations

import dataclasses

import pytest

from medusa_export.export import config, quantize
from medusa_export.export.precisions import PRECISION_TABLE, precisions
from medusa_export.trt import readiness
from medusa_export.validation import plan, validate


def test_the_table_rows():
    rows = {n: (p.dtype, p.weight_bits, p.accuracy_level, p.fused, p.flavour, p.tensorrt, p.tolerance.reference,
                p.ort_factor) for n, p in PRECISION_TABLE.items()}
    assert rows == {"fp32": ("float32", None, None, True, "portable", True, "pytorch", 1.4),
                    "fp16": ("float16", None, None, False, "portable", True, "pytorch", 3.3),
                    "int8": ("float32", 8, 4, True, "ort-contrib", False, "vanilla", 1.6),
                    "int4": ("float32", 4, 1, True, "ort-contrib", False, "vanilla", 1.4)}
    assert PRECISION_TABLE["fp32"].tolerance.exact and PRECISION_TABLE["fp16"].tolerance.margin == 0.1
    with pytest.raises(dataclasses.FrozenInstanceError):
        PRECISION_TABLE["fp32"].dtype = "float16"


def test_every_stage_reads_the_table():
    assert config.PRECISIONS == ("fp32", "fp16", "int8", "int4") == precisions()
    assert config.FUSED_PRECISIONS == ("fp32", "int8", "int4")
    assert config.BACKBONE_ACCURACY == {"int8": 4, "int4": 1}
    assert quantize.WEIGHT_ONLY_BITS == {"int8": 8, "int4": 4}
    assert validate.TOLERANCES == {n: p.tolerance for n, p in PRECISION_TABLE.items()}
    assert validate.tolerance("fp16") is PRECISION_TABLE["fp16"].tolerance
    assert plan.ORT_FACTORS == {"fp32": 1.4, "fp16": 3.3, "int8": 1.6, "int4": 1.4}
    assert readiness.TENSORRT_PRECISIONS == "fp32 or fp16"
    assert config.BuildConfig(precision="fp16").spec.dtype == "float16"
    with pytest.raises(config.UnknownPrecisionError, match="needs an fp32 or weight-only backbone"):
        config.BuildConfig(precision="fp16", heads_precision="int8")
    assert config.BuildConfig(precision="fp32", heads_precision="int4").resolved_heads_precision == "int4"
