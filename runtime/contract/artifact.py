"""Reading an artifact directory: the manifest, its files and checksums, the tree.

The artifact is the contract between the exporter and everything downstream; this
module reads it without importing the exporter (numpy + json only).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ..trees.calibration import ProbabilityMap
from ..errors import ArtifactError, MedusaError
from .manifest import MANIFEST, Manifest, ModelInfo, as_manifest  # noqa: F401  (MANIFEST: for the exporter)
from .onnx_io import DeclaredTensor, declared_io
from ..trees.tree import Tree, tree_from_json

def level_graph(depth: int) -> str:
    """The manifest's ``graphs`` / ``files`` key of the level-``depth`` graph of path-conditioned heads."""
    return f"heads_level{depth}"

#: Files larger than this are checked by size only unless a full verification is asked for.
QUICK_HASH_LIMIT = 64 << 20


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    """Hex SHA-256 of a file, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class Artifact:
    """A loaded artifact.

    Attributes:
        path: the directory.
        manifest: the parsed, checked manifest.json (:class:`~medusa_runtime.contract.manifest.Manifest`).
        tree: the tree the artifact was built for.
        head_accuracies: float64 [K, topk] calibrated a_k^(i) the tree was built from
            (Medusa paper §2.3.3), or None when the build had no calibration.
        calibration: the heads' probability map (``tree.json`` ``calibration``; per-step trees), or None.
        simulated: {"static" | "dynamic": {nodes: tokens per step}} simulated by ``calibrate`` for
            these heads (``tree.json`` ``simulated``; ``--tree auto``), or None.
    """

    path: Path
    manifest: Manifest
    tree: Tree
    head_accuracies: np.ndarray | None = None
    calibration: ProbabilityMap | None = None
    simulated: dict | None = None

    def file(self, key: str) -> Path:
        """Absolute path of the file the manifest's ``files`` names ``key``."""
        return self.path / self.manifest.files[key]

    @property
    def model(self) -> ModelInfo:
        return self.manifest.model

    @property
    def head_type(self) -> str:
        """"medusa" (also when the manifest has no ``heads`` entry) or "hydra"."""
        return self.manifest.head_type


def _remedy(manifest: Manifest, path: Path, rel: str) -> str:
    """How to rewrite the damaged artifact file ``rel``: a TensorRT plan (or its build files) with
    ``medusa-export engine`` of the precision whose record lists it, anything else with a new build."""
    for precision, rec in (manifest.engines or {}).items():
        if rel in [v for v in rec.values() if isinstance(v, str)] or rel.endswith(f".{precision}.plan"):
            return f"rebuild the {precision} engines with `medusa-export engine --artifact {path} --precision {precision}`"
    if rel.startswith("engines/"):
        return f"rebuild the engines with `medusa-export engine --artifact {path}`"
    return "the artifact is damaged: export it again with `medusa-export build`"


