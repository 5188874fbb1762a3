"""One KV file of the disk tier: its format, how it is written, read and verified.

A valid safetensors file, but written and read by this hand-written code on purpose, not by
the `safetensors` library: loading through the library needs one more copy of the data to
verify our checksum, and was measured slower; this reader reads the data into one buffer,
checksums it and views the tensors in place, with no further copy however long the unit.

    u64 little-endian header length N | N bytes of JSON header | tensor data
    tensors, in data order: positions [S] i64, token_ids [S] i64, keys [L,H,S,Dk],
    values [L,H,S,Dv], placeholder [S] bool
    __metadata__: format, format_version, key, stored (as in the name), meta (JSON of the
    caller's meta), tensors (JSON: dtype and shape of each), put_dtype, sha256 (of the whole
    data section)

Files are written 0600 and durably by `home.write_private`: a temporary name in the same folder
(`.<name>.<random>.tmp`), the data fsynced, renamed into place, the folder fsynced -- so a
crash leaves the old file, the new one, or a temporary leftover, never a name with nothing
behind it. What a crash could leave anyway (an older writer's empty or zero-filled file, a
write cut short) is recognised as ours by `crash_leftover`: a regular file of the user's that
is empty, all zero bytes, or a prefix of a file this code writes (its header cut short); such
a file at one of our names is replaced, not kept as a foreign file forever.
`read_file` opens only regular files (O_NONBLOCK | O_NOFOLLOW, so a FIFO never blocks) and
raises UntrustedFileError for what `promptlang.home.untrusted_reason` refuses (another
user's file, or one others can write), CorruptFileError for a file that fails a check; its
`ours` is False when the file carries no promptlang-kv tag (nothing says who wrote it).
The folder the files live in, and its rules, are in `folder.py`.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
from pathlib import Path

import torch

from promptlang.errors import CorruptFileError, InvalidArgumentError, UntrustedFileError
from promptlang.home import MISSING, untrusted_reason, write_private
from promptlang.runtime.kv.unit import UnitKV

FORMAT = "promptlang-kv"
FORMAT_VERSION = "2"

_MAX_HEADER = 16 << 20  # our headers are a few hundred bytes; anything huge is foreign
# 8-byte ints first keeps data aligned
_TENSOR_ORDER = ("positions", "token_ids", "keys", "values", "placeholder")
_DTYPE_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}
FLOAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
_OPEN_FLAGS = (os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0)
               | getattr(os, "O_CLOEXEC", 0))  # a FIFO swapped in after lstat cannot block


# ---- writing and reading -------------------------------------------------------------------

def write_file(path: Path, key: str, kv: UnitKV, meta: dict[str, str],
               put_dtype: torch.dtype, stored: str) -> int:
    """Write `kv` (CPU tensors) to `path` (0600, atomically); returns the file's size."""
    tensors = {name: getattr(kv, name).detach().contiguous() for name in _TENSOR_ORDER}
    chunks = [_tensor_bytes(tensors[name]) for name in _TENSOR_ORDER]
    digest = hashlib.sha256()
    for chunk in chunks:
        digest.update(chunk)
    header = {}
    offset = 0
    for name, chunk in zip(_TENSOR_ORDER, chunks):
        t = tensors[name]
        header[name] = {"dtype": _DTYPE_CODES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(chunk)]}
        offset += len(chunk)
    header["__metadata__"] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "key": key,
        "stored": stored,
        "meta": json.dumps(meta, sort_keys=True),
        "tensors": json.dumps({name: {"dtype": dtype_name(t.dtype), "shape": list(t.shape)}
                               for name, t in tensors.items()}),
        "put_dtype": dtype_name(put_dtype),
        "sha256": digest.hexdigest(),
    }
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads the header so data starts 8-aligned
    write_private(path, [struct.pack("<Q", len(text)), text, *chunks])
    return 8 + len(text) + offset


def read_file(path: Path, key: str,
               stored: str) -> tuple[UnitKV, dict[str, str], torch.dtype, int]:
    """Read and verify one KV file. FileNotFoundError: there is none; UntrustedFileError:
    it must not be read (see `untrusted_reason`); CorruptFileError: it failed a check."""
    reason = untrusted_reason(path)
    if reason == MISSING:                   # evicted by another process: a plain miss (even
        raise FileNotFoundError(path)       # if a writer's rename brings it back meanwhile)
    if reason is not None:
        os.lstat(path)                      # gone meanwhile: a plain miss
        raise UntrustedFileError(reason)
    fd = os.open(path, _OPEN_FLAGS)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
            raise UntrustedFileError("it changed while it was opened")
        try:
            kv, info, size = _read_verified(f, st.st_size, key, stored)
        except CorruptFileError as err:
            err.identity = (st.st_ino, st.st_mtime_ns)
            if not err.ours:                  # no tag: but maybe what a crash left of ours
                leftover = _leftover_reason(f, st.st_size)
                if leftover is not None:
                    ours = CorruptFileError(leftover)
                    ours.identity = err.identity
                    raise ours from None
            raise
    return kv, info["meta"], info["put_dtype"], size


