"""The TensorRT backend and engine build run end to end against the EMULATED TensorRT and CUDA runtime.

``tests/emulated`` holds a test double of TensorRT's Python API and of cuda-python's runtime module
(host memory, the ONNX run by ONNX Runtime on the CPU; see its docstrings). It is put first on
``sys.path`` for this module only (and removed afterwards, so the other test files see no TensorRT).
What passes here is our use of the API as the emulation enforces it, NOT TensorRT: the emulated
engine computes what ONNX Runtime does, so "token-exact" means our buffers, bindings, profiles and
KV compaction are right, not that TensorRT's kernels match.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
import types
from pathlib import Path

import numpy as np
import pytest

from conftest import MT_BENCH
from medusa_export.cli.main import main
from medusa_runtime.contract.artifact import load_artifact
from medusa_runtime.decode.loop import generate
from medusa_runtime.trees.treespec import tree_from_spec

EMULATED = Path(__file__).parent / "emulated"
_EMULATED_MODULES = ("tensorrt", "cuda")


def _drop_emulated_modules() -> None:
    for name in [m for m in sys.modules if m.split(".")[0] in _EMULATED_MODULES]:
        del sys.modules[name]


@pytest.fixture(scope="module")
def emulated():
    """(tensorrt, cuda.bindings.runtime): the emulated modules, importable for this module's tests only."""
    sys.path.insert(0, str(EMULATED))
    _drop_emulated_modules()
    trt = importlib.import_module("tensorrt")
    cudart = importlib.import_module("cuda.bindings.runtime")
    assert trt.EMULATED and cudart.EMULATED
    try:
        yield trt, cudart
    finally:
        sys.path.remove(str(EMULATED))
        _drop_emulated_modules()


@pytest.fixture(scope="module")
def engine_art(emulated, tiny_trt_artifact, tmp_path_factory):
    """A copy of the tiny artifact (16-node tree) with fp32 plans built by the emulated builder."""
    art = Path(shutil.copytree(tiny_trt_artifact, tmp_path_factory.mktemp("emulated") / "art"))
    assert main(["engine", "--artifact", str(art), "--precision", "fp32"]) == 0
    return art


def test_build_engine_flag_builds_plans(emulated, tiny_trt_artifact, tmp_path):
    """``build --engine trt`` where TensorRT imports (the emulated one): the step builds the plans and exits 0 (the
    machine without TensorRT: tests/test_trt.py::test_build_engine_flag_runs_the_engine_step_without_tensorrt)."""
    from argparse import Namespace

    from medusa_export.cli.trt import after_build

    art = Path(shutil.copytree(tiny_trt_artifact, tmp_path / "art"))
    args = Namespace(engine="trt", engine_precision="fp32", engine_prompts=None, workspace_mib=None,
                     engine_device_id=0)
    assert after_build(args, art) == 0
    assert (art / "engines/model.fp32.plan").read_bytes().startswith(emulated[0].PLAN_MAGIC)
    assert _manifest_engines(art)["fp32"]["status"] == "built"


def _manifest_engines(art) -> dict:
    return json.loads((Path(art) / "manifest.json").read_text())["engines"]


def test_doctor_names_the_emulated_tensorrt(emulated):
    """doctor on the emulated TensorRT and CUDA runtime: offered, but always as "tensorrt (emulated)" (never
    "tensorrt"), with the emulation named in its checks and its runtime line."""
    from medusa_export.cli.doctor import run_doctor

    report = run_doctor()
    assert "tensorrt" not in report.backends and report.backends["tensorrt (emulated)"] == ["fp16", "bf16", "fp32", "int4", "int8", "fp8"]
    checks = {c.name: c.detail for c in report.checks}
    assert checks["tensorrt"].startswith(f"{emulated[0].__version__} EMULATED (tests/emulated")
    assert "EMULATED" in checks["cuda-python"]
    assert report.runtime["tensorrt"]["label"] == "tensorrt (emulated)"
    assert report.runtime["tensorrt"]["here"] == "available"
    text = report.render()
    assert "tensorrt (emulated): fp16, bf16, fp32, int4, int8, fp8" in text
    assert f"tensorrt (emulated) (tensorrt {emulated[0].__version__} EMULATED, batched, GPU, fixed tree)" in text


_START: dict[int, int] = {}


def live_bytes_at_start(cudart) -> int:
    """The emulated device bytes live when the running test's :func:`live_bytes` fixture started."""
    return _START[id(cudart)]


@pytest.fixture
def live_bytes(emulated):
    """The emulated device's live bytes, asserted back to their value at the start of the test."""
    cudart = emulated[1]
    before = cudart.emulator_live_device_bytes(), cudart.emulator_live_host_bytes()
    _START[id(cudart)] = before[0]
    yield cudart
    assert (cudart.emulator_live_device_bytes(), cudart.emulator_live_host_bytes()) == before


def _engines(art, precision="fp32", **options):
    from medusa_runtime.engines import create_engine

    a = load_artifact(art)
    return a, create_engine(a, "onnxruntime"), create_engine(a, "tensorrt", precision=precision, **options)


PROMPTS = ([5, 6, 7], list(range(10, 40)), [3] * 61)


# ---------------------------------------------------------------- the emulation's own rules


