"""The module store: encoded units' KV, kept in three tiers and looked up by key.

A key is an opaque hex digest made by the encoder from everything that determines a unit's KV
(model fingerprint, encoding rule, token ids, positions, context units' keys), so a key names
its content: two puts of one key carry the same tensors.

Tiers, fastest first:

    device  tensors on the compute device, ready for the assembler
    host    CPU memory; on CUDA pinned, copied to the device asynchronously on a copy stream
    disk    one safetensors file per key and store dtype under `disk_dir`; survives restarts,
            checked on load

The device and host tiers are exclusive (an entry lives in at most one of them); the disk
tier is written through on `put`. Each tier has a byte budget (None = unlimited, 0 = tier
off) and evicts least-recently-used entries past it: device -> host -> dropped (still on
disk). An entry larger than a tier's whole budget skips that tier.

The disk budget is enforced after each put by scanning the directory (files other processes
wrote count too), deleting the files used longest ago; a file's last use is the later of its
mtime and this process's last use of the key, and hits refresh the mtime at most once a minute
so the order survives restarts. `disk_budget_bytes=0` turns the disk tier off entirely.

The disk tier touches only its own files. Its folder is made private (0700) and marked with a
`.promptlang-kv-store` file when the store creates it (or adopts an empty folder, or one that
holds nothing but promptlang KV files); a folder with other files and no marker is refused,
and `clear_disk` / `list_disk_entries` refuse any folder without the marker (the KV home
excepted, which they adopt as a store would). Inside it, only
regular files (checked with lstat: a FIFO is never opened) whose safetensors header carries
the `promptlang-kv` format tag are listed, counted, evicted or deleted; anything else is left
alone. Files are written 0600 through `promptlang.home.write_private` (temporary name, then
rename). A file that `promptlang.home.untrusted_reason` refuses (another user's, or writable
by others) is never loaded: it is a miss, so the caller encodes the unit again and the put
replaces the file; one `CacheWarning` per reason per process says so.

On a CPU device the device and host tiers would be the same memory, so there is one memory
tier, reported as "device", governed by `device_budget_bytes`; `host_budget_bytes` is
ignored. `host_tier=True` keeps a separate host tier anyway (entries move between the two by
reference, never copied): a two-level LRU, used by the tests to exercise demotion.

Disk file `<key>.<stored>.safetensors`, where <stored> is the store dtype (`float32`,
`bfloat16`, ...) or `put` for a store without one (KV kept as put), so stores of different
dtypes sharing a folder never serve each other's KV. A valid safetensors file, written and
read here without extra copies:

    u64 little-endian header length N | N bytes of JSON header | tensor data
    tensors, in data order: positions [S] i64, token_ids [S] i64, keys [L,H,S,Dk],
    values [L,H,S,Dv], placeholder [S] bool
    __metadata__: format, format_version, key, stored (as in the name), meta (JSON of the
    caller's meta), tensors (JSON: dtype and shape of each), put_dtype, sha256 (of the whole
    data section)

A file of ours that fails any check (incomplete, wrong version, wrong key or store dtype,
wrong shapes, checksum mismatch) is reported with `CacheWarning`, counted in
`stats.corrupt_files`, deleted, and treated as a miss, so the caller re-encodes. A file at
one of our names without our format tag is counted the same way but kept (and not
overwritten), reported once per reason per process. Neither is ever served.

Store dtype: `dtype=torch.bfloat16` (or float16) stores keys and values at that precision in
every tier (halving their bytes; budgets count stored bytes). `get` converts them back to
`compute_dtype` if given, else to the dtype they were put with; that conversion is a copy per
get. Without a store dtype, `get` returns the stored tensors themselves.

Thread safety: one lock guards the memory tiers and counters; disk reads, writes and deletes
of one key are serialised by a per-key (striped) lock, and a thread that waited on it looks in
memory again first, so concurrent gets of one key load its file once. The store never mutates
a tensor it holds or returned; `put` keeps the tensors it is given (when no dtype or device
conversion is needed), so callers must not mutate them afterwards either.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import stat
import struct
import threading
import time
import warnings
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

import torch

from promptlang.errors import CacheError
from promptlang.home import kv_dir, private_dir, untrusted_reason, write_private
from promptlang.inputs import read_bytes
from promptlang.runtime.kv import ModuleKV

FORMAT = "promptlang-kv"
FORMAT_VERSION = "2"
SUFFIX = ".safetensors"
MARKER = ".promptlang-kv-store"
TIERS = ("device", "host", "disk")

_MARKER_TEXT = b"promptlang-kv-store 1\n"
_KEY_RE = re.compile(r"[0-9A-Za-z_-]{1,128}\Z")
_TMP_RE = re.compile(r"\.[0-9A-Za-z_.-]+\.tmp\Z")  # write_private's temporary names (and v1's)
_MAX_HEADER = 16 << 20  # our headers are a few hundred bytes; anything huge is foreign
_TENSOR_ORDER = ("positions", "token_ids", "keys", "values", "placeholder")  # 8-byte ints first keeps data aligned
_DTYPE_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}
_FLOAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
_TOUCH_EVERY_NS = 60 * 10**9  # persist a memory hit to the file's mtime at most once a minute
_OPEN_FLAGS = (os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0)
               | getattr(os, "O_CLOEXEC", 0))  # a FIFO swapped in after lstat cannot block

_warned: set[str] = set()   # reasons already reported by `_warn_once` in this process
_warned_lock = threading.Lock()


class CacheWarning(UserWarning):
    """Something in the KV store was wrong but recoverable: a corrupt file, a failed write."""


class UntrustedFileError(Exception):
    """Internal: a disk file that must not be read (see `untrusted_reason`)."""


class CorruptFileError(Exception):
    """Internal: a disk file failed a check. Never escapes the store."""

    identity: tuple[int, int] | None = None  # (inode, mtime ns) of the file that failed
    ours = True                               # False: no promptlang-kv tag, so not deleted


@dataclass
class StoreStats:
    """Counters since the store was made, and current bytes per memory tier."""

    device_hits: int = 0
    host_hits: int = 0
    disk_hits: int = 0
    misses: int = 0
    puts: int = 0
    device_evictions: int = 0      # each one moves down to host when a host tier takes it
    host_evictions: int = 0
    disk_evictions: int = 0
    disk_loads: int = 0            # files read and verified (gets and prefetches)
    disk_bytes_read: int = 0
    disk_writes: int = 0
    disk_bytes_written: int = 0
    disk_write_errors: int = 0
    corrupt_files: int = 0
    untrusted_files: int = 0       # files untrusted_reason refused (not ours, or writable)
    prefetches: int = 0            # keys a prefetch found in host or disk and moved up
    device_bytes: int = 0
    host_bytes: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True)
class StoreEntry:
    """One key as `ModuleStore.entries()` sees it."""

    key: str
    tiers: tuple[str, ...]           # subset of TIERS, fastest first
    nbytes: int                      # stored tensor bytes (store dtype)
    meta: dict[str, str]
    file_bytes: int | None = None    # size of the disk file, if any


@dataclass
class _Entry:
    kv: ModuleKV
    meta: dict[str, str]
    nbytes: int
    put_dtype: torch.dtype
    ready: object = None             # CUDA event the tensors' last copy recorded, or None


@dataclass
class _Tier:
    """An LRU of entries under a byte budget (None = unlimited, 0 = off)."""

    name: str
    budget: int | None
    entries: OrderedDict = field(default_factory=OrderedDict)
    used: int = 0

    def fits(self, nbytes: int) -> bool:
        return self.budget is None or nbytes <= self.budget

    def add(self, key: str, entry: _Entry) -> None:
        self.discard(key)
        self.entries[key] = entry
        self.used += entry.nbytes

    def discard(self, key: str) -> _Entry | None:
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.used -= entry.nbytes
        return entry

    def over_budget(self) -> bool:
        return self.budget is not None and self.used > self.budget

    def pop_lru(self) -> tuple[str, _Entry]:
        key, entry = self.entries.popitem(last=False)
        self.used -= entry.nbytes
        return key, entry


class ModuleStore:
    """Key -> ModuleKV, in device, host and disk tiers with byte budgets and LRU eviction.

    device: the compute device that `get` returns tensors on.
    *_budget_bytes: per-tier budget; None = unlimited, 0 = tier off.
    disk_dir: where the disk tier lives (default `promptlang.home.kv_dir()`); created (0700,
        marked) if needed. CacheError for a folder that is not the user's, or that holds
        other files and has no marker.
    dtype: store keys/values at this float dtype (None = as put).
    compute_dtype: dtype of keys/values returned by `get` (None = the dtype they were put with).
    host_tier: None = a host tier on accelerators only; True/False forces it on/off.
    """

    def __init__(self, device: torch.device | str = "cpu", device_budget_bytes: int | None = None,
                 host_budget_bytes: int | None = None, disk_dir: str | os.PathLike | None = None,
                 disk_budget_bytes: int | None = None, dtype: torch.dtype | None = None, *,
                 compute_dtype: torch.dtype | None = None, host_tier: bool | None = None):
        self.device = torch.device(device)
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise CacheError(f"ModuleStore: device {self.device} requested but CUDA is not available")
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
        for name, value in (("device_budget_bytes", device_budget_bytes),
                            ("host_budget_bytes", host_budget_bytes),
                            ("disk_budget_bytes", disk_budget_bytes)):
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"ModuleStore: {name} must be None or a byte count >= 0, got {value!r}")
        for name, value in (("dtype", dtype), ("compute_dtype", compute_dtype)):
            if value is not None and value not in _FLOAT_DTYPES:
                raise ValueError(f"ModuleStore: {name} must be a float dtype, got {value!r}")
        self.dtype = dtype
        self.compute_dtype = compute_dtype
        self._cuda = self.device.type == "cuda"
        if host_tier is None:
            host_tier = self.device.type != "cpu"
        self._device = _Tier("device", device_budget_bytes)
        self._host = _Tier("host", host_budget_bytes if host_tier else 0)
        self._disk_budget = disk_budget_bytes
        self.disk_dir: Path | None = None
        self._stored = _dtype_name(dtype) if dtype is not None else "put"  # part of file names
        if disk_budget_bytes != 0:
            self.disk_dir = Path(disk_dir) if disk_dir is not None else kv_dir()
            _open_dir(self.disk_dir)
        self._lock = threading.Lock()
        self._key_locks = [threading.Lock() for _ in range(64)]
        self._stats = StoreStats()
        self._used: dict[str, tuple[int, int]] = {}     # key -> (last use ns, sequence): disk LRU
        self._touched: dict[str, int] = {}               # key -> ns the file's mtime was last set
        self._scanned: dict[str, tuple[tuple[int, int, int], bool]] = {}  # name -> (identity, ours)
        self._seq = itertools.count()
        self._copy_stream = torch.cuda.Stream(self.device) if self._cuda else None

    def __repr__(self) -> str:
        return (f"ModuleStore(device={str(self.device)!r}, device_budget_bytes={self._device.budget}, "
                f"host_budget_bytes={self._host.budget}, disk_dir={self.disk_dir}, "
                f"disk_budget_bytes={self._disk_budget}, dtype={self.dtype})")

    # ---- public API -------------------------------------------------------------------------

    @property
    def stats(self) -> StoreStats:
        """A snapshot of the counters."""
        with self._lock:
            self._stats.device_bytes, self._stats.host_bytes = self._device.used, self._host.used
            return StoreStats(**self._stats.as_dict())

    def contains(self, key: str) -> bool:
        """Whether any tier has `key` (a disk file counts without being verified)."""
        _check_key(key)
        with self._lock:
            if key in self._device.entries or key in self._host.entries:
                return True
        return self.disk_dir is not None and _is_regular(self._path(key))

    def __contains__(self, key: str) -> bool:
        return self.contains(key)

    def get(self, key: str) -> ModuleKV | None:
        """The unit's KV on `self.device`, or None (miss, or a corrupt file was discarded)."""
        _check_key(key)
        with self._lock:
            entry = self._lookup_memory(key, count=True)
        if entry is None and self.disk_dir is not None:
            entry, _ = self._load_through(key, count=True)
        if entry is None:
            with self._lock:
                self._stats.misses += 1
            return None
        return self._for_caller(entry)

    def put(self, key: str, kv: ModuleKV, meta: Mapping[str, str] | None = None) -> None:
        """Store `kv` under `key` in the device tier and write it through to disk.

        `meta` (str -> str; values are passed through str()) is kept for `entries()` and the
        file header. A key already on disk is not rewritten: a key names its content.
        """
        _check_key(key)
        _check_kv(kv)
        meta = {str(k): str(v) for k, v in (meta or {}).items()}
        put_dtype = kv.keys.dtype
        stored = _convert(kv, self.dtype, self.device)
        entry = _Entry(stored, meta, stored.nbytes, put_dtype)
        with self._lock:
            self._stats.puts += 1
            self._place(key, entry)
            self._note_use(key)
        if self.disk_dir is not None and _fits(self._disk_budget, entry.nbytes):
            self._write_through(key, entry)
            self._enforce_disk_budget(protect=key)

    def prefetch(self, keys: Iterable[str]) -> int:
        """Bring host and disk entries up to the device tier (e.g. a union's other members).

        Disk reads happen in this call (run it on a worker thread to overlap them); on CUDA
        the host->device copies are asynchronous and `get` orders the caller's stream after
        them. Returns how many of `keys` are now in memory.
        """
        resident = 0
        for key in keys:
            _check_key(key)
            with self._lock:
                in_host = key in self._host.entries
                entry = self._lookup_memory(key, count=False)
                self._stats.prefetches += entry is not None and in_host
            if entry is None and self.disk_dir is not None:
                _, loaded = self._load_through(key, count=False)
                with self._lock:
                    self._stats.prefetches += loaded
            with self._lock:
                resident += key in self._device.entries or key in self._host.entries
        return resident

    def evict(self, key: str, tiers: Iterable[str] | None = None) -> bool:
        """Drop `key` from `tiers` (default: all, disk included). True if anything was removed."""
        _check_key(key)
        tiers = _check_tiers(tiers)
        removed = False
        with self._lock:
            for tier in (self._device, self._host):
                if tier.name in tiers and tier.discard(key) is not None:
                    removed = True
        if "disk" in tiers and self.disk_dir is not None:
            with self._key_lock(key):
                removed |= _unlink_ours(self._path(key))
            with self._lock:
                self._used.pop(key, None)
                self._touched.pop(key, None)
        return removed

    def clear(self, tiers: Iterable[str] | None = None) -> int:
        """Empty `tiers` (default: all, disk included). Returns the number of entries removed."""
        tiers = _check_tiers(tiers)
        removed = 0
        with self._lock:
            for tier in (self._device, self._host):
                if tier.name in tiers:
                    removed += len(tier.entries)
                    tier.entries.clear()
                    tier.used = 0
        if "disk" in tiers and self.disk_dir is not None:
            removed += clear_disk(self.disk_dir)
            with self._lock:
                self._used.clear()
                self._touched.clear()
        return removed

    def entries(self) -> list[StoreEntry]:
        """Every key in every tier, disk files written by other processes included, by key."""
        with self._lock:
            memory = {key: (tier.name, e.nbytes, dict(e.meta))
                      for tier in (self._host, self._device) for key, e in tier.entries.items()}
        disk = {}
        if self.disk_dir is not None:
            disk = {d["key"]: d for d in list_disk_entries(self.disk_dir) if d["error"] is None}
        result = []
        for key in sorted(memory.keys() | disk.keys()):
            tiers, nbytes, meta, file_bytes = [], 0, {}, None
            if key in memory:
                tiers.append(memory[key][0])
                nbytes, meta = memory[key][1], memory[key][2]
            if key in disk:
                tiers.append("disk")
                file_bytes = disk[key]["file_bytes"]
                if key not in memory:
                    nbytes, meta = disk[key]["nbytes"], disk[key]["meta"]
            result.append(StoreEntry(key, tuple(tiers), nbytes, meta, file_bytes))
        return result

    # ---- memory tiers (call with self._lock held) --------------------------------------------

    def _lookup_memory(self, key: str, count: bool) -> _Entry | None:
        """The entry on the device if `key` is in memory; a host entry is promoted."""
        entry = self._device.entries.get(key)
        if entry is not None:
            self._device.entries.move_to_end(key)
            if count:
                self._stats.device_hits += 1
        else:
            entry = self._host.entries.get(key)
            if entry is None:
                return None
            if count:
                self._stats.host_hits += 1
            # too big for the device tier: stays in host (now MRU), served through a copy
            entry = self._to_device(self._place(key, entry))
        self._note_use(key)
        return entry

    def _place(self, key: str, entry: _Entry) -> _Entry | None:
        """Insert into the highest tier that can hold it, demoting LRU entries past budgets.

        Returns the entry as that tier holds it, or None if neither memory tier takes it."""
        self._device.discard(key)
        self._host.discard(key)
        if not self._device.fits(entry.nbytes):
            return self._demote(key, entry)
        entry = self._to_device(entry)
        self._device.add(key, entry)
        while self._device.over_budget():
            old_key, old = self._device.pop_lru()
            self._stats.device_evictions += 1
            self._demote(old_key, old)
        return entry

    def _demote(self, key: str, entry: _Entry) -> _Entry | None:
        if not self._host.fits(entry.nbytes):
            return None  # dropped from memory; the disk tier (if any) still has it
        entry = self._to_host(entry)
        self._host.add(key, entry)
        while self._host.over_budget():
            self._host.pop_lru()
            self._stats.host_evictions += 1
        return entry

    def _to_device(self, entry: _Entry) -> _Entry:
        """The entry's tensors on the compute device (asynchronous copy on CUDA)."""
        if not self._cuda or entry.kv.keys.device == self.device:
            return entry
        with torch.cuda.stream(self._copy_stream):
            if entry.ready is not None:  # the device->host copy that filled these pinned tensors
                self._copy_stream.wait_event(entry.ready)
            kv = entry.kv.to(self.device, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self._copy_stream)
        return _Entry(kv, entry.meta, entry.nbytes, entry.put_dtype, ready)

    def _to_host(self, entry: _Entry) -> _Entry:
        """The entry's tensors in pinned host memory (asynchronous copy on CUDA)."""
        if not self._cuda or entry.kv.keys.is_pinned():
            return entry
        if entry.kv.keys.device.type == "cpu":  # read from disk: pin it (a synchronous copy)
            return _Entry(ModuleKV(*(t.pin_memory() for t in _tensors(entry.kv))), entry.meta,
                          entry.nbytes, entry.put_dtype)
        stream = torch.cuda.current_stream(self.device)
        if entry.ready is not None:
            stream.wait_event(entry.ready)
        parts = []
        for t in _tensors(entry.kv):
            pinned = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
            pinned.copy_(t, non_blocking=True)
            t.record_stream(stream)  # t may come from the copy stream: keep it until this copy ran
            parts.append(pinned)
        ready = torch.cuda.Event()
        ready.record(stream)
        return _Entry(ModuleKV(*parts), entry.meta, entry.nbytes, entry.put_dtype, ready)

    def _note_use(self, key: str) -> None:
        self._used[key] = (time.time_ns(), next(self._seq))

    # ---- disk tier ---------------------------------------------------------------------------

    def _path(self, key: str) -> Path:
        return self.disk_dir / f"{key}.{self._stored}{SUFFIX}"

    def _key_of(self, name: str) -> str | None:
        """The key of file `name` if it is one of this store's names (its store dtype)."""
        tail = f".{self._stored}{SUFFIX}"
        key = name[:-len(tail)] if name.endswith(tail) else ""
        return key if _KEY_RE.match(key) else None

    def _key_lock(self, key: str) -> threading.Lock:
        return self._key_locks[hash(key) % len(self._key_locks)]

    def _load_through(self, key: str, count: bool) -> tuple[_Entry | None, bool]:
        """(entry, loaded from disk): loads `key` once however many threads ask at one time."""
        with self._key_lock(key):
            with self._lock:  # another thread may have loaded it while this one waited
                entry = self._lookup_memory(key, count=count)
            if entry is not None:
                return entry, False
            path = self._path(key)
            try:
                kv, meta, put_dtype, nbytes_read = _read_file(path, key, self._stored)
            except FileNotFoundError:
                return None, False
            except UntrustedFileError as err:
                _warn_once(str(err), f"promptlang: not loading KV cache file {path}: {err}; "
                           "its unit is encoded again (other files refused for this reason "
                           "are not reported)")
                with self._lock:
                    self._stats.untrusted_files += 1
                return None, False
            except CorruptFileError as err:
                self._discard_corrupt(path, err)
                return None, False
            except OSError as err:
                warnings.warn(f"promptlang: cannot read KV cache file {path}: {err}", CacheWarning,
                              stacklevel=3)
                return None, False
            stored = _convert(kv, self.dtype, torch.device("cpu"))
            entry = _Entry(stored, meta, stored.nbytes, put_dtype)
            with self._lock:
                self._stats.disk_loads += 1
                self._stats.disk_bytes_read += nbytes_read
                if count:
                    self._stats.disk_hits += 1
                # placed where it fits; if nowhere, served once from what was read
                entry = self._to_device(self._place(key, entry) or entry)
                self._note_use(key)
                touch = self._due_touch(key)
            if touch:
                _touch(path)
            return entry, True

    def _due_touch(self, key: str) -> bool:
        now = time.time_ns()
        if now - self._touched.get(key, 0) < _TOUCH_EVERY_NS:
            return False
        self._touched[key] = now
        return True

    def _discard_corrupt(self, path: Path, err: CorruptFileError) -> None:
        if not err.ours:
            _warn_once(f"foreign: {err}", f"promptlang: ignored KV cache file {path}: {err}; "
                       "promptlang did not write it, so it is left as it is (other such files "
                       "are not reported)", stacklevel=5)
        else:
            warnings.warn(f"promptlang: discarded corrupt KV cache file {path}: {err}",
                          CacheWarning, stacklevel=4)
            try:  # delete only the file that was read, not one another process replaced it with
                st = os.lstat(path)
                if (st.st_ino, st.st_mtime_ns) == err.identity:
                    path.unlink()
            except FileNotFoundError:
                pass
        with self._lock:
            self._stats.corrupt_files += 1
            self._used.pop(self._key_of(path.name), None)

    def _write_through(self, key: str, entry: _Entry) -> None:
        path = self._path(key)
        with self._key_lock(key):
            existing = _existing_file(path, key, self._stored)
            if existing == "current":
                with self._lock:
                    touch = self._due_touch(key)
                if touch:
                    _touch(path)
                return
            if existing == "foreign":
                _warn_once("foreign file in the way",
                           f"promptlang: not writing KV cache file {path}: a file promptlang did "
                           "not write is in the way and is left as it is (other such files are "
                           "not reported)")
                with self._lock:
                    self._stats.disk_write_errors += 1
                return
            kv = entry.kv
            if kv.keys.device.type != "cpu":
                if entry.ready is not None:
                    torch.cuda.current_stream(self.device).wait_event(entry.ready)
                kv = kv.to("cpu")
            try:
                written = _write_file(path, key, kv, entry.meta, entry.put_dtype, self._stored)
            except OSError as err:
                warnings.warn(f"promptlang: cannot write KV cache file {path}: {err}", CacheWarning,
                              stacklevel=3)
                with self._lock:
                    self._stats.disk_write_errors += 1
                return
        with self._lock:
            self._stats.disk_writes += 1
            self._stats.disk_bytes_written += written
            self._touched[key] = time.time_ns()

    def _enforce_disk_budget(self, protect: str) -> None:
        """Delete least-recently-used files of ours until the directory fits the disk budget.

        Scans the directory, so files other processes wrote count too (ours by their header,
        whatever their store dtype or format version); a file's last use is its mtime or this
        process's last use of the key, whichever is later. Other files are neither counted
        nor touched.
        """
        if self._disk_budget is None:
            return
        files = self._scan_disk()
        keep = self._path(protect).name
        with self._lock:
            total = sum(info.st_size for info in files.values())
            if total <= self._disk_budget:
                return
            order = sorted((max((info.st_mtime_ns, -1), self._used.get(self._key_of(name), (0, -1))),
                            name) for name, info in files.items() if name != keep)
        for _, name in order:
            if total <= self._disk_budget:
                break
            key = self._key_of(name)
            with self._key_lock(key or name):
                if _unlink_same(self.disk_dir / name, files[name]):
                    total -= files[name].st_size
                    with self._lock:
                        self._stats.disk_evictions += 1
                        self._used.pop(key, None)
                        self._touched.pop(key, None)

    def _scan_disk(self) -> dict[str, os.stat_result]:
        """File name -> lstat of every KV file of ours in the folder now. A file's header is
        read once per (inode, size, mtime), not on every scan."""
        known, seen, ours = self._scanned, {}, {}
        for entry in _listdir(self.disk_dir):
            if entry.name.startswith(".") or not entry.name.endswith(SUFFIX):
                continue
            try:
                info = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if not stat.S_ISREG(info.st_mode):
                continue
            identity = (info.st_ino, info.st_size, info.st_mtime_ns)
            hit = known.get(entry.name)
            if hit is None or hit[0] != identity:
                hit = (identity, _peek_header(Path(entry.path), info) is not None)
            seen[entry.name] = hit
            if hit[1]:
                ours[entry.name] = info
        self._scanned = seen
        return ours

    # ---- returning entries -------------------------------------------------------------------

    def _for_caller(self, entry: _Entry) -> ModuleKV:
        """The entry's KV for the calling thread: its stream ordered after pending copies,
        keys and values in the compute dtype."""
        kv = entry.kv
        if self._cuda and entry.ready is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(entry.ready)
            for t in _tensors(kv):
                t.record_stream(stream)
        target = self.compute_dtype or entry.put_dtype
        if kv.keys.dtype != target:
            kv = ModuleKV(kv.keys.to(target), kv.values.to(target), kv.positions, kv.token_ids,
                          kv.placeholder)
        return kv


