"""The disk tier: one KV file per key and store dtype in a private folder; survives restarts.

put -> `write` (once per key: a key names its content) -> `trim` to the disk budget;
miss in memory -> `read` (verified) -> the store places it in memory -> `note_load`.

The file format and its checks are in kvfile.py, the folder rules in folder.py. A file of
ours that fails a check is reported with `CacheWarning`, counted in `corrupt_files`, deleted
and treated as a miss, so the caller re-encodes; a file at one of our names without our tag
is counted and missed the same way but kept and never overwritten -- unless it is what a
crash left of ours (empty, zero-filled, or cut short inside its header:
`kvfile.crash_leftover`), which is deleted and replaced like a corrupt file. Writes are
durable (home.write_private: fsync, rename, fsync the folder); temporary files a dead
writer left over an hour ago are deleted when a store opens the folder. A file that
`promptlang.home.untrusted_reason` refuses (another user's, or writable by others) is never
loaded: it is a miss, counted in `untrusted_files`, and the put that follows replaces it.
Warnings about untrusted and foreign files come once per reason per process.

The budget is enforced after each put by scanning the folder (files other processes wrote
count too); hits refresh a file's mtime at most once a minute, so the LRU order survives
restarts (policy.oldest_first). Reads, writes and deletes of one key are serialised by a
striped per-key lock; counters and last-use records are guarded by the store's lock.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from promptlang.errors import CorruptFileError, UntrustedFileError
from promptlang.runtime.kv.unit import UnitKV
from promptlang.runtime.store.eviction import oldest_first, trim_to_budget
from promptlang.runtime.store.folder import (clear_disk, is_regular, list_disk_entries,
                                             listdir, open_dir, regular_stat,
                                             remove_stale_temporaries, touch, unlink_ours,
                                             unlink_same)
from promptlang.runtime.store.key import SUFFIX, file_name, key_of_file
from promptlang.runtime.store.kvfile import existing_file, peek_header, read_file, write_file
from promptlang.runtime.store.tier import BackingTier, CacheWarning, Entry, Listed, warn_once

_TOUCH_EVERY_NS = 60 * 10**9  # persist a memory hit to the file's mtime at most once a minute


@dataclass
class DiskCounters:
    """The disk tier's share of `StoreStats` (its `disk_*`, corrupt and untrusted counts)."""

    hits: int = 0
    evictions: int = 0
    loads: int = 0               # files read and verified (gets and prefetches)
    bytes_read: int = 0
    writes: int = 0
    bytes_written: int = 0
    write_errors: int = 0
    corrupt_files: int = 0
    untrusted_files: int = 0     # files untrusted_reason refused (not ours, or writable)


