"""scripts/make_random_checkpoint.py: the files are the real formats (transformers and our heads loader read
them, strictly), the values are the documented ones, the writer streams, and bad input is refused."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "make_random_checkpoint.py"
_spec = importlib.util.spec_from_file_location("make_random_checkpoint", _PATH)
mrc = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("make_random_checkpoint", mrc)
_spec.loader.exec_module(mrc)

def _read_all(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a model folder, through its index (or model.safetensors alone)."""
    index = folder / "model.safetensors.index.json"
    files = ["model.safetensors"]
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    out = {}
    for name in files:
        with safe_open(str(folder / name), framework="pt") as f:
            for key in f.keys():
                out[key] = f.get_tensor(key)
    return out


def _load_hf(folder: Path):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(folder), dtype="auto", output_loading_info=True)
    return model, info


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    mrc.make_checkpoint("tiny", out, seed=7, progress=False)
    return out


def test_tiny_files_index_and_shards(tiny):
    files = sorted(p.name for p in tiny.iterdir())
    shards = [f for f in files if f.startswith("model-")]
    assert len(shards) >= 2 and shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                                           for i in range(1, len(shards) + 1)]
    assert {"config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json",
            "tokenizer_config.json", "special_tokens_map.json", mrc.INFO_FILE} <= set(files)
    assert not [p for p in tiny.parent.iterdir() if ".partial-" in p.name]
    index = json.loads((tiny / "model.safetensors.index.json").read_text())
    cfg = json.loads((tiny / "config.json").read_text())
    specs = mrc.model_tensors(cfg)
    assert list(index["weight_map"]) == sorted(s.name for s in specs)
    assert index["metadata"]["total_size"] == 2 * sum(s.numel for s in specs)  # fp16
    for name in set(index["weight_map"].values()):  # every key sits where the index says
        with safe_open(str(tiny / name), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            assert sorted(f.keys()) == sorted(k for k, v in index["weight_map"].items() if v == name)
    # tensors in save_pretrained's order: the shards follow one another along the model
    order = [index["weight_map"][s.name] for s in specs]
    assert order == sorted(order)


def test_tiny_loads_in_transformers_with_the_written_values(tiny):
    model, info = _load_hf(tiny)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    cfg = json.loads((tiny / "config.json").read_text())
    state = model.state_dict()
    specs = mrc.model_tensors(cfg)
    assert sorted(state) == sorted(s.name for s in specs)
    for s in specs:
        assert state[s.name].dtype == torch.float16 and tuple(state[s.name].shape) == s.shape, s.name
        assert torch.equal(state[s.name], mrc.tensor_values(s, 7, "fp16")), s.name
    w = state["model.layers.0.self_attn.q_proj.weight"].float()
    assert abs(w.std().item() - mrc.STD) < 0.002 and abs(w.mean().item()) < 0.002
    norm = state["model.norm.weight"].float()
    assert (norm - 1).abs().max().item() < 0.1 and norm.std().item() > 0.005  # near 1, not exactly 1
    ids = torch.tensor([[1, 100, 200, 300]])
    with torch.no_grad():
        logits = model(ids).logits
    assert torch.isfinite(logits).all()


def test_tiny_tokenizer_and_chat_template(tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny))
    assert len(tok) == 512 and tok.bos_token_id == 1 and tok.eos_token_id == 2 and tok.unk_token_id == 0
    # byte-level: 'h' is byte 104, the byte tokens start after the 3 special ids
    assert tok("hi").input_ids == [1, 3 + ord("h"), 3 + ord("i")]
    assert tok.decode(tok("héllo wörld").input_ids, skip_special_tokens=True) == "héllo wörld"
    assert tok.convert_ids_to_tokens(511) == "<|filler_511|>"
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    text = tok.decode(ids)
    assert ids[0] == 1 and ids.count(1) == 1
    assert text.startswith("<s>A chat between") and text.endswith("USER: Hi ASSISTANT:")
    gen = json.loads((tiny / "generation_config.json").read_text())
    assert gen["bos_token_id"] == 1 and gen["eos_token_id"] == 2


def test_tiny_heads_load_with_our_loader(tiny):
    from torch import nn

    from medusa_export.loading.heads_formats import load_heads

    hdir = tiny.parent / "tiny-heads"
    meta = json.loads((hdir / "config.json").read_text())
    assert meta == {"base_model_name_or_path": str(tiny), "medusa_num_heads": 4, "medusa_num_layers": 1,
                    "transformers_version": meta["transformers_version"]}
    lm_head = nn.Linear(64, 512, bias=False)
    heads = load_heads(hdir, lm_head)
    assert (heads.config.num_heads, heads.config.num_layers, heads.config.own_projection) == (4, 1, True)
    spec = mrc.TensorSpec("2.0.linear.weight", (64, 64))
    assert torch.equal(heads.state_dict()["heads.2.0.linear.weight"].half(), mrc.tensor_values(spec, 7, "fp16"))


