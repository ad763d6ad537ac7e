"""Many sequences through one engine (medusa_runtime.decode.batch): each sequence's tokens in a batch equal
its batch-1 tokens (greedy, sample and typical per seed), with prompts of different lengths,
different accepted lengths in one step, sequences finishing early, joining late, cancelled or
failing alone; the session's generate_batch and the --prompt-file command line.

The "counter" model (conftest.make_counter_medusa) continues t with t+1; with ``miss_every=3``
its heads guess wrong after multiples of 3, so rows at different tokens accept different
lengths in the same step.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace

import numpy as np
import pytest

from conftest import make_counter_medusa, make_tiny_tokenizer, plain_greedy, tiny_loaded
from medusa_runtime.decode.acceptance import SamplingConfig
from medusa_runtime.decode.batch import LoopedBatchEngine, Scheduler, SequenceRequest, batch_engine
from medusa_runtime.errors import ContextOverflowError, InvalidSettingError, InvalidTreeError
from medusa_runtime.decode.loop import generate
from medusa_runtime.front.session import MedusaSession
from medusa_runtime.trees.tree import make_tree

VOCAB, CONTEXT, EOS = 300, 128, 2


def _counter_build(out, batch_size: int, graph: str = "portable"):
    from medusa_export.pipeline import BuildConfig, build_artifact
    from medusa_runtime.trees.treespec import tree_from_spec

    lm = tiny_loaded(make_counter_medusa(miss_every=3), name="counter-miss", max_context=CONTEXT)
    return build_artifact(lm, tree_from_spec("16", num_heads=3), out,
                          BuildConfig(validate=False, batch_size=batch_size, graph=graph), progress=False)


@pytest.fixture(scope="module", params=[(1, "portable"), (4, "portable"), (4, "fused")],
                ids=["batch1-graph", "batched-graph", "batched-fused-graph"])
def counter_artifact(request, tmp_path_factory):
    """The counter model built three times: the batch-1 step graph (the scheduler loops over rows), and the
    batched portable and fused ones (``--batch-size 4``: OrtBatchEngine runs every row in one call); every
    test below runs on each."""
    return _counter_build(tmp_path_factory.mktemp("batch") / "counter", *request.param)


@pytest.fixture(scope="module")
def counter_batch1(tmp_path_factory):
    """The batch-1 counter artifact's session: the reference of the batched graph's rows."""
    return MedusaSession(_counter_build(tmp_path_factory.mktemp("batch1") / "counter", 1), threads=1)


@pytest.fixture(scope="module")
def counter(counter_artifact):
    return MedusaSession(counter_artifact, threads=1)


def _batch1(session, req: SequenceRequest):
    return generate(session.engine, req.prompt_ids, req.tree or session.tree, max_new_tokens=req.max_new_tokens,
                    eos_token_ids=session.eos_token_ids, sampling=req.sampling)


def _same(state, ref) -> None:
    r = state.result
    assert state.error is None, state.error
    assert (r.tokens, r.finish_reason) == (ref.tokens, ref.finish_reason), state.request.tag
    assert (r.step_tokens, r.accept_depths) == (ref.step_tokens, ref.accept_depths), state.request.tag


class _Boundaries:
    """Records (boundary, sequence tag, tokens emitted) from each sequence's on_tokens."""

    def __init__(self):
        self.now = 0
        self.log: list[tuple[int, object, int]] = []

    def callback(self, tag):
        return lambda tokens: self.log.append((self.now, tag, len(tokens))) and None

    def mixed(self) -> list[int]:
        """Boundaries at which sequences emitted different numbers of tokens."""
        by = {}
        for b, _, n in self.log:
            by.setdefault(b, set()).add(n)
        return [b for b, ns in by.items() if len(ns) > 1]


def _requests(**kw):
    # different prompt lengths; one hits EOS (2) early; one has a small budget; the tokens reached
    # differ mod 3, so the rows accept different lengths in the same steps
    prompts = [[100], list(range(40, 71)), [295, 296], list(range(7, 12)), [150, 151, 152]]
    budgets = [40, 33, 30, 5, 26]
    return [SequenceRequest(p, n, tag=i, **kw) for i, (p, n) in enumerate(zip(prompts, budgets))]