# ---- module-level disk helpers (used by `promptlang cache ls` / `cache clear`) --------------

def list_disk_entries(disk_dir: str | os.PathLike | None = None) -> list[dict]:
    """Every promptlang KV file in `disk_dir` (default the KV home), sorted by key.

    Each dict: key, path, stored (the store dtype, or "put"), file_bytes, nbytes (tensor
    bytes), modified (mtime, seconds), meta (the caller's meta), put_dtype, length (tokens),
    error (None, or why the file is not one this promptlang reads). Only headers are read:
    checksums are verified on load. Files without the promptlang-kv tag are not listed; a
    folder without the store's marker raises CacheError (a missing one lists nothing).
    """
    directory = _existing_dir(disk_dir, "list")
    if directory is None:
        return []
    result = []
    for path, info, header, data_start in _our_files(directory):
        md = header["__metadata__"]
        key, stored = str(md.get("key", "")), str(md.get("stored", ""))
        item = {"key": key, "path": str(path), "stored": stored, "file_bytes": info.st_size,
                "nbytes": 0, "modified": info.st_mtime, "meta": {}, "put_dtype": "",
                "length": 0, "error": None}
        try:
            checked = _check_header(header, key, stored, info.st_size - data_start)
            if path.name != f"{key}.{stored}{SUFFIX}":
                raise CorruptFileError("its name does not match its key and store dtype")
            item.update(nbytes=checked["data_bytes"], meta=checked["meta"],
                        put_dtype=_dtype_name(checked["put_dtype"]), length=checked["length"])
        except FileNotFoundError:
            continue
        except (CorruptFileError, OSError) as err:
            item["error"] = str(err)
        result.append(item)
    return sorted(result, key=lambda item: (item["key"], item["stored"], item["path"]))


