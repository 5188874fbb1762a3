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

On a CPU device the device and host tiers would be the same memory, so there is one memory
tier, reported as "device", governed by `device_budget_bytes`; `host_budget_bytes` is
ignored. `host_tier=True` keeps a separate host tier anyway (entries move between the two by
reference, never copied): a two-level LRU, used by the tests to exercise demotion.

The disk tier touches only its own files, in a private folder it marked; the file format,
its checks and the folder rules are in `promptlang.runtime.kvfiles`. A file of ours that
fails a check is reported with `CacheWarning`, counted in `stats.corrupt_files`, deleted and
treated as a miss, so the caller re-encodes; a file at one of our names without our tag is
counted and missed the same way but kept and never overwritten. A file that
`promptlang.home.untrusted_reason` refuses (another user's, or writable by others) is never
loaded: it is a miss, counted in `stats.untrusted_files`, and the put that follows replaces
it. Warnings about untrusted and foreign files come once per reason per process. Nothing
that failed is ever served.

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

import itertools
import os
import re
import stat
import threading
import time
import warnings
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

import torch

from promptlang.errors import CacheError
from promptlang.home import kv_dir
from promptlang.runtime.kv import ModuleKV
from promptlang.runtime.kvfiles import (FLOAT_DTYPES, MARKER, SUFFIX, CorruptFileError,
                                        UntrustedFileError, check_kv, clear_disk, dtype_name,
                                        existing_file, is_regular, list_disk_entries, listdir,
                                        open_dir, peek_header, read_file, touch, unlink_ours,
                                        unlink_same, write_file)

__all__ = ["CacheWarning", "ModuleStore", "StoreEntry", "StoreStats", "TIERS", "MARKER",
           "clear_disk", "list_disk_entries"]

TIERS = ("device", "host", "disk")

_KEY_RE = re.compile(r"[0-9A-Za-z_-]{1,128}\Z")
_TOUCH_EVERY_NS = 60 * 10**9  # persist a memory hit to the file's mtime at most once a minute

_warned: set[str] = set()   # reasons already reported by `_warn_once` in this process
_warned_lock = threading.Lock()


class CacheWarning(UserWarning):
    """Something in the KV store was wrong but recoverable: a corrupt file, a failed write."""


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
            if value is not None and value not in FLOAT_DTYPES:
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
        self._stored = dtype_name(dtype) if dtype is not None else "put"  # part of file names
        if disk_budget_bytes != 0:
            self.disk_dir = Path(disk_dir) if disk_dir is not None else kv_dir()
            open_dir(self.disk_dir)
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
        return self.disk_dir is not None and is_regular(self._path(key))

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
        check_kv(kv)
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
                removed |= unlink_ours(self._path(key))
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
                kv, meta, put_dtype, nbytes_read = read_file(path, key, self._stored)
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
                due = self._due_touch(key)
            if due:
                touch(path)
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
            existing = existing_file(path, key, self._stored)
            if existing == "current":
                with self._lock:
                    due = self._due_touch(key)
                if due:
                    touch(path)
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
                written = write_file(path, key, kv, entry.meta, entry.put_dtype, self._stored)
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
            last_use = {name: max((info.st_mtime_ns, -1),
                                  self._used.get(self._key_of(name), (0, -1)))
                        for name, info in files.items() if name != keep}
            order = sorted((used, name) for name, used in last_use.items())
        for _, name in order:
            if total <= self._disk_budget:
                break
            key = self._key_of(name)
            with self._key_lock(key or name):
                if unlink_same(self.disk_dir / name, files[name]):
                    total -= files[name].st_size
                    with self._lock:
                        self._stats.disk_evictions += 1
                        self._used.pop(key, None)
                        self._touched.pop(key, None)

    def _scan_disk(self) -> dict[str, os.stat_result]:
        """File name -> lstat of every KV file of ours in the folder now. A file's header is
        read once per (inode, size, mtime), not on every scan."""
        known, seen, ours = self._scanned, {}, {}
        for entry in listdir(self.disk_dir):
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
                hit = (identity, peek_header(Path(entry.path), info) is not None)
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


def _fits(budget: int | None, nbytes: int) -> bool:
    return budget is None or nbytes <= budget


def _warn_once(reason: str, message: str, stacklevel: int = 4) -> None:
    """A CacheWarning, the first time `reason` comes up in this process."""
    with _warned_lock:
        if reason in _warned:
            return
        _warned.add(reason)
    warnings.warn(message, CacheWarning, stacklevel=stacklevel)
