"""The embedded model (SmolLM2-135M-Instruct, Q4_1 GGUF dequantized to fp32) through the reference loop.

Independent of which heads are registered (initial or trained): greedy output must equal plain
greedy decoding whatever the heads propose. Reference: transformers' LlamaForCausalLM sharing the
same weights (:func:`medusa_export.loading.transformers_twin.transformers_twin`).
"""

from __future__ import annotations

import pytest

from conftest import mt_bench_prompts, plain_greedy
from medusa_export.chat import apply_chat_template
from medusa_export.loading.transformers_twin import transformers_twin
from medusa_export.model.decode import medusa_generate
from medusa_runtime.trees.treespec import tree_from_spec

pytestmark = pytest.mark.slow

N_NEW = 32
PROMPT_NAMES = [f"mt_bench{i}" for i in range(5)] + ["len1"]


@pytest.fixture(scope="module")
def smollm_prompts(smollm):
    """name -> prompt ids: 5 MT-Bench first turns with the chat template, and a 1-token prompt."""
    prompts = {f"mt_bench{i}": apply_chat_template(smollm.tokenizer, smollm.chat_template,
                                                    [{"role": "user", "content": q}])
               for i, q in enumerate(mt_bench_prompts(5))}
    prompts["len1"] = smollm.tokenizer.encode("The", add_special_tokens=False)
    assert len(prompts["len1"]) == 1
    return prompts


@pytest.fixture(scope="module")
def smollm_reference(smollm, smollm_prompts):
    """name -> transformers' plain greedy continuation (N_NEW tokens, EOS ignored), memoised."""
    hf = transformers_twin(smollm.model.backbone)
    memo = {}

    def ref(name: str) -> list[int]:
        if name not in memo:
            memo[name] = plain_greedy(hf, smollm_prompts[name], N_NEW)
        return memo[name]

    return ref


def test_embedded_model_is_what_the_design_says(smollm):
    c = smollm.model.config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.vocab_size) == (
        576, 30, 9, 3, 49152)
    assert c.tie_word_embeddings and smollm.model.backbone.lm_head.weight is smollm.model.backbone.embed_tokens.weight
    # the GGUF tokenizer reports the wrong EOS; the generation config's <|im_end|> is used
    assert smollm.eos_token_ids == [2] and smollm.tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"
    ids = apply_chat_template(smollm.tokenizer, smollm.chat_template, [{"role": "user", "content": "Hi"}])
    text = smollm.tokenizer.decode(ids)
    assert "<|im_start|>user\nHi<|im_end|>\n" in text and text.endswith("<|im_start|>assistant\n")


# Each prompt runs one of the two trees (the reference loop runs ~5-10 tokens/s here); the 1-token
# prompt runs both.
CASES = [(name, "chain" if i % 2 == 0 else "16") for i, name in enumerate(PROMPT_NAMES)] + [("len1", "chain")]


@pytest.mark.parametrize("name, spec", CASES)
def test_embedded_greedy_equals_plain_greedy(smollm, smollm_prompts, smollm_reference, name, spec):
    ref = smollm_reference(name)
    assert len(set(ref)) >= 10, ref
    tree = tree_from_spec(spec, num_heads=smollm.model.num_heads)
    res = medusa_generate(smollm.model, smollm_prompts[name], tree, max_new_tokens=N_NEW)
    assert res.tokens == ref
    assert res.finish_reason == "length" and res.prompt_tokens == len(smollm_prompts[name])


def test_embedded_eos_stops_the_reply(smollm, smollm_prompts):
    """With the registered EOS a short answer ends with finish "stop", the EOS not emitted."""
    ids = apply_chat_template(smollm.tokenizer, smollm.chat_template,
                              [{"role": "user", "content": "What is the capital of France? One word."}])
    res = medusa_generate(smollm.model, ids, tree_from_spec("16", num_heads=smollm.model.num_heads),
                          max_new_tokens=24, eos_token_ids=smollm.eos_token_ids)
    assert res.finish_reason == "stop"
    assert smollm.tokenizer.decode(res.tokens) == "The capital of France is Paris."
