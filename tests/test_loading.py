"""Loading every family and every published heads layout from files written in that layout.

Layouts (tests/checkpoints.py): an HF folder per family; FasterDecoding medusa-1.0 (heads inside
the model folder, ``medusa_head.``, fp16 .bin shards or safetensors); the version-2 heads-only
file (philschmid Llama 3.1: bf16, no own projection); NVIDIA modelopt FP8 (``medusa_heads.``, FP8
weights with per-tensor scales). Each has the malformed cases: missing key, extra key, wrong shape.
"""

from __future__ import annotations

import json

import pytest
import torch

from checkpoints import (quantize_fp8, random_head_tensors, save_family_dir, write_medusa_1_0, write_modelopt_fp8,
                         write_v2_heads)
from conftest import FAMILIES
from medusa_export.errors import HeadsFormatError, UnsupportedModelError, WeightsNotFoundError
from medusa_export.loading import fp8
from medusa_export.loading.backbone import check_gguf_rope, gguf_notes, load_backbone
from medusa_export.loading.gguf_meta import GGUFHeader, read_gguf_header
from medusa_export.loading.heads_formats import load_heads
from medusa_export.loading.registry import NO_CHAT_TEMPLATE_NOTE, load_model

IDS = torch.tensor([[5, 17, 42, 7, 99, 3, 250, 12, 64, 1, 2]])  # 11 tokens: past the window of 8


@torch.no_grad()
def _assert_same_logits(backbone, hf, atol=2e-5):
    n = IDS.shape[1]
    hidden, _ = backbone(IDS, torch.arange(n)[None], torch.ones(n, n, dtype=torch.bool).tril(), backbone.empty_past())
    torch.testing.assert_close(backbone.lm_head(hidden), hf(IDS).logits, atol=atol, rtol=1e-5)


def _heads_state(heads) -> dict:
    return {k.removeprefix("heads."): v for k, v in heads.state_dict().items()}


# --- plain HF folders, every family -----------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_folder_of_every_family(tmp_path, family):
    hf = save_family_dir(tmp_path, family)
    loaded = load_backbone(tmp_path)
    assert loaded.backbone.config.model_type == hf.config.model_type
    assert loaded.embedded_heads is None and loaded.quantization is None and loaded.kept_scales == {}
    gen_eos = hf.generation_config.eos_token_id  # Qwen configs name none: the tokenizer's </s> (2)
    assert loaded.eos_token_ids == [int(gen_eos) if gen_eos is not None else 2]
    _assert_same_logits(loaded.backbone, hf)
    if family == "qwen2":  # tied: no lm_head.weight in the file, the head is the embedding
        assert loaded.backbone.lm_head.weight is loaded.backbone.embed_tokens.weight


def test_generation_config_eos_list_wins(tmp_path):
    save_family_dir(tmp_path, "llama3")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [128001, 128008, 128009]}))
    assert load_backbone(tmp_path).eos_token_ids == [128001, 128008, 128009]