def test_counter_model_accepts_different_lengths(counter):
    c = counter.generate(prompt_ids=[100], max_new_tokens=30)
    assert c.token_ids == [(101 + i) % VOCAB for i in range(30)]
    assert {1, 4} <= set(c.result.step_tokens)  # misses after multiples of 3, whole paths otherwise


@pytest.mark.parametrize("max_batch", [1, 3, 5])
def test_batch_equals_batch1_greedy(counter, max_batch):
    spy = _Boundaries()
    reqs = _requests()
    for r in reqs:
        r.on_tokens = spy.callback(r.tag)
    sched = Scheduler(counter.engine, counter.tree, max_batch=max_batch, eos_token_ids=counter.eos_token_ids)
    states = [sched.submit(r) for r in reqs]
    order = []
    while not sched.idle:
        assert len(sched.running) <= max_batch
        spy.now += 1
        order += [s.request.tag for s in sched.step()]
    for s in states:
        r = s.request
        _same(s, _batch1(counter, SequenceRequest(r.prompt_ids, r.max_new_tokens)))
        assert s.max_batch_seen <= max_batch
    assert states[2].result.finish_reason == "stop" and states[2].result.tokens == [297, 298, 299, 0, 1]
    assert states[3].result.finish_reason == "length" and len(states[3].result.tokens) == 5
    assert sorted(order) == list(range(5))
    if max_batch > 1:
        assert order.index(3) < order.index(0)  # the short one left first
        assert spy.mixed(), "no step where rows accepted different lengths"
        assert max(s.max_batch_seen for s in states) == max_batch


def test_a_sequence_joins_late_and_waits_for_a_free_row(counter):
    sched = Scheduler(counter.engine, counter.tree, max_batch=2, eos_token_ids=counter.eos_token_ids)
    a = sched.submit(SequenceRequest([10, 11, 12], 30, tag="a"))
    b = sched.submit(SequenceRequest([200], 10, tag="b"))  # 1 + 4 + 1 + 4 tokens: 3 steps
    sched.step()
    late = sched.submit(SequenceRequest(list(range(60, 80)), 20, tag="late"))
    waited = 0
    while late in sched.waiting:  # no free row until b leaves
        sched.step()
        waited += 1
    assert waited == 3 and b.done and not a.done and b.finished <= late.started
    sched.run()
    for s in (a, b, late):
        r = s.request
        _same(s, _batch1(counter, SequenceRequest(r.prompt_ids, r.max_new_tokens)))
    assert late.max_batch_seen == 2


@pytest.mark.parametrize("settings", [dict(temperature=1.0), dict(temperature=1.3, top_k=4, top_p=0.9),
                                      dict(temperature=2.0, acceptance="typical")])
def test_sampling_is_per_sequence_and_reproducible_per_seed(counter, settings):
    """Each sequence draws from its own seeded stream: its tokens are its batch-1 tokens with its
    seed, whatever runs beside it; two sequences with one prompt and two seeds differ."""
    reqs = [SequenceRequest([100], 30, SamplingConfig(seed=seed, **settings), tag=seed) for seed in range(4)]
    reqs += [SequenceRequest(list(range(40, 60)), 25, SamplingConfig(seed=7, **settings), tag=7)]
    sched = Scheduler(counter.engine, counter.tree, max_batch=3, eos_token_ids=counter.eos_token_ids)
    states = [sched.submit(r) for r in reqs]
    sched.run()
    for s in states:
        _same(s, _batch1(counter, s.request))
    outs = [tuple(s.result.tokens) for s in states[:4]]
    assert len(set(outs)) >= 2  # the seeds matter (the counter model is peaked: some seeds agree)
    assert sum(sum(s.result.accept_depths) for s in states) >= 10  # the trees accepted candidates


