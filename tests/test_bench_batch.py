"""scripts/bench_batch.py on tiny batched fused artifacts (fp32 and int4) of the counter model: one run measures
vanilla and every Medusa tree at each batch size, labels the rows by the manifest's precision and graph, picks a
tree per B, writes the JSON, the dated markdown table and the chart, and every reply is the counter's own
continuation whatever the tree (vanilla and Medusa rows give identical tokens)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from conftest import MT_BENCH, make_counter_medusa, tiny_loaded

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "bench_batch.py"
_spec = importlib.util.spec_from_file_location("bench_batch", _PATH)
bb = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("bench_batch", bb)
_spec.loader.exec_module(bb)

VOCAB, EOS = 300, 2


@pytest.fixture(scope="module")
def counter_artifacts(tmp_path_factory):
    """The counter model (greedy next token after t: t+1 mod V; every head guesses right) built as batched
    fused step graphs, fp32 and int4, ``--batch-size 4``."""
    from medusa_export.pipeline import BuildConfig, build_artifact
    from medusa_runtime.trees.treespec import tree_from_spec

    root = tmp_path_factory.mktemp("bench_batch")
    lm = tiny_loaded(make_counter_medusa(), name="counter", max_context=512)
    return [build_artifact(lm, tree_from_spec("16", num_heads=3), root / precision,
                           # int4 with fp32 activations (level 1): any tree (the int8-activation regime takes chains)
                           BuildConfig(validate=False, batch_size=4, graph="fused", precision=precision,
                                       accuracy_level=1 if precision == "int4" else None),
                           progress=False)
            for precision in ("fp32", "int4")]


def counter_reply(prompt_ids: list[int], n: int) -> list[int]:
    """The counter model's greedy reply, computed independently: last+1, last+2, ... up to EOS or n tokens."""
    out, t = [], prompt_ids[-1]
    while len(out) < n:
        t = (t + 1) % VOCAB
        if t == EOS:
            break
        out.append(t)
    return out


def test_bench_batch_curve(counter_artifacts, tmp_path, capsys):
    out = tmp_path / "curve.json"
    assert bb.main(["--artifacts", *map(str, counter_artifacts), "--trees", "2,4", "--batch-sizes", "1,2,4",
                    "--prompts", "3", "--max-new-tokens", "6", "--threads", "1", "--out", str(out),
                    "--questions", str(MT_BENCH)]) == 0
    report = json.loads(out.read_text())
    from medusa_runtime.front.session import MedusaSession

    session = MedusaSession(counter_artifacts[0], threads=1)
    replies = [counter_reply(session.encode(q), 6) for q in bb.read_first_turns(MT_BENCH, 4)]  # by hand
    assert report["batch_sizes"] == [1, 2, 4] and report["tree_specs"] == ["2", "4"] and report["model"] == "counter"
    assert [(a["precision"], a["graph"], a["max_batch_size"]) for a in report["artifacts"]] == [
        ("fp32", "fused", 4), ("int4", "fused", 4)]
    for a in report["artifacts"]:
        assert a["trees"] == {"vanilla": {"size": 1, "depth": 0}, "T=2": {"size": 2, "depth": 1},
                              "T=4": {"size": 4, "depth": 3}}
        assert [(r["batch"], r["sequences"]) for r in a["rows"]] == [(1, 3), (2, 3), (4, 4)]
        for r in a["rows"]:
            ba = r["batched"]
            assert r["identical"] is True and r["differs"] == [] and "looped" not in r
            assert set(ba["trees"]) == {"vanilla", "T=2", "T=4"}
            assert ba["vanilla"]["tokens_per_step"] == 1.0 and ba["vanilla"]["max_batch_seen"] == r["batch"]
            # the chosen tree is the measured best, and the counter's heads are always right
            best = max(("T=2", "T=4"), key=lambda t: ba["trees"][t]["tokens_per_s"])
            assert ba["medusa"]["tree"] == best and ba["medusa"]["tree_size"] == int(best[2:])
            assert ba["medusa"]["tokens_per_step"] > 1.5
            assert ba["medusa_over_vanilla"] == pytest.approx(ba["medusa"]["tokens_per_s"] / ba["vanilla"]["tokens_per_s"])
            mine = replies[:r["sequences"]]
            for m in ba["trees"].values():  # one run each (--repeats 1): the counter's reply tokens over its wall time
                assert m["tokens_per_s"] == pytest.approx(sum(map(len, mine)) / m["wall_s"])
                # no sequence takes longer than the whole run: each one's tokens/s is at least its tokens / wall
                assert m["per_sequence_tokens_per_s"] >= min(map(len, mine)) / m["wall_s"] > 0
    table = out.with_suffix(".md").read_text()
    assert table.startswith(f"## Batch curve, {report['date'][:10]}")
    assert sum(line.startswith("| fp32 | fused |") for line in table.splitlines()) == 3
    assert sum(line.startswith("| int4 | fused |") for line in table.splitlines()) == 3
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| precision | graph | B |" in capsys.readouterr().out


