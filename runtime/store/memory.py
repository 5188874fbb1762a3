"""The memory tiers: device (where the assembler reads KV) and host (CPU memory below it).

Each is an LRU of entries under a byte budget (an OrderedDict, least recently used first).
They differ only in `admit`, which brings an entry's tensors into the tier's memory:

    device  on CUDA, an asynchronous copy to the device on the tier's copy stream
    host    on CUDA, pinned CPU memory, copied asynchronously from the device

On a CPU device both admit entries by reference (no copy). Every method here is called with
the store's lock held; which tier an entry goes to is decided by policy.place.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from promptlang.runtime.kv.unit import UnitKV
from promptlang.runtime.store.eviction import fits
from promptlang.runtime.store.tier import Entry, Listed, Tier


class MemoryTier(Tier):
    """Entries held in memory, least recently used first, under a byte budget."""

    def __init__(self, name: str, budget: int | None):
        self.name = name
        self.budget = budget
        self.entries: OrderedDict[str, Entry] = OrderedDict()
        self.used = 0                # bytes held
        self.hits = 0
        self.evictions = 0           # entries pushed out past the budget

    def admit(self, entry: Entry) -> Entry:
        """`entry` with its tensors in this tier's memory."""
        return entry

    def get(self, key: str) -> Entry | None:
        """The entry of `key`, now the most recently used; None if not here."""
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
        return entry

    def add(self, key: str, entry: Entry) -> None:
        self.discard(key)
        self.entries[key] = entry
        self.used += entry.nbytes

    def discard(self, key: str) -> Entry | None:
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.used -= entry.nbytes
        return entry

    def over_budget(self) -> bool:
        return not fits(self.budget, self.used)

    def pop_lru(self) -> tuple[str, Entry]:
        key, entry = self.entries.popitem(last=False)
        self.used -= entry.nbytes
        return key, entry

    def contains(self, key: str) -> bool:
        return key in self.entries

    def evict(self, key: str) -> bool:
        return self.discard(key) is not None

    def clear(self) -> int:
        removed = len(self.entries)
        self.entries.clear()
        self.used = 0
        return removed

    def listing(self) -> dict[str, Listed]:
        return {key: Listed(e.nbytes, dict(e.meta)) for key, e in self.entries.items()}


class DeviceTier(MemoryTier):
    """Entries on the compute device, ready for the assembler."""

    def __init__(self, budget: int | None, device: torch.device):
        super().__init__("device", budget)
        self.device = device
        self._cuda = device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(device) if self._cuda else None

    def admit(self, entry: Entry) -> Entry:
        """The entry's tensors on the compute device (asynchronous copy on CUDA)."""
        if not self._cuda or entry.kv.keys.device == self.device:
            return entry
        with torch.cuda.stream(self._copy_stream):
            if entry.ready is not None:  # the device->host copy that filled these pinned tensors
                self._copy_stream.wait_event(entry.ready)
            kv = entry.kv.to(self.device, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self._copy_stream)
        return Entry(kv, entry.meta, entry.nbytes, entry.put_dtype, ready)


class HostTier(MemoryTier):
    """Entries in CPU memory below the device tier; pinned on CUDA."""

    def __init__(self, budget: int | None, device: torch.device):
        super().__init__("host", budget)
        self.device = device
        self._cuda = device.type == "cuda"

    def admit(self, entry: Entry) -> Entry:
        """The entry's tensors in pinned host memory (asynchronous copy on CUDA)."""
        if not self._cuda or entry.kv.keys.is_pinned():
            return entry
        if entry.kv.keys.device.type == "cpu":  # read from disk: pin it (a synchronous copy)
            return Entry(UnitKV(*(t.pin_memory() for t in tensors(entry.kv))), entry.meta,
                         entry.nbytes, entry.put_dtype)
        stream = torch.cuda.current_stream(self.device)
        if entry.ready is not None:
            stream.wait_event(entry.ready)
        parts = []
        for t in tensors(entry.kv):
            pinned = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
            pinned.copy_(t, non_blocking=True)
            t.record_stream(stream)  # t may come from the copy stream: keep it until this copy ran
            parts.append(pinned)
        ready = torch.cuda.Event()
        ready.record(stream)
        return Entry(UnitKV(*parts), entry.meta, entry.nbytes, entry.put_dtype, ready)


def tensors(kv: UnitKV) -> tuple[torch.Tensor, ...]:
    """Every tensor of `kv`, in UnitKV's field order."""
    return kv.keys, kv.values, kv.positions, kv.token_ids, kv.placeholder