def clear_disk(disk_dir: str | os.PathLike | None = None) -> int:
    """Delete every promptlang KV file (and leftover temporary one) in `disk_dir`; returns the
    number of KV files removed. Other files stay; a folder without the store's marker raises
    CacheError and nothing in it is deleted (a missing folder: 0)."""
    directory = _existing_dir(disk_dir, "delete")
    if directory is None:
        return 0
    removed = sum(_unlink_same(path, info) for path, info, _, _ in _our_files(directory))
    for path, info, _, _ in _our_files(directory, temporary=True):
        _unlink_same(path, info)
    return removed


# ---- file format -----------------------------------------------------------------------------

def _write_file(path: Path, key: str, kv: ModuleKV, meta: dict[str, str],
               put_dtype: torch.dtype, stored: str) -> int:
    """Write `kv` (CPU tensors) to `path` (0600, atomically); returns the file's size."""
    tensors = {name: getattr(kv, name).detach().contiguous() for name in _TENSOR_ORDER}
    chunks = [_tensor_bytes(tensors[name]) for name in _TENSOR_ORDER]
    digest = hashlib.sha256()
    for chunk in chunks:
        digest.update(chunk)
    header, offset = {}, 0
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
        "tensors": json.dumps({name: {"dtype": _dtype_name(t.dtype), "shape": list(t.shape)}
                               for name, t in tensors.items()}),
        "put_dtype": _dtype_name(put_dtype),
        "sha256": digest.hexdigest(),
    }
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads the header so data starts 8-aligned
    write_private(path, [struct.pack("<Q", len(text)), text, *chunks])
    return 8 + len(text) + offset


