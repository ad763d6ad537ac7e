"""Every family switch in both written step graphs, against transformers' own models (issue 13).

Tiny random models built from transformers' config classes (Llama 3 RoPE scaling, Llama biases + linear RoPE
+ tied embeddings, Mistral sliding window, Qwen2 q/k/v biases + a sliding layer, Qwen3 q/k norms + explicit
head_dim), saved with ``save_pretrained`` and exported from the checkpoint folder. transformers initialises
biases to 0 and norm weights to 1, so they are randomised first (otherwise the switch is never exercised).
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch

from conftest import make_tiny_tokenizer, plain_greedy, rmsnorm_chains
from medusa_export.pipeline import BuildConfig, build_artifact
from medusa_export.loading.sources import open_model
from medusa_runtime.contract.artifact import load_artifact
from medusa_runtime.engines.kvcache import KVCache
from medusa_runtime.engines.ort import OrtEngine
from medusa_runtime.decode.loop import causal_mask, generate
from medusa_runtime.trees.tree import make_tree

COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1)
# Depth 3 with siblings: nodes deep in the tree sit at past length + depth, past the window of 8 positions.
TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0]]
PROMPT = [5, 17, 230, 9, 41, 77, 12, 3, 99, 140, 8, 61]  # 12 tokens: longer than the window


def _families():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    return {
        "llama3-rope": (LlamaConfig(**COMMON, rope_theta=1e4, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}), ["rope_scaling=llama3"]),
        "llama-biases": (LlamaConfig(**COMMON, attention_bias=True, mlp_bias=True, tie_word_embeddings=True,
                                     rope_scaling={"type": "linear", "factor": 2.0}),
                         ["rope_scaling=linear", "qkv_bias", "o_bias", "mlp_bias", "tied_embeddings"]),
        "mistral-window": (MistralConfig(**COMMON, sliding_window=8), ["sliding_window=8"]),
        "qwen2-window": (Qwen2Config(**COMMON, tie_word_embeddings=True, use_sliding_window=True, sliding_window=8,
                                     max_window_layers=1), ["qkv_bias", "sliding_window=8", "tied_embeddings"]),
        "qwen3-qknorm": (Qwen3Config(**COMMON, head_dim=32), ["qk_norm"]),
    }


FAMILIES = list(_families())


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """``family(name)`` -> (transformers model, checkpoint folder), made once per name."""
    made = {}

    def get(name):
        if name not in made:
            from transformers import AutoModelForCausalLM

            cfg, _ = _families()[name]
            torch.manual_seed(FAMILIES.index(name))
            hf = AutoModelForCausalLM.from_config(cfg).eval()
            with torch.no_grad():  # transformers initialises biases to 0 and norms to 1: exercise the switches
                for n, p in hf.named_parameters():
                    if n.endswith("bias"):
                        p.normal_(0, 0.1)
                    elif "norm" in n:
                        p.copy_(1 + 0.2 * torch.randn_like(p))
            path = tmp_path_factory.mktemp("family") / name
            hf.save_pretrained(path, safe_serialization=True, max_shard_size="100KB")
            make_tiny_tokenizer().save_pretrained(path)
            made[name] = (hf, path)
        return made[name]

    return get


@pytest.fixture(scope="module")
def artifact(family, tmp_path_factory):
    made = {}

    def get(name, graph):
        if (name, graph) not in made:
            _, path = family(name)
            lm = open_model(str(path))
            out = tmp_path_factory.mktemp("art") / f"{name}-{graph}"
            made[name, graph] = build_artifact(lm, make_tree(TREE, num_heads=4), out,
                                               BuildConfig(graph=graph, new_tokens=24), progress=False)
        return made[name, graph]

    return get


@pytest.mark.parametrize("graph", ["portable", "fused"])
@pytest.mark.parametrize("name", FAMILIES)
def test_family_greedy_equals_transformers(family, artifact, name, graph):
    """Medusa with a depth-3 tree, and plain greedy, on the written graph == transformers' greedy generate, for
    24 tokens past a 12-token prompt (past the 8-position sliding window); the prefill's log-probs match."""
    hf, _ = family(name)
    path = artifact(name, graph)
    m = json.loads((path / "manifest.json").read_text())
    assert m["model"]["architecture"] == hf.config.model_type
    assert sorted(m["model"]["features"]) == sorted(_families()[name][1])
    assert m["validation"]["passed"] and "checksums" in m["validation"]["ran"], m["validation"]
    art = load_artifact(path)
    eng = OrtEngine(art)
    ref = plain_greedy(hf, PROMPT, 24)
    assert len(set(ref)) > 3
    kw = dict(max_new_tokens=24, max_context=256)
    assert generate(eng, PROMPT, art.tree, **kw).tokens == ref
    assert generate(eng, PROMPT, make_tree([], num_heads=4), **kw).tokens == ref
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT])).logits[0].float()
    logp = torch.log_softmax(logits, -1).numpy()
    out = eng.step(np.asarray(PROMPT)[None], np.arange(len(PROMPT))[None], causal_mask(len(PROMPT)), 1.0,
                   KVCache.for_engine(eng, 64).past())
    np.testing.assert_array_equal(out.topk_ids[:, 0], logp.argmax(-1))
    np.testing.assert_allclose(out.topk_logprobs[:, 0], logp.max(-1), atol=1e-4)
    if graph == "portable":
        assert m["trt_readiness"]["passed"], m["trt_readiness"]["errors"]
        from medusa_export.trt.typed import write_typed_graphs

        model = onnx.load(str(path / "model.onnx"), load_external_data=False)
        chains = rmsnorm_chains(model)
        assert len(chains) == (4 if name.startswith("qwen3") else 2) * 2 + 1  # q / k norms: 2 more per layer
        write_typed_graphs(path, {"model": "model.onnx"}, "fp16")  # TensorRT's fp16 graph: every chain in fp32
        typed = onnx.shape_inference.infer_shapes(onnx.load(str(path / "engines/model.fp16.onnx"),
                                                            load_external_data=False)).graph
        types = {v.name: v.type.tensor_type.elem_type for v in [*typed.value_info, *typed.output]}
        assert {types[n.output[0]] for chain in chains for n in chain} == {onnx.TensorProto.FLOAT}


