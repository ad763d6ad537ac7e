"""Prompt files: the one reader of the JSONL prompt files every command and benchmark takes.

A prompt file is JSONL, one JSON object a line (blank lines skipped). The records read:

- ``{"prompt": "..."}``: a user message;
- ``{"turns": ["...", ...]}``: an MT-Bench ``question.jsonl`` line (its first turn);
- ``{"messages": [{"role": ..., "content": ...}, ...]}``: a conversation.

:func:`jsonl_records` yields the objects (typed errors naming the file and the line);
:func:`read_first_turns` gives the first user turn of each (validation, the typed-graph check, the
benchmarks); :func:`read_prompt_file` gives ``generate --prompt-file``'s records (with a per-line
``max_new_tokens`` and ``seed``). Head training reads more record layouts on top of
:func:`jsonl_records` (``medusa_export.training.distill.load_prompts``). Torch-free.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator, NamedTuple

from ..errors import PromptFileError

#: What ``generate --prompt-file`` reads, for help texts and errors.
PROMPT_FILE_FORMAT = ("JSONL, one object a line with 'prompt' (a user message), 'messages' (a conversation) or "
                      "'turns' (MT-Bench: the first turn); optional 'max_new_tokens' and 'seed' per line")


#: The environment variable naming the project's shared folder (the one holding ``data/eval/mt_bench``).
SHARED_ENV = "MEDUSA_EXPORT_SHARED"
#: MT-Bench's first turns, relative to the shared folder.
MT_BENCH_RELPATH = Path("data") / "eval" / "mt_bench" / "question.jsonl"


def shared_dir() -> Path:
    """The project's shared folder: ``$MEDUSA_EXPORT_SHARED`` when set, else ``shared/`` beside the checkout.

    "Beside the checkout" is the parent of the folder holding this package's source (``<checkout>/runtime/front``),
    so a checkout at ``/work/main`` reads ``/work/shared``. The folder is not checked here (callers that
    need a file in it check that file, naming it and this variable).
    """
    env = os.environ.get(SHARED_ENV)
    return Path(env) if env else Path(__file__).resolve().parents[3] / "shared"


def mt_bench_questions() -> Path:
    """MT-Bench's ``question.jsonl`` in :func:`shared_dir` (the benchmarks' and tests' default prompts)."""
    return shared_dir() / MT_BENCH_RELPATH


class PromptRecord(NamedTuple):
    """One line of a prompt file."""

    prompt: str | list  # a user message, or a list of {"role", "content"} messages
    max_new_tokens: int | None  # the line's own budget, or None
    seed: int | None  # the line's own seed, or None


def jsonl_records(path: str | Path) -> Iterator[tuple[int, dict]]:
    """The JSON objects of a JSONL file with their 1-based line numbers; blank lines are skipped.

    Lines are split at ``\\n`` only (not ``str.splitlines``: a JSON string may hold U+2028).

    Raises:
        PromptFileError: the file is missing, a directory or not UTF-8, or a line is not valid JSON or
            not a JSON object (the message names the file and the line).
    """
    path = Path(path)
    if path.is_dir():
        raise PromptFileError(f"prompt file {path} is a directory; give a JSONL file (e.g. {path}/question.jsonl)")
    if not path.is_file():
        raise PromptFileError(f"prompt file {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        line = path.read_bytes()[: exc.start].count(b"\n") + 1
        raise PromptFileError(f"{path}:{line}: not UTF-8 (byte {exc.object[exc.start]:#04x} at offset {exc.start}); "
                              "prompt files are JSONL in UTF-8") from None
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PromptFileError(f"{where}: not valid JSON ({exc})") from None
        if not isinstance(rec, dict):
            raise PromptFileError(f"{where}: expected a JSON object, got {type(rec).__name__}")
        yield n, rec


def read_first_turns(path: str | Path, limit: int | None = None) -> list[str]:
    """The first user turn of each record: its ``prompt``, first of ``turns`` (MT-Bench) or first user message.

    Args:
        path: a prompt file (see the module docstring), e.g. MT-Bench's ``question.jsonl``.
        limit: stop after this many prompts (None: all); callers check it is >= 1.

    Raises:
        PromptFileError: as :func:`jsonl_records`, a line with none of those keys, or a file with no prompt
            (a command never runs on nothing, nor swaps an empty file for its defaults).
    """
    out = []
    for n, rec in jsonl_records(path):
        if "prompt" in rec:
            out.append(rec["prompt"])
        elif "turns" in rec:
            out.append(rec["turns"][0])
        elif "messages" in rec:
            out.append(next(m["content"] for m in rec["messages"] if m["role"] == "user"))
        else:
            raise PromptFileError(f"{path}:{n}: expected a 'prompt', 'turns' or 'messages' key")
        if limit and len(out) >= limit:
            break
    if not out:
        raise PromptFileError(f"prompt file {path} holds no prompts; {PROMPT_FILE_FORMAT}")
    return out


def _record_int(rec: dict, key: str, where: str) -> int | None:
    value = rec.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise PromptFileError(f"{where}: {key} must be an integer >= 0, got {value!r}")
    return value


def read_prompt_file(path: str | Path) -> list[PromptRecord]:
    """The prompts of a JSONL file (:data:`PROMPT_FILE_FORMAT`); blank lines are skipped, other keys ignored.

    Raises:
        PromptFileError: the file is missing, empty, or a line is not a JSON object with a usable
            prompt (the message names the file and the line).
    """
    out = []
    for n, rec in jsonl_records(path):
        where = f"{Path(path)}:{n}"
        if isinstance(rec.get("prompt"), str):
            prompt = rec["prompt"]
        elif isinstance(rec.get("messages"), list) and rec["messages"]:
            prompt = rec["messages"]
        elif isinstance(rec.get("turns"), list) and rec["turns"] and isinstance(rec["turns"][0], str):
            prompt = rec["turns"][0]
        else:
            raise PromptFileError(f"{where}: expected a 'prompt' string, a non-empty 'messages' list or a 'turns' "
                                  f"list of strings; the line has keys {sorted(rec)}")
        out.append(PromptRecord(prompt, _record_int(rec, "max_new_tokens", where), _record_int(rec, "seed", where)))
    if not out:
        raise PromptFileError(f"prompt file {path} holds no prompts")
    return out
