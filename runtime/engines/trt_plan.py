"""Pure planning for TensorRT: optimization profiles, concrete shapes, KV buffer layout, compaction copies.

Everything here is numpy/json only and tested without TensorRT; ``trt`` (runtime)
and ``medusa_export.trt`` (engine build, trtexec command) both read their shapes from here,
so the profiles an engine is built with and the ones the runtime selects are the same.

The manifest's ``graphs.model.profiles`` gives each profile as ranges of the symbolic
dims, e.g. ``{"tree_step": {"S": [T, T], "P": [0, max_context - T]}}``; the heads graph
gets one profile over R in [1, T].
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..contract.artifact import level_graph
from ..errors import ArtifactError, MedusaError
from ..contract.manifest import Manifest, TensorSpec, as_manifest
from .kvcache import compaction_slots

#: Order of the model graph's optimization profiles in an engine (profile index = position).
PROFILE_ORDER = ("prefill", "tree_step", "decode")
#: TensorRT requires I/O tensor addresses aligned to this many bytes.
ALIGN = 256
#: Folder of an artifact that holds engines, their build records and build commands.
ENGINE_DIR = "engines"

_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int8": 1, "bool": 1}


class ShapeOutOfProfileError(MedusaError, ValueError):
    """No optimization profile of the engine covers a step's sizes; the message lists the profiles."""


class PlanMismatchError(ArtifactError):
    """A plan was built for another TensorRT version, GPU model, precision or set of profiles than this
    machine and manifest: the message says what differs and how to rebuild."""


@dataclass(frozen=True)
class Profile:
    """One optimization profile: symbol -> (min, opt, max), e.g. {"S": (16, 16, 16), "P": (0, 120, 240)}."""

    name: str
    dims: dict

    def contains(self, sizes: dict[str, int]) -> bool:
        """Whether every symbol of the profile is given and inside its [min, max]."""
        return all(s in sizes and lo <= sizes[s] <= hi for s, (lo, _, hi) in self.dims.items())

    def volume(self) -> int:
        """Number of size combinations the profile admits (smaller = more specific)."""
        v = 1
        for lo, _, hi in self.dims.values():
            v *= hi - lo + 1
        return v

    def describe(self) -> str:
        return f"{self.name}(" + ", ".join(f"{s} in [{lo}, {hi}]" for s, (lo, _, hi) in self.dims.items()) + ")"


def _opt(lo: int, hi: int) -> int:
    """The size TensorRT tunes kernels for: the middle of the range (a neutral choice)."""
    return lo + (hi - lo) // 2


#: Per profile, symbols whose opt size is the range's minimum instead of its middle: a real prefill (a
#: first prompt) has no past, so the prefill profile is tuned for P = 0, and the batch scheduler prefills each
#: sequence in a call of its own, so a batched graph's prefill is tuned for B = 1 (TensorRT picks kernels for opt).
OPT_AT_MIN = {"prefill": ("P", "B")}


def model_profiles(manifest: Manifest | dict) -> list[Profile]:
    """The backbone step graph's profiles, in :data:`PROFILE_ORDER` (opt sizes: :data:`OPT_AT_MIN`, else the
    middle of each range)."""
    spec = as_manifest(manifest).graphs["model"].profiles or {}
    unknown = set(spec) - set(PROFILE_ORDER)
    if unknown:
        raise MedusaError(f"manifest lists unknown profiles {sorted(unknown)}; known: {', '.join(PROFILE_ORDER)}")
    return [Profile(name, {s: (lo, lo if s in OPT_AT_MIN.get(name, ()) else _opt(lo, hi), hi)
                           for s, (lo, hi) in spec[name].items()})
            for name in PROFILE_ORDER if name in spec]


def heads_profiles(manifest: Manifest | dict) -> list[Profile]:
    """The heads graph's one profile: R (rows) in [1, tree size], tuned for the loop's R = 1."""
    return [Profile("heads", {"R": (1, 1, max(1, as_manifest(manifest).tree.size))})]


