"""scripts/bench_step_overhead.py drives the decode loop as generate does: same tokens, one time per tree step."""

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "bench_step_overhead.py"


@pytest.fixture(scope="module")
def bso():
    spec = importlib.util.spec_from_file_location("bench_step_overhead", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_timed_loop_decodes_what_generate_decodes(bso, smollm_artifact):
    from medusa_runtime.contract.artifact import load_artifact
    from medusa_runtime.decode.loop import generate
    from medusa_runtime.engines.ort import OrtEngine

    art = load_artifact(smollm_artifact)
    engine = OrtEngine(art, threads=1)
    ids = [1, 504, 3458, 314, 253, 1056, 28]
    ref = generate(engine, ids, art.tree, max_new_tokens=20)
    rec = bso.decode_timed(engine, ids, art.tree, 20, [])
    assert rec["tokens"] == ref.tokens and len(ref.tokens) == 20
    assert len(rec["step"]) == len(rec["heads"]) == len(rec["host"]) == len(ref.step_tokens)
    assert rec["past"][0] == len(ids) + 1 - 1  # the first tree step follows the prompt (its root is not cached yet)
    assert all(t > 0 for t in rec["step"])
    assert all(h > 0 for h in rec["heads"][:-1])  # no heads after the step that ends the generation
