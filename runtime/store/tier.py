"""What a tier of the module store is, and the entry it holds.

`ModuleStore` (module_store.py) composes two kinds of tier, both `Tier`s:

    MemoryTier   holds an entry's tensors (memory.py: device, host). The memory tiers form
                 one exclusive chain, fastest first: an entry lives in at most one of them and
                 moves down the chain when it is evicted (policy.place). Their methods are
                 called with the store's lock held and do no I/O.
    BackingTier  holds a copy, written through on put and read back on a miss, that outlives
                 the memory tiers (disk.py; a remote or object-store tier would be another).
                 Called without the store's lock; does its own I/O and per-key locking.

A new tier implements one of them; the budget and eviction rules it follows are in policy.py.
"""

from __future__ import annotations

import threading
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from promptlang.runtime.kv.unit import UnitKV
from promptlang.runtime.store.eviction import fits

_warned: set[str] = set()   # reasons already reported by `warn_once` in this process
_warned_lock = threading.Lock()


class CacheWarning(UserWarning):
    """Something in the KV store was wrong but recoverable: a corrupt file, a failed write."""


def warn_once(reason: str, message: str, stacklevel: int = 4) -> None:
    """A CacheWarning, the first time `reason` comes up in this process."""
    with _warned_lock:
        if reason in _warned:
            return
        _warned.add(reason)
    warnings.warn(message, CacheWarning, stacklevel=stacklevel)


@dataclass
class Entry:
    """One unit's KV as a tier holds it (keys and values in the store dtype)."""

    kv: UnitKV
    meta: dict[str, str]
    nbytes: int                      # stored tensor bytes: what budgets count
    put_dtype: torch.dtype           # dtype of the keys/values `put` was given
    ready: object = None             # CUDA event the tensors' last copy recorded, or None

    def cpu_kv(self) -> UnitKV:
        """The KV on the CPU, once any pending copy that filled it has run."""
        kv = self.kv
        if kv.keys.device.type != "cpu":
            if self.ready is not None:
                torch.cuda.current_stream(kv.keys.device).wait_event(self.ready)
            kv = kv.to("cpu")
        return kv


@dataclass(frozen=True)
class Listed:
    """What a tier's listing says of one key."""

    nbytes: int
    meta: dict[str, str]
    file_bytes: int | None = None    # size of its file, for tiers that keep files


class Tier(ABC):
    """A place that holds entries by key under a byte budget (None = unlimited, 0 = off)."""

    name: str
    budget: int | None

    def fits(self, nbytes: int) -> bool:
        """Whether an entry of `nbytes` can be held at all (it is not over the whole budget)."""
        return fits(self.budget, nbytes)

    @abstractmethod
    def contains(self, key: str) -> bool:
        """Whether the tier holds `key` (unverified for a backing tier)."""

    @abstractmethod
    def evict(self, key: str) -> bool:
        """Drop `key`; True if something was removed."""

    @abstractmethod
    def clear(self) -> int:
        """Drop everything; returns the number of entries removed."""

    @abstractmethod
    def listing(self) -> dict[str, Listed]:
        """Every key the tier holds now."""


class BackingTier(Tier):
    """A tier that keeps a copy of what is put (write-through) and serves misses from it."""

    @abstractmethod
    def key_lock(self, key: str) -> threading.Lock:
        """The lock that serialises this tier's reads, writes and deletes of `key`."""

    @abstractmethod
    def read(self, key: str) -> tuple[UnitKV, dict[str, str], torch.dtype, int] | None:
        """(kv on the CPU, meta, put dtype, bytes read), or None: absent, or refused or
        failed a check (reported and counted by the tier). Call with `key_lock(key)` held."""

    @abstractmethod
    def write(self, key: str, entry: Entry) -> None:
        """Keep a copy of `entry` unless one is there already (a key names its content)."""

    @abstractmethod
    def trim(self, protect: str) -> None:
        """Evict least-recently-used entries, never `protect`, until within the budget."""

    @abstractmethod
    def note_use(self, key: str) -> None:
        """`key` was served from memory or put (store lock held): it counts as recently used."""

    @abstractmethod
    def note_load(self, key: str, nbytes_read: int, hit: bool) -> bool:
        """Count a `read` that was served (store lock held); True if the caller should
        `refresh(key)` after releasing the lock."""

    @abstractmethod
    def refresh(self, key: str) -> None:
        """Record `key`'s use where it survives the process (e.g. a file's mtime)."""
