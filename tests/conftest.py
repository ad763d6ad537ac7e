"""Shared fixtures: tiny generated models, the embedded model, and ONE exported artifact.

Expensive things are session-scoped: the embedded SmolLM2 model is loaded once and its
artifact is exported once (tree of 16 nodes, fp32) and shared by every test that needs it.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import tempfile
from pathlib import Path

# OpenMP threads that spin while waiting made every torch op take ~10-20 ms when the 2 cores were
# shared with other processes (the tiny-model tests ran ~30x slower, the embedded model ~14x);
# passive waiting costs little when the machine is idle. Must be set before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The runtime's default tree is timed on the machine (medusa_runtime.tuning.treecache): the suite pins it to the tree each
# artifact was built with, so that a test's tree does not depend on the machine's timing, and keeps timings out of
# the user's cache. tests/test_default_tree.py clears MEDUSA_EXPORT_TREE to test the default itself.
os.environ["MEDUSA_EXPORT_TREE"] = "artifact"
os.environ["MEDUSA_EXPORT_CACHE"] = tempfile.mkdtemp(prefix="medusa-export-cache-")

import pytest  # noqa: E402
import torch  # noqa: E402
from medusa_export.model.families import FAMILIES as _FAMILY_TABLE  # noqa: E402

#: The prompts the suite uses, carried by the repository (tests/data/README.md names their source and licence): the
#: first 20 MT-Bench questions. The suite never reads the shared prompt sets (``../shared/data``), which only the
#: benchmarks and head training use, so a fresh clone runs it with nothing beside it.
DATA = Path(__file__).resolve().parent / "data"
MT_BENCH = DATA / "mt_bench_questions.jsonl"
SMOLLM_TREE = "16"


#: Set by .ci/run: CI installs the serving tools (tritonserver, tritonclient, g++, nlohmann-json) and GNU time, so a
#: test that would skip for want of one fails there instead (:func:`skip_or_fail_in_ci`).
IN_CI = os.environ.get("MEDUSA_EXPORT_CI") == "1"


def skip_or_fail_in_ci(reason: str) -> None:
    """Skip the test for want of a tool (``reason`` says which), or fail it under ``MEDUSA_EXPORT_CI=1``."""
    if IN_CI:
        pytest.fail(f"{reason}; MEDUSA_EXPORT_CI=1 (CI installs it: .ci/run, .ci/setup_serving.sh), so this is a "
                    "failure")
    pytest.skip(reason)


def import_or_fail_in_ci(module: str, reason: str):
    """``pytest.importorskip(module)``, except that under ``MEDUSA_EXPORT_CI=1`` a missing module fails the test."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        skip_or_fail_in_ci(f"{module} is not importable ({exc}): {reason}")


def mt_bench_prompts(n: int = 5) -> list[str]:
    """First-turn MT-Bench questions (evaluation only; never trained on), from the repository's copy (n <= 20)."""
    lines = MT_BENCH.read_text().splitlines()[:n]
    return [json.loads(line)["turns"][0] for line in lines]


@functools.lru_cache(maxsize=None)
def _tiny_bpe_json(vocab_limit: int) -> str:
    """The trained tiny BPE (trained once per session and vocab size), as ``tokenizers`` JSON."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_limit, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = mt_bench_prompts(20) + (DATA / "bpe_corpus.txt").read_text().splitlines()
    tok.train_from_iterator(corpus, trainer)
    return tok.to_str()


def hand_timed_trees(monkeypatch, step_ms) -> None:
    """Replace the runtime's tree timings (medusa_runtime.tuning.autotree) with hand-given ones, so that the tree a build or
    a session chooses can be worked out by hand: a step of an n-node tree takes ``step_ms(n)`` ms, the heads
    nothing, and a step of the whole decode loop with that tree the same ``step_ms(n)``."""
    import medusa_runtime.tuning.autotree as autotree

    monkeypatch.setattr(autotree, "time_tree_steps",
                        lambda engine, trees, **_: ({n: float(step_ms(n)) for n in trees}, {n: 0.0 for n in trees}))
    monkeypatch.setattr(autotree, "time_decode_loop", lambda engine, tree, **_: float(step_ms(tree.size)))


def make_tiny_tokenizer(vocab_limit: int = 300):
    """A real byte-level BPE tokenizer (transformers fast tokenizer) trained in-process on a
    few sentences, with a ChatML-like chat template. Its ids stay below ``vocab_limit``.

    The training is cached (:func:`_tiny_bpe_json`); every call returns a new object, so a
    test may change its own."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_str(_tiny_bpe_json(vocab_limit))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
    )
    return fast


