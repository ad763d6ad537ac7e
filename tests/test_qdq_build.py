"""`build --graph portable --precision int8|fp8|int4` (issue 42): standard-ONNX Q/DQ artifacts.

The graphs are checked against references that do not go through our rewrite: ONNX's own reference evaluator
(``onnx.reference``) runs each DequantizeLinear, whose output is compared with the float16 weights of an fp16 build of
the same model (within half a quantization step for int8 / int4, within E4M3's rounding for fp8, worked out here by
hand); the readiness rules are checked on hand-made graphs with planted violations; bad input is refused with typed
errors before anything is written.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import make_tiny_medusa, tiny_loaded
from medusa_runtime.contract.artifact import load_artifact
from medusa_runtime.engines.ort import OrtEngine

QDQ = ("int4", "int8", "fp8")


def _build(out: Path, precision: str, graph: str = "portable", validate: bool = False, **kw) -> Path:
    from medusa_export.pipeline import BuildConfig, build_artifact
    from medusa_runtime.trees.treespec import tree_from_spec

    _, model = make_tiny_medusa()
    lm = tiny_loaded(model, max_context=256)
    return build_artifact(lm, tree_from_spec("chain" if precision == "int8" else "16", num_heads=3), out,
                          BuildConfig(precision=precision, graph=graph, validate=validate, new_tokens=16, **kw),
                          progress=False)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The tiny model built fp16 and, validated, portable int4 / int8 / fp8."""
    root = tmp_path_factory.mktemp("qdq")
    # int4 by round-to-nearest here, whose error bound is worked out below (AWQ's search: tests/test_calibration.py)
    return {p: _build(root / p, p, validate=p != "fp16", **({"int4_scales": "rtn"} if p == "int4" else {}))
            for p in ("fp16", *QDQ)}


def _array(t: TensorProto, base: Path) -> np.ndarray:
    """An initializer's values with its external data read (int4 / float8 unpacked by onnx's own helper)."""
    return numpy_helper.to_array(_inline(t, base))


def _dequantized(model: onnx.ModelProto, node: onnx.NodeProto, base: Path) -> np.ndarray:
    """``node`` (a DequantizeLinear of initializers) run by ONNX's reference evaluator, float32."""
    from onnx.reference import ReferenceEvaluator

    inits = {t.name: t for t in model.graph.initializer}
    feeds = [_inline(inits[x], base) for x in node.input if x]
    g = helper.make_graph([node], "dq", [], [helper.make_tensor_value_info(node.output[0], TensorProto.FLOAT16, None)],
                          initializer=feeds)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    return np.asarray(ReferenceEvaluator(m).run(None, {})[0], np.float32)


def _inline(t: TensorProto, base: Path) -> TensorProto:
    """A copy of initializer ``t`` with its external data (relative to ``base``) read in."""
    t = onnx.TensorProto.FromString(t.SerializeToString())
    if t.data_location == TensorProto.EXTERNAL:
        onnx.external_data_helper.load_external_data_for_tensor(t, str(base))
        t.data_location = TensorProto.DEFAULT
        del t.external_data[:]
    return t


@pytest.mark.parametrize("precision", QDQ)
def test_portable_build_is_a_standard_qdq_graph(built, precision):
    """No com.microsoft op, opset 21, the flavour portable, a DequantizeLinear feeding every weight product (and for
    W8A8 a Q/DQ pair on its activation), quantized tensors of the precision's ONNX type, readiness passed under both
    majors, and the validation's rule: Medusa == plain greedy of the same graph on every prompt."""
    art = built[precision]
    m = json.loads((art / "manifest.json").read_text())
    assert m["flavour"] == "portable" and m["precision"]["name"] == precision and m["precision"]["kv_dtype"] == "float16"
    assert m["trt_readiness"]["passed"] and not m["trt_readiness"]["errors"]
    want = {"int4": TensorProto.INT4, "int8": TensorProto.INT8, "fp8": TensorProto.FLOAT8E4M3FN}[precision]
    for file in ("model.onnx", "heads.onnx"):
        model = onnx.load(str(art / file), load_external_data=False)
        assert {o.version for o in model.opset_import if o.domain in ("", "ai.onnx")} == {21}
        assert not [n for n in model.graph.node if n.domain not in ("", "ai.onnx")]
        producer = {o: n for n in model.graph.node for o in n.output}
        products = [n for n in model.graph.node if n.op_type in ("MatMul", "Gemm") and n.input[1] in producer
                    and producer[n.input[1]].op_type == "DequantizeLinear"]
        inits = {t.name: t for t in model.graph.initializer}
        assert len(products) == (15 if file == "model.onnx" else 4)  # 2 layers x 7 + lm_head; 3 heads + projection
        for n in products:
            assert inits[producer[n.input[1]].input[0]].data_type == want
            if precision != "int4":
                q = producer[n.input[0]]
                assert q.op_type == "DequantizeLinear" and producer[q.input[0]].op_type == "QuantizeLinear"
    v = m["validation"]
    assert v["passed"] and v["tolerance"]["reference"] == "vanilla"
    assert all(p["vanilla_identical"] for p in v["prompts"])
    assert all("first_divergence" in p and ("reference_margin" in p) for p in v["prompts"])