@pytest.mark.parametrize("change, error, message", [
    (lambda d: (d / "config.json").unlink(), WeightsNotFoundError, r"no config\.json in"),
    (lambda d: (d / "model.safetensors").unlink(), WeightsNotFoundError,
     r"no weights in .*: expected one of model\.safetensors, model\.safetensors\.index\.json, pytorch_model\.bin"),
    (lambda d: (d / "tokenizer.json").unlink() or (d / "tokenizer_config.json").unlink(), WeightsNotFoundError,
     r"cannot load a tokenizer"),
    (lambda d: _edit_config(d, model_type="phi3"), UnsupportedModelError,
     r"model_type 'phi3' is not supported; supported: llama, mistral, qwen2, qwen3"),
    (lambda d: _edit_config(d, quantization_config={"quant_method": "gptq", "bits": 4}), UnsupportedModelError,
     r"quantized checkpoint \(gptq, gptq\) is not supported; supported: unquantized, or TensorRT Model Optimizer"),
    (lambda d: _edit_config(d, num_hidden_layers=3), UnsupportedModelError,
     r"checkpoint is missing key 'layers\.2\.input_layernorm\.weight'"),
    (lambda d: _edit_config(d, num_hidden_layers=1), UnsupportedModelError,
     r"checkpoint has unexpected key 'layers\.1\.input_layernorm\.weight'"),
    (lambda d: _edit_config(d, intermediate_size=96), UnsupportedModelError,
     r"key 'layers\.0\.mlp\.gate_proj\.weight' has shape \(128, 64\), expected \(96, 64\)"),
], ids=["no-config", "no-weights", "no-tokenizer", "family", "gptq", "missing-key", "extra-key", "wrong-shape"])
def test_bad_hf_folders(tmp_path, change, error, message):
    save_family_dir(tmp_path, "mistral")
    change(tmp_path)
    with pytest.raises(error, match=message):
        load_backbone(tmp_path)


def _edit_config(folder, **fields):
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **fields}))


# --- FasterDecoding medusa-1.0: heads inside the model folder ---------------------------------------


@pytest.mark.parametrize("fmt, counts", [("bin", True), ("safetensors", False)])
def test_medusa_1_0_folder(tmp_path, fmt, counts):
    """fp16 shards (index + 2 files), ``medusa_head.`` keys; the backbone comes from the same folder;
    a config without the counts (as the 13b/33b ones were) has them inferred from the keys."""
    hf, heads = write_medusa_1_0(tmp_path, "mistral", num_heads=3, fmt=fmt, counts=counts)
    lm = load_model(str(tmp_path))
    assert lm.model.num_heads == 3 and lm.model.heads.config.own_projection
    assert lm.heads_source == f"{tmp_path} (medusa_head.* keys)"
    got = _heads_state(lm.model.heads)
    assert got.keys() == heads.keys() and all(torch.equal(got[k], heads[k].float()) for k in heads)
    _assert_same_logits(lm.model.backbone, hf)
    # --heads pointing at the folder reads only the shards that hold heads
    alone = load_heads(tmp_path, lm.model.backbone.lm_head)
    assert all(torch.equal(_heads_state(alone)[k], got[k]) for k in got)


@pytest.mark.parametrize("change, message", [
    (lambda s: s.pop("medusa_head.1.0.linear.bias"), r"missing key '1\.0\.linear\.bias'"),
    (lambda s: s.update({"medusa_head.2.0.linear.scale": torch.ones(64)}), r"unexpected key '2\.0\.linear\.scale'"),
    (lambda s: s.update({"medusa_head.1.2.linear.weight": torch.ones(64, 64)}),
     r"unexpected key '1\.2\.linear\.weight' in heads file: the heads have 1 block\(s\) and its own projection"),
    (lambda s: s.pop("medusa_head.2.1.weight"), r"missing key '2\.1\.weight'"),
    (lambda s: s.update({"medusa_head.0.1.weight": torch.ones(321, 64).half()}),
     r"key '0\.1\.weight' has shape \(321, 64\), expected \(320, 64\)"),
], ids=["missing-key", "extra-key", "stray-block", "missing-projection", "wrong-shape"])
def test_bad_medusa_1_0_heads_name_the_key(tmp_path, change, message):
    write_medusa_1_0(tmp_path, "llama3", fmt="safetensors", change=change)
    with pytest.raises(HeadsFormatError, match=message):
        load_model(str(tmp_path))


def test_medusa_1_0_config_count_is_checked(tmp_path):
    """A config.json count that disagrees with the keys is a warning: the keys decide."""
    write_medusa_1_0(tmp_path, "mistral", num_heads=3)
    _edit_config(tmp_path, medusa_num_heads=5)
    with pytest.warns(UserWarning, match=r"config\.json says 5 heads but the weights hold 3"):
        assert load_model(str(tmp_path)).model.num_heads == 3