@pytest.mark.parametrize("graph", ["portable", "fused"])
@pytest.mark.parametrize("name", ["mistral-window", "qwen2-window"])
def test_tree_nodes_past_the_window_equal_a_causal_forward(artifact, name, graph):
    """Each tree node sees the past and its ancestors within the window *by position* (past length + depth):
    its outputs equal a causal forward over prompt + its root-to-node path."""
    art = load_artifact(artifact(name, graph))
    eng = OrtEngine(art)
    b = art.tree.buffers()
    cache = KVCache.for_engine(eng, 64)
    n = len(PROMPT)
    out = eng.step(np.asarray(PROMPT)[None], np.arange(n)[None], causal_mask(n), 1.0, cache.past())
    cache.keep(out.new_kv, np.arange(n))
    tokens = np.arange(200, 200 + art.tree.size)
    tree_out = eng.step(tokens[None], (n + b.depth)[None], b.attention_mask, 1.0, cache.past())
    assert b.depth.max() == 3
    for node in range(art.tree.size):
        seq = np.concatenate([PROMPT, tokens[b.attention_mask[node]]])
        full = eng.step(seq[None], np.arange(len(seq))[None], causal_mask(len(seq)), 1.0,
                        KVCache.for_engine(eng, len(seq)).past())
        np.testing.assert_allclose(tree_out.hidden[node], full.hidden[-1], atol=2e-4)
        assert tree_out.topk_ids[node, 0] == full.topk_ids[-1, 0]
