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
from medusa_export.errors import MedusaError
from medusa_export.training.batch_decode import BatchedDecoder, DecodeRequest
from medusa_export.training.distill import (Generator, Prompt, TrainConfig, future_index, heads_loss, load_prompts,
                                            restrict_targets, select_prompts, train_data, train_heads, vocab_remap)
from medusa_export.training.features import cached_features, compute_features, length_batches
from medusa_export.training.replies import decode_requests, generate_to_store
from medusa_export.training.reply_store import ReplyStore, StoredReply
from medusa_runtime.trees.tree import expected_accept_length, greedy_tree, make_tree

from conftest import FAMILIES as FAMILY_FIXTURES
from conftest import make_family_hf, make_tiny_tokenizer


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


def _prompt_ids(tok, prompts=PROMPTS):
    return [tok.apply_chat_template([dict(m) for m in p.messages], add_generation_prompt=True) for p in prompts]


def _decode(hf, prompts, *, batch_size, max_new_tokens, eos, temperature=0.0, dtype=torch.float32):
    dec = BatchedDecoder(hf, batch_size=batch_size, capacity=128, dtype=dtype)
    got = {}
    reqs = [DecodeRequest(f"r{i}", tuple(p), temperature, seed=3) for i, p in enumerate(prompts)]
    dec.run(reqs, max_new_tokens=max_new_tokens, eos_token_ids=eos, on_reply=lambda r, t: got.__setitem__(r.id, t))
    return [got[f"r{i}"] for i in range(len(prompts))]


def test_batched_decoder_equals_transformers_greedy_with_refills_and_eos(tiny):
    hf, _, tok = tiny
    prompts = _prompt_ids(tok)
    free = _decode(hf, prompts, batch_size=6, max_new_tokens=12, eos=[])
    eos = free[0][5]  # a token the first reply writes mid-way: that reply must stop there, EOS included
    got = _decode(hf, prompts, batch_size=2, max_new_tokens=12, eos=[eos])  # 6 prompts through 2 rows
    assert got[0] == free[0][:free[0].index(eos) + 1]
    for p, toks in zip(prompts, got):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=eos,
                          pad_token_id=0)[0, len(p):].tolist()
        assert toks == ref


@pytest.mark.parametrize("family", sorted(FAMILY_FIXTURES))
def test_batched_decoder_equals_transformers_greedy_in_every_family(family):
    """Every family fixture (biases incl. MLP biases, q/k norms, sliding windows shorter than the reply, RoPE
    scaling) decodes as transformers' own ``generate``: the decoder reads its switches and windows from the
    family table (issue 38), so a switch the table names but the decoder ignores fails here."""
    hf = make_family_hf(family)
    prompts = [[5, 17, 42, 7, 99, 3, 11, 250, 8, 64, 12], [1, 2, 3]]  # the first longer than the 8-token windows
    got = _decode(hf, prompts, batch_size=2, max_new_tokens=14, eos=[])
    for p, toks in zip(prompts, got):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=14, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
        assert toks == ref, family


def test_sampled_replies_are_seeded_per_reply_not_per_batch(tiny):
    hf, _, tok = tiny
    prompts = _prompt_ids(tok)
    a = _decode(hf, prompts, batch_size=2, max_new_tokens=10, eos=[], temperature=1.5)
    b = _decode(hf, prompts, batch_size=3, max_new_tokens=10, eos=[], temperature=1.5)
    greedy = _decode(hf, prompts, batch_size=3, max_new_tokens=10, eos=[])
    assert a == b
    assert a != greedy


