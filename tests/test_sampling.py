"""Exact sampling (acceptance "sample"): the joint law of the first generated tokens is plain sampling's.

A tiny random Llama with a 24-token vocabulary (its lm_head scaled up, so that next-token
distributions are peaked and depend on the context), exported with the current exporter and run
by the runtime (ONNX Runtime), trees of 4 and 16 nodes. The reference is exact: the probability
of every 3-token continuation, enumerated from transformers' own logits and logits warpers
(TemperatureLogitsWarper -> TopKLogitsWarper -> TopPLogitsWarper, the order of transformers'
sampling). The empirical law over N seeds is compared by total variation with a bound sized from
the exact law itself (the 99.9% quantile of the TV of N multinomial draws): "sample" must pass it,
typical acceptance at its defaults must fail it. Whole-vocabulary sampling runs through the
in-graph sampler that every step graph carries (``export/sampler.py``, manifest ``step_sampler``),
checked against the contract of docs/sampling.md computed here in float64 from transformers' logits,
in both graph flavours.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from conftest import make_tiny_medusa, plain_greedy, tiny_loaded
from medusa_export.model.decode import TorchEngine
from medusa_runtime.decode.acceptance import SamplingConfig, draw_tokens
from medusa_runtime.contract.artifact import load_artifact
from medusa_runtime.engines.base import SamplerInputs
from medusa_runtime.engines.kvcache import KVCache
from medusa_runtime.engines.ort import OrtEngine
from medusa_runtime.errors import UnsupportedSamplingError
from medusa_runtime.decode.loop import causal_mask, generate
from medusa_runtime.trees.treespec import tree_from_spec

VOCAB = 24
PROMPT = [3, 1, 4, 1]
N = 1000  # seeds per law
TREES = {"4": tree_from_spec("4", num_heads=3), "16": tree_from_spec("16", num_heads=3)}
ROOT = tree_from_spec("root", num_heads=3)


@pytest.fixture(scope="module")
def peaked():
    """(transformers model, MedusaModel) sharing weights; lm_head x10: entropies ~1-2 nats over 24 tokens."""
    hf, model = make_tiny_medusa(vocab=VOCAB, seed=0, medusa_heads=3)
    with torch.no_grad():
        model.backbone.lm_head.weight.mul_(10.0)  # the heads share it (initial heads): candidates stay the base's top-k
    return hf, model


@pytest.fixture(scope="module")
def engines(peaked, tmp_path_factory):
    """(a PyTorch engine without the in-graph sampler, the ONNX Runtime engine of the built artifact, which has it)."""
    from medusa_export.pipeline import BuildConfig, build_artifact

    root = tmp_path_factory.mktemp("sampling")
    art = build_artifact(tiny_loaded(peaked[1], max_context=64), TREES["16"], root / "art", BuildConfig(validate=False),
                         progress=False)
    return TorchEngine(peaked[1], max_context=64), OrtEngine(load_artifact(art), threads=1)


def exact_law(hf, temperature: float, top_k: int, top_p: float) -> dict[tuple[int, int, int], float]:
    """P(x1, x2, x3) of plain sampling after PROMPT, every continuation enumerated (transformers' warpers)."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    def q(prefixes):
        with torch.no_grad():
            scores = hf(torch.tensor([PROMPT + list(p) for p in prefixes])).logits[:, -1].double()
        scores = TemperatureLogitsWarper(temperature)(None, scores)
        scores = TopKLogitsWarper(top_k)(None, scores) if top_k else scores
        scores = TopPLogitsWarper(top_p)(None, scores) if top_p < 1 else scores
        return torch.softmax(scores, -1).numpy()

    law = {}
    p1 = q([()])[0]
    firsts = [(int(a),) for a in np.flatnonzero(p1)]
    p2 = q(firsts)
    pairs = [(a, int(b), p1[a] * p2[i, b]) for i, (a,) in enumerate(firsts) for b in np.flatnonzero(p2[i])]
    p3 = q([(a, b) for a, b, _ in pairs])
    for j, (a, b, pab) in enumerate(pairs):
        for c in np.flatnonzero(p3[j]):
            law[(a, b, int(c))] = pab * p3[j, c]
    assert abs(sum(law.values()) - 1) < 1e-9
    return law


def tv_bound(law: dict, n: int, quantile: float = 0.999) -> float:
    """The TV distance that N samples of ``law`` itself stay under with probability ``quantile``."""
    p = np.array(list(law.values()))
    draws = np.random.default_rng(0).multinomial(n, p, size=4000) / n
    return float(np.quantile(0.5 * np.abs(draws - p).sum(axis=1), quantile))


def tv(law: dict, outputs: list[tuple]) -> float:
    """Total variation between the empirical law of ``outputs`` and ``law`` (outcomes outside it count fully)."""
    keys, counts = np.unique(np.array(outputs), axis=0, return_counts=True)
    emp = {tuple(int(x) for x in k): c / len(outputs) for k, c in zip(keys, counts)}
    return 0.5 * sum(abs(emp.get(k, 0.0) - law.get(k, 0.0)) for k in set(emp) | set(law))


def first_three(engine, tree, cfg: SamplingConfig, seeds=range(N)) -> tuple[list[tuple], int]:
    """The first 3 tokens for each seed (EOS ignored) and the candidates accepted in all."""
    outs, accepted = [], 0
    for seed in seeds:
        r = generate(engine, PROMPT, tree, max_new_tokens=3, sampling=dataclasses.replace(cfg, seed=seed))
        outs.append(tuple(r.tokens))
        accepted += sum(r.accept_depths)
    return outs, accepted


@pytest.mark.parametrize("tree", TREES)
def test_sample_has_plain_samplings_law_and_typical_does_not(peaked, engines, tree):
    """Top-k 4 from the step's top-k outputs (the host draw): sample passes, typical at its defaults fails."""
    hf, _ = peaked
    cfg = SamplingConfig(temperature=1.0, top_k=4)
    law = exact_law(hf, 1.0, 4, 1.0)
    bound = tv_bound(law, N)
    sample, accepted = first_three(engines[1], TREES[tree], cfg)
    vanilla, _ = first_three(engines[1], ROOT, cfg)
    typical, _ = first_three(engines[1], TREES[tree], dataclasses.replace(cfg, acceptance="typical"))
    assert accepted >= 0.2 * N  # the tree did its work: candidates were accepted, not only root draws
    assert sample == vanilla  # token for token, seed by seed (the m-th uniform drives position m)
    assert tv(law, sample) < bound, (tv(law, sample), bound)
    assert tv(law, typical) > bound + 0.2, (tv(law, typical), bound)


@pytest.mark.parametrize("tree", TREES)
def test_the_law_test_fails_a_loop_that_gives_every_node_the_same_uniform(peaked, engines, tree, monkeypatch):
    """The mutation docs/sampling.md names: a loop that draws every node of a step with one uniform (the first one
    asked for in each call) instead of each generated position's own leaves the exact law, and the total-variation
    test above catches it (TV above the 99.9% bound of the exact law's own draws)."""
    from medusa_runtime.decode.acceptance import PositionUniforms

    real_at = PositionUniforms.at
    monkeypatch.setattr(PositionUniforms, "at", lambda self, positions: np.full(
        np.shape(positions), real_at(self, positions)[0] if np.size(positions) else 0.0))
    hf, _ = peaked
    cfg = SamplingConfig(temperature=1.0, top_k=4)
    law = exact_law(hf, 1.0, 4, 1.0)
    bound = tv_bound(law, N)
    mutated, _ = first_three(engines[1], TREES[tree], cfg)
    print(f"{tree} nodes: TV {tv(law, mutated):.3f} against the bound {bound:.3f}")
    assert tv(law, mutated) > bound, (tv(law, mutated), bound)


def test_whole_vocabulary_through_the_in_graph_sampler(peaked, engines):
    """top_k 0 + top_p 0.8 needs the whole distribution: refused without the sampler, exact with it."""
    hf, _ = peaked
    cfg = SamplingConfig(temperature=1.0, top_k=0, top_p=0.8)
    with pytest.raises(UnsupportedSamplingError, match="Exact here: top_k 1..10"):
        generate(engines[0], PROMPT, TREES["16"], max_new_tokens=3, sampling=cfg)
    law = exact_law(hf, 1.0, 0, 0.8)
    bound = tv_bound(law, N)
    sample, accepted = first_three(engines[1], TREES["16"], cfg)
    typical, _ = first_three(engines[1], TREES["16"], dataclasses.replace(cfg, acceptance="typical"))
    assert accepted >= 0.2 * N
    assert sample[:200] == first_three(engines[1], ROOT, cfg, range(200))[0]  # = plain sampling, seed by seed
    assert tv(law, sample) < bound, (tv(law, sample), bound)
    assert tv(law, typical) > bound + 0.2, (tv(law, typical), bound)


def test_graph_and_host_draw_the_same_token_from_the_same_uniform(engines):
    """Where both are exact (top-k <= step_topk), sampled_ids equals the host's draw from the top-k outputs."""
    eng = engines[1]
    rng = np.random.default_rng(1)
    ids = np.array([PROMPT + [5, 7, 9, 11, 2, 0]], np.int64)
    s = ids.shape[1]
    for top_k, top_p, temperature in [(4, 1.0, 1.0), (10, 0.7, 0.8), (1, 1.0, 1.0), (7, 0.95, 1.4)]:
        u = rng.random(s).astype(np.float32)
        out = eng.step(ids, np.arange(s)[None], causal_mask(s), temperature, KVCache.for_engine(eng, 16).past(),
                       sampling=SamplerInputs(u, top_k, top_p))
        np.testing.assert_array_equal(out.sampled_ids, draw_tokens(out.topk_ids, out.topk_logprobs, u, top_k, top_p))
    # rows with a negative uniform are not sampled; top_k -1 turns the sampler off (the loop's feed when unused)
    u[[0, 3]] = -1.0
    past = KVCache.for_engine(eng, 16).past()
    out = eng.step(ids, np.arange(s)[None], causal_mask(s), 1.0, past, sampling=SamplerInputs(u, 4, 1.0))
    want = draw_tokens(out.topk_ids, out.topk_logprobs, np.maximum(u, 0), 4, 1.0)
    want[[0, 3]] = -1
    np.testing.assert_array_equal(out.sampled_ids, want)
    out = eng.step(ids, np.arange(s)[None], causal_mask(s), 1.0, past, sampling=SamplerInputs(u, -1, 1.0))
    np.testing.assert_array_equal(out.sampled_ids, np.full(s, -1))


def test_pytorch_reference_samples_the_same_tokens(peaked, engines):
    """The PyTorch reference (TorchEngine, same loop) draws the runtime's tokens, host and in-graph sampler."""
    model = peaked[1]
    for cfg, ort, ref in [(SamplingConfig(1.0, top_k=4), engines[1], TorchEngine(model, max_context=64)),
                          (SamplingConfig(1.0, top_k=0, top_p=0.8), engines[1],
                           TorchEngine(model, max_context=64, sampler=True))]:
        seeds = range(30)
        assert first_three(ref, TREES["16"], cfg, seeds)[0] == first_three(ort, TREES["16"], cfg, seeds)[0]


@pytest.mark.parametrize("tree", TREES)
def test_greedy_is_unchanged(peaked, engines, tree):
    """Temperature 0 (acceptance greedy): plain greedy decoding, token for token (transformers' generate)."""
    hf, _ = peaked
    for prompt in (PROMPT, [7, 7, 2, 19, 23, 0]):
        r = generate(engines[1], prompt, TREES[tree], max_new_tokens=20, sampling=SamplingConfig())
        assert r.tokens == plain_greedy(hf, prompt, 20)


# ---------------------------------------------------------------- the emitted sampler against its contract


def contract_draw(p: np.ndarray, u: float, top_k: int, top_p: float) -> int:
    """docs/sampling.md "in-graph sampler contract v1" for one row, float64 (independent of the graph's algorithm).

    p: [V] probabilities; the kept set is transformers' top-k then top-p over the sorted values, the draw
    the first kept id (increasing id order) whose cumulative kept mass exceeds u * the kept mass.
    """
    top = np.sort(p)[::-1][:top_k or len(p)]
    tau_k = top[-1] if top_k else 0.0
    q = top / top.sum()
    nucleus = top[np.cumsum(q) - q < top_p]
    tau_p = nucleus[-1] if top_p < 1 else 0.0
    kept = p >= max(tau_k, tau_p)
    cdf = np.cumsum(np.where(kept, p, 0.0))
    return int(min(np.count_nonzero(cdf <= u * cdf[-1]), np.flatnonzero(kept)[-1]))


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """A 1001-token tiny Llama (lm_head x30: a spread of peaked and flat rows), built portable and fused."""
    from medusa_export.pipeline import BuildConfig, build_artifact

    hf, model = make_tiny_medusa(vocab=1001, seed=3, medusa_heads=3)
    with torch.no_grad():
        model.backbone.lm_head.weight.mul_(30.0)
    root = tmp_path_factory.mktemp("wide")
    arts = {g: build_artifact(tiny_loaded(model, max_context=64), TREES["4"], root / g,
                              BuildConfig(validate=False, graph=g), progress=False) for g in ("portable", "fused")}
    return hf, arts


@pytest.mark.parametrize("graph", ["portable", "fused"])
def test_emitted_sampler_follows_the_contract(wide, graph):
    """Every setting, whole vocabulary included: sampled_ids = the contract's draw (float64, transformers' logits),
    and = the host's draw from the top-k outputs where that is exact (top_k <= 10); the manifest declares it."""
    hf, arts = wide
    art = load_artifact(arts[graph])
    assert art.manifest.step_sampler.to_json() == {"version": 1, "spec": "docs/sampling.md"}
    eng = OrtEngine(art, threads=1)
    assert eng.capabilities.sampler
    ids = np.array([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]], np.int64)
    s = ids.shape[1]
    with torch.no_grad():
        logits = hf(torch.from_numpy(ids)).logits[0].double()
    rng = np.random.default_rng(7)
    # top-k <= 256 and whole-vocabulary top-p whose nucleus fits in 256 tokens read a sorted prefix (TopK 256);
    # wider top-k and wider nuclei (temperature 4: up to ~700 tokens) search their threshold: both are covered
    settings = [(0, 1.0, 1.0), (0, 0.8, 1.0), (0, 0.5, 0.7), (0, 0.95, 4.0), (0, 0.6, 4.0), (50, 1.0, 1.0),
                (300, 0.9, 1.3), (4, 1.0, 1.0), (10, 0.7, 0.8), (1, 1.0, 1.0), (256, 0.99, 4.0), (1001, 1.0, 1.0),
                (5000, 0.95, 1.0), (700, 0.9, 4.0)]
    draws, nuclei = 0, set()
    for top_k, top_p, temperature in settings:
        p = torch.softmax(logits / temperature, -1).numpy()
        if top_k == 0 and top_p < 1:
            mass = np.cumsum(np.sort(p, -1)[:, ::-1], -1)
            nuclei |= {bool(n > 256) for n in (mass < top_p).sum(-1) + 1}
        for _ in range(5):
            u = rng.random(s).astype(np.float32)
            out = eng.step(ids, np.arange(s)[None], causal_mask(s), temperature, KVCache.for_engine(eng, 16).past(),
                           sampling=SamplerInputs(u, top_k, top_p))
            want = [contract_draw(p[i], float(u[i]), top_k, top_p) for i in range(s)]
            assert out.sampled_ids.tolist() == want, (top_k, top_p, temperature)
            if 1 <= top_k <= 10:
                np.testing.assert_array_equal(out.sampled_ids,
                                              draw_tokens(out.topk_ids, out.topk_logprobs, u, top_k, top_p))
            draws += s
    assert draws == 60 * len(settings) and nuclei == {False, True}
    # only rows with a uniform >= 0 are sampled; sample_top_k -1 turns the sampler off
    u[[0, 5]] = -1.0
    out = eng.step(ids, np.arange(s)[None], causal_mask(s), 1.0, KVCache.for_engine(eng, 16).past(),
                   sampling=SamplerInputs(u, 0, 0.9))
    p = torch.softmax(logits, -1).numpy()
    assert out.sampled_ids.tolist() == [-1 if u[i] < 0 else contract_draw(p[i], float(u[i]), 0, 0.9) for i in range(s)]
    out = eng.step(ids, np.arange(s)[None], causal_mask(s), 1.0, KVCache.for_engine(eng, 16).past(),
                   sampling=SamplerInputs(np.full(s, 0.5, np.float32), -1, 1.0))
    assert out.sampled_ids.tolist() == [-1] * s


def test_emitted_sampler_passes_the_tensorrt_readiness_check(wide):
    """The portable graph with its sampler (If, NonZero, ScatterElements, CumSum, Range) passes the parser table check."""
    from medusa_export.trt.readiness import check_artifact

    report = check_artifact(wide[1]["portable"])
    assert report.passed and not report.findings, [str(f) for f in report.findings]
    assert {"If", "NonZero", "ScatterElements", "CumSum"} <= set(report.graphs["model"]["op_types"])
    assert "TopK" in report.graphs["model"]["op_types"]  # the step's own top-10, not the sampler's
