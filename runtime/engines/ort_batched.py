"""The batched ONNX Runtime engine: all the rows of a step in one call of a batched step graph.

Artifacts built with ``build --batch-size N`` (N > 1, manifest ``batch``) have a step graph with a
dynamic batch dimension B and per-row past lengths (docs/batching.md). :class:`OrtBatchEngine` is the
:class:`~medusa_runtime.decode.batch.BatchEngine` the scheduler drives for them: ``step_rows`` packs the
rows into one call (:func:`~.ort_rows.run_rows`: padding, the packed past kept between calls) and
hands each row its own :class:`~medusa_runtime.engines.base.StepResult`.

Pure numpy + onnxruntime: no torch.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from ..contract.artifact import Artifact
from ..errors import ArtifactError
from .base import RowInputs, StepResult
from .ort import OrtEngine
from .ort_rows import PackedPast, run_rows


class OrtBatchEngine(OrtEngine):
    """:class:`~.ort.OrtEngine` for a batched artifact, with the :class:`~medusa_runtime.decode.batch.BatchEngine`
    interface: ``step_rows`` runs every row in one ONNX Runtime call (see the module docstring).

    ``step`` (one sequence: :func:`~medusa_runtime.decode.loop.generate`, validation) runs the same graph
    as a batch of one.

    Args:
        artifact: a batched artifact (manifest ``batch``); other arguments as :class:`OrtEngine`.

    Raises:
        ArtifactError: the artifact's step graph is not batched (use :class:`OrtEngine`, which the
            scheduler loops over the rows).
    """

    def __init__(self, artifact: Artifact, **options):
        super().__init__(artifact, **options)
        self.packed = PackedPast()
        if not self.max_batch:
            raise ArtifactError(f"{artifact.path}: the step graph is not batched (no manifest 'batch'); rebuild with "
                                "`medusa-export build --batch-size N` or run it with OrtEngine")
        self.capabilities = replace(self.capabilities, batched=True)

    def row_cache(self, capacity: int):
        """One sequence's KV row of ``capacity`` slots in the artifact's layout (:meth:`OrtEngine.make_cache`)."""
        return self.make_cache(capacity)

    def release(self, cache) -> None:
        """The sequence of ``cache`` left: the packed past holding its row is dropped (each row's cache is
        its own arrays, freed with it)."""
        self.packed.forget(cache)

    def step_rows(self, caches: Sequence, inputs: Sequence[RowInputs]) -> list[StepResult]:
        """One call over ``len(caches)`` rows: row b runs ``inputs[b]`` after ``caches[b]``'s valid past
        (:func:`run_rows`).

        Raises:
            ArtifactError: a row asks for the in-graph sampler (batched graphs have none).
            ContextOverflowError: a row's step does not fit its cache.
        """
        if len(caches) != len(inputs):
            raise ValueError(f"{len(caches)} caches for {len(inputs)} rows")
        if any(r.sampling is not None for r in inputs):
            raise ArtifactError("a batched step graph has no in-graph sampler: sample on the host")
        return run_rows(self.step_session, self.step_io, caches, inputs, self.packed)
