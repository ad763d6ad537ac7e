"""Strongly typed fp16 / bf16 engines from an fp32 artifact (issue 39), under the EMULATED TensorRT 10 and 11.

The typed graph is checked against ONNX's own type inference and ONNX Runtime (independent of the typed pass'
bookkeeping); the emulated engines (tests/emulated: a test double, not TensorRT) must decode token for token what
ONNX Runtime decodes over the same typed graph, and their plans must carry no precision flag.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest

from medusa_runtime.contract.artifact import load_artifact

EMULATED = Path(__file__).parent / "emulated"
PROMPT = [3, 17, 42, 5, 99, 7, 12]
NEW = 10

#: The API of each major the project's builder and runtime run against (the emulation's default is 10.15.1).
MAJORS = ("10.15.1", "11.1.0")

_GENERATE = """
import json, sys
from medusa_runtime.front.session import MedusaSession
s = MedusaSession(sys.argv[1], backend="tensorrt", tree="artifact", precision=sys.argv[2], notice=None)
print(json.dumps(s.generate(prompt_ids=json.loads(sys.argv[3]), max_new_tokens=int(sys.argv[4])).token_ids))
"""


def _env(version: str, **extra) -> dict:
    return {**os.environ, "EMULATED_TENSORRT_VERSION": version,
            "PYTHONPATH": os.pathsep.join([str(EMULATED), *sys.path]), **extra}


def _run(version: str, *args, cwd=None, **extra) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], env=_env(version, **extra), capture_output=True, text=True,
                          timeout=600, cwd=cwd)


def _plan_header(path: Path) -> dict:
    """The emulated plan's build record (its header: flags, network typing, the ONNX it was built from)."""
    data = path.read_bytes()
    return json.loads(data.split(b"\n", 1)[1])


def _ort_tokens_of_typed_graph(art_dir: Path, precision: str) -> list[int]:
    """Greedy Medusa decoding with ONNX Runtime over the typed graphs (bf16: with its rounding points in fp32)."""
    from medusa_export.trt.typed import rounded_in_float32
    from medusa_runtime.decode.loop import generate
    from medusa_runtime.engines.ort import OrtEngine

    art = load_artifact(art_dir)
    files = {}
    for g in ("model", "heads"):
        path = art_dir / f"engines/{g}.{precision}.onnx"
        if precision == "bf16":
            out = art_dir / f"{g}.rounded.onnx"
            onnx.save(rounded_in_float32(onnx.load(str(path), load_external_data=False), path.parent), str(out))
            path = out
        files[g] = str(path)
    view = replace(art, manifest=replace(art.manifest, files={**art.manifest.files, **files}))
    return generate(OrtEngine(view), PROMPT, art.tree, max_new_tokens=NEW, max_context=art.model.max_context).tokens


@pytest.mark.parametrize("version", MAJORS)
@pytest.mark.parametrize("precision", ["fp16", "bf16", "int4", "int8", "fp8"])
def test_typed_engine_builds_and_generates_under_both_majors(tiny_trt_artifact, tmp_path, version, precision):
    """`engine --precision fp16|bf16` of the fp32 artifact: a validated typed graph beside the plans, plans built
    strongly typed with no builder precision flag (TF32 left as TensorRT's default for typed plans), recorded as
    computing in the precision's type; the runtime's TensorRT backend then decodes what ONNX Runtime decodes over
    the same typed graph."""
    art = Path(shutil.copytree(tiny_trt_artifact, tmp_path / "art"))
    r = _run(version, "-m", "medusa_export.cli.main", "engine", "--artifact", str(art), "--precision", precision)
    assert r.returncode == 0, r.stderr[-3000:]
    computes = {"fp16": "float16", "bf16": "bfloat16", "int4": "float16 (int4 weights)", "int8": "int8 (W8A8)",
                "fp8": "fp8 E4M3 (W8A8)"}[precision]
    assert f"TensorRT {version}" in r.stdout and f"computing in {computes}" in r.stdout
    rec = json.loads((art / "manifest.json").read_text())["engines"][precision]
    assert rec["typed_graph"]["validation"]["passed"] and rec["typed_graphs"]["model"] == f"engines/model.{precision}.onnx"
    for g in ("model", "heads"):
        header = _plan_header(art / f"engines/{g}.{precision}.plan")
        assert header["strongly_typed"] and header["onnx"].endswith(f"engines/{g}.{precision}.onnx")
        assert not set(header["flags"]) & {"FP16", "BF16", "INT8", "FP8", "OBEY_PRECISION_CONSTRAINTS"}
    got = _run(version, "-c", _GENERATE, str(art), precision, json.dumps(PROMPT), str(NEW))
    assert got.returncode == 0, got.stderr[-3000:]
    assert json.loads(got.stdout.strip().splitlines()[-1]) == _ort_tokens_of_typed_graph(art, precision)


