"""GGUF's header read straight from the memory-mapped file (ggml's docs/gguf.md).

The layout: the magic `GGUF`, a version (2 or 3), the tensor count and the key-value count,
the key-values (a string key, a value type, a value: a number, a string, or an array of
values of one type, arrays of arrays included), one info record a tensor (name, dimensions,
ggml type, offset), then the tensor data from the next multiple of `general.alignment`.

Numbers are read with `struct`, numeric arrays with `numpy.frombuffer`, string arrays in one
tight loop; arrays whose values are not wanted (`skip`: a tokenizer's 262,144 tokens) are only
stepped over. Tensor data is never read here: each tensor is a view of the mapped file. A
file that ends early or holds impossible values is a `GGUFFormatError` saying where, never a
struct or numpy exception. The `gguf` package's `GGUFReader` is the reference this is tested
against (gguf/reference.py, tests/test_gguf_reader.py); unlike it, arrays of arrays are kept
nested, not flattened.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
MAX_NESTING = 8  # arrays of arrays: ggml itself reads none; a bound keeps damaged files from recursing

# ggml type id -> (name, elements per block, bytes per block): ggml.h's ggml_type
GGML_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
}  # fmt: skip
# types whose data is typed by its element (as the gguf package does); the rest are uint8 rows of blocks
_ELEMENT_DTYPES = {"F32": "f4", "F16": "f2", "F64": "f8", "I8": "i1", "I16": "i2", "I32": "i4", "I64": "i8"}

_BLOCKS = {name: (per_block, block_bytes) for name, per_block, block_bytes in GGML_TYPES.values()}

# GGUF value type id -> (struct's format, numpy's type) of one value; 8 is a string, 9 an array
_SCALARS = {0: ("B", "u1"), 1: ("b", "i1"), 2: ("H", "u2"), 3: ("h", "i2"), 4: ("I", "u4"), 5: ("i", "i4"),
            6: ("f", "f4"), 7: ("?", "?"), 10: ("Q", "u8"), 11: ("q", "i8"), 12: ("d", "f8")}  # fmt: skip
_STRING, _ARRAY, _UINT32 = 8, 9, 4


class GGUFFormatError(ValueError):
    """The bytes are not a GGUF layout this reader understands; the message says where."""


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    type_name: str  # ggml's name: F32, Q4_K, ...
    dims: tuple[int, ...]  # GGUF's order: the first is the row length (ggml's ne[0])
    offset: int  # of its data from the file's start (already past the header, aligned)
    n_bytes: int

    @property
    def n_elements(self) -> int:
        return math.prod(self.dims)


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    version: int
    byte_order: str  # "<" little-endian, ">" big-endian (as numpy and struct write it)
    metadata: dict[str, Any]  # file order, led by GGUF.version/tensor_count/kv_count as the gguf package has them
    array_lengths: dict[str, int]  # the element count of each key holding an array, skipped ones included
    tensors: list[TensorInfo]
    alignment: int
    data_offset: int  # where the tensor data begins


def map_file(path: str | os.PathLike) -> mmap.mmap:
    """The whole file mapped read-only (an empty file cannot be mapped: it is no GGUF)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            raise GGUFFormatError("the file is empty")
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


def read_header(buf: bytes | mmap.mmap, skip: frozenset[str] = frozenset()) -> GGUFHeader:
    """Parse the header of the GGUF bytes `buf`; the arrays of keys in `skip` are counted, not kept."""
    return _Parser(buf).header(skip)


def tensor_data(buf: bytes | mmap.mmap, header: GGUFHeader, info: TensorInfo) -> np.ndarray:
    """A tensor's data, a view of `buf`, typed as the gguf package types it: F32, F16, F64 and
    integer tensors by element in row-major shape; others (BF16, quantized) as uint8 rows of blocks."""
    shape = tuple(reversed(info.dims))
    element = _ELEMENT_DTYPES.get(info.type_name)
    if element is not None:
        dtype = np.dtype(header.byte_order + element)
        return np.frombuffer(buf, dtype, info.n_elements, info.offset).reshape(shape)
    per_block, block_bytes = _BLOCKS[info.type_name]
    row_bytes = info.dims[0] // per_block * block_bytes
    return np.frombuffer(buf, np.uint8, info.n_bytes, info.offset).reshape(*shape[:-1], row_bytes)


