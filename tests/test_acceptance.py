"""Acceptance (medusa_runtime.decode.acceptance): greedy, exact sampling and typical, on hand-made arrays;
the sampling settings and their truncation against transformers' own logits warpers."""

from __future__ import annotations

import argparse
import math

import numpy as np
import pytest

from medusa_runtime.decode.acceptance import (PositionUniforms, SamplingConfig, TypicalConfig, accept_greedy, accept_sample,
                                      accept_typical, draw_tokens, inverse_cdf, sampling_config, sampling_route,
                                      truncated_probs)
from medusa_runtime.errors import InvalidSettingError, UnsupportedSamplingError
from medusa_runtime.trees.tree import make_tree

# Nodes: 0 root, 1 [0], 2 [1], 3 [0,0], 4 [0,1], 5 [1,0], 6 [0,0,0]
# retrieve rows: [0,1,4,-1], [0,2,5,-1], [0,1,3,6]
TREE = make_tree([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]], num_heads=3, topk=2)
TOKENS = np.array([100, 10, 11, 20, 21, 20, 30])


def _argmax(**at_node) -> np.ndarray:
    """Backbone argmax per node: 99 (matches no candidate) except where given."""
    out = np.full(TREE.size, 99)
    for node, tok in at_node.items():
        out[int(node[1:])] = tok
    return out


def test_greedy_nothing_accepted():
    acc = accept_greedy(TREE, TOKENS, _argmax(n0=7))
    np.testing.assert_array_equal(acc.accepted, [0])
    assert (acc.next_token, acc.accept_length, acc.path_index) == (7, 0, 0)


def test_greedy_accepts_second_child_path():
    # root predicts 10 (node 1), node 1 predicts 21 (node 4, not node 3), node 4 predicts 77
    acc = accept_greedy(TREE, TOKENS, _argmax(n0=10, n1=21, n4=77))
    np.testing.assert_array_equal(acc.accepted, [0, 1, 4])
    assert (acc.next_token, acc.accept_length, acc.path_index) == (77, 2, 0)


def test_greedy_picks_the_longest_path():
    acc = accept_greedy(TREE, TOKENS, _argmax(n0=10, n1=20, n3=30, n6=5))
    np.testing.assert_array_equal(acc.accepted, [0, 1, 3, 6])
    assert (acc.next_token, acc.accept_length, acc.path_index) == (5, 3, 2)


def test_greedy_needs_every_ancestor():
    # node 6's token matches node 3's argmax, but node 3 itself is rejected
    acc = accept_greedy(TREE, TOKENS, _argmax(n0=10, n1=55, n3=30))
    np.testing.assert_array_equal(acc.accepted, [0, 1])
    assert acc.next_token == 55


def test_greedy_tie_goes_to_the_first_row():
    # nodes 3 and 4 carry the same token: both accepted at depth 2; node 6 rejected.
    tokens = TOKENS.copy()
    tokens[4] = 20
    acc = accept_greedy(TREE, tokens, _argmax(n0=10, n1=20, n3=42, n4=43))
    np.testing.assert_array_equal(acc.accepted, [0, 1, 4])  # row 0 ([0,1,4]) before row 2 ([0,1,3,6])
    assert (acc.path_index, acc.next_token) == (0, 43)


def test_greedy_root_only_tree():
    acc = accept_greedy(make_tree([], num_heads=2), np.array([5]), np.array([9]))
    np.testing.assert_array_equal(acc.accepted, [0])
    assert acc.next_token == 9


# --- typical acceptance -------------------------------------------------------------------------
# Tree: root with two children (node 1 = [0], node 2 = [1]); retrieve rows [0,1], [0,2].
FORK = make_tree([[0], [1]], num_heads=1, topk=2)
FORK_TOKENS = np.array([5, 3, 4])


def _typical(p1, p2, entropy, config, drawn=(3, 8, 7)):
    token_logprobs = np.full((3, 3), -30.0)
    token_logprobs[0, 1], token_logprobs[0, 2] = math.log(p1), math.log(p2)
    return accept_typical(FORK, FORK_TOKENS, token_logprobs, np.array([entropy, 0.0, 0.0]), config, np.array(drawn))


