"""A GGUF file's tensor index, read in a fraction of a second: where each tensor's bytes are,
their type and shape, and the architecture, with the metadata skipped rather than decoded.

The `gguf` package's GGUFReader decodes every metadata value into Python objects: a model
with a 150k-token vocabulary takes ~6 s to open on these machines, which a load that only
needs the tensors' offsets should not pay. GGUFReader still reads a file in full once,
before its first conversion (loading.check_gguf). Every count and length is checked against
the bytes left before it is used, so a damaged or crafted file is a ModelError naming it,
never a large allocation.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from promptlang.errors import ModelError

# GGUF metadata value types -> the size of a fixed-size value
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_LENGTH = struct.Struct("<Q")
MAX_DIMS = 4
DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class TensorEntry:
    name: str
    type: int                  # ggml's type number (gguf.GGMLQuantizationType)
    shape: tuple[int, ...]     # GGUF order: the fastest-varying dimension first
    offset: int                # from the file's start


@dataclass
class GgufIndex:
    path: Path
    arch: str
    tensors: dict[str, TensorEntry]

    def rows(self, name: str) -> np.ndarray:
        """Tensor `name`'s bytes as [rows, row bytes] uint8, mapped from the file (read-only:
        the pages are the file's, shared with every process that maps it)."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        entry = self.tensors[name]
        per_block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(entry.type)]
        columns = entry.shape[0]
        rows = math.prod(entry.shape[1:])
        row_bytes = columns // per_block * nbytes
        return np.memmap(self.path, dtype=np.uint8, mode="r", offset=entry.offset,
                         shape=(rows, row_bytes))


class _Cursor:
    def __init__(self, path: Path, data: mmap.mmap):
        self.path = path
        self.data = data
        self.at = 0

    def take(self, size: int) -> int:
        if size < 0 or self.at + size > len(self.data):
            raise ModelError(f"{self.path}: a damaged GGUF file (a value runs past the end "
                             f"of the file at byte {self.at:,})")
        at = self.at
        self.at += size
        return at

    def unpack(self, fmt: str):
        return struct.unpack_from(fmt, self.data, self.take(struct.calcsize(fmt)))

    def string(self) -> bytes:
        (size,) = self.unpack("<Q")
        at = self.take(size)
        return bytes(self.data[at:at + size])

    def skip_string(self) -> None:
        (size,) = self.unpack("<Q")
        self.take(size)

    def skip_strings(self, count: int) -> None:
        """`count` strings one after another (a vocabulary: 150k of them), each length read
        and checked in one loop, without a call per string."""
        data = self.data
        end = len(data)
        length = _LENGTH.unpack_from
        at = self.at
        for _ in range(count):
            if at + 8 > end:
                break
            at += 8 + length(data, at)[0]
            if at > end:
                break
        else:
            self.at = at
            return
        self.at = at
        raise ModelError(f"{self.path}: a damaged GGUF file (a value runs past the end of "
                         f"the file at byte {min(at, end):,})")

    def skip_value(self, kind: int, depth: int = 0) -> None:
        if kind in _FIXED:
            self.take(_FIXED[kind])
        elif kind == _STRING:
            self.skip_string()
        elif kind == _ARRAY and depth < 2:
            inner, count = self.unpack("<IQ")
            if inner in _FIXED:
                self.take(_FIXED[inner] * count)
            elif inner == _STRING:
                if count * 8 > len(self.data) - self.at:
                    raise ModelError(f"{self.path}: a damaged GGUF file (an array of "
                                     f"{count:,} strings in {len(self.data) - self.at:,} bytes)")
                self.skip_strings(count)
            else:
                for _ in range(min(count, len(self.data) - self.at)):
                    self.skip_value(inner, depth + 1)
        else:
            raise ModelError(f"{self.path}: a damaged GGUF file (metadata value type {kind})")


def read_index(path: Path) -> GgufIndex:
    """The tensor index of the GGUF at `path` (see the module doc)."""
    with open(path, "rb") as handle:
        try:
            data = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        except (ValueError, OSError) as err:
            raise ModelError(f"{path}: cannot map the GGUF file ({err})") from None
    try:
        return _parse(path, data)
    finally:
        data.close()


def _parse(path: Path, data: mmap.mmap) -> GgufIndex:
    cursor = _Cursor(path, data)
    magic, version, tensors, kvs = cursor.unpack("<4sIQQ")
    if magic != b"GGUF" or version not in (2, 3):
        raise ModelError(f"{path}: not a GGUF file of version 2 or 3")
    if kvs * 13 > len(data) or tensors * 24 > len(data):
        raise ModelError(f"{path}: a GGUF header that claims {tensors:,} tensors and {kvs:,} "
                         f"metadata entries in {len(data):,} bytes (truncated or corrupt)")
    arch = ""
    alignment = DEFAULT_ALIGNMENT
    for _ in range(kvs):
        key = cursor.string()
        (kind,) = cursor.unpack("<I")
        if key == b"general.architecture" and kind == _STRING:
            arch = cursor.string().decode("utf-8", errors="replace")
        elif key == b"general.alignment" and kind == 4:
            (alignment,) = cursor.unpack("<I")
        else:
            cursor.skip_value(kind)
    infos = []
    for _ in range(tensors):
        name = cursor.string().decode("utf-8", errors="replace")
        (dims,) = cursor.unpack("<I")
        if not 1 <= dims <= MAX_DIMS:
            raise ModelError(f"{path}: a damaged GGUF file (tensor {name!r} has {dims} "
                             f"dimensions)")
        shape = cursor.unpack(f"<{dims}Q")
        kind, offset = cursor.unpack("<IQ")
        infos.append((name, kind, tuple(int(d) for d in shape), offset))
    if alignment <= 0 or alignment & (alignment - 1):
        raise ModelError(f"{path}: a damaged GGUF file (alignment {alignment})")
    start = (cursor.at + alignment - 1) // alignment * alignment
    index = {}
    for name, kind, shape, offset in infos:
        entry = TensorEntry(name, kind, shape, start + offset)
        if entry.offset + _nbytes(path, entry) > len(data):
            raise ModelError(f"{path}: a damaged GGUF file (tensor {name!r} runs past the end "
                             f"of the file)")
        index[name] = entry
    return GgufIndex(path, arch, index)


def _nbytes(path: Path, entry: TensorEntry) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        per_block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(entry.type)]
    except (ValueError, KeyError):
        raise ModelError(f"{path}: tensor {entry.name!r} has ggml type {entry.type}, which "
                         f"the gguf package does not know") from None
    count = math.prod(entry.shape)
    if entry.shape[0] % per_block:
        raise ModelError(f"{path}: tensor {entry.name!r}: rows of {entry.shape[0]} values "
                         f"are not whole blocks of {per_block}")
    return count // per_block * nbytes
