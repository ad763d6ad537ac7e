"""The family table (medusa_export.model.families) as the one place a family is declared.

Worked example (issue 23 item 5): a new family is one :class:`Family` entry. "llama-variant" is a Llama with
another ``model_type`` name (as a fine-tune that renames its architecture would be); with its entry registered
and nothing else changed, its checkpoint loads, exports through both graph writers, and the exported step
decodes token for token what transformers' own Llama decodes greedily; make_random_checkpoint.py makes it too.
Without the entry it is refused by name.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from checkpoints import save_family_dir
from conftest import plain_greedy
from medusa_export.errors import UnsupportedModelError
from medusa_export.loading.architectures import backbone_config, transformers_config
from medusa_export.model.families import FAMILIES, SWITCHES, Family, family_of, gguf_family

PROMPT = [5, 17, 230, 9, 41, 77, 12, 3, 99, 140, 8, 61]
N_NEW = 24

#: the whole declaration of the new family: one entry.
VARIANT = Family(
    "llama-variant", "Llama variant (test)", hf_model_type="llama", hf_class="LlamaForCausalLM",
    switch_fields={"attention_bias": ("qkv_bias", "o_bias"), "mlp_bias": ("mlp_bias",)},
    config_fields={"attention_bias": False, "mlp_bias": False},
    test_shape_defaults={"rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False},
)


@pytest.fixture
def variant(monkeypatch):
    """The table with VARIANT registered (for this test only)."""
    monkeypatch.setitem(FAMILIES, VARIANT.model_type, VARIANT)
    return VARIANT


@pytest.fixture(scope="module")
def variant_dir(tmp_path_factory):
    """(transformers Llama with biases and linear RoPE, its folder saved with model_type "llama-variant")."""
    path = tmp_path_factory.mktemp("variant") / "llama-variant"
    hf = save_family_dir(path, "llama-linear-bias", seed=3)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "llama"
    cfg["model_type"] = VARIANT.model_type
    (path / "config.json").write_text(json.dumps(cfg))
    return hf, path


def test_every_family_has_a_tiny_fixture_and_known_switches():
    for mt, fam in FAMILIES.items():
        assert fam.model_type == mt and fam.fixtures, mt
        assert set(fam.switches({})) == set(SWITCHES)
    assert {f.gguf_architecture for f in FAMILIES.values()} == {"llama", "qwen2", "qwen3"}
    assert gguf_family("llama").gguf_permuted_qk and not gguf_family("qwen2").gguf_permuted_qk


def test_switches_follow_the_fields():
    assert FAMILIES["llama"].switches({"attention_bias": True}) == dict(
        qkv_bias=True, o_bias=True, mlp_bias=False, qk_norm=False)
    assert FAMILIES["qwen2"].switches({"attention_bias": True, "mlp_bias": True}) == dict(
        qkv_bias=True, o_bias=False, mlp_bias=False, qk_norm=False)  # Qwen2Config has neither field
    assert FAMILIES["qwen3"].switches({}) == dict(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=True)
    assert FAMILIES["qwen2"].window_layers({"use_sliding_window": True, "sliding_window": 8,
                                            "num_hidden_layers": 3, "max_window_layers": 2}) == (
        8, ("full_attention", "full_attention", "sliding_attention"))
    assert FAMILIES["mistral"].window_layers({"sliding_window": 8}) == (8, ())


def test_a_bad_entry_and_unknown_names_are_refused():
    with pytest.raises(ValueError, match=r"unknown switch 'q_bias'; switches: qkv_bias, o_bias, mlp_bias, qk_norm"):
        Family("x", "X", "llama", "LlamaForCausalLM", fixed_switches={"q_bias": True})
    with pytest.raises(ValueError, match=r"window 'some'; choose one of none, every_layer, layer_types"):
        Family("x", "X", "llama", "LlamaForCausalLM", window="some")
    with pytest.raises(UnsupportedModelError, match=r"GGUF architecture 'gemma' is not supported; supported: "
                                                    r"llama \(Llama 1/2/3.x, Mistral\), qwen2 \(Qwen2 / Qwen2.5\)"):
        gguf_family("gemma")


def test_without_its_entry_the_variant_is_refused(variant_dir):
    _, path = variant_dir
    with pytest.raises(UnsupportedModelError,
                       match=r"model_type 'llama-variant' is not supported; supported: llama, mistral, qwen2, qwen3"):
        backbone_config(json.loads((path / "config.json").read_text()))


def test_the_variant_maps_like_llama(variant, variant_dir):
    hf, path = variant_dir
    cfg = backbone_config(json.loads((path / "config.json").read_text()))
    assert cfg.model_type == "llama-variant" and family_of(cfg.model_type) is variant
    assert cfg.features == ["rope_scaling=linear", "qkv_bias", "o_bias", "mlp_bias"]
    from dataclasses import replace

    assert replace(cfg, model_type="llama") == backbone_config(hf.config.to_dict())
    back = transformers_config(cfg)  # the transformers model that computes the variant: a Llama
    assert type(back).__name__ == "LlamaConfig" and back.attention_bias and back.mlp_bias


@pytest.mark.parametrize("graph", ["portable", "fused"])
def test_the_variant_exports_and_decodes_as_transformers(variant, variant_dir, graph, tmp_path):
    """Loading + export (both graph writers) + greedy decode of the written step == transformers' greedy."""
    from medusa_export.pipeline import BuildConfig, build_artifact
    from medusa_export.loading.sources import open_model
    from medusa_runtime.contract.artifact import load_artifact
    from medusa_runtime.engines.ort import OrtEngine
    from medusa_runtime.decode.loop import generate
    from medusa_runtime.trees.tree import make_tree

    hf, path = variant_dir
    lm = open_model(str(path))
    tree = make_tree([[0], [1], [0, 0], [0, 1], [1, 0]], num_heads=4)
    out = build_artifact(lm, tree, tmp_path / graph, BuildConfig(graph=graph, new_tokens=N_NEW), progress=False)
    m = json.loads((out / "manifest.json").read_text())
    assert m["model"]["architecture"] == "llama-variant"
    assert m["validation"]["passed"], m["validation"]
    art = load_artifact(out)
    eng = OrtEngine(art)
    ref = plain_greedy(hf, PROMPT, N_NEW)
    assert len(set(ref)) > 3
    assert generate(eng, PROMPT, art.tree, max_new_tokens=N_NEW, max_context=256).tokens == ref