def _read_verified(f, size: int, key: str, stored: str) -> tuple[UnitKV, dict, int]:
    header, data_start = _read_header(f, size)
    info = check_header(header, key, stored, size - data_start)
    data = bytearray(size - data_start)
    if f.readinto(data) != len(data):
        raise CorruptFileError("file shorter than its header says (truncated?)")
    if hashlib.sha256(data).hexdigest() != info["sha256"]:
        raise CorruptFileError("checksum mismatch")
    parts = {}
    for name in _TENSOR_ORDER:
        spec = header[name]
        dtype = _CODE_DTYPES[spec["dtype"]]
        begin, end = spec["data_offsets"]
        numel = (end - begin) // _itemsize(dtype)
        if numel == 0:
            t = torch.empty(0, dtype=dtype)
        else:  # a view of `data`: no copy
            t = torch.frombuffer(data, dtype=dtype, count=numel, offset=begin)
        parts[name] = t.reshape(spec["shape"])
    kv = UnitKV(**parts)
    try:
        check_kv(kv)
    except ValueError as err:
        raise CorruptFileError(str(err)) from None
    return kv, info, size


def _read_header(f, size: int) -> tuple[dict, int]:
    """The parsed safetensors header of open file `f` of `size` bytes, and where data starts.
    Its CorruptFileErrors are not `ours`: without a header, nothing says who wrote the file."""
    try:
        return _parse_header(f, size)
    except CorruptFileError as err:
        err.ours = False
        raise


def _parse_header(f, size: int) -> tuple[dict, int]:
    if size < 8:
        raise CorruptFileError(f"{size} bytes is too short for a safetensors file")
    prefix = f.read(8)
    if len(prefix) != 8:
        raise CorruptFileError("file shorter than 8 bytes (truncated?)")
    (length,) = struct.unpack("<Q", prefix)
    if length < 2 or length > _MAX_HEADER or 8 + length > size:
        raise CorruptFileError(f"not a safetensors file (header length {length}, file {size} bytes)")
    raw = f.read(length)
    if len(raw) != length:
        raise CorruptFileError("file shorter than its header (truncated?)")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CorruptFileError(f"unreadable safetensors header: {err}") from None
    except RecursionError:
        raise CorruptFileError("unreadable safetensors header: nested too deeply") from None
    if not isinstance(header, dict):
        raise CorruptFileError("safetensors header is not an object")
    return header, 8 + length


def check_header(header: dict, key: str, stored: str, data_bytes: int) -> dict:
    """Validate a header against our format, the key and store dtype its name says, and the
    file's data size; returns its metadata."""
    md = header.get("__metadata__")
    if not isinstance(md, dict) or md.get("format") != FORMAT:
        err = CorruptFileError(f"not a promptlang KV file (no {FORMAT!r} format tag)")
        err.ours = False
        raise err
    if md.get("format_version") != FORMAT_VERSION:
        raise CorruptFileError(f"format version {md.get('format_version')!r}, "
                               f"this promptlang reads {FORMAT_VERSION!r}")
    if md.get("key") != key:
        raise CorruptFileError(f"file holds key {md.get('key')!r}, its name says {key!r}")
    if md.get("stored") != stored:
        raise CorruptFileError(f"file holds KV stored as {md.get('stored')!r}, its name says "
                               f"{stored!r}")
    names = set(header) - {"__metadata__"}
    if names != set(_TENSOR_ORDER):
        raise CorruptFileError(f"tensors {sorted(names)}, expected {sorted(_TENSOR_ORDER)}")
    try:
        meta = json.loads(md["meta"])
        declared = json.loads(md["tensors"])
        put_dtype = _dtype_from_name(md["put_dtype"])
        sha = md["sha256"]
        offset = 0
        for name in _TENSOR_ORDER:
            spec = header[name]
            dtype = _CODE_DTYPES[spec["dtype"]]
            shape = spec["shape"]
            begin, end = spec["data_offsets"]
            numel = 1
            for dim in shape:
                numel *= int(dim)
            if begin != offset or end - begin != numel * _itemsize(dtype):
                raise CorruptFileError(f"tensor {name!r} has inconsistent data offsets")
            if declared[name] != {"dtype": dtype_name(dtype), "shape": shape}:
                raise CorruptFileError(f"tensor {name!r} does not match its declared dtype/shape")
            offset = end
        if stored != "put" and dtype_name(_CODE_DTYPES[header["keys"]["dtype"]]) != stored:
            raise CorruptFileError(f"keys are {header['keys']['dtype']}, not stored as {stored}")
        length = int(header["positions"]["shape"][0])
    except CorruptFileError:
        raise
    except (KeyError, IndexError, TypeError, ValueError, AttributeError, RecursionError) as err:
        raise CorruptFileError(f"malformed header ({type(err).__name__})") from None
    if offset != data_bytes:
        raise CorruptFileError(f"data section is {data_bytes} bytes, header says {offset} (truncated?)")
    if not isinstance(meta, dict):
        raise CorruptFileError("meta is not an object")
    return {"meta": {str(k): str(v) for k, v in meta.items()}, "put_dtype": put_dtype,
            "sha256": sha, "data_bytes": offset, "length": length}