def test_medusa_1_0_backbone_stays_strict(tmp_path):
    write_medusa_1_0(tmp_path, "mistral", change=lambda s: s.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(UnsupportedModelError, match=r"missing key 'layers\.1\.mlp\.up_proj\.weight'"):
        load_model(str(tmp_path))


def test_two_head_prefixes_are_refused(tmp_path):
    write_medusa_1_0(tmp_path, "mistral", change=lambda s: s.update({"medusa_heads.0.0.linear.bias": torch.ones(64)}))
    with pytest.raises(UnsupportedModelError, match="both medusa_head. and medusa_heads. prefixes"):
        load_model(str(tmp_path))


# --- version-2 heads-only file (philschmid Llama 3.1) -------------------------------------------------


def test_v2_heads_without_projection(tmp_path):
    hf = save_family_dir(tmp_path / "model", "llama3")
    heads = write_v2_heads(tmp_path / "heads", 64, 320)
    lm = load_model(str(tmp_path / "model"), heads_path=str(tmp_path / "heads"))
    cfg = lm.model.heads.config
    assert (cfg.num_heads, cfg.num_layers, cfg.own_projection) == (3, 1, False)
    got = _heads_state(lm.model.heads)
    assert got.keys() == heads.keys() and all(torch.equal(got[k], heads[k].float()) for k in heads)
    x = torch.randn(2, 64)
    block = heads["1.0.linear.weight"].float()
    expected = hf.lm_head(x + torch.nn.functional.silu(x @ block.T + heads["1.0.linear.bias"].float()))
    torch.testing.assert_close(lm.model.heads(x)[1], expected)  # TGI MedusaHeadV2: lm_head(x + SiLU(Wx + b))


@pytest.mark.parametrize("change, message", [
    (lambda t: t.pop("2.0.linear.weight"), r"missing key '2\.0\.linear\.weight'"),
    (lambda t: t.update({"1.1.weight": torch.ones(320, 64, dtype=torch.bfloat16)}), r"unexpected key '1\.1\.weight'"),
    (lambda t: t.update({"0.0.linear.bias": torch.ones(65, dtype=torch.bfloat16)}),
     r"key '0\.0\.linear\.bias' has shape \(65,\), expected \(64,\)"),
], ids=["missing-key", "extra-key", "wrong-shape"])
def test_bad_v2_heads(tmp_path, change, message):
    write_v2_heads(tmp_path, 64, 320, change=change)
    with pytest.raises(HeadsFormatError, match=message):
        load_heads(tmp_path, torch.nn.Linear(64, 320, bias=False))


# --- NVIDIA modelopt FP8 -----------------------------------------------------------------------------


def test_fp8_dequantize_is_weight_times_scale():
    w = torch.randn(8, 4)
    q, s = quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == ()
    assert torch.equal(fp8.dequantize(q, s), q.float() * s)
    assert (fp8.dequantize(q, s) - w).abs().max() <= w.abs().max() / 8  # within an E4M3 step
    assert torch.equal(fp8.dequantize(q, s.reshape(1), torch.float16), (q.float() * s).half())
    rows = torch.arange(1.0, 9.0)  # per output channel (one scale per row), as the export's source reads it too
    assert torch.equal(fp8.dequantize(q, rows), q.float() * rows[:, None])
    assert torch.equal(fp8.dequantize(q[2:5], rows, rows=(2, 5)), q[2:5].float() * rows[2:5, None])
    with pytest.raises(UnsupportedModelError, match=r"shape \(3,\) for a weight of shape \(8, 4\): only per-tensor "
                                                     r"scales \(one value\) or per-output-channel"):
        fp8.dequantize(q, torch.ones(3))


def test_modelopt_fp8_folder(tmp_path):
    hf, heads, input_scales = write_modelopt_fp8(tmp_path, "llama3", num_heads=3)
    lm = load_model(str(tmp_path))
    assert lm.quantization == "modelopt FP8 (20 weights dequantized to float32)"  # 2 layers x 7 + 3 heads x 2
    assert lm.kept_scales == pytest.approx(input_scales) and len(input_scales) == 20
    assert any("TensorRT FP8 plan" in n for n in lm.notes)
    assert lm.model.num_heads == 3 and lm.model.heads.config.own_projection
    got = _heads_state(lm.model.heads)
    assert got.keys() == heads.keys() and all(torch.equal(got[k], heads[k]) for k in heads)
    b = lm.model.backbone
    assert torch.equal(b.layers[1].self_attn.k_proj.weight, hf.model.layers[1].self_attn.k_proj.weight)
    _assert_same_logits(b, hf)


@pytest.mark.parametrize("change, error, message", [
    (lambda s: s.pop("model.layers.0.mlp.up_proj.weight_scale"), UnsupportedModelError,
     r"FP8 tensor 'model\.layers\.0\.mlp\.up_proj\.weight' has no 'model\.layers\.0\.mlp\.up_proj\.weight_scale'"),
    (lambda s: s.update({"model.norm.weight_scale": torch.ones(())}), UnsupportedModelError,
     r"'model\.norm\.weight_scale' scales no FP8 weight"),
    (lambda s: s.update({"model.layers.0.self_attn.q_proj.weight_scale": torch.ones(128)}), UnsupportedModelError,
     r"'model\.layers\.0\.self_attn\.q_proj\.weight_scale' has shape \(128,\) for a weight of shape \(64, 64\): only "
     r"per-tensor scales"),
    (lambda s: s.pop("medusa_heads.1.1.weight"), UnsupportedModelError,
     r"'medusa_heads\.1\.1\.weight_scale' scales no FP8 weight \('medusa_heads\.1\.1\.weight' is missing"),
    (lambda s: [s.pop(f"medusa_heads.1.1.{n}") for n in ("weight", "weight_scale", "input_scale")], HeadsFormatError,
     r"missing key '1\.1\.weight'"),
    (lambda s: s.update({"medusa_heads.3.0.linear.weight": s["medusa_heads.0.0.linear.weight"],
                         "medusa_heads.3.0.linear.weight_scale": s["medusa_heads.0.0.linear.weight_scale"]}),
     HeadsFormatError, r"missing key '3\.0\.linear\.bias'"),
    (lambda s: s.update({"model.layers.0.self_attn.rotary.weight": torch.ones(2)}), UnsupportedModelError,
     r"unexpected key 'layers\.0\.self_attn\.rotary\.weight'"),
], ids=["missing-scale", "stray-scale", "wrong-size-scale", "missing-head-weight", "missing-head-key", "stray-head",
        "extra-key"])
def test_bad_modelopt_fp8(tmp_path, change, error, message):
    write_modelopt_fp8(tmp_path, "llama3", change=change)
    with pytest.raises(error, match=message):
        load_model(str(tmp_path))


def test_other_fp8_producers_are_refused(tmp_path):
    write_modelopt_fp8(tmp_path, "llama3")
    (tmp_path / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "llmcompressor"},
                                                               "quantization": {"quant_algo": "FP8"}}))
    with pytest.raises(UnsupportedModelError, match=r"\(llmcompressor, FP8\) is not supported"):
        load_model(str(tmp_path))