def _read_file(path: Path, key: str,
               stored: str) -> tuple[ModuleKV, dict[str, str], torch.dtype, int]:
    """Read and verify one KV file. FileNotFoundError: there is none; UntrustedFileError:
    it must not be read (see `untrusted_reason`); CorruptFileError: it failed a check."""
    reason = untrusted_reason(path)
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
            raise
    return kv, info["meta"], info["put_dtype"], size


def _read_verified(f, size: int, key: str, stored: str) -> tuple[ModuleKV, dict, int]:
    header, data_start = _read_header(f, size)
    info = _check_header(header, key, stored, size - data_start)
    data = bytearray(size - data_start)
    if f.readinto(data) != len(data):
        raise CorruptFileError("file shorter than its header says (truncated?)")
    if hashlib.sha256(data).hexdigest() != info["sha256"]:
        raise CorruptFileError("checksum mismatch")
    parts = {}
    for name in _TENSOR_ORDER:
        spec = header[name]
        dtype, (begin, end) = _CODE_DTYPES[spec["dtype"]], spec["data_offsets"]
        numel = (end - begin) // _itemsize(dtype)
        if numel == 0:
            t = torch.empty(0, dtype=dtype)
        else:  # a view of `data`: no copy
            t = torch.frombuffer(data, dtype=dtype, count=numel, offset=begin)
        parts[name] = t.reshape(spec["shape"])
    kv = ModuleKV(**parts)
    try:
        _check_kv(kv)
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
    if not isinstance(header, dict):
        raise CorruptFileError("safetensors header is not an object")
    return header, 8 + length


