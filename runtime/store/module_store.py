"""`ModuleStore`: the tiers composed into one key -> UnitKV store.

get:  memory tiers (device, then host, promoted to device) -> the disk tier (read, verified,
      placed in memory) -> a miss.
put:  the fastest memory tier that can hold it (policy.place demotes what no longer fits),
      and written through to disk, then the disk budget is enforced.

One lock guards the memory tiers and every counter; disk reads, writes and deletes of one
key are serialised by the disk tier's per-key lock, and a thread that waited on it looks in
memory again first, so concurrent gets of one key load its file once. The store never mutates
a tensor it holds or returned; `put` keeps the tensors it is given (when no dtype or device
conversion is needed), so callers must not mutate them afterwards either.
"""

from __future__ import annotations

import os
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Mapping

import torch

from promptlang.errors import CacheError, InvalidArgumentError
from promptlang.home import kv_dir
from promptlang.runtime.kv.unit import UnitKV
from promptlang.runtime.store.disk import DiskCounters, DiskTier
from promptlang.runtime.store.key import check_key
from promptlang.runtime.store.kvfile import FLOAT_DTYPES, check_kv, dtype_name
from promptlang.runtime.store.memory import DeviceTier, HostTier, MemoryTier, tensors
from promptlang.runtime.store.eviction import place
from promptlang.runtime.store.tier import Entry

TIERS = ("device", "host", "disk")


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