@pytest.mark.parametrize(
    "p1, entropy, accepted",
    [
        # threshold = min(epsilon, delta * exp(-H)) with epsilon = 0.6, delta = 0.9
        (0.5, 0.0, False),  # min(0.6, 0.9) = 0.6 > 0.5
        (0.5, 1.0, True),  # min(0.6, 0.9 / e = 0.331) = 0.331 < 0.5
        (0.32, 1.0, False),  # 0.32 < 0.331
        (0.65, 0.0, True),  # 0.65 > 0.6
    ],
)
def test_typical_threshold_formula(p1, entropy, accepted):
    cfg = TypicalConfig(temperature=1.0, posterior_threshold=0.6, posterior_alpha=0.9)
    acc = _typical(p1, 0.01, entropy, cfg)
    if accepted:
        np.testing.assert_array_equal(acc.accepted, [0, 1])
        assert acc.next_token == 8  # the draw at node 1
    else:
        np.testing.assert_array_equal(acc.accepted, [0])
        assert acc.next_token == 3  # the draw at the root (not node 1's token: typical does not look)


def test_typical_tie_broken_by_probability():
    # both children pass (threshold 0.3); the second row has the larger log-probability
    cfg = TypicalConfig(temperature=1.0, posterior_threshold=0.3, posterior_alpha=0.3)
    acc = _typical(0.35, 0.55, 0.0, cfg)
    np.testing.assert_array_equal(acc.accepted, [0, 2])
    assert (acc.path_index, acc.next_token) == (1, 7)


def test_typical_defaults_and_validation():
    d = TypicalConfig()
    assert (d.temperature, d.posterior_threshold, d.posterior_alpha) == (0.7, 0.09, 0.3)
    with pytest.raises(ValueError, match="temperature > 0"):
        TypicalConfig(temperature=0.0)
    with pytest.raises(ValueError, match="epsilon"):
        TypicalConfig(posterior_threshold=0.0)
    with pytest.raises(ValueError, match="delta"):
        TypicalConfig(posterior_alpha=0.0)


# --- exact sampling: the walk ---------------------------------------------------------------------
# TREE nodes: 0 root(100), 1 [0](10), 2 [1](11), 3 [0,0](20), 4 [0,1](21), 5 [1,0](20), 6 [0,0,0](30)


def _drawn(**at_node) -> np.ndarray:
    """The token drawn at each node: 99 (no child carries it) except where given."""
    return _argmax(**at_node)


@pytest.mark.parametrize("draws, path, next_token, row", [
    ({"n0": 7}, [0], 7, 0),  # the root's draw matches no child: it is the bonus token
    ({"n0": 11, "n2": 20, "n5": 4}, [0, 2, 5], 4, 1),
    ({"n0": 10, "n1": 20, "n3": 30, "n6": 5}, [0, 1, 3, 6], 5, 2),
    ({"n0": 10, "n1": 21, "n4": 30}, [0, 1, 4], 30, 0),  # 30 is node 6's token, but node 6 is not node 4's child
    ({"n0": 10, "n1": 11}, [0, 1], 11, 0),  # 11 is a child of the root, not of node 1
])
def test_sample_walks_the_draws(draws, path, next_token, row):
    acc = accept_sample(TREE, TOKENS, _drawn(**draws))
    np.testing.assert_array_equal(acc.accepted, path)
    assert (acc.next_token, acc.path_index) == (next_token, row)
    np.testing.assert_array_equal(TREE.buffers().retrieve_indices[row, : len(path)], path)


def _walk_the_draws(tree, tokens, drawn) -> list[int]:
    """The tokens sampling acceptance emits, by the rule of accept_sample's docstring, written independently:
    from the root, move to a child whose token equals the current node's draw (the longest such walk, the first
    child in node order on ties), then emit the draw at the last node as the bonus token."""
    parent = tree.buffers().parent
    children = {v: [c for c in range(1, tree.size) if parent[c] == v] for v in range(tree.size)}

    def walk(v: int) -> list[int]:
        best = [v]
        for c in children[v]:
            if tokens[c] == drawn[v] and len(path := [v] + walk(c)) > len(best):
                best = path
        return best

    path = walk(0)
    return [int(tokens[v]) for v in path[1:]] + [int(drawn[path[-1]])]