def test_reply_store_round_trip_resume_and_parts(tiny_gen, tmp_path):
    g = tiny_gen
    dec = BatchedDecoder(g.hf_model, batch_size=2, capacity=128, dtype=torch.float32)
    store = ReplyStore(tmp_path / "s", vocab_size=300, meta={"max_new_tokens": 6})
    kw = dict(max_new_tokens=6, eos_token_ids=[], progress=False, flush_replies=2)
    reqs = decode_requests(g.tokenizer, g.chat_template, PROMPTS[:3], samples=2, temperature=1.0)
    assert [r.id for r in reqs] == ["t/0", "t/1", "t/2", "t/0~s1", "t/1~s1", "t/2~s1"]
    assert [r.temperature for r in reqs] == [0.0] * 3 + [1.0] * 3
    stats = generate_to_store(dec, reqs[:4], store, **kw)
    assert stats["replies"] == 4 and stats["tokens"] == 24 and len(store.chunks()) == 2
    again = decode_requests(g.tokenizer, g.chat_template, PROMPTS[:3], samples=2, temperature=1.0, have=store.ids())
    assert [r.id for r in again] == ["t/1~s1", "t/2~s1"]  # a restart asks only for what is missing
    generate_to_store(dec, again, store, **kw)
    reps = store.read()
    assert sorted(r.id for r in reps) == sorted(r.id for r in reqs)
    assert all(r.reply.dtype == np.uint16 and len(r.reply) == 6 for r in reps)
    by_id = {r.id: r for r in reps}
    assert list(by_id["t/0"].prompt) == _prompt_ids(g.tokenizer, PROMPTS[:1])[0]
    assert by_id["t/0~s1"].temperature == 1.0 and by_id["t/0"].temperature == 0.0
    with pytest.raises(MedusaError, match="max_new_tokens 6 there, 7 now"):
        ReplyStore(tmp_path / "s", vocab_size=300, meta={"max_new_tokens": 7})
    for i in (0, 1):  # two processes filling one store
        part = ReplyStore(tmp_path / "p", vocab_size=300, part=f"p{i}of2")
        generate_to_store(dec, decode_requests(g.tokenizer, g.chat_template, PROMPTS[:5], part=(i, 2)), part, **kw)
    assert sorted(r.id for r in ReplyStore(tmp_path / "p", vocab_size=300).read()) == [f"t/{i}" for i in range(5)]
    with pytest.raises(ValueError, match="0 <= i < n"):
        decode_requests(g.tokenizer, g.chat_template, PROMPTS, part=(2, 2))


def _stored_replies(tiny, folder, max_new_tokens):
    """(fp32 decoder, greedy replies to PROMPTS stored in ``folder``)."""
    hf, _, tok = tiny
    dec = BatchedDecoder(hf, batch_size=3, capacity=128, dtype=torch.float32)
    store = ReplyStore(folder, vocab_size=300)
    generate_to_store(dec, decode_requests(tok, tok.chat_template, PROMPTS), store, max_new_tokens=max_new_tokens,
                      eos_token_ids=[], progress=False)
    return dec, store.read()


def test_recomputed_features_are_the_backbones_hidden_states_and_top_k(tiny, tmp_path):
    hf = tiny[0]
    dec, reps = _stored_replies(tiny, tmp_path / "s", 9)
    feats = compute_features(dec, reps, soft_topk=4, batch_tokens=40)  # several batches of unequal length
    assert feats.lengths == [9] * len(reps) and feats.hidden.shape == (9 * len(reps), 32)
    for j, r in enumerate(reps):
        ids = torch.tensor([r.prompt.tolist() + r.reply[:-1].tolist()])
        with torch.no_grad():
            ref = hf.model(ids).last_hidden_state[0, len(r.prompt) - 1:]  # [9, d]
            logits = hf.lm_head(ref)
        h = feats.hidden[9 * j:9 * (j + 1)]
        assert torch.allclose(h, ref, atol=1e-5)
        assert logits.argmax(-1).tolist() == r.reply.tolist()  # greedy: hidden[i] predicts r_i
        top = torch.softmax(logits, -1).topk(4)
        assert torch.equal(feats.teacher_ids[9 * j:9 * (j + 1)], top.indices)
        assert torch.allclose(feats.teacher_p[9 * j:9 * (j + 1)], top.values / top.values.sum(-1, keepdim=True),
                              atol=1e-5)
    cached = cached_features(dec, reps, tmp_path / "f", soft_topk=4)
    assert len(list((tmp_path / "f").glob("features-*.safetensors"))) == 1
    again = cached_features(dec, reps, tmp_path / "f", soft_topk=4)
    assert torch.equal(cached.hidden, again.hidden) and torch.equal(cached.teacher_ids, again.teacher_ids)


def test_length_batches_cover_every_index_within_the_budget():
    lengths = [5, 1, 9, 3, 30, 2]
    batches = length_batches(lengths, 10)
    assert sorted(i for b in batches for i in b) == list(range(6))
    assert all(len(b) * max(lengths[i] for i in b) <= 10 or len(b) == 1 for b in batches)


