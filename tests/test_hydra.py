"""Path-conditioned (Hydra) heads: module, file format, lossless decoding, training (tiny random models)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from medusa_export.errors import HeadsFormatError
from medusa_export.loading.heads_formats import load_heads
from medusa_export.model.decode import medusa_generate
from medusa_export.model.heads import save_heads
from medusa_export.model.hydra_heads import HydraHeads
from medusa_export.model.medusa import MedusaModel
from medusa_export.training.distill import TrainConfig, heads_loss, train_data, train_heads
from medusa_runtime.trees.dynamic import DynamicTree
from medusa_runtime.trees.tree import greedy_tree, make_tree


@pytest.fixture(scope="module")
def tiny():
    from conftest import make_tiny_medusa

    return make_tiny_medusa(vocab=300, hidden=32, layers=2, heads=4, kv_heads=2, medusa_heads=3, seed=2,
                            head_noise=0.05)


def _hydra(model, noise=0.0, seed=0):
    heads = HydraHeads.from_medusa(model.heads, model.backbone.embed_tokens)
    if noise:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in heads.parameters():
                p.add_(torch.randn(p.shape, generator=g) * noise)
    return heads


def test_hydra_heads_made_from_medusa_heads_compute_the_same(tiny):
    _, model = tiny
    hydra = _hydra(model)
    h = torch.randn(5, 32)
    path = torch.randint(0, 300, (5, 3))
    with torch.no_grad():
        assert torch.allclose(hydra(h, path), model.heads(h), atol=1e-5)
        for k in range(3):
            assert torch.allclose(hydra.level_logits(k, h[:1], path[:, :k + 1]), model.heads(h[:1])[k].expand(5, -1),
                                  atol=1e-5)


def test_head_k_reads_only_the_first_k_plus_1_path_tokens(tiny):
    _, model = tiny
    hydra = _hydra(model, noise=0.1)
    h = torch.randn(4, 32)
    path = torch.randint(0, 300, (4, 3))
    other = path.clone()
    other[:, 2] = (other[:, 2] + 1) % 300
    with torch.no_grad():
        a, b = hydra(h, path), hydra(h, other)
    assert torch.equal(a[:2], b[:2]) and not torch.allclose(a[2], b[2])  # heads 1-2 never see token 3
    other[:, 0] = (other[:, 0] + 1) % 300
    with torch.no_grad():
        assert not torch.allclose(hydra(h, other)[0], a[0])  # head 1 reads the root


def test_hydra_heads_file_round_trip_and_errors(tiny, tmp_path):
    _, model = tiny
    hydra = _hydra(model, noise=0.1)
    save_heads(hydra, tmp_path / "h", extra={"recipe": {"x": 1}})
    back = load_heads(tmp_path / "h", model.backbone.lm_head, model.backbone.embed_tokens)
    assert isinstance(back, HydraHeads) and back.config == hydra.config
    for k, v in hydra.head_state_dict().items():
        assert torch.equal(back.head_state_dict()[k], v), k
    with pytest.raises(HeadsFormatError, match="need the backbone's input embedding"):
        load_heads(tmp_path / "h", model.backbone.lm_head)
    tensors = hydra.head_state_dict()
    tensors["1.0.res.weight"] = tensors["1.0.res.weight"][:, :64]
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "h" / "heads.safetensors"))
    with pytest.raises(HeadsFormatError, match=r"'1.0.res.weight' has shape \(32, 64\), expected \(32, 96\)"):
        load_heads(tmp_path / "h", model.backbone.lm_head, model.backbone.embed_tokens)


PROMPT = [5, 17, 33, 2, 90, 41]


@pytest.mark.parametrize("head_type", ["medusa", "hydra"])
@pytest.mark.parametrize("tree_kind", ["static", "dynamic"])
def test_decoding_is_lossless_for_every_head_type_and_tree_policy(tiny, head_type, tree_kind):
    """Against transformers' plain greedy decoding of the same weights (conftest.plain_greedy: no code of the
    runtime's loop, cache, trees or acceptance), and in fewer steps than the runtime's own plain decoding."""
    from conftest import plain_greedy

    hf, model = tiny
    want = plain_greedy(hf, PROMPT, 30)
    plain = medusa_generate(model, PROMPT, make_tree([], num_heads=3), max_new_tokens=30)
    assert plain.tokens == want
    m = model if head_type == "medusa" else MedusaModel(model.backbone, _hydra(model, noise=0.05)).eval()
    acc = np.array([[0.5, 0.2, 0.1], [0.3, 0.1, 0.05], [0.2, 0.1, 0.05]])
    tree = greedy_tree(12, acc, topk=3) if tree_kind == "static" else DynamicTree(size=12, num_heads=3, topk=3,
                                                                                   width=3)
    out = medusa_generate(m, PROMPT, tree, max_new_tokens=30)
    assert out.tokens == want
    assert len(out.step_tokens) < len(plain.step_tokens)  # the heads guess some tokens right


def test_hydra_training_learns_what_only_the_path_tells(tiny):
    """Replies where each token follows from the one before (r_{i+1} = f(r_i)) and hidden states that are
    noise: a path-conditioned head can learn them from the root, a Medusa head cannot."""
    _, model = tiny
    torch.manual_seed(0)
    replies = []
    for _ in range(12):
        t = [int(torch.randint(0, 30, ()))]
        for _ in range(39):
            t.append((t[-1] * 7 + 3) % 30)
        replies.append(t)
    data = train_data(torch.randn(480, 32), replies, 3)
    lm = model.backbone.lm_head
    cfg = TrainConfig(num_heads=3, epochs=30, batch_tokens=64, lr=3e-2, warmup_steps=2, soft_topk=0)
    hydra = train_heads(data, lm, cfg, progress=False, heads=_hydra(model)).heads
    medusa = train_heads(data, lm, cfg, progress=False).heads
    assert isinstance(hydra, HydraHeads)
    w = lm.weight.detach().to(torch.bfloat16)
    every = data.batch(torch.arange(data.num_tokens))
    with torch.no_grad():
        _, _, hits_h = heads_loss(hydra, w, every)
        _, _, hits_m = heads_loss(medusa, w, every)
    n = every[4].sum(0)
    # The tiny random lm_head (std 0.02) makes confident logits slow to learn: the gap is what counts.
    assert (hits_h / n).min() > 0.25 and (hits_h / n).min() > 3 * (hits_m / n).max()


@pytest.mark.parametrize("head_type", ["medusa", "hydra"])
@pytest.mark.parametrize("tree_kind", ["static", "dynamic"])
def test_simulation_on_the_greedy_reply_matches_the_decode_loop(tiny, head_type, tree_kind):
    """Greedy output = the greedy reply, so any head type and tree policy can be scored offline
    from the reply's hidden states (calibrate), step for step as the runtime decodes."""
    from medusa_export.training.batch_decode import BatchedDecoder
    from medusa_export.training.calibrate import heads_topk, simulate_dynamic, simulate_steps
    from medusa_export.training.features import compute_features
    from medusa_export.training.reply_store import StoredReply

    hf, model = tiny
    m = model if head_type == "medusa" else MedusaModel(model.backbone, _hydra(model, noise=0.05)).eval()
    acc = np.array([[0.5, 0.2, 0.1], [0.3, 0.1, 0.05], [0.2, 0.1, 0.05]])
    tree = greedy_tree(10, acc, topk=3) if tree_kind == "static" else DynamicTree(size=10, num_heads=3, topk=3,
                                                                                   width=2)
    ref = medusa_generate(m, PROMPT, tree, max_new_tokens=25)
    reply = medusa_generate(m, PROMPT, make_tree([], num_heads=3), max_new_tokens=31).tokens
    hidden = compute_features(BatchedDecoder(hf, dtype=torch.float32),
                              [StoredReply("x", np.asarray(PROMPT), np.asarray(reply))]).hidden
    if tree_kind == "static":
        steps = simulate_steps(reply, heads_topk(m.heads, hidden, 3, tokens=reply).numpy(), tree, max_new_tokens=25)
    else:
        steps = simulate_dynamic(m.heads, hidden, reply, tree, max_new_tokens=25)
    assert steps == ref.step_tokens


