"""The README's main job, `medusa-export build --model smollm2-135m --tree 64`: its artifact (64-node tree, fp32)
decodes the build's three validation prompts x 64 tokens exactly as transformers' plain greedy decoding of the
same weights, with its own tree and with plain decoding through the runtime (issue 40: never checked before on
anything larger than a 16-node tree or 32 tokens). The reference here is transformers' model built in the test
(conftest.plain_greedy), not the validation's own code; the build's validation is checked to have named and run
its independent reference too."""

from __future__ import annotations

import pytest

from conftest import plain_greedy
from medusa_export.loading.transformers_twin import transformers_twin
from medusa_export.pipeline import BuildConfig, build_artifact
from medusa_export.validation.checks import prompt_ids
from medusa_runtime.contract.artifact import load_artifact
from medusa_runtime.engines.ort import OrtEngine
from medusa_runtime.decode.loop import generate
from medusa_runtime.trees.tree import make_tree
from medusa_runtime.trees.treespec import tree_from_spec

pytestmark = pytest.mark.slow

N_NEW = 64


@pytest.fixture(scope="module")
def main_job(smollm, tmp_path_factory):
    """The main job's artifact, built with build's defaults (validation on: 3 prompts x 64 tokens, fp32)."""
    tree = tree_from_spec("64", num_heads=smollm.model.num_heads, accuracies=smollm.head_accuracies)
    out = tmp_path_factory.mktemp("main-job") / "smollm2-135m-t64-fp32"
    return build_artifact(smollm, tree, out, BuildConfig(), progress=False)


def test_main_job_artifact_equals_transformers_plain_greedy(smollm, main_job):
    art = load_artifact(main_job)
    assert art.tree.size == 64 and art.manifest.precision_name == "fp32"
    v = art.manifest.validation
    assert v["passed"] and v["reference"].startswith("transformers generate")
    assert all(p["identical"] and p["plain_identical"] for p in v["prompts"]) and len(v["prompts"]) == 3

    texts, ids = prompt_ids(smollm, None)
    hf = transformers_twin(smollm.model.backbone)
    engine = OrtEngine(art)
    root = make_tree([], num_heads=art.model.medusa_heads, topk=art.tree.topk)
    for text, prompt in zip(texts, ids):  # EOS ignored on both sides: 64 tokens each
        want = plain_greedy(hf, prompt, N_NEW)
        medusa = generate(engine, prompt, art.tree, max_new_tokens=N_NEW, max_context=art.model.max_context)
        plain = generate(engine, prompt, root, max_new_tokens=N_NEW, max_context=art.model.max_context)
        assert medusa.tokens == want, text
        assert plain.tokens == want, text
        assert len(set(want)) >= 20, want  # a real reply, not a loop of one token
        assert medusa.steps < plain.steps  # the trained heads were accepted somewhere
