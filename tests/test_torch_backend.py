"""The ``torch`` backend (medusa_export.validation.torch_backend): the PyTorch reference as an engine of an
artifact decodes the tokens the ONNX Runtime backend decodes; bad device ids and missing weights are typed
errors. Run on the CPU here (no CUDA device in CI)."""

from __future__ import annotations

import pytest

from conftest import make_tiny_medusa
from medusa_export.validation import torch_backend
from medusa_runtime.engines import BACKENDS
from medusa_runtime.errors import BackendUnavailableError, MedusaError
from medusa_runtime.front.session import MedusaSession


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(BACKENDS, "torch", torch_backend.TORCH_BACKEND)


def test_torch_backend_decodes_what_onnxruntime_decodes(tiny_trt_artifact, registered):
    _, model = make_tiny_medusa()  # the fixture's model: same seed, same weights
    prompts = [[5, 17, 42, 9], [300, 2, 77, 15, 900, 4]]
    with MedusaSession(tiny_trt_artifact, tree="16", notice=None) as ort, \
            MedusaSession(tiny_trt_artifact, backend="torch", model=model, tree="16", notice=None) as pt:
        assert pt.engine.capabilities.step_topk == ort.engine.capabilities.step_topk == 10
        for ids in prompts:
            want = ort.generate(prompt_ids=ids, max_new_tokens=24)
            got = pt.generate(prompt_ids=ids, max_new_tokens=24)
            assert got.token_ids == want.token_ids and len(got.token_ids) == 24
            assert got.result.accept_depths == want.result.accept_depths
            plain = pt.generate(prompt_ids=ids, max_new_tokens=24, vanilla=True)
            assert plain.token_ids == want.token_ids  # greedy Medusa is lossless on the reference too


def test_torch_backend_bad_input(tiny_trt_artifact, registered):
    with pytest.raises(BackendUnavailableError, match=r"--device-id 3: PyTorch sees no CUDA device"):
        torch_backend.torch_device(3)
    assert torch_backend.torch_device(None) == "cpu"
    # an fp16 artifact's reference runs in float16 on a GPU, float32 on the CPU
    assert torch_backend.run_dtype("float16", "cuda:0") == "float16"
    assert torch_backend.run_dtype("float16", "cpu") == torch_backend.run_dtype("float32", "cuda:0") == "float32"
    # the tiny artifact's model is not registered: its weights must be given
    with pytest.raises(MedusaError, match=r"is not a registered model and was built from 'random \(test\)'.*give its "
                                          "weights with --model-path"):
        MedusaSession(tiny_trt_artifact, backend="torch", notice=None)
