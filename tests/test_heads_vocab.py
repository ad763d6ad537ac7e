"""``--heads-vocab N``: the Medusa heads project onto the top N ids of the draft vocabulary (FR-Spec)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from conftest import make_tiny_medusa, plain_greedy, tiny_loaded
from medusa_export.pipeline import BuildConfig, build_artifact
from medusa_export.export.heads_graph import write_heads_only
from medusa_export.loading.sources import sources_from_model
from medusa_export.loading.draft_vocab import (DRAFT_VOCAB_FILE, DraftVocab, HeadsVocabError, load_draft_vocab,
                                               subset_ids)
from medusa_export.training.draft_vocab import coverage, draft_vocab_json, frequency_order, write_draft_vocab
from medusa_runtime.contract.artifact import load_artifact
from medusa_runtime.engines.ort import OrtEngine
from medusa_runtime.decode.loop import generate
from medusa_runtime.trees.tree import make_tree
from medusa_runtime.trees.treespec import tree_from_spec

TOPK = 10
VOCAB = 503


def _run(path: Path, hidden: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(["medusa_topk_ids"], {"hidden_states": hidden})[0]


def _reference(model, hidden: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """The heads' top-k restricted to ``ids``, from the PyTorch heads (full logits, then a column subset)."""
    with torch.no_grad():
        logits = model.heads(torch.from_numpy(hidden))[..., torch.from_numpy(ids)]  # [K, R, N]
    return ids[torch.topk(logits, TOPK, dim=-1).indices.transpose(0, 1).numpy()]  # [R, K, topk]


# ---- pure logic -----------------------------------------------------------------------------


def test_frequency_order_and_coverage():
    ids, counts = frequency_order([[5, 3, 5, 7], [3, 5, 9, 9]])
    assert ids.tolist() == [5, 3, 9, 7] and counts.tolist() == [3, 2, 2, 1]  # ties: lower id first
    assert coverage(counts, (1, 2, 10)) == {"1": 0.375, "2": 0.625, "10": 1.0}


def test_subset_ids_completes_unseen_ids_and_checks_the_range():
    draft = DraftVocab(np.array([7, 2, 5]), "test")
    assert subset_ids(draft, 2, 10, 2).tolist() == [7, 2]
    assert subset_ids(draft, 6, 10, 2).tolist() == [7, 2, 5, 0, 1, 3]  # unseen ids follow in id order
    assert sorted(subset_ids(draft, 10, 10, 2).tolist()) == list(range(10))
    for n in (1, 11):
        with pytest.raises(HeadsVocabError, match=r"choose 0 \(the full vocabulary of 10\) or a size from 2 .* to 10"):
            subset_ids(draft, n, 10, 2)
    with pytest.raises(HeadsVocabError, match="tiny has none; choose --heads-vocab 0"):
        subset_ids(None, 4, 10, 2, model="tiny")
    with pytest.raises(HeadsVocabError, match="outside"):
        subset_ids(DraftVocab(np.array([3, 12]), "bad"), 2, 10, 2)


def test_draft_vocab_file_round_trip(tmp_path):
    ids, counts = frequency_order([[1, 1, 4, 2]])
    doc = draft_vocab_json(ids, counts, vocab_size=8, source="unit test")
    path = write_draft_vocab(doc, tmp_path)
    data = json.loads(path.read_text())
    assert data["total_tokens"] == 4 and data["ids"] == [1, 2, 4] and data["coverage"]["2048"] == 1.0
    (tmp_path / "heads.safetensors").write_bytes(b"")
    loaded = load_draft_vocab(tmp_path / "heads.safetensors")  # a heads file's folder is searched too
    assert loaded.ids.tolist() == [1, 2, 4] and loaded.source == "unit test"
    assert load_draft_vocab(tmp_path / "nothing") is None and load_draft_vocab(None) is None
    path.write_text('{"format": "other"}')
    with pytest.raises(HeadsVocabError, match="not a draft vocabulary"):
        load_draft_vocab(tmp_path)