def test_train_data_batch_gives_paths_and_targets_by_hand():
    replies = [[10, 11, 12, 13], [20, 21]]
    hidden = torch.arange(6, dtype=torch.float32)[:, None].repeat(1, 2)
    data = train_data(hidden, replies, 2)
    assert data.rows.tolist() == [0, 1, 2, 4]  # positions where head 1 has a target
    h, path, ids, p, valid = data.batch(torch.arange(4))
    assert h[:, 0].tolist() == [0, 1, 2, 4]
    assert path.tolist() == [[10, 11], [11, 12], [12, 13], [20, 21]]  # root, then the token after it
    assert ids[..., 0].tolist() == [[11, 12], [12, 13], [13, 13], [21, 21]]
    assert valid.tolist() == [[True, True], [True, True], [True, False], [True, False]]
    assert p[..., 0].tolist() == valid.float().tolist()
    teacher = (torch.arange(12).view(6, 2), torch.full((6, 2), 0.5))
    _, _, ids, p, _ = train_data(hidden, replies, 2, teacher=teacher).batch(torch.tensor([0, 3]))
    assert ids.tolist() == [[[2, 3], [4, 5]], [[10, 11], [10, 11]]]
    assert p.tolist() == [[[0.5, 0.5], [0.5, 0.5]], [[0.5, 0.5], [0.0, 0.0]]]
    with pytest.raises(ValueError, match="6 reply tokens but 5 hidden states"):
        train_data(hidden[:5], replies, 2)


def test_restricted_targets_drop_and_renormalise_outside_mass():
    remap = vocab_remap(torch.tensor([7, 3, 5]), 10)
    assert remap.tolist() == [-1, -1, -1, 1, -1, 2, -1, 0, -1, -1]
    ids = torch.tensor([[[3, 4], [4, 9]]])  # one row, two heads, top-2
    p = torch.tensor([[[0.6, 0.4], [0.7, 0.3]]])
    sub, q, valid = restrict_targets(ids, p, torch.tensor([[True, True]]), remap)
    assert sub[0, 0].tolist() == [1, 0] and q[0, 0].tolist() == [1.0, 0.0]
    assert valid.tolist() == [[True, False]]  # head 2's targets lie outside the subset


def test_train_heads_refuses_a_device_it_cannot_see():
    from medusa_export.training.pipeline import check_device
    from medusa_export.errors import MedusaError

    assert check_device("cpu") == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises(MedusaError, match="sees 0 CUDA device"):
            check_device("cuda")
    with pytest.raises(MedusaError, match="cpu, cuda or cuda:N"):
        check_device("gpu")


def _tiny_data(gen, tmp_path, soft_topk=0):
    dec = BatchedDecoder(gen.hf_model, batch_size=3, capacity=128, dtype=torch.float32)
    store = ReplyStore(tmp_path / "replies", vocab_size=300)
    generate_to_store(dec, decode_requests(gen.tokenizer, gen.chat_template, PROMPTS), store, max_new_tokens=24,
                      eos_token_ids=[], progress=False)
    reps = store.read()
    feats = compute_features(dec, reps, soft_topk=soft_topk)
    return train_data(feats.hidden, [r.reply.tolist() for r in reps], 3, teacher=feats.teacher)


@pytest.mark.parametrize("soft_topk", [0, 8])
def test_a_few_training_steps_lower_the_loss(tiny_gen, tmp_path, soft_topk):
    data = _tiny_data(tiny_gen, tmp_path, soft_topk)
    w = tiny_gen.lm_head.weight.detach().to(torch.bfloat16)
    everything = data.batch(torch.arange(data.num_tokens))
    cfg = TrainConfig(num_heads=3, num_layers=1, epochs=10, batch_tokens=32, lr=1e-2, warmup_steps=2,
                      soft_topk=soft_topk)
    res = train_heads(data, tiny_gen.lm_head, cfg, progress=False)
    with torch.no_grad():
        from medusa_export.model.heads import HeadsConfig, MedusaHeads

        fresh = MedusaHeads(HeadsConfig(3, 1, 32, 300, False), tiny_gen.lm_head)
        before, _, _ = heads_loss(fresh, w, everything)
        after, _, _ = heads_loss(res.heads, w, everything)
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
        toks, = _decode(hf, [ids], batch_size=1, max_new_tokens=25, eos=[])
        hidden = compute_features(BatchedDecoder(hf, dtype=torch.float32),
                                  [StoredReply("x", np.asarray(ids), np.asarray(toks))]).hidden
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
    """The generator is the family's transformers model on the strictly loaded tensors; the batched decode
    loop on it (fp32, 2 rows with a refill) equals plain greedy decoding of the original model, past the
    window of 8, and its teacher-forced hidden states are the model's own."""
    from conftest import plain_greedy
    from medusa_export.training.distill import load_generator

    hf = _write_layout(tmp_path, layout)
    gen = load_generator(str(tmp_path))
    assert type(gen.hf_model) is type(hf)
    prompts = [[5, 17, 42, 7, 99, 3], [8, 1, 2, 250, 12, 64, 9, 9, 31, 4, 77], [3, 3, 60]]
    got = _decode(gen.hf_model, prompts, batch_size=2, max_new_tokens=14, eos=[])
    for p, toks in zip(prompts, got):
        assert toks == plain_greedy(hf, p, 14)
    dec = BatchedDecoder(gen.hf_model, batch_size=2, capacity=128, dtype=torch.float32)
    feats = compute_features(dec, [StoredReply("r", np.asarray(prompts[1]), np.asarray(got[1]))])
    with torch.no_grad():
        ref = hf.model(torch.tensor([prompts[1] + got[1][:-1]])).last_hidden_state[0, 10:]
    torch.testing.assert_close(feats.hidden, ref, atol=1e-4, rtol=1e-4)