def test_sample_emits_what_an_explicit_walk_of_the_draws_emits():
    """accept_sample reuses accept_greedy's longest-prefix search with the draws in place of the argmax; this
    checks it against the walk itself (trees with repeated sibling tokens, random draws; the draw is a function of
    the node's path, as a backbone's is: nodes with equal paths see the same distribution and the same uniform)."""
    rng = np.random.default_rng(0)
    tree = make_tree([[i] for i in range(3)] + [[i, j] for i in range(3) for j in range(3)] + [[0, 0, 0], [1, 2, 0]],
                     num_heads=3, topk=3)
    parent = tree.buffers().parent

    def path_tokens(tokens, v):
        return () if v < 0 else path_tokens(tokens, parent[v]) + (int(tokens[v]),)

    lengths = set()
    for _ in range(300):
        tokens = rng.integers(0, 4, tree.size)  # siblings may repeat a token
        model = {}
        drawn = np.array([model.setdefault(path_tokens(tokens, v), int(rng.integers(0, 4))) for v in range(tree.size)])
        s = accept_sample(tree, tokens, drawn)
        assert list(tokens[s.accepted[1:]]) + [s.next_token] == _walk_the_draws(tree, tokens, drawn)
        lengths.add(len(s.accepted))
    assert lengths == {1, 2, 3, 4}  # the draws reached every depth


# --- the sampling distribution against transformers' logits warpers --------------------------------


def _transformers_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Plain sampling's distribution: transformers' TemperatureLogitsWarper -> TopKLogitsWarper ->
    TopPLogitsWarper (the order of generation/utils.py), then softmax; float64."""
    import torch
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    scores = torch.from_numpy(logits.astype(np.float64))
    scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return torch.softmax(scores, dim=-1).numpy()


def _step_topk(logits: np.ndarray, temperature: float, k: int):
    """What the step graph returns: the k best ids and their log-probs over the whole vocabulary."""
    z = logits.astype(np.float64) / temperature
    logp = z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) - z.max(-1, keepdims=True)
    ids = np.argsort(-logp, axis=-1, kind="stable")[:, :k]
    return ids, np.take_along_axis(logp, ids, axis=-1)


@pytest.mark.parametrize("temperature, top_k, top_p", [
    (1.0, 10, 1.0), (0.7, 10, 1.0), (0.7, 4, 1.0), (1.3, 10, 0.9), (0.5, 7, 0.5), (1.0, 1, 1.0),
    (1.0, 10, 0.05), (2.0, 3, 0.99),
])
def test_top_k_outputs_give_plain_sampling_distribution(temperature, top_k, top_p):
    """Renormalising the step's top-10 (k <= 10) and applying top-p inside is exactly transformers'
    temperature -> top-k -> top-p, for every row, over the whole vocabulary."""
    logits = np.random.default_rng(3).normal(0, 3, (6, 40))
    want = _transformers_probs(logits, temperature, top_k, top_p)
    ids, lp = _step_topk(logits, temperature, 10)
    got = np.zeros_like(want)
    np.put_along_axis(got, ids, truncated_probs(lp, top_k, top_p), axis=-1)
    np.testing.assert_allclose(got, want, atol=1e-12)


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (0, 0.8), (25, 0.6), (40, 1.0)])
def test_whole_sorted_vocabulary_gives_plain_sampling_distribution(top_k, top_p):
    """The in-graph sampler's reference: the whole vocabulary sorted, any top-k / top-p."""
    logits = np.random.default_rng(4).normal(0, 2, (5, 40))
    want = _transformers_probs(logits, 0.8, top_k, top_p)
    ids, lp = _step_topk(logits, 0.8, 40)
    got = np.zeros_like(want)
    np.put_along_axis(got, ids, truncated_probs(lp, top_k, top_p), axis=-1)
    np.testing.assert_allclose(got, want, atol=1e-12)


