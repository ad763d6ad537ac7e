"""Validation against a reference that shares no code with the runtime (medusa_export.validation.independent), and
what `verify` reads, loads and reports (issue 40): a bug planted in the runtime's KV compaction fails `verify`;
`verify` opens the backbone and heads the manifest records; zero compared tokens is not a pass; a near-tie is
reported with its step and margin; a failed trtexec names its log.

Tiny random models only (the embedded model's checks are in tests/test_embedded.py, marked slow)."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import xml.etree.ElementTree as ET
from dataclasses import replace

import pytest

from conftest import make_counter_medusa, make_tiny_medusa, make_tiny_tokenizer, plain_greedy, tiny_loaded
from medusa_export.cli.main import main
from medusa_export.errors import MedusaError
from medusa_export.model.decode import KVCache, TorchEngine
from medusa_export.model.heads import save_heads
from medusa_export.pipeline import BuildConfig, build_artifact
from medusa_export.validation.independent import IndependentReference, token_budget
from medusa_runtime.errors import EXIT_MISMATCH, EXIT_USAGE
from medusa_runtime.decode.loop import generate
from medusa_runtime.trees.tree import make_tree
from medusa_runtime.trees.treespec import tree_from_spec

KINDS = ["transformers-generate", "full-recompute"]


# --- the independent reference itself ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_reference_decodes_the_counter_model_by_hand(kind):
    """The counter model's greedy next token after t is t+1 (conftest.make_counter_medusa): the reference's tokens
    are known by hand, EOS is cut (not emitted) and the context limit leaves C - n + 1 tokens."""
    ref = IndependentReference(make_counter_medusa(), kind)
    assert ref.kind == kind
    run = ref.greedy([7, 8, 9], max_new_tokens=6)
    assert run.tokens == [10, 11, 12, 13, 14, 15]
    assert len(run.margins) == 6 and (run.margins > 1.0).all()  # the counter's top-1 leads by a wide margin
    assert ref.greedy([7, 8, 9], max_new_tokens=6, eos_token_ids=[13]).tokens == [10, 11, 12]
    assert ref.greedy([7, 8, 9], max_new_tokens=6, max_context=5).tokens == [10, 11, 12]  # 5 - 3 + 1 tokens
    assert ref.greedy([299], max_new_tokens=2).tokens == [0, 1]  # t+1 mod V
    assert ref.greedy([0], max_new_tokens=5).tokens == [1, 2, 3, 4, 5]  # 2, the config's default EOS, is not asked for


def test_the_context_budget_is_the_runtimes():
    """token_budget against what the runtime's loop really emits when the context fills (not a restatement)."""
    model = make_counter_medusa()
    for cap, prompt in [(8, [3, 4, 5, 6, 7]), (6, [1, 2, 3, 4, 5, 6]), (40, [1, 2])]:
        out = generate(TorchEngine(model, max_context=cap), prompt, make_tree([], num_heads=3), max_new_tokens=64,
                       max_context=cap)
        assert len(out.tokens) == token_budget(len(prompt), 64, cap), cap


@pytest.mark.parametrize("kind", KINDS)
def test_reference_equals_transformers_plain_greedy_on_a_random_model(kind):
    """Both kinds against conftest.plain_greedy (transformers' own model, loaded separately): 24 tokens."""
    hf, model = make_tiny_medusa(vocab=320, seed=3)
    prompt = [5, 17, 33, 2, 90, 41, 7]
    assert IndependentReference(model, kind).greedy(prompt, max_new_tokens=24).tokens == plain_greedy(hf, prompt, 24)


def test_unknown_reference_kind_and_empty_prompt_are_refused():
    _, model = make_tiny_medusa(vocab=64, hidden=16)
    with pytest.raises(MedusaError, match="unknown independent reference 'cached'"):
        IndependentReference(model, "cached")
    with pytest.raises(MedusaError, match="at least one token"):
        IndependentReference(model, "full-recompute").greedy([], max_new_tokens=4)


# --- verify on an artifact built from local folders -------------------------------------------------------------


@pytest.fixture(scope="module")
def local_build(tmp_path_factory):
    """A tiny model folder and a separate heads folder (trained-like: noisy heads), and the artifact `build` made
    from them through main(): (model dir, heads dir, artifact)."""
    root = tmp_path_factory.mktemp("local")
    hf, model = make_tiny_medusa(vocab=300, hidden=32, layers=2, heads=4, kv_heads=2, medusa_heads=3, seed=5,
                                 head_noise=0.3)
    hf.save_pretrained(root / "model", safe_serialization=True)
    make_tiny_tokenizer().save_pretrained(root / "model")
    save_heads(model.heads, root / "heads")
    art = root / "art"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["build", "--model", str(root / "model"), "--heads", str(root / "heads"), "--tree", "16",
                     "--max-context", "256", "--max-new-tokens", "12", "--out", str(art)]) == 0
    return root / "model", root / "heads", art