def make_tiny_medusa(*, vocab=1001, hidden=64, layers=2, heads=4, kv_heads=2, medusa_heads=3, seed=0,
                     own_projection=False, head_noise=0.0, tie=False, intermediate=None):
    """(hf_model, MedusaModel) with random weights; the MedusaModel shares the HF weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from medusa_export.loading.backbone import backbone_from_hf_model
    from medusa_export.model.medusa import MedusaModel

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=4096, tie_word_embeddings=tie)
    hf = LlamaForCausalLM(cfg).eval()
    model = MedusaModel.with_initial_heads(backbone_from_hf_model(hf), medusa_heads, own_projection=own_projection)
    if head_noise:
        with torch.no_grad():
            for p in model.heads.parameters():
                p.add_(torch.randn_like(p) * head_noise)
    return hf, model.eval()


# One tiny random model per family fixture (medusa_export.model.families: each Family's ``fixtures``), made with
# transformers' own config class (hidden 64, GQA 4/2), its distinguishing feature switched on: RoPE scaling, a
# sliding window smaller than the test context (8 tokens), biases, q/k norms, an explicit head_dim, tied
# embeddings. fixture name -> (the family's transformers model_type, config keyword arguments).
FAMILIES = {name: (fam.hf_model_type, copy.deepcopy(dict(kw)))
            for fam in _FAMILY_TABLE.values() for name, kw in fam.fixtures.items()}


def make_family_hf(family: str, *, vocab=320, seed=0):
    """A tiny random transformers model of ``family`` (see :data:`FAMILIES`), eval mode.

    transformers initialises every Linear bias to 0 and every RMSNorm weight to 1, which would
    leave the biases and q/k norms untested: they are randomised here."""
    import transformers

    model_type, kw = FAMILIES[family]
    kw = copy.deepcopy(kw)  # transformers adds "rope_type" to a rope_scaling dict it is given
    cfg = transformers.AutoConfig.for_model(model_type, vocab_size=vocab, hidden_size=64, intermediate_size=128,
                                            num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=512, initializer_range=0.2, **kw)
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.1)
            elif "norm" in name:
                p.normal_(1.0, 0.2)
    return hf


def make_family_medusa(family: str, *, vocab=320, seed=0, medusa_heads=3, head_noise=0.02):
    """(hf_model, MedusaModel) of ``family``: our reference loaded strictly from the transformers
    model's state dict (shared tensors), with §2.1.1 initial heads plus noise."""
    from medusa_export.loading.backbone import backbone_from_hf_model
    from medusa_export.model.medusa import MedusaModel

    hf = make_family_hf(family, vocab=vocab, seed=seed)
    model = MedusaModel.with_initial_heads(backbone_from_hf_model(hf), medusa_heads)
    torch.manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.heads.parameters():
            p.add_(torch.randn_like(p) * head_noise)
    return hf, model.eval()