# --- GGUF ------------------------------------------------------------------------------------------


def _write_gguf(path, *, rope_freqs: bool, name="Meta Llama 3.1 8B Instruct"):
    import numpy as np
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), "llama")
    w.add_name(name)
    w.add_context_length(8192)
    w.add_token_list(["<s>", "</s>", "a b", "ü"])
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    if rope_freqs:
        w.add_tensor("rope_freqs.weight", np.ones(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_header_is_read_without_the_tensors(tmp_path):
    _write_gguf(tmp_path / "m.gguf", rope_freqs=True)
    h = read_gguf_header(tmp_path / "m.gguf")
    assert h.strings["general.architecture"] == "llama" and h.strings["general.name"] == "Meta Llama 3.1 8B Instruct"
    assert "llama.context_length" in h.keys and "tokenizer.ggml.tokens" in h.keys
    assert h.tensors == ["token_embd.weight", "rope_freqs.weight"]
    (tmp_path / "x.gguf").write_bytes(b"GGML" + bytes(20))
    with pytest.raises(WeightsNotFoundError, match="is not a GGUF file"):
        read_gguf_header(tmp_path / "x.gguf")


def test_gguf_with_rope_scaling_is_refused_before_loading(tmp_path):
    _write_gguf(tmp_path / "llama31.gguf", rope_freqs=True)
    with pytest.raises(UnsupportedModelError, match=r"RoPE scaling \(tensor rope_freqs\.weight.*transformers' GGUF "
                                                     r"loader drops"):
        load_backbone(tmp_path / "llama31.gguf")
    check_gguf_rope(read_gguf_header(tmp_path / "llama31.gguf").__class__(keys=["llama.rope.freq_base"]))
    with pytest.raises(UnsupportedModelError, match=r"key llama\.rope\.scaling\.type"):
        check_gguf_rope(GGUFHeader(keys=["llama.rope.scaling.type"], strings={"llama.rope.scaling.type": "linear"}))


def test_gguf_sliding_window_notes():
    assert "sliding_window=4096" in gguf_notes(GGUFHeader(), "mistral")[0]
    assert "loads as a llama model without a sliding window" in gguf_notes(
        GGUFHeader(strings={"general.name": "Mistral 7B Instruct v0.2"}), "llama")[0]
    assert gguf_notes(GGUFHeader(strings={"general.name": "SmolLM2"}), "llama") == []


# --- base models: no chat template -----------------------------------------------------------------------


def test_base_model_without_chat_template(tmp_path):
    from medusa_export.chat import apply_chat_template

    save_family_dir(tmp_path, "qwen3", chat_template=False)
    lm = load_model(str(tmp_path))
    assert lm.chat_template is None and NO_CHAT_TEMPLATE_NOTE in lm.notes
    ids = apply_chat_template(lm.tokenizer, lm.chat_template, [{"role": "user", "content": "Write a poem."}])
    assert ids == lm.tokenizer.encode("Write a poem.") and len(ids) > 2


def test_random_head_tensors_layout():
    t = random_head_tensors(8, 11, num_heads=2, num_layers=2)
    assert sorted(t) == ["0.0.linear.bias", "0.0.linear.weight", "0.1.linear.bias", "0.1.linear.weight", "0.2.weight",
                         "1.0.linear.bias", "1.0.linear.weight", "1.1.linear.bias", "1.1.linear.weight", "1.2.weight"]


# --- the opened model (build / verify: tensor sources) says and refuses what the loaded one does ----------


def _open(path, **kw):
    from medusa_export.loading.sources import open_model

    return open_model(str(path), **kw)


def test_opened_modelopt_fp8_equals_the_loaded(tmp_path):
    """One dequantization (loading/fp8.dequantize) behind both: the streamed source's tensors equal the loaded
    model's, and the quantization, kept scales and notes are the same."""
    write_modelopt_fp8(tmp_path, "llama3", num_heads=3)
    lm, om = load_model(str(tmp_path)), _open(tmp_path)
    assert om.model is None and om.quantization == lm.quantization == "modelopt FP8 (20 weights dequantized to float32)"
    assert om.kept_scales == lm.kept_scales and len(om.kept_scales) == 20
    assert om.notes == lm.notes and any("TensorRT FP8 plan" in n for n in om.notes)
    assert om.heads_source == lm.heads_source == f"{tmp_path} (medusa_heads.* keys)"
    src = om.sources
    assert (src.heads_config.num_heads, src.heads_config.own_projection) == (3, True)
    k_proj = lm.model.backbone.layers[1].self_attn.k_proj.weight
    assert torch.equal(src.backbone.read("model.layers.1.self_attn.k_proj.weight"), k_proj)
    assert torch.equal(src.backbone.read_rows("model.layers.1.self_attn.k_proj.weight", 3, 7), k_proj[3:7])
    assert torch.equal(src.heads.read("2.1.weight"), lm.model.heads.heads[2][-1].weight)


def test_opened_model_refuses_other_quantizers(tmp_path):
    write_modelopt_fp8(tmp_path / "a", "llama3")
    (tmp_path / "a" / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "llmcompressor"},
                                                                     "quantization": {"quant_algo": "FP8"}}))
    with pytest.raises(UnsupportedModelError, match=r"\(llmcompressor, FP8\) is not supported"):
        _open(tmp_path / "a")
    save_family_dir(tmp_path / "b", "mistral")
    _edit_config(tmp_path / "b", quantization_config={"quant_method": "gptq", "bits": 4})
    with pytest.raises(UnsupportedModelError, match=r"quantized checkpoint \(gptq, gptq\) is not supported"):
        _open(tmp_path / "b")


