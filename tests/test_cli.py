"""``medusa-export`` through :func:`main`: every command's happy path on tiny models, exit codes and what is
printed, and one name per flag meaning (old spellings as hidden aliases).

The process boundary itself (the console script, a torch-free process) is tested in
tests/test_runtime.py::test_runtime_commands_run_without_torch; here everything runs in-process.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import shutil
import xml.etree.ElementTree as ET

import numpy as np
import onnx
import pytest
from onnx.external_data_helper import ExternalDataInfo

import medusa_export.loading.registry
from conftest import make_counter_medusa, make_tiny_medusa, make_tiny_tokenizer, save_tiny_hf_dir
from medusa_export.cli.main import build_parser, main
from medusa_export.loading.accuracies import load_accuracies
from medusa_export.loading.registry import DEFAULT_MODEL, load_model, load_registry
from medusa_export.model.heads import save_heads
from medusa_runtime.contract.artifact import load_artifact, sha256_file
from medusa_runtime.errors import EXIT_MISMATCH, EXIT_UNAVAILABLE, EXIT_USAGE


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "tiny-llama"
    save_tiny_hf_dir(path)
    return path


@pytest.fixture(scope="module")
def built(tiny_model_dir, tmp_path_factory):
    """``medusa-export build`` on the tiny local model, through main(): (artifact path, exit code, stdout)."""
    out = tmp_path_factory.mktemp("cli-build") / "tiny-t4"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        rc = main(["build", "--model", str(tiny_model_dir), "--tree", "4", "--max-context", "256",
                   "--max-new-tokens", "8", "--out", str(out)])
    return out, rc, stdout.getvalue()


# --- registry and the PyTorch reference ------------------------------------------------------


def test_unknown_model_exits_2_listing_known_models(capsys):
    assert main(["generate", "--model", "nope", "--prompt", "hi"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "medusa-export: error: unknown model 'nope'" in err
    for name in load_registry():
        assert name in err


def test_models_lists_the_registry_and_marks_the_default(capsys):
    assert main(["models"]) == 0
    header, *lines = capsys.readouterr().out.splitlines()
    assert header.split()[:3] == ["name", "architecture", "heads"]
    assert sorted(line.split()[0] for line in lines) == sorted(load_registry())
    assert [line.split()[0] for line in lines if line.endswith("[default]")] == [DEFAULT_MODEL]


def test_generate_on_a_local_model(tiny_model_dir, capsys):
    rc = main(["generate", "--model", str(tiny_model_dir), "--prompt", "Hello there", "--tree", "16",
               "--max-new-tokens", "6"])
    assert rc == 0
    err = capsys.readouterr().err
    assert "tree: 16 nodes" in err
    assert "[6 tokens in 6 forward passes (prefill + 5 tree steps); mean accepted tokens per step: 1.00;" in err
    assert "finish: length" in err


def test_reference_generate_samples_and_refuses_bad_settings_before_loading(tiny_model_dir, capsys):
    rc = main(["generate", "--model", str(tiny_model_dir), "--prompt", "Hello", "--tree", "16", "--max-new-tokens", "6",
               "--temperature", "0.8", "--top-k", "0", "--top-p", "0.9", "--seed", "2"])
    assert rc == 0  # the reference samples from the whole vocabulary
    assert "PyTorch reference, sample T=0.8 top-k off top-p 0.9 seed 2" in capsys.readouterr().err
    rc = main(["generate", "--model", "no-such-model", "--prompt", "Hi", "--temperature", "-1"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "temperature must be a finite number >= 0" in err and "loading" not in err


def test_bad_tree_exits_2(tiny_model_dir, capsys):
    rc = main(["generate", "--model", str(tiny_model_dir), "--prompt", "Hi", "--tree", "bushy"])
    assert rc == EXIT_USAGE
    assert "unknown tree 'bushy'" in capsys.readouterr().err


@pytest.mark.slow
def test_generate_embedded_model(smollm, monkeypatch, capsys):
    """The main job's command on the embedded model (the loaded model reused: loading is the
    ``smollm`` fixture's test)."""
    calls = []

    def load_model(name, **kwargs):
        calls.append(name)
        return smollm

    monkeypatch.setattr(medusa_export.loading.registry, "load_model", load_model)
    rc = main(["generate", "--model", "smollm2-135m", "--prompt", "Explain speculative decoding in two sentences.",
               "--max-new-tokens", "8"])
    assert rc == 0 and calls == ["smollm2-135m"]
    out, err = capsys.readouterr()
    # the reply printed is transformers' plain greedy continuation of the chat-templated prompt, decoded
    from conftest import plain_greedy
    from medusa_export.chat import apply_chat_template
    from medusa_export.loading.transformers_twin import transformers_twin

    ids = apply_chat_template(smollm.tokenizer, smollm.chat_template,
                              [{"role": "user", "content": "Explain speculative decoding in two sentences."}])
    want = smollm.tokenizer.decode(plain_greedy(transformers_twin(smollm.model.backbone), ids, 8))
    assert out == want + "\n", (out, want)
    assert "[8 tokens in" in err and "mean accepted tokens per step:" in err and "finish: length" in err