def test_emulated_cuda_rejects_what_cuda_would(emulated):
    """The emulated runtime's strict rules: no device in this thread, a copy past an allocation, freed memory."""
    _, cudart = emulated
    err = [None]

    def no_device():
        err[0] = cudart.cudaMalloc(16)[0]

    t = threading.Thread(target=no_device)
    t.start()
    t.join()
    assert err[0] == cudart.cudaError_t.cudaErrorInvalidDevice  # the thread never called cudaSetDevice
    assert cudart.cudaSetDevice(0) == (cudart.cudaError_t.cudaSuccess,)
    assert cudart.cudaSetDevice(cudart.DEVICE_COUNT)[0] == cudart.cudaError_t.cudaErrorInvalidDevice
    err, ptr = cudart.cudaMalloc(64)
    assert err == 0 and ptr % 256 == 0
    host = np.arange(16, dtype=np.float32)
    H2D, D2H = cudart.cudaMemcpyKind.cudaMemcpyHostToDevice, cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
    assert cudart.cudaMemcpy(ptr, host.ctypes.data, 64, H2D)[0] == 0
    back = np.zeros(16, np.float32)
    assert cudart.cudaMemcpy(back.ctypes.data, ptr, 64, D2H)[0] == 0 and back.tolist() == host.tolist()
    assert cudart.cudaMemcpy(ptr + 8, host.ctypes.data, 64, H2D)[0] == cudart.cudaError_t.cudaErrorInvalidValue
    assert "past the end" in cudart.emulator_last_error()
    assert cudart.cudaMemcpy(ptr, host.ctypes.data, 64, D2H)[0] == cudart.cudaError_t.cudaErrorInvalidMemcpyDirection
    _, stream = cudart.cudaStreamCreate()
    assert cudart.cudaMemsetAsync(ptr + 16, 0, 32, stream)[0] == 0
    assert cudart.cudaMemcpy(back.ctypes.data, ptr, 64, D2H)[0] == 0
    assert back.tolist() == [0, 1, 2, 3, 0, 0, 0, 0, 0, 0, 0, 0, 12, 13, 14, 15]
    assert cudart.cudaMemsetAsync(ptr + 32, 0, 64, stream)[0] == cudart.cudaError_t.cudaErrorInvalidValue  # past the end
    assert cudart.cudaMemsetAsync(host.ctypes.data, 0, 4, stream)[0] != 0  # host memory
    assert cudart.cudaStreamDestroy(stream)[0] == 0
    assert cudart.cudaFree(ptr)[0] == 0
    assert cudart.cudaMemcpy(back.ctypes.data, ptr, 4, D2H)[0] == cudart.cudaError_t.cudaErrorIllegalAddress
    assert "freed" in cudart.emulator_last_error()
    assert cudart.cudaFree(ptr)[0] == cudart.cudaError_t.cudaErrorInvalidValue  # a double free


def test_emulated_execution_needs_every_address_and_an_in_profile_shape(engine_art, emulated):
    """enqueueV3 without an address for an output is refused, as is a shape outside the selected profile."""
    trt, cudart = emulated
    cudart.cudaSetDevice(0)
    engine = trt.Runtime(trt.Logger()).deserialize_cuda_engine((engine_art / "engines/heads.fp32.plan").read_bytes())
    ctx = engine.create_execution_context()
    d = load_artifact(engine_art).model.hidden_size
    tree_size = load_artifact(engine_art).tree.size
    assert not ctx.set_input_shape("hidden_states", (tree_size + 1, d))  # R is in [1, T]
    assert "outside profile 0" in trt.emulator_last_error()
    assert ctx.set_input_shape("hidden_states", (1, d))
    ptrs = [cudart.cudaMalloc(4096)[1] for _ in range(2)]
    try:
        ctx.set_tensor_address("hidden_states", ptrs[0])
        ctx.set_tensor_address("medusa_topk_ids", ptrs[1])
        assert not ctx.execute_async_v3(0)
        assert "without an address: ['medusa_topk_logprobs']" in trt.emulator_last_error()
    finally:
        for p in ptrs:
            cudart.cudaFree(p)


# ---------------------------------------------------------------- engine build and the backend


def test_emulated_engine_build_records_the_plan_key(engine_art, emulated):
    trt, cudart = emulated
    manifest = load_artifact(engine_art).manifest
    rec = manifest.engines["fp32"]
    assert rec["status"] == "built" and rec["tensorrt"] == trt.__version__
    assert rec["sources"] == {f: manifest.checksums[f].sha256 for f in ("model.onnx", "heads.onnx", "weights.bin")}
    assert rec["gpu"] == cudart.NAME == "Emulated GPU (host memory)" and rec["compute_capability"] == "9.0"
    assert [p["name"] for p in rec["profiles"]["model"]] == ["prefill", "tree_step", "decode"]
    for plan in (rec["model_plan"], rec["heads_plan"]):
        assert (engine_art / plan).read_bytes().startswith(trt.PLAN_MAGIC)
    assert not list((engine_art / "engines").glob(".*.tmp-*"))  # nothing half-written


def test_rebuilding_over_engine_plans_names_each_one_and_force_says_what_it_replaced(engine_art, emulated, tmp_path,
                                                                                        capsys):
    """``medusa-export engine`` lists its plans among the manifest's checksums, so a rebuild's refusal counted them
    as the artifact's own ("17 files, 547.8 MB") and ``--force`` deleted them unnamed. Now every file under
    engines/ is named with its size, plans first, and ``--force`` says before and after what it replaced."""
    from conftest import save_tiny_hf_dir
    from medusa_runtime.contract.artifact import MANIFEST

    art = Path(shutil.copytree(engine_art, tmp_path / "art"))
    checksums = json.loads((art / MANIFEST).read_text())["checksums"]
    engine_files = sorted(rel for rel in checksums if rel.startswith("engines/"))
    plans = [rel for rel in engine_files if rel.endswith(".plan")]
    on_disk = sorted(p.relative_to(art).as_posix() for p in (art / "engines").rglob("*") if p.is_file())
    assert len(plans) == 2 and engine_files == on_disk  # the engine step listed every file it wrote
    save_tiny_hf_dir(tmp_path / "tiny")
    argv = ["build", "--model", str(tmp_path / "tiny"), "--tree", "4", "--max-context", "256", "--no-validate",
            "--out", str(art)]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    named = err[err.index("the TensorRT files of `medusa-export engine`: "):]
    listed = [item.split(" (")[0] for item in named.split(": ", 1)[1].split(", which would all be deleted")[0]
              .split(", ")]
    assert listed[:2] == sorted(plans) and sorted(listed) == engine_files  # plans first, then every other file
    for rel in engine_files:  # each size as printed, read back, within its rounding of the file's
        number, unit = named.split(f"{rel} (", 1)[1].split(")", 1)[0].split()
        scale = {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9}[unit]
        assert abs(float(number) * scale - (art / rel).stat().st_size) <= 0.05 * scale, (rel, number, unit)
    assert "Give --force to replace all of it" in err and sorted(checksums) == sorted(
        json.loads((art / MANIFEST).read_text())["checksums"])  # refused: nothing touched
    assert main(argv + ["--force"]) == 0
    out, err = capsys.readouterr()
    for line in ([l for l in err.splitlines() if l.startswith("[note: --force: ")]
                 + [l for l in out.splitlines() if l.startswith("  replaced (--force): ")]):
        assert all(rel in line for rel in engine_files), line
    assert "all of it is replaced when this build passes" in err and "  replaced (--force): an artifact" in out
    assert not (art / "engines").exists()