def test_probability_map_fit_by_hand():
    from medusa_export.training.calibrate import _isotonic, fit_probability_map

    assert _isotonic(np.array([0.1, 0.5, 0.3, 0.9]), np.array([1.0, 1.0, 3.0, 1.0])).tolist() == \
        pytest.approx([0.1, 0.35, 0.35, 0.9])
    tokens = [[1, 2, 3, 4, 5]]
    ids = np.zeros((5, 1, 2), dtype=np.int64)
    ids[:, 0, 0] = [2, 3, 9, 9, 0]  # head 1's first choice right at positions 0 and 1
    ids[:, 0, 1] = [7, 7, 4, 5, 0]  # second choice right at 2 and 3
    lps = np.zeros((5, 1, 2))
    lps[:, 0, 0] = np.log(0.8)
    lps[:, 0, 1] = np.log(0.1)
    m = fit_probability_map(tokens, [ids], [lps], bins=4, lowest=-4.0)
    # two bins used: log 0.1 (2 of 4 right) and log 0.8 (2 of 4 right)
    assert m.logprobs.tolist() == pytest.approx([np.log(0.1), np.log(0.8)])
    assert m.p_right.tolist() == [[0.5, 0.5]]


@pytest.fixture(scope="module")
def attached(tiny, tmp_path_factory):
    """Tiny artifacts written by ``build`` with log-prob Medusa heads and with hydra heads, each with the full
    vocabulary and with a 64-id subset (--heads-vocab 64); the hydra one validated by build's own checks."""
    import dataclasses

    from conftest import tiny_loaded
    from medusa_export.pipeline import BuildConfig, build_artifact
    from medusa_export.loading.accuracies import load_accuracies_doc
    from medusa_export.loading.draft_vocab import DraftVocab
    from medusa_export.training.calibrate import save_accuracies

    _, model = tiny
    root = tmp_path_factory.mktemp("built")
    acc = np.array([[0.5, 0.2, 0.1] + [0.01] * 7, [0.3, 0.1, 0.05] + [0.01] * 7, [0.2, 0.1, 0.05] + [0.01] * 7])
    out = {"_acc": acc, "_heads": {}}
    for kind, heads in (("medusa", model.heads), ("hydra", _hydra(model, noise=0.05))):
        out["_heads"][kind] = heads
        hdir = root / f"{kind}-heads"
        save_heads(heads, hdir)
        save_accuracies(acc, hdir, source="test", positions=1, head_type=kind)
        lm = tiny_loaded(MedusaModel(model.backbone, heads).eval(), max_context=256)
        lm = dataclasses.replace(lm, head_accuracies=acc, accuracies_doc=load_accuracies_doc(hdir),
                                 draft_vocab=DraftVocab(SUBSET, "test"))
        for name, vocab in ((kind, 0), (kind + "-subset", len(SUBSET))):
            cfg = BuildConfig(validate=name == "hydra", heads_vocab=vocab, new_tokens=12)
            out[name] = build_artifact(lm, greedy_tree(8, acc), root / name, cfg, progress=False)
    return out


