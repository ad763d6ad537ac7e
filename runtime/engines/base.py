"""What every engine backend offers the decode loop: the :class:`Engine` protocol, what an engine
declares it can do (:class:`Capabilities`), the step's inputs (:class:`RowInputs`, :class:`SamplerInputs`)
and outputs (:class:`StepResult`).

The loop (:mod:`medusa_runtime.decode.loop`) and the batch scheduler are written against these alone; the
backends (:mod:`.ort`, :mod:`.ort_batched`, :mod:`.ort_cuda`, :mod:`.trt`, and the PyTorch reference
``medusa_export.model.decode.TorchEngine``) implement them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np

from ..contract.manifest import HEAD_TYPES


@dataclass(frozen=True)
class Capabilities:
    """What an engine declares it runs and its limits: the loop, the batch scheduler, the session and
    ``--tree auto`` read these (``engine.capabilities``) instead of probing the engine for methods.

    Attributes:
        head_type: the heads it runs, one of :data:`~medusa_runtime.contract.manifest.HEAD_TYPES`: "medusa"
            (``heads`` and, with ``heads_logprobs`` below, ``Engine.heads_logprobs``) or "hydra"
            (path-conditioned heads, ``heads_level``: their log-probabilities come with them).
        heads_logprobs: ``heads_logprobs`` returns the Medusa heads' log-probabilities (the heads
            graph has ``medusa_topk_logprobs``): what per-step trees (``--tree dynamic:T``) of
            Medusa heads need (:func:`medusa_runtime.decode.loop.runs_dynamic_trees`).
        sampler: the step graph has the in-graph sampler (docs/sampling.md): ``step`` accepts
            ``sampling=SamplerInputs(...)`` and returns ``StepResult.sampled_ids``.
        own_cache: ``make_cache(capacity)`` makes the KV cache the step reads (a device cache, or a
            head-major one written in place); otherwise the loop's numpy
            :class:`~medusa_runtime.engines.kvcache.KVCache` of the engine's geometry.
        batched: ``step_rows(caches, inputs)`` runs every row of a step in one call (a
            :class:`~medusa_runtime.decode.batch.BatchEngine` over a batched step graph); otherwise the
            scheduler loops over the rows with ``step`` (:class:`~medusa_runtime.decode.batch.LoopedBatchEngine`).
        max_context: the KV capacity the graphs were built for, tokens (the artifact's
            ``model.max_context``: default capacity and its upper bound); None: not said, a
            generation then names its own.
        step_topk: k of the step's top-k outputs (which sampling settings are exact from them);
            None: read from the prefill's outputs.
        vocab_size: V, the embedding table's rows (prompt ids are checked against it); None: unchecked.
        device_id: the CUDA device the engine runs on; None on the host (part of the tree cache's
            backend fingerprint, :mod:`medusa_runtime.tuning.treecache`).
        min_rows: ``step`` pads a call of fewer rows to this many (the manifest's ``precision.step_rows``), so
            that every row is computed in one kernel regime; the loop leaves room for the padding in the cache.
        chain_trees: Medusa equals plain greedy decoding of this engine on chain trees only (``--tree auto``
            times chains; other trees are refused).

    Whether the tree is fixed when the engine is built is a fact of the backend, not of one engine:
    :attr:`medusa_runtime.engines.BackendSpec.fixed_tree`.

    Raises:
        ValueError: a head type outside :data:`~medusa_runtime.contract.manifest.HEAD_TYPES` (an engine's own
            declaration: a programming error, not user input).
    """

    head_type: str = HEAD_TYPES[0]
    heads_logprobs: bool = False
    sampler: bool = False
    own_cache: bool = False
    batched: bool = False
    max_context: int | None = None
    step_topk: int | None = None
    vocab_size: int | None = None
    device_id: int | None = None
    min_rows: int = 1
    chain_trees: bool = False

    def __post_init__(self) -> None:
        if self.head_type not in HEAD_TYPES:
            raise ValueError(f"unknown head type {self.head_type!r}; engines run {', '.join(HEAD_TYPES)} heads")

    @classmethod
    def with_limits(cls, limits, **facts) -> "Capabilities":
        """The capabilities ``facts`` with the limits of an artifact's step graph (``max_context``,
        ``step_topk``, ``vocab_size`` of a :class:`medusa_runtime.contract.artifact.StepLimits`)."""
        return cls(max_context=limits.max_context, step_topk=limits.step_topk, vocab_size=limits.vocab_size,
                   min_rows=limits.min_rows, chain_trees=limits.chain_trees, **facts)


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
    """What the loop needs from a backend: its geometry, its declared :class:`Capabilities`, ``step``
    and ``heads``, and the methods its capabilities declare (below)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_heads: int  # Medusa heads K
    kv_dtype: np.dtype
    capabilities: Capabilities

    def step(self, input_ids: np.ndarray, position_ids: np.ndarray, mask: np.ndarray, temperature: float,
             past: list[tuple[np.ndarray, np.ndarray]]) -> StepResult:
        """Run S tokens (input_ids/position_ids int64 [1, S], mask bool [S, S]) after the past views.

        Engines with ``capabilities.sampler`` also take ``sampling: SamplerInputs | None = None``.
        """

    def heads(self, hidden: np.ndarray, topk: int) -> np.ndarray:
        """hidden [R, d] -> int64 [R, K, >=topk] the heads' best tokens.

        ``hidden`` is a row slice of a step's ``StepResult.hidden`` (whatever type the
        engine returned there, e.g. a device buffer).
        """

    def close(self) -> None:
        """Free what the engine holds outside the garbage collector's reach (device memory); the engine is
        unusable afterwards. Host engines: nothing."""

    # Declared by ``capabilities`` (see :func:`~medusa_runtime.decode.loop.run_heads` and
    # :func:`~medusa_runtime.decode.loop.check_heads`):
    # * ``heads_logprobs(hidden [R, d], topk) -> (ids int64 [R, K, topk], logprobs float32 [R, K, topk])``:
    #   Medusa heads with their log-probabilities (per-step trees), when ``capabilities.heads_logprobs``;
    # * ``heads_level(depth, hidden [N, d], path_ids int64 [R, depth], topk) -> (ids [R, topk], logprobs [R, topk])``:
    #   the path-conditioned head of that depth on R paths (root first), N = 1 (one h_t for every
    #   path) or N = R (each path's own h_t: paths of several sequences in one call), when
    #   ``capabilities.head_type`` is "hydra";
    # * ``make_cache(capacity) -> cache``, when ``capabilities.own_cache``: engines that keep the KV cache
    #   in their own memory (a GPU) or layout. The cache must offer what :class:`KVCache` offers
    #   (a :class:`CacheState` with past() and keep()); ``step`` then receives its ``past()`` and may
    #   write the new K/V into the cache itself (``new_kv`` ignored).


class RowInputs(NamedTuple):
    """One sequence's part of an engine call, batch dimension dropped (:meth:`Decoding.inputs`)."""

    tokens: np.ndarray  # int64 [S]: the prompt (prefill) or the tree's candidates
    positions: np.ndarray  # int64 [S]: position ids (past length + depth)
    mask: np.ndarray  # bool [S, S]: which new tokens each new token sees (the whole valid past is seen)
    temperature: float  # the step's softmax temperature (1.0 when greedy)
    sampling: SamplerInputs | None  # the in-graph sampler's inputs, or None (sampler off)