def load_artifact(path: str | Path, *, full_verify: bool = False) -> Artifact:
    """Open and check an artifact directory.

    Checks: manifest present and valid JSON, format and version, every file in the
    checksum table present with the recorded size, SHA-256 of every file (of files up to
    :data:`QUICK_HASH_LIMIT` only, unless ``full_verify``), the tree consistent with
    the manifest (node count, depth <= heads), every manifest field the graphs also fix against
    the manifest's graph I/O lists (:func:`check_model_vs_graphs`), and those lists against the
    inputs and outputs the ONNX files declare (:func:`check_graph_files`).

    Raises:
        ArtifactError: ``path`` missing or not a directory (the message says how one is built); anything
            missing, edited or inconsistent; the message names the file/key.
    """
    path = Path(path)
    mpath = path / MANIFEST
    if not path.is_dir():
        what = f"{path} is a file, not an artifact directory" if path.exists() else \
            f"artifact directory {path} does not exist"
        raise ArtifactError(f"{what}: an artifact is the folder `medusa-export build` "
                            f"writes ({MANIFEST}, tree.json and the ONNX graphs), e.g. medusa-export build "
                            "--model smollm2-135m --out artifacts/smollm2 and then --artifact artifacts/smollm2")
    if not mpath.is_file():
        raise ArtifactError(f"{path} is not an artifact: {MANIFEST} is missing")
    try:
        doc = json.loads(mpath.read_text())
    except json.JSONDecodeError as exc:
        raise ArtifactError(f"{mpath} is not valid JSON: {exc}") from None
    try:
        manifest = Manifest.from_json(doc)
    except ArtifactError as exc:
        raise ArtifactError(f"{mpath}: {exc}") from None
    for rel, rec in manifest.checksums.items():
        f = path / rel
        if not f.is_file():
            raise ArtifactError(f"artifact file {rel} is missing from {path}: {_remedy(manifest, path, rel)}")
        size = f.stat().st_size
        if size != rec.bytes:
            raise ArtifactError(f"artifact file {rel} has {size} bytes, the manifest records {rec.bytes} (truncated or "
                                f"replaced): {_remedy(manifest, path, rel)}")
        if (full_verify or size <= QUICK_HASH_LIMIT) and sha256_file(f) != rec.sha256:
            raise ArtifactError(f"artifact file {rel} fails its SHA-256 check: it was changed after the build: "
                                f"{_remedy(manifest, path, rel)}")
    for key, rel in manifest.files.items():
        if rel not in manifest.checksums:
            raise ArtifactError(f"{mpath}: file {key}={rel} has no checksum")
    heads = manifest.model.medusa_heads
    try:
        tree_data = json.loads((path / manifest.files["tree"]).read_text())
        tree = tree_from_json(tree_data, num_heads=heads)
    except (MedusaError, KeyError, json.JSONDecodeError) as exc:
        raise ArtifactError(f"{path}: bad tree: {exc}") from None
    if tree.size != manifest.tree.size:
        raise ArtifactError(f"{path}: tree has {tree.size} nodes, the manifest records {manifest.tree.size}")
    check_model_vs_graphs(manifest, mpath, tree)
    check_fields_vs_graphs(manifest, mpath)
    check_graph_files(manifest, path)
    calibration = simulated = None
    if isinstance(tree_data, dict):
        try:
            if tree_data.get("calibration") is not None:
                calibration = ProbabilityMap.from_json(tree_data["calibration"])
            if tree_data.get("simulated") is not None:
                simulated = {str(p): {int(n): float(v) for n, v in t.items()} for p, t in tree_data["simulated"].items()}
        except (MedusaError, KeyError, TypeError, ValueError) as exc:
            raise ArtifactError(f"{path}: tree.json calibration/simulated: {exc}") from None
    return Artifact(path, manifest, tree, _accuracies(tree_data, path, heads), calibration, simulated)


def _accuracies(tree_data, path: Path, num_heads: int) -> np.ndarray | None:
    if not isinstance(tree_data, dict) or tree_data.get("head_accuracies") is None:
        return None
    acc = np.asarray(tree_data["head_accuracies"], dtype=np.float64)
    if acc.ndim != 2 or acc.shape[0] < num_heads or not np.all((acc >= 0) & (acc <= 1)):
        raise ArtifactError(f"{path}: tree.json head_accuracies must be probabilities [num_heads >= {num_heads}, "
                            f"topk], got shape {acc.shape}")
    return acc


def kv_layout(manifest: Manifest | dict) -> str:
    """The artifact's KV cache layout: "sequence-major" ([1, P, H_kv, D] past views, new K/V
    returned) or "head-major" ([1, H_kv, C, D] whole buffers written in place, ``ort-fused``).

    Raises:
        ArtifactError: an unknown layout name.
    """
    return as_manifest(manifest).layout


