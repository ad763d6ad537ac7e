"""Head training, calibration and accuracy-based trees on tiny random models (fast)."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch

from medusa_export.loading.accuracies import load_accuracies
from medusa_export.loading.heads_formats import load_heads
from medusa_export.model.heads import save_heads
from medusa_export.training.calibrate import (accuracy_counts, calibrate, heads_topk, pooled_accuracies,
                                              save_accuracies, simulate_steps)
from medusa_export.training.distill import (Generator, Prompt, TrainConfig, build_train_data, future_index,
                                            generate_batch, generate_replies, load_hidden, load_prompts, medusa_loss,
                                            read_replies, select_prompts, train_heads)
from medusa_runtime.tree import expected_accept_length, greedy_tree, make_tree

from conftest import make_tiny_tokenizer


@pytest.fixture(scope="module")
def tiny():
    """(hf_model, MedusaModel, tokenizer) with ids below the tokenizer's vocab."""
    from conftest import make_tiny_medusa

    hf, model = make_tiny_medusa(vocab=300, hidden=32, layers=2, heads=4, kv_heads=2, medusa_heads=3, seed=1)
    return hf, model, make_tiny_tokenizer(300)


@pytest.fixture(scope="module")
def tiny_gen(tiny):
    hf, _, tok = tiny
    return Generator(hf, tok, tok.chat_template, [tok.eos_token_id], tok.eos_token_id, "random (test)")


PROMPTS = [Prompt(f"t/{i}", "t", ({"role": "user", "content": text},)) for i, text in enumerate(
    ["Write a poem about the sea.", "What is 2 + 2?", "Explain gravity to a child in a few words please.",
     "List three colors.", "Tell me a joke", "Translate 'hello' to French."])]


def test_load_prompts_reads_every_format(tmp_path):
    recs = [
        {"source": "mix", "id": 1, "messages": [{"role": "user", "content": "a\u2028b"}]},
        {"question_id": 81, "turns": ["first", "second"]},
        {"id": "k", "prompt": "koala"},
        {"id": "s", "instruction": "Do it.", "instances": [{"input": "x", "output": "y"}]},
        {"input": "### Human: hi ### Assistant: hello ### Human: again ### Assistant:"},
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},  # ends with reply
    ]
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in recs) + "\n")
    ps = load_prompts(f)
    assert [p.messages[-1]["content"] for p in ps] == ["a\u2028b", "first", "koala", "Do it.\n\nx", "again"]
    assert [m["role"] for m in ps[-1].messages] == ["user", "assistant", "user"]
    assert ps[0].source == "mix" and ps[1].source == "p"
    train, held = select_prompts(ps, caps={"p": 2}, seed=0, holdout=1)
    assert len(train) + len(held) == 3 and len({p.id for p in train + held}) == 3


def test_future_index_stays_inside_each_reply():
    idx, valid = future_index([3, 2], 2)
    assert valid.tolist() == [[True, True], [True, False], [False, False], [True, False], [False, False]]
    assert idx[valid].tolist() == [1, 2, 2, 4]


def test_generated_hidden_states_are_aligned_and_match_plain_greedy(tiny, tiny_gen):
    hf, model, tok = tiny
    ids = [tok.apply_chat_template([dict(m) for m in p.messages], add_generation_prompt=True) for p in PROMPTS[:3]]
    out = generate_batch(hf, tok, ids, max_new_tokens=12, eos_token_ids=[], pad_token_id=tok.eos_token_id)
    for prompt, (toks, hidden) in zip(ids, out):
        assert len(toks) == hidden.shape[0] == 12
        # hidden[i] predicts r_i through the backbone's own lm_head
        assert (hf.lm_head(hidden.float()).argmax(-1).tolist()) == toks
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
        assert toks == ref


