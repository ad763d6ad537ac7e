"""Validation of an artifact against PyTorch (used by ``build`` and ``verify``).

The reference the artifact must equal is independent of the runtime (:mod:`~.independent`): plain greedy
decoding in PyTorch (transformers' ``generate`` on the same weights, or a full-recompute loop without a KV cache)
that shares no code with :func:`medusa_runtime.decode.loop.generate`, its KV cache and compaction, tree buffers or
acceptance, computed once per prompt. Checks per prompt:

1. Step outputs: the prefill and one tree step run through ONNX Runtime and the PyTorch reference on
   the same inputs; top-1 log-probability, entropy and hidden states must agree within
   the precision's tolerance (:data:`TOLERANCES`).
2. Greedy tokens against the independent reference: the artifact's Medusa decoding (its own tree) and its plain
   decoding (a root-only tree) through the runtime's loop on ONNX Runtime must both emit the reference's tokens
   for ``new_tokens`` tokens. For fp16 a divergence at a position where the reference's top-2 margin (log-prob gap)
   is below the precision's ``margin`` is reported as a near-tie (with its step and margin) instead of a failure.
   Diagnostic: the PyTorch reference through the same runtime loop, compared token by token with the artifact and
   with the reference, says where a mismatch starts (in code both share, or in the artifact's graphs).
3. Medusa against plain greedy on the same graph: the artifact's tree and a root-only tree
   (one token per step) over the same ONNX Runtime engine must emit identical tokens.
4. Accepted lengths against PyTorch: greedy tokens stay identical whatever the heads propose
   (the backbone verifies every candidate), so a broken heads graph would pass checks 1-3. Where
   the heads graph computes what the reference's heads compute (an fp32 artifact with fp32 heads
   over the whole vocabulary, and every truncated check), the tokens each tree step accepted must
   equal the PyTorch reference's through the runtime's loop, step by step (:func:`exact_heads`).

Which checks decide pass/fail is the precision's :attr:`Tolerance.reference`: "pytorch"
(fp32, fp16: checks 1 and 2, and 4 where it applies) or "vanilla" (the weight-only int8 / int4 graphs: check 3,
lossless relative to their own precision; 1 and 2 are recorded as agreement with fp32). A report on which the
reference generated no token at all (its first token EOS on every prompt) fails: nothing was compared.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import time
from importlib import resources
from pathlib import Path

import numpy as np

from medusa_runtime.contract.artifact import Artifact
from medusa_runtime.engines.kvcache import KVCache
from medusa_runtime.engines.ort import OrtEngine
from medusa_runtime.decode.loop import causal_mask, generate
from medusa_runtime.contract.manifest import Manifest
from medusa_runtime.front.prompts import read_first_turns
from medusa_runtime.trees.tree import make_tree

from ..model.decode import TorchEngine
from ..model.medusa import MedusaModel
from .independent import IndependentReference
from .report import (TOLERANCES, PromptReport, ValidationError, ValidationReport, compared_tokens,  # noqa: F401
                     tolerance, validation_summary)


def default_prompts() -> list[str]:
    """The project's own validation prompts (models/validation_prompts.jsonl)."""
    return read_prompts(Path(str(resources.files("medusa_models"))) / "validation_prompts.jsonl")


def read_prompts(path: str | Path, limit: int | None = None) -> list[str]:
    """First user turns from a JSONL file: records with "prompt", "turns" (MT-Bench) or "messages".

    The shared reader :func:`medusa_runtime.front.prompts.read_first_turns`.

    Raises:
        PromptFileError: the file is missing, a line is not a JSON object or has none of those keys.
    """
    return read_first_turns(path, limit)


def _max_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max()) if a.size else 0.0


def _first_difference(a: list[int], b: list[int]) -> int:
    """Index of the first differing token (the shorter length when one is a prefix of the other)."""
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _at(tokens: list[int], i: int) -> int | None:
    return tokens[i] if i < len(tokens) else None