def test_inverse_cdf_on_a_uniform_grid_reproduces_the_probabilities():
    """N evenly spaced uniforms land on each token N * p times, to within one."""
    ids = np.array([[11, 22, 33, 44]])
    lp = np.log(np.array([[0.5, 0.3, 0.15, 0.05]]))
    n = 1000
    u = (np.arange(n) + 0.5) / n
    draws = draw_tokens(np.repeat(ids, n, 0), np.repeat(lp, n, 0), u, top_k=0, top_p=1.0)
    counts = [(draws == t).sum() for t in ids[0]]
    assert np.all(np.abs(np.array(counts) - n * np.array([0.5, 0.3, 0.15, 0.05])) <= 1), counts
    assert draw_tokens(ids, lp, np.array([0.0]), 0, 1.0)[0] == 11  # u = 0: the lowest id kept
    # the CDF runs in increasing id order, whatever order the top-k outputs come in
    shuffled = draw_tokens(np.repeat(ids[:, ::-1], n, 0), np.repeat(lp[:, ::-1], n, 0), u, top_k=0, top_p=1.0)
    np.testing.assert_array_equal(shuffled, draws)
    top = draw_tokens(np.repeat(ids, n, 0), np.repeat(lp, n, 0), u, top_k=2, top_p=1.0)
    assert set(top.tolist()) == {11, 22} and abs((top == 11).mean() - 0.5 / 0.8) < 2 / n
    nucleus = draw_tokens(np.repeat(ids, n, 0), np.repeat(lp, n, 0), u, top_k=0, top_p=0.75)
    assert set(nucleus.tolist()) == {11, 22}  # the mass before 33 is 0.8, not < 0.75


def test_inverse_cdf_never_picks_a_zero_probability_column():
    probs = np.array([[0.5, 0.5, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    assert inverse_cdf(probs, np.array([1 - 1e-17, 0.999999999])).tolist() == [1, 0]


def test_position_uniforms_do_not_depend_on_chunking():
    a, b = PositionUniforms(5), PositionUniforms(5)
    x = np.concatenate([a.at([0, 1, 2]), a.at(np.arange(3, 200)), a.at([0])])
    y = np.concatenate([b.at(np.arange(200))[::-1][::-1], b.at([0])])
    np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(y[:200], np.random.default_rng(5).random(200))


# --- settings ---------------------------------------------------------------------------------------


def test_sampling_defaults_and_modes():
    d = SamplingConfig()
    assert (d.temperature, d.acceptance, d.top_k, d.top_p, d.seed, d.mode) == (0.0, None, 10, 1.0, 0, "greedy")
    assert (d.posterior_threshold, d.posterior_alpha) == (TypicalConfig.posterior_threshold, TypicalConfig.posterior_alpha)
    assert SamplingConfig(temperature=0.7).mode == "sample"
    t = SamplingConfig(temperature=0.7, acceptance="typical", posterior_threshold=0.2)
    assert t.mode == "typical" and t.typical == TypicalConfig(0.7, 0.2, 0.3)
    assert sampling_config(t, top_p=0.9, seed=None) == SamplingConfig(0.7, "typical", 10, 0.9, 0.2)


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -1.0}, "temperature must be a finite number >= 0"),
    ({"temperature": float("nan")}, "temperature must be a finite number >= 0"),
    ({"temperature": 0.5, "acceptance": "greedy"}, "greedy acceptance decodes the argmax: it needs temperature 0"),
    ({"acceptance": "typical"}, "typical acceptance needs temperature > 0"),
    ({"temperature": 1.0, "acceptance": "rejection"}, "unknown acceptance 'rejection'; choose one of greedy, sample"),
    ({"top_k": -1}, "top_k must be an integer >= 0"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"seed": -2}, "seed must be an integer >= 0"),
    ({"temperature": 0.5, "posterior_threshold": 0.0}, r"posterior_threshold \(epsilon\) must be in \(0, 1\]"),
    ({"posterior_alpha": -1.0}, r"posterior_alpha \(delta\) must be > 0"),
])
def test_sampling_settings_out_of_range_are_typed_errors(kwargs, message):
    with pytest.raises(InvalidSettingError, match=message):
        SamplingConfig(**kwargs)


