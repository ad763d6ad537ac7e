"""Stop handling inside an accepted path, token by token.

A Medusa step emits several tokens at once; stops must behave exactly as if they had
been produced one by one: EOS ends the output (the EOS token itself is not emitted),
``max_new_tokens`` is never exceeded, and stop strings cut the text where they start.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence


@dataclass(frozen=True)
class StopResult:
    """Tokens to emit from one step and, if generation ends, why.

    Attributes:
        tokens: the emitted prefix of the step's tokens.
        finish_reason: None to continue, "stop" (EOS or stop string) or "length"
            (max_new_tokens reached).
    """

    tokens: list[int]
    finish_reason: str | None


def apply_stops(
    step_tokens: Sequence[int],
    *,
    generated: int,
    max_new_tokens: int,
    eos_token_ids: Iterable[int],
) -> StopResult:
    """Cut one step's tokens at the first EOS or at max_new_tokens, whichever comes first.

    Args:
        step_tokens: the tokens a step produced, in order.
        generated: tokens already emitted before this step.
        max_new_tokens: total budget of emitted tokens (>= 0).
        eos_token_ids: ids that end generation.
    """
    eos = set(eos_token_ids)
    out: list[int] = []
    for tok in step_tokens:
        if generated + len(out) >= max_new_tokens:
            return StopResult(out, "length")
        if int(tok) in eos:
            return StopResult(out, "stop")
        out.append(int(tok))
    if generated + len(out) >= max_new_tokens:
        return StopResult(out, "length")
    return StopResult(out, None)


def find_stop_string(text: str, stop_strings: Sequence[str], start: int = 0) -> int:
    """Index in ``text`` where the earliest stop string begins (searching from ``start``), or -1."""
    hits = [i for s in stop_strings if s and (i := text.find(s, start)) >= 0]
    return min(hits) if hits else -1
