"""The ``ort-fused`` step graph (``--graph fused``): parity with the portable graph, lossless Medusa
through the runtime, the head-major in-place KV cache, the manifest and bad combinations.

Artifacts are built once per module from tiny random Llamas (grouped-query attention).
"""

from __future__ import annotations

import itertools
import json

import numpy as np
import onnx
import pytest

from conftest import SMOLLM_TREE, mt_bench_prompts, plain_greedy, tiny_loaded
from medusa_export.chat import apply_chat_template
from medusa_export.pipeline import BuildConfig, build_artifact
from medusa_export.export.config import UnsupportedGraphError
from medusa_export.trt.readiness import check_artifact
from medusa_export.validation.validate import validate
from medusa_runtime.contract.artifact import load_artifact
from medusa_runtime.engines.kvcache import HeadMajorKVCache, KVCache, compact_in_place, write_accepted
from medusa_runtime.engines.ort import OrtEngine
from medusa_runtime.errors import ContextOverflowError
from medusa_runtime.decode.loop import causal_mask, generate
from medusa_runtime.trees.tree import make_tree
from medusa_runtime.trees.treespec import tree_from_spec

# Depth 3 with siblings at every depth: nodes far apart on a path (compaction moves rows).
TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0], [1, 0, 0]]
GQA = dict(vocab=1001, heads=4, kv_heads=2, medusa_heads=3, head_noise=0.3)
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 323, 84, 626]


@pytest.fixture(scope="module")
def gqa(tiny_hf):
    return tiny_hf(**GQA)


@pytest.fixture(scope="module")
def built(gqa, tmp_path_factory):
    """``built(graph, precision, validate)``: artifacts of the GQA model and TREE, built once each."""
    cache = {}
    lm = tiny_loaded(gqa[1], max_context=256)

    def get(graph: str, precision: str = "fp32", validate: bool = False):
        key = (graph, precision, validate)
        if key not in cache:
            out = tmp_path_factory.mktemp("fused") / f"{graph}-{precision}-{validate}"
            cfg = BuildConfig(graph=graph, precision=precision, validate=validate, new_tokens=24)
            cache[key] = build_artifact(lm, make_tree(TREE, num_heads=3), out, cfg, progress=False)
        return cache[key]

    return get


def _kv_rows(cache, start: int, stop: int) -> list[np.ndarray]:
    """Every layer's K and V of slots [start, stop) as [n, H_kv, D], whatever the cache layout."""
    if isinstance(cache, HeadMajorKVCache):
        return [buf[i, 0, :, start:stop].transpose(1, 0, 2) for i in range(len(cache.keys))
                for buf in (cache.keys, cache.values)]
    return [buf[0, start:stop] for k, v in zip(cache.keys, cache.values) for buf in (k, v)]


