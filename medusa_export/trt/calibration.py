"""Int8 calibration inputs for the backbone step graph, from prompts.

TensorRT calibrates a dynamic-shape network at the calibration profile's opt shapes, so
every batch has exactly the prefill profile's opt S (and P = 0): the prompts, rendered
with the artifact's chat template and tokenized, are concatenated into one token stream
and cut into windows of S tokens.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from medusa_runtime.contract.artifact import step_sampler
from medusa_runtime.engines.base import sampler_feed
from medusa_runtime.engines.trt_plan import model_profiles
from medusa_runtime.decode.loop import causal_mask
from medusa_runtime.contract.manifest import Manifest, as_manifest

_NP = {"float32": np.float32, "float16": np.float16}


def calibration_windows(token_lists: list[list[int]], length: int, batches: int) -> list[np.ndarray]:
    """Windows of ``length`` tokens over the concatenated prompts (repeated if too short).

    Returns:
        Up to ``batches`` int64 arrays of shape [length].

    Raises:
        ValueError: no tokens at all.
    """
    stream = [t for ids in token_lists for t in ids]
    if not stream:
        raise ValueError("no calibration tokens: the prompts are empty")
    need = length * batches
    reps = -(-need // len(stream))
    stream = (stream * reps)[:need]
    return [np.asarray(stream[i * length:(i + 1) * length], dtype=np.int64) for i in range(batches)]


def step_feeds(manifest: Manifest | dict, windows: list[np.ndarray]) -> list[dict[str, np.ndarray]]:
    """Prefill inputs (P = 0) of the step graph for each window."""
    manifest = as_manifest(manifest)
    m = manifest.model
    kv = _NP[manifest.precision.kv_dtype]
    empty = np.zeros((1, 0, m.num_kv_heads, m.head_dim), kv)
    sampler = step_sampler(manifest)
    feeds = []
    for w in windows:
        s = len(w)
        feed = {"input_ids": w[None], "position_ids": np.arange(s, dtype=np.int64)[None],
                "new_token_mask": causal_mask(s), "temperature": np.ones(1, np.float32),
                **(sampler_feed(s, None) if sampler else {})}  # the in-graph sampler off
        for i in range(m.num_layers):
            feed[f"past_key_values.{i}.key"] = empty
            feed[f"past_key_values.{i}.value"] = empty
        feeds.append(feed)
    return feeds


def calibration_feeds(folder: Path, manifest: Manifest | dict, prompts: list[str], batches: int) -> list[dict[str, np.ndarray]]:
    """Calibration inputs from user prompts, tokenized with the artifact's tokenizer and chat template."""
    manifest = as_manifest(manifest)
    from transformers import AutoTokenizer

    from ..chat import apply_chat_template

    tok = AutoTokenizer.from_pretrained(str(folder / manifest.tokenizer.dir))
    template = (folder / manifest.tokenizer.chat_template).read_text() or None
    ids = [apply_chat_template(tok, template, [{"role": "user", "content": p}]) for p in prompts]
    prefill = model_profiles(manifest)[0]
    return step_feeds(manifest, calibration_windows(ids, prefill.dims["S"][1], batches))
