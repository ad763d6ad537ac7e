"""Typed errors shared by the runtime and the exporter.

Every error raised at a boundary (user input, files on disk) derives from
:class:`MedusaError`, so a CLI can catch one type and print its message.
"""


class MedusaError(Exception):
    """Base class of every error this project raises on bad input."""


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


class InvalidSettingError(MedusaError, ValueError):
    """A generation setting is out of its valid range (temperature, top-k, top-p, acceptance,
    max_new_tokens, context); the message names the setting and its valid range."""


class UnsupportedSamplingError(InvalidSettingError):
    """Sampling settings the engine cannot sample exactly (e.g. the whole vocabulary from a step
    graph that returns only its top-k); the message names the settings that are exact there."""