def make_counter_medusa(scale: float = 6.0, vocab: int = 300, miss_every: int = 0):
    """A MedusaModel whose greedy next token after t is t+1 mod V, head k's top guess t+1+k.

    Layers' residual outputs are scaled down (they still run and perturb the logits a
    little, so the K/V matter); lm_head row j is scale * E[j-1] and head k's own projection
    row j is scale * E[j-1-k] (E the embeddings), so after the final norm the logit of
    t+1 (head k: t+1+k) is ~scale * 1.3 against ~N(0, scale * 0.16) for the others.

    ``miss_every`` m > 0 ((V / 2) % m == 0): after a token t with t % m == 0 every head guesses
    t+1+k+V/2 instead (a permutation of the rows), so a step whose last accepted token is a
    multiple of m accepts nothing and the others accept a whole path: sequences at different
    tokens accept different lengths in the same step.
    """
    _, model = make_tiny_medusa(vocab=vocab, medusa_heads=3, own_projection=True)
    with torch.no_grad():
        for block in model.backbone.layers:
            block.self_attn.o_proj.weight.mul_(0.05)
            block.mlp.down_proj.weight.mul_(0.05)
        emb = model.backbone.embed_tokens.weight
        model.backbone.lm_head.weight.copy_(scale * torch.roll(emb, 1, dims=0))
        for k, head in enumerate(model.heads.heads, start=1):
            src = (torch.arange(vocab) - 1 - k) % vocab  # row j guessed after token src[j]
            if miss_every:
                assert (vocab // 2) % miss_every == 0
                miss = src % miss_every == 0
                src[miss] = (src[miss] - vocab // 2) % vocab
            head[-1].weight.copy_(scale * emb[src])
    return model


def tiny_loaded(model, *, name="tiny", tree="16", max_context=512):
    """Wrap a tiny MedusaModel as a registry LoadedMedusa with the tiny tokenizer."""
    from medusa_export.loading.registry import LoadedMedusa

    tok = make_tiny_tokenizer()
    return LoadedMedusa(model=model, tokenizer=tok, eos_token_ids=[tok.eos_token_id], chat_template=tok.chat_template,
                        name=name, backbone_source="random (test)", heads_source="random (test)",
                        default_tree=tree, max_context=max_context)


def save_tiny_hf_dir(path, **kwargs):
    """Write a tiny random Llama (:func:`make_tiny_medusa` kwargs) as an HF model directory:
    ``save_pretrained`` safetensors weights, config, generation config and the tiny tokenizer.
    Returns the transformers model."""
    hf, _ = make_tiny_medusa(**kwargs)
    hf.save_pretrained(path, safe_serialization=True)
    make_tiny_tokenizer().save_pretrained(path)
    return hf


@pytest.fixture(scope="session")
def tiny_hf():
    """Factory of tiny random Llama models: ``tiny_hf(**kwargs)`` -> (hf_model, MedusaModel) as
    :func:`make_tiny_medusa` builds them (seeded), built once per distinct kwargs and shared."""
    built = {}

    def make(**kwargs):
        key = tuple(sorted(kwargs.items()))
        if key not in built:
            built[key] = make_tiny_medusa(**kwargs)
        return built[key]

    return make


@torch.no_grad()
def plain_greedy(hf_model, prompt_ids, max_new_tokens: int) -> list[int]:
    """Plain greedy decoding by transformers (the independent reference), EOS ignored.

    The attention mask is given explicitly: inferred from ``pad_token_id`` it would mask every
    prompt token equal to it (a random prompt may well contain id 0)."""
    ids = torch.tensor([list(prompt_ids)])
    out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                            do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


@pytest.fixture(scope="session")
def smollm():
    """The embedded SmolLM2-135M model with its registered heads (loaded once)."""
    from medusa_export.loading.registry import load_model

    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def smollm_artifact(smollm, tmp_path_factory):
    """ONE fp32 artifact of the embedded model (16-node tree), exported once per session.

    Built without build's own validation: the parity tests validate it explicitly.
    """
    from medusa_export.pipeline import BuildConfig, build_artifact
    from medusa_runtime.trees.treespec import tree_from_spec

    tree = tree_from_spec(SMOLLM_TREE, num_heads=smollm.model.num_heads,
                          accuracies=smollm.head_accuracies)
    out = tmp_path_factory.mktemp("artifacts") / "smollm2-135m"
    return build_artifact(smollm, tree, out, BuildConfig(max_context=1024, validate=False), progress=False)


@pytest.fixture(scope="session")
def tiny_trt_artifact(tmp_path_factory):
    """A tiny exported artifact (2 layers, 16-node tree, max context 256, fp32, real tokenizer),
    built once per session without validation, for the TensorRT stage's tests (tests/test_trt.py).
    Tests that change it copy it first."""
    from medusa_export.pipeline import BuildConfig, build_artifact
    from medusa_runtime.trees.treespec import tree_from_spec

    _, model = make_tiny_medusa()
    lm = tiny_loaded(model, max_context=256)
    out = tmp_path_factory.mktemp("trt") / "tiny"
    return build_artifact(lm, tree_from_spec("16", num_heads=3), out, BuildConfig(validate=False), progress=False)


def rmsnorm_chains(model) -> list[list]:
    """Every RMSNorm chain of an ONNX graph, found by structure (not by name): ``ReduceMean`` of a squaring
    (``Pow(x, 2)`` or ``Mul(x, x)``), then every node up to the ``Mul`` by x, then (past a ``Cast``) the ``Mul``
    by the weight initializer. Returns each chain's nodes (Casts left out)."""
    from collections import defaultdict

    nodes = list(model.graph.node)
    producer = {o: n for n in nodes for o in n.output}
    consumers = defaultdict(list)
    for n in nodes:
        for i in n.input:
            consumers[i].append(n)
    consts = {t.name for t in model.graph.initializer}
    chains = []
    for rm in (n for n in nodes if n.op_type == "ReduceMean"):
        sq = producer[rm.input[0]]
        assert sq.op_type in ("Pow", "Mul"), sq.op_type
        x = sq.input[0]
        chain, n = [sq, rm], rm
        while not (n.op_type == "Mul" and x in n.input and n is not sq):
            (n,) = consumers[n.output[0]]
            chain.append(n)
        (n,) = consumers[n.output[0]]
        if n.op_type == "Cast":
            (n,) = consumers[n.output[0]]
        assert n.op_type == "Mul" and any(i in consts for i in n.input), n.op_type
        chains.append(chain + [n])
    return chains