def test_shipped_draft_vocab_is_loaded_with_the_embedded_heads():
    """The embedded model's frequency list ships beside its heads (not the model itself: no weights loaded)."""
    from medusa_export.loading.registry import models_dir

    draft = load_draft_vocab(models_dir() / "smollm2-135m")
    data = json.loads((models_dir() / "smollm2-135m" / DRAFT_VOCAB_FILE).read_text())
    assert draft is not None and len(np.unique(draft.ids)) == len(draft.ids) == data["distinct_ids"]
    assert draft.ids.max() < data["vocab_size"] == 49152
    assert 0.9 < data["coverage"]["8192"] <= data["coverage"]["16384"] <= 1.0


# ---- the heads graph ----------------------------------------------------------------------------


@pytest.mark.parametrize("own_projection", [False, True], ids=["shared-lm_head", "own-projection"])
def test_subset_heads_graph_is_the_restricted_top_k(tmp_path, own_projection):
    _, model = make_tiny_medusa(vocab=VOCAB, hidden=64, medusa_heads=3, head_noise=0.3, own_projection=own_projection,
                                seed=3)
    hidden = np.random.default_rng(0).standard_normal((6, 64)).astype(np.float32)
    src = sources_from_model(model)

    def export_heads(name, ids=None):
        (tmp_path / name).mkdir()
        return write_heads_only(tmp_path / name, src, TOPK, ids)

    full = _run(export_heads("full"), hidden)
    ids = np.random.default_rng(1).permutation(VOCAB)[:80].astype(np.int64)
    sub = _run(export_heads("sub", ids), hidden)
    assert sub.shape == full.shape == (6, 3, TOPK) and sub.dtype == np.int64
    assert np.isin(sub, ids).all()
    np.testing.assert_array_equal(sub, _reference(model, hidden, ids))
    assert not np.array_equal(sub, full)  # a random subset misses most of the full top-k
    g = onnx.load(str(tmp_path / "sub" / "heads.onnx"), load_external_data=False)
    assert "Gather" in {n.op_type for n in g.graph.node}
    # When the subset holds the full top-k of every row, nothing changes.
    held = np.unique(np.concatenate([full.ravel(), ids[:20]])).astype(np.int64)
    np.testing.assert_array_equal(_run(export_heads("held", held[::-1].copy()), hidden), full)


# ---- build ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny model whose draft vocabulary comes from its own greedy replies (as the shipped one does)."""
    hf, model = make_tiny_medusa(vocab=VOCAB, hidden=128, intermediate=512, medusa_heads=2, head_noise=0.3, tie=True)
    lm = tiny_loaded(model)
    rng = np.random.default_rng(0)
    replies = [plain_greedy(hf, rng.integers(3, VOCAB, 12).tolist(), 24) for _ in range(4)]
    ids, _ = frequency_order(replies)
    lm.draft_vocab = DraftVocab(ids, "greedy replies of the tiny model (test)")
    return hf, lm


def _build(lm, out, **cfg):
    cfg.setdefault("new_tokens", 16)
    return build_artifact(lm, tree_from_spec("8", num_heads=2), out, BuildConfig(**cfg), progress=False)


