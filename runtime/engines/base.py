"""What every engine backend offers the decode loop: the :class:`Engine` protocol, the step's inputs
(:class:`RowInputs`, :class:`SamplerInputs`) and outputs (:class:`StepResult`).

The loop (:mod:`medusa_runtime.loop`) and the batch scheduler are written against these alone; the
backends (:mod:`.ort`, :mod:`.ort_batched`, :mod:`.ort_cuda`, :mod:`.trt`, and the PyTorch reference
``medusa_export.model.decode.TorchEngine``) implement them.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import numpy as np


class StepResult(NamedTuple):
    """One engine step's outputs, batch dimension dropped (see medusa_export.model.medusa)."""

    topk_ids: np.ndarray  # int64 [S, k]
    topk_logprobs: np.ndarray  # float32 [S, k]
    entropy: np.ndarray  # float32 [S]
    token_logprobs: np.ndarray  # float32 [S, S]
    hidden: np.ndarray  # [S, d]
    new_kv: list  # per layer (key, value), each [1, S, H_kv, D]
    sampled_ids: np.ndarray | None = None  # int64 [S], the in-graph sampler's draw (only when asked for)


class SamplerInputs(NamedTuple):
    """What a step with the in-graph sampler is fed (docs/sampling.md), batch dimension dropped."""

    uniforms: np.ndarray  # float32 [S] in [0, 1): row i's draw (< 0: row i not sampled)
    top_k: int  # 0 = the whole vocabulary (-1: the sampler off, sampled_ids all -1)
    top_p: float  # (0, 1]; 1 = off


def sampler_feed(s: int, sampling: SamplerInputs | None) -> dict[str, np.ndarray]:
    """The in-graph sampler's step inputs for S rows (docs/sampling.md); None: the sampler off (top_k -1)."""
    if sampling is None:
        sampling = SamplerInputs(np.full(s, -1.0, np.float32), -1, 1.0)
    return {"sample_uniforms": np.ascontiguousarray(sampling.uniforms, np.float32).reshape(1, s),
            "sample_top_k": np.array([sampling.top_k], np.int64),
            "sample_top_p": np.array([sampling.top_p], np.float32)}


class Engine(Protocol):
    """What the loop needs from a backend.

    Optional attributes the loop reads when present: ``max_context`` (the KV capacity the
    graphs were built for: the default capacity and its upper bound), ``step_topk`` and
    ``vocab_size`` (which sampling settings are exact from the top-k outputs) and
    ``has_sampler`` (the step graph has the in-graph sampler: ``step`` then accepts
    ``sampling=SamplerInputs(...)`` and returns ``sampled_ids``).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_heads: int  # Medusa heads K
    kv_dtype: np.dtype

    def step(self, input_ids: np.ndarray, position_ids: np.ndarray, mask: np.ndarray, temperature: float,
             past: list[tuple[np.ndarray, np.ndarray]]) -> StepResult:
        """Run S tokens (input_ids/position_ids int64 [1, S], mask bool [S, S]) after the past views.

        Engines with ``has_sampler`` also take ``sampling: SamplerInputs | None = None``.
        """

    def heads(self, hidden: np.ndarray, topk: int) -> np.ndarray:
        """hidden [R, d] -> int64 [R, K, >=topk] the heads' best tokens.

        ``hidden`` is a row slice of a step's ``StepResult.hidden`` (whatever type the
        engine returned there, e.g. a device buffer).
        """

    def close(self) -> None:
        """Free what the engine holds outside the garbage collector's reach (device memory); the engine is
        unusable afterwards. Host engines: nothing."""

    # Optional, by head type and tree policy (see :func:`run_heads`, :func:`check_heads`):
    # * ``head_type``: "medusa" (default when absent) or "hydra" (path-conditioned heads);
    # * ``heads_logprobs(hidden [R, d], topk) -> (ids int64 [R, K, topk], logprobs float32 [R, K, topk])``:
    #   Medusa heads with their log-probabilities (per-step trees); ``has_heads_logprobs`` False says
    #   the method exists but the artifact's graph lacks the output;
    # * ``heads_level(depth, hidden [N, d], path_ids int64 [R, depth], topk) -> (ids [R, topk], logprobs [R, topk])``:
    #   the path-conditioned head of that depth on R paths (root first), N = 1 (one h_t for every
    #   path) or N = R (each path's own h_t: paths of several sequences in one call); the heads of
    #   "hydra" engines.

    # Optional: ``make_cache(capacity) -> cache`` for engines that keep the KV cache in
    # their own memory (a GPU). The cache must offer what :class:`KVCache` offers
    # (a :class:`CacheState` with past() and keep()); ``step`` then receives its
    # ``past()`` and may write the new K/V into the cache itself (``new_kv`` ignored).


class RowInputs(NamedTuple):
    """One sequence's part of an engine call, batch dimension dropped (:meth:`Decoding.inputs`)."""

    tokens: np.ndarray  # int64 [S]: the prompt (prefill) or the tree's candidates
    positions: np.ndarray  # int64 [S]: position ids (past length + depth)
    mask: np.ndarray  # bool [S, S]: which new tokens each new token sees (the whole valid past is seen)
    temperature: float  # the step's softmax temperature (1.0 when greedy)
    sampling: SamplerInputs | None  # the in-graph sampler's inputs, or None (sampler off)