def test_vanilla_and_medusa_rows_give_the_counters_tokens(counter_artifacts):
    """The runs the report is made of: at B = 1 and 4, vanilla (root-only tree) and each Medusa tree return every
    prompt's independent reference reply, on the batched engine and looped over the same graph."""
    from medusa_runtime.front.session import MedusaSession

    session = MedusaSession(counter_artifacts[0], threads=1)
    trees = bb.candidate_trees(session, ["2", "4", "chain"])
    assert {n: t.size for n, t in trees.items()} == {"vanilla": 1, "T=2": 2, "T=4": 4, "chain": 4}
    prompts = [session.encode(q) for q in bb.read_first_turns(MT_BENCH, 4)]
    want = [counter_reply(p, 6) for p in prompts]
    assert sum(map(len, want)) >= 20
    for b in (1, 4):
        for name, tree in trees.items():
            run = bb.run_once(session.batch_engine, session, tree, prompts, 6, b)
            assert run["ids"] == want, (b, name)
            assert run["max_batch_seen"] == b
    looped = bb.LoopedBatchEngine(session.engine)  # --looped without --looped-artifacts: the graph as a batch of one
    assert bb.run_once(looped, session, trees["T=4"], prompts, 6, 4)["ids"] == want


def test_a_differing_reply_fails_the_run(counter_artifacts, tmp_path, monkeypatch):
    """A Medusa reply that differs from vanilla's is reported (``identical`` false, NO in the table) and the exit
    status is 1, after the files are written. The looped mode runs on a batch-1 artifact (--looped-artifacts)."""
    from medusa_export.pipeline import BuildConfig, build_artifact
    from medusa_runtime.trees.treespec import tree_from_spec

    batch1 = build_artifact(tiny_loaded(make_counter_medusa(), name="counter", max_context=512),
                            tree_from_spec("16", num_heads=3), tmp_path / "b1", BuildConfig(validate=False, graph="fused"),
                            progress=False)
    real = bb.run_once

    def corrupt(engine, session, tree, *args):
        run = real(engine, session, tree, *args)
        if tree.size > 1:
            run["ids"] = [ids[:-1] + [ids[-1] + 1] for ids in run["ids"]]
        return run

    monkeypatch.setattr(bb, "run_once", corrupt)
    out = tmp_path / "bad.json"
    assert bb.main(["--artifacts", str(counter_artifacts[0]), "--trees", "2", "--batch-sizes", "2", "--prompts", "2",
                    "--max-new-tokens", "3", "--threads", "1", "--out", str(out), "--looped-artifacts", str(batch1),
                    "--questions", str(MT_BENCH)]) == 1
    art = json.loads(out.read_text())["artifacts"][0]
    assert art["looped_artifact"] == str(batch1)
    row = art["rows"][0]
    assert row["identical"] is False and row["differs"] == ["batched T=2", "looped T=2"]
    assert set(row["batched_over_looped"]) == {"vanilla", "medusa"}
    assert row["looped"]["vanilla"]["max_batch_seen"] == 2
    assert "| NO: batched T=2, looped T=2 |" in out.with_suffix(".md").read_text()


@pytest.mark.parametrize("argv, message", [
    (["--trees", "4,4"], "give each Medusa tree once"),
    (["--trees", "root,4"], "give each Medusa tree once"),
    (["--batch-sizes", "0,2"], "must be >= 1"),
    (["--batch-sizes", "1,x"], "not a comma-separated list"),
    (["--prompts", "0"], "must be >= 1"),
    (["--looped-artifacts", "a", "b"], "2 entries for 1 --artifacts"),
])
def test_bad_arguments_are_refused_before_any_work(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bb.main(["--artifacts", "/nonexistent", *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err
