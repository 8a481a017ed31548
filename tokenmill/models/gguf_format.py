"""The GGUF container: metadata and tensor directory, read from a memory map.

gguf.GGUFReader builds numpy views for every element of every metadata array (~250,000 for a
49k-token vocabulary: ~3 s, most of a start-up). We need a few scalars and the tensors, so this
reader walks the header once with struct and keeps string arrays as their count and position,
decoded only if asked for. Type codes and block sizes come from the gguf package.

Layout (little-endian; github.com/ggml-org/ggml/blob/master/docs/gguf.md):
    "GGUF", u32 version (2 or 3), u64 tensor count, u64 metadata count,
    metadata: string key, u32 value type, value       (string = u64 length + UTF-8 bytes;
                                                        array = u32 item type, u64 count, items)
    tensors: string name, u32 n_dims, u64 dims[n_dims] (innermost first), u32 ggml type, u64 offset
    padding to general.alignment (32), then the tensor data (offsets are relative to its start)
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

MAGIC = b"GGUF"
_SCALARS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_NUMPY = {
    GGUFValueType.UINT8: np.uint8, GGUFValueType.INT8: np.int8, GGUFValueType.UINT16: np.uint16,
    GGUFValueType.INT16: np.int16, GGUFValueType.UINT32: np.uint32, GGUFValueType.INT32: np.int32,
    GGUFValueType.FLOAT32: np.float32, GGUFValueType.BOOL: np.bool_, GGUFValueType.UINT64: np.uint64,
    GGUFValueType.INT64: np.int64, GGUFValueType.FLOAT64: np.float64,
}
# element types the data of a tensor is viewed as; every other type is raw bytes per row
_TENSOR_DTYPES = {
    GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32, GGMLQuantizationType.I64: np.int64,
}


class GGUFFormatError(ValueError):
    """The file is not a GGUF this reader understands (truncated, wrong magic, unknown type)."""


@dataclass(frozen=True)
class StringArray:
    """A metadata array of strings, kept as where it lies; `decode()` reads it."""

    data: np.ndarray  # the whole file
    start: int  # offset of the first string's length
    count: int

    def __len__(self) -> int:
        return self.count

    def decode(self) -> list[str]:
        buffer, offset, out = self.data, self.start, []
        for _ in range(self.count):
            (length,) = struct.unpack_from("<Q", buffer, offset)
            out.append(bytes(buffer[offset + 8 : offset + 8 + length]).decode("utf-8", errors="replace"))
            offset += 8 + length
        return out


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # ggml order: innermost (the row) first, as GGUFReader's `shape`
    data: np.ndarray  # typed elements [outer..., inner] for float/int types, else bytes [outer..., row bytes]


class GGUFContents:
    """A GGUF file's metadata (scalars as Python values, numeric arrays as lists, string arrays as
    StringArray) and tensors, over one read-only memory map."""

    def __init__(self, path: Path | str) -> None:
        self.metadata: dict[str, object] = {}
        self.tensors: list[GGUFTensor] = []
        try:
            self.data = np.memmap(path, mode="r")  # ValueError for an empty file
            self._parse()
        except (struct.error, IndexError, KeyError, ValueError, UnicodeDecodeError) as exc:
            if isinstance(exc, GGUFFormatError):
                raise
            raise GGUFFormatError(f"malformed header ({type(exc).__name__}: {exc})") from None

    # ---- parsing ------------------------------------------------------------------------------
    def _parse(self) -> None:
        if bytes(self.data[:4]) != MAGIC:
            raise GGUFFormatError("not a GGUF file (bad magic)")
        version, tensor_count, kv_count = struct.unpack_from("<IQQ", self.data, 4)
        if version not in (2, 3):
            raise GGUFFormatError(f"unsupported GGUF version {version}")
        self._offset = 24
        for _ in range(kv_count):
            key = self._string()
            if key in self.metadata:
                raise GGUFFormatError(f"duplicate metadata key {key!r}")
            self.metadata[key] = self._value(GGUFValueType(self._unpack("<I")))
        infos = []
        for _ in range(tensor_count):
            name = self._string()
            n_dims = self._unpack("<I")
            shape = tuple(self._unpack("<Q") for _ in range(n_dims))
            infos.append((name, GGMLQuantizationType(self._unpack("<I")), shape, self._unpack("<Q")))
        alignment = int(self.metadata.get("general.alignment", 32))
        if alignment <= 0 or alignment & (alignment - 1):
            raise GGUFFormatError(f"invalid alignment {alignment}")
        data_start = -(-self._offset // alignment) * alignment
        self.tensors = [self._tensor(data_start, *info) for info in infos]

    def _unpack(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self.data, self._offset)
        self._offset += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        length = self._unpack("<Q")
        end = self._offset + length
        if end > len(self.data):
            raise GGUFFormatError("a string runs past the end of the file")
        text = bytes(self.data[self._offset : end]).decode("utf-8")
        self._offset = end
        return text

    def _value(self, kind: GGUFValueType):
        if kind == GGUFValueType.STRING:
            return self._string()
        if kind in _SCALARS:
            return self._unpack(_SCALARS[kind])
        if kind != GGUFValueType.ARRAY:
            raise GGUFFormatError(f"unknown metadata type {kind}")
        item = GGUFValueType(self._unpack("<I"))
        count = self._unpack("<Q")
        if item == GGUFValueType.STRING:
            strings = StringArray(self.data, self._offset, count)
            for _ in range(count):  # skip them: only their lengths are read
                length = self._unpack("<Q")
                self._offset += length
            if self._offset > len(self.data):
                raise GGUFFormatError("a string array runs past the end of the file")
            return strings
        if item in _NUMPY:
            dtype = np.dtype(_NUMPY[item]).newbyteorder("<")
            end = self._offset + count * dtype.itemsize
            if end > len(self.data):
                raise GGUFFormatError("an array runs past the end of the file")
            values = np.frombuffer(self.data, dtype=dtype, count=count, offset=self._offset).tolist()
            self._offset = end
            return values
        return [self._value(item) for _ in range(count)]  # arrays of arrays

    def _tensor(self, data_start: int, name: str, kind: GGMLQuantizationType, shape: tuple[int, ...],
                offset: int) -> GGUFTensor:
        block, block_bytes = GGML_QUANT_SIZES[kind]
        row = shape[0] if shape else 1
        if row % block:
            raise GGUFFormatError(f"tensor {name}: row of {row} is not a whole number of {kind.name} blocks")
        outer = tuple(reversed(shape[1:]))
        rows = int(np.prod(outer)) if outer else 1
        nbytes = rows * row // block * block_bytes
        start = data_start + offset
        if start + nbytes > len(self.data):
            raise GGUFFormatError(f"tensor {name} runs past the end of the file")
        if kind in _TENSOR_DTYPES:
            array = np.frombuffer(self.data, dtype=_TENSOR_DTYPES[kind], count=rows * row, offset=start)
            data = array.reshape(*outer, row)
        else:
            data = np.frombuffer(self.data, dtype=np.uint8, count=nbytes, offset=start).reshape(*outer, -1)
        return GGUFTensor(name, kind, shape, data)