@pytest.mark.parametrize("heads_precision", ["auto", "int8"])
def test_subset_artifact_is_lossless_and_records_its_vocab(tiny, tmp_path, heads_precision):
    hf, lm = tiny
    n = 40
    path = _build(lm, tmp_path / "art", heads_vocab=n, heads_precision=heads_precision)
    m = json.loads((path / "manifest.json").read_text())
    hv = m["heads_vocab"]
    assert hv["size"] == n and hv["subset"] and hv["vocab_size"] == VOCAB
    assert hv["draft_vocab_ids"] == len(lm.draft_vocab.ids)
    assert "top 40 ids of the draft vocabulary" in hv["source"] and "greedy replies of the tiny model" in hv["source"]
    assert m["graphs"]["heads"]["outputs"][0]["name"] == "medusa_topk_ids"  # the contract is unchanged
    v = m["validation"]
    assert v["passed"] and all(p["vanilla_identical"] for p in v["prompts"])
    g = onnx.load(str(path / "heads.onnx"))
    ops = {nd.op_type for nd in g.graph.node}
    if heads_precision == "int8":  # the quantizer took the [N, d] matrix
        assert m["flavour"] == "ort-contrib" and m["precision"]["heads"] == "int8"
        nbits = [nd for nd in g.graph.node if nd.op_type == "MatMulNBits"]
        widths = {a.i for nd in nbits for a in nd.attribute if a.name == "N"}
        assert n in widths and VOCAB not in widths
    else:  # portable fp32: still TensorRT-ready
        assert m["flavour"] == "portable" and m["trt_readiness"]["passed"]
        assert "Gemm" in ops
    assert "Gather" in ops
    sub = subset_ids(lm.draft_vocab, n, VOCAB, TOPK)
    art = load_artifact(path, full_verify=True)
    eng = OrtEngine(art)
    hidden = np.random.default_rng(2).standard_normal((3, 128)).astype(np.float32)
    ids = eng.heads(hidden, art.tree.topk)  # the runtime's own call into the heads graph
    assert np.isin(ids, sub).all()
    root = make_tree([], num_heads=2, topk=art.tree.topk)
    rng = np.random.default_rng(5)
    for prompt in (rng.integers(3, VOCAB, 6).tolist(), list(range(40, 90))):
        kw = dict(max_new_tokens=24, max_context=256)
        medusa, plain = generate(eng, prompt, art.tree, **kw), generate(eng, prompt, root, **kw)
        assert medusa.tokens == plain.tokens == plain_greedy(hf, prompt, 24)
        # Every token is accounted to a step (the prefill's, then each tree step's), and the root-only tree
        # emits exactly one per step: 23 steps after the prefill for 24 tokens.
        assert 1 + sum(medusa.step_tokens) == 24 and plain.step_tokens == [1] * 23


def test_default_build_keeps_the_full_vocabulary(tiny_trt_artifact):
    m = json.loads((tiny_trt_artifact / "manifest.json").read_text())
    assert m["heads_vocab"] == {"size": 1001, "vocab_size": 1001, "subset": False, "source": "the full vocabulary"}
    g = onnx.load(str(tiny_trt_artifact / "heads.onnx"), load_external_data=False)
    assert "Gather" not in {n.op_type for n in g.graph.node}


@pytest.mark.parametrize("n, match", [
    (5, r"--heads-vocab 5 is out of range: choose 0 \(the full vocabulary of 503\) or a size from 10"),
    (504, r"--heads-vocab 504 is out of range"),
])
def test_bad_heads_vocab_is_refused_without_output(tiny, tmp_path, n, match):
    _, lm = tiny
    with pytest.raises(HeadsVocabError, match=match):
        _build(lm, tmp_path / "x", heads_vocab=n, validate=False)
    assert not (tmp_path / "x").exists() and not list(tmp_path.iterdir())


def test_missing_draft_vocab_is_refused(tmp_path):
    _, model = make_tiny_medusa(vocab=VOCAB, medusa_heads=2)
    with pytest.raises(HeadsVocabError, match="needs a draft vocabulary .* tiny has none; choose --heads-vocab 0"):
        _build(tiny_loaded(model), tmp_path / "x", heads_vocab=64, validate=False)
    with pytest.raises(HeadsVocabError, match="must be 0 .* or a subset size N > 0, got -1"):
        BuildConfig(heads_vocab=-1)
    assert not list(tmp_path.iterdir())


def test_cli_passes_heads_vocab():
    from medusa_export.cli.main import build_parser

    args = build_parser().parse_args(["build", "--heads-vocab", "8192"])
    assert args.heads_vocab == 8192
    assert build_parser().parse_args(["build"]).heads_vocab == BuildConfig.heads_vocab == 0


@pytest.mark.slow
def test_embedded_model_has_a_draft_vocab(smollm):
    assert smollm.draft_vocab is not None and len(smollm.draft_vocab.ids) > 8192
    assert smollm.draft_vocab.path.endswith(f"smollm2-135m/{DRAFT_VOCAB_FILE}")