# --- build, verify, and the runtime on what build wrote --------------------------------------


def test_build_writes_a_validated_artifact(built):
    path, rc, stdout = built
    assert rc == 0
    m = json.loads((path / "manifest.json").read_text())
    assert m["model"]["name"] == "tiny-llama" and m["model"]["max_context"] == 256
    assert m["tree"]["size"] == 4 and m["precision"]["name"] == "fp32"
    v = m["validation"]
    assert v["passed"] and len(v["prompts"]) == 3 and all(p["identical"] and p["tokens"] == 8 for p in v["prompts"])
    assert f"artifact: {path}" in stdout and "tree: 4 nodes" in stdout and "validation:" in stdout
    assert "time per stage: opening the model " in stdout  # the ~20 s open of the embedded model was in no stage
    assert not list(path.parent.glob(".*partial*"))  # the temporary folder was moved into place


def test_verify_passes_on_the_built_artifact(built, tiny_model_dir, capsys):
    path, _, _ = built
    assert main(["verify", "--artifact", str(path), "--model-path", str(tiny_model_dir), "--limit", "2",
                 "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert out.count("identical") == 2 and "PASSED: 2 prompts, precision fp32" in out


def test_verify_of_the_checksums_alone_compares_no_prompt(built, tiny_model_dir, capsys):
    """It said 'PASSED: 3 prompts' though the checksums check compares none."""
    path, _, _ = built
    assert main(["verify", "--artifact", str(path), "--model-path", str(tiny_model_dir), "--checks", "checksums"]) == 0
    out = capsys.readouterr().out
    assert "PASSED: no prompt compared, precision fp32 (checks: checksums)" in out and "identical" not in out


def test_verify_exits_1_when_the_weights_disagree(built, tiny_model_dir, tmp_path, capsys):
    """An artifact whose weights were edited and its checksums rewritten: it loads, but disagrees."""
    path, _, _ = built
    bad = tmp_path / "edited"
    shutil.copytree(path, bad)
    graph = onnx.load(str(bad / "model.onnx"), load_external_data=False)
    embed = next(t for t in graph.graph.initializer if t.name.endswith("embed_tokens.weight"))
    info = ExternalDataInfo(embed)
    with open(bad / info.location, "r+b") as f:  # token i now reads token V-1-i's embedding
        f.seek(info.offset)
        w = np.frombuffer(f.read(info.length), dtype=np.float32).reshape(tuple(embed.dims))[::-1]
        f.seek(info.offset)
        f.write(w.tobytes())
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["checksums"][info.location] = {**manifest["checksums"][info.location],
                                            "sha256": sha256_file(bad / info.location)}
    (bad / "manifest.json").write_text(json.dumps(manifest))
    load_artifact(bad, full_verify=True)  # consistent: only the comparison can tell

    junit = tmp_path / "parity.xml"
    assert main(["verify", "--artifact", str(bad), "--model-path", str(tiny_model_dir), "--limit", "2",
                 "--max-new-tokens", "6", "--junit", str(junit)]) == EXIT_MISMATCH
    out, err = capsys.readouterr()
    assert out.count("MISMATCH") == 2 and "FAILED:" in err
    suite = ET.parse(junit).getroot()
    cases = {(c.get("classname"), c.get("name")): c.find("failure") for c in suite.iter("testcase")}
    assert sorted(cases) == [("checksums", "weights"), ("parity.fp32", "prompt_0"), ("parity.fp32", "prompt_1")]
    assert suite.get("tests") == "3" and suite.get("failures") == "3"
    assert "step outputs differ" in cases["parity.fp32", "prompt_0"].get("message")
    assert embed.name in cases["checksums", "weights"].get("message")  # the edited tensor is named

    only = tmp_path / "checksums.xml"  # the checksums check alone: its case is the report (none was written)
    assert main(["verify", "--artifact", str(bad), "--model-path", str(tiny_model_dir), "--checks", "checksums",
                 "--junit", str(only)]) == EXIT_MISMATCH
    capsys.readouterr()
    suite = ET.parse(only).getroot()
    assert [(c.get("classname"), c.get("name")) for c in suite.iter("testcase")] == [("checksums", "weights")]
    assert suite.get("failures") == "1"
    assert main(["verify", "--artifact", str(path), "--model-path", str(tiny_model_dir), "--checks", "checksums",
                 "--junit", str(only)]) == 0
    capsys.readouterr()
    suite = ET.parse(only).getroot()
    assert suite.get("tests") == "1" and suite.get("failures") == "0" and suite.find("testcase/failure") is None


@pytest.fixture(scope="module")
def counter_dirs(tmp_path_factory):
    """The counter model on disk (conftest.make_counter_medusa: after t the greedy token is t+1 and head k
    guesses t+1+k, so Medusa accepts whole paths): an HF folder and its heads folder."""
    from medusa_export.loading.transformers_twin import transformers_twin

    root = tmp_path_factory.mktemp("counter")
    model = make_counter_medusa()
    transformers_twin(model.backbone).save_pretrained(root / "model", safe_serialization=True)
    make_tiny_tokenizer().save_pretrained(root / "model")
    save_heads(model.heads, root / "heads")
    return root / "model", root / "heads"


def test_a_broken_heads_graph_fails_verify(counter_dirs, tmp_path, capsys):
    """Greedy tokens stay identical whatever the heads propose (the backbone verifies every candidate), so the
    validation compares the tokens each tree step accepted with the fp32 reference's: heads.onnx with its own
    projections scrambled (checksums rewritten, so the artifact loads) passes on tokens and fails on those."""
    model_dir, heads_dir = counter_dirs
    path = tmp_path / "counter"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["build", "--model", str(model_dir), "--heads", str(heads_dir), "--tree", "chain",
                     "--max-context", "256", "--max-new-tokens", "12", "--out", str(path)]) == 0
    v = json.loads((path / "manifest.json").read_text())["validation"]
    assert v["passed"] and [p["accept_identical"] for p in v["prompts"]] == [True] * 3
    assert min(p["mean_accepted"] for p in v["prompts"]) > 2  # the heads guess right: whole chains accepted
    from medusa_export.validation.validate import validation_summary

    assert "Medusa and plain greedy tokens identical to the reference on 3/3 prompts x 12 tokens" in validation_summary(v)
    assert "tokens accepted per tree step identical on 3/3" in validation_summary(v)

    bad = tmp_path / "scrambled"
    shutil.copytree(path, bad)
    backbone_offsets = {ExternalDataInfo(t).offset for t in onnx.load(str(bad / "model.onnx"), load_external_data=False)
                        .graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL}
    heads_graph = onnx.load(str(bad / "heads.onnx"), load_external_data=False)
    own = [t for t in heads_graph.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL
           and ExternalDataInfo(t).offset not in backbone_offsets and len(t.dims) >= 2 and t.dims[-2] == 300]
    assert own, [t.name for t in heads_graph.graph.initializer]  # the heads' own [V, d] projections
    for t in own:
        info = ExternalDataInfo(t)
        with open(bad / info.location, "r+b") as f:  # head k's row j now guesses another token
            f.seek(info.offset)
            w = np.frombuffer(f.read(info.length), dtype=np.float32).reshape(tuple(t.dims))
            f.seek(info.offset)
            f.write(np.roll(w, 7, axis=-2).tobytes())
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["checksums"][info.location] = {**manifest["checksums"][info.location],
                                            "sha256": sha256_file(bad / info.location)}
    (bad / "manifest.json").write_text(json.dumps(manifest))
    load_artifact(bad, full_verify=True)
    capsys.readouterr()

    assert main(["verify", "--artifact", str(bad), "--model-path", str(model_dir), "--heads", str(heads_dir),
                 "--checks", "full", "--max-new-tokens", "12"]) == EXIT_MISMATCH
    out, err = capsys.readouterr()
    assert out.count("full      identical") == 3 and "MISMATCH" not in out  # the tokens alone would pass
    assert err.count("greedy tokens identical, but the tokens accepted per tree step differ from the reference's at "
                     "tree step 1: reference 4, artifact 1") == 3, err


def test_verify_of_a_local_model_needs_its_weights(built, tmp_path, capsys):
    """Without --model-path verify opens the folder the manifest records; where it is gone, it says so."""
    path, _, _ = built
    moved = shutil.copytree(path, tmp_path / "moved")
    manifest = json.loads((moved / "manifest.json").read_text())
    manifest["model"]["backbone_source"] = str(tmp_path / "gone")
    (moved / "manifest.json").write_text(json.dumps(manifest))
    assert main(["verify", "--artifact", str(moved)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert f"'tiny-llama' is not a registered model and was built from '{tmp_path / 'gone'}'" in err
    assert "give its weights with --model-path" in err


def test_generate_runs_what_build_wrote(built, capsys):
    path, _, _ = built
    assert main(["generate", "--artifact", str(path), "--prompt", "Hi", "--max-new-tokens", "5", "--threads", "1"]) == 0
    assert "[5 tokens in" in capsys.readouterr().err
    assert main(["generate", "--artifact", str(path), "--model", "smollm2-135m", "--prompt", "Hi"]) == EXIT_USAGE
    assert "--model choose(s) the PyTorch reference's model" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None, reason="TensorRT is installed here")
def test_a_missing_backend_exits_3(built, capsys):
    path, _, _ = built
    assert main(["generate", "--artifact", str(path), "--backend", "tensorrt", "--prompt", "Hi"]) == EXIT_UNAVAILABLE
    assert "the tensorrt backend needs TensorRT's Python package" in capsys.readouterr().err


# --- heads: calibrate end to end, train-heads' input errors ----------------------------------


def test_calibrate_writes_accuracies_that_trees_use(tiny_model_dir, tmp_path, capsys):
    _, model = make_tiny_medusa(medusa_heads=3, head_noise=0.05)  # the same backbone as tiny_model_dir (seed 0)
    heads = tmp_path / "heads"
    save_heads(model.heads, heads)
    prompts = tmp_path / "held_out.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in
                               ["Name three colors.", "What is 2 + 2?", "Tell me a joke.", "Say hi."]))
    rc = main(["calibrate", "--model", str(tiny_model_dir), "--heads", str(heads), "--prompt-file", str(prompts),
               "--limit", "3", "--max-new-tokens", "12", "--batch-size", "2", "--topk", "4", "--budgets", "4", "8",
               "--cache", str(tmp_path / "cache")])
    assert rc == 0
    out = capsys.readouterr().out
    acc = load_accuracies(heads)
    assert acc.shape == (3, 4) and (acc >= 0).all() and (acc.sum(1) <= 1 + 1e-9).all()
    assert json.loads((heads / "accuracies.json").read_text())["source"] == str(prompts)
    assert out.startswith("medusa heads, top-1 accuracy per head: " + ", ".join(f"{a:.3f}" for a in acc[:, 0]))
    rows = [line.split() for line in out.splitlines()[2:4]]
    assert [int(r[0]) for r in rows] == [4, 8]  # the greedy trees of each budget, from these accuracies
    lm = load_model(str(tiny_model_dir), heads_path=str(heads))  # --tree N reads them beside the heads
    np.testing.assert_allclose(lm.head_accuracies, acc)


