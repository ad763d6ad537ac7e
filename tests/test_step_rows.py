"""The row regime of int8-activation backbones (manifest ``precision.step_rows``): one-token steps run as two rows and
trees are chains, so that Medusa equals plain greedy decoding of the same graph bit for bit (issue 41, item 4).

The facts it rests on are measured on ONNX Runtime's CPU kernels here, with the graph's own multi-row computation as
the reference for a row: a padded one-row step gives the bits of that row inside a chain step, an unpadded one does
not (the control that shows the regime is needed).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conftest import mt_bench_prompts
from medusa_export.export.config import ExportConfig
from medusa_runtime.contract.artifact import load_artifact
from medusa_runtime.decode.loop import causal_mask, generate
from medusa_runtime.engines.base import SamplerInputs
from medusa_runtime.engines.ort import OrtEngine, pad_rows
from medusa_runtime.errors import InvalidTreeError
from medusa_runtime.trees.tree import chain_tree, greedy_tree, is_chain, make_tree
from medusa_runtime.trees.treespec import parse_tree_spec, tree_from_spec
from medusa_runtime.tuning.resolve import TreeContext, resolve_tree


def test_pad_rows_by_hand():
    ids, pos = np.array([[7, 8]]), np.array([[10, 11]])
    mask = np.array([[True, False], [True, True]])
    samp = SamplerInputs(np.array([0.5, -1.0], np.float32), 0, 1.0)
    p_ids, p_pos, p_mask, p_samp = pad_rows(ids, pos, mask, samp, 4)
    assert p_ids.tolist() == [[7, 8, 8, 8]]
    assert p_pos.tolist() == [[10, 11, 12, 13]]
    assert p_mask.tolist() == [[True, False, False, False],  # the real rows see no padding row
                               [True, True, False, False],
                               [True, True, True, False],  # a padding row sees the real rows and itself
                               [True, True, True, True]]
    assert p_samp.uniforms.tolist() == [0.5, -1.0, -1.0, -1.0]  # padding rows are never sampled
    assert pad_rows(ids, pos, mask, None, 3)[3] is None


def test_chain_grammar_and_shapes():
    assert parse_tree_spec("chain:3").kind == "chain" and parse_tree_spec("chain:3").size == 3
    for bad in ("chain:0", "chain:x", "chain:"):
        with pytest.raises(InvalidTreeError, match="chain:N takes a node count"):
            parse_tree_spec(bad)
    t = tree_from_spec("chain:3", num_heads=4, topk=10)
    assert t.choices == ((0,), (0, 0)) and is_chain(t)
    assert tree_from_spec("chain", num_heads=4).size == 5
    with pytest.raises(InvalidTreeError, match="1..5 nodes"):
        tree_from_spec("chain:6", num_heads=4)
    assert is_chain(make_tree([], num_heads=4))
    assert not is_chain(make_tree([(0,), (1,)], num_heads=4))  # two depth-1 nodes: a branch


def test_only_level_4_weight_only_backbones_ask_for_the_regime():
    assert ExportConfig(precision="int4", graph="fused", accuracy_level=4).step_rows["min_rows"] == 2
    assert ExportConfig(precision="int4", graph="fused", accuracy_level=4).step_rows["trees"] == "chain"
    assert ExportConfig(precision="int4", graph="fused", accuracy_level=1).step_rows is None
    assert ExportConfig(precision="fp32").step_rows is None
    qdq = ExportConfig(precision="int4")  # the portable Q/DQ graph: two-row steps, any tree
    assert (qdq.step_rows["min_rows"], qdq.step_rows["trees"]) == (2, "any")


def test_chains_only_context_refuses_branching_trees_and_times_chains():
    acc = np.full((4, 10), 0.2)
    ctx = TreeContext(num_heads=4, topk=10, accuracies=acc, chains_only=True)
    with pytest.raises(InvalidTreeError, match="int8 activations.*chain:N"):
        resolve_tree("8", ctx)
    with pytest.raises(InvalidTreeError, match="branches"):
        resolve_tree(greedy_tree(4, acc), ctx)
    with pytest.raises(InvalidTreeError, match="branches"):
        resolve_tree("dynamic:4", ctx)
    assert resolve_tree("chain:2", ctx).tree.size == 2
    deferred = resolve_tree("auto", ctx)  # build: the longest chain is exported, timed afterwards
    assert deferred.deferred and deferred.tree.size == 5 and is_chain(deferred.tree) and deferred.policy == "chain"
    assert resolve_tree("8", TreeContext(num_heads=4, topk=10, accuracies=acc)).tree.size == 8  # no regime: any tree


@pytest.fixture(scope="module")
def int4_level4(smollm, tmp_path_factory):
    """The embedded model's fused int4 artifact with int8 activations (accuracy level 4), 3-node chain, unvalidated."""
    from medusa_export.pipeline import BuildConfig, build_artifact

    out = tmp_path_factory.mktemp("rows") / "int4-l4"
    tree = chain_tree(smollm.model.num_heads, nodes=3)
    return build_artifact(smollm, tree, out, BuildConfig(precision="int4", graph="fused", accuracy_level=4, max_context=1024,
                                                          heads_precision="int8", validate=False), progress=False)