SUBSET = np.random.default_rng(0).permutation(300)[:64]  # a draft vocabulary's top 64 ids


@pytest.mark.parametrize("head_type", ["medusa", "hydra"])
@pytest.mark.parametrize("tree_spec", ["8", "dynamic:8"])
def test_attached_heads_run_in_onnx_runtime_like_pytorch(tiny, attached, head_type, tree_spec):
    from medusa_runtime.contract.artifact import load_artifact
    from medusa_runtime.engines.ort import OrtEngine
    from medusa_runtime.decode.loop import generate
    from medusa_runtime.trees.treespec import tree_from_spec

    from conftest import plain_greedy

    hf, model = tiny
    art = load_artifact(attached[head_type])
    assert art.head_type == head_type
    engine = OrtEngine(art, threads=1)
    tree = tree_from_spec(tree_spec, num_heads=3, accuracies=art.head_accuracies, topk=art.tree.topk)
    got = generate(engine, PROMPT, tree, max_new_tokens=30)
    plain = generate(engine, PROMPT, make_tree([], num_heads=3, topk=art.tree.topk), max_new_tokens=30)
    assert got.tokens == plain.tokens == plain_greedy(hf, PROMPT, 30)  # lossless, against transformers
    m = model if head_type == "medusa" else MedusaModel(model.backbone, _hydra(model, noise=0.05)).eval()
    ref = medusa_generate(m, PROMPT, tree, max_new_tokens=30)
    assert got.tokens == ref.tokens and got.step_tokens == ref.step_tokens  # the same candidates as PyTorch


