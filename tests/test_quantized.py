"""Weight-only quantized artifacts (MatMulNBits int8 / int4) and quantized heads graphs."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from conftest import make_tiny_medusa, tiny_loaded
from medusa_export.pipeline import BuildConfig, build_artifact
from medusa_export.export.config import ExportConfig, UnknownPrecisionError
from medusa_export.export.quantize import QuantizationError, WeightOnlyConfig, quantize_rows
from medusa_export.trt.readiness import check_artifact
from medusa_export.validation.validate import PromptReport, ValidationError, ValidationReport, tolerance
from medusa_runtime.contract.artifact import load_artifact
from medusa_runtime.engines.ort import OrtEngine
from medusa_runtime.decode.loop import generate
from medusa_runtime.trees.tree import make_tree
from medusa_runtime.trees.treespec import tree_from_spec

ARTIFACT_FILES = ["chat_template.jinja", "heads.onnx", "manifest.json", "manifest.schema.json", "model.onnx", "tokenizer",
                  "tree.json", "weights.bin"]


@pytest.fixture(scope="module")
def tiny_lm():
    """Tied embedding, projections larger than the embedding (as in a real model)."""
    _, model = make_tiny_medusa(vocab=503, hidden=128, intermediate=512, medusa_heads=2, head_noise=0.3, tie=True)
    return tiny_loaded(model)


def _build(lm, out, **cfg):
    cfg.setdefault("new_tokens", 16)
    return build_artifact(lm, tree_from_spec("8", num_heads=2), out, BuildConfig(**cfg), progress=False)


@pytest.fixture(scope="module")
def built(tiny_lm, tmp_path_factory):
    """Artifacts built once per module (with validation): ``built(precision, heads_precision)``."""
    cache = {}

    def get(precision: str, heads_precision: str = "auto"):
        key = (precision, heads_precision)
        if key not in cache:
            out = tmp_path_factory.mktemp("quantized") / f"{precision}-{heads_precision}"
            graph = "contrib" if precision in ("int8", "int4") else "portable"  # the MatMulNBits graphs
            cache[key] = _build(tiny_lm, out, precision=precision, heads_precision=heads_precision, graph=graph)
        return cache[key]

    return get


def _op_types(path) -> set[str]:
    return {n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node}


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_weight_only_artifact_is_lossless_to_its_own_graph(built, precision):
    path = built(precision)
    m = json.loads((path / "manifest.json").read_text())
    assert m["flavour"] == "ort-contrib" and "com.microsoft::MatMulNBits" in m["flavour_note"]
    assert m["precision"]["name"] == precision and m["precision"]["heads"] == "int8"  # auto: measured default
    assert f"int{precision[-1]} weight-only" in m["precision"]["weights"]
    v = m["validation"]
    assert v["passed"] and v["tolerance"]["reference"] == "vanilla", v
    assert all(p["vanilla_identical"] and p["tokens"] > 0 for p in v["prompts"])
    assert sorted(p.name for p in path.iterdir()) == ARTIFACT_FILES  # one merged weights.bin, no leftovers
    for g in ("model.onnx", "heads.onnx"):
        ops = _op_types(path / g)
        assert "MatMulNBits" in ops and "Gemm" not in ops
    assert "Gather" in _op_types(path / "model.onnx")  # the embedding stays a float lookup
    # The check the validation made, repeated here: Medusa == plain greedy on the same engine.
    art = load_artifact(path, full_verify=True)
    eng = OrtEngine(art)
    root = make_tree([], num_heads=2, topk=art.tree.topk)
    for prompt in ([5, 17, 230, 9], list(range(40, 90))):
        kw = dict(max_new_tokens=24, max_context=256)
        medusa, plain = generate(eng, prompt, art.tree, **kw), generate(eng, prompt, root, **kw)
        assert medusa.tokens == plain.tokens and len(medusa.tokens) == 24
        # Every token is accounted to a step (the prefill's, then each tree step's), and the root-only tree
        # emits exactly one per step: 23 steps after the prefill for 24 tokens.
        assert 1 + sum(medusa.step_tokens) == 24 and plain.step_tokens == [1] * 23


def test_quantized_artifact_is_smaller_and_reported_not_trt_ready(built, tiny_lm, tiny_trt_artifact):
    int4 = built("int4")
    fp32_bytes = 4 * sum(p.numel() for p in tiny_lm.model.parameters())  # tied weights counted once
    assert (int4 / "weights.bin").stat().st_size < 0.5 * fp32_bytes
    m32 = json.loads((tiny_trt_artifact / "manifest.json").read_text())
    assert m32["flavour"] == "portable" and m32["trt_readiness"]["passed"]
    m4 = json.loads((int4 / "manifest.json").read_text())
    r = m4["trt_readiness"]
    assert not r["passed"] and "flavour is 'ort-contrib'" in r["errors"][0] and "--precision fp32" in r["errors"][0]
    assert not check_artifact(int4).passed


def test_quantized_heads_on_fp32_backbone(built):
    """--heads-precision int4: only heads.onnx is quantized; the output still equals plain greedy."""
    path = built("fp32", "int4")
    m = json.loads((path / "manifest.json").read_text())
    assert m["precision"]["name"] == "fp32" and m["precision"]["heads"] == "int4"
    assert m["flavour"] == "ort-contrib"
    assert "MatMulNBits" not in _op_types(path / "model.onnx") and "MatMulNBits" in _op_types(path / "heads.onnx")
    v = m["validation"]
    assert v["passed"] and v["tolerance"]["reference"] == "pytorch"  # the backbone is fp32: exact vs PyTorch
    assert all(p["identical"] and p["vanilla_identical"] for p in v["prompts"])


def test_fp32_default_stays_portable():
    cfg = ExportConfig()
    assert cfg.resolved_heads_precision == "fp32"
    assert ExportConfig(precision="fp16").resolved_heads_precision == "fp16"
    assert ExportConfig(precision="int4", heads_precision="same").resolved_heads_precision == "int4"


@pytest.mark.parametrize("kw, match", [
    (dict(precision="int3"), "unknown precision 'int3'; choose one of fp32, fp16, int8, int4"),
    (dict(precision="INT8"), "unknown precision 'INT8'"),
    (dict(heads_precision="fp8"), "unknown heads precision 'fp8'; choose one of auto, same, int8, int4"),
    (dict(precision="fp16", heads_precision="int4"), "needs an fp32 or weight-only backbone"),
])
def test_bad_precision_names_are_clear_errors(kw, match):
    with pytest.raises(UnknownPrecisionError, match=match):
        BuildConfig(**kw)


def test_bad_precision_in_manifest_or_quantizer_settings():
    with pytest.raises(QuantizationError, match="choose one of int8, int4"):
        WeightOnlyConfig.for_precision("fp16")
    with pytest.raises(QuantizationError, match="power of two"):
        WeightOnlyConfig(bits=4, block_size=48)
    with pytest.raises(ValidationError, match="known: fp32, fp16, int8, int4"):
        tolerance("int2")


def test_vanilla_divergence_fails_a_weight_only_report():
    """int8/int4 pass on Medusa == plain greedy; disagreeing with fp32 PyTorch is information."""
    ok = PromptReport("differs from fp32", 8, False, 0.5, 0.5, 3.0, first_divergence=2, vanilla_identical=True)
    bad = PromptReport("medusa != vanilla", 8, True, 0.0, 0.0, 0.0, vanilla_identical=False, vanilla_divergence=5,
                       vanilla_token=11, medusa_token=12)
    report = ValidationReport("int4", 8, [ok, bad])
    assert report.failure(ok) is None
    assert report.failures() == ["'medusa != vanilla': Medusa diverges from plain greedy decoding of the same int4 "
                                 "graph at new token 5: Medusa 12, plain greedy 11"]
    assert "tokens before the first divergence 2, 8" in report.summary()
    assert json.loads(json.dumps(report.to_json()))["tolerance"]["atol"] is None  # valid JSON, no Infinity
    assert ValidationReport("fp32", 8, [ok]).failures()  # the same figures fail an fp32 artifact


@pytest.mark.parametrize("bits, k", [(4, 96), (8, 96), (4, 80)], ids=["int4", "int8", "int4-padded-K"])
def test_per_tensor_blocks_equal_the_whole_graph_quantizer(bits, k):
    """quantize_rows (per tensor, in blocks of rows) writes the bytes MatMulNBitsQuantizer writes for the same
    weight in a graph: same kernels, same zero-padding of K, rows independent."""
    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    rng = np.random.default_rng(bits + k)
    w = rng.standard_normal((24, k)).astype(np.float32)  # nn.Linear layout [out N, in K]
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 24])],
                              [numpy_helper.from_array(np.ascontiguousarray(w.T), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    q = MatMulNBitsQuantizer(model, bits=bits, block_size=32, is_symmetric=False, accuracy_level=1)
    q.process()
    inits = {t.name: numpy_helper.to_array(t) for t in q.model.model.graph.initializer}
    parts = [quantize_rows(w[i:i + 7], bits, 32, False) for i in range(0, 24, 7)]  # blocks of 7 rows
    packed, scales, zp = (np.concatenate([p[j] for p in parts]) for j in range(3))
    np.testing.assert_array_equal(packed, inits[f"w_Q{bits}"])
    np.testing.assert_array_equal(scales, inits["w_scales"])
    np.testing.assert_array_equal(zp, inits["w_zero_points"])


def test_backbone_accuracy_level_defaults_are_the_fast_int8_compute_with_its_row_regime():
    nbits = dict(graph="contrib")  # the MatMulNBits graphs (--graph portable's int4 / int8 are Q/DQ: no level)
    assert ExportConfig(precision="int4", **nbits).weight_only("int4").accuracy_level == 4  # exact with step_rows
    assert ExportConfig(precision="int4", **nbits).step_rows["trees"] == "chain"
    assert ExportConfig(precision="int4", accuracy_level=1, **nbits).step_rows is None
    assert ExportConfig(precision="int8", **nbits).weight_only("int8").accuracy_level == 4  # the only fast int8 kernel
    assert ExportConfig(precision="int4", **nbits).weight_only("int8", heads=True).accuracy_level == 4  # heads propose
    assert ExportConfig(precision="int4", accuracy_level=4, **nbits).weight_only("int4").accuracy_level == 4
    assert ExportConfig(precision="int4").weight_only("int4") is None
