"""The onnxruntime-cuda backend's code (I/O binding, the device KV cache's offsets and in-place compaction) runs
here with ``io_device="cpu"``: every binding on ONNX Runtime's CPU device and the strided copies as host
memmoves. Token-exact against the CPU backend. No CUDA provider runs here: this checks our binding code, not
the CUDA provider or a GPU."""

from __future__ import annotations

import numpy as np
import pytest

from medusa_runtime.contract.artifact import load_artifact
from medusa_runtime.engines import create_engine
from medusa_runtime.engines.ort_cuda import DeviceKVCache, OrtCudaEngine
from medusa_runtime.errors import InvalidSettingError
from medusa_runtime.decode.loop import generate
from medusa_runtime.trees.treespec import tree_from_spec

PROMPTS = ([5, 6, 7], list(range(10, 40)), [3] * 61)


@pytest.fixture(scope="module")
def engines(tiny_trt_artifact):
    a = load_artifact(tiny_trt_artifact)
    return a, create_engine(a, "onnxruntime"), OrtCudaEngine(a, io_device="cpu")


@pytest.mark.parametrize("spec", ["artifact", "1", "4"])
def test_ort_cuda_bindings_on_the_cpu_device_are_token_exact(engines, spec):
    a, ort, dev = engines
    tree = a.tree if spec == "artifact" else tree_from_spec(spec, num_heads=a.model.medusa_heads)
    for prompt in PROMPTS:
        ref = generate(ort, prompt, tree, max_new_tokens=20, max_context=a.model.max_context)
        got = generate(dev, prompt, tree, max_new_tokens=20, max_context=a.model.max_context)
        assert got.tokens == ref.tokens and len(got.tokens) == 20
        assert got.accept_depths == ref.accept_depths


def test_ort_cuda_cache_continues_a_conversation(engines):
    """A second turn after a kept cache (a prefill with P > 0) binds the past at slot 0 and the new K/V at slot P:
    its tokens are those of the whole context fed at once to the CPU backend."""
    a, ort, dev = engines
    cache = dev.make_cache(a.model.max_context)
    assert isinstance(cache, DeviceKVCache)
    generate(dev, PROMPTS[0], a.tree, max_new_tokens=8, max_context=a.model.max_context, cache=cache)
    context = list(cache.tokens)
    assert len(context) > len(PROMPTS[0]) and -1 not in context
    second = generate(dev, [9, 8], a.tree, max_new_tokens=8, max_context=a.model.max_context, cache=cache)
    ref = generate(ort, context + [9, 8], a.tree, max_new_tokens=8, max_context=a.model.max_context)
    assert second.tokens == ref.tokens and len(ref.tokens) == 8


def test_ort_cuda_unknown_io_device_is_a_typed_error(tiny_trt_artifact):
    with pytest.raises(InvalidSettingError, match="io_device must be one of cuda, cpu"):
        OrtCudaEngine(load_artifact(tiny_trt_artifact), io_device="gpu")
