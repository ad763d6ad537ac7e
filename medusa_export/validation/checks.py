"""Running the validation checks a :class:`~.plan.ValidationPlan` chose, for ``build`` and ``verify``.

Each check returns a JSON-ready record with ``passed``; :func:`run_checks` collects them into the
manifest's ``validation`` (the full check's report stays at the top level, as before; the others are
under their names, and ``ran`` / ``skipped`` say what ran and why the rest did not).
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

from medusa_runtime.contract.artifact import Artifact, load_artifact
from medusa_runtime.engines.ort import OrtEngine
from medusa_runtime.decode.loop import generate
from medusa_runtime.contract.manifest import Manifest, as_manifest
from medusa_runtime.trees.tree import make_tree

from ..export.build import write_artifact
from ..export.config import ExportConfig
from ..loading.sources import ModelSources, reference_model
from ..model.decode import TorchEngine
from .config import ValidationConfig
from .plan import CHECK_TEXT, SELF_CHECK_LIMIT, SELF_CHECK_TOKENS, ValidationPlan
from .independent import IndependentReference
from .report import NOTHING_COMPARED
from .validate import compare_runs, default_prompts, reference_runs


#: Session config of the validation's ONNX Runtime sessions over float32 graphs: without MatMul pre-packing
#: the weights stay in the memory-mapped weights file (page cache) instead of pre-packed anonymous copies.
#: Measured on the embedded model's fp32 artifact (543 MB): resident growth after three prefill steps 685 MB
#: (138 MB anonymous) instead of 912 MB (779 MB anonymous), step time not slower. Quantized graphs keep it:
#: MatMulNBits without pre-packing ran 2.5-3x slower and used no less memory.
FP32_SESSION_CONFIG = {"session.disable_prepacking": "1"}


def validation_engine(artifact: Artifact) -> OrtEngine:
    """An ONNX Runtime engine over ``artifact`` for validation (:data:`FP32_SESSION_CONFIG` for float32 graphs)."""
    fp32 = artifact.manifest.precision_name == "fp32" and "MatMulNBits" not in (artifact.manifest.flavour_note or "")
    return OrtEngine(artifact, session_config=FP32_SESSION_CONFIG if fp32 else None)


def prompt_ids(lm, prompts: list[str] | None) -> tuple[list[str], list[list[int]]]:
    """(texts, token ids) of the validation prompts (the project's own by default), chat template applied."""
    from ..chat import apply_chat_template

    texts = prompts or default_prompts()
    ids = [apply_chat_template(lm.tokenizer, lm.chat_template, [{"role": "user", "content": t}]) for t in texts]
    return texts, ids


def check_prompts_fit(texts: list[str], ids: list[list[int]], max_context: int, new_tokens: int) -> list[str]:
    """Before the export: every validation prompt must fit the context the artifact is built for.

    A prompt longer than ``max_context`` could not be run at all (the build failed after the export); one that
    fits without room for ``new_tokens`` more is compared on fewer tokens, which the returned notes say.

    Args:
        texts: the prompts (user messages), for the messages.
        ids: their token ids, chat template applied (:func:`prompt_ids`).
        max_context: the artifact's KV capacity in tokens.
        new_tokens: greedy tokens compared per prompt.

    Returns:
        One note per prompt compared on fewer than ``new_tokens`` tokens (the context fills first).

    Raises:
        ContextOverflowError: a prompt has more tokens than ``max_context``; the message names it and what to do.
    """
    from ..errors import ContextOverflowError

    longest = max(range(len(ids)), key=lambda i: len(ids[i]))
    if len(ids[longest]) >= max_context:
        raise ContextOverflowError(
            f"validation prompt {longest + 1} ({texts[longest][:40]!r}) has {len(ids[longest])} tokens with the chat "
            f"template, which leaves no room in --max-context {max_context}: give --max-context "
            f">= {len(ids[longest]) + new_tokens} (the prompt and --max-new-tokens {new_tokens}), shorter prompts "
            "with --prompt-file, or --no-validate")
    return [f"validation prompt {i + 1} has {len(p)} tokens: with --max-new-tokens {new_tokens} it needs "
            f"{len(p) + new_tokens} > --max-context {max_context}, so it is compared on fewer tokens"
            for i, p in enumerate(ids) if len(p) + new_tokens > max_context]


def check_full(artifact: Artifact, lm, src: ModelSources, texts, ids, new_tokens: int, progress: bool) -> dict:
    """The whole artifact against the whole reference (:func:`~.validate.validate`, reference phase first)."""
    ref = lm.model if lm.model is not None else reference_model(src)  # loaded, or streamed from the sources
    runs, reference = reference_phase(ref, artifact, lm, ids, new_tokens, progress)
    del ref
    return artifact_phase(artifact, lm, texts, runs, new_tokens, progress, reference)


def reference_phase(ref, artifact: Artifact, lm, ids, new_tokens: int, progress: bool, engine=None):
    """The references' runs over ``ref`` (the fp32 PyTorch reference model): the independent reference
    (:class:`~.independent.IndependentReference`) and the loop reference (``engine``, default a CPU
    :class:`TorchEngine`). The caller drops ``ref`` before :func:`artifact_phase` (memory).

    Args:
        ref: the reference :class:`~medusa_export.model.medusa.MedusaModel` (whole or truncated, any device).
        artifact: the artifact under test (its tree, step top-k and context).
        lm: the model's :class:`~medusa_export.loading.registry.LoadedMedusa` (its EOS ids).
        ids: token ids per prompt.
        new_tokens: greedy tokens per prompt.
        progress: progress bars.
        engine: the loop reference's engine (default: a :class:`TorchEngine` over ``ref``).

    Returns:
        (the :class:`~.validate.ReferenceRun` of each prompt, the independent reference's description).
    """
    independent = IndependentReference(ref)
    runs = reference_runs(ref, artifact, ids, new_tokens=new_tokens, eos_token_ids=lm.eos_token_ids,
                          progress=progress, engine=engine, independent=independent)
    return runs, independent.description


def artifact_phase(artifact: Artifact, lm, texts, runs, new_tokens: int, progress: bool, reference: str) -> dict:
    """The artifact's runs on ONNX Runtime against :func:`reference_phase`'s.

    Args:
        artifact: the artifact under test.
        lm: the model (its EOS ids).
        texts: the prompts' text; runs: :func:`reference_phase`'s runs of them.
        new_tokens: greedy tokens per prompt; progress: progress bars.
        reference: the independent reference's description (the report names it).

    Returns:
        The :class:`~.report.ValidationReport` as JSON.
    """
    return compare_runs(artifact, runs, texts, new_tokens=new_tokens, eos_token_ids=lm.eos_token_ids,
                        engine=validation_engine(artifact), progress=progress, reference=reference).to_json()


def truncated_export(manifest: Manifest) -> ExportConfig:
    """The export options of the truncated check's artifact: those the artifact under test records (its step
    graph, batch size and context: :meth:`~medusa_export.export.config.ExportConfig.of_manifest`) in fp32, the
    heads in fp32 over the whole vocabulary."""
    return ExportConfig.of_manifest(manifest, precision="fp32")


def check_truncated(folder: Path, lm, src: ModelSources, layers: int, artifact: Artifact, texts, ids,
                    new_tokens: int, progress: bool) -> dict:
    """(a) The same exporter on the first ``layers`` layers in fp32 (same graph flavour, real final norm, lm_head
    and heads; :func:`truncated_export`) against the reference of the same truncation: greedy tokens identical
    (fp32 rule)."""
    sub = folder.parent / f".{folder.name}.truncated"
    shutil.rmtree(sub, ignore_errors=True)
    sub.mkdir()
    try:
        tsrc = ModelSources(src.backbone, src.heads, src.config.truncated(layers), src.heads_config)
        write_artifact(sub, lm, tsrc, artifact.tree, truncated_export(artifact.manifest), artifact.model.max_context,
                       progress=False)
        truncated = load_artifact(sub)
        ref = reference_model(src, layers)
        runs, reference = reference_phase(ref, truncated, lm, ids, new_tokens, progress)
        del ref
        report = artifact_phase(truncated, lm, texts, runs, new_tokens, progress, reference)
    finally:
        shutil.rmtree(sub, ignore_errors=True)
    return {"layers": layers, **report}


def check_checksums(folder: Path, manifest: Manifest | dict, src: ModelSources, vocab_ids, progress: bool) -> dict:
    """(b) Every tensor of ``weights.bin`` against its recorded SHA-256: read back and re-made from the sources."""
    from tqdm.auto import tqdm

    from ..export.heads_graph import VOCAB_IDS
    from ..export.weights import WeightsCheckError, verify_weights

    m = as_manifest(manifest)
    records = m.weights.records
    if records is None:  # Q/DQ weights (build --graph portable --precision int8|fp8|int4): derived, no recipes
        import hashlib

        bad = []
        for rel in (m.weights.file, *(g.file for g in m.graphs.values())):
            h = hashlib.sha256()
            with open(folder / rel, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 24), b""):
                    h.update(chunk)
            if rel not in m.checksums or h.hexdigest() != m.checksums[rel].sha256:
                bad.append(rel)
        note = ("files only: the Q/DQ weights are made from the float16 ones by the rewrite, which has no per-tensor "
                "checkpoint recipe; weights.bin and the graphs re-read against the manifest's SHA-256")
        if bad:
            return {"passed": False, "error": f"{', '.join(bad)} differ from the manifest's SHA-256 ({note})"}
        return {"passed": True, "tensors": m.weights.tensors, "bytes": m.weights.bytes, "files_only": note}
    total = sum(r["length"] for r in records)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="checksums (weights.bin)", disable=not progress,
               mininterval=0.5, leave=False)
    arrays = {VOCAB_IDS: np.asarray(vocab_ids, np.int64)} if vocab_ids is not None else {}
    try:
        info = verify_weights(folder, records, src.by_name, arrays, lambda n, _: bar.update(n))
        return {"passed": True, **info}
    except WeightsCheckError as exc:
        return {"passed": False, "error": str(exc)}
    finally:
        bar.close()