def test_generate_replies_resumes_from_its_cache(tiny_gen, tmp_path):
    g = tiny_gen
    kw = dict(batch_size=2, max_new_tokens=6, eos_token_ids=[], pad_token_id=g.pad_token_id, progress=False)
    first = generate_replies(g.hf_model, g.tokenizer, g.chat_template, PROMPTS[:3], tmp_path, **kw)
    assert len(first) == 3 and len(list(tmp_path.glob("shard-*"))) == 2
    again = generate_replies(g.hf_model, g.tokenizer, g.chat_template, PROMPTS[:4], tmp_path, **kw)
    assert len(again) == 4 and len(list(tmp_path.glob("shard-*"))) == 3  # only the new prompt ran
    cached = read_replies(tmp_path)
    assert [r.tokens for r in cached] == [r.tokens for r in again]
    assert [h.shape[0] for h in load_hidden(tmp_path, cached)] == [6, 6, 6, 6]


def test_generate_replies_in_parts_fill_one_cache(tiny_gen, tmp_path):
    g = tiny_gen
    kw = dict(batch_size=2, max_new_tokens=6, eos_token_ids=[], pad_token_id=g.pad_token_id, progress=False)
    whole = generate_replies(g.hf_model, g.tokenizer, g.chat_template, PROMPTS[:5], tmp_path / "whole", **kw)
    for i in (0, 1):  # what two side-by-side processes do
        generate_replies(g.hf_model, g.tokenizer, g.chat_template, PROMPTS[:5], tmp_path / "parts", part=(i, 2), **kw)
    parts = read_replies(tmp_path / "parts")
    assert sorted(r.id for r in parts) == sorted(r.id for r in whole)  # every prompt exactly once
    assert {r.id: r.tokens for r in parts} == {r.id: r.tokens for r in whole}
    assert sorted(p.name for p in (tmp_path / "parts").glob("shard-*")) == [
        "shard-p0of2-00000.safetensors", "shard-p0of2-00001.safetensors", "shard-p1of2-00000.safetensors"]
    with pytest.raises(ValueError, match="0 <= i < n"):
        generate_replies(g.hf_model, g.tokenizer, g.chat_template, PROMPTS[:5], tmp_path / "bad", part=(2, 2), **kw)


def test_sampled_replies_are_extra_variants_seeded_and_resumable(tiny_gen, tmp_path):
    g = tiny_gen
    kw = dict(batch_size=2, max_new_tokens=8, eos_token_ids=[], pad_token_id=g.pad_token_id, progress=False)
    greedy = {r.id: r.tokens for r in generate_replies(g.hf_model, g.tokenizer, g.chat_template, PROMPTS[:3],
                                                         tmp_path / "greedy", **kw)}
    run = lambda d: generate_replies(g.hf_model, g.tokenizer, g.chat_template, PROMPTS[:3], d,  # noqa: E731
                                     samples=3, temperature=1.5, seed=7, **kw)
    a, b = run(tmp_path / "a"), run(tmp_path / "b")
    ids = sorted(r.id for r in a)
    assert ids == sorted(f"t/{i}{s}" for i in range(3) for s in ("", "~s1", "~s2"))
    by_id = {r.id: r.tokens for r in a}
    assert {i: by_id[i] for i in greedy} == greedy  # variant 0 is the greedy reply
    assert {r.id: r.tokens for r in b} == by_id  # same seed, same samples
    assert any(by_id[f"t/{i}~s1"] != greedy[f"t/{i}"] for i in range(3))  # sampling at T=1.5 leaves greedy
    assert len(list((tmp_path / "a").glob("shard-*"))) == 6  # one pass per variant, 2 batches each
    again = run(tmp_path / "a")  # everything cached: nothing new runs
    assert len(again) == 9 and len(list((tmp_path / "a").glob("shard-*"))) == 6
    hid = load_hidden(tmp_path / "a", again)
    for r, h in zip(again, hid):
        assert h.shape == (8, 32)
        if "~s" not in r.id:  # greedy: hidden[i] is the state whose argmax is r_i
            assert g.hf_model.lm_head(h.float()).argmax(-1).tolist() == r.tokens
    with pytest.raises(ValueError, match="samples must be at least 1"):
        generate_replies(g.hf_model, g.tokenizer, g.chat_template, PROMPTS[:3], tmp_path / "bad", samples=0, **kw)


