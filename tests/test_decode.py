"""The PyTorch reference Medusa model and decode loop on tiny random Llamas.

Reference for every token comparison: transformers' own greedy ``generate`` on the same
weights (an independent implementation), never our backbone run another way.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from conftest import plain_greedy
from medusa_export.model.decode import TorchEngine, medusa_generate
from medusa_runtime.decode.acceptance import SamplingConfig, accept_greedy
from medusa_runtime.engines.kvcache import KVCache
from medusa_runtime.errors import ContextOverflowError, MedusaError
from medusa_runtime.decode.loop import causal_mask, generate
from medusa_runtime.trees.tree import gather_candidates, make_tree
from medusa_runtime.trees.treespec import tree_from_spec

# Grouped-query attention (4 heads, 2 KV heads), vocabs that are not multiples of 8. (Tied embeddings
# are covered by the embedded model: a tiny random tied model only repeats its input token.)
GQA_MODELS = {
    "v1001": dict(vocab=1001, seed=0),
    "v32001-4heads": dict(vocab=32001, seed=1, medusa_heads=4, head_noise=0.02),
}
# vocab 8, 3 Medusa heads: the full tree (every path of depth <= 3, top-8) holds every continuation,
# so every step accepts 3 candidates and compaction moves K/V every step. Seed 7: varied greedy output.
VOCAB8 = dict(vocab=8, seed=7)
FULL_TREE = make_tree([p for d in (1, 2, 3) for p in itertools.product(range(8), repeat=d)], num_heads=3, topk=8)
PROMPTS = {"len1": [3], "len12": [3, 1, 4, 1, 5, 1, 2, 6, 5, 3, 5, 7]}  # ids < 8: valid for every model
N_NEW = 40


@pytest.fixture(scope="module")
def reference(tiny_hf):
    """reference(model_kwargs, prompt) -> transformers' greedy continuation (N_NEW tokens), memoised."""
    memo = {}

    def ref(model_kw: dict, prompt: list[int]) -> list[int]:
        key = (tuple(sorted(model_kw.items())), tuple(prompt))
        if key not in memo:
            memo[key] = plain_greedy(tiny_hf(**model_kw)[0], prompt, N_NEW)
        return memo[key]

    return ref


@pytest.fixture(scope="module")
def vocab8(tiny_hf, reference):
    """(MedusaModel, prompt, greedy reference) for the vocab-8 model and a length-1 prompt."""
    prompt = PROMPTS["len1"]
    ref = reference(VOCAB8, prompt)
    assert len(set(ref)) >= 4, ref  # not a trivial repetition
    return tiny_hf(**VOCAB8)[1], prompt, ref


# --- lossless greedy ---------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", PROMPTS.values(), ids=PROMPTS.keys())
@pytest.mark.parametrize("spec", ["root", "4", "16", "64", "chain"])
@pytest.mark.parametrize("model_kw", GQA_MODELS.values(), ids=GQA_MODELS.keys())
def test_greedy_equals_plain_greedy(tiny_hf, reference, model_kw, spec, prompt):
    model = tiny_hf(**model_kw)[1]
    tree = tree_from_spec(spec, num_heads=model.num_heads)
    assert tree.size == (1 if spec == "root" else 1 + model.num_heads if spec == "chain" else int(spec))
    ref = reference(model_kw, prompt)
    assert len(set(ref)) >= 8, ref
    res = medusa_generate(model, prompt, tree, max_new_tokens=N_NEW)
    assert res.tokens == ref
    assert res.finish_reason == "length"
    assert sum(res.step_tokens) + 1 >= N_NEW  # prefill gives the first token, each step the rest


@pytest.mark.parametrize("prompt", PROMPTS.values(), ids=PROMPTS.keys())
def test_full_tree_accepts_three_candidates_every_step(tiny_hf, reference, prompt):
    model = tiny_hf(**VOCAB8)[1]
    ref = reference(VOCAB8, prompt)
    assert len(set(ref)) >= 3, ref
    res = medusa_generate(model, prompt, FULL_TREE, max_new_tokens=N_NEW)
    assert res.tokens == ref
    # 1 + 4 * 9 = 37 tokens after 9 full steps; the 10th accepts 4 but max_new_tokens keeps 3 (counted: 3)
    assert res.step_tokens == [4] * 9 + [3] and res.accept_depths == [3] * 10


@pytest.mark.parametrize("spec", ["16", "64"])
def test_partial_acceptance_equals_plain_greedy(vocab8, spec):
    """Trees that hold some continuations: accepted lengths vary from step to step."""
    model, prompt, ref = vocab8
    res = medusa_generate(model, prompt, tree_from_spec(spec, num_heads=3, topk=8), max_new_tokens=N_NEW)
    assert res.tokens == ref
    assert len(set(res.step_tokens)) >= 3, res.step_tokens