def test_vanilla_and_medusa_sequences_share_steps(counter):
    root = make_tree([], num_heads=3)
    reqs = [SequenceRequest([100], 20, tag="medusa"), SequenceRequest([100], 20, tree=root, tag="vanilla")]
    sched = Scheduler(counter.engine, counter.tree, max_batch=2)
    m, v = (sched.submit(r) for r in reqs)
    sched.run()
    assert m.result.tokens == v.result.tokens == [(101 + i) % VOCAB for i in range(20)]
    assert v.result.step_tokens == [1] * 19 and max(m.result.step_tokens) == 4


@pytest.mark.parametrize("batched", [False, True], ids=["batch1-graph", "batched-graph"])
def test_greedy_batch_equals_transformers(tiny_trt_artifact, tiny_hf, tmp_path, batched):
    """An independent reference: transformers' greedy generate of the same random model, four prompts of
    different lengths sharing each step and finishing at different times. Batched: the model built with
    --batch-size 4 (one call per step); each row is also the batch-1 artifact's generate (tokens, tokens per step)."""
    from medusa_export.pipeline import BuildConfig, build_artifact
    from medusa_runtime.engines.ort_batched import OrtBatchEngine
    from medusa_runtime.trees.treespec import tree_from_spec

    hf, model = tiny_hf()
    session = batch1 = MedusaSession(tiny_trt_artifact, threads=1)
    if batched:
        art = build_artifact(tiny_loaded(model, max_context=256), tree_from_spec("16", num_heads=3), tmp_path / "b4",
                             BuildConfig(validate=False, batch_size=4), progress=False)
        session = MedusaSession(art, threads=1)
    assert isinstance(session.engine, OrtBatchEngine) == batched
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 1000, size=n).tolist() for n in (3, 17, 9, 30)]
    sched = Scheduler(session.engine, session.tree, max_batch=4)  # EOS ignored, as plain_greedy does
    states = [sched.submit(SequenceRequest(p, 12 + 3 * i, tag=i)) for i, p in enumerate(prompts)]
    sched.run()
    for s, p in zip(states, prompts):
        n = s.request.max_new_tokens
        assert s.error is None and s.max_batch_seen == 4
        assert s.result.tokens == plain_greedy(hf, p, n)
        ref = generate(batch1.engine, p, batch1.tree, max_new_tokens=n)
        assert (s.result.tokens, s.result.step_tokens) == (ref.tokens, ref.step_tokens)


class _RunSpy:
    """Wraps an ONNX Runtime session: records the input_ids shape of every run."""

    def __init__(self, session):
        self.session, self.shapes = session, []

    def run(self, names, feed, *args):
        self.shapes.append(feed["input_ids"].shape)
        return self.session.run(names, feed, *args)

    def __getattr__(self, name):
        return getattr(self.session, name)


def test_batched_graph_runs_every_row_in_one_call(counter, counter_batch1):
    """A batched artifact: one ONNX Runtime call per tree step over all the running rows (prompts of different
    lengths, rows accepting different lengths in one step, rows leaving early); each row's tokens, finish
    reason, tokens per step and accepted depths equal the batch-1 *graph*'s generate of that row."""
    eng = counter.engine
    if not eng.max_batch:
        pytest.skip("the batch-1 graph: the scheduler loops over the rows")
    spy = _RunSpy(eng.step_session)
    eng.step_session = spy
    try:
        sched = Scheduler(eng, counter.tree, max_batch=5, eos_token_ids=counter.eos_token_ids)
        states = [sched.submit(r) for r in _requests()]
        running = []
        while not sched.idle:
            before = len(spy.shapes)
            sched.step()
            running.append((len(spy.shapes) - before, len(sched.running)))
    finally:
        eng.step_session = counter.engine.step_session = spy.session
    for s in states:
        r = s.request
        _same(s, _batch1(counter_batch1, SequenceRequest(r.prompt_ids, r.max_new_tokens)))
    prefills = [shape for shape in spy.shapes if shape[1] != counter.tree.size]
    steps = [shape for shape in spy.shapes if shape[1] == counter.tree.size]
    assert sorted(p[1] for p in prefills) == sorted(len(r.prompt_ids) for r in _requests())
    assert all(p[0] == 1 for p in prefills)  # each joiner prefilled over its own row
    assert steps[0][0] == 5 and {b for b, _ in steps} >= {5, 4}  # all rows in one call; fewer once some left
    assert running[0][0] == 5 + 1  # the first boundary: 5 prefills, then one tree step for all 5 rows


