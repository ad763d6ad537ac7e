"""Checkpoints read tensor by tensor (loading/checkpoint.py): every format, and every bad input as a typed error."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from conftest import make_tiny_medusa, make_tiny_tokenizer
from medusa_export.errors import CheckpointError, InsufficientDiskError, WeightsNotFoundError
from medusa_export.loading.checkpoint import (DictSource, SafetensorsSource, TorchBinSource, backbone_shapes,
                                              check_backbone, check_disk, find_weights)
from medusa_export.loading.sources import open_backbone, open_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(hf model, sharded safetensors folder): a tiny Llama saved in 3+ shards with its index and tokenizer."""
    hf, _ = make_tiny_medusa(vocab=301, hidden=64, layers=2, medusa_heads=2, seed=5)
    path = tmp_path_factory.mktemp("ckpt") / "sharded"
    hf.save_pretrained(path, safe_serialization=True, max_shard_size="60KB")
    make_tiny_tokenizer().save_pretrained(path)
    return hf, path


def _copy(src, tmp_path, name="copy"):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def test_sharded_safetensors_reads_what_transformers_saved(tiny):
    hf, path = tiny
    kind, files, weight_map = find_weights(path)
    assert kind == "safetensors" and len(files) >= 3 and (path / "model.safetensors.index.json").is_file()
    src, cfg, _, _, gguf = open_backbone(path)
    assert gguf is None and cfg.num_hidden_layers == 2 and cfg.head_dim == 16
    state = hf.state_dict()
    assert sorted(src.keys()) == sorted(k for k in state if k != "lm_head.weight" or not cfg.tie_word_embeddings)
    for key in src.keys():
        info = src.info(key)
        assert info.shape == tuple(state[key].shape) and info.dtype == "float32" and info.file.endswith(".safetensors")
        torch.testing.assert_close(src.read(key), state[key], rtol=0, atol=0)
    emb = "model.embed_tokens.weight"
    torch.testing.assert_close(src.read_rows(emb, 7, 19), state[emb][7:19], rtol=0, atol=0)


def test_bin_shards_and_fp16(tiny, tmp_path):
    hf, _ = tiny
    hf.half().save_pretrained(tmp_path / "bin", safe_serialization=False, max_shard_size="60KB")
    hf.float()
    kind, files, _ = find_weights(tmp_path / "bin")
    assert kind == "bin" and len(files) >= 2
    src = TorchBinSource(files)
    for key, t in hf.state_dict().items():
        if key in src:
            assert src.info(key).dtype == "float16"
            torch.testing.assert_close(src.read(key), t.half(), rtol=0, atol=0)