@pytest.mark.parametrize("precision", QDQ)
def test_dequantized_weights_are_the_fp16_weights_within_the_quantization_step(built, precision):
    """Every DequantizeLinear, run by ONNX's reference evaluator, gives the fp16 build's weight within what the
    precision's rounding allows, worked out here: int8 per output channel |w - dq| <= max|w| / 127 / 2; int4 per block
    of the node's block_size along K <= max|w| / 7 / 2; fp8 E4M3 (3 mantissa bits) <= 2^-4 |w| + the smallest
    subnormal step 2^-9 x the channel's scale (scale = max|w| / 448)."""
    art16, art = built["fp16"], built[precision]
    fp16 = {t.name: t for t in onnx.load(str(art16 / "model.onnx"), load_external_data=False).graph.initializer}
    model = onnx.load(str(art / "model.onnx"), load_external_data=False)
    dq = [n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.name.endswith(".weight/dequantize")]
    assert dq
    made_by = {o: n for n in model.graph.node for o in n.output}
    inits = {t.name: t for t in model.graph.initializer}
    smoothed = 0
    for node in dq:
        name = node.name.removesuffix("/dequantize")
        w = _array(fp16[name], art16).astype(np.float32)
        product = next(n for n in model.graph.node if n.op_type in ("MatMul", "Gemm") and n.input[1] == node.output[0])
        x = made_by.get(product.input[0])  # W8A8: DequantizeLinear <- QuantizeLinear <- (SmoothQuant's Mul) <- x
        mul = made_by.get(made_by[x.input[0]].input[0]) if x is not None and x.op_type == "DequantizeLinear" else None
        if mul is not None and mul.op_type == "Mul" and mul.name.endswith("/smooth"):
            inv = _array(inits[mul.input[1]], art).astype(np.float32)  # x / s as x * (1 / s): the weight is s * w
            trans_b = any(a.name == "transB" and a.i for a in product.attribute)  # Gemm [N, K] (the tied lm_head)
            w = w / (inv.reshape(1, -1) if trans_b else inv.reshape(-1, 1))  # along K
            smoothed += 1
        got = _dequantized(model, node, art)
        assert got.shape == w.shape
        attrs = {a.name: a.i for a in node.attribute}
        k = attrs["axis"] if precision == "int4" else 1 - attrs["axis"]  # int4: blocked along K; W8A8: channel axis
        if precision == "int4":
            b = attrs["block_size"]
            wk = np.moveaxis(w, k, 0)
            step = np.abs(wk.reshape(wk.shape[0] // b, b, -1)).max(axis=1) / 7
            bound = np.moveaxis(np.repeat(step, b, axis=0), 0, k) / 2
        else:
            amax = np.abs(w).max(axis=k, keepdims=True)
            bound = (amax / 127 / 2) if precision == "int8" else (np.abs(w) * 2.0 ** -4 + amax / 448 * 2.0 ** -9)
        assert np.all(np.abs(got - w) <= bound * 1.01 + 1e-3 * np.abs(w) + 1e-7), name
    assert (smoothed > 0) == (precision == "int8")  # int8 is smoothed (SmoothQuant), fp8 and int4 are not


def test_engine_of_an_fp16_artifact_writes_the_build_s_graph(built, tmp_path):
    """`engine --precision int4` of an fp16 artifact and `build --graph portable --precision int4` write the same
    graph from the same weights: node for node, and the same quantized bytes."""
    from medusa_export.trt.quantized import write_quantized

    art = Path(shutil.copytree(built["fp16"], tmp_path / "fp16"))
    write_quantized(art, {"model": "model.onnx", "heads": "heads.onnx"}, "int4", None, int4_scales="rtn", progress=False)
    for g in ("model", "heads"):
        a = onnx.load(str(art / f"engines/{g}.int4.onnx"), load_external_data=False)
        b = onnx.load(str(built["int4"] / f"{g}.onnx"), load_external_data=False)
        assert [n.SerializeToString() for n in a.graph.node] == [n.SerializeToString() for n in b.graph.node]
        ai, bi = {t.name: t for t in a.graph.initializer}, {t.name: t for t in b.graph.initializer}
        assert ai.keys() == bi.keys()
        for name in ai:
            np.testing.assert_array_equal(_array(ai[name], art / "engines"), _array(bi[name], built["int4"]))


# ---------------------------------------------------------------- readiness: TensorRT's Q/DQ rules, planted violations

def _filled(name: str, qtype: int, dims, value: int) -> TensorProto:
    """A constant of ONNX type ``qtype`` (int8, uint8, int4, float8 E4M3) with every element ``value``."""
    n = int(np.prod(dims)) if dims else 1
    if qtype in (TensorProto.INT8, TensorProto.UINT8):
        return numpy_helper.from_array(np.full(dims, value, np.int8 if qtype == TensorProto.INT8 else np.uint8), name)
    if qtype == TensorProto.INT4:
        return helper.make_tensor(name, qtype, list(dims), [value] * n)
    return helper.make_tensor(name, qtype, list(dims), bytes([value]) * n, raw=True)  # float8: value is its bit pattern


def _qdq_model(*, qtype=TensorProto.INT8, zero=0, scale_shape=(), block=0, axis=1, weight_shape=(64, 32),
               runtime_scale=False) -> onnx.ModelProto:
    """x [1, 64] float16 -> Q/DQ (activation, per tensor) -> MatMul with DQ(weight [64, 32]): one product."""
    w = _filled("w", qtype, weight_shape, 0)
    ws = numpy_helper.from_array(np.ones(scale_shape, np.float16), "ws")
    wz = _filled("wz", qtype, scale_shape, zero)
    xs = numpy_helper.from_array(np.array(0.1, np.float16), "xs")
    xz = _filled("xz", TensorProto.INT8 if qtype == TensorProto.INT4 else qtype, (), 0)
    dq_attrs = {"axis": axis, **({"block_size": block} if block else {})}
    nodes = [helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wd"], name="w/dequantize", **dq_attrs)]
    scale = "xs"
    if runtime_scale:
        nodes.append(helper.make_node("Abs", ["xs"], ["xs_rt"], name="abs"))
        scale = "xs_rt"
    nodes += [helper.make_node("QuantizeLinear", ["x", scale, "xz"], ["xq"], name="x/quantize"),
              helper.make_node("DequantizeLinear", ["xq", scale, "xz"], ["xd"], name="x/dequantize"),
              helper.make_node("MatMul", ["xd", "wd"], ["y"], name="product")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [1, 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [1, 32])], initializer=[w, ws, wz, xs, xz])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


@pytest.mark.parametrize("major", ["10", "11"])
def test_readiness_passes_the_graphs_we_write_and_finds_each_planted_violation(major):
    from medusa_export.trt.readiness import check_qdq

    def errors(model, **kw):
        return [str(f) for f in check_qdq(model, "g.onnx", major, **kw)]

    assert errors(_qdq_model(scale_shape=(32,))) == []  # int8 per output channel, zeros
    assert errors(_qdq_model(qtype=TensorProto.FLOAT8E4M3FN, scale_shape=(32,))) == []
    assert errors(_qdq_model(qtype=TensorProto.INT4, scale_shape=(1, 32), block=64, axis=0)) == []
    planted = {
        "non-zero zero point": (_qdq_model(scale_shape=(32,), zero=3), "non-zero"),
        "uint8": (_qdq_model(qtype=TensorProto.UINT8, scale_shape=(32,)), "UINT8"),
        "int4 block 8": (_qdq_model(qtype=TensorProto.INT4, scale_shape=(8, 32), block=8, axis=0), "block size 8"),
        "per-channel length": (_qdq_model(scale_shape=(16,)), "per-channel scale of 16"),
        "runtime scale": (_qdq_model(scale_shape=(32,), runtime_scale=True), "computed at run time"),
        "int4 activation": (_qdq_model(qtype=TensorProto.INT4, scale_shape=(1, 32), block=64, axis=0), None),
    }
    for what, (model, text) in planted.items():
        if text is None:
            continue
        found = errors(model)
        assert any(text in e and f"TensorRT {major}" in e for e in found), (what, found)
    # int8 in blocks: TensorRT 10 blocks int4 only (10.0's Dequantize page), 11 int8 / fp8 too
    blocked_int8 = errors(_qdq_model(scale_shape=(1, 32), block=64, axis=0))
    assert bool(blocked_int8) == (major == "10"), blocked_int8
    # fp8 on a GPU older than Ada
    fp8 = _qdq_model(qtype=TensorProto.FLOAT8E4M3FN, scale_shape=(32,))
    assert any("compute capability 8.9" in e for e in errors(fp8, compute_capability=(8, 6)))
    assert errors(fp8, compute_capability=(9, 0)) == []
    # int4 quantizing an activation: weight-only in TensorRT
    m = _qdq_model(qtype=TensorProto.INT4, scale_shape=(1, 32), block=64, axis=0)
    for n in m.graph.node:
        if n.op_type == "QuantizeLinear":
            n.input[2] = "w4z"
    m.graph.initializer.append(helper.make_tensor("w4z", TensorProto.INT4, [], [0]))
    assert any("weight-only" in e for e in errors(m))


def test_a_built_artifact_with_a_planted_violation_fails_readiness(built, tmp_path):
    """The whole check on an artifact: a non-zero zero point planted in the built int8 graph is an error."""
    from medusa_export.trt.readiness import check_artifact

    art = Path(shutil.copytree(built["int8"], tmp_path / "art"))
    model = onnx.load(str(art / "model.onnx"), load_external_data=False)
    zp = next(t for t in model.graph.initializer if t.name.startswith("zero_point.i8.") and t.dims)
    zp.CopyFrom(numpy_helper.from_array(np.ones(tuple(zp.dims), np.int8), zp.name))
    onnx.save(model, str(art / "model.onnx"))
    report = check_artifact(art)
    assert not report.passed and any("non-zero values" in str(e) for e in report.errors)


# ---------------------------------------------------------------- bad input: typed errors, nothing written

def test_a_precision_a_graph_cannot_carry_names_the_choices():
    from medusa_export.export.config import ExportConfig, UnknownPrecisionError, UnsupportedGraphError

    with pytest.raises(UnsupportedGraphError, match=r"--graph fused does not take --precision fp8.*choose --precision "
                                                    r"fp32, int8, int4, or --graph portable for fp8"):
        ExportConfig(precision="fp8", graph="fused")
    with pytest.raises(UnsupportedGraphError, match=r"--graph contrib does not take --precision fp16.*int8, int4"):
        ExportConfig(precision="fp16", graph="contrib")
    with pytest.raises(UnknownPrecisionError, match="heads precision 'int4' needs an fp32 or weight-only"):
        ExportConfig(precision="int8", heads_precision="int4")  # MatMulNBits heads behind a float16 Q/DQ backbone
    assert ExportConfig(precision="int4", graph="contrib").resolved_heads_precision == "int8"  # as before
    assert ExportConfig(precision="int4").resolved_heads_precision == "int4"  # Q/DQ heads


def test_a_block_size_the_model_does_not_divide_is_refused_before_writing(tmp_path):
    from medusa_export.export.config import UnsupportedGraphError

    with pytest.raises(UnsupportedGraphError, match=r"--block-size 128 does not divide hidden_size 64.*choose 64 or 32 "
                                                    r"or 16"):
        _build(tmp_path / "a", "int4", block_size=128)
    assert not (tmp_path / "a").exists()
    art = _build(tmp_path / "b", "int4", block_size=32, int4_scales="rtn")  # divides: every DQ blocks by 32
    model = onnx.load(str(art / "model.onnx"), load_external_data=False)
    assert {a.i for n in model.graph.node if n.op_type == "DequantizeLinear" for a in n.attribute
            if a.name == "block_size"} == {32}


def test_calibration_prompts_missing_empty_or_too_few_are_refused(tmp_path):
    from medusa_export.pipeline import BuildConfig, BuildRequest, build
    from medusa_export.trt.quantized import CalibrationPromptsError
    from medusa_runtime.errors import PromptFileError

    cfg = BuildConfig(precision="int8")
    with pytest.raises(PromptFileError):
        build(BuildRequest("smollm2-135m", calibration_prompt_file=str(tmp_path / "none.jsonl"), out=str(tmp_path / "o")),
              cfg)
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "one.jsonl").write_text(json.dumps({"prompt": "Hi"}) + "\n")
    for f, n in (("empty.jsonl", 0), ("one.jsonl", 1)):
        with pytest.raises((CalibrationPromptsError, PromptFileError), match=r"(at least 2 non-empty prompts.*has "
                                                                            rf"{n}|empty|no record)"):
            build(BuildRequest("smollm2-135m", calibration_prompt_file=str(tmp_path / f), out=str(tmp_path / "o")), cfg)
    assert not (tmp_path / "o").exists()
    from medusa_export.trt.quantized import check_calibration_prompts

    with pytest.raises(CalibrationPromptsError, match="choose --precision int4"):  # the precision that needs none
        check_calibration_prompts("fp8", ["only one", "  "])
    assert check_calibration_prompts("int4", None) == []  # round-to-nearest: no calibration


def test_fp8_is_refused_where_the_visible_gpu_lacks_it(tmp_path):
    """An emulated GPU of compute capability 8.6 (Ampere): `build --precision fp8` exits with a typed error naming
    8.9 and the way to build for another machine; nothing is written."""
    import subprocess
    import sys

    emulated = Path(__file__).parent / "emulated"
    code = ("import sys; sys.path.insert(0, 'tests'); from test_qdq_build import _build; from pathlib import Path; "
            f"_build(Path({str(tmp_path / 'a')!r}), 'fp8')")
    env = {**__import__("os").environ, "PYTHONPATH": f"{emulated}:{':'.join(sys.path)}", "EMULATED_CUDA_CC": "8.6"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                       cwd=Path(__file__).parent.parent)
    assert r.returncode != 0 and "UnsupportedGraphError" in r.stderr and "compute capability 8.9" in r.stderr \
        and "has 8.6" in r.stderr and "CUDA_VISIBLE_DEVICES" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "a").exists()


