"""The PyTorch reference for every family (Llama 3.x, Mistral, Qwen2, Qwen3) against transformers.

Each tiny model is made with transformers' own config class with the family's feature on
(conftest.FAMILIES: RoPE scaling llama3 / linear, sliding window 8 < the test context, q/k/v/o
and MLP biases, q/k norms, explicit head_dim, tied embeddings), biases and norm weights
randomised. The independent reference is transformers: its logits, and its greedy ``generate``.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from conftest import FAMILIES, make_family_hf, make_family_medusa, plain_greedy
from medusa_export.errors import UnsupportedModelError
from medusa_export.loading.architectures import backbone_config, transformers_config
from medusa_export.loading.backbone import backbone_from_hf_model, backbone_from_state_dict
from medusa_export.model.decode import medusa_generate
from medusa_runtime.decode.loop import causal_mask
from medusa_runtime.trees.tree import make_tree
from medusa_runtime.trees.treespec import tree_from_spec

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]  # 12 tokens: with 40 new ones the context is 52 > window 8
N_NEW = 40
EXPECTED_FEATURES = {
    "llama3": ["rope_scaling=llama3"],
    "llama-linear-bias": ["rope_scaling=linear", "qkv_bias", "o_bias", "mlp_bias"],
    "mistral": ["sliding_window=8"],
    "qwen2": ["qkv_bias", "sliding_window=8", "tied_embeddings"],
    "qwen3": ["qkv_bias", "o_bias", "qk_norm"],
}


@pytest.fixture(scope="module")
def family():
    """family(name, **kw) -> (hf_model, MedusaModel), built once per name and kwargs."""
    built = {}

    def get(name, **kw):
        key = (name, tuple(sorted(kw.items())))
        if key not in built:
            built[key] = make_family_medusa(name, **kw)
        return built[key]

    return get


@pytest.fixture(scope="module")
def greedy_ref(family):
    memo = {}

    def ref(name, **kw):
        key = (name, tuple(sorted(kw.items())))
        if key not in memo:
            memo[key] = plain_greedy(family(name, **kw)[0], PROMPT, N_NEW)
        return memo[key]

    return ref


@pytest.mark.parametrize("name", FAMILIES)
def test_config_switches(family, name):
    hf, model = family(name)
    cfg = model.config
    assert cfg.model_type == hf.config.model_type and cfg.features == EXPECTED_FEATURES[name]
    assert cfg.head_dim == (32 if name == "qwen3" else 16)
    if name == "qwen2":  # max_window_layers=1: layer 0 attends everything, the others slide
        assert [cfg.window(i) for i in range(3)] == [None, 8, 8]
    if name == "qwen3":
        assert hf.model.layers[0].self_attn.q_norm.weight.std() > 0.05  # randomised, not transformers' ones
        assert torch.equal(model.backbone.layers[0].self_attn.q_norm.weight, hf.model.layers[0].self_attn.q_norm.weight)
    # the inverse mapping gives back a transformers config of the same model
    assert backbone_config(transformers_config(cfg).to_dict()) == cfg


@torch.no_grad()
@pytest.mark.parametrize("name", FAMILIES)
def test_logits_equal_transformers(family, name):
    """Prefill logits, then a 6-token step after a past of 20 (> the window), against transformers'
    forward over the whole sequence."""
    hf, model = family(name)
    ids = torch.tensor([list(range(7, 33))])  # 26 tokens
    expected = hf(ids).logits
    logits, _, _ = model(ids, torch.arange(26)[None], torch.from_numpy(causal_mask(26)), model.backbone.empty_past())
    torch.testing.assert_close(logits, expected, atol=2e-5, rtol=1e-5)
    _, _, past = model(ids[:, :20], torch.arange(20)[None], torch.from_numpy(causal_mask(20)),
                       model.backbone.empty_past())
    logits, _, new_kv = model(ids[:, 20:], torch.arange(20, 26)[None], torch.from_numpy(causal_mask(6)), past)
    torch.testing.assert_close(logits, expected[:, 20:], atol=2e-5, rtol=1e-5)
    assert new_kv[0][0].shape == (1, 6, 2, model.config.head_dim)


@torch.no_grad()
@pytest.mark.parametrize("name", ["mistral", "qwen2"])
def test_tree_nodes_see_the_window_by_position(family, name):
    """Each node of a 64-node tree after a past of 14 (> window 8) = transformers' causal forward
    over past + the node's root-to-node path: the window is applied by position (past + depth)."""
    hf, model = family(name)
    tree = tree_from_spec("64", num_heads=3)
    b = tree.buffers()
    g = torch.Generator().manual_seed(1)
    past_ids = torch.randint(0, 320, (14,), generator=g).tolist()
    tokens = torch.randint(0, 320, (tree.size,), generator=g)
    _, _, past = model(torch.tensor([past_ids]), torch.arange(14)[None], torch.from_numpy(causal_mask(14)),
                       model.backbone.empty_past())
    logits, _, _ = model(tokens[None], torch.as_tensor(14 + b.depth)[None], torch.as_tensor(b.attention_mask), past)
    for node in range(tree.size):
        path = np.flatnonzero(b.attention_mask[node])
        expected = hf(torch.tensor([past_ids + tokens[path].tolist()])).logits[0, -1]
        torch.testing.assert_close(logits[0, node], expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("spec", ["16", "chain"])
@pytest.mark.parametrize("name", FAMILIES)
def test_medusa_greedy_equals_transformers_generate(family, greedy_ref, name, spec):
    _, model = family(name)
    ref = greedy_ref(name)
    assert len(set(ref)) >= 6, ref  # not a trivial repetition
    tree = tree_from_spec(spec, num_heads=model.num_heads)
    res = medusa_generate(model, PROMPT, tree, max_new_tokens=N_NEW)
    assert res.tokens == ref


@pytest.mark.parametrize("name", ["mistral", "qwen2", "llama3"])
def test_full_tree_accepts_three_every_step_beyond_the_window(family, name):
    """Vocab 8 and every path of depth <= 3 in the tree: each step accepts 3 candidates, so
    depth-3 nodes decide the output and compaction moves K/V every step, far past the window."""
    hf, model = family(name, vocab=8, seed=7)  # seed 7: 7-8 distinct tokens in every family's reply
    prompt = [p % 8 for p in PROMPT]
    ref = plain_greedy(hf, prompt, N_NEW)
    assert len(set(ref)) >= 6, ref
    full = make_tree([p for d in (1, 2, 3) for p in itertools.product(range(8), repeat=d)], num_heads=3, topk=8)
    # 585 nodes exceed the tiny models' max_position_embeddings (512), whose capacity the engine now
    # defaults to: give the reference (no hard limit) room for the whole tree.
    res = medusa_generate(model, prompt, full, max_new_tokens=N_NEW, max_context=1024)
    assert res.tokens == ref
    full_steps, rest = divmod(N_NEW - 1, 4)  # step_tokens counts emitted tokens: the last step is cut at N_NEW
    assert res.step_tokens == [4] * full_steps + ([rest] if rest else [])


def test_strict_loading_names_the_key():
    hf = make_family_hf("qwen3")
    cfg = backbone_config(hf.config.to_dict())
    state = dict(hf.state_dict())
    state.pop("model.layers.1.self_attn.k_norm.weight")
    with pytest.raises(UnsupportedModelError, match=r"missing key 'layers\.1\.self_attn\.k_norm\.weight' \(a qwen3"):
        backbone_from_state_dict(cfg, state)
    state = dict(hf.state_dict())
    state["model.layers.0.self_attn.o_proj.lora_A"] = torch.zeros(1)
    with pytest.raises(UnsupportedModelError, match=r"unexpected key 'layers\.0\.self_attn\.o_proj\.lora_A'"):
        backbone_from_state_dict(cfg, state)
    state = dict(hf.state_dict())
    state["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(7)
    with pytest.raises(UnsupportedModelError, match=r"'layers\.0\.self_attn\.q_proj\.bias' has shape \(7,\), "
                                                    r"expected \(128,\)"):
        backbone_from_state_dict(cfg, state)


@pytest.mark.parametrize("change, message", [
    ({"model_type": "gemma2"}, r"model_type 'gemma2' is not supported; supported: llama, mistral, qwen2, qwen3"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, r"rope_scaling type 'yarn' is not supported; "
                                                             r"supported: default, linear, llama3"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, r"rope_scaling 'llama3' lacks the field"),
    ({"hidden_act": "gelu"}, r"hidden_act 'gelu' is not supported; supported: silu"),
    ({"partial_rotary_factor": 0.5}, r"partial_rotary_factor 0\.5 is not supported"),
])
def test_unsupported_configs_are_refused_by_name(change, message):
    cfg = {**make_family_hf("llama3").config.to_dict(), **change}
    with pytest.raises(UnsupportedModelError, match=message):
        backbone_config(cfg)


def test_family_defaults_come_from_transformers():
    """Fields a config.json leaves out take the transformers class's default, as its model would."""
    base = dict(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    assert backbone_config({"model_type": "qwen3", **base, "num_key_value_heads": 2}).head_dim == 128
    mistral = backbone_config({"model_type": "mistral", **base, "num_attention_heads": 16})
    assert mistral.sliding_window == 4096 and mistral.num_key_value_heads == 8 and mistral.head_dim == 4
    with pytest.raises(UnsupportedModelError, match="mistral config: 4 attention heads are not a multiple of 8 KV"):
        backbone_config({"model_type": "mistral", **base})
    assert backbone_config({"model_type": "llama", **base}).num_key_value_heads == 4


def test_backbone_from_hf_model_round_trip_is_exact():
    """Our reference's weights are the transformers model's own tensors (no copy)."""
    hf = make_family_hf("llama-linear-bias")
    b = backbone_from_hf_model(hf)
    assert b.layers[1].mlp.down_proj.bias.data_ptr() == hf.model.layers[1].mlp.down_proj.bias.data_ptr()
