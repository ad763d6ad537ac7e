"""The batched TensorRT engine (:class:`medusa_runtime.engines.trt_batched.TrtBatchEngine`) against the EMULATED
TensorRT and CUDA runtime (tests/emulated; see tests/test_trt_emulated.py): several sequences in one execution of
a batched step graph's plan, token-exact with the batched ONNX Runtime engine and with batch-1 decoding.

What passes here is our use of the API (bindings, profiles, packing, per-row compaction) as the emulation
enforces it, not TensorRT.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import make_counter_medusa, make_tiny_medusa, tiny_loaded
from test_trt_emulated import emulated, live_bytes, serve_ids, triton_gpu_instance_ids  # noqa: F401 - fixtures

from medusa_export.cli.main import main
from medusa_runtime.contract.artifact import load_artifact

CONTEXT, N = 128, 4
PROMPTS = [[5, 6, 7], list(range(10, 40)), [3] * 21, [100, 101], list(range(200, 211))]
BUDGETS = [30, 12, 40, 25, 18]


def _build(out: Path, batch_size: int, model=None) -> Path:
    from medusa_export.pipeline import BuildConfig, build_artifact
    from medusa_runtime.trees.treespec import tree_from_spec

    lm = tiny_loaded(model or make_counter_medusa(miss_every=3), name="counter-miss", max_context=CONTEXT)
    art = build_artifact(lm, tree_from_spec("16", num_heads=3), out, BuildConfig(validate=False, batch_size=batch_size),
                         progress=False)
    assert main(["engine", "--artifact", str(art), "--precision", "fp32"]) == 0
    return art


@pytest.fixture(scope="module")
def batched_art(emulated, tmp_path_factory):  # noqa: F811
    """The counter model built with --batch-size 4 (portable graph), fp32 plans from the emulated builder."""
    return _build(tmp_path_factory.mktemp("trt-batched") / "b4", N)


def test_batched_plans_profiles_cover_the_built_batch_and_prefill_one_sequence(batched_art):
    """The plans' profiles cover B in [1, N] (the manifest's ranges); the prefill is tuned for B = 1 and P = 0
    (the scheduler prefills each sequence in a call of its own), the tree and decode steps for B's middle."""
    from medusa_runtime.engines.trt_plan import model_profiles

    m = load_artifact(batched_art).manifest
    ranges = m.graphs["model"].profiles
    prefill, tree_step, decode = model_profiles(m)
    assert [tuple(ranges[p]["B"]) for p in ("prefill", "tree_step", "decode")] == [(1, N)] * 3
    assert prefill.dims["B"] == (1, 1, N) and prefill.dims["P"][:2] == (0, 0)
    assert tree_step.dims["B"] == decode.dims["B"] == (1, 1 + (N - 1) // 2, N)
    recorded = m.engines["fp32"]["profiles"]["model"]
    assert recorded[0]["name"] == "prefill" and recorded[0]["dims"]["B"] == [1, 1, N]


@pytest.fixture
def executions(monkeypatch):
    """The rows of every multi-row execution of TrtBatchEngine, in order."""
    from medusa_runtime.engines.trt_batched import TrtBatchEngine

    rows: list[int] = []
    run = TrtBatchEngine._execute_rows

    def recording(self, key, caches, inputs):
        rows.append(len(caches))
        return run(self, key, caches, inputs)

    monkeypatch.setattr(TrtBatchEngine, "_execute_rows", recording)
    return rows


def _session(art, backend: str, **options):
    from medusa_runtime.front.session import MedusaSession

    extra = {"precision": "fp32"} if backend == "tensorrt" else {"threads": 1}
    return MedusaSession(art, backend=backend, tree="artifact", **extra, **options)


def test_emulated_batched_trt_plans_run_rows_together_token_exact(batched_art, live_bytes, executions):  # noqa: F811
    """Five prompts of different lengths and budgets, four rows per execution (the fifth joins when a row
    leaves), then six at once (executions of at most N = 4 rows): every reply is the batched ONNX Runtime
    engine's and batch-1 decoding's, token for token and step for step."""
    from medusa_runtime.engines.trt_batched import TrtBatchEngine

    with _session(batched_art, "onnxruntime") as ort:
        ref = ort.generate_batch(prompt_ids=PROMPTS, max_new_tokens=BUDGETS, batch_size=N)
        alone = [ort.generate(prompt_ids=p, max_new_tokens=n) for p, n in zip(PROMPTS, BUDGETS)]
    with _session(batched_art, "tensorrt") as trt:
        assert isinstance(trt.engine, TrtBatchEngine) and trt.engine.capabilities.batched
        got = trt.generate_batch(prompt_ids=PROMPTS, max_new_tokens=BUDGETS, batch_size=N)
        assert max(executions) == N and len(executions) >= 5
        assert 1 <= trt.engine.repacks < len(executions) / 2  # the packed past is mostly updated, not rebuilt
        del executions[:]
        six = trt.generate_batch(prompt_ids=PROMPTS + [[9, 8]], max_new_tokens=BUDGETS + [20], batch_size=6)
        assert N + 2 in [a + b for a, b in zip(executions, executions[1:])] and max(executions) == N
        assert trt.engine.live_caches == 0
    for c, r, a in zip(got, ref, alone):
        assert c.token_ids == r.token_ids == a.token_ids and len(c.token_ids) > 0
        assert c.result.step_tokens == r.result.step_tokens == a.result.step_tokens
    assert [c.token_ids for c in six[:5]] == [c.token_ids for c in got]
    assert max(c.tokens_per_step for c in got) > 1.5  # the heads accept: compaction of several nodes per row


def test_emulated_batched_trt_plans_are_token_exact_on_a_random_model(emulated, live_bytes, tmp_path):  # noqa: F811
    """The tiny random-weight model (its tokens depend on every past K/V, unlike the counter's), batched:
    five prompts, four rows per execution, the packed past kept between calls: ONNX Runtime's replies."""
    art = _build(tmp_path / "random-b4", N, make_tiny_medusa()[1])
    with _session(art, "onnxruntime") as ort:
        ref = ort.generate_batch(prompt_ids=PROMPTS, max_new_tokens=BUDGETS, batch_size=N)
    with _session(art, "tensorrt") as trt:
        got = trt.generate_batch(prompt_ids=PROMPTS, max_new_tokens=BUDGETS, batch_size=N)
        assert trt.engine.repacks >= 1
    assert [c.token_ids for c in got] == [c.token_ids for c in ref]
    assert [len(c.token_ids) for c in got] == BUDGETS


def _prefilled(engine, prompts):
    caches = [engine.row_cache(CONTEXT) for _ in prompts]
    from medusa_runtime.engines.base import RowInputs

    for c, p in zip(caches, prompts):
        n = len(p)
        out = engine.step_rows([c], [RowInputs(np.array(p, np.int64), np.arange(n), np.tril(np.ones((n, n), bool)),
                                               1.0, None)])[0]
        c.keep(out.new_kv, np.arange(n), p)
    return caches


def test_emulated_batched_step_pads_rows_and_compacts_each_row(batched_art, live_bytes):  # noqa: F811
    """Rows of different lengths and pasts in one execution (padding, packed past), then each row keeps other
    nodes (its K/V from its own rows of the step buffer) and steps again: per row, the outputs are ONNX
    Runtime's batched engine's (ids equal, log-probs within 1e-5)."""
    from medusa_runtime.engines import create_engine
    from medusa_runtime.engines.base import RowInputs

    a = load_artifact(batched_art)
    ort, trt = create_engine(a, "onnxruntime", threads=1), create_engine(a, "tensorrt", precision="fp32")
    try:
        prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[3]]
        rows = [_prefilled(e, prompts) for e in (ort, trt)]
        chain = lambda n: np.tril(np.ones((n, n), bool))  # noqa: E731
        steps = [
            [RowInputs(np.array([8, 9, 10, 11, 12]), 3 + np.arange(5), chain(5), 1.0, None),
             RowInputs(np.array([40]), np.array([30]), chain(1), 0.7, None),
             RowInputs(np.array([102, 103, 104]), 2 + np.arange(3), chain(3), 1.0, None)],
            [RowInputs(np.array([13, 14]), 6 + np.arange(2), chain(2), 1.0, None),
             RowInputs(np.array([41, 42, 43, 44]), 31 + np.arange(4), chain(4), 1.0, None),
             RowInputs(np.array([106]), np.array([4]), chain(1), 1.0, None)],
        ]
        keeps = [[0, 1, 2], [0], [0, 2]]  # row 2 keeps nodes 0 and 2: a gap in its own step rows
        for step in steps:
            outs = [e.step_rows(c, step) for e, c in zip((ort, trt), rows)]
            for (o, t), r in zip(zip(*outs), step):
                n = len(r.tokens)
                assert t.topk_ids.shape == (n, o.topk_ids.shape[1])
                np.testing.assert_array_equal(t.topk_ids, o.topk_ids)
                np.testing.assert_allclose(t.topk_logprobs, o.topk_logprobs, atol=1e-5)
                np.testing.assert_allclose(t.entropy, o.entropy, atol=1e-5)
                np.testing.assert_allclose(t.token_logprobs, o.token_logprobs, atol=1e-5)
            for e, caches, res in zip((ort, trt), rows, outs):
                for c, out, keep, r in zip(caches, res, keeps, step):
                    keep = [k for k in keep if k < len(r.tokens)]
                    c.keep(out.new_kv, np.array(keep), r.tokens[keep].tolist())
        assert [c.length for c in rows[1]] == [c.length for c in rows[0]] == [8, 32, 5]
        for c in rows[1]:
            trt.release(c)
    finally:
        trt.close()