def _assert_step_close(a, b):
    np.testing.assert_array_equal(a.topk_ids, b.topk_ids)
    for x, y in ((a.topk_logprobs, b.topk_logprobs), (a.entropy, b.entropy), (a.token_logprobs, b.token_logprobs),
                 (a.hidden, b.hidden)):
        np.testing.assert_allclose(x, y, atol=1e-4, rtol=1e-4)
    for (ka, va), (kb, vb) in zip(a.new_kv, b.new_kv):
        np.testing.assert_allclose(ka, kb, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(va, vb, atol=1e-5, rtol=1e-5)


def test_fused_step_equals_portable_graph(built):
    """Prefill, then two tree steps at past length > 0 with the depth-3 tree mask; after each tree step
    a path of non-adjacent nodes is kept, so the second step reads a compacted cache."""
    engines = [OrtEngine(load_artifact(built(g))) for g in ("portable", "fused")]
    tree = load_artifact(built("fused")).tree
    b = tree.buffers()
    assert tree.max_depth == 3 and b.attention_mask.sum() > tree.size  # a real tree mask
    caches = [KVCache.for_engine(e, 64) for e in engines]
    assert isinstance(caches[1], HeadMajorKVCache) and caches[1].keys.shape == (2, 1, 2, 64, 16)
    n = len(PROMPT)
    ids = np.asarray(PROMPT, np.int64)[None]
    outs = [e.step(ids, np.arange(n)[None], causal_mask(n), 1.0, c.past()) for e, c in zip(engines, caches)]
    _assert_step_close(*outs)
    for c, o in zip(caches, outs):
        c.keep(o.new_kv, np.arange(n), PROMPT)
    rng = np.random.default_rng(0)
    for path in ([0, 1, 4, 7], [0, 2]):  # node indices of root -> [0] -> [0, 1] -> [0, 1, 0]; root -> [1]
        p = caches[0].length
        tokens = rng.integers(0, 1001, tree.size)[None]
        outs = [e.step(tokens, (p + b.depth)[None], b.attention_mask, 1.0, c.past()) for e, c in zip(engines, caches)]
        _assert_step_close(*outs)
        assert not np.allclose(outs[1].hidden[4], outs[1].hidden[5])  # siblings differ: the mask matters
        for c, o in zip(caches, outs):
            c.keep(o.new_kv, np.array(path), tokens[0, path])
        assert caches[1].length == caches[0].length == p + len(path)
        for x, y in zip(*(_kv_rows(c, 0, c.length) for c in caches)):
            np.testing.assert_allclose(x, y, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_tree_nodes_equal_a_causal_forward_of_their_path(built, temperature):
    """Each tree node's outputs equal plain causal decoding of prompt + its root-to-node path
    (the position ids are past length + depth, not + index)."""
    art = load_artifact(built("fused"))
    eng = OrtEngine(art)
    b = art.tree.buffers()
    cache = KVCache.for_engine(eng, 64)
    n = len(PROMPT)
    out = eng.step(np.asarray(PROMPT)[None], np.arange(n)[None], causal_mask(n), temperature, cache.past())
    cache.keep(out.new_kv, np.arange(n))
    tokens = np.arange(500, 500 + art.tree.size)
    tree_out = eng.step(tokens[None], (n + b.depth)[None], b.attention_mask, temperature, cache.past())
    for node in (4, 7, 9):
        seq = np.concatenate([PROMPT, tokens[b.attention_mask[node]]])
        full = eng.step(seq[None], np.arange(len(seq))[None], causal_mask(len(seq)), temperature,
                        KVCache.for_engine(eng, len(seq)).past())
        np.testing.assert_allclose(tree_out.hidden[node], full.hidden[-1], atol=1e-4)
        np.testing.assert_allclose(tree_out.topk_logprobs[node], full.topk_logprobs[-1], atol=1e-4)
        assert tree_out.topk_ids[node, 0] == full.topk_ids[-1, 0]


def test_manifest_flavour_layout_and_validation(built):
    path = built("fused", validate=True)
    m = json.loads((path / "manifest.json").read_text())
    assert m["flavour"] == "ort-fused"
    for op in ("com.microsoft::GroupQueryAttention", "com.microsoft::QuickGelu", "SimplifiedLayerNormalization"):
        assert op in m["flavour_note"]
    assert m["kv_layout"]["layout"] == "head-major"
    inputs = {t["name"]: t for t in m["graphs"]["model"]["inputs"]}
    assert inputs["past_key_values.1.value"]["shape"] == [1, 2, "C", 16]
    assert inputs["past_sequence_length"]["dtype"] == "int32"
    assert [t["name"] for t in m["graphs"]["model"]["outputs"]][-1] == "present.1.value"
    v = m["validation"]
    assert v["passed"] and v["tolerance"]["reference"] == "pytorch", v
    assert all(p["identical"] and p["vanilla_identical"] and p["tokens"] == 24 for p in v["prompts"])
    assert max(p["max_logprob_diff"] for p in v["prompts"]) < 1e-4
    ops = {(n.domain, n.op_type) for n in onnx.load(str(path / "model.onnx"), load_external_data=False).graph.node}
    assert ("com.microsoft", "GroupQueryAttention") in ops and ("", "Transpose") not in ops
    assert json.loads((built("portable") / "manifest.json").read_text())["kv_layout"]["layout"] == "sequence-major"


def test_tensorrt_readiness_refuses_the_fused_flavour(built):
    r = json.loads((built("fused") / "manifest.json").read_text())["trt_readiness"]
    assert not r["passed"]
    assert "flavour is 'ort-fused'" in r["errors"][0] and "--graph portable" in r["errors"][0]
    report = check_artifact(built("fused"))
    assert not report.passed
    assert [e.graph for e in report.errors] == ["manifest.json"]  # one error, not one per ONNX Runtime op
    assert check_artifact(built("portable")).passed


def test_greedy_through_the_runtime_equals_plain_greedy(built, gqa):
    """Medusa on the fused artifact == plain greedy of the same graph == transformers' greedy."""
    art = load_artifact(built("fused"))
    eng = OrtEngine(art)
    root = make_tree([], num_heads=3, topk=art.tree.topk)
    for prompt in (PROMPT, list(range(40, 90))):
        medusa = generate(eng, prompt, art.tree, max_new_tokens=32, max_context=256)
        plain = generate(eng, prompt, root, max_new_tokens=32, max_context=256)
        assert medusa.tokens == plain.tokens == plain_greedy(gqa[0], prompt, 32)
        assert len(medusa.tokens) == 32


@pytest.mark.parametrize("graph", ["fused", "portable"])
def test_the_loop_takes_its_context_from_the_artifact(built, graph):
    """medusa_runtime.decode.loop.generate without max_context: the artifact's 256 tokens (issue 16: a
    hard 2048 made a 256-context fused artifact fail on a 3-token prompt, and a 256-context
    portable one accept a 300-token prompt)."""
    eng = OrtEngine(load_artifact(built(graph)))
    tree = make_tree(TREE, num_heads=3)
    res = generate(eng, [5, 6, 7], tree, max_new_tokens=8)
    assert res.tokens == generate(eng, [5, 6, 7], tree, max_new_tokens=8, max_context=256).tokens
    assert len(res.tokens) == 8
    with pytest.raises(ContextOverflowError, match="the prompt has 300 tokens but only 256 of the 256-token context"):
        generate(eng, list(range(300)), tree, max_new_tokens=1)
    with pytest.raises(ContextOverflowError, match="max_context 2048 exceeds the engine's context of 256 tokens"):
        generate(eng, [5, 6, 7], tree, max_new_tokens=1, max_context=2048)


def test_accepting_full_paths_equals_plain_greedy(tiny_hf, tmp_path):
    """Vocabulary 8 and every depth-2 path of the top 8: each step accepts two candidates at
    scattered node indices, so the in-place cache moves rows every step."""
    hf, model = tiny_hf(vocab=8, seed=7)
    full = make_tree([p for d in (1, 2) for p in itertools.product(range(8), repeat=d)], num_heads=3, topk=8)
    path = build_artifact(tiny_loaded(model, max_context=256), full, tmp_path / "v8",
                          BuildConfig(graph="fused", validate=False), progress=False)
    eng = OrtEngine(load_artifact(path))
    prompt = [3]
    res = generate(eng, prompt, full, max_new_tokens=40, max_context=256)
    assert res.tokens == plain_greedy(hf, prompt, 40)
    assert res.accept_depths[:5] == [2] * 5  # full paths accepted


def test_weight_only_precision_composes_with_fused(built):
    path = built("fused", "int4", validate=True)
    m = json.loads((path / "manifest.json").read_text())
    assert m["flavour"] == "ort-fused" and "com.microsoft::MatMulNBits" in m["flavour_note"]
    assert m["precision"]["name"] == "int4" and m["precision"]["quantized_matmuls"]["model.onnx"]["quantized"] > 0
    v = m["validation"]
    assert v["passed"] and v["tolerance"]["reference"] == "vanilla", v
    assert all(p["vanilla_identical"] for p in v["prompts"])
    ops = {n.op_type for n in onnx.load(str(path / "model.onnx"), load_external_data=False).graph.node}
    assert {"MatMulNBits", "GroupQueryAttention"} <= ops and "MatMul" not in ops


def test_chain_only_graph_leaves_positions_and_mask_to_gqa_bit_for_bit(built, gqa, tmp_path, monkeypatch):
    """An int4 (accuracy level 4) fused graph runs chains only (manifest step_rows), so its GroupQueryAttention
    takes neither position_ids nor attention_bias; its outputs equal, bit for bit, those of the same graph
    written with both wired (the general tree graph), on a prefill, padded one-token steps and chain steps."""
    from medusa_export.export import fused, writer

    chain_path = built("fused", "int4")
    assert json.loads((chain_path / "manifest.json").read_text())["precision"]["step_rows"]["trees"] == "chain"
    monkeypatch.setattr(writer, "write_fused_step", lambda *a, **kw: fused.write_fused_step(*a, **{**kw, "chain": False}))
    wired_path = build_artifact(tiny_loaded(gqa[1], max_context=256), make_tree(TREE, num_heads=3), tmp_path / "wired",
                                BuildConfig(graph="fused", precision="int4", validate=False), progress=False)

    def gqa_inputs(path):
        nodes = onnx.load(str(path / "model.onnx"), load_external_data=False).graph.node
        return [list(n.input[9:11]) for n in nodes if n.op_type == "GroupQueryAttention"]

    assert all(ins == ["", ""] for ins in gqa_inputs(chain_path))
    assert all(ins[0] == "position_ids" and ins[1] for ins in gqa_inputs(wired_path))
    results = []
    for path in (chain_path, wired_path):
        eng = OrtEngine(load_artifact(path))
        cache = eng.make_cache(64)
        out, steps, p = [], [PROMPT, [7], [8, 9], [10], [11, 12, 13]], 0
        for ids in steps:
            s = len(ids)
            r = eng.step(np.array([ids]), (p + np.arange(s))[None], causal_mask(s), 1.0, cache.past())
            out += [r.topk_ids.copy(), r.topk_logprobs.copy(), r.token_logprobs.copy(), r.hidden.copy()]
            cache.keep(r.new_kv, np.arange(s))
            p += s
        results.append(out)
    assert len(results[0]) == len(results[1]) == 20
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


def test_chat_reuses_the_in_place_cache_like_the_portable_artifact(built):
    """Multi-turn chat: later turns prefill after a reused, truncated prefix of the head-major cache."""
    from medusa_runtime.front.session import MedusaSession

    sessions = [MedusaSession(built(g), threads=2) for g in ("portable", "fused")]
    for i, turn in enumerate(("Write a poem about the sea.", "Now make it shorter.", "Explain it.")):
        replies = [s.chat(turn, max_new_tokens=12) for s in sessions]
        assert replies[0].token_ids == replies[1].token_ids and replies[0].token_ids
        assert replies[0].reused_tokens == replies[1].reused_tokens and (replies[1].reused_tokens > 0) == (i > 0)


@pytest.mark.parametrize("accepted", [[0], [0, 1, 2], [0, 2, 5], [0, 3, 4, 9]])
def test_compact_in_place_equals_write_accepted(accepted):
    """Head-major in-place compaction (axis 2) leaves the slots that copying the accepted rows into a
    sequence-major cache gives."""
    rng = np.random.default_rng(1)
    past, t = 5, 10
    new = rng.standard_normal((1, t, 2, 4))  # [1, T, H_kv, D]
    expected = np.zeros((1, 32, 2, 4))
    write_accepted(expected, new, past, np.array(accepted))
    head_major = np.zeros((1, 2, 32, 4))
    head_major[:, :, past:past + t] = new.transpose(0, 2, 1, 3)  # what the step wrote
    assert compact_in_place(head_major, past, np.array(accepted)) == past + len(accepted)
    n = past + len(accepted)
    np.testing.assert_array_equal(head_major[:, :, :n].transpose(0, 2, 1, 3), expected[:, :n])


def test_in_place_cache_refuses_what_does_not_fit(built):
    eng = OrtEngine(load_artifact(built("fused")))
    with pytest.raises(ContextOverflowError, match="exceeds this artifact's max context 256"):
        eng.make_cache(257)
    cache = eng.make_cache(8)
    with pytest.raises(ContextOverflowError, match="does not fit"):
        eng.step(np.zeros((1, 9), np.int64), np.arange(9)[None], causal_mask(9), 1.0, cache.past())
    cache.length = 7
    with pytest.raises(ContextOverflowError):
        cache.keep([], np.array([0, 1]))


@pytest.mark.parametrize("kw, match", [
    (dict(graph="fused", precision="fp16"), "--graph fused does not take --precision fp16.*choose --precision fp32, "
                                            "int8, int4, or --graph portable"),
    (dict(graph="fast"), "unknown graph 'fast'; choose one of portable, contrib, fused"),
])
def test_bad_graph_choices_are_typed_errors(kw, match):
    with pytest.raises(UnsupportedGraphError, match=match):
        BuildConfig(**kw)


def test_cli_rejects_a_fused_fp16_build(tmp_path, capsys):
    from medusa_export.cli.main import main

    assert main(["build", "--graph", "fused", "--precision", "fp16", "--out", str(tmp_path / "out")]) == 2
    assert "--graph fused does not take --precision fp16" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_embedded_fused_artifact_matches_pytorch_on_mt_bench(smollm, tmp_path):
    """SmolLM2-135M, fused graph: step outputs within fp32 tolerance of PyTorch, greedy tokens identical to
    the PyTorch reference, and Medusa (16-node tree steps) identical to plain greedy (one-token steps)."""
    tree = tree_from_spec(SMOLLM_TREE, num_heads=smollm.model.num_heads, accuracies=smollm.head_accuracies)
    path = build_artifact(smollm, tree, tmp_path / "fused", BuildConfig(graph="fused", max_context=1024, validate=False),
                          progress=False)
    texts = mt_bench_prompts(2)
    ids = [apply_chat_template(smollm.tokenizer, smollm.chat_template, [{"role": "user", "content": t}]) for t in texts]
    report = validate(load_artifact(path), smollm.model, ids, texts, new_tokens=32, eos_token_ids=smollm.eos_token_ids,
                      progress=False)
    assert report.passed, report.failures()
    assert all(p.identical and p.vanilla_identical and p.tokens > 0 for p in report.prompts)
    assert max(p.max_logprob_diff for p in report.prompts) < 1e-3


def test_prefills_bind_fresh_buffers_and_tree_rows_keep_theirs(built):
    """Row counts up to KEPT_ROWS keep their bound buffers (a step of a kept count reuses them); longer steps
    (prefills: prompt lengths vary) are not kept, so the engine's memory does not grow with every new prompt length;
    the outputs are those of a fresh engine either way."""
    from medusa_runtime.engines.ort import KEPT_ROWS

    path = built("fused")
    eng, fresh = OrtEngine(load_artifact(path)), OrtEngine(load_artifact(path))
    cache, p = eng.make_cache(256), 0
    for n in (KEPT_ROWS + 3, 2, KEPT_ROWS + 1, 2, 1, 1):
        ids = (np.arange(n) * 7 + p) % 1000
        want = fresh.step(ids[None], (p + np.arange(n))[None], causal_mask(n), 1.0, fresh.make_cache(256).past()) \
            if p == 0 else None
        got = eng.step(ids[None], (p + np.arange(n))[None], causal_mask(n), 1.0, cache.past())
        if want is not None:
            np.testing.assert_array_equal(got.topk_logprobs, want.topk_logprobs)
        cache.keep(got.new_kv, np.arange(n))
        p += n
    assert sorted(eng._rows) == [1, 2]  # the two prefill lengths left nothing behind
