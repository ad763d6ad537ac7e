"""The validation's report: per-prompt records, the pass/fail rule of each precision, the summary line.

:class:`ValidationReport` is what :func:`~.validate.compare_runs` returns and what the manifest's ``validation``
record holds (``to_json`` / ``from_json``); :func:`validation_summary` is the one line ``build`` and ``verify`` print.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from medusa_runtime.errors import EXIT_MISMATCH

from ..errors import MedusaError
from ..export.precisions import Column, Tolerance


class ValidationError(MedusaError):
    """The artifact disagrees with the PyTorch reference; the message gives the first divergence."""

    exit_code = EXIT_MISMATCH  # as `verify`'s: a mismatch, not bad input


#: The failure of a check on which no token was generated on any prompt (not a pass: nothing was compared).
NOTHING_COMPARED = ("nothing compared: no token was generated on any prompt (the first new token is EOS, or no room "
                    "or budget for one); give prompts the model answers (--prompt-file) or more --max-new-tokens")

#: precision name -> its validation rule (:class:`~medusa_export.export.precisions.Tolerance`), from the table.
TOLERANCES = Column("tolerance")


def tolerance(precision: str) -> Tolerance:
    """The pass/fail rule of ``precision``.

    Raises:
        ValidationError: an unknown precision name (the message lists the known ones).
    """
    if precision not in TOLERANCES:
        raise ValidationError(f"no validation rule for precision {precision!r}; known: {', '.join(TOLERANCES)}")
    return TOLERANCES[precision]


@dataclass
class PromptReport:
    """One prompt's comparison (a record of the manifest's ``validation.prompts``).

    "The reference" is the independent one (:mod:`~.independent`: plain greedy decoding in PyTorch that shares no
    code with the runtime's decode loop, KV cache, tree buffers or acceptance); "the loop reference" is the PyTorch
    reference driven by the runtime's own loop, compared only as a diagnostic of where a mismatch starts.
    """

    prompt: str
    tokens: int  # new tokens the reference generated (and the artifact is compared on)
    identical: bool  # the artifact's Medusa tokens (its own tree) == the reference's
    max_logprob_diff: float  # step outputs, artifact vs loop reference on the same inputs
    max_entropy_diff: float
    max_hidden_diff: float
    first_divergence: int | None = None  # index in the generated tokens
    divergence_step: int | None = None  # the artifact's tree step that emitted it (0 = the prefill's token)
    reference_token: int | None = None
    artifact_token: int | None = None
    reference_margin: float | None = None  # the reference's top-1 minus top-2 log-prob at that position
    near_tie: bool = False
    agreement: float = 1.0  # fraction of generated positions before the first divergence
    vanilla_identical: bool | None = None  # Medusa == plain greedy (root-only tree) on the same engine
    vanilla_divergence: int | None = None  # first differing new token
    vanilla_token: int | None = None  # plain greedy's token there (Medusa's: ``medusa_token``)
    medusa_token: int | None = None
    vanilla_margin: float | None = None  # the graph's own top-1 minus top-2 log-prob where plain greedy and Medusa part
    vanilla_near_tie: bool = False  # below the graph form's near_tie (float16 Q/DQ graphs): reported, not a failure
    #: the tokens each tree step accepted equal the loop reference's (None: not compared, :func:`exact_heads`)
    accept_identical: bool | None = None
    accept_divergence_step: int | None = None  # first tree step (1 = the first after the prefill) that differs
    reference_accepted: int | None = None  # tokens that step emitted: the loop reference's, the artifact's
    artifact_accepted: int | None = None
    mean_accepted: float | None = None  # the artifact's tokens per tree step (information)
    #: the artifact's plain decoding (root-only tree) == the reference (None: not compared)
    plain_identical: bool | None = None
    plain_divergence: int | None = None  # first differing new token, the artifact's plain token there, the margin
    plain_token: int | None = None
    plain_margin: float | None = None
    plain_near_tie: bool = False
    #: diagnostic: the PyTorch reference through the runtime's loop (the artifact's tree) == the reference
    loop_identical: bool | None = None
    #: diagnostic: first new token where the artifact and the loop reference differ (None: they agree)
    engine_divergence: int | None = None


def _where(p: PromptReport) -> str:
    """Where a mismatch with the reference starts, from the diagnostics (engine vs engine in the same loop)."""
    if p.loop_identical is None:
        return ""
    if p.engine_divergence is None:
        return ("; the PyTorch reference through the runtime's decode loop gives the artifact's tokens, so the fault "
                "is in code both share (the decode loop, KV cache and compaction, tree buffers or acceptance)")
    loop = ("it equals the reference there, so the fault is in the artifact's graphs" if p.loop_identical
            else "it also differs from the reference")
    return (f"; the artifact and the PyTorch reference through the runtime's decode loop first differ at new token "
            f"{p.engine_divergence} ({loop})")


@dataclass
class ValidationReport:
    """Every prompt's comparison under one precision's rule (:func:`tolerance`).

    Attributes:
        precision: the artifact's precision name.
        new_tokens: the tokens asked for per prompt.
        prompts: one :class:`PromptReport` per prompt.
        reference: how the reference is named (:data:`~.independent.REFERENCE_TEXT`; "" in records written
            before it existed).
        reference_seconds: the independent reference's time over every prompt (None: not measured).
        regime: how the engine ran the steps when the manifest's ``precision.step_rows`` asks for a regime (e.g.
            "one-token steps as 2 rows, chain trees"), "" otherwise.
    """

    precision: str
    new_tokens: int
    prompts: list[PromptReport] = field(default_factory=list)
    reference: str = ""
    reference_seconds: float | None = None
    regime: str = ""

    @staticmethod
    def from_json(record: dict) -> "ValidationReport":
        """A check's record in the manifest (``precision``, ``new_tokens``, ``prompts``) as a report."""
        return ValidationReport(record["precision"], record["new_tokens"],
                                [PromptReport(**p) for p in record["prompts"]], record.get("reference", ""),
                                record.get("reference_seconds"), record.get("regime", ""))

    def failure(self, p: PromptReport) -> str | None:
        """Why prompt ``p`` fails (one line), or None when it passes."""
        tol = tolerance(self.precision)
        if not any(q.tokens for q in self.prompts):
            return f"{p.prompt[:40]!r}: {NOTHING_COMPARED}"
        if tol.reference == "vanilla":
            if p.vanilla_identical is False and not p.vanilla_near_tie:
                margin = "" if p.vanilla_margin is None else f", the graph's top-2 log-prob margin {p.vanilla_margin}"
                return (f"{p.prompt[:40]!r}: Medusa diverges from plain greedy decoding of the same "
                        f"{self.precision} graph at new token {p.vanilla_divergence}: Medusa {p.medusa_token}, "
                        f"plain greedy {p.vanilla_token}{margin}")
            return None
        if not (p.max_logprob_diff <= tol.atol and p.max_entropy_diff <= tol.atol
                and p.max_hidden_diff <= tol.hidden_atol):
            return (f"{p.prompt[:40]!r}: step outputs differ (log-prob {p.max_logprob_diff:.2e}, "
                    f"entropy {p.max_entropy_diff:.2e}, hidden {p.max_hidden_diff:.2e}; "
                    f"tolerance {tol.atol:g}/{tol.hidden_atol:g})")
        ref = f"the reference ({self.reference})" if self.reference else "the reference"
        if not (p.identical or p.near_tie):
            return (f"{p.prompt[:40]!r}: Medusa's greedy tokens diverge from {ref} at new token {p.first_divergence} "
                    f"(tree step {p.divergence_step}): reference {p.reference_token}, artifact {p.artifact_token}, "
                    f"reference top-2 log-prob margin {_fmt(p.reference_margin)}{_where(p)}")
        if p.plain_identical is False and not p.plain_near_tie:
            return (f"{p.prompt[:40]!r}: plain greedy decoding (root-only tree) of the artifact diverges from {ref} at "
                    f"new token {p.plain_divergence}: artifact {p.plain_token}, reference top-2 log-prob margin "
                    f"{_fmt(p.plain_margin)}{_where(p)}")
        if p.accept_identical is False:
            return (f"{p.prompt[:40]!r}: greedy tokens identical, but the tokens accepted per tree step differ from "
                    f"the reference's at tree step {p.accept_divergence_step}: reference {p.reference_accepted}, "
                    f"artifact {p.artifact_accepted} (the heads graph proposes other candidates than the reference's "
                    "heads)")
        return None

    @property
    def passed(self) -> bool:
        """Every prompt's step outputs within tolerance and tokens identical (or a near-tie), and at least one token
        compared."""
        return all(self.failure(p) is None for p in self.prompts)

    def failures(self) -> list[str]:
        """One line per failing prompt."""
        return [f for f in map(self.failure, self.prompts) if f is not None]

    def to_json(self) -> dict:
        tol = tolerance(self.precision)
        return {"precision": self.precision, "new_tokens": self.new_tokens, "passed": self.passed,
                "reference": self.reference, "reference_seconds": self.reference_seconds, "regime": self.regime,
                "checks": _CHECKS[tol.reference], "tolerance": asdict(tol), "prompts": [asdict(p) for p in self.prompts]}

    def summary(self) -> str:
        """One line for the build summary (:func:`validation_summary`)."""
        return validation_summary(self.to_json())