def test_emulated_trt_backend_is_token_exact_with_onnxruntime(engine_art, live_bytes):
    """Greedy Medusa with the artifact's tree: the emulated TensorRT backend gives ONNX Runtime's tokens."""
    a, ort, trt_engine = _engines(engine_art)
    try:
        for prompt in PROMPTS:
            ref = generate(ort, prompt, a.tree, max_new_tokens=24, max_context=a.model.max_context)
            got = generate(trt_engine, prompt, a.tree, max_new_tokens=24, max_context=a.model.max_context)
            assert got.tokens == ref.tokens and len(got.tokens) == 24
            assert got.steps == ref.steps
    finally:
        trt_engine.close()


@pytest.mark.parametrize("spec", ["1", "4", "64"])
def test_emulated_trt_backend_runs_other_trees_through_the_prefill_profile(engine_art, live_bytes, spec):
    """Trees other than the plans' (16 nodes) select the prefill profile (S in [1, C]) and stay token-exact."""
    a, ort, trt_engine = _engines(engine_art)
    tree = tree_from_spec(spec, num_heads=a.model.medusa_heads)
    try:
        for prompt in PROMPTS[:2]:
            ref = generate(ort, prompt, tree, max_new_tokens=20, max_context=a.model.max_context)
            got = generate(trt_engine, prompt, tree, max_new_tokens=20, max_context=a.model.max_context)
            assert got.tokens == ref.tokens
    finally:
        trt_engine.close()


def test_emulated_trt_backend_is_token_exact_with_a_dynamic_tree(engine_art, live_bytes):
    """A tree chosen every step (dynamic:16): steps of varying S after a past, through whichever profile covers
    them; the tokens are ONNX Runtime's."""
    a, ort, trt_engine = _engines(engine_art)
    tree = tree_from_spec("dynamic:16", num_heads=a.model.medusa_heads)
    try:
        for prompt in PROMPTS[:2]:
            ref = generate(ort, prompt, tree, max_new_tokens=20, max_context=a.model.max_context)
            got = generate(trt_engine, prompt, tree, max_new_tokens=20, max_context=a.model.max_context)
            assert got.tokens == ref.tokens and len(got.tokens) == 20
            assert got.accept_depths == ref.accept_depths
    finally:
        trt_engine.close()


def _hardlinked_copy(src: Path, dst: Path) -> Path:
    """A copy of an artifact whose large files (weights, graphs) are hard links: the engine build only reads them
    and writes its plans and the manifest as new files (atomically), so the shared original is not touched."""
    def link_or_copy(a, b):
        if os.path.getsize(a) > (1 << 20):
            os.link(a, b)
        else:
            shutil.copy2(a, b)
    return Path(shutil.copytree(src, dst, copy_function=link_or_copy))


@pytest.mark.slow
def test_emulated_trt_backend_is_token_exact_on_the_embedded_model(smollm_artifact, emulated, tmp_path):
    """The embedded SmolLM2-135M artifact (16-node tree): fp32 plans built by the emulated builder give ONNX
    Runtime's greedy Medusa tokens, and closing the engine leaves no device memory."""
    cudart = emulated[1]
    before = cudart.emulator_live_device_bytes()
    art = _hardlinked_copy(smollm_artifact, tmp_path / "smollm")
    assert main(["engine", "--artifact", str(art), "--precision", "fp32"]) == 0
    a, ort, trt_engine = _engines(art)
    try:
        prompt = list(range(100, 140))
        ref = generate(ort, prompt, a.tree, max_new_tokens=16, max_context=a.model.max_context)
        got = generate(trt_engine, prompt, a.tree, max_new_tokens=16, max_context=a.model.max_context)
        assert got.tokens == ref.tokens and len(got.tokens) == 16
    finally:
        trt_engine.close()
    assert cudart.emulator_live_device_bytes() == before


def _family_names() -> list[str]:
    from conftest import FAMILIES

    return sorted(FAMILIES)


@pytest.mark.parametrize("family", _family_names())
def test_emulated_trt_backend_is_token_exact_for_every_family(family, emulated, tmp_path):
    """A tiny model of each family (biases, q/k norms, sliding windows, rope scaling, tied embeddings): its
    emulated fp32 plans give ONNX Runtime's greedy Medusa tokens."""
    from conftest import make_family_medusa, tiny_loaded
    from medusa_export.pipeline import BuildConfig, build_artifact

    _, model = make_family_medusa(family)
    art = build_artifact(tiny_loaded(model, name=family, max_context=128), tree_from_spec("8", num_heads=3),
                         tmp_path / family, BuildConfig(validate=False), progress=False)
    assert main(["engine", "--artifact", str(art), "--precision", "fp32"]) == 0
    a, ort, trt_engine = _engines(art)
    try:
        for prompt in (PROMPTS[0], PROMPTS[1]):
            ref = generate(ort, prompt, a.tree, max_new_tokens=16, max_context=a.model.max_context)
            got = generate(trt_engine, prompt, a.tree, max_new_tokens=16, max_context=a.model.max_context)
            assert got.tokens == ref.tokens and len(got.tokens) == 16
    finally:
        trt_engine.close()