def check_model_vs_graphs(manifest: Manifest | dict, mpath: Path, tree: Tree) -> None:
    """The manifest's model geometry must agree with its own graph I/O lists.

    Checks: one key and one value input per layer, KV shape [1, P, H_kv, D] (head-major:
    [1, H_kv, C, D]), the heads
    graph's [R, K, topk] output against the Medusa head count and the tree's topk.

    Raises:
        ArtifactError: a disagreement (an edited manifest); the message names both values.
    """
    manifest = as_manifest(manifest)
    m = manifest.model
    layers, kv_heads, head_dim, heads = m.num_layers, m.num_kv_heads, m.head_dim, m.medusa_heads
    kind = manifest.head_type
    try:
        step = manifest.graphs["model"]
        heads_graphs = ([manifest.graphs[level_graph(j)] for j in range(1, heads + 1)] if kind == "hydra"
                        else [manifest.graphs["heads"]])
    except KeyError as exc:
        raise ArtifactError(f"{mpath}: incomplete model or graphs section (missing {exc})") from None
    past = [t.name for t in step.inputs if t.name.startswith("past_key_values.")]
    if len(past) != 2 * layers:
        raise ArtifactError(f"{mpath}: model.num_layers is {layers} but the step graph has {len(past)} "
                            f"past_key_values inputs (expected {2 * layers})")
    kv = step.shape("past_key_values.0.key") or []
    heads_and_dim = [kv[1], kv[3]] if manifest.layout == "head-major" and len(kv) == 4 else kv[2:]
    if heads_and_dim != [kv_heads, head_dim]:
        raise ArtifactError(f"{mpath}: the KV inputs are {kv} but the model section says "
                            f"{kv_heads} KV heads of dimension {head_dim}")
    if kind == "hydra":
        for j, g in enumerate(heads_graphs, start=1):
            ids = g.shape("level_topk_ids", outputs=True) or []
            if ids[1:] != [tree.topk]:
                raise ArtifactError(f"{mpath}: heads level {j} outputs {ids} but the tree uses top-{tree.topk}")
        return
    topk_ids = heads_graphs[0].shape("medusa_topk_ids", outputs=True) or []
    if topk_ids[1:] != [heads, tree.topk]:
        raise ArtifactError(f"{mpath}: the heads graph outputs {topk_ids} but the manifest has {heads} Medusa heads "
                            f"and the tree uses top-{tree.topk}")


#: Manifest fields that a graph's I/O also fixes: (field, graph key, "inputs" | "outputs", tensor, dim index).
#: A row applies when the graph has that tensor and the field is recorded; the dim must then equal the field.
FIELD_DIMS = (
    ("step_topk", "model", "outputs", "topk_ids", -1),
    ("step_topk", "model", "outputs", "topk_logprobs", -1),
    ("model.hidden_size", "model", "outputs", "hidden_states", -1),
    ("model.hidden_size", "heads", "inputs", "hidden_states", -1),
    ("model.medusa_heads", "heads", "outputs", "medusa_topk_logprobs", 1),
    ("heads.num_heads", "heads", "outputs", "medusa_topk_ids", 1),
    ("tree.topk", "heads", "outputs", "medusa_topk_logprobs", -1),
)

#: Manifest fields that fix a graph tensor's element type: (field, graph key, "inputs" | "outputs", tensor).
FIELD_DTYPES = (
    ("precision.kv_dtype", "model", "inputs", "past_key_values.0.key"),
    ("precision.kv_dtype", "model", "inputs", "past_key_values.0.value"),
)


def _field(manifest: Manifest, dotted: str):
    value = manifest
    for part in dotted.split("."):
        value = getattr(value, part, None)
    return value


