"""``weights.bin``: every exported tensor written once, as it is made from its source tensors.

A :class:`Recipe` says how one exported tensor (or, for MatMulNBits, its three tensors) is made from
checkpoint tensors: which keys (concatenated along the output rows), kept ``[out, in]`` or transposed to a
MatMul's ``[in, out]``, in float32 / float16 or quantized to MatMulNBits int8 / int4 blocks (with
onnxruntime's own quantization kernels, ``quantize_matmul_{4,8}bits``: the bytes
``MatMulNBitsQuantizer`` would write). :class:`WeightsWriter` reads the sources, converts, appends the
bytes to ``weights.bin`` (4096-byte aligned) and drops them, one tensor (or one block of rows) at a time,
recording each tensor's offset, length and the SHA-256 of its bytes. The same recipe asked twice (the tied
embedding and lm_head, the heads' shared lm_head) is written once; so is a tensor whose bytes equal an
earlier one's (the file is cut back to before it).

:class:`WeightsPlan` answers the same calls from the headers alone (names, shapes, bytes), so the
graphs can be laid out and the disk checked before anything is read. :func:`verify_weights` re-reads
every tensor from ``weights.bin`` and re-derives it from the sources, streamed, against the recorded
SHA-256 (validation check (b), issue 13).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import asdict, dataclass, field
from math import prod
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
from onnx import TensorProto

from ..errors import MedusaError
from ..loading.checkpoint import TensorSource
from .quantize import WEIGHT_ONLY_BITS, nbits_geometry, quantize_rows

WEIGHTS_FILE = "weights.bin"
ALIGN = 4096
#: Elements converted per block of rows (float32: 64 MiB), so a large matrix is never whole in memory twice.
CHUNK_ELEMENTS = 1 << 24
_ONNX_DTYPE = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "uint8": TensorProto.UINT8,
               "int64": TensorProto.INT64, "int32": TensorProto.INT32}


class WeightsCheckError(MedusaError):
    """A tensor in ``weights.bin`` differs from its recorded checksum or from its source re-converted."""


@dataclass(frozen=True)
class Recipe:
    """How one exported tensor is made from checkpoint tensors.

    Attributes:
        source: which :class:`TensorSource` ("backbone" or "heads").
        keys: source tensors, concatenated along dim 0 (the output rows of ``[out, in]`` weights).
        layout: "rows" keeps ``[out, in]`` (Gather tables, ``Gemm(transB=1)``, norms, biases); "cols" writes the
            transpose ``[in, out]`` (a ``MatMul`` weight).
        dtype: "float32", "float16", or "int8" / "int4": MatMulNBits blocks of the rows (three tensors: the
            packed weight ``[N, blocks, blob]`` uint8, scales ``[N, blocks]`` float32, zero points uint8).
        block_size: MatMulNBits block (int8 / int4 only).
        symmetric: symmetric blocks, no zero points (int8 / int4 only).
        rows_of: name of an int64 ``[N]`` tensor written before (the heads' vocabulary subset): the
            output holds those rows of the concatenated keys, in that order.
    """

    source: str
    keys: tuple[str, ...]
    layout: str = "rows"
    dtype: str = "float32"
    block_size: int = 0
    symmetric: bool = False
    rows_of: str = ""

    @property
    def quantized(self) -> bool:
        return self.dtype in WEIGHT_ONLY_BITS

    def to_json(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if v not in ("", 0, False) or k in ("source", "keys")}
        d["keys"] = list(self.keys)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Recipe":
        return cls(**{**d, "keys": tuple(d["keys"])})


@dataclass(frozen=True)
class OutTensor:
    """One tensor a recipe makes: its graph name, ONNX dtype name and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * np.dtype(self.dtype).itemsize


def recipe_outputs(name: str, recipe: Recipe, sources: dict[str, TensorSource],
                   row_counts: dict[str, int] | None = None) -> list[OutTensor]:
    """The tensors ``recipe`` makes under base name ``name``, from the sources' headers only.

    Raises:
        MedusaError: keys whose trailing dims differ (cannot be concatenated), or a quantized recipe on a
            tensor that is not 2-D.
    """
    src = sources[recipe.source]
    infos = [src.info(k) for k in recipe.keys]
    tails = {i.shape[1:] for i in infos}
    if len(tails) != 1:
        raise MedusaError(f"{name}: cannot concatenate {', '.join(recipe.keys)} (shapes {[i.shape for i in infos]})")
    rows = sum(i.shape[0] for i in infos)
    if recipe.rows_of:
        rows = (row_counts or {})[recipe.rows_of]
    shape = (rows, *tails.pop())
    if recipe.quantized:
        if len(shape) != 2:
            raise MedusaError(f"{name}: MatMulNBits needs a 2-D weight, {recipe.keys[0]} is {list(shape)}")
        n, k = shape
        blocks, blob, zp = nbits_geometry(k, WEIGHT_ONLY_BITS[recipe.dtype], recipe.block_size)
        q = f"{name}_Q{WEIGHT_ONLY_BITS[recipe.dtype]}"
        outs = [OutTensor(q, "uint8", (n, blocks, blob)), OutTensor(f"{q}_scales", "float32", (n, blocks))]
        if not recipe.symmetric:
            outs.append(OutTensor(f"{q}_zero_points", "uint8", (n, zp)))
        return outs
    if recipe.layout == "cols":
        shape = (*shape[1:][::-1], shape[0]) if len(shape) == 2 else shape[::-1]
    return [OutTensor(name, recipe.dtype, shape)]


_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16}