@pytest.mark.parametrize("head_type", ["medusa", "hydra"])
def test_heads_on_a_vocabulary_subset_simulate_as_the_artifact_runs_them(tiny, attached, head_type):
    """calibrate --heads-vocab N scores the heads as an artifact built with --heads-vocab N runs them."""
    from medusa_export.training.batch_decode import BatchedDecoder
    from medusa_export.training.calibrate import simulate_dynamic
    from medusa_export.training.features import compute_features
    from medusa_export.training.reply_store import StoredReply
    from medusa_runtime.contract.artifact import load_artifact
    from medusa_runtime.engines.ort import OrtEngine
    from medusa_runtime.decode.loop import generate

    hf, model = tiny
    art = load_artifact(attached[head_type + "-subset"])
    assert art.manifest.heads_vocab.size == 64
    engine = OrtEngine(art, threads=1)
    spec = DynamicTree(size=8, num_heads=3, topk=art.tree.topk)
    got = generate(engine, PROMPT, spec, max_new_tokens=25)
    reply = generate(engine, PROMPT, make_tree([], num_heads=3, topk=10), max_new_tokens=31).tokens
    assert got.tokens == reply[:25]
    heads = model.heads if head_type == "medusa" else _hydra(model, noise=0.05)
    hidden = compute_features(BatchedDecoder(hf, dtype=torch.float32),
                              [StoredReply("x", np.asarray(PROMPT), np.asarray(reply))]).hidden
    steps = simulate_dynamic(heads, hidden, reply, spec, max_new_tokens=25, vocab_ids=SUBSET)
    assert steps == got.step_tokens


def test_session_resolves_per_step_trees_with_the_artifacts_calibration(attached):
    from medusa_runtime.front.session import MedusaSession

    s = MedusaSession(attached["hydra"], threads=1, tree="dynamic:6")
    assert isinstance(s.tree, DynamicTree) and s.tree.size == 6
    s = MedusaSession(attached["hydra"], threads=1, tree="auto:dynamic")
    assert [r.size for r in s.tree_timings][:4] == [1, 2, 3, 4]
    from medusa_runtime.tuning.autotree import pick

    chosen = pick(s.tree_timings).size  # the measured best: per-step trees of that size, or plain decoding
    assert s.tree.size == chosen and isinstance(s.tree, DynamicTree) == (chosen > 1)


def test_build_writes_the_heads_graphs_of_each_head_type(attached):
    """Medusa heads: heads.onnx with ids and log-probabilities; hydra heads: one level graph per head; the
    manifest names them, its heads.type says which, tree.json carries the heads' calibration doc; build's own
    validation ran on the hydra artifact and passed."""
    from medusa_runtime.contract.artifact import load_artifact

    med, hyd = load_artifact(attached["medusa"]), load_artifact(attached["hydra"])
    hyd_path = hyd.path
    med, hyd = med.manifest.to_json(), hyd.manifest.to_json()
    assert med["heads"]["type"] == "medusa" and hyd["heads"]["type"] == "hydra"
    assert [t["name"] for t in med["graphs"]["heads"]["outputs"]] == ["medusa_topk_ids", "medusa_topk_logprobs"]
    assert sorted(k for k in hyd["graphs"] if k != "model") == ["heads_level1", "heads_level2", "heads_level3"]
    assert hyd["files"]["heads_level2"] == "heads_level2.onnx" and "heads" not in hyd["files"]
    assert [t["shape"] for t in hyd["graphs"]["heads_level2"]["inputs"]] == [["H", 32], ["R", 2]]
    assert hyd["validation"]["passed"] is True
    assert json.loads((hyd_path / "tree.json").read_text())["head_type"] == "hydra"
    assert hyd["trt_readiness"]["graphs"].keys() >= {"model", "heads_level1", "heads_level3"}


