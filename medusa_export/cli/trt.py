"""Command-line parts of the TensorRT stage: ``engine`` and ``build --engine trt``."""

from __future__ import annotations

import argparse
import sys

from ..trt.config import ENGINE_PRECISION_TABLE, EXIT_NO_TENSORRT, EngineConfig
from .args import add_artifact_arg, add_prompt_file_arg


def _add_engine_options(p: argparse.ArgumentParser, prefix: str = "") -> None:
    rows = "; ".join(f"{n}: {'not built: ' + r.unavailable.split(':')[0] if r.unavailable else 'computes in ' + r.computes_in}"
                     for n, r in ENGINE_PRECISION_TABLE.items())
    p.add_argument(f"--{prefix}precision", dest="engine_precision", choices=list(ENGINE_PRECISION_TABLE),
                   default=EngineConfig.precision,
                   help=f"engine precision, built strongly typed on TensorRT 10 and 11 ({rows}); fp16 and bf16 of an "
                        f"fp32 artifact build from a typed graph written beside the plans, with float32 norms, softmax "
                        f"and output tail (default: {EngineConfig.precision})")
    add_prompt_file_arg(p, "prompts the typed graph is validated on (default: the project's own prompts)",
                        flag=f"--{prefix}prompt-file", dest="engine_prompts")
    p.add_argument("--workspace", type=int, dest="workspace_mib", metavar="MIB",
                   help="builder workspace limit in MiB (default: TensorRT's, all free device memory)")
    p.add_argument(f"--{prefix}device-id", dest="engine_device_id", type=int, metavar="N",
                   default=EngineConfig.device_id,
                   help=f"CUDA device to build (and tune) the engines on (default: {EngineConfig.device_id})")


def _engine_config(args) -> EngineConfig:
    return EngineConfig(precision=args.engine_precision, prompts=args.engine_prompts, workspace_mib=args.workspace_mib,
                        device_id=args.engine_device_id, validate=not getattr(args, "no_validate", False))


def run_engine(path, args) -> int:
    """The engine step on ``path``; prints its message, returns its exit code."""
    from ..trt.engine_step import run_engine_step

    outcome = run_engine_step(path, _engine_config(args))
    print(("" if outcome.code == 0 else "medusa-export engine: ") + outcome.message,
          file=sys.stdout if outcome.code == 0 else sys.stderr)
    return outcome.code


def cmd_engine(args) -> int:
    """Build TensorRT engines from an artifact (or write the commands to, where TensorRT is absent)."""
    return run_engine(args.artifact, args)


def add_build_engine_args(p: argparse.ArgumentParser) -> None:
    """``build --engine trt`` (+ the engine options, ``--engine-precision``)."""
    p.add_argument("--engine", choices=("none", "trt"), default="none",
                   help="after the artifact is built, also build TensorRT engines (trt); where TensorRT is absent "
                        f"the trtexec commands are written and build exits {EXIT_NO_TENSORRT}")
    _add_engine_options(p, prefix="engine-")


def after_build(args, path) -> int:
    """Run the engine step after ``build`` when ``--engine trt`` was given; else 0."""
    return run_engine(path, args) if args.engine == "trt" else 0


def readiness_line(r: dict | None, flavour: str | None) -> str | None:
    """The build summary's TensorRT readiness line, from the manifest's ``trt_readiness`` report and ``flavour``
    (None when the manifest has no report)."""
    if not r:
        return None
    flavour = flavour or "portable"
    if flavour != "portable" and not r["passed"]:  # refused by design, not a defect of this build
        return (f"  TensorRT {r['tensorrt']} readiness: not applicable: flavour {flavour} runs on ONNX Runtime only "
                "(for TensorRT build --graph portable --precision fp32|fp16|int8|fp8|int4 --heads-precision auto)")
    line = f"  TensorRT {r['tensorrt']} readiness: {'PASSED' if r['passed'] else 'FAILED'}"
    if r["errors"]:
        line += f" ({len(r['errors'])} error(s); first: {r['errors'][0]})"
    elif r["warnings"]:
        line += f" ({len(r['warnings'])} warning(s))"
    else:
        ops = sorted({op for g in r["graphs"].values() for op in g["op_types"]})
        line += f" ({len(ops)} op types, all in the ONNX parser; tree step static but for the past length)"
    return line


def add_trt_commands(sub) -> None:
    """Add ``engine`` to the CLI's sub-commands."""
    p = sub.add_parser(
        "engine", help="build TensorRT engines from an artifact (writes trtexec commands where TensorRT is absent)",
        description="Check the artifact's ONNX for TensorRT (ops, opset, shapes, weight paths), write the equivalent "
                    "trtexec commands (engines/trtexec.PRECISION.txt) and a build script (engines/build_engine.sh), "
                    "then, where TensorRT's Python package imports, build the engines with optimization profiles for "
                    "the prefill, the tree step and decoding, a timing cache and a build record in the manifest.",
        epilog=f"exit codes: 0 engines built; 1 a typed graph failed its validation; 2 the ONNX is not ready for "
               f"TensorRT, a precision not built from this artifact, or other bad input; "
               f"{EXIT_NO_TENSORRT} TensorRT is not installed here (the commands and build script were written for a "
               f"GPU machine); 130 interrupted")
    add_artifact_arg(p)
    _add_engine_options(p)
    p.add_argument("--no-validate", action="store_true",
                   help="do not validate a typed graph on ONNX Runtime before building (it is validated by default)")
    p.set_defaults(func=cmd_engine)