def check_self(artifact: Artifact, lm, texts, ids, new_tokens: int, progress: bool) -> dict:
    """(c) The whole artifact through ONNX Runtime: Medusa greedy equals plain greedy (root-only tree) of the
    same graph. Artifacts over :data:`~.plan.SELF_CHECK_LIMIT` bytes decode fewer tokens of one prompt."""
    from tqdm.auto import tqdm

    big = artifact.manifest.weights.bytes > SELF_CHECK_LIMIT
    if big:
        texts, ids, new_tokens = texts[:1], ids[:1], min(new_tokens, SELF_CHECK_TOKENS)
    from .validate import graph_margins, self_near_tie

    eng = validation_engine(artifact)
    tie = self_near_tie(artifact.manifest)
    root = make_tree([], num_heads=artifact.model.medusa_heads, topk=artifact.tree.topk)
    kw = dict(max_new_tokens=new_tokens, eos_token_ids=lm.eos_token_ids, max_context=artifact.model.max_context)
    prompts = []
    for text, pid in tqdm(list(zip(texts, ids)), desc="validating: Medusa vs plain greedy (ONNX Runtime)",
                          disable=not progress, unit="prompt"):
        m = generate(eng, pid, artifact.tree, **kw)
        v = generate(eng, pid, root, **kw)
        j = next((i for i, (a, b) in enumerate(zip(m.tokens, v.tokens)) if a != b), None)
        if j is None and len(m.tokens) != len(v.tokens):
            j = min(len(m.tokens), len(v.tokens))
        rec = {"prompt": text, "tokens": len(v.tokens), "identical": j is None, "first_divergence": j,
               "steps": m.steps, "plain_steps": v.steps}
        if j is not None and tie:  # a float16 Q/DQ graph: its own near-ties are reported, not failures
            rec["margin"] = round(float(graph_margins(eng, pid, v.tokens[:j])[-1]), 5)
            rec["near_tie"] = rec["margin"] < tie
        prompts.append(rec)
    return {"passed": all(p["identical"] or p.get("near_tie") for p in prompts) and any(p["tokens"] for p in prompts),
            "new_tokens": new_tokens, "prompts": prompts, "reduced": big}