class ModuleStore:
    """Key -> UnitKV, in device, host and disk tiers with byte budgets and LRU eviction.

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
                raise CacheError(f"ModuleStore: device {self.device} requested but CUDA is not "
                                 f"available")
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
        for name, value in (("device_budget_bytes", device_budget_bytes),
                            ("host_budget_bytes", host_budget_bytes),
                            ("disk_budget_bytes", disk_budget_bytes)):
            if value is not None and (not isinstance(value, int) or value < 0):
                raise InvalidArgumentError(f"ModuleStore: {name} must be None or a byte count "
                                           f">= 0, got {value!r}")
        for name, value in (("dtype", dtype), ("compute_dtype", compute_dtype)):
            if value is not None and value not in FLOAT_DTYPES:
                raise InvalidArgumentError(f"ModuleStore: {name} must be a float dtype, "
                                           f"got {value!r}")
        self.dtype = dtype
        self.compute_dtype = compute_dtype
        self._cuda = self.device.type == "cuda"
        if host_tier is None:
            host_tier = self.device.type != "cpu"
        self._lock = threading.Lock()
        self._device = DeviceTier(device_budget_bytes, self.device)
        self._host = HostTier(host_budget_bytes if host_tier else 0, self.device)
        self._memory: tuple[MemoryTier, ...] = (self._device, self._host)  # fastest first
        self._disk_budget = disk_budget_bytes
        self.disk_dir: Path | None = None
        self._disk: DiskTier | None = None
        if disk_budget_bytes != 0:
            self.disk_dir = Path(disk_dir) if disk_dir is not None else kv_dir()
            stored = dtype_name(dtype) if dtype is not None else "put"  # part of file names
            self._disk = DiskTier(self.disk_dir, disk_budget_bytes, stored, self._lock)
        self._misses = self._puts = self._prefetches = 0

    def __repr__(self) -> str:
        return (f"ModuleStore(device={str(self.device)!r}, "
                f"device_budget_bytes={self._device.budget}, "
                f"host_budget_bytes={self._host.budget}, disk_dir={self.disk_dir}, "
                f"disk_budget_bytes={self._disk_budget}, dtype={self.dtype})")

    # ---- public API -------------------------------------------------------------------------

    @property
    def stats(self) -> StoreStats:
        """A snapshot of the counters."""
        with self._lock:
            disk = self._disk.counts if self._disk is not None else DiskCounters()
            return StoreStats(
                device_hits=self._device.hits, host_hits=self._host.hits, disk_hits=disk.hits,
                misses=self._misses, puts=self._puts, device_evictions=self._device.evictions,
                host_evictions=self._host.evictions, disk_evictions=disk.evictions,
                disk_loads=disk.loads, disk_bytes_read=disk.bytes_read, disk_writes=disk.writes,
                disk_bytes_written=disk.bytes_written, disk_write_errors=disk.write_errors,
                corrupt_files=disk.corrupt_files, untrusted_files=disk.untrusted_files,
                prefetches=self._prefetches, device_bytes=self._device.used,
                host_bytes=self._host.used)

    def contains(self, key: str) -> bool:
        """Whether any tier has `key` (a disk file counts without being verified)."""
        check_key(key)
        with self._lock:
            if any(tier.contains(key) for tier in self._memory):
                return True
        return self._disk is not None and self._disk.contains(key)

    def __contains__(self, key: str) -> bool:
        return self.contains(key)

    def get(self, key: str) -> UnitKV | None:
        """The unit's KV on `self.device`, or None (miss, or a corrupt file was discarded)."""
        return self.lookup(key)[0]

    def lookup(self, key: str) -> tuple[UnitKV | None, str | None]:
        """As `get`, with the tier that served it: "device", "host" or "disk" (None on a
        miss)."""
        check_key(key)
        with self._lock:
            tier = "device" if self._device.contains(key) else "host"
            entry = self._lookup_memory(key, count=True)
        if entry is None and self._disk is not None:
            entry, loaded = self._load_through(key, count=True)
            tier = "disk" if loaded else "device"     # else another thread had just loaded it
        if entry is None:
            with self._lock:
                self._misses += 1
            return None, None
        return self._for_caller(entry), tier

    def memory_bytes(self, key: str) -> int:
        """The bytes the device or host tier holds of `key`; 0 if neither does (no disk
        lookup, no counters, no change to recency)."""
        check_key(key)
        with self._lock:
            for tier in self._memory:
                entry = tier.entries.get(key)
                if entry is not None:
                    return entry.nbytes
        return 0

    @property
    def memory_budget_bytes(self) -> int | None:
        """The device and host tiers' budgets together; None when one is unlimited."""
        budgets = [tier.budget for tier in self._memory if tier.budget != 0]
        return None if any(b is None for b in budgets) else sum(budgets)

    def put(self, key: str, kv: UnitKV, meta: Mapping[str, str] | None = None) -> None:
        """Store `kv` under `key` in the device tier and write it through to disk.

        `meta` (str -> str; values are passed through str()) is kept for `entries()` and the
        file header. A key already on disk is not rewritten: a key names its content.
        """
        check_key(key)
        check_kv(kv)
        meta = {str(k): str(v) for k, v in (meta or {}).items()}
        put_dtype = kv.keys.dtype
        stored = _convert(kv, self.dtype, self.device)
        entry = Entry(stored, meta, stored.nbytes, put_dtype)
        with self._lock:
            self._puts += 1
            place(self._memory, key, entry)
            self._note_use(key)
        if self._disk is not None and self._disk.fits(entry.nbytes):
            self._disk.write(key, entry)
            self._disk.trim(protect=key)

    def prefetch(self, keys: Iterable[str]) -> int:
        """Bring host and disk entries up to the device tier (e.g. a union's other members).

        Disk reads happen in this call (run it on a worker thread to overlap them); on CUDA
        the host->device copies are asynchronous and `get` orders the caller's stream after
        them. Returns how many of `keys` are now in memory.
        """
        resident = 0
        for key in keys:
            check_key(key)
            with self._lock:
                in_host = self._host.contains(key)
                entry = self._lookup_memory(key, count=False)
                self._prefetches += entry is not None and in_host
            if entry is None and self._disk is not None:
                _, loaded = self._load_through(key, count=False)
                with self._lock:
                    self._prefetches += loaded
            with self._lock:
                resident += any(tier.contains(key) for tier in self._memory)
        return resident

    def evict(self, key: str, tiers: Iterable[str] | None = None) -> bool:
        """Drop `key` from `tiers` (default: all, disk included). True if anything was removed."""
        check_key(key)
        tiers = _check_tiers(tiers)
        removed = False
        with self._lock:
            for tier in self._memory:
                if tier.name in tiers and tier.evict(key):
                    removed = True
        if "disk" in tiers and self._disk is not None:
            removed |= self._disk.evict(key)
        return removed

    def clear(self, tiers: Iterable[str] | None = None) -> int:
        """Empty `tiers` (default: all, disk included). Returns the number of entries removed."""
        tiers = _check_tiers(tiers)
        removed = 0
        with self._lock:
            for tier in self._memory:
                if tier.name in tiers:
                    removed += tier.clear()
        if "disk" in tiers and self._disk is not None:
            removed += self._disk.clear()
        return removed

    def entries(self) -> list[StoreEntry]:
        """Every key in every tier, disk files written by other processes included, by key."""
        with self._lock:
            memory = {key: (tier.name, listed)
                      for tier in reversed(self._memory) for key, listed in tier.listing().items()}
        disk = self._disk.listing() if self._disk is not None else {}
        result = []
        for key in sorted(memory.keys() | disk.keys()):
            tiers = []
            nbytes = 0
            meta = {}
            file_bytes = None
            if key in memory:
                tiers.append(memory[key][0])
                nbytes = memory[key][1].nbytes
                meta = memory[key][1].meta
            if key in disk:
                tiers.append("disk")
                file_bytes = disk[key].file_bytes
                if key not in memory:
                    nbytes = disk[key].nbytes
                    meta = disk[key].meta
            result.append(StoreEntry(key, tuple(tiers), nbytes, meta, file_bytes))
        return result

    # ---- memory (call with self._lock held) -------------------------------------------------

    def _lookup_memory(self, key: str, count: bool) -> Entry | None:
        """The entry on the device if `key` is in memory; a host entry is promoted."""
        entry = self._device.get(key)
        if entry is not None:
            self._device.hits += count
        else:
            entry = self._host.get(key)
            if entry is None:
                return None
            self._host.hits += count
            # too big for the device tier: stays in host (now MRU), served through a copy
            entry = self._device.admit(place(self._memory, key, entry))
        self._note_use(key)
        return entry

    def _note_use(self, key: str) -> None:
        if self._disk is not None:
            self._disk.note_use(key)

    # ---- disk -------------------------------------------------------------------------------

    def _load_through(self, key: str, count: bool) -> tuple[Entry | None, bool]:
        """(entry, loaded from disk): loads `key` once however many threads ask at one time."""
        disk = self._disk
        with disk.key_lock(key):
            with self._lock:  # another thread may have loaded it while this one waited
                entry = self._lookup_memory(key, count=count)
            if entry is not None:
                return entry, False
            loaded = disk.read(key)
            if loaded is None:
                return None, False
            kv, meta, put_dtype, nbytes_read = loaded
            stored = _convert(kv, self.dtype, torch.device("cpu"))
            entry = Entry(stored, meta, stored.nbytes, put_dtype)
            with self._lock:
                # placed where it fits; if nowhere, served once from what was read
                entry = self._device.admit(place(self._memory, key, entry) or entry)
                due = disk.note_load(key, nbytes_read, hit=count)
            if due:
                disk.refresh(key)
            return entry, True

    # ---- returning entries ------------------------------------------------------------------

    def _for_caller(self, entry: Entry) -> UnitKV:
        """The entry's KV for the calling thread: its stream ordered after pending copies,
        keys and values in the compute dtype."""
        kv = entry.kv
        if self._cuda and entry.ready is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(entry.ready)
            for t in tensors(kv):
                t.record_stream(stream)
        target = self.compute_dtype or entry.put_dtype
        if kv.keys.dtype != target:
            kv = UnitKV(kv.keys.to(target), kv.values.to(target), kv.positions, kv.token_ids,
                          kv.placeholder)
        return kv


def _check_tiers(tiers: Iterable[str] | None) -> set[str]:
    if tiers is None:
        return set(TIERS)
    tiers = {tiers} if isinstance(tiers, str) else set(tiers)
    unknown = tiers - set(TIERS)
    if unknown:
        raise InvalidArgumentError(f"unknown tier(s) {sorted(unknown)}; tiers are {TIERS}")
    return tiers


def _convert(kv: UnitKV, dtype: torch.dtype | None, device: torch.device) -> UnitKV:
    """`kv` with keys/values at `dtype` on `device`; the same tensors where nothing changes."""
    keys = kv.keys.detach()
    values = kv.values.detach()
    if dtype is not None and keys.dtype != dtype:
        keys = keys.to(dtype)
        values = values.to(dtype)
    out = UnitKV(keys, values, kv.positions.detach(), kv.token_ids.detach(),
                 kv.placeholder.detach())
    if any(t.device != device for t in tensors(out)):
        out = out.to(device)
    return out