def test_packed_past_is_kept_between_calls(counter, monkeypatch):
    """The batched engine's packed past (PackedPast): between calls over the same rows only the newly kept
    slots are copied, and every call's packed valid slots equal the rows' caches packed afresh."""
    from medusa_runtime.engines.kvcache import HeadMajorKVCache
    from medusa_runtime.engines.ort_rows import PackedPast, pack_past

    eng = counter.engine
    if not eng.max_batch:
        pytest.skip("the batch-1 graph: the scheduler loops over the rows")
    calls = []
    update = PackedPast.update

    def checked(self, caches, num_layers):
        arrays, lengths = update(self, caches, num_layers)
        fresh, _ = pack_past(caches, num_layers)
        head_major = isinstance(caches[0], HeadMajorKVCache)
        for pair, fresh_pair in zip(arrays, fresh):
            for got, want in zip(pair, fresh_pair):
                for b, n in enumerate(lengths):
                    np.testing.assert_array_equal(got[b, :, :n] if head_major else got[b, :n],
                                                  want[b, :, :n] if head_major else want[b, :n])
        calls.append(len(caches))
        return arrays, lengths

    monkeypatch.setattr(PackedPast, "update", checked)
    repacks = eng.packed.repacks
    sched = Scheduler(eng, counter.tree, max_batch=5, eos_token_ids=counter.eos_token_ids)
    states = [sched.submit(r) for r in _requests()]
    sched.run()
    assert all(s.error is None for s in states)
    assert len(calls) >= 8 and 1 <= eng.packed.repacks - repacks < len(calls) / 2  # mostly incremental


def test_batched_artifact_refuses_batch1_only_backends(counter_artifact):
    from medusa_runtime.contract.artifact import load_artifact
    from medusa_runtime.engines import create_engine
    from medusa_runtime.errors import BackendUnavailableError

    art = load_artifact(counter_artifact)
    if art.manifest.batch is None:
        pytest.skip("a batch-1 artifact")
    with pytest.raises(BackendUnavailableError, match="--backend onnxruntime or tensorrt, or build with --batch-size 1"):
        create_engine(art, "onnxruntime-cuda")


def test_fused_artifact_rows_keep_their_own_cache(tmp_path):
    """Head-major caches written in place by the fused graph, one per row: rows never see each other."""
    from medusa_export.pipeline import BuildConfig, build_artifact
    from medusa_runtime.trees.treespec import tree_from_spec

    lm = tiny_loaded(make_counter_medusa(miss_every=3), name="counter-fused", max_context=CONTEXT)
    art = build_artifact(lm, tree_from_spec("16", num_heads=3), tmp_path / "fused",
                         BuildConfig(validate=False, graph="fused"), progress=False)
    session = MedusaSession(art, threads=1)
    reqs = _requests(sampling=SamplingConfig(temperature=1.0, seed=3))
    sched = Scheduler(session.engine, session.tree, max_batch=3, eos_token_ids=session.eos_token_ids)
    states = [sched.submit(r) for r in reqs]
    sched.run()
    for s in states:
        _same(s, _batch1(session, s.request))


# ---------------------------------------------------------------------------------------
# Sequences that end alone: cancelled, a failing callback, bad requests, the context
# ---------------------------------------------------------------------------------------


def test_cancel_and_a_failing_callback_end_one_sequence_alone(counter):
    def boom(tokens):
        if len(tokens) and tokens[-1] > 120:
            raise RuntimeError("client gone")

    sched = Scheduler(counter.engine, counter.tree, max_batch=4)
    ok = sched.submit(SequenceRequest([50], 30, tag="ok"))
    bad = sched.submit(SequenceRequest([100], 40, on_tokens=boom, tag="bad"))
    gone = sched.submit(SequenceRequest([150], 40, tag="gone"))
    never = sched.submit(SequenceRequest([160], 40, tag="never"))
    never.cancel()
    finished = sched.step()
    assert never in finished and never.result.finish_reason == "cancelled" and never.result.tokens == []
    gone.cancel()
    sched.run()
    assert gone.result.finish_reason == "cancelled" and 0 < len(gone.result.tokens) < 40
    assert isinstance(bad.error, RuntimeError) and bad.result.finish_reason == "error"
    _same(ok, _batch1(counter, SequenceRequest([50], 30)))