def test_opened_gguf_with_rope_scaling_is_refused_from_its_header(tmp_path):
    _write_gguf(tmp_path / "llama31.gguf", rope_freqs=True)
    with pytest.raises(UnsupportedModelError, match=r"RoPE scaling \(tensor rope_freqs\.weight.*transformers' GGUF "
                                                     r"loader drops"):
        _open(tmp_path / "llama31.gguf")


def test_opened_medusa_1_0_third_party_count_warns(tmp_path):
    """As the loader: the keys decide, a config.json count that disagrees is a warning; --heads may name the
    model folder that holds them."""
    write_medusa_1_0(tmp_path / "m", "mistral", num_heads=3, fmt="safetensors")
    _edit_config(tmp_path / "m", medusa_num_heads=5)
    with pytest.warns(UserWarning, match=r"config\.json says 5 heads but the weights hold 3"):
        om = _open(tmp_path / "m")
    assert om.sources.heads_config.num_heads == 3 and om.heads_source == f"{tmp_path / 'm'} (medusa_head.* keys)"
    save_family_dir(tmp_path / "base", "mistral")
    with pytest.warns(UserWarning, match=r"config\.json says 5 heads but the weights hold 3"):
        om = _open(tmp_path / "base", heads_path=str(tmp_path / "m"))
    assert om.sources.heads_config.num_heads == 3 and om.heads_source == str(tmp_path / "m")


