"""TensorRT stage: readiness check, trtexec commands and build script, profile/shape planning,
device KV compaction plan, `engine` without TensorRT, `doctor`.

TensorRT cannot be installed in this project's CI: the engine build and the TrtEngine backend run
end to end against the EMULATED TensorRT in tests/test_trt_emulated.py (token-exact against ONNX
Runtime there). Everything here runs without TensorRT.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import shlex
import shutil
import subprocess
from argparse import Namespace
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from conftest import rmsnorm_chains
from medusa_export.cli.main import main
from medusa_export.cli.trt import after_build
from medusa_export.trt.commands import trtexec_args
from medusa_export.trt.config import EXIT_NO_TENSORRT, EngineConfig
from medusa_export.trt.readiness import check_artifact, check_external_data, check_fixed_shapes, check_ops
from medusa_export.validation.manifest_update import update_manifest
from medusa_runtime.contract.artifact import load_artifact
from medusa_runtime.engines.kvcache import write_accepted
from medusa_runtime.errors import BackendUnavailableError, ContextOverflowError
from medusa_runtime.engines.trt_plan import (ALIGN, KVLayout, ShapeOutOfProfileError, compaction_copies, compaction_runs,
                                     model_profiles, pack_copies, packed_layout, profile_shapes, select_profile)

HAVE_TRT = importlib.util.find_spec("tensorrt") is not None


@pytest.fixture
def art(tiny_trt_artifact, tmp_path):
    """A private copy of the session's tiny artifact (the engine step writes into it)."""
    return Path(shutil.copytree(tiny_trt_artifact, tmp_path / "art"))


def _manifest(path) -> dict:
    return json.loads((Path(path) / "manifest.json").read_text())


# ---------------------------------------------------------------- readiness


def test_readiness_passes_on_exported_artifact(tiny_trt_artifact):
    report = check_artifact(tiny_trt_artifact)
    assert report.passed, [str(e) for e in report.errors]
    assert "MatMul" in report.graphs["model"]["op_types"] and "TopK" in report.graphs["heads"]["op_types"]
    stored = _manifest(tiny_trt_artifact)["trt_readiness"]  # build ran the check and kept the result
    assert stored["passed"] and stored["tensorrt"] == report.tensorrt


@pytest.mark.slow
def test_readiness_passes_on_embedded_model_artifact(smollm_artifact):
    report = check_artifact(smollm_artifact)
    assert report.passed, [str(e) for e in report.errors]
    assert report.graphs["model"]["opset"] == 18