def test_emulated_batch_server_batches_rows_on_device_1(batched_art, live_bytes, executions):  # noqa: F811
    """The batch server's thread drives the batched plans on emulated device 1: requests share executions
    and each reply is the session's own generate."""
    cudart = live_bytes
    with _session(batched_art, "tensorrt", device_id=1) as session:
        ref = [session.generate(prompt_ids=p, max_new_tokens=n).token_ids for p, n in zip(PROMPTS, BUDGETS)]
        assert cudart.emulator_live_device_bytes(1) > 0 == cudart.emulator_live_device_bytes(0)
        del executions[:]
        requests = [{"input_ids": p, "max_new_tokens": n} for p, n in zip(PROMPTS, BUDGETS)]
        assert serve_ids(session, requests, batch_size=N) == ref
        assert executions and max(executions) > 1  # rows shared executions


def test_triton_gpu_instance_runs_batched_plans_rows_together(batched_art, live_bytes, executions, tmp_path,  # noqa: F811
                                                              monkeypatch):
    """The Triton model of a batched artifact, a KIND_GPU instance on emulated device 1: concurrent requests share
    executions of the batched plans (not one sequence per engine call) and each gets ONNX Runtime's greedy ids."""
    got = triton_gpu_instance_ids(batched_art, live_bytes, tmp_path, monkeypatch, PROMPTS, 16)
    assert executions and max(executions) > 1
    with _session(batched_art, "onnxruntime") as ort:
        ref = [ort.generate(prompt_ids=p, max_new_tokens=16).token_ids for p in PROMPTS]
    assert got == ref and all(len(r) == 16 for r in ref)