def test_bad_requests_are_refused_at_submit(counter, monkeypatch):
    sched = Scheduler(counter.engine, counter.tree, max_batch=2)
    with pytest.raises(InvalidSettingError, match="prompt is empty"):
        sched.submit(SequenceRequest([], 4))
    with pytest.raises(InvalidSettingError, match="max_new_tokens must be an integer >= 0, got -1"):
        sched.submit(SequenceRequest([1], -1))
    with pytest.raises(ContextOverflowError, match="the prompt has 129 tokens but a sequence's context holds 128"):
        sched.submit(SequenceRequest([5] * 129, 4))
    with pytest.raises(InvalidTreeError, match="exceeds the engine's 3 Medusa heads"):
        sched.submit(SequenceRequest([1], 4, tree=make_tree([(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)], num_heads=4)))
    with monkeypatch.context() as m:  # an engine that cannot bind the in-graph sampler (CUDA / TensorRT engines)
        m.setattr(counter.engine, "capabilities", replace(counter.engine.capabilities, sampler=False))
        with pytest.raises(InvalidSettingError, match="Exact here: top_k 1..10"):
            sched.submit(SequenceRequest([1], 4, SamplingConfig(temperature=0.5, top_k=0)))
    with pytest.raises(InvalidSettingError, match="batch size must be an integer >= 1, got 0"):
        Scheduler(counter.engine, counter.tree, max_batch=0)
    assert sched.idle
    zero = sched.submit(SequenceRequest([1], 0))
    assert sched.run() == [zero] and zero.result.tokens == [] and zero.result.finish_reason == "length"


def test_rows_fill_their_context_independently(counter):
    """A row near its capacity falls back to one-token steps and ends with "length"; the others go on."""
    sched = Scheduler(counter.engine, counter.tree, max_batch=2, capacity=64)
    full = sched.submit(SequenceRequest(list(range(3, 3 + 60)), 50, tag="full"))
    free = sched.submit(SequenceRequest([100], 50, tag="free"))
    sched.run()
    ref = generate(counter.engine, list(range(3, 63)), counter.tree, max_new_tokens=50, max_context=64)
    assert full.result.tokens == ref.tokens and full.result.finish_reason == "length" and len(ref.tokens) == 5
    assert free.result.tokens == [(101 + i) % VOCAB for i in range(50)]


def test_batch_engine_wraps_batch1_engines(counter):
    if counter.engine.max_batch:  # a batched artifact's engine is its own batch engine
        assert batch_engine(counter.engine) is counter.engine and counter.engine.capabilities.batched
        assert counter.batch_engine is counter.engine
        return
    looped = batch_engine(counter.engine)
    assert isinstance(looped, LoopedBatchEngine) and not looped.capabilities.batched
    assert batch_engine(looped) is looped
    assert looped.num_layers == counter.engine.num_layers and looped.capabilities.max_context == CONTEXT


# ---------------------------------------------------------------------------------------
# MedusaSession.generate_batch and generate --prompt-file
# ---------------------------------------------------------------------------------------

TEXTS = ["hello there", "Compose an engaging travel blog post", "a", "isn't it ?", "Name three colors."]