def _check_header(header: dict, key: str, stored: str, data_bytes: int) -> dict:
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
            shape, (begin, end) = spec["shape"], spec["data_offsets"]
            numel = 1
            for dim in shape:
                numel *= int(dim)
            if begin != offset or end - begin != numel * _itemsize(dtype):
                raise CorruptFileError(f"tensor {name!r} has inconsistent data offsets")
            if declared[name] != {"dtype": _dtype_name(dtype), "shape": shape}:
                raise CorruptFileError(f"tensor {name!r} does not match its declared dtype/shape")
            offset = end
        if stored != "put" and _dtype_name(_CODE_DTYPES[header["keys"]["dtype"]]) != stored:
            raise CorruptFileError(f"keys are {header['keys']['dtype']}, not stored as {stored}")
    except CorruptFileError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise CorruptFileError(f"malformed header ({type(err).__name__}: {err})") from None
    if offset != data_bytes:
        raise CorruptFileError(f"data section is {data_bytes} bytes, header says {offset} (truncated?)")
    if not isinstance(meta, dict):
        raise CorruptFileError("meta is not an object")
    return {"meta": {str(k): str(v) for k, v in meta.items()}, "put_dtype": put_dtype,
            "sha256": sha, "data_bytes": offset, "length": int(header["positions"]["shape"][0])}