@pytest.mark.parametrize("version", MAJORS)
def test_fp32_plans_clear_tf32(tiny_trt_artifact, version, tmp_path):
    """fp32 plans compute in fp32 (TF32, on by default in both majors, cleared), as the artifact was validated."""
    art = Path(shutil.copytree(tiny_trt_artifact, tmp_path / "art"))
    r = _run(version, "-m", "medusa_export.cli.main", "engine", "--artifact", str(art), "--precision", "fp32")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "TF32" not in _plan_header(art / "engines/model.fp32.plan")["flags"]
    assert json.loads((art / "manifest.json").read_text())["engines"]["fp32"]["computes_in"] == "float32"


def test_engine_takes_a_relative_artifact_path(tiny_trt_artifact, tmp_path):
    """docs/tensorrt.md's command gives the artifact as a relative path: the typed graph's validation (and the W8A8
    calibration) resolved its files under the doubled path (artifacts/x/artifacts/x/engines/...) and crashed."""
    shutil.copytree(tiny_trt_artifact, tmp_path / "artifacts" / "tiny")
    for precision in ("fp16", "int8"):
        r = _run("10.15.1", "-m", "medusa_export.cli.main", "engine", "--artifact", "artifacts/tiny", "--precision",
                 precision, cwd=tmp_path)
        assert r.returncode == 0, r.stderr[-2000:]


def test_bf16_is_refused_on_a_gpu_older_than_ampere(tiny_trt_artifact, tmp_path):
    """`--precision bf16` where the visible GPU has compute capability 7.5: a typed error naming both capabilities and
    the fix (exit 2), nothing written in engines/."""
    art = Path(shutil.copytree(tiny_trt_artifact, tmp_path / "art"))
    r = _run("10.15.1", "-m", "medusa_export.cli.main", "engine", "--artifact", str(art), "--precision", "bf16",
             EMULATED_CUDA_CC="7.5")
    assert r.returncode == 2 and "compute capability 8.0 or newer" in r.stderr and "has 7.5" in r.stderr, r.stderr
    assert not (art / "engines").exists() or not list((art / "engines").iterdir())


def test_a_typed_graph_that_breaks_strong_typing_is_refused_before_the_build(tiny_trt_artifact, tmp_path):
    """An op whose inputs disagree in type (a head's Gemm of a float32 hidden state and float16 weights) is found by ONNX type inference before
    any build, named with its input types."""
    from medusa_export.trt.typed import TypedGraphError, check_strong_typing, write_typed_graphs

    art = Path(shutil.copytree(tiny_trt_artifact, tmp_path / "art"))
    write_typed_graphs(art, {"model": "model.onnx", "heads": "heads.onnx"}, "fp16")
    model = onnx.load(str(art / "engines/heads.fp16.onnx"), load_external_data=False)
    check_strong_typing(model)  # as written: consistent
    cast = next(n for n in model.graph.node if n.op_type == "Cast" and n.attribute[0].i == onnx.TensorProto.FLOAT16)
    cast.attribute[0].i = onnx.TensorProto.FLOAT  # the hidden state no longer cast down: its consumer mixes types
    with pytest.raises(TypedGraphError, match=r"\(Gemm\) mixes input types \(hidden_states/as_f16: FLOAT, .*FLOAT16"):
        check_strong_typing(model)