def test_every_rule_reads_only_the_step_outputs_it_declares():
    """Each table entry's ``needs`` is true: its accept runs on a step that has only those StepResult fields
    (any other read is an AttributeError), and accepts what the rule itself accepts (the FORK tree above)."""
    import types

    from medusa_runtime.decode.acceptance import ACCEPTANCE_RULES
    from medusa_runtime.engines.base import StepResult

    token_logprobs = np.full((3, 3), -30.0)
    token_logprobs[0, 1] = math.log(0.8)  # node 1's candidate (3) is likely at the root: typical accepts it
    outputs = {"token_logprobs": token_logprobs, "entropy": np.array([0.5, 0.0, 0.0])}
    drawn = np.array([3, 8, 7])  # the root draws node 1's token (3): greedy and sample accept node 1
    for name, rule in ACCEPTANCE_RULES.items():
        assert set(rule.needs) <= set(StepResult._fields), name
        step = types.SimpleNamespace(**{n: outputs[n] for n in rule.needs})
        cfg = SamplingConfig(temperature=1.0 if rule.sampled else 0.0, acceptance=name)
        acc = rule.accept(FORK, FORK_TOKENS, drawn, step, rule.params(cfg) if rule.params else None)
        assert (acc.accepted.tolist(), acc.next_token) == ([0, 1], 8), name


def test_describe_writes_the_rules_parameters():
    """The log line of each rule (the CLI's notice): typical's epsilon and delta come from its table entry."""
    assert SamplingConfig().describe() == "greedy"
    assert SamplingConfig(temperature=0.7, top_p=0.9).describe() == "sample T=0.7 top-k 10 top-p 0.9 seed 0"
    assert SamplingConfig(temperature=2.0, acceptance="typical", top_k=0, posterior_threshold=0.2, seed=3).describe() \
        == "typical T=2 top-k off epsilon 0.2 delta 0.3 seed 3"


def test_sampling_route_says_which_settings_are_exact():
    route = lambda cfg, **kw: sampling_route(cfg, **{"step_topk": 10, "vocab_size": 1000, "graph_sampler": False, **kw})  # noqa: E731
    assert route(SamplingConfig()) == "greedy"
    assert route(SamplingConfig(temperature=1.0, top_k=10, top_p=0.5)) == "host"
    assert route(SamplingConfig(temperature=1.0, top_k=0), graph_sampler=True) == "graph"
    assert route(SamplingConfig(temperature=1.0, top_k=50), graph_sampler=True) == "graph"
    assert route(SamplingConfig(temperature=1.0, top_k=0), vocab_size=10) == "host"  # the top-10 is the vocabulary
    for cfg in (SamplingConfig(temperature=1.0, top_k=0), SamplingConfig(temperature=1.0, top_k=11, top_p=0.9),
                SamplingConfig(temperature=1.0, acceptance="typical", top_k=0)):
        with pytest.raises(UnsupportedSamplingError, match=r"Exact here: top_k 1..10, with any top_p"):
            route(cfg)


def test_a_new_acceptance_rule_is_one_table_entry(tiny_trt_artifact, monkeypatch, capsys):
    """Worked example (docs "where to add": an acceptance rule): a rule that accepts the root alone, added
    to ACCEPTANCE_RULES only, runs end to end through the session; nothing else knows its name."""
    from medusa_runtime.decode.acceptance import ACCEPTANCE_RULES, Acceptance, AcceptanceRule, SamplingConfig
    from medusa_runtime.front.session import MedusaSession

    calls = []

    def root_only(tree, tokens, drawn, step, params):
        calls.append((tree.size, params))
        return Acceptance(np.array([0]), int(drawn[0]), 0)  # the root; the bonus token is the root's argmax

    monkeypatch.setitem(ACCEPTANCE_RULES, "root-only",
                        AcceptanceRule(root_only, params=lambda cfg: cfg.seed, sampled=False))
    session = MedusaSession(tiny_trt_artifact, tree="16", notice=None)
    prompt = [5, 17, 42, 9]
    got = session.generate(prompt_ids=prompt, max_new_tokens=6, sampling=SamplingConfig(acceptance="root-only",
                                                                                          seed=3))
    plain = session.generate(prompt_ids=prompt, max_new_tokens=6, vanilla=True)
    assert got.token_ids == plain.token_ids  # the root's argmax each step is plain greedy decoding
    assert got.result.accept_depths == [0] * 5  # one token per step after the prefill's
    assert calls == [(16, 3)] * 5  # called on every tree step with its parameters from the config
    with pytest.raises(InvalidSettingError, match="root-only acceptance decodes the argmax"):
        SamplingConfig(acceptance="root-only", temperature=0.5)
    # the entry points offer it too: the CLI's --acceptance choices and the serving request's field
    from medusa_runtime.front.cli import add_sampling_args, sampling_from_args
    from medusa_runtime.front.serving import parse_request

    parser = argparse.ArgumentParser()
    add_sampling_args(parser)
    assert sampling_from_args(parser.parse_args(["--acceptance", "root-only", "--seed", "3"])) == \
        SamplingConfig(acceptance="root-only", seed=3)
    req = parse_request({"input_ids": prompt, "max_new_tokens": 6, "acceptance": "root-only", "seed": 3}, session)
    assert req.sampling == SamplingConfig(acceptance="root-only", seed=3)
    # and the runtime CLI decodes with it end to end: the session's reply (plain greedy decoding's)
    from medusa_runtime.front.cli import main as runtime_main

    calls.clear()
    argv = ["generate", "--artifact", str(tiny_trt_artifact), "--tree", "16", "--prompt", "hi", "--raw",
            "--max-new-tokens", "6", "--acceptance", "root-only", "--seed", "3", "--threads", "1"]
    assert runtime_main(argv) == 0
    out, _ = capsys.readouterr()
    want = session.generate("hi", max_new_tokens=6, raw=True, vanilla=True)
    assert len(want.token_ids) == 6 and out == want.text + "\n"
    assert calls == [(16, 3)] * 5