# ---- small helpers ---------------------------------------------------------------------------

def _check_key(key: str) -> None:
    if not isinstance(key, str) or not _KEY_RE.match(key):
        raise ValueError(f"store key must be 1-128 characters of [0-9A-Za-z_-], got {key!r}")


def _check_tiers(tiers: Iterable[str] | None) -> set[str]:
    if tiers is None:
        return set(TIERS)
    tiers = {tiers} if isinstance(tiers, str) else set(tiers)
    unknown = tiers - set(TIERS)
    if unknown:
        raise ValueError(f"unknown tier(s) {sorted(unknown)}; tiers are {TIERS}")
    return tiers


def _check_kv(kv: ModuleKV) -> None:
    """ValueError unless `kv` has ModuleKV's shapes and dtypes."""
    k, v = kv.keys, kv.values
    if k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]:
        raise ValueError(f"keys {tuple(k.shape)} / values {tuple(v.shape)} are not [L, H_kv, S, D]")
    if k.dtype not in _FLOAT_DTYPES or v.dtype != k.dtype:
        raise ValueError(f"keys/values must share one float dtype, got {k.dtype} / {v.dtype}")
    s = k.shape[2]
    for name, dtype in (("positions", torch.int64), ("token_ids", torch.int64),
                        ("placeholder", torch.bool)):
        t = getattr(kv, name)
        if t.shape != (s,) or t.dtype != dtype:
            raise ValueError(f"{name} must be [{s}] {dtype}, got {tuple(t.shape)} {t.dtype}")