def test_small_shape_loads_and_is_about_100_mb(tmp_path):
    out = tmp_path / "small"
    info = mrc.make_checkpoint("small", out, progress=False)
    model, load = _load_hf(out)
    assert not load["missing_keys"] and not load["unexpected_keys"]
    n = sum(p.numel() for p in model.parameters())
    assert n == info["parameters"] and 90e6 < 2 * n < 120e6
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) >= 2
    assert index["metadata"]["total_size"] == 2 * n
    from medusa_export.loading.heads_formats import load_heads

    heads = load_heads(tmp_path / "small-heads", model.lm_head.float())
    assert (heads.config.num_heads, heads.config.vocab_size, heads.config.hidden_size) == (4, 16384, 512)


@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3"])
def test_families_load_strictly(tmp_path, family):
    from medusa_export.loading.architectures import backbone_config

    out = tmp_path / family
    mrc.make_checkpoint("tiny", out, family=family, heads=2, heads_layout="none", dtype="bf16", progress=False)
    assert not (tmp_path / f"{family}-heads").exists()
    model, info = _load_hf(out)
    assert type(model).__name__ == mrc.FAMILY_TABLE[family].hf_class
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.dtype == torch.bfloat16
    cfg = json.loads((out / "config.json").read_text())
    written = _read_all(out)
    assert sorted(written) == sorted(s.name for s in mrc.model_tensors(cfg))
    state = model.state_dict()
    for key, value in written.items():
        assert torch.equal(state[key], value), key
    bc = backbone_config(cfg)
    assert bc.model_type == family
    if family.startswith("qwen"):  # tied: no lm_head in the files, transformers ties it
        assert "lm_head.weight" not in written and model.lm_head.weight is model.model.embed_tokens.weight
        assert "model.layers.0.self_attn.q_proj.bias" in written or family == "qwen3"
    if family == "qwen3":
        assert written["model.layers.1.self_attn.k_norm.weight"].shape == (16,)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    if family == "mistral":
        assert tok.decode(tok.apply_chat_template([{"role": "user", "content": "x"}])) == "<s>[INST] x [/INST]"
    else:
        assert tok.convert_tokens_to_ids("<|im_end|>") == 512 - 32 + 2 == cfg["eos_token_id"]
        assert tok.bos_token is None and tok("a").input_ids == [ord("a")]  # bytes at ids 0..255, no bos


def test_medusa_1_0_layout_heads_inside_the_shards(tmp_path):
    from medusa_export.loading.heads_formats import infer_heads_config

    out = tmp_path / "m10"
    mrc.make_checkpoint("tiny", out, heads=3, heads_layout="medusa-1.0", progress=False)
    assert not (tmp_path / "m10-heads").exists()
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["medusa_num_heads"], cfg["medusa_num_layers"]) == (3, 1)
    written = _read_all(out)
    heads = {k.removeprefix("medusa_head."): v for k, v in written.items() if k.startswith("medusa_head.")}
    assert len(heads) == 3 * 3
    hc = infer_heads_config(heads, hidden_size=64, vocab_size=512, num_heads=3, num_layers=1)
    assert hc.own_projection
    _, info = _load_hf(out)  # transformers loads the backbone and reports the heads as unexpected
    assert not info["missing_keys"] and sorted(info["unexpected_keys"]) == sorted(
        k for k in written if k.startswith("medusa_head."))


def test_shared_projection_heads_and_bf16_heads(tmp_path):
    from torch import nn

    from medusa_export.loading.heads_formats import load_heads

    out = tmp_path / "m"
    mrc.make_checkpoint("tiny", out, heads=2, head_layers=2, head_projection="shared", heads_dtype="bf16",
                        heads_out=tmp_path / "h", progress=False)
    with safe_open(str(tmp_path / "h" / mrc.HEADS_FILE), framework="pt") as f:
        assert sorted(f.keys()) == ["0.0.linear.bias", "0.0.linear.weight", "0.1.linear.bias", "0.1.linear.weight",
                                    "1.0.linear.bias", "1.0.linear.weight", "1.1.linear.bias", "1.1.linear.weight"]
        assert f.get_tensor("0.0.linear.weight").dtype == torch.bfloat16
    heads = load_heads(tmp_path / "h", nn.Linear(64, 512, bias=False))
    assert (heads.config.num_heads, heads.config.num_layers, heads.config.own_projection) == (2, 2, False)