def test_every_sampling_setting_is_a_cli_option(capsys):
    """add_sampling_args offers one option per SamplingConfig field (its name with dashes), typed and
    defaulted by the field; sampling_from_args gives back the config."""
    from medusa_runtime.front.cli import add_sampling_args, sampling_from_args

    parser = argparse.ArgumentParser()
    add_sampling_args(parser)
    args = parser.parse_args(["--temperature", "0.5", "--acceptance", "typical", "--top-k", "7", "--top-p", "0.8",
                              "--posterior-threshold", "0.2", "--posterior-alpha", "0.4", "--seed", "9"])
    assert sampling_from_args(args) == SamplingConfig(0.5, "typical", 7, 0.8, 0.2, 0.4, 9)
    assert sampling_from_args(parser.parse_args([])) == SamplingConfig()
    with pytest.raises(SystemExit):
        parser.parse_args(["--acceptance", "rejection"])
    assert "invalid choice: 'rejection' (choose from" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["--top-k", "1.5"])
    assert "--top-k: invalid int value: '1.5'" in capsys.readouterr().err


def test_generate_takes_the_sampling_settings_by_name(tiny_trt_artifact):
    """docs/sampling.md's shorthand: ``generate(temperature=, seed=, ...)`` is ``generate(sampling=
    SamplingConfig(...))``, a keyword overriding the given config's field (None keeps it), in generate and
    generate_batch alike; a keyword that is no setting is a TypeError naming the settings."""
    from medusa_runtime.front.session import MedusaSession

    session = MedusaSession(tiny_trt_artifact, tree="16", notice=None)
    prompt, n = [5, 17, 42, 9], 8
    cfg = SamplingConfig(temperature=0.9, seed=4)
    want = session.generate(prompt_ids=prompt, max_new_tokens=n, sampling=cfg).token_ids
    assert len(want) == n
    assert session.generate(prompt_ids=prompt, max_new_tokens=n, temperature=0.9, seed=4).token_ids == want
    assert session.generate(prompt_ids=prompt, max_new_tokens=n, sampling=cfg, seed=None).token_ids == want
    other = session.generate(prompt_ids=prompt, max_new_tokens=n, sampling=cfg, seed=5).token_ids
    assert other != want  # the keyword took effect over the config's seed
    batch = session.generate_batch(prompt_ids=[prompt, prompt], max_new_tokens=n,
                                   sampling=[cfg, SamplingConfig(temperature=0.9, seed=1)], seed=4)
    assert [c.token_ids for c in batch] == [want, want]  # the keyword overrides every prompt's seed
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'temprature': not a sampling setting "
                                        r"\(SamplingConfig's fields: temperature, acceptance, top_k"):
        session.generate(prompt_ids=prompt, temprature=0.9)
