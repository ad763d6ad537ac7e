"""The ``trtexec`` command lines and build script equivalent to ``medusa-export engine``.

Written into every artifact the engine step sees, so that a user can build the engines
on their own GPU machine with TensorRT alone. Everything is derived from the manifest:
the shapes of every input for every optimization profile
(``medusa_runtime.engines.trt_plan.profile_shapes``), the plan names and the ONNX each plan is built from
(the precision is its types: no precision flag).
"""

from __future__ import annotations

import shlex
from pathlib import Path

from medusa_runtime.engines.trt_plan import ENGINE_DIR, graph_profiles, plan_files, plan_graphs, profile_shapes
from medusa_runtime.contract.manifest import Manifest, as_manifest

from .config import BUILD_SCRIPT, ENGINE_PRECISION_TABLE, QDQ_ARTIFACTS, TIMING_CACHE, TRTEXEC_COMMON, engine_precision
from .typed import typed_paths


def graph_sources(manifest: Manifest | dict, precision: str) -> dict[str, str]:
    """The ONNX each graph's plan of ``precision`` is built from: the artifact's own graph, or the typed graph the
    precision's row writes beside the plans (:func:`~.typed.typed_paths`), by graph.

    Raises:
        MedusaError: the precision is not built, or not from this artifact's type (:meth:`EnginePrecision.source`).
    """
    manifest = as_manifest(manifest)
    graphs = plan_graphs(manifest)
    if engine_precision(precision).source(manifest.precision.kv_dtype, manifest.precision_name) == "typed":
        typed = typed_paths(precision, graphs)
        return {g: typed[g] for g in graphs}
    return {g: manifest.graphs[g].file for g in graphs}


def _dims(shape: tuple) -> str:
    return "x".join(str(d) for d in shape)


def trtexec_args(manifest: Manifest | dict, graph: str, precision: str, *, onnx_file: str | None = None,
                 workspace_mib: int | None = None) -> list[str]:
    """Arguments of one ``trtexec`` build, run from the artifact root; valid for TensorRT 10 and 11 alike
    (:data:`~.config.TRTEXEC_COMMON`: strongly typed, no precision flag; the precision is the ONNX's types).

    Args:
        manifest: the artifact's manifest.
        graph: "model" (backbone step, profiles prefill / tree_step / decode), "heads" or a level graph
            ``heads_level{j}`` (path-conditioned heads).
        precision: a buildable row of :data:`~.config.ENGINE_PRECISION_TABLE`.
        onnx_file: the ONNX to build from (default: :func:`graph_sources`).
        workspace_mib: builder workspace limit.

    Returns:
        argv without the program name.
    """
    manifest = as_manifest(manifest)
    row = engine_precision(precision)
    g = manifest.graphs[graph]
    args = [f"--onnx={onnx_file or graph_sources(manifest, precision)[graph]}"]
    for i, prof in enumerate(graph_profiles(manifest, graph)):
        shapes = profile_shapes(g.inputs, prof)
        args.append(f"--profile={i}")
        for k, flag in enumerate(("--minShapes", "--optShapes", "--maxShapes")):
            args.append(f"{flag}=" + ",".join(f"{name}:{_dims(s[k])}" for name, s in shapes.items()))
    args += [*TRTEXEC_COMMON, *row.trtexec]
    if workspace_mib:
        args.append(f"--memPoolSize=workspace:{workspace_mib}M")
    tag = f"{graph}.{precision}"
    args += [f"--timingCacheFile={TIMING_CACHE}", "--profilingVerbosity=detailed",
             f"--exportLayerInfo={ENGINE_DIR}/layers.{tag}.json", f"--saveEngine={plan_files(manifest, precision)[graph]}",
             "--skipInference"]
    return args


def buildable(manifest: Manifest | dict) -> list[str]:
    """The engine precisions this artifact's type can be built in (the table's rows that take it)."""
    m = as_manifest(manifest)
    kv, name = m.precision.kv_dtype, m.precision_name
    if name in QDQ_ARTIFACTS:  # already Q/DQ: its own precision only (EnginePrecision.source)
        return [name]
    return [n for n, r in ENGINE_PRECISION_TABLE.items() if not r.unavailable and kv in r.sources]