def test_generate_batch_equals_generate(counter):
    """Text, ids, finish reason, steps and streamed pieces of each prompt: those of generate() alone."""
    stop = ["xyz"]
    seeds = [SamplingConfig(temperature=1.0, seed=s) for s in range(len(TEXTS))]
    pieces: dict[int, list[str]] = {}
    done = []
    start = time.perf_counter()
    got = counter.generate_batch(TEXTS, max_new_tokens=[20, 9, 30, 4, 16], sampling=seeds, stop=stop, batch_size=3,
                                 stream=lambda i, p: pieces.setdefault(i, []).append(p),
                                 on_done=lambda i, c: done.append(i))
    wall = time.perf_counter() - start
    tok = make_tiny_tokenizer()  # the artifact's tokenizer, with transformers' chat template: an independent count
    assert sorted(done) == list(range(len(TEXTS))) and done != list(range(len(TEXTS)))  # finish order != input order
    for i, (text, c) in enumerate(zip(TEXTS, got)):
        ref = counter.generate(text, max_new_tokens=[20, 9, 30, 4, 16][i], sampling=seeds[i], stop=stop)
        assert (c.token_ids, c.text, c.finish_reason) == (ref.token_ids, ref.text, ref.finish_reason), text
        assert c.result.step_tokens == ref.result.step_tokens
        assert "".join(pieces.get(i, [])) == c.text
        assert c.prompt_tokens == len(tok.apply_chat_template([{"role": "user", "content": text}],
                                                              add_generation_prompt=True, tokenize=True))
        assert 0 < c.seconds <= wall  # each reply's own time lies within the batch's
    greedy = counter.generate_batch(prompt_ids=[[100], [7, 8]], max_new_tokens=6, vanilla=True)
    assert [c.token_ids for c in greedy] == [list(range(101, 107)), list(range(9, 15))]
    assert greedy[0].result.step_tokens == [1] * 5


def test_generate_batch_refuses_bad_input_before_any_work(counter):
    with pytest.raises(InvalidSettingError, match="prompt 1: max_new_tokens must be an integer >= 0, got -2"):
        counter.generate_batch(prompt_ids=[[1], [2]], max_new_tokens=[3, -2])
    with pytest.raises(ValueError, match="max_new_tokens has 3 values for 2 prompts"):
        counter.generate_batch(prompt_ids=[[1], [2]], max_new_tokens=[3, 4, 5])
    with pytest.raises(InvalidSettingError, match="prompt 0: the prompt is empty"):
        counter.generate_batch(prompt_ids=[[], [2]])
    with pytest.raises(InvalidSettingError, match="top_p must be in"):
        counter.generate_batch(["a"], temperature=0.5, top_p=2.0)
    with pytest.raises(TypeError, match="sampling must be a SamplingConfig .*, got dict"):
        counter.generate_batch(["a", "b"], sampling=[SamplingConfig(), {"temperature": 0.5}])
    with pytest.raises(TypeError, match="unexpected keyword argument 'temprature': not a sampling setting"):
        counter.generate_batch(["a"], temprature=0.5)
    with pytest.raises(InvalidSettingError, match="batch size must be an integer >= 1"):
        counter.generate_batch(["a"], batch_size=0)


def _prompt_file(path):
    lines = [{"prompt": TEXTS[0]}, {"messages": [{"role": "system", "content": "be brief"},
                                                 {"role": "user", "content": TEXTS[1]}], "id": "x"},
             {"turns": [TEXTS[2], "second turn"], "question_id": 81}, {"prompt": TEXTS[3], "seed": 5},
             {"prompt": TEXTS[4], "max_new_tokens": 3}]
    path.write_text("\n".join(json.dumps(x) for x in lines[:2]) + "\n\n" + "\n".join(json.dumps(x) for x in lines[2:]))
    return path


