"""The validation stage's options (``build`` and ``verify``): :class:`ValidationConfig`.

The export's options are :class:`medusa_export.export.config.ExportConfig`; ``build`` takes both
(:class:`medusa_export.pipeline.BuildConfig`), ``verify`` only this one: the options the artifact was exported
with are read from its manifest by the check that needs them (the truncated check's re-export,
:meth:`~medusa_export.export.config.ExportConfig.of_manifest`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import MedusaError
from .plan import parse_checks


@dataclass(frozen=True)
class ValidationConfig:
    """What the validation runs; the CLI reads its defaults from here.

    Attributes:
        validate: run the validation stage (``build --no-validate``: False).
        checks: validation checks (``--checks``): "auto" (the pre-flight chooses what fits:
            :mod:`medusa_export.validation.plan`) or a comma-separated list of full, truncated,
            checksums, self, gpu.
        validate_layers: N of the truncated check (the first N layers + final norm, lm_head, heads).
        new_tokens: greedy tokens compared per validation prompt.

    Raises:
        MedusaError: ``validate_layers`` < 1, or an unknown check name (the message lists them).
    """

    validate: bool = True
    checks: str = "auto"
    validate_layers: int = 2
    new_tokens: int = 64

    def __post_init__(self) -> None:
        if self.validate_layers < 1:
            raise MedusaError(f"--validate-layers must be >= 1, got {self.validate_layers}")
        parse_checks(self.checks)