@pytest.mark.parametrize("argv, message", [
    (["--cap", "gsm8k"], "--cap takes SOURCE=N, got 'gsm8k'"),
    (["--prompt-file", "no-such.jsonl"], "prompt file no-such.jsonl does not exist"),
    ([], "the following argument is required: --prompt-file"),
])
def test_train_heads_input_errors_exit_2(tmp_path, capsys, argv, message):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Hi"}) + "\n")
    if "--prompt-file" not in argv and argv:
        argv = argv + ["--prompt-file", str(prompts)]
    assert main(["train-heads", "--out", str(tmp_path / "h"), *argv]) == EXIT_USAGE
    assert f"medusa-export: error: {message}" in capsys.readouterr().err


# --- one name per flag meaning ---------------------------------------------------------------


@pytest.mark.parametrize("command, new, old", [
    ("build", ["--prompt-file", "p.jsonl", "--max-new-tokens", "9"], ["--prompts", "p.jsonl", "--new-tokens", "9"]),
    ("verify", ["--artifact", "A", "--prompt-file", "p.jsonl", "--max-new-tokens", "9"],
     ["A", "--prompts", "p.jsonl", "--new-tokens", "9"]),
    ("engine", ["--artifact", "A"], ["A"]),
    ("triton", ["--artifact", "A", "--out", "R"], ["A", "--out", "R"]),
    ("train-heads", ["--out", "H", "--prompt-file", "a.jsonl", "--prompt-file", "b.jsonl"],
     ["--out", "H", "--data", "a.jsonl", "--data", "b.jsonl"]),
    ("calibrate", ["--prompt-file", "a.jsonl"], ["--data", "a.jsonl"]),
])
def test_old_flag_spellings_are_hidden_aliases(command, new, old):
    parser = build_parser(command)
    assert vars(parser.parse_args([command, *old])) == vars(parser.parse_args([command, *new]))
    sub = parser._subparsers._group_actions[0].choices[command]
    shown = sub.format_help()
    for flag in (a for a in old if a.startswith("--") and a not in new):
        assert flag not in shown