def test_engine_of_another_precision_from_a_qdq_artifact_names_the_build(built, tmp_path):
    from medusa_export.cli.main import main

    art = Path(shutil.copytree(built["int4"], tmp_path / "art"))
    assert main(["engine", "--artifact", str(art), "--precision", "int8", "--no-validate"]) == 2
    assert main(["engine", "--artifact", str(art), "--precision", "fp16", "--no-validate"]) == 2
    assert not (art / "engines").exists() or not list((art / "engines").glob("*.onnx"))


def test_qdq_builds_run_in_their_row_regime_and_validate_strictly(built):
    """A Q/DQ graph on ONNX Runtime runs one-token steps as two rows (manifest ``precision.step_rows``), and its
    validation then requires Medusa == plain greedy of the same graph exactly: a divergence at any margin fails."""
    from medusa_export.validation.report import PromptReport, ValidationReport

    for p in QDQ:
        m = json.loads((built[p] / "manifest.json").read_text())
        want = "chain" if p == "int8" else "any"  # int8 W8A8: chains (its quantized activations)
        assert (m["precision"]["step_rows"]["min_rows"], m["precision"]["step_rows"]["trees"]) == (2, want)
        assert m["validation"]["passed"] and all(q["vanilla_identical"] for q in m["validation"]["prompts"])
        assert OrtEngine(load_artifact(built[p])).capabilities.min_rows == 2
    tie = PromptReport("p", 16, False, 0.0, 0.0, 0.0, vanilla_identical=False, vanilla_divergence=5, vanilla_token=1,
                       medusa_token=2, vanilla_margin=0.05, vanilla_near_tie=False)
    assert not ValidationReport("int4", 16, [tie]).passed