@pytest.fixture(scope="module")
def hydra_art(emulated, tmp_path_factory):
    """A tiny artifact with path-conditioned (hydra) heads (heads_level1..3.onnx, 8-node greedy tree) and its fp32
    plans built by the emulated builder."""
    import dataclasses

    import torch
    from conftest import make_tiny_medusa, tiny_loaded
    from medusa_export.loading.accuracies import load_accuracies_doc
    from medusa_export.model.heads import save_heads
    from medusa_export.model.hydra_heads import HydraHeads
    from medusa_export.model.medusa import MedusaModel
    from medusa_export.pipeline import BuildConfig, build_artifact
    from medusa_export.training.calibrate import save_accuracies
    from medusa_runtime.trees.tree import greedy_tree

    _, model = make_tiny_medusa(vocab=300, hidden=32, layers=2, heads=4, kv_heads=2, medusa_heads=3, seed=2,
                                head_noise=0.05)
    heads = HydraHeads.from_medusa(model.heads, model.backbone.embed_tokens)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # hydra heads that differ from the Medusa ones they were made from
        for prm in heads.parameters():
            prm.add_(torch.randn(prm.shape, generator=g) * 0.05)
    root = tmp_path_factory.mktemp("hydra")
    acc = np.array([[0.5, 0.2, 0.1] + [0.01] * 7, [0.3, 0.1, 0.05] + [0.01] * 7, [0.2, 0.1, 0.05] + [0.01] * 7])
    save_heads(heads, root / "heads")
    save_accuracies(acc, root / "heads", source="test", positions=1, head_type="hydra")
    lm = dataclasses.replace(tiny_loaded(MedusaModel(model.backbone, heads).eval(), max_context=256),
                             head_accuracies=acc, accuracies_doc=load_accuracies_doc(root / "heads"))
    art = build_artifact(lm, greedy_tree(8, acc), root / "art", BuildConfig(validate=False), progress=False)
    assert main(["engine", "--artifact", str(art), "--precision", "fp32"]) == 0
    return art


def test_emulated_trt_backend_runs_hydra_heads_one_plan_per_level(hydra_art, live_bytes):
    """Path-conditioned (hydra) heads: ``engine`` builds one plan per tree level (heads_level{j}), the emulated
    TensorRT backend runs them level by level and gives ONNX Runtime's greedy tokens and accept depths; the
    Medusa heads call is a typed error; closing frees every device byte."""
    from medusa_runtime.errors import MedusaError

    rec = json.loads((hydra_art / "manifest.json").read_text())["engines"]["fp32"]
    levels = [f"heads_level{j}" for j in (1, 2, 3)]
    assert "heads_plan" not in rec and [rec[f"{g}_plan"] for g in levels] == [
        f"engines/{g}.fp32.plan" for g in levels]
    assert all((hydra_art / rec[f"{g}_plan"]).is_file() for g in levels)
    from medusa_export.triton.repository import built_plans

    assert built_plans(load_artifact(hydra_art))[0] == "fp32"  # the Triton repository finds the level plans
    script = (hydra_art / "engines" / "build_engine.sh").read_text()  # trtexec builds one plan per level too
    assert all(f"run {g} fp16" in script and f"--saveEngine=engines/{g}.fp16.plan" in script for g in levels)
    assert "run heads fp16" not in script and '"engines/heads_level3.$PRECISION.plan"]' in script
    assert subprocess.run(["bash", "-n", str(hydra_art / "engines" / "build_engine.sh")]).returncode == 0
    a, ort, trt_engine = _engines(hydra_art)
    try:
        assert trt_engine.capabilities.head_type == "hydra" and not trt_engine.capabilities.heads_logprobs
        for prompt in PROMPTS:
            ref = generate(ort, prompt, a.tree, max_new_tokens=24, max_context=a.model.max_context)
            got = generate(trt_engine, prompt, a.tree, max_new_tokens=24, max_context=a.model.max_context)
            assert got.tokens == ref.tokens and len(got.tokens) == 24
            assert got.accept_depths == ref.accept_depths
        # Every level plan on its own (the tiny random heads' guesses are rarely accepted, so the tokens alone
        # would not show a wrong level 2 or 3): one hidden row for R paths, and one row per path (H = R).
        rng = np.random.default_rng(0)
        for depth in (1, 2, 3):
            paths = rng.integers(0, a.model.vocab_size, size=(5, depth))
            for hidden in (rng.standard_normal((1, a.model.hidden_size)), rng.standard_normal((5, a.model.hidden_size))):
                hidden = hidden.astype(np.float32)
                want_ids, want_lp = ort.heads_level(depth, hidden, paths, 4)
                ids, lp = trt_engine.heads_level(depth, hidden, paths, 4)
                assert ids.shape == (5, want_ids.shape[1]) and np.array_equal(ids, want_ids)
                np.testing.assert_allclose(lp, want_lp, atol=1e-5)
        with pytest.raises(MedusaError, match="hydra"):
            trt_engine.heads(np.zeros((1, a.model.hidden_size), np.float32), 1)
    finally:
        trt_engine.close()


def test_emulated_trt_backend_names_a_missing_level_plan(hydra_art, emulated, tmp_path):
    """A hydra artifact with one level's plan truncated, then missing: typed errors naming the file and how to
    rebuild it."""
    from medusa_runtime.errors import ArtifactError

    art = Path(shutil.copytree(hydra_art, tmp_path / "art"))
    plan = art / "engines" / "heads_level2.fp32.plan"
    plan.write_bytes(plan.read_bytes()[:-1])
    with pytest.raises(ArtifactError, match=r"heads_level2\.fp32\.plan has \d+ bytes.*truncated.*`medusa-export "
                                            r"engine --artifact .* --precision fp32`"):
        _engines(art)
    plan.unlink()
    with pytest.raises(ArtifactError, match=r"heads_level2\.fp32\.plan is missing.*`medusa-export engine "
                                            r"--artifact .* --precision fp32`"):
        _engines(art)


def test_emulated_step_buffers_are_sized_to_the_step_and_host_buffers_pinned(engine_art, live_bytes):
    """After a generation no device memory but the engine's own is live, and that is far below one KV cache of
    max_context (the new-K/V buffer holds a step's rows, not the context's); a prefill copies no token_logprobs
    [S, S] to the host; the host staging buffers are page-locked (cudaMallocHost)."""
    from medusa_runtime.engines.trt_plan import KVLayout

    cudart = live_bytes
    a, _, trt_engine = _engines(engine_art)
    m = a.model
    try:
        host_before = cudart.emulator_live_host_bytes()
        generate(trt_engine, PROMPTS[1], a.tree, max_new_tokens=12, max_context=m.max_context)
        assert trt_engine.live_caches == 0
        full_kv = KVLayout(m.num_layers, m.num_kv_heads, m.head_dim, 4, m.max_context).total_bytes
        scratch = max(g.scratch_bytes() for g in (trt_engine.model, trt_engine.heads_graph))
        own = cudart.emulator_live_device_bytes() - live_bytes_at_start(cudart)
        assert own - scratch < full_kv // 2, (own, scratch, full_kv)
        step_rows = KVLayout(m.num_layers, m.num_kv_heads, m.head_dim, 4, a.tree.size).total_bytes
        assert trt_engine._buf.sizes["model.new_kv"] == step_rows
        assert cudart.emulator_live_host_bytes() > host_before  # pinned staging buffers
        cache = trt_engine.make_cache(64)
        n = len(PROMPTS[1])
        out = trt_engine.step(np.array([PROMPTS[1]]), np.arange(n)[None], np.tril(np.ones((n, n), bool)), 1.0,
                              cache.past())
        assert out.token_logprobs.shape == (n, 0) and out.topk_ids.shape[0] == n
        cache.free()
    finally:
        trt_engine.close()


