"""A GGUF file's header without building its metadata arrays: scalar metadata, tensor names, shapes, types and
where their data lie.

``gguf.GGUFReader`` builds a numpy view per element of every metadata array, about a minute on two cores for a
262k-token vocabulary's three arrays (tokens, scores, types); what the SDK and the harness read (a tensor's place,
the file type, the tensors' types and sizes) is in the header's fixed-size fields. This reader steps over each
array by its length and reads only scalars and strings (GGUF v2/v3: magic, version, counts, metadata, tensor infos;
the tensor data start at the first multiple of ``general.alignment``, default 32, after the tensor infos).
``tests/edge_sdk/test_gguf_header.py`` holds it to ``gguf.GGUFReader`` on every metadata type.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from os import PathLike
from typing import Any

import numpy as np

#: struct codes of GGUF's fixed-size metadata value types (gguf.GGUFValueType: 0-7 and 10-12)
_SCALAR_CODES = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor's entry: ``dims`` as the file lists them (fastest-varying first), ``kind`` its
    ``gguf.GGMLQuantizationType``, ``offset`` where its data begin in the file."""

    name: str
    dims: tuple[int, ...]
    kind: Any
    offset: int

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.dims, dtype=np.int64))

    @property
    def n_bytes(self) -> int:
        """Its data's size: ``n_elements / block_size * type_size`` (``gguf.GGML_QUANT_SIZES``)."""
        import gguf

        block_size, type_size = gguf.GGML_QUANT_SIZES[self.kind]
        return self.n_elements // block_size * type_size


@dataclass(frozen=True)
class GGUFHeader:
    """``metadata``: every scalar and string value by key (arrays left out); ``tensors`` in file order."""

    metadata: dict[str, int | float | bool | str]
    tensors: tuple[GGUFTensor, ...]

    def tensor(self, name: str) -> GGUFTensor | None:
        return next((tensor for tensor in self.tensors if tensor.name == name), None)


def read_gguf_header(source: str | PathLike[str] | np.ndarray) -> GGUFHeader:
    """The header of a GGUF file (a path, or its bytes such as a ``numpy.memmap``); ``ValueError`` for a file that
    is not GGUF v2 or v3."""
    import gguf  # imported here: `import edge_sdk` stays numpy-only

    data = np.memmap(source, mode="r") if not isinstance(source, np.ndarray) else source
    header = memoryview(data).cast("B")
    if len(header) < 24 or bytes(header[:4]) != b"GGUF":
        raise ValueError("not a GGUF file (no GGUF magic)")
    order = "<" if struct.unpack_from("<I", header, 4)[0] & 0xFFFF else ">"  # as gguf.GGUFReader tells it
    version, n_tensors, n_metadata = struct.unpack_from(order + "IQQ", header, 4)
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (2 or 3)")

    def string_at(at: int) -> tuple[str, int]:
        (length,) = struct.unpack_from(order + "Q", header, at)
        return bytes(header[at + 8 : at + 8 + length]).decode("utf-8", errors="replace"), at + 8 + length

    def value_end(kind: int, at: int, count: int = 1) -> int:
        if kind in _SCALAR_CODES:
            return at + count * struct.calcsize(_SCALAR_CODES[kind])
        for _ in range(count):
            if kind == _STRING:
                at += 8 + struct.unpack_from(order + "Q", header, at)[0]
            elif kind == _ARRAY:
                item_kind, length = struct.unpack_from(order + "IQ", header, at)
                at = value_end(item_kind, at + 12, length)
            else:
                raise ValueError(f"GGUF metadata value type {kind} is unknown")
        return at

    metadata: dict[str, int | float | bool | str] = {}
    at = 24
    for _ in range(n_metadata):
        key, key_end = string_at(at)
        (kind,) = struct.unpack_from(order + "I", header, key_end)
        if kind in _SCALAR_CODES:
            (metadata[key],) = struct.unpack_from(order + _SCALAR_CODES[kind], header, key_end + 4)
        elif kind == _STRING:
            metadata[key] = string_at(key_end + 4)[0]
        at = value_end(kind, key_end + 4)
    entries = []
    for _ in range(n_tensors):
        name, name_end = string_at(at)
        (n_dims,) = struct.unpack_from(order + "I", header, name_end)
        dims = struct.unpack_from(order + f"{n_dims}Q", header, name_end + 4)
        kind, offset = struct.unpack_from(order + "IQ", header, name_end + 4 + 8 * n_dims)
        entries.append((name, tuple(int(d) for d in dims), gguf.GGMLQuantizationType(kind), offset))
        at = name_end + 4 + 8 * n_dims + 12
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    data_start = -(-at // alignment) * alignment
    return GGUFHeader(metadata, tuple(GGUFTensor(name, dims, kind, data_start + offset)
                                      for name, dims, kind, offset in entries))
