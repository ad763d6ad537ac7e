"""``medusa-export generate`` / ``models``: exit codes and what is printed."""

from __future__ import annotations

import subprocess
import sys

import pytest

import medusa_export.loading.registry
from conftest import save_tiny_hf_dir
from medusa_export.cli.main import main
from medusa_export.loading.registry import load_registry


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "tiny-llama"
    save_tiny_hf_dir(path)
    return path


def test_unknown_model_exits_2_listing_known_models():
    proc = subprocess.run([sys.executable, "-m", "medusa_export.cli", "generate", "--model", "nope", "--prompt", "hi"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "unknown model 'nope'" in proc.stderr
    for name in load_registry():
        assert name in proc.stderr
    assert "Traceback" not in proc.stderr


def test_models_lists_the_registry(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for name in load_registry():
        assert name in out


def test_generate_on_a_local_model(tiny_model_dir, capsys):
    rc = main(["generate", "--model", str(tiny_model_dir), "--prompt", "Hello there", "--tree", "16",
               "--max-new-tokens", "6"])
    assert rc == 0
    err = capsys.readouterr().err
    assert "tree: 16 nodes" in err
    assert "[6 tokens in 6 forward passes (prefill + 5 tree steps); mean accepted tokens per step: 1.00;" in err
    assert "finish: length" in err


def test_bad_tree_exits_2(tiny_model_dir, capsys):
    rc = main(["generate", "--model", str(tiny_model_dir), "--prompt", "Hi", "--tree", "bushy"])
    assert rc == 2
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
    assert out.strip()
    assert "[8 tokens in" in err and "mean accepted tokens per step:" in err and "finish: length" in err


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
