"""The batched portable step graph (``build --batch-size N``, issue 16 phase B): each row of one batched call
equals the batch-1 graph's call on that row alone (prefill with prompts of different lengths, padded; a tree
step over rows with different past lengths, the padding of the past filled with noise; a temperature per row;
a sliding-window family), the manifest records the batch, batch-1 builds keep the batch-1 contract, and the
fused graph refuses a batch size > 1 with a typed error naming the choice that works.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from conftest import make_family_medusa, make_tiny_medusa, tiny_loaded
from medusa_export.pipeline import BuildConfig, build_artifact
from medusa_export.export.config import UnsupportedGraphError
from medusa_runtime.contract.artifact import load_artifact, step_batch
from medusa_runtime.engines.base import sampler_feed
from medusa_runtime.trees.treespec import tree_from_spec

BATCH = 4
#: A 4-node tree: root, two children of the root, a child of the first child (node order, ancestors first).
TREE_MASK = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], bool)
TREE_DEPTH = np.array([0, 1, 1, 2])


def _build(model, folder, batch_size: int):
    cfg = BuildConfig(validate=False, batch_size=batch_size)
    return build_artifact(tiny_loaded(model, max_context=128), tree_from_spec("8", num_heads=3), folder, cfg,
                          progress=False)


@pytest.fixture(scope="module", params=["llama", "mistral"])
def pair(request, tmp_path_factory):
    """(batch-1 artifact, batched artifact, vocab) of one model: a tiny Llama, and Mistral (sliding window 8)."""
    model = make_tiny_medusa()[1] if request.param == "llama" else make_family_medusa("mistral")[1]
    root = tmp_path_factory.mktemp(f"batched-{request.param}")
    return _build(model, root / "b1", 1), _build(model, root / "bn", BATCH), model.backbone.config.vocab_size


def _session(folder):
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(str(folder / "model.onnx"), opts, providers=["CPUExecutionProvider"])


def _run(sess, feed: dict) -> dict:
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feed)))


def _layers(sess) -> int:
    return sum(1 for i in sess.get_inputs() if i.name.startswith("past_key_values.")) // 2


def _single(sess, ids, pos, mask, temperature, past):
    """The batch-1 graph on one row: ids/pos [S], mask [S, S], past per layer (k, v) [1, P, H, D]."""
    feed = {"input_ids": ids[None], "position_ids": pos[None], "new_token_mask": mask,
            "temperature": np.array([temperature], np.float32), **sampler_feed(len(ids), None)}
    for i, (k, v) in enumerate(past):
        feed[f"past_key_values.{i}.key"], feed[f"past_key_values.{i}.value"] = k, v
    return _run(sess, feed)


def _assert_row(batched: dict, b: int, n: int, single: dict) -> None:
    """Row b of a batched call (its first n new tokens) equals the batch-1 call."""
    np.testing.assert_array_equal(batched["topk_ids"][b, :n], single["topk_ids"][0])
    for name in ("topk_logprobs", "entropy", "hidden_states"):
        np.testing.assert_allclose(batched[name][b, :n], single[name][0], atol=2e-5, rtol=1e-5, err_msg=name)
    np.testing.assert_allclose(batched["token_logprobs"][b, :n, :n], single["token_logprobs"][0], atol=2e-5, rtol=1e-5)
    for name in single:
        if name.startswith("new_key_values."):
            np.testing.assert_allclose(batched[name][b, :n], single[name][0], atol=2e-5, rtol=1e-5, err_msg=name)


def test_batched_rows_equal_batch1_calls(pair):
    one, many, vocab = pair
    s1, sb = _session(one), _session(many)
    layers = _layers(s1)
    rng = np.random.default_rng(0)
    lengths = [5, 12, 1, 9]  # prompts of different lengths: one batched prefill, shorter rows padded
    prompts = [rng.integers(3, vocab, size=n) for n in lengths]
    s = max(lengths)
    ids, pos, mask = np.zeros((BATCH, s), np.int64), np.zeros((BATCH, s), np.int64), np.zeros((BATCH, s, s), bool)
    for b, p in enumerate(prompts):
        n = len(p)
        ids[b, :n], pos[b, :n], pos[b, n:] = p, np.arange(n), n - 1
        mask[b, :n, :n] = np.tril(np.ones((n, n), bool))
        mask[b, np.arange(n, s), np.arange(n, s)] = True  # padding sees itself only
    empty = np.zeros((BATCH, 0) + tuple(sb.get_inputs()[-1].shape[2:]), np.float32)
    feed = {"input_ids": ids, "position_ids": pos, "new_token_mask": mask,
            "temperature": np.ones(BATCH, np.float32), "past_sequence_length": np.zeros(BATCH, np.int32)}
    for i in range(layers):
        feed[f"past_key_values.{i}.key"] = feed[f"past_key_values.{i}.value"] = empty
    prefill = _run(sb, feed)
    pasts = []
    for b, p in enumerate(prompts):
        n = len(p)
        kv0 = [(np.zeros((1, 0) + empty.shape[2:], np.float32),) * 2 for _ in range(layers)]
        single = _single(s1, p, np.arange(n), np.tril(np.ones((n, n), bool)), 1.0, kv0)
        _assert_row(prefill, b, n, single)
        pasts.append([(single[f"new_key_values.{i}.key"], single[f"new_key_values.{i}.value"]) for i in range(layers)])

    # a tree step after pasts of different lengths; the past's padding is noise that must be ignored;
    # a temperature per row; positions past the sliding window (8) for the long rows
    p_max, t = max(lengths), len(TREE_DEPTH)
    temps = np.array([1.0, 0.7, 1.3, 1.0], np.float32)
    tree_ids = rng.integers(3, vocab, size=(BATCH, t))
    tree_pos = np.array(lengths)[:, None] + TREE_DEPTH[None]
    feed = {"input_ids": tree_ids, "position_ids": tree_pos, "new_token_mask": np.repeat(TREE_MASK[None], BATCH, 0),
            "temperature": temps, "past_sequence_length": np.array(lengths, np.int32)}
    for i in range(layers):
        for j, n in enumerate(("key", "value")):
            buf = rng.normal(size=(BATCH, p_max) + empty.shape[2:]).astype(np.float32)
            for b in range(BATCH):
                buf[b, : lengths[b]] = pasts[b][i][j][0]
            feed[f"past_key_values.{i}.{n}"] = buf
    step = _run(sb, feed)
    for b in range(BATCH):
        single = _single(s1, tree_ids[b], tree_pos[b], TREE_MASK, float(temps[b]), pasts[b])
        _assert_row(step, b, t, single)


def test_manifest_records_the_batch_and_batch1_keeps_its_contract(pair):
    one, many, _ = pair
    m1, mb = load_artifact(one).manifest.to_json(), load_artifact(many).manifest.to_json()
    assert "batch" not in m1 and step_batch(m1) == 0
    shapes1 = {t["name"]: t["shape"] for t in m1["graphs"]["model"]["inputs"]}
    assert shapes1["input_ids"] == [1, "S"] and shapes1["new_token_mask"] == ["S", "S"]
    assert shapes1["temperature"] == [1] and "past_sequence_length" not in shapes1
    assert mb["batch"]["max_batch_size"] == BATCH and mb["batch"]["dynamic"] is True and step_batch(mb) == BATCH
    shapes = {t["name"]: t["shape"] for t in mb["graphs"]["model"]["inputs"] + mb["graphs"]["model"]["outputs"]}
    assert shapes["input_ids"] == ["B", "S"] and shapes["new_token_mask"] == ["B", "S", "S"]
    assert shapes["temperature"] == ["B"] and shapes["past_sequence_length"] == ["B"]
    assert shapes["past_key_values.0.key"][:2] == ["B", "P"] and shapes["topk_ids"][:2] == ["B", "S"]
    assert mb["graphs"]["model"]["profiles"]["tree_step"]["B"] == [1, BATCH]
    assert mb["trt_readiness"]["passed"] is True
    # the graphs declare what the manifest says
    names = {i.name: i.shape for i in _session(many).get_inputs()}
    assert names["input_ids"] == ["B", "S"] and names["past_sequence_length"] == ["B"]


@pytest.mark.parametrize("kwargs, message", [
    (dict(batch_size=0), "integer >= 1"),
    (dict(batch_size=2.0), "integer >= 1"),
])
def test_bad_batch_settings_are_typed_errors(kwargs, message):
    with pytest.raises(UnsupportedGraphError, match=message):
        BuildConfig(**kwargs)


def test_cli_build_bad_batch_size_is_a_one_line_error(tmp_path, capsys):
    from medusa_export.cli.main import main

    code = main(["build", "--model", "smollm2-135m", "--batch-size", "0", "--no-validate", "--out", str(tmp_path / "a")])
    err = capsys.readouterr().err
    assert code != 0 and "--batch-size must be an integer >= 1, got 0" in err and "Traceback" not in err
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("precision", ["fp16", "int8", "int4"])
def test_other_precisions_batch_row_for_row(tmp_path, precision):
    """fp16 and the weight-only (MatMulNBits) graphs batch too: four prompts of different lengths sharing each
    step give each prompt's tokens from the batch-1 artifact of the same precision."""
    from medusa_runtime.decode.batch import Scheduler, SequenceRequest
    from medusa_runtime.engines.ort_batched import OrtBatchEngine
    from medusa_runtime.decode.loop import generate
    from medusa_runtime.front.session import MedusaSession

    model = make_tiny_medusa()[1]
    tree = tree_from_spec("16" if precision == "fp16" else "chain", num_heads=3)  # int8 activations: chains (step_rows)
    sessions = [MedusaSession(build_artifact(tiny_loaded(model, max_context=128), tree,
                                             tmp_path / f"b{b}", BuildConfig(validate=False, batch_size=b,
                                                                            precision=precision,
                                                                            graph="contrib" if precision != "fp16"
                                                                            else "portable"), progress=False),
                              threads=1) for b in (1, BATCH)]
    one, many = sessions
    assert isinstance(many.engine, OrtBatchEngine)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 1000, size=n).tolist() for n in (3, 17, 9, 30)]
    sched = Scheduler(many.engine, many.tree, max_batch=BATCH)
    states = [sched.submit(SequenceRequest(p, 20, tag=i)) for i, p in enumerate(prompts)]
    sched.run()
    for s, p in zip(states, prompts):
        ref = generate(one.engine, p, one.tree, max_new_tokens=20)
        assert s.max_batch_seen == BATCH and (s.result.tokens, s.result.step_tokens) == (ref.tokens, ref.step_tokens)


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral"])
def test_batched_fused_graph_rows_equal_batch1_and_transformers(tmp_path, family):
    """--graph fused --batch-size 4 (explicit attention over the head-major buffers instead of
    GroupQueryAttention; q/k norms in Qwen3, a sliding window in Mistral): four prompts of different lengths
    sharing each step give each prompt the fused batch-1 artifact's tokens and tokens per step, and
    transformers' greedy tokens. The Llama build runs build's own validation on the batched graph."""
    from conftest import plain_greedy
    from medusa_runtime.decode.batch import Scheduler, SequenceRequest
    from medusa_runtime.engines.ort_batched import OrtBatchEngine
    from medusa_runtime.decode.loop import generate
    from medusa_runtime.front.session import MedusaSession

    hf, model = make_tiny_medusa() if family == "llama" else make_family_medusa(family)
    sessions = []
    for b in (1, BATCH):
        cfg = BuildConfig(validate=family == "llama" and b > 1, new_tokens=16, graph="fused", batch_size=b)
        art = build_artifact(tiny_loaded(model, max_context=128), tree_from_spec("16", num_heads=3), tmp_path / f"b{b}",
                             cfg, progress=False)
        sessions.append(MedusaSession(art, threads=1))
    one, many = sessions
    m = load_artifact(many.artifact.path).manifest.to_json()
    assert m["flavour"] == "ort-fused" and m["batch"]["graph"] == "fused" and isinstance(many.engine, OrtBatchEngine)
    if family == "llama":
        assert m["validation"]["passed"] is True
    vocab = model.backbone.config.vocab_size
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, vocab, size=n).tolist() for n in (3, 17, 9, 30)]
    sched = Scheduler(many.engine, many.tree, max_batch=BATCH)
    states = [sched.submit(SequenceRequest(p, 12 + 3 * i, tag=i)) for i, p in enumerate(prompts)]
    sched.run()
    for s, p in zip(states, prompts):
        n = s.request.max_new_tokens
        ref = generate(one.engine, p, one.tree, max_new_tokens=n)
        assert s.error is None and s.max_batch_seen == BATCH
        assert (s.result.tokens, s.result.step_tokens) == (ref.tokens, ref.step_tokens)
        assert s.result.tokens == plain_greedy(hf, p, n)