def _model(nodes, inputs, outputs, initializers=(), opset=18, domains=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    imports = [helper.make_opsetid("", opset)] + [helper.make_opsetid(d, 1) for d in domains]
    return helper.make_model(graph, opset_imports=imports)


def _vi(name, dims, elem=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, elem, dims)


def test_readiness_names_the_unsupported_op():
    m = _model([helper.make_node("Relu", ["x"], ["r"], name="ok_relu"),
                helper.make_node("Unique", ["r"], ["y"], name="dedupe_tokens")],
               [_vi("x", [4])], [_vi("y", [None])])
    findings, info = check_ops(m, "model.onnx")
    errors = [str(f) for f in findings if f.level == "error"]
    assert len(errors) == 1 and "unsupported op Unique" in errors[0] and "dedupe_tokens" in errors[0], errors
    assert info["op_types"] == ["Relu", "Unique"]


def test_readiness_flags_custom_domain_opset_and_quantized_matmul():
    m = _model([helper.make_node("DynamicQuantizeLinear", ["x"], ["q", "s", "z"], name="dq"),
                helper.make_node("MatMulInteger", ["q", "w"], ["y32"], name="mmi"),
                helper.make_node("FusedGelu", ["x"], ["g"], name="fg", domain="com.example")],
               [_vi("x", [2, 2]), _vi("w", [2, 2], TensorProto.UINT8)], [_vi("y32", [2, 2], TensorProto.INT32),
                                                                         _vi("g", [2, 2])],
               opset=25, domains=("com.example",))
    text = "\n".join(str(f) for f in check_ops(m, "model.onnx")[0] if f.level == "error")
    assert "opset 25 is outside" in text
    assert "MatMulInteger" in text and "DynamicQuantizeLinear" in text  # what an ORT int8 artifact contains
    assert "com.example::FusedGelu" in text and "plugin" in text


def test_readiness_checks_constant_inputs():
    k = helper.make_tensor("k", TensorProto.INT64, [1], [3])
    m = _model([helper.make_node("TopK", ["x", "k"], ["v", "i"], name="topk_const"),
                helper.make_node("TopK", ["x", "kdyn"], ["v2", "i2"], name="topk_dynamic"),
                helper.make_node("ReduceMean", ["x", "axes"], ["mean"], name="mean_dynamic_axes")],
               [_vi("x", [1, 8]), _vi("kdyn", [1], TensorProto.INT64), _vi("axes", [1], TensorProto.INT64)],
               [_vi("v", None), _vi("i", None, TensorProto.INT64), _vi("v2", None), _vi("i2", None, TensorProto.INT64),
                _vi("mean", None)], initializers=[k])
    errors = [str(f) for f in check_ops(m, "g.onnx")[0] if f.level == "error"]
    assert any("topk_dynamic" in e and "K input" in e for e in errors), errors
    assert any("mean_dynamic_axes" in e and "axes" in e for e in errors), errors
    assert not any("topk_const" in e for e in errors)


def test_readiness_tree_step_shapes_must_be_static_but_for_past():
    # y = concat(past, x) depends on P: with S bound it is still dynamic -> error; z = x * 2 is fine.
    two = helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])
    m = _model([helper.make_node("Concat", ["past", "x"], ["y"], axis=1),
                helper.make_node("Mul", ["x", "two"], ["z"])],
               [_vi("x", [1, "S"]), _vi("past", [1, "P"]), _vi("extra", ["L"])], [_vi("y", [1, "S"]), _vi("z", [1, "S"])],
               initializers=[two])
    errors = [str(f) for f in check_fixed_shapes(m, "model.onnx", {"S": 16}, ("P",))]
    assert any("output 'y'" in e for e in errors), errors
    assert not any("output 'z'" in e for e in errors), errors
    assert any("input 'extra'" in e for e in errors), errors


def test_readiness_external_data_must_stay_inside_the_artifact(tiny_trt_artifact, tmp_path):
    model = onnx.load(str(tiny_trt_artifact / "model.onnx"), load_external_data=False)
    assert not check_external_data(model, "model.onnx", tiny_trt_artifact)
    ext = next(t for t in model.graph.initializer if t.data_location == TensorProto.EXTERNAL)
    loc = next(e for e in ext.external_data if e.key == "location")
    loc.value = str(tiny_trt_artifact / "weights.bin")  # absolute: depends on where the artifact lives
    assert "absolute" in str(check_external_data(model, "model.onnx", tiny_trt_artifact)[0])
    loc.value = "../weights.bin"
    assert "outside" in str(check_external_data(model, "model.onnx", tiny_trt_artifact)[0])


# ---------------------------------------------------------------- profiles and shapes (pure)