def test_typed_weights_are_the_fp32_weights_rounded(tiny_trt_artifact, tmp_path):
    """Every weight of a heavy node is stored as the float32 weight rounded to nearest (numpy's float16 / ml_dtypes'
    bfloat16 rounding, checked here value by value), in one file the graphs share (the tied lm_head stored once)."""
    import ml_dtypes

    from medusa_export.trt.typed import write_typed_graphs

    art = Path(shutil.copytree(tiny_trt_artifact, tmp_path / "art"))
    src = {t.name: t for t in onnx.load(str(art / "model.onnx")).graph.initializer}
    for precision, np_type in (("fp16", np.float16), ("bf16", ml_dtypes.bfloat16)):
        report = write_typed_graphs(art, {"model": "model.onnx", "heads": "heads.onnx"}, precision)
        typed = onnx.load(str(art / f"engines/model.{precision}.onnx"), load_external_data=False)
        low = [t for t in typed.graph.initializer if t.name.endswith(f".{'f16' if precision == 'fp16' else 'bf16'}")]
        assert low
        data = (art / report.weights_file).read_bytes()
        for t in low:
            info = {e.key: e.value for e in t.external_data}
            raw = data[int(info["offset"]):int(info["offset"]) + int(info["length"])]
            got = np.frombuffer(raw, dtype=np_type).reshape(tuple(t.dims))
            want = onnx.numpy_helper.to_array(src[t.name.rsplit(".", 1)[0]]).astype(np_type)
            np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


# ---------------------------------------------------------------- trtexec lines per major version

OPTIONS = json.loads((Path(__file__).parent / "data" / "trtexec_options.json").read_text())


def test_the_option_tables_say_what_trtexec_11_removed():
    """The tables (read from sampleOptions.cpp at v10.16 and v11.1) hold the removals NVIDIA's 10.x-to-11.x migration
    guide lists, so a line using them fails the test below: a check of the data, not of our code."""
    removed = {"--fp16", "--bf16", "--fp8", "--int4", "--best", "--calib", "--precisionConstraints",
               "--layerPrecisions", "--layerOutputTypes"}  # (v11.1 still names --int8, in another parser's options)
    assert removed <= set(OPTIONS["10"]["options"]) and not removed & set(OPTIONS["11"]["options"])
    assert {"--stronglyTyped", "--noTF32", "--onnx", "--saveEngine"} <= set(OPTIONS["11"]["options"])


def _assert_trtexec_lines_parse_under_both_majors(art: Path, precision: str) -> None:
    """Each line of engines/trtexec.PRECISION.txt and of build_engine.sh uses only options both majors' trtexec parse."""
    import shlex

    lines = [ln for ln in (art / f"engines/trtexec.{precision}.txt").read_text().splitlines() if not ln.startswith("#")]
    script = (art / "engines/build_engine.sh").read_text()
    runs = [shlex.split(b.split("\n    ;;")[0].split("\n    run ")[0].replace("\\\n", " "))[2:]
            for b in script.split("    run ")[1:]]
    assert len(lines) == 2 and runs
    for argv in [shlex.split(ln)[1:] for ln in lines] + runs:
        for major in ("10", "11"):
            unknown = [a for a in argv if a.split("=")[0] not in OPTIONS[major]["options"]]
            assert not unknown, (major, unknown)