@pytest.mark.parametrize("head_type", ["medusa", "hydra"])
def test_level_graph_takes_one_hidden_row_or_one_per_path(attached, head_type):
    """The ORT heads equal PyTorch's on the same rows: ids exactly, log-probabilities to fp32 rounding;
    a level graph broadcasts one h_t over the paths or reads one row per path (batched sequences)."""
    from medusa_runtime.contract.artifact import load_artifact
    from medusa_runtime.engines.ort import OrtEngine

    art = load_artifact(attached[head_type])
    engine = OrtEngine(art, threads=1)
    rng = np.random.default_rng(1)
    hidden = rng.standard_normal((2, 32)).astype(np.float32)
    k = art.tree.topk
    if head_type == "medusa":
        ids, lp = engine.heads_logprobs(hidden, k)
        logits = attached_model_logits(attached, head_type, torch.from_numpy(hidden))  # [K, 2, V]
        ref = torch.log_softmax(logits, -1).topk(k, dim=-1)
        assert ids.tolist() == ref.indices.transpose(0, 1).tolist()
        np.testing.assert_allclose(lp, ref.values.transpose(0, 1).numpy(), atol=1e-5)
        return
    paths = np.array([[5, 9], [5, 17], [250, 3]])
    one, one_lp = engine.heads_level(2, hidden[:1], paths, k)
    per, per_lp = engine.heads_level(2, np.repeat(hidden[:1], 3, axis=0), paths, k)
    assert one.tolist() == per.tolist() and np.array_equal(one_lp, per_lp)
    logits = attached_model_logits(attached, head_type, torch.from_numpy(hidden[:1]).expand(3, -1),
                                   torch.from_numpy(paths), depth=2)
    ref = torch.log_softmax(logits, -1).topk(k, dim=-1)
    assert one.tolist() == ref.indices.tolist()
    np.testing.assert_allclose(one_lp, ref.values.numpy(), atol=1e-5)


def attached_model_logits(attached, head_type, hidden, paths=None, depth=0):
    """PyTorch logits of the heads the ``attached`` artifacts were built from (kept beside them)."""
    heads = attached["_heads"][head_type]
    with torch.no_grad():
        if paths is None:
            return heads(hidden)
        return heads.level_logits(depth - 1, hidden, paths)


def test_build_records_per_step_trees_and_the_session_runs_them(tiny, attached, tmp_path):
    """build --tree dynamic:T: the static tree is the T-node greedy tree, the policy is in the manifest and
    tree.json, and a session on the artifact runs per-step trees by default (tokens = plain greedy)."""
    import dataclasses

    from conftest import tiny_loaded
    from medusa_export.pipeline import BuildConfig, build_artifact
    from medusa_runtime.front.session import MedusaSession

    from conftest import plain_greedy

    hf, model = tiny
    acc = attached["_acc"]
    lm = dataclasses.replace(tiny_loaded(MedusaModel(model.backbone, attached["_heads"]["hydra"]).eval(),
                                         max_context=256), head_accuracies=acc)
    path = build_artifact(lm, greedy_tree(6, acc), tmp_path / "dyn", BuildConfig(validate=False), progress=False,
                          tree_policy="dynamic")
    m = json.loads((path / "manifest.json").read_text())
    assert m["tree"]["policy"] == "dynamic:6" and m["tree"]["size"] == 6
    s = MedusaSession(path, threads=1)
    assert isinstance(s.tree, DynamicTree) and s.tree.size == 6
    plain = MedusaSession(path, threads=1, tree="root")
    got = s.generate(prompt_ids=PROMPT, max_new_tokens=20)
    want = plain_greedy(hf, PROMPT, 20)  # transformers' plain greedy decoding: no code of the runtime
    assert got.token_ids == plain.generate(prompt_ids=PROMPT, max_new_tokens=20).token_ids == want
    assert max(got.result.step_tokens) > 1  # the heads' candidates were accepted at some step