def test_train_heads_refuses_a_device_it_cannot_see():
    from medusa_export.cli.heads import check_device
    from medusa_export.errors import MedusaError

    assert check_device("cpu") == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises(MedusaError, match="sees 0 CUDA device"):
            check_device("cuda")
    with pytest.raises(MedusaError, match="cpu, cuda or cuda:N"):
        check_device("gpu")


def _tiny_data(gen, tmp_path, soft_topk=0):
    reps = generate_replies(gen.hf_model, gen.tokenizer, gen.chat_template, PROMPTS, tmp_path, batch_size=3,
                            max_new_tokens=24, eos_token_ids=[], pad_token_id=gen.pad_token_id, progress=False)
    hid = load_hidden(tmp_path, reps)
    return build_train_data([r.tokens for r in reps], hid, 3, lm_weight=gen.lm_head.weight, soft_topk=soft_topk)


@pytest.mark.parametrize("soft_topk", [0, 8])
def test_a_few_training_steps_lower_the_loss(tiny_gen, tmp_path, soft_topk):
    data = _tiny_data(tiny_gen, tmp_path, soft_topk)
    w = tiny_gen.lm_head.weight.detach().to(torch.bfloat16)
    cfg = TrainConfig(num_heads=3, num_layers=1, epochs=10, batch_tokens=32, lr=1e-2, warmup_steps=2,
                      soft_topk=soft_topk)
    res = train_heads(data, tiny_gen.lm_head, cfg, progress=False)
    with torch.no_grad():
        from medusa_export.model.heads import HeadsConfig, MedusaHeads

        fresh = MedusaHeads(HeadsConfig(3, 1, 32, 300, False), tiny_gen.lm_head)
        before, _, _ = medusa_loss(fresh, w, data.hidden, data.target_ids, data.target_p, data.valid)
        after, _, _ = medusa_loss(res.heads, w, data.hidden, data.target_ids, data.target_p, data.valid)
    assert res.steps > 10
    # soft targets cannot go below the teacher's entropy (high for a random model): absolute drop
    assert float(before) - float(after) > 0.2


def test_training_resumes_from_its_checkpoint(tiny_gen, tmp_path):
    data = _tiny_data(tiny_gen, tmp_path / "c")
    cfg = TrainConfig(num_heads=3, epochs=2, batch_tokens=32, lr=1e-2, warmup_steps=2, soft_topk=0)
    ckpt = tmp_path / "ckpt.pt"
    full = train_heads(data, tiny_gen.lm_head, cfg, progress=False, checkpoint=ckpt)
    again = train_heads(data, tiny_gen.lm_head, cfg, progress=False, checkpoint=ckpt)  # already finished
    for (k, a), (_, b) in zip(full.heads.state_dict().items(), again.heads.state_dict().items()):
        assert torch.equal(a, b), k


def test_saved_heads_reload_exactly(tiny_gen, tmp_path):
    data = _tiny_data(tiny_gen, tmp_path / "c")
    cfg = TrainConfig(num_heads=3, num_layers=2, epochs=1, batch_tokens=32, lr=1e-2, warmup_steps=2, soft_topk=0)
    heads = train_heads(data, tiny_gen.lm_head, cfg, progress=False).heads
    save_heads(heads, tmp_path / "h", extra={"recipe": {"epochs": 1}})
    back = load_heads(tmp_path / "h", tiny_gen.lm_head)
    assert back.config == heads.config
    saved, loaded = heads.head_state_dict(), back.head_state_dict()
    assert saved.keys() == loaded.keys() and not any(k.endswith(f"{2}.weight") and "linear" not in k for k in saved)
    for k in saved:
        assert torch.equal(saved[k], loaded[k]), k
    assert json.loads((tmp_path / "h" / "heads.json").read_text())["recipe"] == {"epochs": 1}


def _connected_trees(nodes, size):
    for subset in itertools.combinations(nodes, size):
        s = set(subset)
        if all(len(p) == 1 or p[:-1] in s for p in subset):
            yield subset