def _plant_compaction_bug(monkeypatch):
    """The issue's planted bug: after each copy of accepted K/V into the cache, the first written slot is zeroed.
    Patched where the runtime's KVCache.keep looks it up (one module global), so every engine in this process
    (ONNX Runtime's and the PyTorch reference's in the runtime's loop) runs it."""
    scope = KVCache.keep.__globals__
    original = scope["write_accepted"]

    def write_accepted(cache, new, past_len, accepted):
        length = original(cache, new, past_len, accepted)
        cache[:, past_len] = 0
        return length

    monkeypatch.setitem(scope, "write_accepted", write_accepted)


@pytest.mark.parametrize("checks", ["full", "truncated,self"])  # truncated + self: the plan of a model too big
def test_verify_fails_with_a_bug_planted_in_the_kv_compaction(local_build, monkeypatch, capsys, checks):
    """Before the independent reference both sides ran the runtime's loop and cache and verify still PASSED."""
    _, _, art = local_build
    check = checks.split(",")[0]
    argv = ["verify", "--artifact", str(art), "--checks", checks, "--validate-layers", "1", "--max-new-tokens", "12"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.count(f"{check:9s} identical") == 3
    assert f"{check:9s} reference: transformers generate (greedy, its own KV cache), PyTorch fp32, same weights" in out

    _plant_compaction_bug(monkeypatch)
    assert main(argv) == EXIT_MISMATCH
    out, err = capsys.readouterr()
    bad = out.count(f"{check:9s} MISMATCH")  # a zeroed slot need not change every prompt's argmax in a random model
    assert bad >= 1 and "FAILED:" in err
    assert err.count(f"{check}: ") >= bad and err.count("diverge from the reference (transformers generate") == bad
    assert err.count("so the fault is in code both share (the decode loop, KV cache and compaction") == bad


def test_build_summary_names_the_reference(local_build):
    _, _, art = local_build
    from medusa_export.validation.validate import validation_summary

    v = json.loads((art / "manifest.json").read_text())["validation"]
    assert v["reference"] == "transformers generate (greedy, its own KV cache), PyTorch fp32, same weights"
    assert all(p["identical"] and p["plain_identical"] and p["loop_identical"] for p in v["prompts"])
    assert validation_summary(v).startswith(
        "PASSED: Medusa and plain greedy tokens identical to the reference on 3/3 prompts x 12 tokens (reference: "
        "transformers generate")


def test_verify_loads_the_backbone_and_heads_the_manifest_records(local_build, tmp_path, capsys):
    """It refused ("not a registered model") without --model-path, and with --model-path alone it loaded untrained
    heads and failed the checksums ("the checkpoint changed")."""
    model_dir, heads_dir, art = local_build
    m = json.loads((art / "manifest.json").read_text())["model"]
    assert (m["backbone_source"], m["heads_source"]) == (str(model_dir), str(heads_dir))  # absolute
    for extra in ([], ["--model-path", str(model_dir)]):
        assert main(["verify", "--artifact", str(art), "--limit", "1", "--max-new-tokens", "4", *extra]) == 0, extra
        err = capsys.readouterr().err
        assert f"heads: {heads_dir} (as the manifest records)" in err
        assert f"backbone: {model_dir} ({'--model-path' if extra else 'as the manifest records'})" in err

    moved = tmp_path / "moved"  # the recorded folders are gone: verify names them and the option to use
    shutil.copytree(art, moved)
    manifest = json.loads((moved / "manifest.json").read_text())
    manifest["model"]["backbone_source"] = str(tmp_path / "gone-model")
    manifest["model"]["heads_source"] = str(tmp_path / "gone-heads")
    (moved / "manifest.json").write_text(json.dumps(manifest))
    assert main(["verify", "--artifact", str(moved), "--limit", "1", "--max-new-tokens", "4"]) == EXIT_USAGE
    assert f"heads were '{tmp_path / 'gone-heads'}'" in capsys.readouterr().err
    assert main(["verify", "--artifact", str(moved), "--heads", str(heads_dir), "--limit", "1"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert f"built from '{tmp_path / 'gone-model'}'" in err and "--model-path" in err
    manifest["model"]["heads_source"] = "heads"  # a relative path recorded by an older build, not here
    (moved / "manifest.json").write_text(json.dumps(manifest))
    assert main(["verify", "--artifact", str(moved), "--model-path", str(model_dir), "--limit", "1"]) == EXIT_USAGE
    assert "would compare with untrained heads: give the heads with --heads" in capsys.readouterr().err


# --- nothing compared is not a pass -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def counter_artifact(tmp_path_factory):
    """The counter model exported (fp32, a 4-node tree), no validation: (artifact path, its LoadedMedusa)."""
    lm = tiny_loaded(make_counter_medusa(), max_context=256)
    out = tmp_path_factory.mktemp("counter") / "art"
    return build_artifact(lm, tree_from_spec("4", num_heads=3), out, BuildConfig(validate=False), progress=False), lm


def test_zero_compared_tokens_is_not_a_pass(counter_artifact):
    """A model whose first new token is EOS: it said PASSED ("identical on 3/3 prompts x 0/0/0 of 16 tokens")."""
    from medusa_export.validation.checks import check_self, prompt_ids
    from medusa_export.validation.validate import validate, validation_summary
    from medusa_runtime.contract.artifact import load_artifact

    path, lm = counter_artifact
    texts, ids = prompt_ids(lm, None)
    first = [p[-1] + 1 for p in ids]  # the counter's first new token, by hand
    eos = replace(lm, eos_token_ids=first)
    report = validate(load_artifact(path), lm.model, ids, texts, new_tokens=8, eos_token_ids=first, progress=False)
    assert [p.tokens for p in report.prompts] == [0, 0, 0] and not report.passed
    assert all("nothing compared" in f for f in report.failures()) and len(report.failures()) == 3
    assert validation_summary(report.to_json()).startswith("FAILED: ")
    assert check_self(load_artifact(path), eos, texts, ids, 8, False)["passed"] is False
    ok = validate(load_artifact(path), lm.model, ids, texts, new_tokens=8, eos_token_ids=[], progress=False)
    assert ok.passed and [p.tokens for p in ok.prompts] == [8, 8, 8]
    # the 4-node chain (root + 3) accepts whole paths: the prefill's token, then 4 + 3 (max_new_tokens) in 2 steps
    assert [p.mean_accepted for p in ok.prompts] == [3.5] * 3


# --- a near-tie is reported with its step and margin ------------------------------------------------------------


def _near_tie_result() -> dict:
    """An fp16 report whose one prompt diverges from the reference at new token 12, tree step 10, where the
    reference's top-2 margin is 5e-4 (below fp16's near-tie margin), as run_checks returns it."""
    from medusa_export.validation.validate import PromptReport, ValidationReport, tolerance

    assert tolerance("fp16").margin > 5e-4
    p = PromptReport("a prompt", 16, False, 1e-4, 1e-4, 1e-3, first_divergence=12, divergence_step=10,
                     reference_token=5, artifact_token=6, reference_margin=5e-4, near_tie=True, agreement=0.75,
                     vanilla_identical=True, plain_identical=True)
    report = ValidationReport("fp16", 16, [p], reference="full-recompute greedy, PyTorch fp32, no KV cache")
    assert report.passed
    return {**report.to_json(), "ran": ["full"]}


def test_a_near_tie_is_reported_in_the_summary_and_the_junit_case(tmp_path):
    """It said "PASSED: greedy tokens identical on 0/1 prompts", and the JUnit case was bare."""
    from medusa_export.validation.checks import passed_notes, result_lines
    from medusa_export.validation.junit import write_junit
    from medusa_export.validation.validate import validation_summary

    result = _near_tie_result()
    tie = "near-tie at new token 12 (tree step 10), reference top-2 log-prob margin 5.00e-04"
    assert validation_summary(result) == (
        "PASSED: Medusa and plain greedy tokens identical to the reference on 0/1 prompts x 16 tokens (reference: "
        f"full-recompute greedy, PyTorch fp32, no KV cache); prompt 1: {tie}; max |log-prob diff| 1.00e-04")
    assert passed_notes(result) == [f"full prompt 1: {tie}"]
    assert result_lines(result)[0].startswith("full      near-tie    16 tokens") and tie in result_lines(result)[0]
    write_junit(tmp_path / "j.xml", result)
    case = ET.parse(tmp_path / "j.xml").getroot().find("testcase")
    assert case.find("failure") is None and case.find("system-out").text == tie
    assert case.find("properties/property").attrib == {"name": "near_tie", "value": tie}