def test_cli_build_of_hydra_heads_with_per_step_trees(tiny, tmp_path):
    """``medusa-export build --heads HYDRA_DIR --tree dynamic:4`` from a model folder: the hydra heads are opened
    as sources (heads.json's counts, shapes checked), written as level graphs, validated against the PyTorch
    reference, and the artifact runs per-step trees by default."""
    import contextlib
    import io

    from conftest import save_tiny_hf_dir
    from medusa_export.cli.main import main
    from medusa_runtime.front.session import MedusaSession

    _, model = tiny
    save_tiny_hf_dir(tmp_path / "model", vocab=300, hidden=32, layers=2, heads=4, kv_heads=2, medusa_heads=3, seed=2,
                     head_noise=0.05)
    save_heads(_hydra(model, noise=0.05), tmp_path / "heads")
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["build", "--model", str(tmp_path / "model"), "--heads", str(tmp_path / "heads"), "--tree",
                     "dynamic:4", "--max-context", "256", "--max-new-tokens", "8", "--out", str(tmp_path / "a")]) == 0
    m = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert m["heads"]["type"] == "hydra" and m["tree"]["policy"] == "dynamic:4" and m["validation"]["passed"]
    s = MedusaSession(tmp_path / "a", threads=1)
    assert isinstance(s.tree, DynamicTree) and s.tree.size == 4


def test_triton_repository_of_hydra_heads_serves_each_level_graph(attached, tmp_path):
    """The Triton repository's engine models: NAME_step and one NAME_heads_level{j} per level, each the artifact's
    graph with its manifest inputs and outputs."""
    from medusa_export.triton.repository import TritonConfig, write_repository

    repo = write_repository(attached["hydra"], tmp_path / "repo", TritonConfig(threads=1, artifact_mode="link"))
    assert sorted(p.name for p in repo.iterdir() if p.is_dir()) == [
        "medusa", "medusa_heads_level1", "medusa_heads_level2", "medusa_heads_level3", "medusa_step"]
    text = (repo / "medusa_heads_level2" / "config.pbtxt").read_text()
    assert 'name: "path_ids"' in text and 'name: "level_topk_logprobs"' in text
    assert (repo / "medusa_heads_level2" / "1" / "model.onnx").read_bytes() == \
        (attached["hydra"] / "heads_level2.onnx").read_bytes()


def test_build_auto_dynamic_records_the_chosen_per_step_size(attached, tiny, tmp_path):
    """build --tree auto:dynamic: per-step trees of each size timed on the built artifact; the chosen size is the
    static tree's and the policy's (or plain decoding, then no policy)."""
    import dataclasses

    from conftest import tiny_loaded
    from medusa_export.pipeline import BuildConfig, build_artifact
    from medusa_runtime.tuning.autotree import DEFAULT_SIZES

    from conftest import plain_greedy

    hf, model = tiny
    acc = attached["_acc"]
    lm = dataclasses.replace(tiny_loaded(model, max_context=256), head_accuracies=acc)
    path = build_artifact(lm, greedy_tree(max(DEFAULT_SIZES), acc), tmp_path / "auto", BuildConfig(validate=False),
                          progress=False, auto_tree=True, tree_policy="dynamic")
    tree = json.loads((path / "manifest.json").read_text())["tree"]
    assert tree["selection"]["chosen"] == tree["size"]
    assert tree.get("policy") == (f"dynamic:{tree['size']}" if tree["size"] > 1 else None)
    assert json.loads((path / "tree.json").read_text()).get("policy") == tree.get("policy")