@pytest.mark.parametrize("seed", range(5))
def test_greedy_tree_is_optimal_on_small_cases(seed):
    rng = np.random.default_rng(seed)
    acc = rng.dirichlet(np.ones(3), size=2)[:, :2]  # 2 heads, top-2, rows sum < 1
    nodes = [(0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1)]
    for budget in (2, 3, 4, 5):
        best = max(expected_accept_length(make_tree(t, num_heads=2, topk=2), acc)
                   for t in _connected_trees(nodes, budget - 1))
        got = greedy_tree(budget, acc)
        assert got.size == budget
        assert expected_accept_length(got, acc) == pytest.approx(best, abs=1e-12)


def test_greedy_tree_hand_checked_case():
    acc = np.array([[0.5, 0.3], [0.4, 0.1]])
    # candidates: [0] .5, [1] .3, [0,0] .2, [0,1] .05, [1,0] .12, [1,1] .03
    tree = greedy_tree(4, acc)
    assert tree.choices == ((0,), (1,), (0, 0))
    assert expected_accept_length(tree, acc) == pytest.approx(1 + 0.5 + 0.3 + 0.2)


def test_accuracies_are_probabilities_and_round_trip(tiny, tiny_gen, tmp_path):
    _, model, _ = tiny
    res = calibrate(tiny_gen, model.heads, PROMPTS, tmp_path, max_new_tokens=16, batch_size=4, topk=5,
                    progress=False)
    acc = res.accuracies
    assert acc.shape == (3, 5)
    assert (acc >= 0).all() and (acc <= 1).all() and (acc.sum(1) <= 1 + 1e-9).all()
    save_accuracies(acc, tmp_path / "h", source="test", positions=res.positions)
    assert np.allclose(load_accuracies(tmp_path / "h"), acc, atol=1e-6)
    assert load_accuracies(tmp_path / "nothing") is None


def test_accuracy_counts_by_hand():
    tokens = [5, 6, 7, 8]
    topk = np.zeros((4, 2, 2), dtype=np.int64)
    topk[:, 0] = [[6, 1], [7, 1], [1, 8], [0, 0]]  # head 1: right at 0 and 1 (top-1), at 2 (top-2)
    topk[:, 1] = [[7, 0], [0, 8], [0, 0], [0, 0]]  # head 2: right at 0 (top-1), 1 (top-2)
    hits, count = accuracy_counts(tokens, topk)
    assert hits.tolist() == [[2, 1], [1, 1]] and count.tolist() == [3, 2]
    assert np.allclose(pooled_accuracies([tokens], [topk]), [[2 / 3, 1 / 3], [0.5, 0.5]])


def test_simulated_acceptance_matches_the_decode_loop(tiny, tiny_gen):
    """Greedy Medusa output = the greedy reply, so acceptance can be simulated from it."""
    from medusa_export.model.decode import medusa_generate

    hf, model, tok = tiny
    with torch.no_grad():  # heads that often guess right: copy the backbone's future argmax a bit
        for p in model.heads.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    tree = greedy_tree(12, np.array([[0.5, 0.2, 0.1], [0.3, 0.1, 0.05], [0.2, 0.1, 0.05]]))
    for p in PROMPTS[:3]:
        ids = tok.apply_chat_template([dict(m) for m in p.messages], add_generation_prompt=True)
        ref = medusa_generate(model, ids, tree, max_new_tokens=20, eos_token_ids=[])
        (toks, hidden), = generate_batch(hf, tok, [ids], max_new_tokens=25, eos_token_ids=[], pad_token_id=0)
        assert toks[:20] == ref.tokens
        steps = simulate_steps(toks, heads_topk(model.heads, hidden.float(), tree.topk).numpy(), tree,
                               max_new_tokens=20)
        assert steps == ref.step_tokens


# --- every family and layout: the generator, train-heads and calibrate ------------------------------------


