"""What a GGUF file declares that transformers' GGUF loader drops: RoPE scaling, the sliding window.

transformers 4.57 (``integrations/ggml.py`` ``GGUF_CONFIG_MAPPING``) maps no ``*.rope.scaling.*``
key and skips the ``rope_freqs.weight`` tensor that llama.cpp writes for Llama 3.1+ (its
"llama3" RoPE factors), so such a file would load as plain RoPE; it maps no sliding window for
llama/mistral either. This module reads the file's header only (key names, a few string values,
tensor names; GGUF format: github.com/ggml-org/ggml ``docs/gguf.md``) in well under a second, where
the ``gguf`` package's reader parses every token array (~4 s for SmolLM2's 49k-token vocabulary).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from ..errors import WeightsNotFoundError

# GGUF value types (docs/gguf.md ``gguf_metadata_value_type``) -> struct format of a scalar.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass
class GGUFHeader:
    """The parts of a GGUF header the loader checks.

    Attributes:
        keys: every metadata key.
        strings: the string-valued metadata (e.g. ``general.architecture``, ``general.name``).
        tensors: every tensor name.
    """

    keys: list[str] = field(default_factory=list)
    strings: dict[str, str] = field(default_factory=dict)
    tensors: list[str] = field(default_factory=list)


def _read(f: BinaryIO, fmt: str):
    return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]


def _string(f: BinaryIO) -> str:
    return f.read(_read(f, "<Q")).decode("utf-8", errors="replace")


def _skip(f: BinaryIO, vtype: int) -> None:
    if vtype == _STRING:
        f.seek(_read(f, "<Q"), 1)
    elif vtype == _ARRAY:
        etype, n = _read(f, "<I"), _read(f, "<Q")
        if etype in _SCALARS:
            f.seek(n * struct.calcsize(_SCALARS[etype]), 1)
        else:
            for _ in range(n):
                _skip(f, etype)
    else:
        f.seek(struct.calcsize(_SCALARS[vtype]), 1)


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """Key names, string values and tensor names of a GGUF file (versions 2 and 3).

    Raises:
        WeightsNotFoundError: not a GGUF file, or a truncated / unknown header.
    """
    out = GGUFHeader()
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise WeightsNotFoundError(f"{path} is not a GGUF file")
            _read(f, "<I")  # version
            n_tensors, n_kv = _read(f, "<Q"), _read(f, "<Q")
            for _ in range(n_kv):
                key, vtype = _string(f), _read(f, "<I")
                out.keys.append(key)
                if vtype == _STRING:
                    out.strings[key] = _string(f)
                else:
                    _skip(f, vtype)
            for _ in range(n_tensors):
                out.tensors.append(_string(f))
                f.seek(struct.calcsize("<Q") * _read(f, "<I") + struct.calcsize("<IQ"), 1)  # dims, type, offset
    except (struct.error, KeyError, OSError) as exc:
        raise WeightsNotFoundError(f"cannot read the GGUF header of {path}: {exc!r}") from None
    return out