def test_one_loader_shares_the_reference_tensors(tmp_path):
    """load_transformers_model (train-heads, calibrate, the benchmarks) and load_model (build) read the same
    checkpoint through load_registered_backbone: the transformers model holds the backbone's tensors
    (no copy), with gradients off, and its logits equal the original model's."""
    from medusa_export.loading.registry import load_model
    from medusa_export.loading.transformers_twin import load_transformers_model

    hf = _write_layout(tmp_path, next(iter(LAYOUTS)))
    model, loaded = load_transformers_model(str(tmp_path))
    assert model.lm_head.weight.data_ptr() == loaded.backbone.lm_head.weight.data_ptr()
    assert not any(p.requires_grad for p in model.parameters())
    x = torch.tensor([[5, 17, 42, 7]])
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, hf(x).logits, atol=0, rtol=0)
        ref = load_model(str(tmp_path)).model.backbone
        assert torch.equal(ref.lm_head.weight, loaded.backbone.lm_head.weight)


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
def test_train_heads_command_end_to_end_and_resumes(tmp_path, capsys):
    from conftest import save_tiny_hf_dir
    from medusa_export.cli.main import main

    save_tiny_hf_dir(tmp_path / "m", vocab=300, hidden=32, layers=2, heads=4, kv_heads=2)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": p.messages[0]["content"]}) + "\n"
                               for i, p in enumerate(PROMPTS)))
    args = ["train-heads", "--model", str(tmp_path / "m"), "--data", str(prompts), "--out", str(tmp_path / "h"),
            "--cache", str(tmp_path / "c"), "--max-new-tokens", "10", "--holdout", "2", "--dtype", "fp32",
            "--batch-size", "3", "--epochs", "2", "--batch-tokens", "8", "--num-heads", "2", "--train-vocab", "40",
            "--samples", "2", "--threads", "1"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "generated 10 replies, 100 tokens" in err  # 2 held out (greedy) + 4 training prompts x 2 variants
    meta = json.loads((tmp_path / "h" / "heads.json").read_text())
    assert meta["recipe"]["replies"] == {"greedy": 4, "sampled": 4, "tokens": 80}
    assert meta["recipe"]["train_vocab"] == 40 and meta["num_heads"] == 2
    assert json.loads((tmp_path / "h" / "draft_vocab.json").read_text())["total_tokens"] == 80
    assert load_accuracies(tmp_path / "h").shape == (2, 10)
    assert main(args) == 0  # everything stored: nothing is generated or recomputed again
    assert "generated" not in capsys.readouterr().err
    assert len(list((tmp_path / "c" / "features").glob("features-*"))) == 2  # training and held-out replies
    hydra = args[:args.index("--out")] + ["--out", str(tmp_path / "hy")] + args[args.index("--out") + 2:]
    assert main(hydra + ["--head-type", "hydra", "--init-heads", str(tmp_path / "h")]) == 0
    meta = json.loads((tmp_path / "hy" / "heads.json").read_text())
    assert meta["head_type"] == "hydra" and "start equal to them" in meta["recipe"]["init"]
    assert json.loads((tmp_path / "hy" / "accuracies.json").read_text())["head_type"] == "hydra"
    assert main(["calibrate", "--model", str(tmp_path / "m"), "--heads", str(tmp_path / "hy"), "--data", str(prompts),
                 "--cache", str(tmp_path / "c"), "--max-new-tokens", "12", "--budgets", "2", "6",
                 "--batch-size", "4"]) == 0
    acc = json.loads((tmp_path / "hy" / "accuracies.json").read_text())
    assert set(acc["simulated"]) == {"static", "dynamic"} and set(acc["simulated"]["dynamic"]) == {"2", "6"}
    assert len(acc["calibration"]["p_right"]) == 2


def test_hashed_gumbel_noise_samples_the_softmax():
    from medusa_export.training.batch_decode import hashed_uniform

    n = 20000
    u = hashed_uniform(torch.full((n,), 12345), torch.arange(n), 4)
    assert abs(float(u.mean()) - 0.5) < 0.01 and float(u.min()) > 0 and float(u.max()) < 1
    assert torch.equal(u, hashed_uniform(torch.full((n,), 12345), torch.arange(n), 4))  # a pure function
    logits = torch.tensor([1.0, 0.0, -1.0, 0.5])
    draws = (logits[None] - torch.log(-torch.log(u))).argmax(-1)
    freq = torch.bincount(draws, minlength=4).float() / n
    assert torch.allclose(freq, torch.softmax(logits, -1), atol=0.01)


def test_projected_ce_matches_autograd():
    from medusa_export.training.distill import ProjectedCE

    torch.manual_seed(0)
    states = torch.randn(6, 8, requires_grad=True)
    weight = torch.randn(20, 8).to(torch.bfloat16)
    ids = torch.randint(0, 20, (6, 3))
    p = torch.softmax(torch.randn(6, 3), -1)
    g = torch.randn(6)
    ce, top = ProjectedCE.apply(states, weight, ids, p)
    (ce * g).sum().backward()
    ref_states = states.detach().clone().requires_grad_(True)
    z = torch.nn.functional.linear(ref_states.to(torch.bfloat16), weight).float()
    ref = torch.logsumexp(z, -1) - (z.gather(1, ids) * p).sum(-1)
    (ref * g).sum().backward()
    assert torch.allclose(ce, ref) and torch.equal(top, z.argmax(-1))
    assert torch.allclose(states.grad, ref_states.grad, atol=2e-2, rtol=2e-2)  # one bf16 rounding of the gradient


def test_feature_chunks_computed_in_parts_are_read_back_whole(tiny, tmp_path):
    hf = tiny[0]
    dec, reps = _stored_replies(tiny, tmp_path / "s", 5)
    for i in (0, 1):
        assert cached_features(dec, reps, tmp_path / "f", soft_topk=2, part=(i, 2), chunk=2) is None
    assert len(list((tmp_path / "f").glob("features-*"))) == 3

    class NoForward(BatchedDecoder):
        def forward(self, *a, **k):
            raise AssertionError("every chunk is cached")

    whole = cached_features(NoForward(hf, dtype=torch.float32), reps, tmp_path / "f", soft_topk=2, chunk=2)
    ref = compute_features(dec, reps, soft_topk=2)
    assert whole.lengths == ref.lengths and torch.allclose(whole.hidden, ref.hidden, atol=1e-6)
    assert torch.equal(whole.teacher_ids, ref.teacher_ids)


def test_batched_decoder_refuses_other_families_by_name():
    """A model outside Llama / Mistral / Qwen2 / Qwen3 (here GPT-2), or a supported family's config whose layers
    are neither full nor sliding attention: a typed error naming what is supported, before anything is read."""
    import transformers

    from medusa_export.errors import UnsupportedModelError
    from medusa_export.training.batch_decode import layer_windows

    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=40))
    with pytest.raises(UnsupportedModelError, match=r"Llama 1/2/3.x \(llama\), Mistral \(mistral\), Qwen2 / Qwen2.5 "
                                                     r"\(qwen2\), Qwen3 \(qwen3\) families; this model is 'gpt2'"):
        BatchedDecoder(gpt2)
    cfg = transformers.Qwen2Config(num_hidden_layers=2, layer_types=["full_attention", "chunked_attention"])
    with pytest.raises(UnsupportedModelError, match="this model has chunked_attention"):
        layer_windows(cfg)
    mistral = transformers.MistralConfig(num_hidden_layers=3, sliding_window=8)
    qwen = transformers.Qwen2Config(num_hidden_layers=3, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    assert layer_windows(mistral) == [8, 8, 8] and layer_windows(qwen) == [None, 8, 8]