@pytest.mark.parametrize("precision", ["fp16", "bf16", "int4", "int8", "fp8", "fp32"])
def test_every_trtexec_line_parses_under_both_majors(tiny_trt_artifact, tmp_path, precision):
    """`engine --precision P` of an fp32 artifact writes trtexec lines both majors parse (no removed option)."""
    from medusa_export.cli.main import main

    art = Path(shutil.copytree(tiny_trt_artifact, tmp_path / "art"))
    main(["engine", "--artifact", str(art), "--precision", precision, "--no-validate"])
    _assert_trtexec_lines_parse_under_both_majors(art, precision)


@pytest.mark.parametrize("version", MAJORS)
def test_build_engine_sh_runs_against_the_emulated_trtexec_of_each_major(tiny_trt_artifact, tmp_path, version):
    """build_engine.sh of each precision against an emulated trtexec that refuses unknown options as that major's does
    (tests/emulated/bin/trtexec); the record names the major's version."""
    from medusa_export.cli.main import main

    art = Path(shutil.copytree(tiny_trt_artifact, tmp_path / "art"))
    for precision in ("fp16", "bf16", "int4", "fp32"):  # writes the typed graphs the script's typed lines read
        main(["engine", "--artifact", str(art), "--precision", precision, "--no-validate"])
    env = {"PATH": "/usr/bin:/bin", "TRTEXEC": str(EMULATED / "bin" / "trtexec"), "EMULATED_TENSORRT_VERSION": version}
    for precision in ("fp16", "bf16", "int4", "fp32"):
        r = subprocess.run(["bash", str(art / "engines/build_engine.sh"), precision], env=env, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        record = json.loads((art / f"engines/build_record.{precision}.json").read_text())
        assert record["tensorrt"] == version and (art / f"engines/model.{precision}.plan").is_file()
    bad = (art / "engines/build_engine.sh").read_text().replace("--stronglyTyped", "--fp16", 1)
    (art / "engines/bad.sh").write_text(bad)
    r = subprocess.run(["bash", str(art / "engines/bad.sh"), "fp16"], env=env, capture_output=True, text=True)
    assert (r.returncode != 0) == version.startswith("11"), r.stdout + r.stderr  # 11 refuses the removed option


def test_int4_weights_are_symmetric_blocks_of_the_fp32_weights(tiny_trt_artifact, tmp_path):
    """int4 weight-only: every weight product reads a blocked DequantizeLinear (opset 21) of int4 values whose block
    scale is max|w| / 7 over the block (worked out here from the fp32 weights) and whose dequantized values lie within
    half a scale of the fp32 weights (round to nearest)."""
    from medusa_export.trt.typed import write_typed_graphs

    art = Path(shutil.copytree(tiny_trt_artifact, tmp_path / "art"))
    src = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(str(art / "model.onnx")).graph.initializer}
    report = write_typed_graphs(art, {"model": "model.onnx", "heads": "heads.onnx"}, "int4")
    typed = onnx.load(str(art / "engines/model.int4.onnx"), load_external_data=False)
    assert {o.version for o in typed.opset_import if o.domain in ("", "ai.onnx")} == {21}
    inits = {t.name: t for t in typed.graph.initializer}
    data = (art / report.weights_file).read_bytes()
    dq = [n for n in typed.graph.node if n.op_type == "DequantizeLinear"]
    assert dq and report.graphs["model"]["int4_products"] == len(dq)
    for node in dq:
        q_t, s_t = inits[node.input[0]], inits[node.input[1]]
        attrs = {a.name: a.i for a in node.attribute}
        w = src[q_t.name.removesuffix(".int4")]
        info = {e.key: e.value for e in q_t.external_data}
        packed = np.frombuffer(data[int(info["offset"]):int(info["offset"]) + int(info["length"])], np.uint8)
        nib = np.stack([packed & 0xF, packed >> 4], axis=1).reshape(-1)[:w.size].astype(np.int8)
        q = np.where(nib > 7, nib - 16, nib).reshape(w.shape)
        k = attrs["axis"]
        if s_t.data_location == onnx.TensorProto.EXTERNAL:
            si = {e.key: e.value for e in s_t.external_data}
            scale = np.frombuffer(data[int(si["offset"]):int(si["offset"]) + int(si["length"])], np.float16)
            scale = scale.reshape(tuple(s_t.dims)).astype(np.float32)
        else:
            scale = onnx.numpy_helper.to_array(s_t).astype(np.float32)
        wk, qk, sk = np.moveaxis(w, k, 0), np.moveaxis(q, k, 0), np.moveaxis(scale, k, 0)
        b = attrs["block_size"]
        blocks = wk.reshape(wk.shape[0] // b, b, -1)
        np.testing.assert_allclose(sk, np.abs(blocks).max(axis=1) / 7, rtol=1e-3)  # fp16-rounded scales
        deq = (qk.reshape(blocks.shape) * sk[:, None, :]).reshape(wk.shape)
        assert np.all(np.abs(deq - wk) <= sk.repeat(b, axis=0) * 0.5 + 1e-3 * np.abs(wk) + 1e-6)


# ---------------------------------------------------------------- the portable Q/DQ artifacts (issue 42)

@pytest.fixture(scope="module")
def qdq_artifacts(tmp_path_factory):
    """The tiny model built `--graph portable --precision int4|int8|fp8` (no validation: tests/test_qdq_build.py)."""
    from conftest import make_tiny_medusa, tiny_loaded
    from medusa_export.pipeline import BuildConfig, build_artifact
    from medusa_runtime.trees.treespec import tree_from_spec

    root = tmp_path_factory.mktemp("qdq-trt")
    _, model = make_tiny_medusa()
    return {p: build_artifact(tiny_loaded(model, max_context=256), tree_from_spec("16", num_heads=3), root / p,
                              BuildConfig(precision=p, validate=False), progress=False) for p in ("int4", "int8", "fp8")}


@pytest.mark.parametrize("version", MAJORS)
@pytest.mark.parametrize("precision", ["int4", "int8", "fp8"])
def test_portable_qdq_artifact_builds_and_generates_under_both_majors(qdq_artifacts, tmp_path, version, precision):
    """`engine --precision P` of a `build --graph portable --precision P` artifact builds its plans from the artifact's
    own Q/DQ graphs (no typed graph written, no builder precision flag) under the EMULATED TensorRT 10 and 11, and the
    runtime's TensorRT backend decodes what ONNX Runtime decodes over the same artifact."""
    from medusa_runtime.decode.loop import generate
    from medusa_runtime.engines.ort import OrtEngine

    art = Path(shutil.copytree(qdq_artifacts[precision], tmp_path / "art"))
    r = _run(version, "-m", "medusa_export.cli.main", "engine", "--artifact", str(art), "--precision", precision)
    assert r.returncode == 0, r.stderr[-3000:]
    rec = json.loads((art / "manifest.json").read_text())["engines"][precision]
    assert "typed_graphs" not in rec and not list((art / "engines").glob("*.onnx"))
    for g in ("model", "heads"):
        header = _plan_header(art / f"engines/{g}.{precision}.plan")
        assert header["strongly_typed"] and header["onnx"].endswith(f"{g}.onnx")
        assert not set(header["flags"]) & {"FP16", "BF16", "INT8", "FP8", "INT4", "OBEY_PRECISION_CONSTRAINTS"}
    _assert_trtexec_lines_parse_under_both_majors(art, precision)  # no option TensorRT 11's trtexec removed
    got = _run(version, "-c", _GENERATE, str(art), precision, json.dumps(PROMPT), str(NEW))
    assert got.returncode == 0, got.stderr[-3000:]
    a = load_artifact(art)
    want = generate(OrtEngine(a), PROMPT, a.tree, max_new_tokens=NEW, max_context=a.model.max_context).tokens
    assert json.loads(got.stdout.strip().splitlines()[-1]) == want