def test_profiles_follow_the_manifest(tiny_trt_artifact):
    m = _manifest(tiny_trt_artifact)
    t, ctx = m["tree"]["size"], m["model"]["max_context"]
    prefill, tree_step, decode = model_profiles(m)
    # the prefill profile admits a past (a later turn's prompt after an existing cache)
    # ... and is tuned (opt) for a real prefill: no past (P = 0)
    assert prefill.dims == {"S": (1, ctx // 2, ctx), "P": (0, 0, ctx - 1)}
    assert tree_step.dims["S"] == (t, t, t) and tree_step.dims["P"][::2] == (0, ctx - t)
    assert decode.dims["S"] == (1, 1, 1)
    profiles = [prefill, tree_step, decode]
    assert select_profile(profiles, {"S": 7, "P": 0}) == 0  # the prompt
    assert select_profile(profiles, {"S": 7, "P": 50}) == 0  # a later turn's prompt
    assert select_profile(profiles, {"S": t, "P": 0}) == 1  # tree step right after a 0-token past
    assert select_profile(profiles, {"S": t, "P": 100}) == 1
    assert select_profile(profiles, {"S": 1, "P": 100}) == 2
    with pytest.raises(ShapeOutOfProfileError, match="tree_step"):
        select_profile(profiles, {"S": t, "P": ctx})  # past too long: the message lists the profiles
    shapes = profile_shapes(m["graphs"]["model"]["inputs"], tree_step)
    h, d = m["model"]["num_kv_heads"], m["model"]["head_dim"]
    assert shapes["past_key_values.1.value"] == ((1, 0, h, d), (1, (ctx - t) // 2, h, d), (1, ctx - t, h, d))
    assert shapes["new_token_mask"] == ((t, t),) * 3


def _emulate(copies, dst: np.ndarray, src: np.ndarray) -> None:
    """cudaMemcpy2D on byte arrays."""
    for c in copies:
        for row in range(c.height):
            s0, d0 = c.src_offset + row * c.spitch, c.dst_offset + row * c.dpitch
            dst[d0:d0 + c.width] = src[s0:s0 + c.width].copy()


@pytest.mark.parametrize("past_len, accepted", [(0, [0, 1, 2, 3, 4]), (5, [0]), (5, [0, 1, 5, 6, 9]), (9, [0, 2, 7])])
def test_device_compaction_equals_write_accepted(past_len, accepted):
    layers, h, d, cap, t = 3, 2, 4, 24, 12
    new = KVLayout(layers, h, d, 4, t)
    cache = KVLayout(layers, h, d, 4, cap)
    assert cache.plane_bytes % ALIGN == 0 and cache.plane_offset(1, "value") == 3 * cache.plane_bytes
    rng = np.random.default_rng(past_len)
    # Reference: per-plane numpy buffers [1, slots, H, D]; the device version packs planes at their offsets.
    ref_cache = [rng.standard_normal((1, cap, h, d)).astype(np.float32) for _ in range(new.planes)]
    ref_new = [rng.standard_normal((1, t, h, d)).astype(np.float32) for _ in range(new.planes)]

    def pack(planes, layout):
        buf = np.zeros(layout.total_bytes, np.uint8)
        for i, p in enumerate(planes):
            raw = p.view(np.uint8).reshape(-1)
            buf[i * layout.plane_bytes:i * layout.plane_bytes + raw.size] = raw
        return buf

    dev_cache, dev_new = pack(ref_cache, cache), pack(ref_new, new)
    acc = np.array(accepted)
    copies = compaction_copies(new, cache, past_len, acc)
    assert len(copies) == len(compaction_runs(acc))
    _emulate(copies, dev_cache, dev_new)
    for c, n in zip(ref_cache, ref_new):
        write_accepted(c, n, past_len, acc)
    assert np.array_equal(dev_cache, pack(ref_cache, cache))


def test_in_place_compaction_after_prefill_never_reads_overwritten_rows():
    layout = KVLayout(2, 1, 2, 4, 16)
    buf = np.arange(layout.total_bytes, dtype=np.int64).astype(np.uint8)
    expect = buf.copy()
    acc = np.array([0, 2, 3, 4, 7])  # the in-place source rows overlap their destinations
    rb = layout.row_bytes
    for plane in range(layout.planes):
        base = plane * layout.plane_bytes
        rows = [expect[base + a * rb: base + (a + 1) * rb].copy() for a in acc]
        for i, r in enumerate(rows):
            expect[base + i * rb: base + (i + 1) * rb] = r
    copies = compaction_copies(layout, layout, 0, acc, in_place=True)
    assert all(c.width == rb for c in copies) and len(copies) == 4  # row 0 already in place
    _emulate(copies, buf, buf)
    assert np.array_equal(buf, expect)
    assert compaction_copies(layout, layout, 0, np.arange(5), in_place=True) == []  # a prefill: nothing moves
    with pytest.raises(ContextOverflowError):
        compaction_copies(layout, layout, 14, np.array([0, 1, 2]))
    assert compaction_runs(np.array([0, 1, 5, 6, 9])) == [(0, 0, 2), (5, 2, 2), (9, 4, 1)]


def test_device_packing_equals_the_onnxruntime_packed_past():
    """pack_copies on byte buffers gives ort_rows.pack_past's [B, P, H_kv, D] rows, plane by plane (the slots past
    a row's length are left as they were: here zeros); after the rows grow, copying only the new slots gives the
    same bytes as packing afresh."""
    from medusa_runtime.engines.kvcache import KVCache
    from medusa_runtime.engines.ort_rows import pack_past

    layers, h, d, cap, slots = 2, 2, 4, 20, 16
    rng = np.random.default_rng(7)
    caches = []
    for n in (5, 0, 13):
        c = KVCache(layers, h, d, cap, np.float32)
        for buf in (*c.keys, *c.values):
            buf[...] = rng.standard_normal(buf.shape)
        c.length = n
        caches.append(c)
    row = KVLayout(layers, h, d, 4, cap)
    packed = packed_layout(row, len(caches), slots)
    assert packed.plane_bytes % ALIGN == 0 and packed.slots == 3 * slots
    dev = np.zeros(packed.total_bytes, np.uint8)

    def device_cache(c):
        src = np.zeros(row.total_bytes, np.uint8)
        for i, plane in enumerate(x for layer in range(layers) for x in (c.keys[layer], c.values[layer])):
            raw = plane.view(np.uint8).reshape(-1)
            src[i * row.plane_bytes:i * row.plane_bytes + raw.size] = raw
        return src

    def check_equals_pack_past():
        ref, ref_lengths = pack_past(caches, layers, slots)
        assert ref_lengths.tolist() == [c.length for c in caches]
        for layer, (k, v) in enumerate(ref):
            for kind, arr in (("key", k), ("value", v)):
                off = packed.plane_offset(layer, kind)
                np.testing.assert_array_equal(dev[off:off + arr.nbytes].view(np.float32).reshape(arr.shape), arr)

    lengths = [c.length for c in caches]
    copies = pack_copies([row] * 3, lengths, packed, slots)
    assert [b for b, _ in copies] == [0, 2]  # a row without a past needs no copy
    for b, c in copies:
        _emulate([c], dev, device_cache(caches[b]))
    check_equals_pack_past()
    for c, grow in zip(caches, (2, 0, 1)):
        c.length += grow
    again = pack_copies([row] * 3, [c.length for c in caches], packed, slots, packed_lengths=lengths)
    assert [(b, c.src_offset // row.row_bytes, c.width // row.row_bytes) for b, c in again] == [(0, 5, 2), (2, 13, 1)]
    for b, c in again:
        _emulate([c], dev, device_cache(caches[b]))
    check_equals_pack_past()
    with pytest.raises(ValueError, match="does not fit"):
        pack_copies([row], [slots + 1], packed, slots)
    with pytest.raises(ValueError, match="packed slots"):
        pack_copies([row], [3], packed, slots, packed_lengths=[4])


# ---------------------------------------------------------------- engine without TensorRT


def _parse_profiles(argv: list[str]) -> list[dict[str, list[str]]]:
    """trtexec argv -> per profile {flag: ["name:AxB", ...]} (flags after each --profile=N)."""
    profiles: list[dict] = []
    for a in argv:
        if a.startswith("--profile="):
            assert int(a.split("=")[1]) == len(profiles)
            profiles.append({})
        elif a.split("=")[0] in ("--minShapes", "--optShapes", "--maxShapes"):
            flag, spec = a.split("=", 1)
            profiles[-1][flag] = {s.rsplit(":", 1)[0]: tuple(int(x) for x in s.rsplit(":", 1)[1].split("x"))
                                  for s in spec.split(",")}
    return profiles


def _expected_shapes(m: dict, graph: str) -> list[dict]:
    """The shapes each profile must give, computed here from the manifest's ranges (not via trt_plan)."""
    inputs = m["graphs"][graph]["inputs"]
    if graph == "heads":
        ranges = [{"R": (1, 1, m["tree"]["size"])}]
    else:
        # opt is the middle of each range, but the prefill's past: a real prefill has none (P = 0)
        ranges = [{s: (lo, lo if (n, s) == ("prefill", "P") else lo + (hi - lo) // 2, hi)
                   for s, (lo, hi) in m["graphs"]["model"]["profiles"][n].items()}
                  for n in ("prefill", "tree_step", "decode")]
    out = []
    for r in ranges:
        out.append({flag: {t["name"]: tuple(d if isinstance(d, int) else r[d][k] for d in t["shape"]) for t in inputs}
                    for k, flag in enumerate(("--minShapes", "--optShapes", "--maxShapes"))})
    return out


def _node_types(model: onnx.ModelProto) -> dict[str, int]:
    """Each node's first output's element type, by ONNX's own type inference (not the typed pass' bookkeeping)."""
    g = onnx.shape_inference.infer_shapes(model).graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*g.input, *g.output, *g.value_info]}
    return {n.name: types.get(n.output[0]) for n in model.graph.node}


def test_typed_graph_keeps_every_rmsnorm_chain_softmax_and_the_output_tail_in_fp32(art):
    """Issue 39: the fp16 typed graph of an fp32 artifact computes every node of every RMSNorm chain (found by
    structure in the artifact's graph: squaring, ReduceMean, the epsilon Add, Sqrt, Reciprocal, the normalising and
    the weight Mul), every attention softmax and the log-softmax / entropy / top-k tail in float32, and every
    weight MatMul in float16; its inputs and outputs keep the artifact's types."""
    from medusa_export.trt.typed import write_typed_graphs

    src = onnx.load(str(art / "model.onnx"), load_external_data=False)
    write_typed_graphs(art, {"model": "model.onnx", "heads": "heads.onnx"}, "fp16")
    typed = onnx.load(str(art / "engines/model.fp16.onnx"), load_external_data=False)
    types = _node_types(typed)
    chains = rmsnorm_chains(src)
    layers = load_artifact(art).model.num_layers
    assert len(chains) == 2 * layers + 1
    for chain in chains:
        assert [n.op_type for n in chain] == ["Pow", "ReduceMean", "Add", "Sqrt", "Reciprocal", "Mul", "Mul"]
        assert {types[n.name] for n in chain} == {onnx.TensorProto.FLOAT}, [n.name for n in chain]
    for op in ("Softmax", "LogSoftmax", "TopK", "ReduceSum", "Exp"):
        assert {types[n.name] for n in typed.graph.node if n.op_type == op} == {onnx.TensorProto.FLOAT}, op
    weight_products = [n.name for n in typed.graph.node if n.op_type in ("MatMul", "Gemm")
                       and any(i.endswith(".weight.f16") for i in n.input)]
    assert len(weight_products) == 7 * layers + 1  # q, k, v, o, gate, up, down per layer, and the lm_head
    assert {types[n] for n in weight_products} == {onnx.TensorProto.FLOAT16}
    io = lambda m: [(v.name, v.type.tensor_type.elem_type) for v in [*m.graph.input, *m.graph.output]]  # noqa: E731
    assert io(typed) == io(src)


@pytest.mark.skipif(HAVE_TRT, reason="TensorRT is installed: `engine` builds instead of stopping")
def test_engine_without_tensorrt_writes_matching_commands(art, capsys):
    assert main(["engine", "--artifact", str(art), "--precision", "fp16"]) == EXIT_NO_TENSORRT
    err = capsys.readouterr().err
    assert "TensorRT is not available here" in err and "bash engines/build_engine.sh fp16" in err
    m = load_artifact(art).manifest.to_json()  # checksums still hold after the manifest update
    rec = m["engines"]["fp16"]
    assert rec["status"].startswith("pending") and rec["model_plan"] == "engines/model.fp16.plan"
    assert {"engines/trtexec.fp16.txt", "engines/build_engine.sh"} <= set(m["checksums"])
    lines = [ln for ln in (art / "engines/trtexec.fp16.txt").read_text().splitlines() if not ln.startswith("#")]
    model_argv, heads_argv = (shlex.split(ln) for ln in lines)
    # fp16 of an fp32 artifact: the typed graphs written beside the plans (checksummed), validated on ONNX Runtime
    assert model_argv[:2] == ["trtexec", "--onnx=engines/model.fp16.onnx"] and heads_argv[1] == "--onnx=engines/heads.fp16.onnx"
    assert {"engines/model.fp16.onnx", "engines/heads.fp16.onnx", "engines/weights.fp16.bin"} <= set(m["checksums"])
    assert rec["computes_in"] == "float16" and rec["typed_graph"]["validation"]["passed"]
    assert _parse_profiles(model_argv) == _expected_shapes(m, "model")
    assert _parse_profiles(heads_argv) == _expected_shapes(m, "heads")
    for flag in ("--stronglyTyped", "--timingCacheFile=engines/timing.cache", "--profilingVerbosity=detailed",
                 "--saveEngine=engines/model.fp16.plan"):
        assert flag in model_argv, flag
    assert not {a.split("=")[0] for a in model_argv} & {"--fp16", "--int8", "--calib", "--layerPrecisions",
                                                        "--precisionConstraints"}  # gone in trtexec 11
    # The script carries the same commands for every precision.
    script = (art / "engines/build_engine.sh").read_text()
    block = script.split("    run model fp16 \\\n")[1].split("\n    run heads")[0]
    assert shlex.split(block.replace("\\\n", " ")) == model_argv[1:]
    assert "--int8" not in script and "--fp16" not in script


def test_trtexec_lines_build_from_the_graph_that_carries_the_precision(tiny_trt_artifact):
    """An fp16 artifact's fp16 plans build from its own graph; an fp32 artifact's from the typed graph beside the plans;
    fp32 plans clear TF32 (--noTF32); no line carries a precision flag; int8 builds from its Q/DQ typed graph (implicit
    calibration is gone in TensorRT 11)."""
    from medusa_runtime.errors import MedusaError

    m = _manifest(tiny_trt_artifact)
    m16 = {**m, "precision": {**m["precision"], "kv_dtype": "float16"}}
    args = trtexec_args(m16, "model", "fp16")
    assert args[0] == "--onnx=model.onnx" and "--stronglyTyped" in args and "--fp16" not in args
    assert trtexec_args(m, "model", "fp16")[0] == "--onnx=engines/model.fp16.onnx"
    assert trtexec_args(m, "heads", "bf16")[0] == "--onnx=engines/heads.bf16.onnx"
    fp32 = trtexec_args(m, "model", "fp32", workspace_mib=2048)
    assert fp32[0] == "--onnx=model.onnx" and {"--noTF32", "--stronglyTyped", "--memPoolSize=workspace:2048M"} <= set(fp32)
    assert "--noTF32" not in args
    assert trtexec_args(m, "model", "int8")[0] == "--onnx=engines/model.int8.onnx"  # explicit Q/DQ: a typed graph
    with pytest.raises(MedusaError, match="built from a float32 artifact, this one is float16"):
        trtexec_args(m16, "model", "bf16")


def test_build_script_runs_with_a_stub_trtexec(art, tmp_path):
    main(["engine", "--artifact", str(art)])
    stub = tmp_path / "trtexec"
    stub.write_text("#!/usr/bin/env bash\necho '[TensorRT v101500]'\n"
                    "for a in \"$@\"; do case \"$a\" in --saveEngine=*) echo plan > \"${a#--saveEngine=}\";; esac; done\n")
    stub.chmod(0o755)
    run = lambda *a, exe=str(stub): subprocess.run(["bash", str(art / "engines/build_engine.sh"), *a],  # noqa: E731
                                                   env={"PATH": "/usr/bin:/bin", "TRTEXEC": exe},
                                                   capture_output=True, text=True)
    r = run("fp16")
    assert r.returncode == 0, r.stderr
    assert (art / "engines/model.fp16.plan").is_file() and (art / "engines/heads.fp16.plan").is_file()
    record = json.loads((art / "engines/build_record.fp16.json").read_text())
    assert record["tensorrt"] == "10.15.0" and record["plans"] == ["engines/model.fp16.plan", "engines/heads.fp16.plan"]
    r = run("bf16")  # its typed graph is written by `medusa-export engine --precision bf16`, not run yet
    assert r.returncode == 3 and "medusa-export engine --artifact . --precision bf16" in r.stderr
    r = run("fp16", exe="/nonexistent/trtexec")
    assert r.returncode == 3 and "not found" in r.stderr
    assert run("fp4").returncode == 2  # not a precision this artifact builds: the usage line


def test_build_engine_flag_runs_the_engine_step_without_tensorrt(art, monkeypatch):
    """``build --engine trt`` where TensorRT does not import (made so here, whatever this machine has): the trtexec
    commands are written and the step exits EXIT_NO_TENSORRT; ``--engine none`` does nothing. With TensorRT (the
    emulated one) the same flag builds the plans: tests/test_trt_emulated.py::test_build_engine_flag_builds_plans."""
    _no_gpu_stack(monkeypatch)
    args = Namespace(engine="trt", engine_precision="fp32", engine_prompts=None, workspace_mib=None,
                     engine_device_id=0)
    assert after_build(args, art) == EXIT_NO_TENSORRT
    assert (art / "engines/trtexec.fp32.txt").is_file() and not list(art.glob("engines/*.plan"))
    before = sorted(p.name for p in art.rglob("*"))
    assert after_build(Namespace(engine="none"), art) == 0
    assert sorted(p.name for p in art.rglob("*")) == before


def test_engine_refuses_a_graph_that_is_not_ready(art, capsys):
    m = onnx.load(str(art / "heads.onnx"), load_external_data=False)
    m.graph.node.append(helper.make_node("Unique", [m.graph.output[0].name], ["u"], name="bad_unique"))
    onnx.save(m, str(art / "heads.onnx"))
    update_manifest(art, {}, ["heads.onnx"])
    assert main(["engine", "--artifact", str(art)]) == 2
    assert "unsupported op Unique" in capsys.readouterr().err
    assert _manifest(art)["engines"]["fp16"]["status"].startswith("blocked")


def test_update_manifest_merges_and_rechecksums(art):
    (art / "engines").mkdir()
    (art / "engines/a.txt").write_text("x")
    update_manifest(art, {"engines": {"fp16": {"status": "a"}}}, ["engines/a.txt"])
    update_manifest(art, {"engines": {"int8": {"status": "b"}}})
    m = load_artifact(art).manifest.to_json()
    assert m["engines"] == {"fp16": {"status": "a"}, "int8": {"status": "b"}}
    assert m["checksums"]["engines/a.txt"]["bytes"] == 1
    assert not list(art.glob(".manifest.json.tmp*"))


def _no_gpu_stack(monkeypatch):
    """This process as on a machine without TensorRT, cuda-python or ONNX Runtime's CUDA provider (whatever this
    one has): those imports fail and ONNX Runtime offers the CPU provider only."""
    import onnxruntime

    for name in ("tensorrt", "cuda", "cuda.cudart", "cuda.bindings", "cuda.bindings.runtime"):
        monkeypatch.setitem(sys.modules, name, None)  # `import name` raises ImportError
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: ["CPUExecutionProvider"])


def test_doctor_without_tensorrt_or_cuda(capsys, monkeypatch):
    """A CPU-only machine (made so here, whatever this one has): TensorRT is unavailable, and the runtime's two GPU
    backends are listed as unavailable with the reason, not among the runtimes that run (issue 40: it listed the
    CUDA runtime among them right after saying CUDA was missing)."""
    _no_gpu_stack(monkeypatch)
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "--  CUDA via onnxruntime  CPU build of onnxruntime (onnxruntime-gpu brings the CUDA provider)" in out
    assert "tensorrt:   unavailable" in out and "devices:    CPU only" not in out and "devices:    CPU" in out
    runtime = next(line for line in out if line.startswith("runtime:"))
    assert runtime.startswith("runtime:    onnxruntime (onnxruntime ") and runtime.endswith(", batched)")
    assert "cuda" not in runtime and "tensorrt" not in runtime
    assert "            onnxruntime-cuda: unavailable here (no CUDA: this onnxruntime has no CUDA execution provider)" \
        in out
    assert "            tensorrt: unavailable here (tensorrt not importable)" in out
    assert main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["backends"]["tensorrt"] == [] and report["devices"] == ["CPU"]
    assert {n: r["here"] == "available" for n, r in report["runtime"].items()} == {
        "onnxruntime": True, "onnxruntime-cuda": False, "tensorrt": False}


@pytest.mark.skipif(not HAVE_TRT or bool(getattr(sys.modules.get("tensorrt"), "EMULATED", False)),
                    reason="needs NVIDIA's TensorRT (the emulated one: tests/test_trt_emulated.py; none: the test above)")
def test_doctor_with_tensorrt():
    """Where NVIDIA's TensorRT imports: its precisions are offered exactly when cuda-python finds a device."""
    from medusa_export.cli.doctor import run_doctor

    report = run_doctor().to_json()
    gpus = len(report["devices"]) - 1
    assert "tensorrt (emulated)" not in report["backends"]
    assert report["backends"]["tensorrt"] == (["fp16", "bf16", "fp32", "int4", "int8", "fp8"] if gpus else [])
    assert report["runtime"]["tensorrt"]["here"] == ("available" if gpus else "unavailable here (no CUDA device)")


def test_engine_config_rejects_bad_options():
    from medusa_runtime.errors import MedusaError

    with pytest.raises(MedusaError, match="fp16, bf16, fp32, int4, int8, fp8"):
        EngineConfig(precision="fp4")
    with pytest.raises(MedusaError, match="workspace"):
        EngineConfig(workspace_mib=0)


# ---------------------------------------------------------------- TensorRT runtime


@pytest.mark.skipif(HAVE_TRT, reason="TensorRT is installed")
def test_trt_backend_says_what_is_missing(tiny_trt_artifact):
    from medusa_runtime.engines.trt import TrtEngine

    with pytest.raises(BackendUnavailableError, match="TensorRT"):
        TrtEngine(load_artifact(tiny_trt_artifact))


def test_readiness_line_says_not_applicable_for_ort_only_flavours():
    from medusa_export.cli.trt import readiness_line

    refused = {"tensorrt": "10.15", "passed": False, "errors": ["flavour is 'ort-fused'"], "warnings": [], "graphs": {}}
    line = readiness_line(refused, "ort-fused")
    assert "not applicable" in line and "ort-fused" in line and "--graph portable" in line
    # a portable artifact that fails is a real failure
    assert "FAILED (1 error(s)" in readiness_line(refused, "portable")
    ok = {"tensorrt": "10.15", "passed": True, "errors": [], "warnings": [],
          "graphs": {"model": {"op_types": ["MatMul", "Add"]}}}
    assert "PASSED (2 op types" in readiness_line(ok, "portable")
    assert readiness_line(None, "portable") is None