def test_typical_acceptance_is_reproducible(vocab8):
    model, prompt, _ = vocab8
    runs = [medusa_generate(model, prompt, FULL_TREE, max_new_tokens=24,
                            sampling=SamplingConfig(0.7, "typical", seed=s)) for s in (3, 3, 4)]
    assert runs[0].tokens == runs[1].tokens and runs[0].step_tokens == runs[1].step_tokens
    assert len(runs[0].tokens) == 24 and all(0 <= t < 8 for t in runs[0].tokens)
    assert runs[0].tokens != runs[2].tokens  # another seed samples other bonus tokens


# --- the tree step ------------------------------------------------------------------------------


@torch.no_grad()
@pytest.mark.parametrize("past_len", [0, 9])
def test_tree_node_logits_equal_causal_forward(tiny_hf, past_len):
    """Each node's logits = transformers' causal forward over past + the node's root-to-node path."""
    hf, model = tiny_hf(**GQA_MODELS["v1001"])
    tree = tree_from_spec("64", num_heads=model.num_heads)
    b = tree.buffers()
    g = torch.Generator().manual_seed(past_len)
    past_ids = torch.randint(0, 1001, (past_len,), generator=g).tolist()
    tokens = torch.randint(0, 1001, (tree.size,), generator=g)
    past = model.backbone.empty_past()
    if past_len:
        _, _, past = model(torch.tensor([past_ids]), torch.arange(past_len)[None],
                           torch.from_numpy(causal_mask(past_len)), past)
    logits, _, new_kv = model(tokens[None], torch.as_tensor(past_len + b.depth)[None],
                              torch.as_tensor(b.attention_mask), past)
    assert logits.shape == (1, tree.size, 1001) and new_kv[0][0].shape == (1, tree.size, 2, 16)
    for node in range(tree.size):
        path = np.flatnonzero(b.attention_mask[node])  # ancestors in node order = root-to-node order
        seq = torch.tensor([past_ids + tokens[path].tolist()])
        expected = hf(seq).logits[0, -1]
        torch.testing.assert_close(logits[0, node], expected, atol=1e-5, rtol=1e-5)


# --- KV compaction --------------------------------------------------------------------------------


def one_by_one_cache(engine: TorchEngine, tokens: list[int], capacity: int) -> KVCache:
    """The cache of feeding ``tokens`` one at a time (S = 1 steps)."""
    cache = KVCache.for_engine(engine, capacity)
    for pos, tok in enumerate(tokens):
        out = engine.step(np.array([[tok]]), np.array([[pos]]), np.ones((1, 1), bool), 1.0, cache.past())
        cache.keep(out.new_kv, np.array([0]))
    return cache


def assert_same_cache(cache: KVCache, expected: KVCache):
    assert cache.length == expected.length
    n = cache.length
    for got, want in zip(cache.keys + cache.values, expected.keys + expected.values):
        np.testing.assert_allclose(got[:, :n], want[:, :n], atol=1e-5, rtol=1e-5)
        assert not got[:, n:].any()  # nothing written past the valid length


def test_compaction_of_one_step_equals_one_by_one(tiny_hf, reference):
    """One tree step by hand (prefill, step, accept_greedy, keep) with heads whose guesses put the
    true continuation on the path [0, 1, 0]: a bushy tree, accepted nodes far apart."""
    model_kw = GQA_MODELS["v1001"]
    model = tiny_hf(**model_kw)[1]
    engine = TorchEngine(model)
    prompt = PROMPTS["len12"]
    ref = reference(model_kw, prompt)
    tree = tree_from_spec("64", num_heads=3)
    b = tree.buffers()
    rng = np.random.default_rng(0)
    heads_topk = rng.choice(np.setdiff1d(np.arange(1001), ref[:5]), size=(3, 10), replace=False)
    heads_topk[0, 0], heads_topk[1, 1], heads_topk[2, 0] = ref[1], ref[2], ref[3]
    cache = KVCache.for_engine(engine, 64)
    out = engine.step(np.array([prompt]), np.arange(len(prompt))[None], causal_mask(len(prompt)), 1.0, cache.past())
    cache.keep(out.new_kv, np.arange(len(prompt)))
    root = int(out.topk_ids[-1, 0])
    assert root == ref[0]
    tokens = gather_candidates(root, heads_topk, tree)
    out = engine.step(tokens[None], (cache.length + b.depth)[None], b.attention_mask, 1.0, cache.past())
    acc = accept_greedy(tree, tokens, out.topk_ids[:, 0])
    index = {p: n for n, p in enumerate([()] + list(tree.choices))}
    expected_path = [index[()], index[(0,)], index[(0, 1)], index[(0, 1, 0)]]
    assert acc.accepted.tolist() == expected_path and expected_path[-1] > 40
    assert acc.next_token == ref[4]
    cache.keep(out.new_kv, acc.accepted)
    assert_same_cache(cache, one_by_one_cache(engine, prompt + ref[:4], 64))