@pytest.mark.slow
def test_padded_one_row_steps_give_the_bits_of_a_chain_step(int4_level4):
    art = load_artifact(int4_level4)
    assert art.manifest.precision.step_rows.min_rows == 2 and art.manifest.precision.step_rows.trees == "chain"
    eng = OrtEngine(art, threads=2)
    assert (eng.capabilities.min_rows, eng.capabilities.chain_trees) == (2, True)
    prompt = np.array([1, 504, 3458, 314, 253, 1056, 28, 900, 77, 4000, 12, 13], np.int64)
    chain = np.array([451, 3415, 253, 88, 1200, 19], np.int64)
    n, t = len(prompt), len(chain)

    def prefilled():
        cache = eng.make_cache(64)
        out = eng.step(prompt[None], np.arange(n)[None], causal_mask(n), 1.0, cache.past())
        cache.keep(out.new_kv, np.arange(n), prompt)
        return cache

    cache = prefilled()
    whole = eng.step(chain[None], (n + np.arange(t))[None], causal_mask(t), 1.0, cache.past()).hidden.copy()
    rows = {}
    for padded in (True, False):
        eng.capabilities = dataclasses.replace(eng.capabilities, min_rows=2 if padded else 1)
        cache, got = prefilled(), []
        for j, tok in enumerate(chain):
            out = eng.step(np.array([[tok]]), np.array([[n + j]]), np.ones((1, 1), bool), 1.0, cache.past())
            assert out.hidden.shape == (1, whole.shape[1]) and out.token_logprobs.shape == (1, 1)
            got.append(out.hidden[0].copy())
            cache.keep(out.new_kv, np.array([0]), [int(tok)])
        rows[padded] = np.stack(got)
    assert np.array_equal(rows[True], whole)  # bit for bit
    assert not np.array_equal(rows[False], whole)  # the one-row kernel rounds otherwise: the regime is needed
    assert np.abs(rows[False] - whole).max() > 1e-3  # and int8 activations amplify it


@pytest.mark.slow
def test_chain_medusa_equals_plain_greedy_of_the_same_int8_activation_graph(int4_level4):
    from medusa_runtime.contract.tokenizer import RuntimeTokenizer

    art = load_artifact(int4_level4)
    eng = OrtEngine(art, threads=2)
    tok = RuntimeTokenizer.from_artifact(art)
    root = make_tree([], num_heads=eng.num_heads, topk=art.tree.topk)
    chains = [chain_tree(eng.num_heads, art.tree.topk, k) for k in (2, 5)]
    for text in mt_bench_prompts(3):
        ids = tok.apply_chat_template([{"role": "user", "content": text}])
        plain = generate(eng, ids, root, max_new_tokens=96).tokens
        for tree in chains:
            res = generate(eng, ids, tree, max_new_tokens=96)
            assert res.tokens == plain, (text[:40], tree.size)
            assert len(res.tokens) > len(res.step_tokens) + 1  # the chain accepted guesses: not plain in disguise
    with pytest.raises(InvalidTreeError, match="branches"):
        resolve_tree("16", TreeContext.of_artifact(art, eng))
