"""The ``trtexec`` command lines and build script equivalent to ``medusa-export engine``.

Written into every artifact the engine step sees, so that a user can build the engines
on their own GPU machine with TensorRT alone. Everything is derived from the manifest:
the shapes of every input for every optimization profile
(``medusa_runtime.engines.trt_plan.profile_shapes``), the plan names and the precision flags.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import onnx

from medusa_runtime.engines.trt_plan import ENGINE_DIR, graph_profiles, plan_files, plan_graphs, profile_shapes
from medusa_runtime.manifest import Manifest, as_manifest

from .config import BUILD_SCRIPT, CALIBRATION_CACHE, ENGINE_PRECISIONS, FP32_OPS, TIMING_CACHE


def fp32_node_names(model: onnx.ModelProto) -> list[str]:
    """Names of the nodes to keep in float32, in graph order: every node of every RMSNorm chain (the squaring,
    ReduceMean, the epsilon Add, Sqrt, Reciprocal, the normalising Mul and the weight Mul: the graph writer
    names them ``<norm>/rmsnorm/*``), every attention softmax, and the op types :data:`FP32_OPS` (the output
    tail). A chain is pinned whole: with the epsilon Add left to fp16, a variance above 65504 becomes inf
    and the norm outputs zeros (issue 13, item 6).

    TensorRT's ONNX parser names each layer after its node, so these names serve both
    ``trtexec --layerPrecisions`` and the Python builder's per-layer constraints.
    """
    from ..export.graph import RMSNORM_MARK, SOFTMAX_MARK

    return [n.name for n in model.graph.node if n.name and (
        n.op_type in FP32_OPS or RMSNORM_MARK in n.name or n.name.endswith(SOFTMAX_MARK))]


def strongly_typed(manifest: Manifest | dict, precision: str) -> bool:
    """An fp16 artifact already carries its types (fp16 weights, explicit float32 casts for
    norms and softmax): TensorRT then builds it strongly typed, exactly as the ONNX says."""
    manifest = as_manifest(manifest)
    return precision == "fp16" and manifest.precision.kv_dtype == "float16"


def _dims(shape: tuple) -> str:
    return "x".join(str(d) for d in shape)


def trtexec_args(manifest: Manifest | dict, graph: str, precision: str, *, fp32_nodes: list[str] = (),
                 workspace_mib: int | None = None) -> list[str]:
    """Arguments of one ``trtexec`` build, run from the artifact root.

    Args:
        manifest: the artifact's manifest.
        graph: "model" (backbone step, profiles prefill / tree_step / decode), "heads" or a level graph
            ``heads_level{j}`` (path-conditioned heads).
        precision: one of :data:`ENGINE_PRECISIONS`.
        fp32_nodes: layer names pinned to float32 (weakly typed fp16 / int8 builds).
        workspace_mib: builder workspace limit.

    Returns:
        argv without the program name.
    """
    manifest = as_manifest(manifest)
    if precision not in ENGINE_PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}")
    g = manifest.graphs[graph]
    args = [f"--onnx={g.file}"]
    for i, prof in enumerate(graph_profiles(manifest, graph)):
        shapes = profile_shapes(g.inputs, prof)
        args.append(f"--profile={i}")
        for k, flag in enumerate(("--minShapes", "--optShapes", "--maxShapes")):
            args.append(f"{flag}=" + ",".join(f"{name}:{_dims(s[k])}" for name, s in shapes.items()))
    if strongly_typed(manifest, precision):
        args.append("--stronglyTyped")
    elif precision in ("fp16", "int8"):
        args.append("--fp16")
        if precision == "int8" and graph == "model":
            args += ["--int8", f"--calib={CALIBRATION_CACHE}", "--calibProfile=0"]
        if fp32_nodes:
            args += ["--precisionConstraints=obey", "--layerPrecisions=" + ",".join(f"{n}:fp32" for n in fp32_nodes)]
    if workspace_mib:
        args.append(f"--memPoolSize=workspace:{workspace_mib}M")
    tag = f"{graph}.{precision}"
    args += [f"--timingCacheFile={TIMING_CACHE}", "--profilingVerbosity=detailed",
             f"--exportLayerInfo={ENGINE_DIR}/layers.{tag}.json", f"--saveEngine={plan_files(manifest, precision)[graph]}",
             "--skipInference"]
    return args


def _fp32_nodes(folder: Path, manifest: Manifest | dict, graph: str, precision: str) -> list[str]:
    if precision == "fp32" or strongly_typed(manifest, precision):
        return []
    return fp32_node_names(onnx.load(str(folder / manifest.graphs[graph].file), load_external_data=False))


def trtexec_commands(folder: Path, manifest: Manifest | dict, precision: str, workspace_mib: int | None = None) -> list[list[str]]:
    """argv (with ``trtexec``) of each graph's build, in :func:`~medusa_runtime.engines.trt_plan.plan_graphs`
    order (the model, then the heads graph or the level graphs of path-conditioned heads)."""
    manifest = as_manifest(manifest)
    return [["trtexec", *trtexec_args(manifest, g, precision, fp32_nodes=_fp32_nodes(folder, manifest, g, precision),
                                      workspace_mib=workspace_mib)] for g in plan_graphs(manifest)]


#: Lines of a failed trtexec's log that ``build_engine.sh`` prints (its error is at the end).
LOG_TAIL_LINES = 25


def build_script(folder: Path, manifest: Manifest | dict, workspace_mib: int | None = None) -> str:
    """A bash script that builds the engines of any precision with ``trtexec``.

    Usage on the GPU machine: ``bash engines/build_engine.sh [fp16|int8|fp32]``. Each trtexec run's output goes
    to ``engines/build.GRAPH.PRECISION.log``; when one fails, the script prints the last :data:`LOG_TAIL_LINES`
    lines of that log and its path on stderr and exits with trtexec's status.

    Args:
        folder: the artifact root.
        manifest: its manifest.
        workspace_mib: trtexec's workspace pool in MiB (None: trtexec's default).

    Returns:
        The script's text.
    """
    manifest = as_manifest(manifest)
    from .. import __version__

    cases = []
    for prec in ENGINE_PRECISIONS:
        lines = [f"  {prec})"]
        if prec == "int8":
            lines += [f"    if [ ! -f {CALIBRATION_CACHE} ]; then",
                      f"      echo \"build_engine.sh: int8 needs {CALIBRATION_CACHE}: run 'medusa-export engine --artifact . "
                      f"--precision int8 --prompt-file PROMPTS.jsonl' on a machine with TensorRT's Python package "
                      f"(it calibrates, saves the cache and builds the engine)\" >&2",
                      "      exit 3", "    fi"]
        for graph, argv in zip(plan_graphs(manifest), trtexec_commands(folder, manifest, prec, workspace_mib)):
            body = " \\\n      ".join(shlex.quote(a) for a in argv[1:])
            lines.append(f"    run {graph} {prec} \\\n      {body}")
        lines.append("    ;;")
        cases.append("\n".join(lines))
    plans = list(plan_files(manifest, "$PRECISION").values())
    heads_note = ("heads.onnx: R rows" if plans[1:] == [f"{ENGINE_DIR}/heads.$PRECISION.plan"] else
                  "heads_level{j}.onnx (one per tree level): H hidden rows, R paths")
    plan_list = ", ".join(f'"{p}"' for p in plans)
    return f"""#!/usr/bin/env bash
# Builds the TensorRT engines of this artifact on a machine with an NVIDIA GPU and TensorRT 10.x.
# Written by medusa-export {__version__} from manifest.json (model {manifest.model.name}, tree of
# {manifest.tree.size} nodes, max context {manifest.model.max_context}); the shapes are the manifest's
# optimization profiles: model.onnx profile 0 = prefill, 1 = tree step, 2 = decode; {heads_note}.
#
#   bash engines/build_engine.sh [fp16|int8|fp32]     (default fp16; TRTEXEC=/path/to/trtexec to choose)
#
# Outputs: {', '.join(plans).replace('$PRECISION', 'PRECISION')}, engines/timing.cache, engines/layers.*.json (per-layer
# precisions, to check that norms and softmax stayed fp32), engines/build.*.log, engines/build_record.PRECISION.json.
set -euo pipefail
cd "$(dirname "${{BASH_SOURCE[0]}}")/.."   # the artifact root: ONNX external data resolves from here
PRECISION="${{1:-fp16}}"
TRTEXEC="${{TRTEXEC:-trtexec}}"
if ! command -v "$TRTEXEC" >/dev/null 2>&1; then
  echo "build_engine.sh: $TRTEXEC not found: install TensorRT 10.x (trtexec ships in its bin/) or set TRTEXEC" >&2
  exit 3
fi
mkdir -p {ENGINE_DIR}
run() {{  # run GRAPH PRECISION ARGS...: one trtexec build, its log kept next to the plan
  local graph="$1" prec="$2" rc=0; shift 2
  local log="{ENGINE_DIR}/build.$graph.$prec.log"
  echo "building $graph ($prec) ..."
  "$TRTEXEC" "$@" >"$log" 2>&1 || rc=$?
  if [ "$rc" -ne 0 ]; then  # trtexec's error is in its log: show its end and name the log
    echo "build_engine.sh: trtexec failed (exit $rc) building $graph ($prec); the end of its log:" >&2
    tail -n {LOG_TAIL_LINES} "$log" | sed 's/^/  | /' >&2
    echo "build_engine.sh: the whole log: $PWD/$log" >&2
    exit "$rc"
  fi
}}
start=$(date +%s)
case "$PRECISION" in
{chr(10).join(cases)}
  *)
    echo "usage: bash engines/build_engine.sh [fp16|int8|fp32]" >&2
    exit 2
    ;;
esac
seconds=$(( $(date +%s) - start ))
v=$(sed -n 's/.*\\[TensorRT v\\([0-9]*\\)\\].*/\\1/p' "{ENGINE_DIR}/build.model.$PRECISION.log" | head -n 1)
trt=""  # trtexec prints its version as [TensorRT vMMmmpp] (10.x) or vMmpp (8.x)
if [ -n "$v" ]; then
  if [ "$v" -ge 10000 ]; then trt="$((v / 10000)).$((v / 100 % 100)).$((v % 100))"; else trt="$((v / 1000)).$((v / 100 % 10)).$((v % 100))"; fi
fi
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 || true)
cat > "{ENGINE_DIR}/build_record.$PRECISION.json" <<RECORD
{{"precision": "$PRECISION", "built_by": "{BUILD_SCRIPT}", "tensorrt": "${{trt:-unknown}}", "gpu": "${{gpu:-unknown}}", "build_seconds": $seconds, "plans": [{plan_list}]}}
RECORD
echo "built {' and '.join(plans)} in ${{seconds}}s"
"""


def write_commands(folder: Path, manifest: Manifest | dict, precision: str, workspace_mib: int | None = None) -> list[str]:
    """Write ``engines/trtexec.PRECISION.txt`` and ``engines/build_engine.sh``; return their relative paths."""
    manifest = as_manifest(manifest)
    (folder / ENGINE_DIR).mkdir(exist_ok=True)
    cmd_rel = f"{ENGINE_DIR}/trtexec.{precision}.txt"
    text = "".join(shlex.join(argv) + "\n" for argv in trtexec_commands(folder, manifest, precision, workspace_mib))
    (folder / cmd_rel).write_text(f"# run from the artifact root; one build per line ({', '.join(manifest.graphs[g].file for g in plan_graphs(manifest))})\n" + text)
    script = folder / BUILD_SCRIPT
    script.write_text(build_script(folder, manifest, workspace_mib))
    script.chmod(0o755)
    return [cmd_rel, BUILD_SCRIPT]