def test_opened_base_model_notes_no_chat_template(tmp_path):
    save_family_dir(tmp_path, "qwen3", chat_template=False)
    om = _open(tmp_path)
    assert om.chat_template is None and om.notes == [NO_CHAT_TEMPLATE_NOTE] == load_model(str(tmp_path)).notes


def test_a_miscounting_config_is_one_note_line_on_the_command_line(tmp_path):
    """The console script as a user runs it: a third-party config.json that miscounts the heads is one
    ``[note: ...]`` line on stderr, not Python's warning with its category and a line of our source."""
    import subprocess
    import sys

    write_medusa_1_0(tmp_path / "m", "mistral", num_heads=3, fmt="safetensors")
    _edit_config(tmp_path / "m", medusa_num_heads=5)
    proc = subprocess.run([sys.executable, "-m", "medusa_export.cli", "generate", "--model", str(tmp_path / "m"),
                           "--prompt", "hi", "--raw", "--tree", "chain", "--max-new-tokens", "2"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    note = f"[note: {tmp_path / 'm'}/config.json says 5 heads but the weights hold 3: the weights' count is used]"
    lines = proc.stderr.splitlines()
    assert lines.count(note) == 1, proc.stderr
    assert "Warning" not in proc.stderr and ".py:" not in proc.stderr, proc.stderr