class _Parser:
    """A cursor over the header; `where` names what is being read, for the error messages."""

    def __init__(self, buf: bytes | mmap.mmap) -> None:
        self.buf, self.pos, self.end = buf, 0, len(buf)
        self.order, self.where = "<", "the magic bytes"

    def header(self, skip: frozenset[str]) -> GGUFHeader:
        try:
            return self._header(skip)
        except (struct.error, OverflowError):  # a read past the end (an offset past 2**63 overflows)
            raise GGUFFormatError(f"the file ends inside {self.where} ({self.end} bytes)") from None
        except UnicodeDecodeError as exc:
            raise GGUFFormatError(f"{self.where} holds text that is not UTF-8 ({exc.reason})") from None

    def _header(self, skip: frozenset[str]) -> GGUFHeader:
        if self.buf[:4] != MAGIC:
            raise GGUFFormatError(f"the file starts with {bytes(self.buf[:4])!r}, not {MAGIC!r}")
        self.pos, self.where = 4, "the version"
        (version,) = struct.unpack_from("<I", self.buf, 4)
        if version & 0xFFFF == 0:  # a file written in the other byte order (as the gguf package tells)
            self.order, version = ">", struct.unpack_from(">I", self.buf, 4)[0]
        if version not in VERSIONS:
            raise GGUFFormatError(f"GGUF version {version} is not one llmserve reads (2 or 3)")
        self.pos, self.where = 8, "the tensor and key-value counts"
        tensor_count, kv_count = self._unpack("QQ")
        metadata: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": tensor_count,
                                    "GGUF.kv_count": kv_count}  # fmt: skip
        lengths: dict[str, int] = {}
        alignment = DEFAULT_ALIGNMENT
        for i in range(kv_count):
            self.where = f"key-value {i}"
            key = self._string()
            self.where = f"key {key!r}"
            if key in metadata or key in lengths:
                raise GGUFFormatError(f"key {key!r} appears twice")
            (vtype,) = self._unpack("I")
            if vtype == _ARRAY:
                lengths[key], value = self._array(0, keep=key not in skip)
                if key not in skip:
                    metadata[key] = value
            else:
                metadata[key] = self._value(vtype)
            if key == "general.alignment":
                alignment = _alignment(vtype, metadata[key])
        infos = [self._tensor_info(i) for i in range(tensor_count)]
        self.where = "the tensor data"
        data_offset = -(-self.pos // alignment) * alignment
        tensors = self._tensors(infos, data_offset)
        return GGUFHeader(version, self.order, metadata, lengths, tensors, alignment, data_offset)

    def _unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(self.order + fmt, self.buf, self.pos)
        self.pos += struct.calcsize(self.order + fmt)
        return values

    def _string(self) -> str:
        (size,) = self._unpack("Q")
        start, self.pos = self.pos, self.pos + size
        if self.pos > self.end:
            raise struct.error("past the end")
        return self.buf[start : self.pos].decode()

    def _value(self, vtype: int) -> Any:
        """A string or a number (arrays: `_array`)."""
        if vtype == _STRING:
            return self._string()
        if vtype not in _SCALARS:
            raise GGUFFormatError(f"{self.where} has value type {vtype}, which GGUF does not define")
        return self._unpack(_SCALARS[vtype][0])[0]

    def _array(self, depth: int, keep: bool) -> tuple[int, list | None]:
        """(element count, the values as a list, or None when not `keep`)."""
        if depth >= MAX_NESTING:
            raise GGUFFormatError(f"{self.where} nests arrays deeper than {MAX_NESTING}")
        itype, count = self._unpack("IQ")
        if itype == _STRING:
            return count, self._strings(count, keep)
        if itype == _ARRAY:
            values = [self._array(depth + 1, keep)[1] for _ in range(count)]
            return count, values if keep else None
        if itype not in _SCALARS:
            raise GGUFFormatError(f"{self.where} is an array of value type {itype}, which GGUF does not define")
        dtype = np.dtype(self.order + _SCALARS[itype][1])
        start, self.pos = self.pos, self.pos + count * dtype.itemsize
        if self.pos > self.end:
            raise struct.error("past the end")
        return count, np.frombuffer(self.buf, dtype, count, start).tolist() if keep else None

    def _strings(self, count: int, keep: bool) -> list[str] | None:
        """`count` strings from the cursor: the hot loop of a tokenizer's vocabulary."""
        buf, pos, unpack = self.buf, self.pos, struct.Struct(self.order + "Q").unpack_from
        if not keep:
            for _ in range(count):
                pos += 8 + unpack(buf, pos)[0]
            if pos > self.end:
                raise struct.error("past the end")
            self.pos = pos
            return None
        values, end = [], self.end
        append = values.append
        for _ in range(count):
            start = pos + 8
            pos = start + unpack(buf, pos)[0]
            if pos > end:
                raise struct.error("past the end")
            append(buf[start:pos].decode())
        self.pos = pos
        return values

    def _tensor_info(self, i: int) -> tuple[str, tuple[int, ...], int, int]:
        self.where = f"tensor info {i}"
        name = self._string()
        self.where = f"the info of tensor {name!r}"
        (n_dims,) = self._unpack("I")
        if n_dims > MAX_DIMS:
            raise GGUFFormatError(f"tensor {name!r} has {n_dims} dimensions; GGUF allows at most {MAX_DIMS}")
        dims = self._unpack(f"{n_dims}Q")
        type_id, offset = self._unpack("IQ")
        return name, dims, type_id, offset

    def _tensors(self, infos: list[tuple[str, tuple[int, ...], int, int]], data_offset: int) -> list[TensorInfo]:
        """Each tensor's type known, its element count an int64, its rows whole blocks, its data inside the file."""
        tensors, names = [], set()
        for name, dims, type_id, offset in infos:
            if name in names:
                raise GGUFFormatError(f"tensor {name!r} appears twice")
            names.add(name)
            if type_id not in GGML_TYPES:
                raise GGUFFormatError(f"tensor {name!r} has ggml type {type_id}, which is not one GGUF defines")
            if math.prod(d for d in dims if d) >= 1 << 63:  # ggml's elements are counted in int64
                raise GGUFFormatError(f"tensor {name!r} has dimensions {list(dims)}: too many elements")
            type_name, per_block, block_bytes = GGML_TYPES[type_id]
            if type_name not in _ELEMENT_DTYPES and (not dims or dims[0] % per_block):
                raise GGUFFormatError(f"tensor {name!r} of type {type_name} has rows of {dims[0] if dims else 1} "
                                      f"values, not whole blocks of {per_block}")  # fmt: skip
            start, n_bytes = data_offset + offset, math.prod(dims) * block_bytes // per_block
            if start + n_bytes > self.end:
                raise GGUFFormatError(f"tensor {name!r} ({type_name}, {list(dims)}) needs bytes {start} to "
                                      f"{start + n_bytes}, past the end of the file ({self.end} bytes)")  # fmt: skip
            tensors.append(TensorInfo(name, type_name, dims, start, n_bytes))
        return tensors


def _alignment(vtype: int, value: Any) -> int:
    """`general.alignment`: a uint32, a power of two (the gguf package's rule)."""
    if vtype != _UINT32:
        raise GGUFFormatError(f"general.alignment has value type {vtype}, not uint32 ({_UINT32})")
    if value == 0 or value & (value - 1):
        raise GGUFFormatError(f"general.alignment is {value}, not a power of two")
    return value