def check_fields_vs_graphs(manifest: Manifest | dict, mpath: Path) -> None:
    """Every manifest field in :data:`FIELD_DIMS` / :data:`FIELD_DTYPES` must equal what its graph's I/O says.

    E.g. ``step_topk`` is k of the step graph's ``topk_ids`` [1, S, k]: an edited ``step_topk`` would make
    the loop treat a top-k it does not have as exact (and sample other tokens).

    Raises:
        ArtifactError: a disagreement; the message names the field, its value and the graph's.
    """
    manifest = as_manifest(manifest)
    for field, key, side, tensor, dim in FIELD_DIMS:
        value, graph = _field(manifest, field), manifest.graphs.get(key)
        spec = graph and next((t for t in getattr(graph, side) if t.name == tensor), None)
        if value is None or spec is None or not spec.shape:
            continue
        if spec.shape[dim] != value:
            raise ArtifactError(f"{mpath}: {field} is {value} but graphs.{key} {side[:-1]} {tensor} has shape "
                                f"{spec.shape} (dim {dim} = {spec.shape[dim]})")
    for field, key, side, tensor in FIELD_DTYPES:
        value, graph = _field(manifest, field), manifest.graphs.get(key)
        spec = graph and next((t for t in getattr(graph, side) if t.name == tensor), None)
        if value is not None and spec is not None and spec.dtype != value:
            raise ArtifactError(f"{mpath}: {field} is {value} but graphs.{key} {side[:-1]} {tensor} is {spec.dtype}")


def _io_mismatch(recorded, declared: list[DeclaredTensor]) -> str | None:
    """What differs between a manifest I/O list and a file's declared one (None: they agree)."""
    by_name = {t.name: t for t in declared}
    names, file_names = [t.name for t in recorded], [t.name for t in declared]
    if sorted(names) != sorted(file_names):
        missing, extra = sorted(set(file_names) - set(names)), sorted(set(names) - set(file_names))
        return f"the manifest lists {extra or 'no'} tensors the file lacks and lacks {missing or 'none'} of the file's"
    for t in recorded:
        d = by_name[t.name]
        if d.dtype is not None and d.dtype != t.dtype:
            return f"{t.name} is {t.dtype} in the manifest, {d.dtype} in the file"
        if d.shape is None:
            continue
        fixed = [(a, b) for a, b in zip(t.shape, d.shape) if isinstance(a, int) or isinstance(b, int)]
        if len(t.shape) != len(d.shape) or any(a != b for a, b in fixed):
            return f"{t.name} has shape {t.shape} in the manifest, {d.shape} in the file"
    return None


def check_graph_files(manifest: Manifest | dict, path: Path) -> None:
    """Each graph's I/O list in the manifest must match the inputs and outputs its ONNX file declares.

    Names (as sets), element types and every fixed dim are compared; symbolic dims may have other
    names. The files are read with :func:`medusa_runtime.contract.onnx_io.declared_io` (their I/O fields only).
    With :func:`check_model_vs_graphs` this ties each manifest field the graphs fix to the graphs themselves.

    Raises:
        ArtifactError: a disagreement; the message names the graph, the tensor and both values.
    """
    manifest = as_manifest(manifest)
    for key, graph in manifest.graphs.items():
        io = declared_io(path / graph.file)
        for side, recorded, declared in (("inputs", graph.inputs, io.inputs), ("outputs", graph.outputs, io.outputs)):
            problem = _io_mismatch(recorded, declared)
            if problem:
                raise ArtifactError(f"{path / MANIFEST}: graphs.{key} {side} disagree with {graph.file}: {problem}")


#: The in-graph sampler's tensors (docs/sampling.md), by the manifest's ``step_sampler.version``.
STEP_SAMPLER_IO = {1: (("sample_uniforms", "sample_top_k", "sample_top_p"), ("sampled_ids",))}


class StepLimits(NamedTuple):
    """What an engine tells the decode loop about its step graph (see :class:`medusa_runtime.engines.base.Engine`)."""

    max_context: int  # KV capacity the graphs were built for (model.max_context)
    vocab_size: int
    step_topk: int | None  # k of topk_ids / topk_logprobs (None: not recorded)
    has_sampler: bool  # the in-graph sampler (step_sampler)
    min_rows: int = 1  # precision.step_rows.min_rows: pad smaller steps to this many rows
    chain_trees: bool = False  # precision.step_rows.trees == "chain": Medusa is exact on chains only