def test_fp8_modelopt_layout_is_dequantized(tmp_path):
    """float8_e4m3fn weight + weight_scale (modelopt: w / scale stored) reads as w8.float() * scale; the scales
    and input_scale are not listed."""
    w = torch.randn(8, 4)
    scale = w.abs().max() / 448
    save_file({"a.weight": (w / scale).to(torch.float8_e4m3fn), "a.weight_scale": scale.reshape(()),
               "a.input_scale": torch.tensor(0.5), "b.weight": torch.randn(3)}, str(tmp_path / "m.safetensors"))
    src = SafetensorsSource([tmp_path / "m.safetensors"])
    assert sorted(src.keys()) == ["a.weight", "b.weight"] and src.info("a.weight").dtype == "float8_e4m3fn"
    got = src.read("a.weight")
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, (w / scale).to(torch.float8_e4m3fn).float() * scale, rtol=0, atol=0)
    assert (got - w).abs().max() < 0.1 * w.abs().max()
    torch.testing.assert_close(src.read_rows("a.weight", 2, 5), got[2:5], rtol=0, atol=0)
    save_file({"a.weight": (w / scale).to(torch.float8_e4m3fn)}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(CheckpointError, match="FP8 tensor 'a.weight' has no 'a.weight_scale'"):
        SafetensorsSource([tmp_path / "bad.safetensors"])


# ---- bad input ----------------------------------------------------------------------------------------------


def test_missing_shard_is_named(tiny, tmp_path):
    path = _copy(tiny[1], tmp_path)
    shard = sorted(path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"model.safetensors.index.json names \d+ shard\(s\); missing: {shard.name}"):
        find_weights(path)


def test_index_naming_an_absent_file(tiny, tmp_path):
    path = _copy(tiny[1], tmp_path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "model-99999-of-99999.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="missing: model-99999-of-99999.safetensors"):
        open_backbone(path)


def test_index_placing_a_key_in_the_wrong_shard(tiny, tmp_path):
    path = _copy(tiny[1], tmp_path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.extra.weight"] = sorted(set(index["weight_map"].values()))[0]
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="places tensor 'model.extra.weight' in .* that file's header lacks it"):
        open_backbone(path)


def test_truncated_shard_is_named(tiny, tmp_path):
    path = _copy(tiny[1], tmp_path)
    shard = sorted(path.glob("model-*.safetensors"))[-1]
    data = shard.read_bytes()
    shard.write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match=rf"{shard.name}: truncated: tensor .* ends at byte {len(data)} but the "
                                              rf"file has {len(data) - 100} bytes"):
        open_backbone(path)
    shard.write_bytes(data[:5])
    with pytest.raises(CheckpointError, match="truncated: 5 bytes, not even a safetensors header"):
        open_backbone(path)


def test_header_that_disagrees_with_config_json(tiny, tmp_path):
    path = _copy(tiny[1], tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"model-.*safetensors: tensor 'model.layers.0.mlp.gate_proj.weight' has "
                                              r"shape \[128, 64\] but config.json: .*intermediate_size 96.* implies \[96, 64\]"):
        open_backbone(path)
    cfg["intermediate_size"], cfg["num_hidden_layers"] = 128, 1
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.1"):
        open_backbone(path)


def test_missing_tensor_and_missing_config(tiny, tmp_path):
    hf, _ = tiny
    state = {k: v for k, v in hf.state_dict().items() if k != "model.norm.weight"}
    src = DictSource(state)
    from medusa_export.loading.backbone import backbone_from_hf_model

    cfg = backbone_from_hf_model(hf).config
    with pytest.raises(CheckpointError, match="tensor 'model.norm.weight' is missing"):
        check_backbone(src, cfg)
    assert set(backbone_shapes(cfg)) == set(state) | {"model.norm.weight"} - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    path = _copy(tiny[1], tmp_path)
    (path / "config.json").unlink()
    with pytest.raises(WeightsNotFoundError, match="no config.json"):
        open_backbone(path)
    with pytest.raises(WeightsNotFoundError, match="no weights in"):
        find_weights(tmp_path)


def test_not_enough_disk_for_weights(tmp_path, monkeypatch):
    import medusa_export.loading.checkpoint as ck

    class Usage:
        free = 1_000_000

    monkeypatch.setattr(ck.shutil, "disk_usage", lambda p: Usage)
    with pytest.raises(InsufficientDiskError, match=r"weights.bin: it needs 2.00 GB but .* has 0.00 GB free"):
        check_disk(tmp_path, 2_000_000_000)


def test_open_model_reads_no_weights(tiny, monkeypatch):
    """open_model checks headers and configs only: no tensor is read until the export asks for one."""
    reads = []
    monkeypatch.setattr(SafetensorsSource, "_raw", lambda self, key, rows: reads.append(key))
    lm = open_model(str(tiny[1]))
    assert lm.model is None and reads == []
    assert lm.sources.config.vocab_size == 301 and lm.sources.heads_config.num_heads == 4  # initial heads
    assert lm.eos_token_ids and lm.tokenizer is not None


@pytest.mark.slow  # reads the embedded model's file
def test_truncated_gguf_is_named(tmp_path):
    from medusa_export.loading.registry import get_entry, resolve_backbone

    path, _ = resolve_backbone(get_entry("smollm2-135m"), None)
    with open(path, "rb") as fh:
        (tmp_path / "m.gguf").write_bytes(fh.read(60_000_000))
    with pytest.raises(CheckpointError, match=r"m.gguf: not a readable GGUF file \(truncated\?\)"):
        open_backbone(tmp_path / "m.gguf")


@pytest.mark.slow
def test_gguf_source_equals_transformers_gguf_loading(smollm):
    """The embedded Q4_1 GGUF read tensor by tensor (Q/K reverse-permuted) equals what transformers loads."""
    from medusa_export.loading.registry import get_entry, resolve_backbone

    path, _ = resolve_backbone(get_entry("smollm2-135m"), None)
    src, cfg, _, _, gguf = open_backbone(path)
    assert gguf == path.name and cfg.tie_word_embeddings and "lm_head.weight" not in src.keys()
    state = smollm.model.backbone.state_dict()
    for key in src.keys():
        ref = state[key.removeprefix("model.")]
        got = src.read(key).float()
        assert got.shape == ref.shape
        assert torch.equal(got, ref), key
    assert np.isclose(cfg.rms_norm_eps, smollm.model.config.rms_norm_eps)