def test_emulated_prefill_profile_is_tuned_for_a_real_prefill(engine_art, emulated):
    """The model plan's prefill profile has opt P = 0 (a first prompt has no past) for every past K/V input."""
    trt, cudart = emulated
    cudart.cudaSetDevice(0)
    engine = trt.Runtime(trt.Logger()).deserialize_cuda_engine((engine_art / "engines/model.fp32.plan").read_bytes())
    lo, opt, hi = engine.get_tensor_profile_shape("past_key_values.0.key", 0)
    assert (lo[1], opt[1]) == (0, 0) and hi[1] > 0
    assert engine.get_tensor_profile_shape("past_key_values.1.value", 0)[1][1] == 0


def test_emulated_cli_generate_tensorrt_prints_onnxruntime_reply(engine_art, emulated, capsys):
    def reply(backend):
        assert main(["generate", "--artifact", str(engine_art), "--backend", backend, "--tree", "artifact",
                     "--prompt", "Hi there", "--max-new-tokens", "16"]) == 0
        out = capsys.readouterr()
        assert f"({'tensorrt (emulated)' if backend == 'tensorrt' else backend}," in out.err  # never "(tensorrt,"
        return out.out

    assert reply("tensorrt") == reply("onnxruntime")
    args = ["generate", "--artifact", str(engine_art), "--tree", "artifact", "--prompt", "Hi there", "--max-new-tokens",
            "16"]
    assert main([*args, "--backend", "tensorrt", "--engine-precision", "fp32"]) == 0
    fp32 = capsys.readouterr().out
    assert fp32 == reply("onnxruntime")
    assert main([*args, "--backend", "tensorrt", "--engine-precision", "fp16"]) == 2  # no fp16 plans built
    assert "no fp16 TensorRT engine" in capsys.readouterr().err
    assert main([*args, "--backend", "onnxruntime", "--engine-precision", "fp32"]) == 2
    assert "use it with --backend tensorrt" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:  # an unknown precision is refused by the parser, with the choices
        main([*args, "--backend", "tensorrt", "--engine-precision", "fp4"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "argument --engine-precision: invalid choice: 'fp4'" in err and all(p in err for p in ("fp16", "bf16", "fp32", "int4", "int8", "fp8"))


def test_emulated_session_refuses_an_engine_precision_it_cannot_build(engine_art, emulated):
    """The Python API's ``precision`` is checked against the precisions ``medusa-export engine`` builds, and the
    message names those built in the artifact (fp32 only here)."""
    from medusa_runtime.errors import InvalidSettingError
    from medusa_runtime.front.session import MedusaSession

    with pytest.raises(InvalidSettingError, match=r"unknown TensorRT engine precision 'fp4': choose one of fp16, "
                                                  r"bf16, fp32, int4, int8, fp8 \(built in .*: fp32\)"):
        MedusaSession(engine_art, backend="tensorrt", tree="artifact", precision="fp4")


def test_emulated_session_leaves_no_device_memory_after_20_generations(engine_art, live_bytes):
    """KV caches are freed when a generation ends; closing the session frees the rest (chat cache, engine)."""
    from medusa_runtime.front.session import MedusaSession

    cudart = live_bytes
    kv_bytes = None
    with MedusaSession(engine_art, backend="tensorrt", tree="artifact", precision="fp32") as session:
        session.generate(prompt_ids=[4, 6, 7], max_new_tokens=8)  # sizes the engine's step buffers
        warm = cudart.emulator_live_device_bytes()
        for i in range(20):
            session.generate(prompt_ids=[5 + i, 6, 7], max_new_tokens=8)
            assert session.engine.live_caches == 0
            assert cudart.emulator_live_device_bytes() == warm, f"generation {i} left device memory"
        session.chat("Hello")
        assert session.engine.live_caches == 1  # the chat's cache lives until close (or reset)
        kv_bytes = session._chat.cache.layout.total_bytes
        assert cudart.emulator_live_device_bytes() >= warm + kv_bytes
    assert kv_bytes > 0
    # live_bytes asserts the emulated device is back where it started


def serve_ids(session, requests: list[dict], batch_size: int) -> list:
    """Each request's token ids (or the exception that ended it), served by a BatchServer's own thread."""
    from medusa_runtime.front.serving import BatchServer, parse_request

    server = BatchServer(session, batch_size=batch_size)
    done, events = {}, [threading.Event() for _ in requests]

    def finisher(i):
        def on_done(out, exc):
            done[i] = exc if exc is not None else out.token_ids
            events[i].set()
        return on_done

    try:
        for i, r in enumerate(requests):
            server.submit(parse_request(r, session), None, finisher(i))
        assert all(e.wait(60) for e in events)
    finally:
        server.close()
    return [done[i] for i in range(len(requests))]


def test_emulated_batch_server_on_device_1(engine_art, live_bytes):
    """The batch server's own thread sets the engine's device (emulated device 1) before it touches it."""
    from medusa_runtime.front.session import MedusaSession

    cudart = live_bytes
    with MedusaSession(engine_art, backend="tensorrt", tree="artifact", precision="fp32", device_id=1) as session:
        ref = [session.generate(prompt_ids=p, max_new_tokens=10).token_ids for p in PROMPTS]
        assert cudart.emulator_live_device_bytes(1) > 0 == cudart.emulator_live_device_bytes(0)
        assert serve_ids(session, [{"input_ids": p, "max_new_tokens": 10} for p in PROMPTS], batch_size=2) == ref


def test_emulated_plan_key_mismatch_is_a_typed_error(engine_art, emulated, tmp_path):
    """A plan recorded for another TensorRT version or GPU is refused at load, naming what differs and the fix."""
    from medusa_runtime.engines import create_engine
    from medusa_runtime.errors import ArtifactError

    art = Path(shutil.copytree(engine_art, tmp_path / "art"))
    m = json.loads((art / "manifest.json").read_text())
    m["engines"]["fp32"]["tensorrt"] = "10.3.0"
    m["engines"]["fp32"]["gpu"] = "NVIDIA A100-SXM4-80GB"
    (art / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match=r"TensorRT 10\.3\.0.*A100.*medusa-export engine") as e:
        create_engine(load_artifact(art), "tensorrt", precision="fp32")
    assert "plan" in str(e.value) and "compute capability" not in str(e.value)  # only what differs
    (art / "engines/model.fp32.plan").write_bytes((engine_art / "engines/model.fp32.plan").read_bytes()[:40])
    m["engines"]["fp32"].update(load_artifact(engine_art).manifest.engines["fp32"])
    (art / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match="model.fp32.plan"):  # a truncated plan names its file
        create_engine(load_artifact(art), "tensorrt", precision="fp32")


def test_emulated_plan_of_another_artifact_or_missing_is_a_typed_error(engine_art, emulated, tmp_path):
    """Plans whose record names other graph checksums, or a plan file that is gone: typed errors naming the fix."""
    from medusa_runtime.engines import create_engine
    from medusa_runtime.engines.trt_plan import PlanMismatchError
    from medusa_runtime.errors import ArtifactError

    art = Path(shutil.copytree(engine_art, tmp_path / "art"))
    m = json.loads((art / "manifest.json").read_text())
    m["engines"]["fp32"]["sources"] = {**m["engines"]["fp32"]["sources"], "model.onnx": "0" * 64}
    (art / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(PlanMismatchError, match=r"graphs model\.onnx .*checksums differ.*medusa-export engine"):
        create_engine(load_artifact(art), "tensorrt", precision="fp32")
    art2 = Path(shutil.copytree(engine_art, tmp_path / "art2"))
    (art2 / "engines/heads.fp32.plan").unlink()
    with pytest.raises(ArtifactError, match="heads.fp32.plan"):
        create_engine(load_artifact(art2), "tensorrt", precision="fp32")


def test_emulated_device_id_past_the_device_count_is_a_typed_error(engine_art, emulated):
    from medusa_runtime.engines import create_engine
    from medusa_runtime.errors import MedusaError

    with pytest.raises(MedusaError, match="device 7.*2 device"):
        create_engine(load_artifact(engine_art), "tensorrt", precision="fp32", device_id=7)


def test_emulated_tensorrt_11_has_no_weak_typing_and_refuses_a_10_plan(engine_art, tmp_path):
    """Under the emulated TensorRT 11 (EMULATED_TENSORRT_VERSION=11.1.0): BuilderFlag.FP16 and the calibrators are
    gone; fp32 plans build, nothing half-written beside them; a 10.x plan is
    refused, naming both versions. tests/test_trt_typed.py builds and generates with typed fp16 / bf16 plans."""
    art = Path(shutil.copytree(engine_art, tmp_path / "art"))
    env = {**os.environ, "EMULATED_TENSORRT_VERSION": "11.1.0",
           "PYTHONPATH": os.pathsep.join([str(EMULATED), *sys.path])}
    probe = ("import tensorrt as trt; print(hasattr(trt.BuilderFlag, 'FP16'), hasattr(trt.BuilderFlag, 'INT8'), "
             "hasattr(trt, 'IInt8EntropyCalibrator2'), hasattr(trt.ICudaEngine, 'device_memory_size'))")
    r = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
    assert r.stdout.split() == ["False", "False", "False", "False"], r.stderr
    run = lambda *a: subprocess.run([sys.executable, "-m", "medusa_export.cli.main", *a], env=env,  # noqa: E731
                                    capture_output=True, text=True, timeout=300)
    r = run("generate", "--artifact", str(art), "--backend", "tensorrt", "--prompt", "Hi", "--max-new-tokens", "4",
            "--tree", "artifact")
    assert r.returncode == 2 and "TensorRT 10.15.1" in r.stderr and "11.1.0" in r.stderr, r.stderr
    r = run("engine", "--artifact", str(art), "--precision", "fp32")
    assert r.returncode == 0 and "TensorRT 11.1.0" in r.stdout, r.stderr
    assert not list((art / "engines").glob(".*tmp*"))


# ---------------------------------------------------------------- scripts/gpu_check.sh

GPU_CHECK = Path(__file__).parent.parent / "scripts" / "gpu_check.sh"


def _gpu_check(tmp_path, **env) -> subprocess.CompletedProcess:
    full = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable, "NEW_TOKENS": "8", **env}
    return subprocess.run(["bash", str(GPU_CHECK)], env=full, capture_output=True, text=True, timeout=300)


def test_gpu_check_runs_end_to_end_against_the_emulation(tmp_path):
    """scripts/gpu_check.sh with tests/emulated first on PYTHONPATH and no GPU: it builds the tiny artifact and
    EMULATED fp32 plans, finds the emulated backend token-identical to ONNX Runtime, labels that row EMULATED,
    and prints the summary last (what a GPU run prints is not known: no GPU has run it). The emulation's times
    are the CPU's: no speed figure of it is printed (it printed "expected speedup 2.03x"), only "emulated: no GPU
    timing"; the CPU's own rows keep theirs."""
    r = _gpu_check(tmp_path, PRECISIONS="fp32", PYTHONPATH=os.pathsep.join([str(EMULATED), *sys.path]))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = r.stdout.split("== summary\n", 1)[1]
    assert "engine fp32" in summary and "built" in summary
    line = next(ln for ln in summary.splitlines() if ln.startswith("tensorrt fp32"))
    assert "EMULATED" in line and "PASS" in line and "3/3 prompts token-identical" in line
    steps = {ln.split("  ")[0]: ln for ln in summary.splitlines() if ln.startswith("step time")}
    assert set(steps) == {"step time onnxruntime cpu", "step time tensorrt fp32", "step time pytorch 7b fp16"}
    assert "expected speedup" in steps["step time onnxruntime cpu"] and "tok/s" in summary  # the CPU's, labelled
    for emulated in (line, steps["step time tensorrt fp32"]):
        assert "emulated: no GPU timing" in emulated
        assert not any(figure in emulated for figure in ("tok/s", "speedup", " ms", "x a 1-token step")), emulated
    emulated_table = r.stdout.split("step time: emulated: no GPU timing (", 1)[1].split("\n== ", 1)[0]
    assert "exp. tokens" in emulated_table and "ms" not in emulated_table and "speedup" not in emulated_table
    assert r.stdout.count("exp. speedup") == 1  # the step-time table of onnxruntime cpu only
    assert "skipped" in steps["step time pytorch 7b fp16"]  # no PyTorch with CUDA here


def test_step_time_torch_rows_and_expected_speedup(tmp_path):
    """scripts/step_time.py --torch tiny --device cpu: one row per tree size 1..64, ratios to the 1-token step,
    and expected speedup = expected tokens per step (the greedy tree under default_accuracies) / that ratio."""
    from medusa_runtime.tuning.autotree import expected_tokens
    from medusa_runtime.trees.tree import default_accuracies, greedy_tree

    out = tmp_path / "st.json"
    r = subprocess.run([sys.executable, str(Path(__file__).parent.parent / "scripts" / "step_time.py"), "--torch",
                        "tiny", "--device", "cpu", "--dtype", "fp32", "--past", "8", "--repeats", "1",
                        "--json", str(out)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [x["tree_size"] for x in rows] == [1, 2, 4, 8, 16, 32, 64] and rows[0]["step_ratio"] == 1.0
    acc = default_accuracies(3)
    for x in rows:
        tokens = expected_tokens(greedy_tree(x["tree_size"], acc, topk=acc.shape[1]), acc)
        assert x["expected_tokens_per_step"] == round(tokens, 3)
        assert x["expected_speedup"] == pytest.approx(tokens / x["step_ratio"], rel=2e-3)


def test_gpu_check_prints_its_summary_when_a_step_fails(tmp_path):
    """A step that stops the script (here: an artifact folder that does not exist) still ends in the summary,
    with that step's FAIL row, and exit code 1 (before, set -e stopped the script before its summary)."""
    r = _gpu_check(tmp_path, ART=str(tmp_path / "missing"), PRECISIONS="fp32",
                   PYTHONPATH=os.pathsep.join(sys.path))
    assert r.returncode == 1
    summary = r.stdout.split("== summary\n", 1)[1]
    assert any(ln.startswith("artifact") and "FAIL" in ln for ln in summary.splitlines()), summary


def test_bench_runs_vanilla_and_medusa_on_the_emulated_tensorrt_engine(engine_art, tmp_path):
    """scripts/bench.py --backend tensorrt --device-id 1 (EMULATED, so its timings mean nothing): vanilla and Medusa
    on the same engine give the same greedy tokens, the step-time scan covers the asked past lengths, and the
    report names the backend as emulated."""
    out = tmp_path / "bench.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(EMULATED), *sys.path])}
    r = subprocess.run([sys.executable, str(Path(__file__).parent.parent / "scripts" / "bench.py"), str(engine_art),
                        "--backend", "tensorrt", "--device-id", "1", "--prompts", "2", "--max-new-tokens", "8",
                        "--repeats", "1", "--past-lengths", "0,32", "--no-transformers", "--out", str(out),
                        "--questions", str(MT_BENCH)],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["backend"] == "tensorrt (emulated)" and report["identical_outputs"] == 2  # never "tensorrt"
    assert [row["past_length"] for row in report["step_time"]["by_past_length"]] == [0, 32]
    assert report["medusa"]["mean_tokens_per_step"] >= report["vanilla"]["mean_tokens_per_step"] == 1.0


# ---------------------------------------------------------------- Triton: the tensorrt backend in a real tritonserver


class _FakeTritonUtils(types.ModuleType):
    """The part of Triton's ``triton_python_backend_utils`` that model.py uses (names from the Python backend's
    README, github.com/triton-inference-server/python_backend: decoupled responses, InferenceResponse, Tensor,
    TritonError codes, Logger), recording what the model sends."""

    TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1

    class TritonModelException(Exception):
        pass

    class TritonError:
        INVALID_ARG, INTERNAL, CANCELLED = "INVALID_ARG", "INTERNAL", "CANCELLED"

        def __init__(self, message, code=None):
            self.message, self.code = message, code

    class Tensor:
        def __init__(self, name, array):
            self.name, self.array = name, np.asarray(array)

        def as_numpy(self):
            return self.array

    class InferenceResponse:
        def __init__(self, output_tensors, error=None):
            self.outputs = {t.name: t.array for t in output_tensors}
            self.error = error

    class Logger:
        lines: list[str] = []

        @classmethod
        def log_info(cls, message):
            cls.lines.append(message)

        log_error = log_info

    def __init__(self):
        super().__init__("triton_python_backend_utils")

    @staticmethod
    def using_decoupled_model_transaction_policy(config):
        return bool(config.get("model_transaction_policy", {}).get("decoupled"))

    @staticmethod
    def get_input_tensor_by_name(request, name):
        return request.inputs.get(name)


class _FakeRequest:
    """A decoupled request: its inputs, and the responses its sender got (the last one flagged final)."""

    def __init__(self, utils, **inputs):
        self.inputs = {k: utils.Tensor(k, v) for k, v in inputs.items()}
        self.responses: list = []
        self.final = threading.Event()

    def parameters(self):
        return "{}"

    def get_response_sender(self):
        request = self

        class Sender:
            def send(self, response=None, flags=0):
                request.responses.append(response)
                if flags == _FakeTritonUtils.TRITONSERVER_RESPONSE_COMPLETE_FINAL:
                    request.final.set()
        return Sender()


def triton_gpu_instance_ids(art: Path, cudart, tmp_path: Path, monkeypatch, prompts, max_new_tokens: int) -> list:
    """Serve ``prompts`` from the generated model.py of ``art``'s Triton repository, run in-process as a KIND_GPU
    instance on EMULATED device 1 with a stand-in for triton_python_backend_utils; asserts the engine and its
    memory live on device 1 only and are freed on finalize; returns each request's output ids."""
    import re

    from medusa_export.triton.repository import TritonConfig, write_repository

    on_device_0 = cudart.emulator_live_device_bytes(0)
    utils = _FakeTritonUtils()
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", utils)
    repo = write_repository(art, tmp_path / "repo", TritonConfig(threads=1, instances=1, engine_models=False,
                                                                tree="artifact"))
    pbtxt = (repo / "medusa" / "config.pbtxt").read_text()
    assert "KIND_GPU" in pbtxt
    params = dict(re.findall(r'key: "(\w+)" value: \{ string_value: "([^"]*)" \}', pbtxt))
    assert params["backend"] == "tensorrt" and params["precision"] == "fp32"
    model_py = repo / "medusa" / "1" / "model.py"
    spec = importlib.util.spec_from_file_location("medusa_triton_model_under_test", model_py)
    module = importlib.util.module_from_spec(spec)
    path_before = list(sys.path)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = path_before  # model.py puts its own folder first, as it does in the Python backend
    model = module.TritonPythonModel()
    config = {"model_transaction_policy": {"decoupled": True},
              "parameters": {k: {"string_value": v} for k, v in params.items()}}
    model.initialize({"model_config": json.dumps(config), "model_instance_kind": "GPU",
                      "model_instance_device_id": "1"})
    try:
        assert model.session.backend == "tensorrt" and model.session.engine.cuda.device == 1
        assert cudart.emulator_live_device_bytes(1) > 0
        assert cudart.emulator_live_device_bytes(0) == on_device_0
        budget = np.array([max_new_tokens], np.int32)
        requests = [_FakeRequest(utils, input_ids=np.asarray(ids, np.int64), max_new_tokens=budget) for ids in prompts]
        assert model.execute(requests) is None  # decoupled: answered from the batch server's thread
        assert all(r.final.wait(120) for r in requests)
    finally:
        model.finalize()
    assert cudart.emulator_live_device_bytes(1) == 0 and model.session is None
    out = []
    for request in requests:
        (response,) = request.responses
        assert response.error is None, response.error.message
        out.append(response.outputs["output_ids"].tolist())
    assert any(" on tensorrt, tree of " in line for line in utils.Logger.lines)
    return out


def test_triton_gpu_instance_runs_on_its_model_instance_device_id(engine_art, live_bytes, tmp_path, monkeypatch):
    """A KIND_GPU instance on device 1 (Triton's ``model_instance_kind`` "GPU" and ``model_instance_device_id``
    "1", the args the Python backend's initialize gets) puts its engine, KV caches and buffers on EMULATED device 1
    only, serves greedy ids equal to the ONNX Runtime session's from its batch server's thread (the emulation
    refuses a device used from a thread that did not set it), and frees everything on finalize. The generated
    model.py runs in-process with a stand-in for triton_python_backend_utils: tritonserver itself cannot load a
    KIND_GPU instance on this GPU-less machine (the real-server test below runs KIND_CPU)."""
    from medusa_runtime.front.session import MedusaSession

    got = triton_gpu_instance_ids(engine_art, live_bytes, tmp_path, monkeypatch, PROMPTS, 12)
    with MedusaSession(engine_art, tree="artifact") as session:
        ref = [session.generate(prompt_ids=ids, max_new_tokens=12).token_ids for ids in PROMPTS]
    assert got == ref and all(len(r) == 12 for r in ref)


def test_triton_serves_the_emulated_tensorrt_engine(engine_art, tmp_path, monkeypatch):
    """The Triton repository of an artifact with built plans runs its generation model on the tensorrt backend in
    the bundled tritonserver, the EMULATED TensorRT and CUDA runtime on the stub's path (its first sys.path entry,
    medusa_export.triton.local): greedy ids equal to the runtime's ONNX Runtime session. This machine has no GPU,
    so the instance group is made KIND_CPU (device 0); a KIND_GPU instance's device id is tested in-process by
    test_triton_gpu_instance_runs_on_its_model_instance_device_id."""
    from conftest import import_or_fail_in_ci, skip_or_fail_in_ci
    from medusa_export.triton.local import STUB_SITE_ENV, LocalTritonServer, TritonUnavailableError, find_bundled
    from medusa_export.triton.local import stub_site
    from medusa_export.triton.repository import TritonConfig, write_repository
    from medusa_runtime.front.session import MedusaSession

    grpc = import_or_fail_in_ci("tritonclient.grpc", "tritonclient[grpc,http] is in the dev extra")
    try:
        find_bundled()
    except TritonUnavailableError as exc:
        skip_or_fail_in_ci(f"no tritonserver binary: {exc}")
    site = tmp_path / "stub-site"  # the numpy < 2 the stub needs (if any), and the emulated modules
    site.mkdir()
    base = stub_site()
    for entry in (base.iterdir() if base is not None else ()):
        (site / entry.name).symlink_to(entry)
    for name in ("tensorrt", "cuda"):
        shutil.copytree(EMULATED / name, site / name)
    monkeypatch.setenv(STUB_SITE_ENV, str(site))
    repo = write_repository(engine_art, tmp_path / "repo", TritonConfig(threads=1, instances=1, engine_models=False,
                                                                       tree="artifact"))
    config = repo / "medusa" / "config.pbtxt"
    text = config.read_text()
    assert 'string_value: "tensorrt"' in text and "KIND_GPU" in text
    config.write_text(text.replace("KIND_GPU", "KIND_CPU"))
    srv = LocalTritonServer(repo, tmp_path / "server", models=["medusa"])
    srv.start()
    try:
        client = grpc.InferenceServerClient(srv.grpc_url)
        with MedusaSession(engine_art, tree="artifact") as session:
            for ids in PROMPTS[:2]:
                ref = session.generate(prompt_ids=ids, max_new_tokens=12)
                got = []
                client.start_stream(callback=lambda result, error: got.append((result, error)))
                x = grpc.InferInput("input_ids", [len(ids)], "INT64")
                x.set_data_from_numpy(np.asarray(ids, np.int64))
                n = grpc.InferInput("max_new_tokens", [1], "INT32")
                n.set_data_from_numpy(np.array([12], np.int32))
                client.async_stream_infer("medusa", [x, n])
                client.stop_stream()  # waits for the responses
                (result, error), = got
                assert error is None, error
                assert result.as_numpy("output_ids").tolist() == ref.token_ids and len(ref.token_ids) == 12
        client.close()
    finally:
        log = srv.log_path.read_text(errors="replace") if srv.log_path.is_file() else ""
        assert srv.stop() == 0, log[-3000:]
    assert " on tensorrt, tree of " in log, log[-3000:]  # the instance log line names the backend it runs