def step_limits(manifest: Manifest | dict) -> StepLimits:
    """The :class:`StepLimits` of an artifact's step graph.

    Raises:
        ArtifactError: a bad ``step_sampler`` entry (:func:`step_sampler`).
    """
    manifest = as_manifest(manifest)
    m = manifest.model
    rows = manifest.precision.step_rows if manifest.precision is not None else None
    return StepLimits(int(m.max_context), int(m.vocab_size), int(manifest.step_topk or 0) or None,
                      step_sampler(manifest), min_rows=int(rows.min_rows) if rows else 1,
                      chain_trees=bool(rows and rows.trees == "chain"))


#: Versions of the manifest's ``batch`` entry this runtime reads.
STEP_BATCH_VERSIONS = (1,)


def step_batch(manifest: Manifest | dict) -> int:
    """The batch size a batched step graph was built for (the manifest's ``batch.max_batch_size``), or 0
    for a batch-1 graph (no ``batch`` entry: every artifact built before batching).

    A batched step graph (docs/batching.md) takes B rows per call: ``input_ids`` / ``position_ids``
    [B, S], ``new_token_mask`` [B, S, S], ``temperature`` [B], ``past_sequence_length`` int32 [B] and
    the rows' pasts ([B, P, H_kv, D] sequence-major, or [B, H_kv, C, D] head-major), and returns each
    row's new K/V (``new_key_values.{i}.*``; it writes no buffer in place); B is dynamic (any B runs;
    ``max_batch_size`` is what it was built and profiled for).

    Raises:
        ArtifactError: an unknown ``batch`` version, a bad size, or a step graph without
            ``past_sequence_length`` or ``new_key_values.*``.
    """
    manifest = as_manifest(manifest)
    spec = manifest.batch
    if spec is None:
        return 0
    version = spec.version
    if version not in STEP_BATCH_VERSIONS:
        raise ArtifactError(f"batch version {version!r} is not supported (this runtime reads "
                            f"{', '.join(map(str, STEP_BATCH_VERSIONS))})")
    size = spec.max_batch_size
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ArtifactError(f"batch.max_batch_size must be an integer >= 1, got {size!r}")
    manifest.layout  # noqa: B018 (checks the layout name)
    names = manifest.graphs["model"].names()
    missing = [n for n in ("past_sequence_length", "new_key_values.0.key") if n not in names]
    if missing:
        raise ArtifactError(f"batch is declared but the step graph lacks {', '.join(missing)}")
    return size


def step_sampler(manifest: Manifest | dict) -> bool:
    """Whether the step graph has the in-graph sampler (the manifest's ``step_sampler``, docs/sampling.md).

    Absent: no sampler (every artifact built before it). Present: ``{"version": 1, ...}``, and the
    step graph's I/O lists must hold its inputs ``sample_uniforms`` float32 [1, S], ``sample_top_k``
    int64 [1], ``sample_top_p`` float32 [1] and its output ``sampled_ids`` int64 [1, S].

    Raises:
        ArtifactError: an unknown version, or tensors missing from the step graph's I/O lists.
    """
    manifest = as_manifest(manifest)
    spec = manifest.step_sampler
    if spec is None:
        return False
    version = spec.version
    if version not in STEP_SAMPLER_IO:
        raise ArtifactError(f"step_sampler version {version!r} is not supported (this runtime reads "
                            f"{', '.join(map(str, STEP_SAMPLER_IO))})")
    names = manifest.graphs["model"].names()
    missing = [n for group in STEP_SAMPLER_IO[version] for n in group if n not in names]
    if missing:
        raise ArtifactError(f"step_sampler is declared but the step graph lacks {', '.join(missing)}")
    return True