LAYOUTS = {  # name -> (writer, family): what train-heads / calibrate read for each
    "llama3": ("family", "llama3"), "mistral": ("family", "mistral"), "qwen2": ("family", "qwen2"),
    "qwen3": ("family", "qwen3"), "medusa-1.0": ("medusa-1.0", "mistral"), "modelopt-fp8": ("fp8", "llama3"),
}


def _write_layout(path, layout):
    from checkpoints import save_family_dir, write_medusa_1_0, write_modelopt_fp8

    writer, family = LAYOUTS[layout]
    if writer == "family":
        return save_family_dir(path, family)
    if writer == "medusa-1.0":
        return write_medusa_1_0(path, family, fmt="safetensors")[0]
    return write_modelopt_fp8(path, family)[0]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_generator_of_every_layout_equals_transformers_greedy(tmp_path, layout):
    """The generator is the family's transformers model on the strictly loaded tensors: its batched,
    left-padded replies equal plain greedy decoding of the original model, past the window of 8."""
    from conftest import plain_greedy
    from medusa_export.training.distill import load_generator

    hf = _write_layout(tmp_path, layout)
    gen = load_generator(str(tmp_path))
    assert type(gen.hf_model) is type(hf)
    prompts = [[5, 17, 42, 7, 99, 3], [8, 1, 2, 250, 12, 64, 9, 9, 31, 4, 77]]  # different lengths: left padding
    out = generate_batch(gen.hf_model, gen.tokenizer, prompts, max_new_tokens=14, eos_token_ids=[],
                         pad_token_id=gen.pad_token_id)
    for p, (toks, hidden) in zip(prompts, out):
        assert toks == plain_greedy(hf, p, 14)
        assert hidden.shape == (14, 64)


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    f = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    f.write_text("\n".join(json.dumps({"id": i, "prompt": p.messages[0]["content"]}) for i, p in enumerate(PROMPTS)))
    return f


@pytest.mark.parametrize("layout", ["llama3", "mistral", "qwen2", "qwen3", "medusa-1.0", "modelopt-fp8"])
def test_train_heads_and_calibrate_on_every_layout(tmp_path, prompt_file, layout, capsys):
    from medusa_export.cli.main import main
    from medusa_export.loading.registry import load_model

    _write_layout(tmp_path / "model", layout)
    model, out, cache = str(tmp_path / "model"), tmp_path / "heads", str(tmp_path / "cache")
    assert main(["train-heads", "--model", model, "--data", str(prompt_file), "--holdout", "2", "--out", str(out),
                 "--cache", cache, "--max-new-tokens", "12", "--batch-size", "4", "--num-heads", "2",
                 "--epochs", "3", "--batch-tokens", "16", "--soft-topk", "4"]) == 0
    meta = json.loads((out / "heads.json").read_text())
    assert (meta["num_heads"], meta["own_projection"]) == (2, False) and meta["recipe"]["train_prompts"] == 4
    assert load_accuracies(out).shape == (2, 10)  # from the held-out replies
    lm = load_model(model, heads_path=str(out))
    assert lm.model.num_heads == 2
    assert main(["calibrate", "--model", model, "--heads", str(out), "--data", str(prompt_file), "--cache", cache,
                 "--max-new-tokens", "12", "--budgets", "4"]) == 0
    assert "top-1 accuracy per head" in capsys.readouterr().out
    acc = load_accuracies(out)
    assert acc.shape == (2, 10) and np.all(acc >= 0) and np.all(acc.sum(1) <= 1 + 1e-9)


def test_calibrate_reads_heads_stored_in_the_checkpoint(tmp_path, prompt_file, capsys):
    """A medusa-1.0 folder's own heads are calibrated without --heads; accuracies.json goes beside them."""
    from medusa_export.cli.main import main

    _write_layout(tmp_path / "m", "medusa-1.0")
    assert main(["calibrate", "--model", str(tmp_path / "m"), "--data", str(prompt_file), "--cache",
                 str(tmp_path / "c"), "--max-new-tokens", "10", "--limit", "3", "--budgets", "4"]) == 0
    assert load_accuracies(tmp_path / "m").shape == (3, 10)
