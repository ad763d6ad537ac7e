"""The Q/DQ graphs of int8, fp8 and int4 (TensorRT's explicit quantization), written where they are asked for:
``build --graph portable --precision int8|fp8|int4`` (the artifact's own ``model.onnx`` / heads graphs /
``weights.bin`` become them) and ``engine --precision int8|fp8|int4`` of a float artifact (beside the plans, in
``engines/``). One function, :func:`write_quantized`, for both: the calibration (W8A8: :mod:`.ranges`) and the
rewrite (:func:`.typed.write_typed_graphs`), so the two commands write the same graph from the same float16 weights.

Calibration prompts: W8A8 scales need at least :attr:`~medusa_export.export.precisions.PrecisionSpec.calibration_prompts`
of them (the project's own by default, ``--calibration-prompt-file`` for a user's); int4 round-to-nearest needs none.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

from ..errors import MedusaError
from ..export.precisions import PRECISION_TABLE
from .typed import DEFAULT_INT4_SCALES, INT4_SCALES, OUTLIER_RATIO, SMOOTH_ALPHA, W8A8, TypedReport, write_typed_graphs


class CalibrationPromptsError(MedusaError, ValueError):
    """Calibration prompts missing, empty or fewer than the precision's method needs (exit 2)."""


def check_calibration_prompts(precision: str, prompts: list[str] | None, source: str = "") -> list[str]:
    """The calibration prompts of ``precision``, checked before anything is written.

    Args:
        precision: a precision name (:data:`~medusa_export.export.precisions.PRECISION_TABLE`).
        prompts: user messages, or None for the project's own (:func:`~medusa_export.validation.validate.default_prompts`).
        source: where they came from, for the message (a file name).

    Returns:
        The prompts (the project's own when None), or [] when the precision needs none.

    Raises:
        CalibrationPromptsError: fewer non-empty prompts than the precision's ``calibration_prompts``, naming both
            numbers and the precisions that need none.
    """
    need = PRECISION_TABLE[precision].calibration_prompts if precision in PRECISION_TABLE else 1
    if not need:
        return []
    if prompts is None:
        from .ranges import default_calibration_prompts

        prompts = default_calibration_prompts()
    got = [p for p in prompts if p and p.strip()]
    if len(got) < need:
        none = ", ".join(n for n, p in PRECISION_TABLE.items() if p.qdq and not p.calibration_prompts)
        raise CalibrationPromptsError(
            f"{precision} (W8A8) calibrates its activation scales on at least {need} non-empty prompts; "
            f"{source or 'the prompts given'} has {len(got)}: give a JSONL file with {need} or more (one "
            f"{{\"prompt\": ...}} per line), or choose --precision {none or 'fp16'} (no calibration)")
    return got


def prompts_sha256(prompts: list[str]) -> str:
    """SHA-256 of the prompts joined by newlines (the manifest's record of what calibrated the scales)."""
    return hashlib.sha256("\n".join(prompts).encode()).hexdigest()


def write_quantized(folder: Path, files: dict[str, str], precision: str, prompts: list[str] | None, *,
                    paths: dict[str, str] | None = None, int4_block: int | None = None,
                    int4_scales: str = DEFAULT_INT4_SCALES, progress: bool = True) -> tuple[TypedReport, dict]:
    """Calibrate (W8A8) and write the Q/DQ graphs of an artifact's float graphs.

    Args:
        folder: the artifact (or a build's temporary folder with its manifest written).
        files: graph key -> artifact-relative ONNX (float32 or float16 graphs).
        precision: ``int8``, ``fp8`` or ``int4``.
        prompts: calibration prompts (checked by :func:`check_calibration_prompts`; None: the project's own).
        paths: output files (:func:`.typed.write_typed_graphs`; default ``engines/*.PRECISION.onnx``).
        int4_block: int4's block size (None: per weight the largest TensorRT block size dividing its K).
        int4_scales: int4's block scales, one of :data:`~.typed.INT4_SCALES`: "awq" (AWQ's clip search on the
            calibration, the default: closer to fp32 on MT-Bench, docs/tensorrt.md) or "rtn" (round-to-nearest, no
            calibration: far faster on large models).
        progress: print what is done.

    Returns:
        (the :class:`~.typed.TypedReport`, its JSON record with the calibration's method, prompt count and SHA-256).

    Raises:
        CalibrationPromptsError: too few prompts. TypedGraphError, MedusaError: as the rewrite and calibration.
    """
    say = (lambda line: print(line, file=sys.stderr, flush=True)) if progress else (lambda line: None)
    if int4_scales not in INT4_SCALES:
        raise CalibrationPromptsError(f"unknown int4 scale method {int4_scales!r}; choose {', '.join(INT4_SCALES)}")
    awq = precision == "int4" and int4_scales == "awq"
    prompts = check_calibration_prompts(precision, prompts)
    calibration = None
    if precision in W8A8 or awq:
        from .ranges import calibrate, default_calibration_prompts

        prompts = prompts or default_calibration_prompts()
        say(f"    calibrating {precision} layer by layer ({len(prompts)} prompts) ...")
        calibration = calibrate(folder, files, prompts, progress=progress)
    say(f"    writing the {precision} Q/DQ graphs ...")
    report = write_typed_graphs(folder, files, precision, paths=paths, int4_block=int4_block, calibration=calibration,
                                int4_scales=int4_scales if precision == "int4" else "rtn",
                                smooth_alpha=SMOOTH_ALPHA.get(precision), outlier_ratio=OUTLIER_RATIO.get(precision))
    record = report.to_json()
    record["scales"] = (f"int4 weights: symmetric, {'AWQ clip search' if awq else 'round-to-nearest'}, per block "
                        "along K" if precision == "int4" else
                        "weights: symmetric per output channel, max|w| / qmax; activations: per tensor, calibrated"
                        + (f", SmoothQuant alpha {SMOOTH_ALPHA[precision]}" if SMOOTH_ALPHA.get(precision) else ""))
    if calibration is not None:
        record["calibration"] = {**calibration.record, **({"int4_scales": int4_scales} if precision == "int4" else
                                                           {"smoothquant_alpha": SMOOTH_ALPHA.get(precision),
                                                            "outlier_ratio": OUTLIER_RATIO.get(precision)})}
    return report, record