def _convert(kv: ModuleKV, dtype: torch.dtype | None, device: torch.device) -> ModuleKV:
    """`kv` with keys/values at `dtype` on `device`; the same tensors where nothing changes."""
    keys, values = kv.keys.detach(), kv.values.detach()
    if dtype is not None and keys.dtype != dtype:
        keys, values = keys.to(dtype), values.to(dtype)
    out = ModuleKV(keys, values, kv.positions.detach(), kv.token_ids.detach(), kv.placeholder.detach())
    if any(t.device != device for t in _tensors(out)):
        out = out.to(device)
    return out


def _tensors(kv: ModuleKV) -> tuple[torch.Tensor, ...]:
    return kv.keys, kv.values, kv.positions, kv.token_ids, kv.placeholder


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without copying."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if dtype not in _FLOAT_DTYPES:
        raise CorruptFileError(f"unknown put dtype {name!r}")
    return dtype


def _fits(budget: int | None, nbytes: int) -> bool:
    return budget is None or nbytes <= budget


# ---- the folder and the files in it ---------------------------------------------------------

def _open_dir(directory: Path) -> None:
    """Make `directory` this store's folder: created 0700 and marked, or an existing folder of
    the user's that is marked, empty, or holds nothing but promptlang KV files (marked now)."""
    if os.path.lexists(directory) and not directory.is_dir():
        raise CacheError(f"KV cache directory {directory} is not a directory")
    try:
        private_dir(directory)
    except OSError as err:
        raise CacheError(f"KV cache directory {directory} cannot be created: {err}") from None
    if not os.access(directory, os.R_OK | os.W_OK | os.X_OK):
        raise CacheError(f"KV cache directory {directory} is not readable and writable "
                         "(set PROMPTLANG_HOME or pass disk_dir= to use another place)")
    info = os.stat(directory)
    if info.st_uid != os.getuid() or info.st_mode & 0o022:
        whose = (f"belongs to uid {info.st_uid}" if info.st_uid != os.getuid()
                 else "is writable by others")
        raise CacheError(f"KV cache directory {directory} {whose}: promptlang keeps KV only in "
                         "a folder private to the user (pass disk_dir= another place)")
    problem = _marker_problem(directory)
    if problem is None:
        return
    if os.path.lexists(directory / MARKER):
        raise CacheError(f"KV cache directory {directory} cannot be used: {problem}")
    ours = {path.name for path, _, _, _ in _our_files(directory)}
    ours |= {path.name for path, _, _, _ in _our_files(directory, temporary=True)}
    others = sorted(entry.name for entry in _listdir(directory)
                    if entry.name not in ours and not entry.name.startswith(f".{MARKER}."))
    if others:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise CacheError(f"KV cache directory {directory} is not a promptlang KV folder: it has "
                         f"no {MARKER} marker and holds other files ({shown}); pass disk_dir= "
                         "an empty or new folder")
    try:
        write_private(directory / MARKER, _MARKER_TEXT)
    except OSError as err:
        raise CacheError(f"KV cache directory {directory} cannot be marked: {err}") from None