def _fmt(margin: float | None) -> str:
    return "n/a" if margin is None else f"{margin:.2e}"


def near_tie_note(p: dict) -> str | None:
    """The near-tie of one prompt record (its step and margin), or None when it has none.

    Args:
        p: a :class:`PromptReport` as a dict (``asdict``).

    Returns:
        E.g. "near-tie at new token 12 (tree step 10), reference top-2 log-prob margin 5.00e-04", or for plain
        decoding "plain decoding near-tie at new token 12, ...".
    """
    notes = []
    if p.get("near_tie"):
        notes.append(f"near-tie at new token {p['first_divergence']} (tree step {p['divergence_step']}), "
                     f"reference top-2 log-prob margin {_fmt(p['reference_margin'])}")
    if p.get("plain_near_tie"):
        notes.append(f"plain decoding near-tie at new token {p['plain_divergence']}, reference top-2 log-prob margin "
                     f"{_fmt(p['plain_margin'])}")
    return "; ".join(notes) or None


def validation_summary(v: dict) -> str:
    """One line from the manifest's ``validation``: the verdict and the figures it rests on, per check that ran
    (for weight-only precisions, agreement with fp32 as well)."""
    head = f"{'PASSED' if v['passed'] else 'FAILED'}: "
    ran = v.get("ran", ["full"])
    parts = []
    for check in ran:
        if check == "full":
            parts.append(_report_summary(v))
        elif check in ("truncated", "gpu"):
            where = f"first {v[check]['layers']} layer(s)" if check == "truncated" else "whole model on the GPU"
            parts.append(f"{check} ({where}): " + _report_summary(v[check]))
        elif check == "checksums":
            c = v[check]
            parts.append(f"checksums: {c['tensors']} tensors ({c['bytes'] / 1e9:.2f} GB) re-read and re-made from the "
                         f"checkpoint" if c["passed"] else f"checksums: {c.get('error')}")
        elif check == "self":
            c = v[check]
            same = sum(p["identical"] for p in c["prompts"])
            parts.append(f"self: Medusa == plain greedy of the same graph on {same}/{len(c['prompts'])} prompts x "
                         f"{compared_tokens(c['prompts'], c['new_tokens'])}")
    return head + "; ".join(parts)