def trtexec_commands(folder: Path, manifest: Manifest | dict, precision: str, workspace_mib: int | None = None) -> list[list[str]]:
    """argv (with ``trtexec``) of each graph's build, in :func:`~medusa_runtime.engines.trt_plan.plan_graphs`
    order (the model, then the heads graph or the level graphs of path-conditioned heads)."""
    manifest = as_manifest(manifest)
    return [["trtexec", *trtexec_args(manifest, g, precision, workspace_mib=workspace_mib)] for g in plan_graphs(manifest)]


#: Lines of a failed trtexec's log that ``build_engine.sh`` prints (its error is at the end).
LOG_TAIL_LINES = 25


def build_script(folder: Path, manifest: Manifest | dict, workspace_mib: int | None = None,
                 default: str = "fp32") -> str:
    """A bash script that builds the engines of any precision this artifact takes (:func:`buildable`) with
    ``trtexec`` of TensorRT 10 or 11 (the same lines for both: :func:`trtexec_args`).

    Usage on the GPU machine: ``bash engines/build_engine.sh [PRECISION]`` (default ``default``). Each trtexec run's
    output goes to ``engines/build.GRAPH.PRECISION.log``; when one fails, the script prints the last
    :data:`LOG_TAIL_LINES` lines of that log and its path on stderr and exits with trtexec's status.

    Args:
        folder: the artifact root.
        manifest: its manifest.
        workspace_mib: trtexec's workspace pool in MiB (None: trtexec's default).
        default: the precision built when none is given.

    Returns:
        The script's text.
    """
    manifest = as_manifest(manifest)
    choices = "|".join(buildable(manifest))
    from .. import __version__

    cases = []
    for prec in buildable(manifest):
        lines = [f"  {prec})"]
        if graph_sources(manifest, prec)["model"].startswith(f"{ENGINE_DIR}/"):  # a typed graph: written by `engine`
            first = graph_sources(manifest, prec)["model"]
            lines += [f"    if [ ! -f {first} ]; then",
                      f"      echo \"build_engine.sh: {prec} engines build from the typed graph {first}: write it with "
                      f"'medusa-export engine --artifact . --precision {prec}' (needs no GPU nor TensorRT)\" >&2",
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
# Builds the TensorRT engines of this artifact on a machine with an NVIDIA GPU and TensorRT 10.x or 11.x
# (strongly typed: the precision is the ONNX's types; the same trtexec options for both majors).
# Written by medusa-export {__version__} from manifest.json (model {manifest.model.name}, tree of
# {manifest.tree.size} nodes, max context {manifest.model.max_context}); the shapes are the manifest's
# optimization profiles: model.onnx profile 0 = prefill, 1 = tree step, 2 = decode; {heads_note}.
#
#   bash engines/build_engine.sh [{choices}]     (default {default}; TRTEXEC=/path/to/trtexec to choose)
#
# Outputs: {', '.join(plans).replace('$PRECISION', 'PRECISION')}, engines/timing.cache, engines/layers.*.json (per-layer
# precisions, to check that norms and softmax stayed fp32), engines/build.*.log, engines/build_record.PRECISION.json.
set -euo pipefail
cd "$(dirname "${{BASH_SOURCE[0]}}")/.."   # the artifact root: ONNX external data resolves from here
PRECISION="${{1:-{default}}}"
TRTEXEC="${{TRTEXEC:-trtexec}}"
if ! command -v "$TRTEXEC" >/dev/null 2>&1; then
  echo "build_engine.sh: $TRTEXEC not found: install TensorRT 10.x or 11.x (trtexec ships in its bin/) or set TRTEXEC" >&2
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
    echo "usage: bash engines/build_engine.sh [{choices}]" >&2
    exit 2
    ;;
esac
seconds=$(( $(date +%s) - start ))
v=$(sed -n 's/.*\\[TensorRT v\\([0-9]*\\)\\].*/\\1/p' "{ENGINE_DIR}/build.model.$PRECISION.log" | head -n 1)
trt=""  # trtexec prints its version as [TensorRT vMMmmpp] (10.x, 11.x) or vMmpp (8.x)
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
    script.write_text(build_script(folder, manifest, workspace_mib, default=precision))
    script.chmod(0o755)
    return [cmd_rel, BUILD_SCRIPT]