def level_profiles(manifest: Manifest | dict) -> list[Profile]:
    """A level graph's (``heads_level{j}``, path-conditioned heads) one profile: H hidden rows and R paths, each
    in [1, tree size] (a level expands at most every node of the tree; the loop feeds one hidden row, H = 1,
    for all of a sequence's paths), tuned for H = R = 1 (level 1 always has the one root path)."""
    t = max(1, as_manifest(manifest).tree.size)
    return [Profile("paths", {"H": (1, 1, t), "R": (1, 1, t)})]


def heads_graphs(manifest: Manifest | dict) -> list[str]:
    """The manifest's heads graphs a plan is built for: ``["heads"]`` (Medusa heads, one graph) or
    ``heads_level1 .. heads_levelK`` (path-conditioned heads, one graph per tree level)."""
    m = as_manifest(manifest)
    return [level_graph(j) for j in range(1, m.model.medusa_heads + 1)] if m.head_type == "hydra" else ["heads"]


def plan_graphs(manifest: Manifest | dict) -> list[str]:
    """Every graph a precision's plans cover, in build order: ``model``, then :func:`heads_graphs`."""
    return ["model", *heads_graphs(manifest)]


def graph_profiles(manifest: Manifest | dict, graph: str) -> list[Profile]:
    """Profiles of ``graph`` ("model", "heads" or a level graph ``heads_level{j}``)."""
    if graph == "model":
        return model_profiles(manifest)
    return heads_profiles(manifest) if graph == "heads" else level_profiles(manifest)


def select_profile(profiles: list[Profile], sizes: dict[str, int]) -> int:
    """Index of the most specific profile containing ``sizes`` (first one on a tie).

    Raises:
        ShapeOutOfProfileError: no profile contains them.
    """
    fits = [(p.volume(), i) for i, p in enumerate(profiles) if p.contains(sizes)]
    if not fits:
        raise ShapeOutOfProfileError(
            f"no optimization profile covers {sizes}; the engine has " + "; ".join(p.describe() for p in profiles))
    return min(fits)[1]


def concrete_shape(shape: list, sizes: dict[str, int]) -> tuple[int, ...]:
    """A manifest shape (ints and symbols) with its symbols replaced by ``sizes``.

    Raises:
        KeyError: a symbol has no size.
    """
    return tuple(int(d) if isinstance(d, int) else int(sizes[d]) for d in shape)


def _specs(tensors: list) -> list[TensorSpec]:
    """Manifest tensors as :class:`TensorSpec` (given as such, or as their JSON entries)."""
    return [t if isinstance(t, TensorSpec) else TensorSpec.from_json(t, "tensor") for t in tensors]


def profile_shapes(tensors: list[TensorSpec], profile: Profile) -> dict[str, tuple[tuple, tuple, tuple]]:
    """Per input tensor of the manifest (:class:`TensorSpec` or its JSON): (min, opt, max) concrete shapes under
    ``profile``."""
    pick = [{s: r[k] for s, r in profile.dims.items()} for k in range(3)]
    return {t.name: tuple(concrete_shape(t.shape, sizes) for sizes in pick) for t in _specs(tensors)}


def io_shapes(tensors: list[TensorSpec], sizes: dict[str, int]) -> dict[str, tuple[int, ...]]:
    """Concrete shapes of the manifest's tensors (inputs or outputs; :class:`TensorSpec` or its JSON) for
    ``sizes``."""
    return {t.name: concrete_shape(t.shape, sizes) for t in _specs(tensors)}


def plan_files(manifest: Manifest | dict, precision: str) -> dict[str, str]:
    """Artifact-relative plan paths of ``precision`` by graph (:func:`plan_graphs`): the manifest's record
    (``model_plan``, ``heads_plan`` or ``heads_level{j}_plan``), else the default names."""
    rec = (as_manifest(manifest).engines or {}).get(precision, {})
    return {g: rec.get(f"{g}_plan", f"{ENGINE_DIR}/{g}.{precision}.plan") for g in plan_graphs(manifest)}