# ---- looking at a file without loading it ----------------------------------------------------

def peek_header(path: Path, info: os.stat_result) -> tuple[dict, int] | None:
    """(header, data start) if the file at `path` is still the regular file `info` describes
    and its header carries the promptlang-kv tag, else None. Never blocks on a FIFO."""
    f = _open_as_seen(path, info)
    if f is None:
        return None
    with f:
        try:
            header, data_start = _read_header(f, os.fstat(f.fileno()).st_size)
        except (CorruptFileError, OSError):
            return None
    md = header.get("__metadata__")
    return (header, data_start) if isinstance(md, dict) and md.get("format") == FORMAT else None


def existing_file(path: Path, key: str, stored: str) -> str:
    """What is at `path` before a write: "absent"; "current" (a trusted file of ours for this
    key and store dtype); "replace" (ours, but outdated or refused by untrusted_reason, or
    what a crash left of ours: `crash_leftover`); or "foreign" (anything else without our
    tag, which is left alone)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return "absent"
    peeked = peek_header(path, info) if stat.S_ISREG(info.st_mode) else None
    if peeked is None:
        return "replace" if crash_leftover(path, info) is not None else "foreign"
    md = peeked[0]["__metadata__"]
    current = (md.get("format_version"), md.get("key"), md.get("stored"))
    if current == (FORMAT_VERSION, key, stored) and untrusted_reason(path) is None:
        return "current"
    return "replace"


# ---- what a crash leaves ----------------------------------------------------------------------

_HEADER_START = b'{"positions":{"dtype":"I64","shape":['   # how write_file's header begins
_ZERO_CHECK_BYTES = 64 << 20          # a zero-filled leftover is checked up to this size


def crash_leftover(path: Path, info: os.stat_result) -> str | None:
    """Why the file at `path` (its lstat `info`) is what a crash left of a file of ours --
    a regular file of the current user's that is empty, all zero bytes, or a prefix of a
    file write_file writes with its header cut short -- or None (then it is not ours,
    unless its header carries our tag). Never blocks on a FIFO; never follows a link."""
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
        return None
    f = _open_as_seen(path, info)
    if f is None:
        return None
    with f:
        try:
            return _leftover_reason(f, os.fstat(f.fileno()).st_size)
        except OSError:
            return None


def _open_as_seen(path: Path, info: os.stat_result):
    """`path` opened for reading if it is still the regular file its lstat `info` describes
    (no link followed, no FIFO blocked on), else None."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError:
        return None
    f = os.fdopen(fd, "rb")
    opened = os.fstat(f.fileno())
    if not stat.S_ISREG(opened.st_mode) or opened.st_ino != info.st_ino:
        f.close()
        return None
    return f


def _leftover_reason(f, size: int) -> str | None:
    """`crash_leftover`'s test on open file `f` of `size` bytes."""
    if size == 0:
        return "an empty file (a write cut short)"
    f.seek(0)
    head = f.read(8 + len(_HEADER_START))
    if len(head) >= 8:
        (length,) = struct.unpack("<Q", head[:8])
        shape_ok = 2 <= length <= _MAX_HEADER and 8 + length > size
    else:                              # the length itself cut short: its high bytes are 0
        shape_ok = not any(head[3:])
    start = head[8:]
    if shape_ok and _HEADER_START.startswith(start) and (start or head[:3] != bytes(3)):
        return f"a write cut short ({size} bytes, inside its header)"
    if not any(head) and size <= _ZERO_CHECK_BYTES:
        while True:
            block = f.read(1 << 20)
            if not block:
                return "only zero bytes (a write cut short)"
            if any(block):
                return None
    return None


# ---- small helpers ---------------------------------------------------------------------------

def check_kv(kv: UnitKV) -> None:
    """ValueError unless `kv` has UnitKV's shapes and dtypes."""
    k = kv.keys
    v = kv.values
    if k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]:
        raise InvalidArgumentError(f"keys {tuple(k.shape)} / values {tuple(v.shape)} are not "
                                   "[L, H_kv, S, D]")
    if k.dtype not in FLOAT_DTYPES or v.dtype != k.dtype:
        raise InvalidArgumentError(f"keys/values must share one float dtype, got {k.dtype} / "
                                   f"{v.dtype}")
    s = k.shape[2]
    for name, dtype in (("positions", torch.int64), ("token_ids", torch.int64),
                        ("placeholder", torch.bool)):
        t = getattr(kv, name)
        if t.shape != (s,) or t.dtype != dtype:
            raise InvalidArgumentError(f"{name} must be [{s}] {dtype}, got {tuple(t.shape)} "
                                       f"{t.dtype}")


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without copying."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if dtype not in FLOAT_DTYPES:
        raise CorruptFileError(f"unknown put dtype {name!r}")
    return dtype