def test_the_variant_self_distils_through_the_batched_decoder(variant, variant_dir):
    """Head training's decoder (training/batch_decode.py) reads the family table's switches and windows, so the
    variant's biases (MLP ones included) decode there as in transformers."""
    import torch

    from medusa_export.training.batch_decode import BatchedDecoder, DecodeRequest

    hf, _ = variant_dir
    got = {}
    BatchedDecoder(hf, batch_size=1, capacity=64, dtype=torch.float32).run(
        [DecodeRequest("p", tuple(PROMPT))], max_new_tokens=N_NEW, eos_token_ids=[],
        on_reply=lambda r, toks: got.__setitem__(r.id, toks))
    assert got["p"] == plain_greedy(hf, PROMPT, N_NEW)


def test_make_random_checkpoint_makes_the_variant(variant):
    path = Path(__file__).resolve().parents[1] / "scripts" / "make_random_checkpoint.py"
    spec = importlib.util.spec_from_file_location("make_random_checkpoint", path)
    mrc = sys.modules.get("make_random_checkpoint") or importlib.util.module_from_spec(spec)
    if "make_random_checkpoint" not in sys.modules:
        sys.modules["make_random_checkpoint"] = mrc
        spec.loader.exec_module(mrc)
    cfg = mrc.shape_config("tiny", "llama-variant")
    llama = mrc.shape_config("tiny", "llama")
    assert cfg["model_type"] == "llama-variant" and cfg["architectures"] == ["LlamaForCausalLM"]
    own = ("model_type", "_family", "pretraining_tp", "rope_scaling")  # the last two: llama's config_fields only
    assert {k: v for k, v in cfg.items() if k not in own} == {k: v for k, v in llama.items() if k not in own}
    public = {k: v for k, v in cfg.items() if not k.startswith("_")}
    assert [t.name for t in mrc.model_tensors(public)] == [t.name for t in mrc.model_tensors(
        {k: v for k, v in llama.items() if not k.startswith("_")})]
    assert backbone_config(public).model_type == "llama-variant"