def check_gpu(artifact: Artifact, lm, src: ModelSources, texts, ids, new_tokens: int, progress: bool,
              device: str = "cuda") -> dict:
    """(d) The whole fp32 reference on the GPU (weights streamed there tensor by tensor) against the artifact on
    ONNX Runtime: the full check's rules, with the reference's memory on the device."""
    ref = reference_model(src, None, device)
    engine = TorchEngine(ref, artifact.manifest.step_topk, max_context=artifact.model.max_context, device=device)
    runs, reference = reference_phase(ref, artifact, lm, ids, new_tokens, progress, engine)
    del ref, engine
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return artifact_phase(artifact, lm, texts, runs, new_tokens, progress, reference)


def check_record(result: dict, check: str) -> dict:
    """One check's record in a :func:`run_checks` result: the full check's report is the result's top level,
    every other check's record is under its name.

    Raises:
        KeyError: ``check`` did not run (it is not in ``result["ran"]``).
    """
    return result if check == "full" else result[check]


def result_lines(result: dict) -> list[str]:
    """``verify``'s lines for a :func:`run_checks` result: one per prompt of each check that compares prompts
    (its tokens against the reference: identical, near-tie with its step and margin, or MISMATCH; what else
    failed is in the result's ``failures``), one for passed checksums.

    Args:
        result: ``run_checks``'s dict.

    Returns:
        The lines, in the order the checks ran.
    """
    from .report import ValidationReport, near_tie_note

    lines = []
    for check in result["ran"]:
        rec = check_record(result, check)
        if "tolerance" in rec:  # a parity check's report
            report = ValidationReport.from_json(rec)
            for p, raw in zip(report.prompts, rec["prompts"]):
                note = near_tie_note(raw)
                same = p.identical and p.plain_identical is not False
                status = "identical" if same else ("near-tie" if note and report.failure(p) is None else "MISMATCH")
                lines.append(f"{check:9s} {status:9s} {p.tokens:4d} tokens  log-prob diff {p.max_logprob_diff:.1e}  "
                             f"{p.prompt[:60]!r}" + (f"  ({note})" if note else ""))
            if report.reference:
                lines.append(f"{check:9s} reference: {report.reference}")
        else:
            for p in rec.get("prompts", []):
                lines.append(f"{check:9s} {'identical' if p['identical'] else 'MISMATCH':9s} {p['tokens']:4d} tokens  "
                             f"{p['prompt'][:60]!r}")
        if check == "checksums" and rec["passed"] and rec.get("files_only"):
            lines.append(f"checksums {rec['tensors']} tensors ({rec['bytes'] / 1e9:.2f} GB): {rec['files_only']}")
        elif check == "checksums" and rec["passed"]:
            lines.append(f"checksums {rec['tensors']} tensors ({rec['bytes'] / 1e9:.2f} GB) re-read and re-made from "
                         "the checkpoint")
    return lines