@dataclass
class ReferenceRun:
    """One prompt through the references (the first phase of :func:`validate`).

    Attributes:
        prompt_ids: the prompt's token ids.
        steps: the loop reference's outputs of a prefill and of one tree step at that past (the engine-vs-engine
            step comparison).
        candidates: the tree step's input tokens (the reference's argmax chain padded with its top-k).
        tokens: the independent reference's greedy tokens (:mod:`~.independent`: what the artifact must emit).
        margins: float [len(tokens) + 1] or [len(tokens)]: the independent reference's top-1 minus top-2 log-prob
            at the prediction of generated token j.
        loop_tokens: the PyTorch reference's tokens through the runtime's decode loop with the artifact's tree
            (diagnostic); step_tokens: the tokens it accepted per tree step.
        seconds: the independent reference's wall time on this prompt.
    """

    prompt_ids: list[int]
    steps: tuple
    candidates: np.ndarray
    tokens: list[int]
    step_tokens: list[int]
    margins: np.ndarray
    loop_tokens: list[int] = field(default_factory=list)
    seconds: float = 0.0  # the independent reference's time on this prompt


def step_outputs(engine, prompt_ids: list[int], artifact: Artifact, candidates: np.ndarray | None = None):
    """A prefill then one tree step of ``artifact``'s tree on ``engine``; the tree step's tokens are
    ``candidates`` or, when None, this engine's argmax chain padded with its top-k.

    Returns:
        ((prefill StepResult, tree-step StepResult), candidates int64 [T]).
    """
    tree = artifact.tree
    n = len(prompt_ids)
    cache = KVCache.for_engine(engine, n + tree.size)
    out = engine.step(np.asarray(prompt_ids, np.int64)[None], np.arange(n, dtype=np.int64)[None], causal_mask(n), 1.0,
                      cache.past())
    cache.keep(out.new_kv, np.arange(n))
    b = tree.buffers()
    if candidates is None:
        candidates = out.topk_ids[-1][np.arange(tree.size) % out.topk_ids.shape[1]].astype(np.int64)
    out2 = engine.step(candidates[None], (n + b.depth)[None], b.attention_mask, 1.0, cache.past())
    return (out, out2), candidates


def step_differences(ref: tuple, art: tuple) -> tuple[float, float, float]:
    """max |diff| of (top-1 log-prob, entropy, hidden) between two engines' :func:`step_outputs`."""
    lp = max(_max_diff(a.topk_logprobs[:, 0], b.topk_logprobs[:, 0]) for a, b in zip(ref, art))
    ent = max(_max_diff(a.entropy, b.entropy) for a, b in zip(ref, art))
    hid = max(_max_diff(a.hidden, b.hidden) for a, b in zip(ref, art))
    return lp, ent, hid


def reference_runs(model, artifact: Artifact, prompts: list[list[int]], *, new_tokens: int = 64,
                   eos_token_ids: list[int] = (), progress: bool = True, engine=None,
                   independent: IndependentReference | None = None) -> list[ReferenceRun]:
    """The reference half of :func:`validate`: per prompt the independent reference's greedy tokens and top-2
    margins, and the loop reference's step outputs and tokens (the diagnostics).

    Args:
        model: the fp32 PyTorch reference (ignored when ``engine`` is given).
        artifact: the artifact whose tree, top-k and context are used.
        prompts: token ids per prompt.
        new_tokens, eos_token_ids: generation length and stops.
        progress: show a progress bar.
        engine: a loop reference engine (default: :class:`TorchEngine` over ``model``).
        independent: the independent reference (default: :class:`IndependentReference` of the engine's model).

    Returns:
        One :class:`ReferenceRun` per prompt.
    """
    from tqdm.auto import tqdm

    cap = artifact.model.max_context
    ref = engine or TorchEngine(model, artifact.manifest.step_topk, max_context=cap)
    independent = independent or IndependentReference(ref.model)
    runs = []
    for ids in tqdm(prompts, desc=f"validating: the references ({independent.kind}; PyTorch in the runtime's loop)",
                    disable=not progress, unit="prompt"):
        steps, candidates = step_outputs(ref, ids, artifact)
        steps = tuple(st._replace(new_kv=[]) for st in steps)  # kept until the comparison: its K/V are not compared
        loop = generate(ref, ids, artifact.tree, max_new_tokens=new_tokens, eos_token_ids=eos_token_ids,
                        max_context=cap)
        t0 = time.perf_counter()
        ind = independent.greedy(ids, max_new_tokens=new_tokens, eos_token_ids=eos_token_ids, max_context=cap)
        runs.append(ReferenceRun(list(ids), steps, candidates, ind.tokens, loop.step_tokens, ind.margins,
                                 loop.tokens, time.perf_counter() - t0))
    return runs