def test_every_command_documents_the_exit_codes(capsys):
    for argv in ([], ["generate"], ["verify"], ["build"]):
        with pytest.raises(SystemExit) as exc:
            main([*argv, "--help"])
        assert exc.value.code == 0
        assert "exit codes: 0 success; 1 the artifact disagrees" in " ".join(capsys.readouterr().out.split())


# --- a base model: no chat template ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def base_model(tmp_path_factory):
    """A tiny Llama 3.x folder whose tokenizer has no chat template, and its built fp32 artifact."""
    from checkpoints import save_family_dir

    root = tmp_path_factory.mktemp("base")
    hf = save_family_dir(root / "base-llama", "llama3", chat_template=False)
    rc = main(["build", "--model", str(root / "base-llama"), "--tree", "4", "--out", str(root / "art"),
               "--max-context", "128", "--new-tokens", "12"])
    assert rc == 0
    return hf, root / "base-llama", root / "art"


def test_base_model_build_summary(tmp_path, base_model, capsys):
    """Built with validation (the fixture's build passed it); the summary says what the missing template means."""
    _, folder, _ = base_model
    assert main(["build", "--model", str(folder), "--tree", "chain", "--out", str(tmp_path / "a"),
                 "--max-context", "128", "--new-tokens", "4"]) == 0
    captured = capsys.readouterr()
    assert (tmp_path / "a" / "chat_template.jinja").read_text() == ""
    assert "  architecture: llama (rope_scaling=llama3)\n" in captured.out
    assert "[note: the model has no chat template (a base model): prompts are encoded as plain text" in captured.err
    assert "(no chat template, a base model: the validation prompts were encoded as plain text)" in captured.out
    assert "chat template: none (a base model): `generate --artifact` continues a plain-text prompt" in captured.out