#: The plans' precision when none is asked for and the manifest records no built plans.
#: The precisions ``medusa-export engine --precision`` builds plans in (``engines/*.PRECISION.plan``); the one
#: table the exporter's options and the runtime's ``--engine-precision`` both read.
ENGINE_PRECISIONS = ("fp16", "bf16", "fp32", "int4", "int8", "fp8")
DEFAULT_PRECISION = "fp16"


def built_precisions(manifest: Manifest | dict) -> list[str]:
    """The precisions whose plans the manifest's engine records mark built, in record order."""
    return [p for p, rec in (as_manifest(manifest).engines or {}).items() if rec.get("status") == "built"]


def default_precision(manifest: Manifest | dict) -> str:
    """The precision of the first built plans in the manifest's engine records, else :data:`DEFAULT_PRECISION`."""
    built = built_precisions(manifest)
    return built[0] if built else DEFAULT_PRECISION


def nbytes(shape: tuple[int, ...], dtype: str) -> int:
    """Bytes of a dense tensor of ``dtype`` (manifest dtype name)."""
    return int(np.prod(shape, dtype=np.int64)) * _ITEMSIZE[dtype]


def align(n: int, to: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``to``."""
    return -(-n // to) * to


@dataclass(frozen=True)
class KVLayout:
    """One device allocation for all layers' K and V, sequence-major.

    Plane ``2 * layer + (0 for key, 1 for value)`` holds ``[1, slots, H_kv, D]``; a plane's
    size is padded to :data:`ALIGN`, so every plane (the address TensorRT gets for a
    layer's past K or V, whose valid prefix is contiguous) is aligned. The step's new K/V
    use the same layout with ``slots`` = the largest S of the engine's profiles.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    itemsize: int
    slots: int

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's K (or V) of one layer: H_kv * D * itemsize."""
        return self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def plane_bytes(self) -> int:
        return align(self.slots * self.row_bytes)

    @property
    def planes(self) -> int:
        return 2 * self.num_layers

    @property
    def total_bytes(self) -> int:
        return self.planes * self.plane_bytes

    def plane_offset(self, layer: int, kind: str) -> int:
        """Byte offset of layer ``layer``'s "key" or "value" plane."""
        return (2 * layer + {"key": 0, "value": 1}[kind]) * self.plane_bytes


def kv_bindings(layout: KVLayout, prefix: str) -> dict[str, int]:
    """Tensor name -> byte offset in the allocation, e.g. ``past_key_values.3.value``."""
    return {f"{prefix}.{i}.{kind}": layout.plane_offset(i, kind)
            for i in range(layout.num_layers) for kind in ("key", "value")}


@dataclass(frozen=True)
class Copy2D:
    """One ``cudaMemcpy2DAsync``: ``height`` rows of ``width`` bytes, one row per K/V plane."""

    dst_offset: int
    dpitch: int
    src_offset: int
    spitch: int
    width: int
    height: int


def compaction_runs(accepted: np.ndarray) -> list[tuple[int, int, int]]:
    """Accepted node indices -> runs (first source node, first destination index, count).

    Consecutive node indices are merged: ``[0, 1, 5, 6, 9]`` -> ``[(0, 0, 2), (5, 2, 2), (9, 4, 1)]``.
    """
    acc = [int(a) for a in np.asarray(accepted).reshape(-1)]
    runs: list[list[int]] = []
    for i, a in enumerate(acc):
        if runs and a == runs[-1][0] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([a, i, 1])
    return [tuple(r) for r in runs]


def compaction_copies(new: KVLayout, cache: KVLayout, past_len: int, accepted: np.ndarray, *,
                      in_place: bool = False) -> list[Copy2D]:
    """Device copies that move the accepted nodes' K/V from the step output into the cache.

    Node ``accepted[i]`` of every layer's new K and V (rows of ``new``) lands in cache slot
    ``past_len + i`` of the same plane: one 2-D copy per run of consecutive nodes covers all
    ``2 * num_layers`` planes at once (height = planes, pitches = the plane sizes). The
    result equals :func:`medusa_runtime.engines.kvcache.write_accepted` applied to every plane.

    With ``in_place`` the step wrote its K/V straight into the cache at slot 0 (a prefill:
    past_len 0, ``new`` is ``cache``): rows already in place are skipped and the others are
    copied one row at a time, in order, so that no copy reads a row an earlier one wrote
    (node indices on a root-to-leaf path increase: row ``accepted[i] >= i``).

    Raises:
        ContextOverflowError: the accepted nodes do not fit the cache.
        ValueError: the layouts disagree, a node index is outside the step's output, or an
            in-place compaction is asked for with a past or with decreasing node indices.
    """
    if (new.num_layers, new.num_kv_heads, new.head_dim, new.itemsize) != \
            (cache.num_layers, cache.num_kv_heads, cache.head_dim, cache.itemsize):
        raise ValueError("new-K/V and cache layouts differ in layers, heads, head_dim or dtype")
    acc = np.asarray(accepted).reshape(-1)
    compaction_slots(past_len, acc, cache.slots)  # capacity check
    if acc.size and (acc.min() < 0 or acc.max() >= new.slots):
        raise ValueError(f"accepted node indices {acc.tolist()} outside the step's {new.slots} rows")
    rb = new.row_bytes
    runs = compaction_runs(acc)
    if in_place:
        if past_len != 0 or np.any(np.diff(acc) <= 0):
            raise ValueError("in-place compaction needs past_len 0 and increasing node indices")
        runs = [(src + k, dst + k, 1) for src, dst, count in runs if src != dst for k in range(count)]
    return [Copy2D(dst_offset=(past_len + dst) * rb, dpitch=cache.plane_bytes, src_offset=src * rb,
                   spitch=new.plane_bytes, width=count * rb, height=new.planes)
            for src, dst, count in runs]


def packed_layout(row: KVLayout, rows: int, slots: int) -> KVLayout:
    """The layout of a batched call's K/V: per plane ``rows`` rows of ``slots`` slots each, [B, slots, H_kv, D]
    (row b's slot j at byte ``(b * slots + j) * row_bytes`` of the plane), planes as in ``row``.

    The batched step graph's past and new K/V are [B, P, H_kv, D] and [B, S, H_kv, D] per layer
    (medusa_export's step contract, docs/batching.md): one such allocation binds them all, a plane per layer
    and K/V, each plane 256-byte aligned (:data:`ALIGN`)."""
    return KVLayout(row.num_layers, row.num_kv_heads, row.head_dim, row.itemsize, rows * slots)


def pack_copies(caches: list[KVLayout], lengths, packed: KVLayout, slots: int,
                packed_lengths=None) -> list[tuple[int, Copy2D]]:
    """Device copies that pack B rows' valid pasts into a batched call's past (:func:`packed_layout`).

    Row b's slots [start_b, lengths[b]) of every plane of its cache (offset 0 of its own allocation) land at the
    same slots of row b of the packed plane, start_b = ``packed_lengths[b]`` (the slots already packed by an
    earlier call) or 0: one 2-D copy per row covers all planes (height = planes, pitches = the plane sizes);
    rows with nothing new need none. The packed slots past a row's length are not written (the graph masks
    them with ``past_sequence_length``).

    Args:
        caches: each row's cache layout (same geometry as ``packed``).
        lengths: each row's valid past length, <= ``slots``.
        packed: the packed layout (``slots`` per row).
        slots: P, the packed past length per row.
        packed_lengths: each row's slots already in the packed buffer (<= its length), or None (none).

    Returns:
        (row index, :class:`Copy2D` with source offset in the row's cache) per row with slots to copy.

    Raises:
        ValueError: the layouts disagree, a row's length exceeds ``slots`` or its cache, or a row's packed
            length exceeds its length.
    """
    starts = [0] * len(caches) if packed_lengths is None else [int(n) for n in packed_lengths]
    out = []
    for b, (cache, n, start) in enumerate(zip(caches, lengths, starts)):
        n = int(n)
        if (cache.num_layers, cache.num_kv_heads, cache.head_dim, cache.itemsize) != \
                (packed.num_layers, packed.num_kv_heads, packed.head_dim, packed.itemsize):
            raise ValueError("row cache and packed layouts differ in layers, heads, head_dim or dtype")
        if not 0 <= n <= min(slots, cache.slots):
            raise ValueError(f"row {b}'s past of {n} slots does not fit {slots} packed slots ({cache.slots} cached)")
        if not 0 <= start <= n:
            raise ValueError(f"row {b} has {start} packed slots but a past of {n}")
        rb = cache.row_bytes
        if n > start:
            out.append((b, Copy2D(dst_offset=(b * slots + start) * rb, dpitch=packed.plane_bytes,
                                  src_offset=start * rb, spitch=cache.plane_bytes, width=(n - start) * rb,
                                  height=packed.planes)))
    return out


def profiles_json(manifest: Manifest | dict) -> dict[str, list[dict]]:
    """Per graph, the profiles a plan is built with (name and (min, opt, max) per symbol), as the build record
    keeps them."""
    return {g: [{"name": p.name, "dims": {s: list(r) for s, r in p.dims.items()}} for p in graph_profiles(manifest, g)]
            for g in plan_graphs(manifest)}


def plan_sources(manifest: Manifest | dict, precision: str | None = None) -> dict[str, str]:
    """SHA-256 of the files a plan is built from, by artifact-relative path, from the manifest's checksum table
    (files it does not list are left out): the model and heads graphs and their external weights, or, where the
    engine record of ``precision`` names ``typed_graphs`` (a typed graph written beside the plans from a float32
    artifact, ``medusa-export engine --precision fp16|bf16``), those files."""
    m = as_manifest(manifest)
    typed = ((m.engines or {}).get(precision) or {}).get("typed_graphs") if precision else None
    if typed:
        files = list(typed.values())
    else:
        files = [m.graphs[g].file for g in plan_graphs(m) if g in m.graphs]
        if m.weights is not None:
            files.append(m.weights.file)
    return {f: m.checksums[f].sha256 for f in files if f in m.checksums}


#: The parts of a plan's key, as (record field, what it is): a plan runs only where each is the same
#: (TensorRT's developer guide: plans are "specific to the exact GPU model they were built on" and not
#: portable "across platforms or TensorRT versions"; its profiles and graphs are the manifest's).
PLAN_KEY = (("tensorrt", "TensorRT"), ("gpu", "GPU"), ("compute_capability", "compute capability"),
            ("precision", "precision"), ("profiles", "optimization profiles"), ("sources", "graphs"))


def plan_key_mismatches(record: dict, current: dict) -> list[str]:
    """What differs between a plan's build record and this machine / artifact (``current``: the same fields).

    A field the record lacks (a plan built by ``engines/build_engine.sh``, an older record) or that is
    "unknown" on either side is not compared.

    Args:
        record: the manifest's ``engines[precision]`` entry (written by ``medusa-export engine``).
        current: :data:`PLAN_KEY`'s fields for this machine and artifact.

    Returns:
        One phrase per differing field, e.g. ``"TensorRT 10.3.0 (this machine has 10.15.1)"``.
    """
    out = []
    for field, what in PLAN_KEY:
        built, here = record.get(field), current.get(field)
        if built in (None, "unknown") or here in (None, "unknown") or built == here:
            continue
        if field == "profiles":
            out.append(f"{what} (the manifest's profiles changed since the build)")
        elif field == "sources":
            changed = sorted(f for f in set(built) | set(here) if built.get(f) != here.get(f))
            out.append(f"{what} {', '.join(changed)} (the plans were built from other files than this artifact's: "
                       f"checksums differ)")
        else:
            out.append(f"{what} {built} (this machine has {here})")
    return out