def passed_notes(result: dict) -> list[str]:
    """What a PASSED verdict rests on besides identical tokens: each near-tie of each parity check that ran.

    Args:
        result: ``run_checks``'s dict.

    Returns:
        One line per near-tie, e.g. "full prompt 1: near-tie at new token 12 (tree step 10), reference top-2
        log-prob margin 5.00e-04".
    """
    from .report import near_tie_note

    return [f"{check} prompt {i + 1}: {note}" for check in result["ran"]
            for i, p in enumerate(check_record(result, check).get("prompts", [])) if (note := near_tie_note(p))]


def self_failure(prompt: dict) -> str | None:
    """The self check's failure message for one prompt record of :func:`check_self`, or None when Medusa's
    tokens equal plain greedy decoding's."""
    if prompt["identical"]:
        return None
    return (f"{prompt['prompt'][:40]!r}: Medusa diverges from plain greedy of the same graph at new token "
            f"{prompt['first_divergence']}")


def _failure(name: str, record: dict) -> list[str]:
    if record.get("passed", True):
        return []
    if name == "checksums":
        return [f"checksums: {record['error']}"]
    if name == "self":
        if not any(p["tokens"] for p in record["prompts"]):
            return [f"self: {NOTHING_COMPARED}"]
        return [f"self: {self_failure(p)}" for p in record["prompts"] if not p["identical"]]
    from .validate import ValidationReport

    report = ValidationReport.from_json(record)
    return [f"{name}: {f}" for f in report.failures()]


