"""The default tree (issue 19): the fastest tree on this engine and machine, timed once and cached.

The suite pins ``MEDUSA_EXPORT_TREE=artifact`` (conftest.py); the tests here clear it to test the default itself,
each with its own cache folder.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

import medusa_runtime.tuning.resolve as resolve_module
from conftest import hand_timed_trees, make_counter_medusa, tiny_loaded
from medusa_export.cli.main import main
from medusa_runtime.tuning.autotree import DEFAULT_MARGIN, TreeTiming, candidate_trees, choose_tree, pick, refine_with_loop
from medusa_runtime.engines import BACKENDS, BackendSpec
from medusa_runtime.engines.ort import OrtEngine
from medusa_runtime.errors import InvalidTreeError
from medusa_runtime.front.session import MedusaSession
from medusa_runtime.trees.treespec import tree_from_spec
from medusa_runtime.tuning.treecache import (CACHE_ENV, MAX_RECORDS, TREE_ENV, TreeRecord, artifact_identity, cached_choice,
                                      read_records, record_path, stale_reason, timing_key, write_records)

README_PROMPT = "Explain speculative decoding in two sentences."


@pytest.fixture
def default_env(monkeypatch, tmp_path):
    """The runtime's real default (no $MEDUSA_EXPORT_TREE), with a cache folder of the test's own."""
    monkeypatch.delenv(TREE_ENV, raising=False)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    # these tests are about the cache's keys; a timing too noisy to cache (test_autotree's timing_noise tests) would
    # make them depend on the machine's load
    monkeypatch.setattr(resolve_module, "timing_noise", lambda *args, **kwargs: None)
    return tmp_path / "cache"


def _build_counter(out, seed_scale: float = 6.0, tree: str = "8"):
    from medusa_export.pipeline import BuildConfig, build_artifact

    lm = tiny_loaded(make_counter_medusa(scale=seed_scale), name="counter", max_context=256)
    return build_artifact(lm, tree_from_spec(tree, num_heads=3), out, BuildConfig(validate=False), progress=False)


@pytest.fixture(scope="module")
def counter_artifact(tmp_path_factory):
    return _build_counter(tmp_path_factory.mktemp("default-tree") / "counter")


# --- the pure choice ----------------------------------------------------------------------------------------


def _rows(*rows):
    return [TreeTiming(*r) for r in rows]


def test_plain_decoding_is_kept_unless_a_tree_beats_it_by_the_margin():
    # root: 1 token / 10 ms = 100 tokens/s; 4 nodes: 1.5 / 14 ms = 107 (7% more); 2 nodes: 1.3 / 12 = 108.
    table = _rows((1, 1.0, 10.0, 0.0), (2, 1.3, 11.0, 1.0), (4, 1.5, 13.0, 1.0))
    assert DEFAULT_MARGIN == 0.1
    assert pick(table).size == 1
    assert pick(table, margin=0.0).size == 2
    faster = _rows((1, 1.0, 10.0, 0.0), (4, 1.5, 12.0, 1.0))  # 115 tokens/s: 15% more
    assert pick(faster).size == 4
    trees = candidate_trees([[0.5, 0.2], [0.3, 0.1]], [1, 2], num_heads=2, topk=2)
    with pytest.raises(InvalidTreeError, match="margin over plain decoding must be >= 0"):
        choose_tree(trees, [[0.5, 0.2], [0.3, 0.1]], {1: 1.0, 2: 1.0}, heads_ms=0.0, margin=-0.1)


def test_the_decode_loop_retimes_plain_decoding_and_the_leader_and_spreads_its_overhead():
    # By the step table: root 100 tokens/s, 2 nodes 1.3/11 = 118, 4 nodes 1.6/12 = 133, 8 nodes 1.8/15 = 120.
    table = _rows((1, 1.0, 10.0, 0.0), (2, 1.3, 10.0, 1.0), (4, 1.6, 11.0, 1.0), (8, 1.8, 14.0, 1.0))
    calls = []

    def loop_ms(size):  # the loop costs 3 ms more than the table for every tree, nothing more for plain decoding
        calls.append(size)
        row = next(r for r in table if r.size == size)
        return row.step_ms + row.heads_ms + (3.0 if size > 1 else 0.0)

    rows = refine_with_loop(table, loop_ms)
    # Root and the leader (4 nodes) timed, alternately, 3 times each: 4 nodes 1.6 / 15 ms = 106.7 tokens/s; the
    # others get the 3 ms overhead (2 nodes 1.3 / 14 = 92.9, 8 nodes 1.8 / 18 = 100); nothing beats root by 10%.
    assert calls == [1, 4] * 3
    assert [r.loop_ms for r in rows] == [10.0, None, 15.0, None]
    assert [r.overhead_ms for r in rows] == [0.0, 3.0, 0.0, 3.0]
    assert [round(r.tokens_per_second, 1) for r in rows] == [100.0, 92.9, 106.7, 100.0]
    assert pick(rows).size == 1
    assert pick(rows, margin=0.0).size == 4
    assert rows[1].to_json()["overhead_ms"] == 3.0 and rows[2].to_json()["loop_ms"] == 15.0


def test_the_leading_tree_is_timed_through_the_loop_even_when_plain_decoding_then_leads_on_paper():
    # By the step table: root 1 / 10 ms = 100 tokens/s, 2 nodes 1.3 / 11 ms = 118.2. Through the loop root takes 8 ms
    # (125 tokens/s, ahead of the 2-node row's table figure by the margin's measure: 118.2 < 1.1 * 125); the 2-node
    # tree through the loop takes 9 ms: 1.3 / 9 ms = 144.4 tokens/s > 1.1 * 125 = 137.5, so the tree is kept.
    table = _rows((1, 1.0, 10.0, 0.0), (2, 1.3, 10.0, 1.0))
    calls = []

    def loop_ms(size):
        calls.append(size)
        return {1: 8.0, 2: 9.0}[size]

    rows = refine_with_loop(table, loop_ms)
    assert calls == [1, 2] * 3 and [r.loop_ms for r in rows] == [8.0, 9.0]
    assert pick(rows).size == 2


def test_plain_decoding_and_the_leading_tree_are_timed_alternately_and_keep_their_fastest():
    # A machine whose speed swings between calls: plain decoding takes 15, 10, 15 ms, the 2-node tree 12, 18, 12 ms
    # (taken in turn: plain, tree, plain, tree, ...). Fastest of each: 10 and 12 ms, so 1.3 / 12 ms = 108.3
    # tokens/s against plain decoding's 100: within the 10% margin, plain decoding; with no margin, the tree.
    table = _rows((1, 1.0, 10.0, 0.0), (2, 1.3, 10.0, 1.0))
    answers = {1: iter([15.0, 10.0, 15.0]), 2: iter([12.0, 18.0, 12.0])}
    calls = []

    def loop_ms(size):
        calls.append(size)
        return next(answers[size])

    rows = refine_with_loop(table, loop_ms)
    assert calls == [1, 2, 1, 2, 1, 2] and [r.loop_ms for r in rows] == [10.0, 12.0]
    assert pick(rows).size == 1 and pick(rows, margin=0.0).size == 2


# --- the cache: keys, records, reuse and invalidation -------------------------------------------------------


def _key(**changes):
    base = dict(artifact="a" * 64, machine={"host": "h", "cpu": "c", "arch": "x86_64", "cores": 2},
                backend={"backend": "onnxruntime", "threads": None}, capacity=2048, policy="static")
    return timing_key(**{**base, **changes})


def test_stale_reasons_name_what_changed():
    key = _key()
    assert stale_reason(key, _key()) == ""
    assert stale_reason(None, key) == "no timing yet"
    assert stale_reason(key, _key(artifact="b" * 64)) == "the artifact changed"
    assert stale_reason(key, _key(machine={"host": "other"})) == "another machine"
    assert stale_reason(key, _key(backend={"backend": "onnxruntime", "threads": 1})) == "another backend, threads or --spin"
    assert stale_reason(key, _key(capacity=512, policy="dynamic")) == "another context capacity, another tree policy"
    assert stale_reason({**key, "version": 0}, key) == "a newer medusa_runtime"


def test_artifact_identity_follows_the_checksums_not_the_folder():
    a = {"model.onnx": "1" * 64, "weights.bin": "2" * 64}
    assert artifact_identity(a) == artifact_identity(dict(reversed(list(a.items()))))
    assert artifact_identity(a) != artifact_identity({**a, "weights.bin": "3" * 64})
    assert record_path("/x/a", Path("/c")).parent == Path("/c/trees")
    assert record_path("/x/a", Path("/c")) == record_path("/x/./a", Path("/c"))
    assert record_path("/x/a", Path("/c")) != record_path("/x/b", Path("/c"))


def test_records_round_trip_and_bad_ones_are_remade(tmp_path):
    rec = TreeRecord(_key(), 4, tuple(_rows((1, 1.0, 10.0, 0.0, 9.5), (4, 1.6, 11.0, 1.0, 14.0))), 2.5, 1.0e9)
    path = tmp_path / "trees" / "r.json"
    assert write_records(path, [rec]) is None
    assert read_records(path) == [rec]
    path.write_text("{not json")
    assert read_records(path) == []
    bad = {**rec.to_json(), "chosen": 3}  # a size that is not in its table: skipped, the good one kept
    path.write_text(json.dumps({"records": [bad, rec.to_json()]}))
    assert read_records(path) == [rec]
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert write_records(blocked / "trees" / "r.json", [rec])  # a file where the folder should be: why, no crash


def test_cached_choice_measures_once_and_again_when_the_key_changes(tmp_path):
    measured = []

    def measure():
        measured.append(1)
        return 4, _rows((1, 1.0, 10.0, 0.0), (4, 1.6, 11.0, 1.0))

    first = cached_choice("/art", _key(), measure, folder=tmp_path)
    again = cached_choice("/art", _key(), measure, folder=tmp_path)
    assert (first.timed, again.timed, len(measured)) == (True, False, 1)
    assert again.record == first.record and again.describe() == "fastest here, cached"
    moved = cached_choice("/art", _key(machine={"host": "other"}), measure, folder=tmp_path)
    assert moved.timed and moved.reason == "another machine" and len(measured) == 2
    assert "timing tree sizes on this machine (another machine)" in moved.notice()
    assert "a 4-node tree, 133.3 expected tokens/s vs 100.0 plain" in moved.notice()
    # Both configurations keep their record: switching back does not time again.
    assert not cached_choice("/art", _key(), measure, folder=tmp_path).timed and len(measured) == 2
    for threads in range(1, MAX_RECORDS + 1):  # the newest MAX_RECORDS are kept
        cached_choice("/art", _key(backend={"backend": "onnxruntime", "threads": threads}), measure, folder=tmp_path)
    assert len(read_records(record_path("/art", tmp_path))) == MAX_RECORDS
    # A changed artifact drops the records of the earlier one.
    cached_choice("/art", _key(artifact="b" * 64), measure, folder=tmp_path)
    assert [r.key["artifact"] for r in read_records(record_path("/art", tmp_path))] == ["b" * 64]


def test_the_build_summary_says_cached_only_when_the_file_was_written(tmp_path):
    """A fresh user's trial found the build printing "cached in FILE" for a noisy timing that was never written
    (the runtime's own notice said "not cached"): the summary now states what happened to the file."""
    from medusa_export.cli.main import machine_tree_lines

    def measure():
        return 4, _rows((1, 1.0, 10.0, 0.0), (4, 1.6, 11.0, 1.0))

    noisy = cached_choice("/art", _key(), measure, folder=tmp_path, cacheable=lambda table: False)
    head = machine_tree_lines(noisy, 4)[0]
    assert not noisy.path.exists() and "not cached: the timing was noisy" in head and "cached in" not in head
    written = cached_choice("/art", _key(), measure, folder=tmp_path)
    assert written.path.exists() and f"cached in {written.path}" in machine_tree_lines(written, 4)[0]
    reused = cached_choice("/art", _key(), measure, folder=tmp_path)
    assert f"read from the cache {reused.path}" in machine_tree_lines(reused, 4)[0]


# --- MedusaSession, the CLI, build and Triton -----------------------------------------------------------------


def test_session_times_once_then_reuses_and_retimes_on_a_change(counter_artifact, default_env, monkeypatch):
    # By hand: a 4-node step takes 10 ms, every other size 1 s: whatever its accuracies, no other tree (at most
    # 1 + depth 3 tokens a step) comes near the 4-node tree's 100+ tokens/s, so 4 is the choice timed and recorded.
    hand_timed_trees(monkeypatch, lambda n: 10.0 if n == 4 else 1000.0)
    notices = []
    first = MedusaSession(counter_artifact, threads=1, notice=notices.append)
    rec = first.default_tree.record
    assert first.default_tree.timed and first.tree_source == "fastest here, timed now"
    assert len(notices) == 1 and notices[0].startswith("timing tree sizes on this machine: ")
    assert record_path(counter_artifact, default_env).is_file()
    assert first.tree.size == rec.chosen == 4  # the session runs the recorded choice, the one worked out above
    assert rec.row(1).loop_ms == 1000.0  # plain decoding is always timed through the loop

    notices.clear()
    second = MedusaSession(counter_artifact, threads=1, notice=notices.append)
    assert not second.default_tree.timed and notices == [] and second.tree_source == "fastest here, cached"
    assert second.tree.size == first.tree.size and second.default_tree.record == rec
    assert second.generate("hi", max_new_tokens=6).token_ids == first.generate("hi", max_new_tokens=6).token_ids

    other_threads = MedusaSession(counter_artifact, threads=2, notice=notices.append)
    assert other_threads.default_tree.reason == "another backend, threads or --spin" and len(notices) == 1
    assert not MedusaSession(counter_artifact, threads=1, notice=None).default_tree.timed  # both kept
    monkeypatch.setattr(resolve_module, "machine_fingerprint", lambda: {"host": "elsewhere", "cores": 64})
    moved = MedusaSession(counter_artifact, threads=2, notice=None)
    assert moved.default_tree.timed and moved.default_tree.reason == "another machine"


def test_a_rebuilt_artifact_is_timed_again(tmp_path, default_env):
    path = _build_counter(tmp_path / "a")
    assert MedusaSession(path, threads=1, notice=None).default_tree.timed
    assert not MedusaSession(path, threads=1, notice=None).default_tree.timed
    _build_counter(tmp_path / "a", seed_scale=5.0)  # other weights, same folder
    again = MedusaSession(path, threads=1, notice=None).default_tree
    assert again.timed and again.reason == "the artifact changed"


@pytest.mark.parametrize("how", ["default", "auto", "prompt-file"])
def test_a_prompt_that_cannot_fit_is_refused_before_any_tree_is_timed(counter_artifact, default_env, tmp_path, how,
                                                                      capsys):
    """``generate`` with a prompt longer than the context: the error comes before the default tree (or ``--tree
    auto``) is timed, so nothing is timed and no record is written; a prompt that fits is timed as before."""
    from medusa_runtime.contract.artifact import load_artifact
    from medusa_runtime.contract.tokenizer import RuntimeTokenizer

    long = " ".join(["hello"] * 12)  # raw, against a 6-token context
    n = len(RuntimeTokenizer.from_artifact(load_artifact(counter_artifact)).encode(long))
    assert n > 6
    base = ["generate", "--artifact", str(counter_artifact), "--raw", "--max-context", "6", "--max-new-tokens", "2"]

    def argv(*prompts):
        if how != "prompt-file":
            return base + ["--prompt", prompts[-1]] + (["--tree", "auto"] if how == "auto" else [])
        file = tmp_path / "prompts.jsonl"
        file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
        return base + ["--prompt-file", str(file)]

    capsys.readouterr()
    assert main(argv("hello", long)) == 2
    err = capsys.readouterr().err
    prefix = "prompt 1: " if how == "prompt-file" else ""
    free = "a sequence's context holds 6" if how == "prompt-file" else "only 6 of the 6-token context are free"
    assert f"medusa-export: error: {prefix}the prompt has {n} tokens but {free}" in err
    assert "timing" not in err and not (default_env / "trees").exists()
    assert main(argv("hello")) == 0  # a prompt that fits: timed as before
    assert "timing" in capsys.readouterr().err


def test_the_artifacts_tree_on_request_and_from_the_environment(counter_artifact, default_env, monkeypatch):
    given = MedusaSession(counter_artifact, threads=1, tree="artifact", notice=None)
    assert given.tree.size == 8 and given.default_tree is None and given.tree_source == "the artifact's"
    monkeypatch.setenv(TREE_ENV, "artifact")
    pinned = MedusaSession(counter_artifact, threads=1)
    assert pinned.tree.size == 8 and pinned.default_tree is None
    monkeypatch.setenv(TREE_ENV, "root")
    assert MedusaSession(counter_artifact, threads=1).tree.size == 1
    assert not (default_env / "trees").exists()  # nothing was timed
    with pytest.raises(InvalidTreeError, match="needs an artifact"):
        tree_from_spec("artifact", num_heads=3)


def test_engines_of_a_fixed_tree_keep_it_and_say_so(counter_artifact, default_env, monkeypatch):
    # a backend whose entry says its tree is fixed when the engine is built (as tensorrt's)
    spec = BackendSpec("fixed-tree-test", lambda art, threads=None, **_: OrtEngine(art, threads=threads),
                       library="onnxruntime", needs="onnxruntime", fixed_tree=True)
    monkeypatch.setitem(BACKENDS, spec.name, spec)
    notices = []
    s = MedusaSession(counter_artifact, backend="fixed-tree-test", threads=1, notice=notices.append)
    assert s.tree.size == 8 and s.default_tree is None and s.tree_source == "the tree the engine was built for"
    assert notices == ["the fixed-tree-test engine is built for the artifact's 8-node tree: running it (no timing "
                       "of other sizes; --tree picks another)"]
    assert not (default_env / "trees").exists()


def test_trt_engines_declare_a_fixed_tree():
    assert BACKENDS["tensorrt"].fixed_tree is True
    assert [name for name, spec in BACKENDS.items() if spec.fixed_tree] == ["tensorrt"]


@pytest.fixture
def timings_favouring_4_nodes(monkeypatch):
    """Tree-step and decode-loop timings (fixed, in place of the machine's) under which 4 nodes is the fastest:
    sizes 1-4 cost the same 10 ms step (+0.5 ms heads, +0.5 ms of loop for trees), larger ones 1 s."""
    import medusa_runtime.tuning.autotree as autotree

    step = lambda n: 10.0 if n <= 4 else 1000.0  # noqa: E731

    def tree_steps(engine, trees, **_):
        return {n: step(n) for n in trees}, {n: 0.5 if n > 1 else 0.0 for n in trees}

    def decode_loop(engine, tree, **_):
        return step(tree.size) + (1.0 if tree.size > 1 else 0.0)

    monkeypatch.setattr(autotree, "time_tree_steps", tree_steps)
    monkeypatch.setattr(autotree, "time_decode_loop", decode_loop)


@pytest.mark.slow
def test_readme_main_job_then_generate_runs_the_fastest_tree(tmp_path, default_env, timings_favouring_4_nodes):
    """The README's flow on the embedded model, with timings under which the 4-node tree is the fastest: build
    (64 nodes) times the sizes and caches its pick; generate then runs that pick without timing again, and its
    reply is plain greedy decoding's (``--tree root``) token for token."""
    out = tmp_path / "smollm2-135m-t64-fp32"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert main(["build", "--model", "smollm2-135m", "--tree", "64", "--no-validate", "--out", str(out)]) == 0
    text = stdout.getvalue()
    [rec] = read_records(record_path(out, default_env))
    assert rec.chosen == 4
    # 4 nodes: the calibrated tokens/step over an 11 ms loop step; 64 nodes: over the 1 s step + heads + overhead
    four, sixty_four = rec.row(4), rec.row(64)
    assert four.loop_ms == 11.0 and sixty_four.overhead_ms == 0.5
    assert f"the artifact's tree: 64 nodes, {sixty_four.expected_tokens:.2f} expected tokens/step, 1001.0 ms/step" in text
    assert f"this machine's pick: 4 nodes, {four.expected_tokens:.2f} expected tokens/step, 11.0 ms/step" in text
    assert "plain decoding: 1 node, 1.00 expected tokens/step, 10.0 ms/step, 100.0 expected tokens/s" in text

    runs = {}
    for tree in (None, "root"):
        out_buf, err_buf = io.StringIO(), io.StringIO()
        argv = ["generate", "--artifact", str(out), "--prompt", README_PROMPT, "--max-new-tokens", "12"]
        with contextlib.redirect_stdout(out_buf), contextlib.redirect_stderr(err_buf):
            assert main(argv + (["--tree", tree] if tree else [])) == 0
        runs[tree] = (out_buf.getvalue(), err_buf.getvalue())
    err = runs[None][1]
    assert "timing tree sizes" not in err  # build's timing was reused
    assert "Medusa tree of 4 nodes (fastest here, cached)" in err
    assert "Medusa tree of 1 node = plain decoding (--tree root)" in runs["root"][1]
    assert runs[None][0] == runs["root"][0]  # greedy: the 4-node tree gives plain decoding's reply


def test_plain_decoding_is_the_default_when_no_tree_pays(counter_artifact, default_env, monkeypatch):
    """Timings under which a tree step costs 10x plain decoding's (more than the 3 heads can win back, at most 4
    tokens per step): the default is plain decoding."""
    import medusa_runtime.tuning.autotree as autotree

    monkeypatch.setattr(autotree, "time_tree_steps",
                        lambda engine, trees, **_: ({n: 10.0 if n == 1 else 100.0 for n in trees}, {n: 0.0 for n in trees}))
    monkeypatch.setattr(autotree, "time_decode_loop", lambda engine, tree, **_: 10.0 if tree.size == 1 else 100.0)
    s = MedusaSession(counter_artifact, threads=1, notice=None)
    assert s.tree.size == 1 and s.default_tree.record.chosen == 1
    assert "fastest: plain decoding (no tree beats it here)" in s.default_tree.notice()


def test_triton_repository_passes_the_tree_parameter(counter_artifact, tmp_path):
    from medusa_export.triton.repository import TritonConfig, write_repository

    default = write_repository(counter_artifact, tmp_path / "r1", TritonConfig(engine_models=False))
    assert 'key: "tree"' not in (default / "medusa" / "config.pbtxt").read_text()
    assert (default / "medusa" / "1" / "medusa_runtime" / "tuning" / "treecache.py").is_file()
    assert "Tree: the runtime's default, the tree fastest on the serving machine: timed when the model" \
        in (default / "README.md").read_text()
    given = write_repository(counter_artifact, tmp_path / "r2", TritonConfig(engine_models=False, tree="4"))
    assert 'parameters { key: "tree" value: { string_value: "4" } }' in (given / "medusa" / "config.pbtxt").read_text()
    assert "Tree: `--tree 4` (model parameter `tree`)." in (given / "README.md").read_text()