def _to(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype`` (itself when it already is; bfloat16 / float16 / float32 values convert exactly or
    round once, as ``Tensor.to`` does)."""
    return t if t.dtype == dtype else t.to(dtype)


def produce(recipe: Recipe, sources: dict[str, TensorSource], arrays: dict[str, np.ndarray],
            chunk_elements: int = CHUNK_ELEMENTS) -> Iterator[tuple[int, np.ndarray]]:
    """The bytes of ``recipe``'s output tensors, as (output index, C-contiguous array) blocks in file order.

    Float "rows" recipes and quantized ones stream blocks of rows (at most ``chunk_elements`` values at
    a time); a float "cols" recipe transposes whole source tensors (one weight matrix at a time; torch's
    blocked transpose: 4-5x numpy's strided copy, measured on a [5632, 2048] fp16 matrix).
    """
    src = sources[recipe.source]
    target = torch.float32 if recipe.quantized else _TORCH_DTYPES[recipe.dtype]

    def row_blocks() -> Iterator[torch.Tensor]:
        if recipe.rows_of:
            ids = torch.from_numpy(np.asarray(arrays[recipe.rows_of], np.int64))
            whole = torch.cat([_to(src.read(k), target) for k in recipe.keys])
            step = max(1, chunk_elements // max(1, prod(whole.shape[1:])))
            for i in range(0, len(ids), step):
                yield whole.index_select(0, ids[i:i + step])
            return
        for key in recipe.keys:
            shape = src.info(key).shape
            step = max(1, chunk_elements // max(1, prod(shape[1:])))
            for i in range(0, shape[0], step):
                yield _to(src.read_rows(key, i, min(shape[0], i + step)), target)

    if recipe.quantized:
        scales, zps = [], []
        for block in row_blocks():
            packed, s, z = quantize_rows(block.contiguous().numpy(), WEIGHT_ONLY_BITS[recipe.dtype], recipe.block_size,
                                         recipe.symmetric)
            scales.append(s)
            zps.append(z)
            yield 0, packed
        yield 1, np.concatenate(scales)
        if not recipe.symmetric:
            yield 2, np.concatenate(zps)
    elif recipe.layout == "rows":
        for block in row_blocks():
            yield 0, block.contiguous().numpy()
    else:
        parts = [_to(src.read(k), target) for k in recipe.keys]
        whole = parts[0] if len(parts) == 1 else torch.cat(parts)
        del parts
        yield 0, whole.t().contiguous().numpy()


@dataclass
class TensorRecord:
    """Where one exported tensor lies in ``weights.bin`` and what it is (the manifest's ``weights.tensors``)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    length: int
    sha256: str
    recipe: dict = field(default_factory=dict)  # Recipe.to_json() + "output" index; or {"array": origin}

    def to_json(self) -> dict:
        d = asdict(self)
        d["shape"] = list(self.shape)
        return d

    def proto(self, location: str = WEIGHTS_FILE) -> TensorProto:
        """An initializer referencing these bytes as external data (``location`` relative to the graph file)."""
        t = TensorProto()
        t.name, t.data_type = self.name, _ONNX_DTYPE[self.dtype]
        t.dims.extend(self.shape)
        t.data_location = TensorProto.EXTERNAL
        for k, v in (("location", location), ("offset", str(self.offset)), ("length", str(self.length))):
            e = t.external_data.add()
            e.key, e.value = k, v
        return t


class WeightsPlan:
    """The weights a graph layout needs, from headers only: names, shapes, bytes (no file is written).

    The graph writers call :meth:`add` / :meth:`add_array` on a plan exactly as on a :class:`WeightsWriter`,
    so a plan run first gives the byte count (disk check, progress total) before anything is read.
    """

    def __init__(self, sources: dict[str, TensorSource]):
        self.sources = sources
        self._by_recipe: dict[Recipe, list[OutTensor]] = {}
        self._by_name: dict[str, OutTensor] = {}
        self._rows: dict[str, int] = {}

    def add(self, name: str, recipe: Recipe) -> list[OutTensor]:
        """The output tensors of ``recipe`` (the earlier ones when the same recipe was added before)."""
        if recipe in self._by_recipe:
            return self._by_recipe[recipe]
        outs = recipe_outputs(name, recipe, self.sources, self._rows)
        for o in outs:
            if o.name in self._by_name:
                raise MedusaError(f"two different weights are both named {o.name!r}")
            self._by_name[o.name] = o
        self._by_recipe[recipe] = outs
        self._accept(recipe, outs)
        return outs

    def add_array(self, name: str, array: np.ndarray, origin: str) -> OutTensor:
        """A tensor computed by the exporter (not read from a checkpoint), e.g. the heads' vocabulary ids."""
        if name in self._by_name:
            return self._by_name[name]
        o = OutTensor(name, str(array.dtype), tuple(array.shape))
        self._by_name[name] = o
        if array.dtype == np.int64 and array.ndim == 1:
            self._rows[name] = len(array)
        self._accept_array(o, array, origin)
        return o

    def _accept(self, recipe: Recipe, outs: list[OutTensor]) -> None:
        pass

    def _accept_array(self, o: OutTensor, array: np.ndarray, origin: str) -> None:
        pass

    def nbytes(self) -> int:
        """Upper bound of the weights file's size (each tensor padded to :data:`ALIGN`)."""
        return sum(o.nbytes + ALIGN for o in self._by_name.values())


class WeightsWriter(WeightsPlan):
    """Writes each added tensor into ``path`` as it is added (see the module docstring).

    Args:
        path: the weights file (created; truncated if it exists).
        sources: the :class:`TensorSource` of each recipe ``source`` name.
        progress: a callback(bytes written, tensor name) for progress bars, or None.
    """

    def __init__(self, path: Path, sources: dict[str, TensorSource],
                 progress: Callable[[int, str], None] | None = None):
        super().__init__(sources)
        self.path = Path(path)
        self._fh = open(self.path, "wb")
        self._arrays: dict[str, np.ndarray] = {}
        self.records: dict[str, TensorRecord] = {}
        self._by_content: dict[tuple, TensorRecord] = {}
        self._progress = progress
        self.deduplicated = 0
        self.seconds = 0.0

    def _begin(self) -> tuple[int, "hashlib._Hash"]:
        pad = (-self._fh.tell()) % ALIGN
        start = self._fh.tell()
        self._fh.write(b"\0" * pad)
        return start, hashlib.sha256()

    def _end(self, start: int, o: OutTensor, h, recipe: dict) -> None:
        offset = start + ((-start) % ALIGN)
        length = self._fh.tell() - offset
        if length != o.nbytes:
            raise MedusaError(f"{o.name}: wrote {length} bytes, expected {o.nbytes} ({list(o.shape)} {o.dtype})")
        rec = TensorRecord(o.name, o.dtype, o.shape, offset, length, h.hexdigest(), recipe)
        key = (rec.sha256, rec.dtype, rec.shape)
        if key in self._by_content:  # same bytes as an earlier tensor: point there, cut the file back
            same = self._by_content[key]
            rec.offset = same.offset
            self._fh.seek(start)
            self._fh.truncate(start)
            self.deduplicated += 1
        else:
            self._by_content[key] = rec
        self.records[o.name] = rec

    def _accept(self, recipe: Recipe, outs: list[OutTensor]) -> None:
        t0 = time.perf_counter()
        current, (start, h) = 0, self._begin()
        for index, data in produce(recipe, self.sources, self._arrays):
            while index != current:
                self._end(start, outs[current], h, {**recipe.to_json(), "output": current})
                current, (start, h) = current + 1, self._begin()
            view = memoryview(data).cast("B")  # the array's bytes, not a copy
            self._fh.write(view)
            h.update(view)
            if self._progress:
                self._progress(view.nbytes, outs[current].name)
        self._end(start, outs[current], h, {**recipe.to_json(), "output": current})
        self.seconds += time.perf_counter() - t0

    def _accept_array(self, o: OutTensor, array: np.ndarray, origin: str) -> None:
        self._arrays[o.name] = array
        start, h = self._begin()
        data = np.ascontiguousarray(array).tobytes()
        self._fh.write(data)
        h.update(data)
        self._end(start, o, h, {"array": origin})

    def proto(self, name: str) -> TensorProto:
        """The external-data initializer of tensor ``name``."""
        return self.records[name].proto()

    def abort(self) -> None:
        """Close the file after a failure (the caller removes the folder)."""
        self._fh.close()

    def close(self) -> dict:
        """Finish the file; returns the manifest's ``weights`` fields (tensor records included)."""
        size = self._fh.tell()
        self._fh.close()
        offsets = {r.offset for r in self.records.values()}
        return {"tensors": len(offsets), "bytes": size, "deduplicated": self.deduplicated,
                "records": [r.to_json() for r in self.records.values()]}


def verify_weights(folder: Path, records: list[dict], sources: dict[str, TensorSource],
                   arrays: dict[str, np.ndarray] | None = None,
                   progress: Callable[[int, str], None] | None = None) -> dict:
    """Check every tensor of ``weights.bin`` against its recorded SHA-256, twice: the bytes read back from the
    file, and the bytes re-made from the sources by the same recipe (streamed, one tensor at a time).

    Args:
        folder: the artifact folder (``weights.bin`` in it).
        records: the manifest's ``weights.records``.
        sources: the checkpoint sources the recipes name.
        arrays: exporter-made tensors by name (e.g. the heads' vocabulary ids); those not given are only
            checked in the file (their bytes are re-read from it for recipes that take rows from them).
        progress: callback(bytes, tensor name).

    Returns:
        {"tensors": checked count, "bytes": bytes re-read, "from_source": recipes re-made, "seconds": s}.

    Raises:
        WeightsCheckError: the first tensor whose bytes differ (named, with both digests).
    """
    t0 = time.perf_counter()
    path = Path(folder) / WEIGHTS_FILE
    by_name = {r["name"]: r for r in records}
    arrays = dict(arrays or {})
    checked = nbytes = remade = 0
    with open(path, "rb") as fh:
        def file_digest(r: dict) -> str:
            h = hashlib.sha256()
            fh.seek(r["offset"])
            left = r["length"]
            while left:
                data = fh.read(min(left, 64 << 20))
                if not data:
                    raise WeightsCheckError(f"{path}: ends inside tensor {r['name']!r}")
                h.update(data)
                left -= len(data)
                if progress:
                    progress(len(data), r["name"])
            return h.hexdigest()

        for r in records:
            got = file_digest(r)
            checked += 1
            nbytes += r["length"]
            if got != r["sha256"]:
                raise WeightsCheckError(f"{path}: tensor {r['name']!r} at byte {r['offset']} has SHA-256 {got[:16]}..., "
                                        f"recorded {r['sha256'][:16]}... (the file changed after export)")
            if "array" in r["recipe"] and r["name"] not in arrays and r["dtype"] == "int64":
                fh.seek(r["offset"])
                arrays[r["name"]] = np.frombuffer(fh.read(r["length"]), np.int64).copy()
        groups: dict[str, list[dict]] = {}
        for r in records:
            if "array" not in r["recipe"]:
                rec = {k: v for k, v in r["recipe"].items() if k != "output"}
                groups.setdefault(repr(sorted(rec.items(), key=lambda kv: kv[0])), []).append(r)
    for rs in groups.values():
        rs.sort(key=lambda r: r["recipe"]["output"])
        recipe = Recipe.from_json({k: v for k, v in rs[0]["recipe"].items() if k != "output"})
        hashes = [hashlib.sha256() for _ in rs]
        for index, data in produce(recipe, sources, arrays):
            hashes[index].update(memoryview(data).cast("B"))
        for r, h in zip(rs, hashes):
            if h.hexdigest() != r["sha256"]:
                keys = ", ".join(recipe.keys)
                raise WeightsCheckError(f"tensor {r['name']!r} re-made from {recipe.source} tensor(s) {keys} has SHA-256 "
                                        f"{h.hexdigest()[:16]}..., but weights.bin holds {r['sha256'][:16]}... (the "
                                        "checkpoint changed, or the conversion is not deterministic)")
        remade += 1
    for name, arr in arrays.items():
        if name in by_name and hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest() != by_name[name]["sha256"]:
            raise WeightsCheckError(f"tensor {name!r} (made by the exporter) differs from weights.bin")
    return {"tensors": checked, "bytes": nbytes, "from_source": remade, "seconds": round(time.perf_counter() - t0, 2)}