def test_heads_config_can_miscount_as_fasterdecodings_vicuna_heads_do(tmp_path):
    """medusa-vicuna-7b-v1.3's config.json says 2 heads for 5 (notes/14-research.md §1.a): reproducible."""
    mrc.make_checkpoint("tiny", tmp_path / "m", heads=5, heads_config_count=2, progress=False)
    assert json.loads((tmp_path / "m-heads" / "config.json").read_text())["medusa_num_heads"] == 2
    with safe_open(str(tmp_path / "m-heads" / mrc.HEADS_FILE), framework="pt") as f:
        assert {k.split(".")[0] for k in f.keys()} == {"0", "1", "2", "3", "4"}


def test_single_shard_is_written_as_hf_does(tmp_path):
    out = tmp_path / "one"
    mrc.make_checkpoint("tiny", out, shard_size=mrc.parse_size("1GB"), heads_layout="none", progress=False)
    assert (out / "model.safetensors").is_file() and not (out / "model.safetensors.index.json").exists()
    _, info = _load_hf(out)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_values_depend_on_seed_and_name_only(tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    mrc.make_checkpoint("tiny", a, seed=3, heads_layout="none", progress=False)
    mrc.make_checkpoint("tiny", b, seed=3, heads_layout="none", shard_size=40_000, progress=False)
    mrc.make_checkpoint("tiny", c, seed=4, heads_layout="none", progress=False)
    ta, tb, tc = _read_all(a), _read_all(b), _read_all(c)
    assert len(set(json.loads((b / "model.safetensors.index.json").read_text())["weight_map"].values())) > 3
    assert ta.keys() == tb.keys() == tc.keys()
    assert all(torch.equal(ta[k], tb[k]) for k in ta)
    assert not any(torch.equal(ta[k], tc[k]) for k in ta)
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (a / f).read_bytes() == (b / f).read_bytes()


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
def test_streaming_writer_equals_safetensors_save_file(tmp_path, dtype):
    from safetensors.torch import save_file

    specs = sorted([mrc.TensorSpec("b.weight", (33, 7)), mrc.TensorSpec("a.bias", (5,), "bias"),
                    mrc.TensorSpec("c.norm", (9,), "norm")], key=lambda s: s.name)  # save_file's order: by name
    mrc.write_safetensors(tmp_path / "ours.safetensors", specs, dtype, 11)
    save_file({s.name: mrc.tensor_values(s, 11, dtype) for s in specs},
              str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
def test_chunked_writer_values_across_chunks(tmp_path, monkeypatch, dtype):
    """Through the reused buffers (several chunks per tensor, a short last one, chunks across tensors) the file
    holds exactly the fresh-tensor values."""
    monkeypatch.setattr(mrc, "CHUNK_ELEMENTS", 1000)
    specs = [mrc.TensorSpec("a", (55, 100)), mrc.TensorSpec("b", (7,), "norm"), mrc.TensorSpec("c", (3, 1001))]
    mrc.write_safetensors(tmp_path / "x.safetensors", specs, dtype, 5)
    with safe_open(str(tmp_path / "x.safetensors"), framework="pt") as f:
        for s in specs:
            assert torch.equal(f.get_tensor(s.name), mrc.tensor_values(s, 5, dtype)), s.name
    assert not torch.equal(mrc.tensor_values(specs[0], 5, dtype).flatten()[:1000],
                           mrc.tensor_values(specs[0], 5, dtype).flatten()[1000:2000])


def test_writer_memory_stays_at_its_buffers(tmp_path):
    """A 128M-value tensor (256 MB fp16; 768 MB if drawn whole in fp32 and cast) costs the writer its buffers."""
    code = f"""
import importlib.util, sys
from pathlib import Path
spec = importlib.util.spec_from_file_location("m", {str(_PATH)!r}); m = importlib.util.module_from_spec(spec)
sys.modules["m"] = m; spec.loader.exec_module(m)
def hwm():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) * 1024
m.write_safetensors(Path({str(tmp_path / 'warm.safetensors')!r}), [m.TensorSpec("w", (1024, 1024))], "fp16", 0)
before = hwm()
m.write_safetensors(Path({str(tmp_path / 'big.safetensors')!r}), [m.TensorSpec("w", (131072, 1024))], "fp16", 0)
print(hwm() - before)
"""
    grew = int(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout)
    assert (tmp_path / "big.safetensors").stat().st_size > 2**28
    buffers = mrc.CHUNK_ELEMENTS * (4 + 2 + 2)  # the fp32 draw buffer + two fp16 output buffers
    assert grew < buffers + 16 * 2**20, f"the writer grew by {grew / 2**20:.0f} MiB"


def test_real_shapes_match_transformers_and_public_counts():
    """Every named shape's tensors are exactly a transformers model's (built on the meta device)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    known = {"vicuna-7b": 6_738_415_616, "llama-3.1-8b": 8_030_261_248, "llama-3.2-1b": 1_235_814_400,
             "mistral-7b": 7_241_732_096}
    for shape in mrc.SHAPES:
        cfg = {k: v for k, v in mrc.shape_config(shape).items() if not k.startswith("_")}
        hf_cfg = AutoConfig.for_model(**cfg)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_cfg)
        state = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        if cfg["tie_word_embeddings"]:
            state.pop("lm_head.weight")
        ours = {s.name: s.shape for s in mrc.model_tensors(cfg)}
        assert ours == state, shape
        if shape in known:
            assert sum(s.numel for s in mrc.model_tensors(cfg)) == known[shape], shape
    # FasterDecoding's medusa-vicuna-7b-v1.3: 5 heads of 147,853,312 parameters (notes/14-research.md §1.a)
    assert sum(s.numel for s in mrc.head_tensors(5, 1, 4096, 32000)) == 5 * 147_853_312


def test_real_vocab_special_token_ids():
    from transformers import PreTrainedTokenizerFast

    tok, tcfg, _ = mrc.make_tokenizer("llama3", 128256, 128256, 131072)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **{k: tcfg[k] for k in ("bos_token", "eos_token")})
    assert len(fast) == 128256 and fast.bos_token_id == 128000 and fast.eos_token_id == 128009
    assert fast.convert_tokens_to_ids(["<|end_of_text|>", "<|eom_id|>", "<|reserved_special_token_247|>"]) == [
        128001, 128008, 128255]
    assert fast("hi").input_ids == [128000, ord("h"), ord("i")]  # the byte tokens at ids 0..255, by byte value
    tok, tcfg, _ = mrc.make_tokenizer("chatml", 151936, 151665, 32768)
    assert tok.get_vocab_size() == 151665 and tok.token_to_id("<|im_end|>") == 151645


def test_bad_input_is_refused_by_name(tmp_path):
    with pytest.raises(mrc.CheckpointSpecError, match="unknown shape 'gpt-5'.*vicuna-7b.*tiny"):
        mrc.shape_config("gpt-5")
    with pytest.raises(mrc.CheckpointSpecError, match="llama model.*test shapes"):
        mrc.shape_config("vicuna-7b", family="qwen2")
    with pytest.raises(mrc.CheckpointSpecError, match="KEY=VALUE"):
        mrc.parse_override("num_hidden_layers")
    with pytest.raises(mrc.CheckpointSpecError, match="not a size"):
        mrc.parse_size("five gigabytes")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep me")
    with pytest.raises(mrc.CheckpointSpecError, match="not empty.*--force"):
        mrc.make_checkpoint("tiny", tmp_path / "full", progress=False)
    assert (tmp_path / "full" / "x").read_text() == "keep me"


def test_interrupted_run_leaves_nothing(tmp_path, monkeypatch):
    calls = []

    def fail_second(path, *a, **k):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(path, *a, **k)

    real = mrc.write_safetensors
    monkeypatch.setattr(mrc, "write_safetensors", fail_second)
    with pytest.raises(KeyboardInterrupt):
        mrc.make_checkpoint("tiny", tmp_path / "m", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_cli_overrides_and_summary(tmp_path):
    r = subprocess.run([sys.executable, str(_PATH), "tiny", str(tmp_path / "t"), "--quiet", "--heads", "2",
                        "--set", "num_hidden_layers=3",
                        "--set", 'rope_scaling={"rope_type": "linear", "factor": 2.0}'],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    cfg = json.loads((tmp_path / "t" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 3 and cfg["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    assert "model.layers.2.mlp.up_proj.weight" in _read_all(tmp_path / "t")
    assert "2 heads x 1 block(s)" in r.stdout
    r = subprocess.run([sys.executable, str(_PATH), "nope", str(tmp_path / "u")], capture_output=True, text=True)
    assert r.returncode == 2 and "unknown shape 'nope'" in r.stderr and not (tmp_path / "u").exists()