def compared_tokens(prompts: list[dict], new_tokens: int) -> str:
    """"64 tokens" when every prompt was compared on ``new_tokens`` tokens, else each prompt's real count
    ("23/48/38 of 64 tokens ..."): a prompt stops early at EOS or when the context is full."""
    counts = [p["tokens"] for p in prompts]
    if all(n == new_tokens for n in counts):
        return f"{new_tokens} tokens"
    return f"{'/'.join(map(str, counts))} of {new_tokens} tokens (fewer where EOS came or the context was full)"


def _report_summary(v: dict) -> str:
    prompts, n = v["prompts"], len(v["prompts"])
    same = sum(p["identical"] for p in prompts)
    ref = v.get("reference") or "the fp32 PyTorch reference"
    if v["tolerance"].get("reference") == "vanilla":
        lossless = sum(bool(p.get("vanilla_identical")) for p in prompts)
        ties = [f"token {p['vanilla_divergence']}, margin {p['vanilla_margin']}" for p in prompts
                if p.get("vanilla_near_tie")]
        agree = ", ".join(str(p["tokens"] if p["first_divergence"] is None else p["first_divergence"]) for p in prompts)
        regime = f" (steps: {v['regime']})" if v.get("regime") else ""
        return (f"Medusa == plain greedy of the same graph{regime} on {lossless}/{n} prompts x "
                f"{compared_tokens(prompts, v['new_tokens'])}"
                + (f" (near-ties of the graph's own rounding on {len(ties)}: {'; '.join(ties)})" if ties else "") + "; "
                f"vs {ref} (information): identical on {same}/{n}, tokens before the first divergence {agree}")
    both = sum(p["identical"] and p.get("plain_identical") is not False for p in prompts)
    worst = max((p["max_logprob_diff"] for p in prompts), default=0.0)
    what = "Medusa and plain greedy tokens" if any(p.get("plain_identical") is not None for p in prompts) \
        else "greedy tokens"
    took = "" if v.get("reference_seconds") is None else f", {v['reference_seconds']:.1f}s"
    text = (f"{what} identical to the reference on {both}/{n} prompts x {compared_tokens(prompts, v['new_tokens'])} "
            f"(reference: {ref}{took})")
    ties = [f"prompt {i + 1}: {note}" for i, p in enumerate(prompts) if (note := near_tie_note(p))]
    if ties:
        text += "; " + "; ".join(ties)
    text += f"; max |log-prob diff| {worst:.2e}"
    compared = [p for p in prompts if p.get("accept_identical") is not None]
    if compared:
        text += (f"; tokens accepted per tree step identical on {sum(p['accept_identical'] for p in compared)}/"
                 f"{len(compared)}")
    return text


_CHECKS = {
    "pytorch": "pass/fail: step outputs within tolerance of the fp32 PyTorch reference; the artifact's Medusa tokens "
               "(its tree) and plain greedy tokens (root-only tree) identical to the independent reference "
               "(`reference`: plain greedy decoding in PyTorch that shares no code with the runtime's loop, cache, "
               "trees or acceptance; near-ties allowed where margin > 0: near_tie, plain_near_tie); and where the "
               "heads graph is the reference's (fp32 heads over the whole vocabulary) the tokens accepted per tree "
               "step identical to the PyTorch reference's through the runtime's loop (accept_* fields). "
               "vanilla_* fields: Medusa vs plain greedy on the same graph (information); loop_identical, "
               "engine_divergence: the PyTorch reference through the runtime's loop against the reference and the "
               "artifact (where a mismatch starts)",
    "vanilla": "pass/fail: Medusa greedy tokens == plain greedy decoding (root-only tree) of the same graph on ONNX "
               "Runtime; the reference fields (identical, first_divergence, agreement: the independent reference; "
               "max_*_diff: the fp32 PyTorch step outputs) are agreement with fp32 (information)",
}