def test_emulated_batched_engine_refuses_what_it_cannot_run(batched_art, emulated, tmp_path_factory):  # noqa: F811
    """Typed errors: a batch-1 artifact, the in-graph sampler, a row that does not fit (before any row runs)."""
    from medusa_runtime.engines.base import RowInputs, SamplerInputs
    from medusa_runtime.engines.trt_batched import TrtBatchEngine
    from medusa_runtime.errors import ArtifactError, ContextOverflowError

    one = _build(tmp_path_factory.mktemp("trt-batch1") / "b1", 1)
    with pytest.raises(ArtifactError, match="not batched"):
        TrtBatchEngine(load_artifact(one), precision="fp32")
    shutil.rmtree(one)
    engine = TrtBatchEngine(load_artifact(batched_art), precision="fp32")
    try:
        caches = [engine.row_cache(8), engine.row_cache(CONTEXT)]
        row = RowInputs(np.array([5, 6]), np.arange(2), np.tril(np.ones((2, 2), bool)), 1.0, None)
        sampled = row._replace(sampling=SamplerInputs(*[np.zeros(1)] * len(SamplerInputs._fields)))
        with pytest.raises(ArtifactError, match="no in-graph sampler"):
            engine.step_rows(caches, [row, sampled])
        long = RowInputs(np.arange(9), np.arange(9), np.tril(np.ones((9, 9), bool)), 1.0, None)
        with pytest.raises(ContextOverflowError, match="does not fit"):
            engine.step_rows(caches, [long, row])
        assert [c.length for c in caches] == [0, 0]
    finally:
        engine.close()