def test_base_model_generate_continues_plain_text(base_model, capsys):
    from conftest import plain_greedy

    hf, folder, art = base_model
    assert main(["generate", "--artifact", str(art), "--prompt", "Write a poem about", "--max-new-tokens", "10",
                 "--threads", "1"]) == 0
    captured = capsys.readouterr()
    assert "[note: this artifact has no chat template (a base model): the prompt is encoded as plain text" in captured.err
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    expected = tok.decode(plain_greedy(hf, tok.encode("Write a poem about"), 10), skip_special_tokens=True)
    assert captured.out == expected + "\n"
    # the PyTorch reference says the same and prints the same text
    assert main(["generate", "--model", str(folder), "--prompt", "Write a poem about", "--max-new-tokens", "10"]) == 0
    captured = capsys.readouterr()
    assert "[note: the model has no chat template (a base model)" in captured.err
    assert captured.out == expected + "\n"


def test_base_model_chat_is_refused_plainly(base_model, capsys):
    _, _, art = base_model
    assert main(["chat", "--artifact", str(art)]) == 2
    err = capsys.readouterr().err
    assert "this artifact has no chat template (a base model): it cannot render chat messages" in err
    assert f"use `generate --artifact {art} --prompt TEXT` to continue a text" in err


def test_modelopt_fp8_build_summary_and_verify(tmp_path, capsys):
    """A modelopt FP8 folder (heads inside, medusa_heads.) streamed into an artifact: the summary's architecture
    line names the quantization, the FP8 note is printed, the validation passes (dequantized weights on both
    sides, heads included) and verify passes on the opened model too."""
    from checkpoints import write_modelopt_fp8

    write_modelopt_fp8(tmp_path / "fp8", "llama3", num_heads=3)
    art = tmp_path / "art"
    assert main(["build", "--model", str(tmp_path / "fp8"), "--tree", "4", "--out", str(art), "--max-context", "128",
                 "--max-new-tokens", "8"]) == 0
    captured = capsys.readouterr()
    assert ("  architecture: llama (rope_scaling=llama3); checkpoint modelopt FP8 (20 weights dequantized to float32)\n"
            in captured.out)
    assert "[note: FP8 (modelopt) checkpoint dequantized to the export precision for ONNX" in captured.err
    assert "validation: PASSED" in captured.out
    m = json.loads((art / "manifest.json").read_text())
    assert m["model"]["medusa_heads"] == 3 and m["validation"]["ran"] == ["full", "checksums"]
    assert main(["verify", "--artifact", str(art), "--model-path", str(tmp_path / "fp8"), "--limit", "1",
                 "--max-new-tokens", "6"]) == 0
    assert "PASSED: 1 prompt, precision fp32 (checks: full, checksums)" in capsys.readouterr().out