def run_checks(plan: ValidationPlan, folder: Path, lm, src: ModelSources, cfg: ValidationConfig = ValidationConfig(),
               *, prompts: list[str] | None = None, vocab_ids=None, progress: bool = True,
               new_tokens: int | None = None) -> dict:
    """Run ``plan.checks`` on the artifact in ``folder``; the manifest's ``validation`` record.

    Args:
        plan: the checks chosen (:func:`~.plan.plan_validation`).
        folder: the artifact (its manifest on disk is read, as a runtime would; the truncated check re-exports
            with the options it records).
        lm: the model (tokenizer, chat template, eos ids; ``model`` when loaded).
        src: the model's tensor sources (the reference and the re-made tensors).
        cfg: the validation's options; ``new_tokens``: greedy tokens compared per prompt.
        prompts: user messages (default: the project's own).
        vocab_ids: the heads' token subset the artifact was built with (the checksums check re-makes it).
        progress: progress lines and bars.
        new_tokens: instead of ``cfg.new_tokens``.

    Returns:
        ``{"passed", "ran", "skipped", "plan", "failures", "seconds", <check>: record ...}``; the full check's
        report (precision, tolerance, prompts, ...) is also merged at the top level, as before this plan existed.
    """
    say = (lambda line: print(f"    {line}", file=sys.stderr, flush=True)) if progress else (lambda line: None)
    artifact = load_artifact(folder)
    manifest = artifact.manifest
    texts, ids = prompt_ids(lm, prompts)
    n = cfg.new_tokens if new_tokens is None else new_tokens
    out: dict = {}
    seconds = {}
    for check in plan.checks:
        t0 = time.perf_counter()
        say(f"{check}: {CHECK_TEXT[check].format(layers=plan.layers)}")
        if check == "full":
            out[check] = check_full(artifact, lm, src, texts, ids, n, progress)
        elif check == "truncated":
            out[check] = check_truncated(folder, lm, src, plan.layers, artifact, texts, ids, n, progress)
        elif check == "checksums":
            out[check] = check_checksums(folder, manifest, src, vocab_ids, progress)
        elif check == "self":
            out[check] = check_self(artifact, lm, texts, ids, n, progress)
        elif check == "gpu":
            out[check] = check_gpu(artifact, lm, src, texts, ids, n, progress)
        seconds[check] = round(time.perf_counter() - t0, 2)
        say(f"{check}: {'passed' if out[check]['passed'] else 'FAILED'} in {seconds[check]:.1f}s")
    failures = [f for c in plan.checks for f in _failure(c, out[c])]
    result = {**out.get("full", {}), "passed": not failures, "ran": list(plan.checks), "skipped": plan.skipped,
              "failures": failures, "seconds": seconds, "plan": plan.to_json()}
    result.update({c: r for c, r in out.items() if c != "full"})
    return result