@pytest.mark.slow
def test_embedded_int4_qdq_medusa_equals_plain_with_two_row_steps_and_not_without(smollm, tmp_path):
    """On the embedded model's int4 Q/DQ graph (float16 activations) with its 64-node tree: padded one-token steps make
    Medusa equal plain greedy decoding bit for bit; unpadded ones (the one-row kernels) leave it (measured 2026-12-07:
    at new tokens 2 and 21 of the first two MT-Bench prompts)."""
    import dataclasses

    from conftest import mt_bench_prompts
    from medusa_export.pipeline import BuildConfig, build_artifact
    from medusa_runtime.contract.tokenizer import RuntimeTokenizer
    from medusa_runtime.decode.loop import generate
    from medusa_runtime.trees.tree import make_tree
    from medusa_runtime.trees.treespec import tree_from_spec

    tree = tree_from_spec("64", num_heads=smollm.model.num_heads, accuracies=smollm.head_accuracies)
    path = build_artifact(smollm, tree, tmp_path / "int4", BuildConfig(precision="int4", max_context=512,
                                                                       validate=False), progress=False)
    art = load_artifact(path)
    eng, tok = OrtEngine(art, threads=2), RuntimeTokenizer.from_artifact(art)
    root = make_tree([], num_heads=eng.num_heads, topk=art.tree.topk)
    same = {}
    for rows in (2, 1):
        eng.capabilities = dataclasses.replace(eng.capabilities, min_rows=rows)
        same[rows] = []
        for text in mt_bench_prompts(2):
            ids = tok.apply_chat_template([{"role": "user", "content": text}])
            same[rows].append(generate(eng, ids, art.tree, max_new_tokens=40).tokens ==
                              generate(eng, ids, root, max_new_tokens=40).tokens)
    assert same[2] == [True, True]
    assert not all(same[1])  # the control: without the regime the tree rows round otherwise
