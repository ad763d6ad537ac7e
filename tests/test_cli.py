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
