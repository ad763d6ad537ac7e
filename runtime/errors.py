"""Typed errors shared by the runtime and the exporter.

Every error raised at a boundary (user input, files on disk) derives from
:class:`MedusaError`, so a CLI can catch one type, print its message and exit with its
:attr:`~MedusaError.exit_code`.
"""

#: Exit codes of the command lines (``medusa-export``, ``python -m medusa_runtime``).
EXIT_OK = 0
#: An artifact disagrees with the PyTorch reference (``verify``, ``build``'s validation).
EXIT_MISMATCH = 1
#: Bad input: a :class:`MedusaError` (its message names the problem) or a command-line error.
EXIT_USAGE = 2
#: A backend or tool this command needs is not available here (TensorRT, a CUDA provider).
EXIT_UNAVAILABLE = 3
#: Interrupted (Ctrl-C); SIGTERM and SIGHUP exit with 128 + the signal's number (143, 129).
EXIT_INTERRUPTED = 130
#: The exit codes for ``--help`` epilogs and docs.
EXIT_CODES_HELP = (f"exit codes: {EXIT_OK} success; {EXIT_MISMATCH} the artifact disagrees with the PyTorch "
                   f"reference (medusa-export verify and build's validation); {EXIT_USAGE} bad input (the message names it); "
                   f"{EXIT_UNAVAILABLE} a needed backend is not available here (TensorRT, CUDA); "
                   f"{EXIT_INTERRUPTED} interrupted (143 terminated by SIGTERM, 129 SIGHUP)")


class MedusaError(Exception):
    """Base class of every error this project raises on bad input.

    Attributes:
        exit_code: the command lines' exit code for this error (:data:`EXIT_USAGE` unless a
            subclass says otherwise).
    """

    exit_code: int = EXIT_USAGE


class InvalidTreeError(MedusaError, ValueError):
    """A token tree (medusa_choices) is malformed; the message names the offending path."""


class ArtifactError(MedusaError):
    """An artifact directory is missing files, has a bad manifest or a wrong checksum."""


class ContextOverflowError(MedusaError, ValueError):
    """A prompt does not fit the context the engine was built for."""


class ChatTemplateError(MedusaError, ValueError):
    """The chat template is missing, does not compile, or rejects the messages."""


class BackendUnavailableError(MedusaError):
    """An engine backend cannot run here (package, provider or GPU missing); the message says what is needed."""

    exit_code = EXIT_UNAVAILABLE


class InvalidSettingError(MedusaError, ValueError):
    """A generation setting is out of its valid range (temperature, top-k, top-p, acceptance,
    max_new_tokens, context); the message names the setting and its valid range."""


class InvalidPromptError(InvalidSettingError):
    """Prompt token ids that are not token ids of the artifact's vocabulary (negative, not integers, or
    >= the vocabulary size); the message names the first bad id, its position and the valid range."""


class UnsupportedSamplingError(InvalidSettingError):
    """Sampling settings the engine cannot sample exactly (e.g. the whole vocabulary from a step
    graph that returns only its top-k); the message names the settings that are exact there."""


class PromptFileError(MedusaError, ValueError):
    """A prompt file (JSONL) is missing or has a malformed line; the message names the file and the line."""