def exact_heads(manifest: Manifest) -> bool:
    """True when the artifact's graphs compute what the fp32 reference computes, heads included: an fp32
    backbone with fp32 heads over the whole vocabulary (not ``--heads-precision int8|int4`` nor
    ``--heads-vocab N``, whose candidates legitimately differ). Then the tokens accepted per tree step must
    equal the reference's (the module docstring's check 4)."""
    p = manifest.precision
    return (tolerance(p.name).exact and (p.heads or p.name) == "fp32"
            and not (manifest.heads_vocab is not None and manifest.heads_vocab.subset))


def graph_margins(engine, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """float [len(tokens) + 1]: the engine's top-1 minus top-2 log-prob of each prediction after ``prompt`` (for
    ``tokens[j]``, and the one after them), from one prefill of ``prompt + tokens``."""
    seq = list(prompt) + list(tokens)
    out = engine.step(np.asarray(seq, np.int64)[None], np.arange(len(seq), dtype=np.int64)[None], causal_mask(len(seq)),
                      1.0, KVCache.for_engine(engine, len(seq)).past())
    lp = out.topk_logprobs[len(prompt) - 1:]
    return (lp[:, 0] - lp[:, 1]) if lp.shape[1] > 1 else np.full(len(lp), np.inf)


def self_near_tie(manifest) -> float:
    """The near-tie margin of Medusa-vs-plain divergences of the artifact's graph form
    (:attr:`~medusa_export.export.precisions.GraphForm.near_tie`; 0: none)."""
    from ..export.config import FLAVOUR_GRAPHS
    from ..export.precisions import PRECISION_TABLE

    spec = PRECISION_TABLE.get(manifest.precision_name)
    form = spec.graphs.get(FLAVOUR_GRAPHS.get(manifest.flavour, "portable")) if spec else None
    return form.near_tie if form else 0.0


def _divergence(reference: list[int], tokens: list[int]) -> int | None:
    """First new token where ``tokens`` differ from ``reference`` (a shorter or longer run differs at the end of
    the shorter), or None when they are equal."""
    return None if tokens == reference else _first_difference(reference, tokens)


def _margin_at(run: ReferenceRun, i: int) -> float:
    return float(run.margins[min(i, len(run.margins) - 1)]) if len(run.margins) else float("inf")


def compare_runs(artifact: Artifact, runs: list[ReferenceRun], texts: list[str], *, new_tokens: int = 64,
                 eos_token_ids: list[int] = (), engine: OrtEngine | None = None, progress: bool = True,
                 reference: str = "") -> ValidationReport:
    """The ONNX Runtime half of :func:`validate`: the artifact's Medusa decoding (its tree) and plain decoding
    (a root-only tree) compared with the independent reference's tokens, the step outputs and tokens of the loop
    reference as the diagnostics.

    Args:
        artifact: the artifact.
        runs: :func:`reference_runs` of the same prompts.
        texts: the prompts' text (for the report).
        new_tokens, eos_token_ids: as the reference runs'.
        engine: an ONNX Runtime engine over the artifact (created when None).
        progress: show a progress bar.
        reference: how the report names the independent reference (:attr:`IndependentReference.description`).

    Returns:
        The report; ``passed`` applies the precision's rule.

    Raises:
        ValidationError: the artifact's precision has no rule in :data:`TOLERANCES`.
    """
    from tqdm.auto import tqdm

    precision = artifact.manifest.precision_name
    tol = tolerance(precision)
    root = make_tree([], num_heads=artifact.model.medusa_heads, topk=artifact.tree.topk)
    eng = engine or OrtEngine(artifact)
    caps = eng.capabilities
    regime = ", ".join(filter(None, (f"one-token steps as {caps.min_rows} rows" if caps.min_rows > 1 else "",
                                     "chain trees" if caps.chain_trees else "")))
    report = ValidationReport(precision, new_tokens, reference=reference,
                              reference_seconds=round(sum(r.seconds for r in runs), 2), regime=regime)
    compare_accepted = exact_heads(artifact.manifest)
    self_tie = self_near_tie(artifact.manifest)
    kw = dict(max_new_tokens=new_tokens, eos_token_ids=eos_token_ids, max_context=artifact.model.max_context)
    desc = "validating: ONNX Runtime, Medusa and plain, against the reference"
    for run, text in tqdm(list(zip(runs, texts)), desc=desc, disable=not progress, unit="prompt"):
        lp, ent, hid = step_differences(run.steps, step_outputs(eng, run.prompt_ids, artifact, run.candidates)[0])
        a = generate(eng, run.prompt_ids, artifact.tree, **kw)
        v = a if artifact.tree.size == 1 else generate(eng, run.prompt_ids, root, **kw)  # a root-only tree *is* plain greedy
        rep = PromptReport(text, len(run.tokens), run.tokens == a.tokens, lp, ent, hid,
                           vanilla_identical=v.tokens == a.tokens, mean_accepted=round(a.mean_accepted, 4),
                           plain_identical=run.tokens == v.tokens, loop_identical=run.loop_tokens == run.tokens,
                           engine_divergence=_divergence(run.loop_tokens, a.tokens))
        if compare_accepted and rep.identical:  # diverging tokens already fail, and accept differently anyway
            rep.accept_identical = a.step_tokens == run.step_tokens
            if not rep.accept_identical:
                j = _first_difference(run.step_tokens, a.step_tokens)
                rep.accept_divergence_step = j + 1
                rep.reference_accepted, rep.artifact_accepted = _at(run.step_tokens, j), _at(a.step_tokens, j)
        if not rep.vanilla_identical:
            j = _first_difference(v.tokens, a.tokens)
            rep.vanilla_divergence, rep.vanilla_token, rep.medusa_token = j, _at(v.tokens, j), _at(a.tokens, j)
            if self_tie:
                rep.vanilla_margin = round(float(graph_margins(eng, run.prompt_ids, v.tokens[:j])[-1]), 5)
                rep.vanilla_near_tie = rep.vanilla_margin < self_tie
        if not rep.plain_identical:
            j = _first_difference(run.tokens, v.tokens)
            rep.plain_divergence, rep.plain_token, rep.plain_margin = j, _at(v.tokens, j), _margin_at(run, j)
            rep.plain_near_tie = not tol.exact and rep.plain_margin < tol.margin
        if not rep.identical:
            i = _first_difference(run.tokens, a.tokens)
            rep.first_divergence = i
            rep.reference_token, rep.artifact_token = _at(run.tokens, i), _at(a.tokens, i)
            rep.divergence_step = int(np.searchsorted(np.cumsum([1] + a.step_tokens), i, side="right"))
            rep.reference_margin = _margin_at(run, i)
            rep.near_tie = not tol.exact and rep.reference_margin < tol.margin
            rep.agreement = i / max(1, len(run.tokens))
        report.prompts.append(rep)
    return report


def validate(
    artifact: Artifact,
    model: MedusaModel,
    prompts: list[list[int]],
    texts: list[str],
    *,
    new_tokens: int = 64,
    eos_token_ids: list[int] = (),
    engine: OrtEngine | None = None,
    progress: bool = True,
) -> ValidationReport:
    """Validate the artifact's ONNX Runtime graphs (module docstring: the three checks).

    Two phases: the reference's runs of every prompt (:func:`reference_runs`), then the artifact's
    (:func:`compare_runs`); a caller short of memory runs the first, drops the model, then the second.

    Args:
        artifact: the artifact (its tree is used).
        model: the fp32 PyTorch reference.
        prompts: token ids per prompt (chat template applied).
        texts: the prompts' text (for the report).
        new_tokens: greedy tokens compared per prompt.
        eos_token_ids: generation stops at these (both sides).
        engine: an ONNX Runtime engine over the artifact (created when None).
        progress: show a progress bar.

    Returns:
        The report; ``passed`` applies the precision's :class:`Tolerance`.

    Raises:
        ValidationError: the artifact's precision has no rule in :data:`TOLERANCES`.
    """
    tolerance(artifact.manifest.precision_name)  # an unknown precision fails before any work
    independent = IndependentReference(model)
    runs = reference_runs(model, artifact, prompts, new_tokens=new_tokens, eos_token_ids=eos_token_ids,
                          progress=progress, independent=independent)
    return compare_runs(artifact, runs, texts, new_tokens=new_tokens, eos_token_ids=eos_token_ids, engine=engine,
                        progress=progress, reference=independent.description)
