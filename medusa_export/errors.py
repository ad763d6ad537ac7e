"""Typed errors of the exporter; all derive from :class:`medusa_runtime.MedusaError`."""

from medusa_runtime.errors import ArtifactError, ContextOverflowError, InvalidTreeError, MedusaError


class UnknownModelError(MedusaError, KeyError):
    """A model name is not in the registry; the message lists the known names."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class WeightsNotFoundError(MedusaError, FileNotFoundError):
    """A registered model's weights are not on disk; the message says what to download and where."""


class UnsupportedModelError(MedusaError, ValueError):
    """A checkpoint's architecture is not one this exporter supports."""


class HeadsFormatError(MedusaError, ValueError):
    """A Medusa heads file has a missing/unexpected key, a wrong shape or a wrong count."""


class CheckpointError(MedusaError, ValueError):
    """A checkpoint file is missing, truncated, unreadable or disagrees with its config; the message names the file."""


class ResourceError(MedusaError):
    """Not enough memory or disk for a stage; the message gives what is needed, what is there and the options."""


class InsufficientMemoryError(ResourceError, MemoryError):
    """The pre-flight estimate of a stage's peak memory exceeds the memory available."""


class InsufficientDiskError(ResourceError, OSError):
    """The output folder's file system has less free space than the weights need."""


class NoteWarning(UserWarning):
    """Something the user should know that does not stop the work (a third-party config that miscounts the heads,
    whose weights decide). A library caller gets a warning of this class; ``medusa-export`` prints it as its
    other notes, one ``[note: ...]`` line on stderr (:func:`medusa_export.cli.main.notes_as_lines`)."""


__all__ = [
    "ArtifactError",
    "CheckpointError",
    "ContextOverflowError",
    "HeadsFormatError",
    "InsufficientDiskError",
    "InsufficientMemoryError",
    "InvalidTreeError",
    "MedusaError",
    "NoteWarning",
    "ResourceError",
    "UnknownModelError",
    "UnsupportedModelError",
    "WeightsNotFoundError",
]
