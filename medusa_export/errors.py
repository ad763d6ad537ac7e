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


__all__ = [
    "ArtifactError",
    "ContextOverflowError",
    "HeadsFormatError",
    "InvalidTreeError",
    "MedusaError",
    "UnknownModelError",
    "UnsupportedModelError",
    "WeightsNotFoundError",
]