def _marker_problem(directory: Path) -> str | None:
    """Why `directory` is not marked as a folder the store created, or None when it is."""
    marker = directory / MARKER
    reason = untrusted_reason(marker)
    if reason is not None:
        return f"{marker}: {reason}"
    try:
        text = read_bytes(marker, max_bytes=4096, error=CacheError)
    except CacheError as err:
        return str(err)
    return None if text == _MARKER_TEXT else f"{marker} is not promptlang's marker"


def _existing_dir(disk_dir: str | os.PathLike | None, action: str) -> Path | None:
    """The marked folder `disk_dir` names, or None if there is none. The KV home (None) is
    adopted as a store would adopt it, so a KV home from before markers can be listed and
    cleared; any other folder without the marker is refused."""
    if disk_dir is None:
        directory = kv_dir()
        if not os.path.lexists(directory):
            return None
        _open_dir(directory)
        return directory
    directory = Path(disk_dir)
    if not os.path.lexists(directory):
        return None
    problem = _marker_problem(directory)
    if problem is not None:
        raise CacheError(f"promptlang does not {action} files in {directory}: it is not a folder "
                         f"promptlang's KV store created ({problem}); nothing was changed")
    return directory


def _listdir(directory: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(directory) as entries:
            return list(entries)
    except FileNotFoundError:
        return []
    except OSError as err:
        raise CacheError(f"KV cache directory {directory} cannot be read: {err}") from None


def _our_files(directory: Path, temporary: bool = False):
    """(path, lstat, header, data start) of each regular file in `directory` whose header
    carries the promptlang-kv tag: KV files, or with `temporary` write_private's leftovers.
    Names are filtered and types checked with lstat before anything is opened."""
    for entry in sorted(_listdir(directory), key=lambda e: e.name):
        name = entry.name
        if temporary:
            if not _TMP_RE.match(name) or name.startswith(f".{MARKER}."):
                continue
        elif name.startswith(".") or not name.endswith(SUFFIX):
            continue
        try:
            info = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(info.st_mode):
            continue
        peeked = _peek_header(Path(entry.path), info)
        if peeked is not None:
            yield Path(entry.path), info, *peeked


def _peek_header(path: Path, info: os.stat_result) -> tuple[dict, int] | None:
    """(header, data start) if the file at `path` is still the regular file `info` describes
    and its header carries the promptlang-kv tag, else None. Never blocks on a FIFO."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        opened = os.fstat(f.fileno())
        if not stat.S_ISREG(opened.st_mode) or opened.st_ino != info.st_ino:
            return None
        try:
            header, data_start = _read_header(f, opened.st_size)
        except (CorruptFileError, OSError):
            return None
    md = header.get("__metadata__")
    return (header, data_start) if isinstance(md, dict) and md.get("format") == FORMAT else None


def _existing_file(path: Path, key: str, stored: str) -> str:
    """What is at `path` before a write: "absent"; "current" (a trusted file of ours for this
    key and store dtype); "replace" (ours, but outdated or refused by untrusted_reason); or
    "foreign" (anything without our tag, which is left alone)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return "absent"
    peeked = _peek_header(path, info) if stat.S_ISREG(info.st_mode) else None
    if peeked is None:
        return "foreign"
    md = peeked[0]["__metadata__"]
    current = (md.get("format_version"), md.get("key"), md.get("stored"))
    if current == (FORMAT_VERSION, key, stored) and untrusted_reason(path) is None:
        return "current"
    return "replace"


def _is_regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _unlink_same(path: Path, info: os.stat_result) -> bool:
    """Delete `path` if it is still the file `info` describes (not one put there since)."""
    try:
        now = os.lstat(path)
        if (now.st_dev, now.st_ino) != (info.st_dev, info.st_ino):
            return False
        path.unlink()
        return True
    except FileNotFoundError:
        return False


def _unlink_ours(path: Path) -> bool:
    """Delete `path` if it is a regular file carrying our tag."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(info.st_mode) or _peek_header(path, info) is None:
        return False
    return _unlink_same(path, info)


def _warn_once(reason: str, message: str, stacklevel: int = 4) -> None:
    """A CacheWarning, the first time `reason` comes up in this process."""
    with _warned_lock:
        if reason in _warned:
            return
        _warned.add(reason)
    warnings.warn(message, CacheWarning, stacklevel=stacklevel)


def _touch(path: Path) -> None:
    try:
        os.utime(path, follow_symlinks=False)
    except (OSError, NotImplementedError):
        pass  # evicted meanwhile, or a read-only file: only the disk LRU order is affected