class DiskTier(BackingTier):
    """KV files `<key>.<stored>.safetensors` in `directory` (created 0700 and marked).

    stored: the store dtype's name, or "put"; stores of different dtypes sharing a folder
        never serve each other's KV.
    lock: the store's lock, which guards this tier's counters and last-use records too.
    """

    name = "disk"

    def __init__(self, directory: Path, budget: int | None, stored: str, lock: threading.Lock):
        self.directory = directory
        self.budget = budget
        self.stored = stored
        open_dir(directory)
        remove_stale_temporaries(directory)
        self._lock = lock
        self._key_locks = [threading.Lock() for _ in range(64)]
        self.counts = DiskCounters()
        self._used: dict[str, tuple[int, int]] = {}     # key -> (last use ns, sequence): disk LRU
        self._touched: dict[str, int] = {}               # key -> ns the file's mtime was last set
        self._scanned: dict[str, tuple[tuple[int, int, int], bool]] = {}  # name -> (identity, ours)
        self._seq = itertools.count()

    def path(self, key: str) -> Path:
        return self.directory / file_name(key, self.stored)

    def key_lock(self, key: str) -> threading.Lock:
        return self._key_locks[hash(key) % len(self._key_locks)]

    # ---- the Tier interface --------------------------------------------------------------------

    def contains(self, key: str) -> bool:
        return is_regular(self.path(key))

    def evict(self, key: str) -> bool:
        with self.key_lock(key):
            removed = unlink_ours(self.path(key))
        with self._lock:
            self._used.pop(key, None)
            self._touched.pop(key, None)
        return removed

    def clear(self) -> int:
        removed = clear_disk(self.directory)
        with self._lock:
            self._used.clear()
            self._touched.clear()
        return removed

    def listing(self) -> dict[str, Listed]:
        """Every readable file of ours, other processes' and other store dtypes' included."""
        return {d["key"]: Listed(d["nbytes"], d["meta"], d["file_bytes"])
                for d in list_disk_entries(self.directory) if d["error"] is None}

    # ---- reading -------------------------------------------------------------------------------

    def read(self, key: str) -> tuple[UnitKV, dict[str, str], torch.dtype, int] | None:
        path = self.path(key)
        try:
            return read_file(path, key, self.stored)
        except FileNotFoundError:
            return None
        except UntrustedFileError as err:
            warn_once(str(err), f"promptlang: not loading KV cache file {path}: {err}; "
                      "its unit is encoded again (other files refused for this reason "
                      "are not reported)", stacklevel=5)
            with self._lock:
                self.counts.untrusted_files += 1
            return None
        except CorruptFileError as err:
            self._discard_corrupt(path, err)
            return None
        except OSError as err:
            warnings.warn(f"promptlang: cannot read KV cache file {path}: {err}", CacheWarning,
                          stacklevel=4)
            return None

    def note_use(self, key: str) -> None:
        self._used[key] = (time.time_ns(), next(self._seq))

    def note_load(self, key: str, nbytes_read: int, hit: bool) -> bool:
        self.counts.loads += 1
        self.counts.bytes_read += nbytes_read
        if hit:
            self.counts.hits += 1
        self.note_use(key)
        return self._due_touch(key)

    def refresh(self, key: str) -> None:
        touch(self.path(key))

    def _due_touch(self, key: str) -> bool:
        now = time.time_ns()
        if now - self._touched.get(key, 0) < _TOUCH_EVERY_NS:
            return False
        self._touched[key] = now
        return True

    def _discard_corrupt(self, path: Path, err: CorruptFileError) -> None:
        if not err.ours:
            warn_once(f"foreign: {err}", f"promptlang: ignored KV cache file {path}: {err}; "
                      "promptlang did not write it, so it is left as it is (other such files "
                      "are not reported)", stacklevel=6)
        else:
            warnings.warn(f"promptlang: discarded corrupt KV cache file {path}: {err}",
                          CacheWarning, stacklevel=5)
            try:  # delete only the file that was read, not one another process replaced it with
                st = os.lstat(path)
                if (st.st_ino, st.st_mtime_ns) == err.identity:
                    path.unlink()
            except FileNotFoundError:
                pass
        with self._lock:
            self.counts.corrupt_files += 1
            self._used.pop(key_of_file(path.name, self.stored), None)

    # ---- writing and the budget ----------------------------------------------------------------

    def write(self, key: str, entry: Entry) -> None:
        path = self.path(key)
        with self.key_lock(key):
            existing = existing_file(path, key, self.stored)
            if existing == "current":
                with self._lock:
                    due = self._due_touch(key)
                if due:
                    touch(path)
                return
            if existing == "foreign":
                warn_once("foreign file in the way",
                          f"promptlang: not writing KV cache file {path}: a file promptlang did "
                          "not write is in the way and is left as it is (other such files are "
                          "not reported)")
                with self._lock:
                    self.counts.write_errors += 1
                return
            try:
                written = write_file(path, key, entry.cpu_kv(), entry.meta, entry.put_dtype,
                                     self.stored)
            except OSError as err:
                warnings.warn(f"promptlang: cannot write KV cache file {path}: {err}", CacheWarning,
                              stacklevel=3)
                with self._lock:
                    self.counts.write_errors += 1
                return
        with self._lock:
            self.counts.writes += 1
            self.counts.bytes_written += written
            self._touched[key] = time.time_ns()

    def trim(self, protect: str) -> None:
        """Delete least-recently-used files of ours until the folder fits the budget.

        Scans the folder, so files other processes wrote count too (ours by their header,
        whatever their store dtype or format version). Other files are neither counted nor
        touched.
        """
        if self.budget is None:
            return
        files = self._scan()
        keep = self.path(protect).name
        with self._lock:
            total = sum(info.st_size for info in files.values())
            if total <= self.budget:
                return
            order = oldest_first(
                {name: info for name, info in files.items() if name != keep},
                lambda name: self._used.get(key_of_file(name, self.stored), (0, -1)))

        def remove(name: str) -> int:
            key = key_of_file(name, self.stored)
            with self.key_lock(key or name):
                if not unlink_same(self.directory / name, files[name]):
                    return 0
                with self._lock:
                    self.counts.evictions += 1
                    self._used.pop(key, None)
                    self._touched.pop(key, None)
            return files[name].st_size

        trim_to_budget(total, self.budget, order, remove)

    def _scan(self) -> dict[str, os.stat_result]:
        """File name -> lstat of every KV file of ours in the folder now. A file's header is
        read once per (inode, size, mtime), not on every scan."""
        known = self._scanned
        seen = {}
        ours = {}
        for entry in listdir(self.directory):
            if entry.name.startswith(".") or not entry.name.endswith(SUFFIX):
                continue
            info = regular_stat(entry)
            if info is None:
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