@pytest.mark.parametrize("command, flag", [("engine", "--device-id"), ("build", "--engine-device-id")])
def test_the_engine_device_flag_shows_n_in_help(command, flag, capsys):
    """The help showed ``--device-id ENGINE_DEVICE_ID`` (argparse's default metavar from the dest)."""
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert f"{flag} N " in out and "ENGINE_DEVICE_ID" not in out


@pytest.mark.parametrize("command", ["verify", "engine"])
def test_a_required_artifact_is_not_bracketed_in_the_usage(command, capsys):
    """The usage line showed ``[--artifact DIR]``, as if it were optional, where leaving it out is an error."""
    with pytest.raises(SystemExit) as exc:
        main([command])
    assert exc.value.code == 2
    usage = " ".join(capsys.readouterr().err.split())
    assert f"medusa-export {command} [-h] --artifact DIR " in usage and "[--artifact DIR]" not in usage


@pytest.mark.parametrize("finish, note", [("stop", True), ("length", False)])
def test_the_summary_says_the_stop_token_is_not_counted(finish, note):
    """Plain decoding that stopped on EOS printed '0.91 tokens/step' with no word on why it is below 1."""
    from types import SimpleNamespace

    from medusa_runtime.front.cli import summary

    result = SimpleNamespace(steps=11, forward_passes=12, host_seconds=0.01, step_tokens=[1] * 10 + [0])
    c = SimpleNamespace(result=result, seconds=0.4, reused_tokens=0, prompt_tokens=5, token_ids=list(range(11)),
                        tokens_per_step=10 / 11, tokens_per_second=27.5, finish_reason=finish)
    line = summary(c, "onnxruntime")
    assert "0.91 tokens/step" in line and f"finish: {finish}" in line
    assert line.startswith("[11 tokens in 12 forward passes (prefill + 11 steps); ")
    assert ("0.91 tokens/step (the stop token or string not counted);" in line) is note


@pytest.mark.parametrize("where", ["artifact", "reference"])
def test_zero_new_tokens_runs_no_forward_pass_and_says_so(built, tiny_model_dir, where, monkeypatch, capsys):
    """``--max-new-tokens 0`` asks for nothing: no engine call at all (counted on the engine class), and the summary
    no longer claims "1 forward passes (prefill + 0 ...)"; one new token is one forward pass, the prefill."""
    from medusa_export.model.decode import TorchEngine
    from medusa_runtime.engines.ort import OrtEngine

    engine = OrtEngine if where == "artifact" else TorchEngine
    calls = []
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda self, *a, **k: calls.append(len(a[0][0])) or step(self, *a, **k))
    source = ["--artifact", str(built[0])] if where == "artifact" else ["--model", str(tiny_model_dir)]
    argv = ["generate", *source, "--prompt", "Hello", "--tree", "4", "--max-new-tokens"]
    capsys.readouterr()
    assert main(argv + ["0"]) == 0
    out, err = capsys.readouterr()
    assert calls == [] and out.strip() == ""
    assert "[0 tokens: --max-new-tokens 0 asks for none, so no forward pass ran; finish: length]" in err
    assert "forward passes" not in err
    assert main(argv + ["1"]) == 0
    assert len(calls) == 1 and calls[0] > 1  # the prefill over the whole prompt
    assert "[1 tokens in 1 forward passes (prefill + 0 " in capsys.readouterr().err
