"""Arguments shared by several sub-commands: one name per meaning, old spellings as hidden aliases.

Torch-free (argparse only), so every command's parser can use it.

==================  =========================================  ==============================
flag                meaning                                    hidden aliases
==================  =========================================  ==============================
``--artifact DIR``  the artifact a command reads               the positional ``ARTIFACT``
                                                               (verify, engine, triton)
``--prompt-file``   a JSONL file of prompts                    ``--prompts`` (build, verify),
                                                               ``--data`` (train-heads,
                                                               calibrate), ``--calibration``
                                                               (engine, build --engine trt)
``--max-new-tokens``  new tokens per reply                     ``--new-tokens`` (build, verify)
==================  =========================================  ==============================
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from medusa_runtime.errors import InvalidSettingError, MedusaError

#: What ``--prompt-file`` reads, for help texts.
PROMPT_FILE_FORMAT = "JSONL, one record a line with 'prompt', 'turns' or 'messages'"


def add_hidden_alias(p: argparse.ArgumentParser, old: str, *, dest: str, **kwargs) -> None:
    """Accept ``old`` as another spelling of the option stored in ``dest``, without showing it in ``--help``.

    Args:
        p: the parser that has the current option.
        old: the old option string, e.g. ``"--new-tokens"``.
        dest: the current option's ``dest``; the current option's default stays in force.
        **kwargs: the current option's ``type`` / ``action`` (e.g. ``type=int``, ``action="append"``).
    """
    p.add_argument(old, dest=dest, help=argparse.SUPPRESS, default=argparse.SUPPRESS, **kwargs)


class _IntoArtifact(argparse.Action):
    """The hidden positional ``ARTIFACT``: stores into ``artifact`` like ``--artifact``."""

    def __call__(self, parser, namespace, values, option_string=None):
        if values is not None:
            namespace.artifact = values


class _RequiredArtifactUsage(argparse.HelpFormatter):
    """Usage that shows ``--artifact DIR`` without brackets: it is required (argparse brackets it because its
    mutually exclusive partner, the hidden positional, sits apart from it in the usage line)."""

    def _format_usage(self, usage, actions, groups, prefix):
        return super()._format_usage(usage, actions, groups, prefix).replace("[--artifact DIR]", "--artifact DIR")


def add_artifact_arg(p: argparse.ArgumentParser, help: str = "the artifact (medusa-export build output)") -> None:
    """``--artifact DIR`` (required), also accepted as a positional argument (the old spelling, hidden)."""
    p.formatter_class = _RequiredArtifactUsage
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--artifact", metavar="DIR", help=f"{help} (required)")
    group.add_argument("artifact_positional", nargs="?", metavar="ARTIFACT", action=_IntoArtifact,
                       help=argparse.SUPPRESS)


def add_prompt_file_arg(p: argparse.ArgumentParser, help: str, *, aliases: tuple[str, ...] = (),
                        repeatable: bool = False, flag: str = "--prompt-file", dest: str = "prompt_file",
                        formats: str = PROMPT_FILE_FORMAT) -> None:
    """``--prompt-file FILE`` (``help`` says what the prompts are for), with hidden ``aliases``.

    Not marked required even where a command needs it (an alias may carry the value): such a
    command checks ``args.prompt_file`` itself, with :func:`require`.

    Args:
        p: the parser.
        help: what the command does with the prompts (the file format is appended).
        aliases: old spellings, accepted but not shown.
        repeatable: the flag may be given several times (a list of files).
        flag: the option string (``--engine-prompt-file`` beside ``build``'s own ``--prompt-file``).
        dest: the attribute name.
        formats: the records the command's reader takes, for the help.
    """
    kwargs = {"action": "append"} if repeatable else {}
    p.add_argument(flag, dest=dest, metavar="FILE", help=f"{help}{'; repeatable' if repeatable else ''}; {formats}",
                   **kwargs)
    for old in aliases:
        add_hidden_alias(p, old, dest=dest, **kwargs)


def require(value, flag: str):
    """``value``, or a :class:`MedusaError` saying that ``flag`` is required (exit code 2)."""
    if not value:
        raise MedusaError(f"the following argument is required: {flag}")
    return value


def check_int(value: int | None, flag: str, *, low: int, high: int | None = None, meaning: str = "") -> int | None:
    """``value`` when it lies in ``[low, high]`` (None: the option was not given, passed through).

    Args:
        value: the parsed option.
        flag: the option string, for the message (e.g. ``"--limit"``).
        low: the smallest valid value.
        high: the largest valid value (None: no upper bound).
        meaning: what the bound is, appended to the message (e.g. "the model's max_position_embeddings").

    Raises:
        InvalidSettingError: ``value`` is outside the range; the message gives the valid range (exit code 2).
    """
    if value is None or (value >= low and (high is None or value <= high)):
        return value
    valid = f">= {low}" if high is None else f"in {low}..{high}"
    raise InvalidSettingError(f"{flag} must be {valid}{f' ({meaning})' if meaning else ''}, got {value}")


def check_output_file(path: str | None, flag: str) -> Path | None:
    """``path`` as a :class:`Path` when a file can be written there (None passed through); checked before a
    command does its work, so a report path that cannot be written fails at once, not after the run.

    Raises:
        InvalidSettingError: ``path`` is a directory, its folder does not exist, or the folder is not writable.
    """
    if path is None:
        return None
    out = Path(path)
    folder = out.parent
    if out.is_dir():
        raise InvalidSettingError(f"{flag} {path} is a directory; give a file path (e.g. {out / 'report.xml'})")
    if not folder.is_dir():
        raise InvalidSettingError(f"{flag} {path}: the folder {folder} does not exist; create it or give a path "
                                  "in an existing folder")
    if not os.access(folder, os.W_OK | os.X_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise InvalidSettingError(f"{flag} {path} cannot be written (permission denied in {folder})")
    return out