@pytest.mark.parametrize("entry", ["medusa_runtime", "medusa-export"])
def test_cli_prompt_file(counter_artifact, counter, tmp_path, capsys, entry):
    from medusa_export.cli.main import main as export_main
    from medusa_runtime.front.cli import main as runtime_main

    main = runtime_main if entry == "medusa_runtime" else export_main
    argv = ["generate", "--artifact", str(counter_artifact), "--prompt-file", str(_prompt_file(tmp_path / "p.jsonl")),
            "--batch-size", "2", "--max-new-tokens", "12", "--temperature", "0.8", "--seed", "1", "--threads", "1"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    lines = [json.loads(line) for line in out.splitlines()]
    assert [x["index"] for x in lines] == list(range(5))
    prompts = [TEXTS[0], [{"role": "system", "content": "be brief"}, {"role": "user", "content": TEXTS[1]}],
               TEXTS[2], TEXTS[3], TEXTS[4]]
    for i, (x, prompt) in enumerate(zip(lines, prompts)):
        ref = counter.generate(prompt, max_new_tokens=3 if i == 4 else 12, temperature=0.8, seed=5 if i == 3 else 1)
        assert (x["token_ids"], x["text"], x["finish_reason"]) == (ref.token_ids, ref.text, ref.finish_reason), i
        assert x["tokens_per_step"] == round(ref.tokens_per_step, 4) and x["prompt_tokens"] == ref.prompt_tokens
    assert "5 prompts, batch size 2:" in err and "tokens/s in all" in err and "tokens/s per sequence" in err


@pytest.mark.parametrize("content, argv, message", [
    (None, [], "prompt file {f} does not exist"),
    ("{\"prompt\": \"a\"}\n{not json\n", [], "{f}:2: not valid JSON"),
    ("[1, 2]\n", [], "{f}:1: expected a JSON object, got list"),
    ("{\"text\": \"a\"}\n", [], "{f}:1: expected a 'prompt' string, a non-empty 'messages' list or a 'turns' list of "
                                "strings; the line has keys ['text']"),
    ("{\"prompt\": \"a\", \"seed\": -1}\n", [], "{f}:1: seed must be an integer >= 0, got -1"),
    ("\n\n", [], "prompt file {f} holds no prompts"),
    ("{\"prompt\": \"a\"}\n", ["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
])
def test_cli_bad_prompt_files_are_one_line_errors(counter_artifact, tmp_path, capsys, content, argv, message):
    from medusa_runtime.front.cli import main

    f = tmp_path / "p.jsonl"
    if content is not None:
        f.write_text(content)
    assert main(["generate", "--artifact", str(counter_artifact), "--prompt-file", str(f), *argv]) == 2
    err = capsys.readouterr().err
    assert message.format(f=f) in err and err.count("\n") == 1, err


def test_cli_batch_size_needs_a_prompt_file(counter_artifact, capsys):
    from medusa_export.cli.main import main

    assert main(["generate", "--artifact", str(counter_artifact), "--prompt", "a", "--batch-size", "2"]) == 2
    assert "--batch-size needs --prompt-file" in capsys.readouterr().err
    assert main(["generate", "--prompt-file", "x.jsonl"]) == 2
    assert "--prompt-file and --batch-size need --artifact" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--artifact", str(counter_artifact), "--prompt", "a", "--prompt-file", "x.jsonl"])
    assert "not allowed with argument" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------
# BatchServer: requests from many threads share steps (what the Triton model runs)
# ---------------------------------------------------------------------------------------


def test_batch_server_serves_threads_together(counter):
    import threading

    from medusa_runtime.front.serving import BatchServer, parse_request, serve

    fields = [{"text_input": t, "max_new_tokens": 10 + 3 * i, "stream": True} for i, t in enumerate(TEXTS)]
    fields[1].update(temperature=0.9, seed=4)
    fields[2].update(temperature=2.0, acceptance="typical", seed=1)
    fields[3]["stop"] = ["zz"]
    reqs = [parse_request(f, counter) for f in fields]
    want = [serve(counter, r) for r in reqs]
    logs: list[str] = []
    server = BatchServer(counter, batch_size=3, log=logs.append)
    results: dict[int, tuple] = {}
    barrier = threading.Barrier(len(reqs) + 2)

    def client(i, req, on_step=None):
        steps, done = [], threading.Event()

        def on_done(out, exc):
            results[i] = (out, exc, steps)
            done.set()

        barrier.wait(timeout=30)
        server.submit(req, on_step or (lambda ids, text: steps.append((ids, text))), on_done)
        assert done.wait(timeout=120)

    def broken(ids, text):
        raise BrokenPipeError("client gone")

    threads = [threading.Thread(target=client, args=(i, r)) for i, r in enumerate(reqs)]
    threads.append(threading.Thread(target=client, args=("broken", reqs[0], broken)))
    for t in threads:
        t.start()
    barrier.wait(timeout=30)
    for t in threads:
        t.join(timeout=180)
    server.close()
    for i, ref in enumerate(want):
        out, exc, steps = results[i]
        assert exc is None, exc
        assert (out.token_ids, out.text, out.finish_reason) == (ref.token_ids, ref.text, ref.finish_reason), i
        assert sum((ids for ids, _ in steps), []) == ref.token_ids and "".join(t for _, t in steps) == ref.text
    out, exc, _ = results["broken"]
    assert out is None and isinstance(exc, BrokenPipeError)
    assert server.max_batch_seen == 3 and logs[-1] == "medusa: 3 sequences share a step (the most so far)"
    with pytest.raises(RuntimeError, match="closed"):
        server.submit(reqs[0], None, lambda out, exc: None)


def test_batch_server_cancels_at_a_step_boundary(counter):
    import threading

    from medusa_runtime.front.serving import BatchServer, parse_request

    server = BatchServer(counter, batch_size=2)
    req = parse_request({"input_ids": [10], "max_new_tokens": 100}, counter)
    stop_now = threading.Event()
    got: list = []
    done = threading.Event()
    server.submit(req, lambda ids, text: stop_now.set(), lambda out, exc: (got.append((out, exc)), done.set()),
                  cancelled=stop_now.is_set)
    assert done.wait(timeout=60)
    server.close()
    (out, exc), = got
    assert exc is None and out.finish_reason == "cancelled" and 0 < len(out.token_ids) < 100


@pytest.mark.slow
def test_embedded_model_batch_equals_batch1(smollm_artifact):
    """The embedded SmolLM2 artifact: four MT-Bench prompts of different lengths, three sharing each step,
    greedy and exact sampling: every reply (ids, finish reason, tokens per step) is its batch-1 reply."""
    from conftest import mt_bench_prompts

    session = MedusaSession(smollm_artifact, threads=2)
    prompts = mt_bench_prompts(4)
    for settings in (dict(), dict(temperature=0.7, seed=3)):
        got = session.generate_batch(prompts, max_new_tokens=[40, 24, 40, 32], batch_size=3, **settings)
        for prompt, n, c in zip(prompts, [40, 24, 40, 32], got):
            ref = session.generate(prompt, max_new_tokens=n, **settings)
            assert (c.token_ids, c.finish_reason) == (ref.token_ids, ref.finish_reason), prompt
            assert c.result.step_tokens == ref.result.step_tokens
        assert max(c.tokens_per_step for c in got) > 1.2  # the heads do accept


@pytest.mark.slow
def test_embedded_model_batched_graph_equals_batch1_artifact(smollm, smollm_artifact, tmp_path):
    """The embedded SmolLM2 built with --batch-size 3: four MT-Bench prompts of different lengths, three rows per
    call, greedy: every reply (ids, finish reason, tokens per step) is the batch-1 artifact's generate."""
    from conftest import SMOLLM_TREE, mt_bench_prompts
    from medusa_export.pipeline import BuildConfig, build_artifact
    from medusa_runtime.engines.ort_batched import OrtBatchEngine
    from medusa_runtime.trees.treespec import tree_from_spec

    tree = tree_from_spec(SMOLLM_TREE, num_heads=smollm.model.num_heads, accuracies=smollm.head_accuracies)
    art = build_artifact(smollm, tree, tmp_path / "b3", BuildConfig(max_context=1024, validate=False, batch_size=3),
                         progress=False)
    batched, batch1 = MedusaSession(art, threads=2), MedusaSession(smollm_artifact, threads=2)
    assert isinstance(batched.engine, OrtBatchEngine)
    prompts, budgets = mt_bench_prompts(4), [40, 24, 40, 32]
    got = batched.generate_batch(prompts, max_new_tokens=budgets, batch_size=3)
    for prompt, n, c in zip(prompts, budgets, got):
        ref = batch1.generate(prompt, max_new_tokens=n)
        assert (c.token_ids, c.finish_reason) == (ref.token_ids, ref.finish_reason), prompt
        assert c.result.step_tokens == ref.result.step_tokens
    assert max(c.tokens_per_step for c in got) > 1.2  # the heads do accept