def test_cache_after_generation_equals_one_by_one(vocab8):
    """The decode loop's cache after 3 full-tree steps (compaction every step)."""
    model, prompt, ref = vocab8
    engine = TorchEngine(model)
    capacity = len(prompt) + 12 + FULL_TREE.size  # room for the 3rd step's whole tree
    cache = KVCache.for_engine(engine, capacity)
    res = generate(engine, prompt, FULL_TREE, max_new_tokens=13, cache=cache)
    assert res.tokens == ref[:13] and res.step_tokens == [4, 4, 4]
    # cached: the prompt, then each step's root + 3 accepted candidates; the last bonus token is not
    assert cache.length == len(prompt) + 12
    assert_same_cache(cache, one_by_one_cache(engine, prompt + ref[:12], capacity))


# --- stops ------------------------------------------------------------------------------------------


def test_eos_in_the_middle_of_an_accepted_path(vocab8):
    model, prompt, ref = vocab8
    # With 4 tokens per step, step s emits ref[4s-3 .. 4s]: index i with i % 4 == 2 is the 2nd of 4.
    i = next(i for i in range(2, N_NEW) if i % 4 == 2 and ref[i] not in ref[:i])
    res = medusa_generate(model, prompt, FULL_TREE, max_new_tokens=N_NEW, eos_token_ids=[ref[i]])
    assert res.tokens == ref[:i]
    assert res.finish_reason == "stop"
    assert res.steps == (i + 2) // 4  # it stopped inside the last step's path (3 candidates accepted) ...
    assert res.accept_depths == [3] * (res.steps - 1) + [1]  # ... of which 1 before EOS counts (issue 27)
    assert res.step_tokens[-1] == 1 and len(res.tokens) == 1 + sum(res.step_tokens)  # only the emitted token counts


@pytest.mark.parametrize("max_new", [0, 1, 2, 5, 6, 13])
def test_max_new_tokens_is_exact(vocab8, max_new):
    model, prompt, ref = vocab8
    res = medusa_generate(model, prompt, FULL_TREE, max_new_tokens=max_new)
    assert res.tokens == ref[:max_new]
    assert res.finish_reason == "length"
    assert res.steps == max(0, math.ceil((max_new - 1) / 4))


def test_context_full_after_prompt_gives_one_token(vocab8, reference):
    """No room for any tree step: the prefill's token only, finish "length"."""
    model, _, _ = vocab8
    prompt = PROMPTS["len12"]
    res = medusa_generate(model, prompt, FULL_TREE, max_new_tokens=N_NEW, max_context=len(prompt))
    assert res.tokens == reference(VOCAB8, prompt)[:1]
    assert res.finish_reason == "length" and res.steps == 0


def test_prompt_longer_than_context_is_refused(vocab8):
    model, _, _ = vocab8
    with pytest.raises(ContextOverflowError, match="the prompt has 12 tokens but only 11"):
        medusa_generate(model, PROMPTS["len12"], FULL_TREE, max_new_tokens=4, max_context=11)


@pytest.mark.parametrize("spec, room", [("16", 30), ("full", 10), ("16", 15)])
def test_small_context_falls_back_to_root_steps(vocab8, spec, room):
    """When the tree no longer fits, root-only steps continue: exactly plain greedy up to capacity
    (a context of C tokens holds C - prompt + 1 new tokens: the last one needs no cache slot)."""
    model, prompt, ref = vocab8
    tree = FULL_TREE if spec == "full" else tree_from_spec(spec, num_heads=3, topk=8)
    res = medusa_generate(model, prompt, tree, max_new_tokens=N_NEW, max_context=len(prompt) + room)
    assert res.tokens == ref[: room + 1]
    assert res.finish_reason == "length"
    assert res.step_tokens[-1] == 1
    if tree.size <= room:
        assert max(res.step_tokens) > 1  # the tree was used while it fitted
    else:
        assert set(res.step_tokens) == {1}


@pytest.mark.parametrize(
    "prompt, kwargs, message",
    [
        ([], {}, "the prompt is empty"),
        ([3], {"max_new_tokens": -1}, "max_new_tokens must be an integer >= 0, got -1"),
        ([3], {"max_context": 0}, "max_context must be an integer >= 1, got 0"),
        ([3], {"tree": tree_from_spec("chain", num_heads=4, topk=8)}, "tree depth 4 exceeds the engine's 3"),
    ],
)
def test_bad_generation_arguments(vocab8, prompt, kwargs, message):
    model = vocab8[0]
    kw = {"tree": FULL_TREE, "max_new_tokens": 4, **kwargs}
    with pytest.raises(MedusaError, match=message):  # typed: the CLI prints the message, no traceback
        medusa_generate(model, prompt, kw.pop("tree"), **kw)
