"""The declared inputs and outputs of an ONNX file, read from its protobuf without the ``onnx`` package.

Opening an artifact checks its manifest against the graphs themselves (:func:`medusa_runtime.contract.artifact.check_graph_files`);
that needs only each graph's input and output names, element types and shapes, which sit in a few small
fields of the file. This reader walks the protobuf wire format (https://protobuf.dev/programming-guides/encoding/)
and seeks over everything else (nodes, initializers, whose raw data may be large), so it reads kilobytes of
a multi-gigabyte file and keeps the runtime free of the ``onnx`` package (torch-free, and absent from Triton's
Python backend images).

Fields read (onnx/onnx.proto, IR version 3+): ``ModelProto.graph`` = 7; ``GraphProto.input`` = 11,
``GraphProto.output`` = 12; ``ValueInfoProto.name`` = 1, ``.type`` = 2; ``TypeProto.tensor_type`` = 1;
``TypeProto.Tensor.elem_type`` = 1, ``.shape`` = 2; ``TensorShapeProto.dim`` = 1;
``Dimension.dim_value`` = 1, ``.dim_param`` = 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO, Iterator, NamedTuple

from ..errors import ArtifactError

#: ``TensorProto.DataType`` numbers -> the names the manifest uses (onnx/onnx.proto).
ELEM_TYPES = {1: "float32", 2: "uint8", 3: "int8", 4: "uint16", 5: "int16", 6: "int32", 7: "int64", 9: "bool",
              10: "float16", 11: "float64", 12: "uint32", 13: "uint64", 16: "bfloat16"}

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


class DeclaredTensor(NamedTuple):
    """One graph input or output as the ONNX file declares it."""

    name: str
    dtype: str | None  # ELEM_TYPES name (None: not a tensor, or an element type not in ELEM_TYPES)
    shape: list[int | str] | None  # ints for fixed dims, names for symbolic ones ("?" unnamed); None: no shape


class DeclaredIO(NamedTuple):
    """A graph's declared inputs and outputs, in the file's order."""

    inputs: list[DeclaredTensor]
    outputs: list[DeclaredTensor]


def _varint(read) -> int:
    shift = value = 0
    while True:
        b = read(1)
        if not b:
            raise EOFError("truncated varint")
        value |= (b[0] & 0x7F) << shift
        if b[0] < 0x80:
            return value
        shift += 7


def _fields(buf: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """(field number, wire type, value) of an in-memory message (length-delimited values as bytes)."""
    pos = 0

    def read(n: int) -> bytes:
        nonlocal pos
        out = buf[pos:pos + n]
        pos += n
        return out

    while pos < len(buf):
        tag = _varint(read)
        field, wire = tag >> 3, tag & 7
        if wire == _VARINT:
            yield field, wire, _varint(read)
        elif wire == _LEN:
            n = _varint(read)
            yield field, wire, read(n)
        elif wire in (_I64, _I32):
            yield field, wire, read(8 if wire == _I64 else 4)
        else:
            raise ValueError(f"unsupported wire type {wire}")


def _tensor(buf: bytes) -> DeclaredTensor:
    name, dtype, shape = "", None, None
    for field, wire, value in _fields(buf):
        if field == 1 and wire == _LEN:
            name = value.decode("utf-8")
        elif field == 2 and wire == _LEN:
            for f2, w2, tensor_type in _fields(value):
                if f2 != 1 or w2 != _LEN:
                    continue
                for f3, w3, v3 in _fields(tensor_type):
                    if f3 == 1 and w3 == _VARINT:
                        dtype = ELEM_TYPES.get(v3)
                    elif f3 == 2 and w3 == _LEN:
                        shape = []
                        for f4, w4, dim in _fields(v3):
                            if f4 == 1 and w4 == _LEN:
                                d: int | str = "?"
                                for f5, w5, v5 in _fields(dim):
                                    if f5 == 1 and w5 == _VARINT:
                                        d = v5 - (1 << 64) if v5 >= 1 << 63 else v5
                                    elif f5 == 2 and w5 == _LEN:
                                        d = v5.decode("utf-8")
                                shape.append(d)
    return DeclaredTensor(name, dtype, shape)


def _skip(fh: BinaryIO, wire: int) -> None:
    if wire == _VARINT:
        _varint(fh.read)
    elif wire == _LEN:
        fh.seek(_varint(fh.read), 1)
    elif wire in (_I64, _I32):
        fh.seek(8 if wire == _I64 else 4, 1)
    else:
        raise ValueError(f"unsupported wire type {wire}")


def declared_io(path: str | Path) -> DeclaredIO:
    """The inputs and outputs an ONNX file declares (its graph's ``input`` and ``output`` value infos).

    Reads only those fields: the rest of the file (nodes, initializers) is skipped by seeking.

    Raises:
        ArtifactError: the file is missing, truncated or not an ONNX model (the message names it).
    """
    path = Path(path)
    inputs: list[DeclaredTensor] = []
    outputs: list[DeclaredTensor] = []
    try:
        with open(path, "rb") as fh:
            size = path.stat().st_size
            found = False
            while fh.tell() < size:
                tag = _varint(fh.read)
                if tag >> 3 == 7 and tag & 7 == _LEN:
                    end = _varint(fh.read) + fh.tell()
                    found = True
                    while fh.tell() < end:
                        t = _varint(fh.read)
                        if t >> 3 in (11, 12) and t & 7 == _LEN:
                            (inputs if t >> 3 == 11 else outputs).append(_tensor(fh.read(_varint(fh.read))))
                        else:
                            _skip(fh, t & 7)
                else:
                    _skip(fh, tag & 7)
    except FileNotFoundError:
        raise ArtifactError(f"graph file {path} is missing") from None
    except (EOFError, ValueError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{path} is not a readable ONNX model ({exc})") from None
    if not found:
        raise ArtifactError(f"{path} is not an ONNX model: it has no graph")
    return DeclaredIO(inputs, outputs)
