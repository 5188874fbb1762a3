"""The store's budget and eviction policy, in one place: least recently used goes first.

Every tier has a byte budget (None = unlimited, 0 = tier off); an entry larger than a tier's
whole budget skips that tier.

Memory tiers (`place`): an entry goes into the fastest tier of the chain that can hold it;
past a tier's budget its least-recently-used entries move down to the next tier, and fall off
the end of the chain (the backing tiers still have them).

Disk (`oldest_first`, `trim_to_budget`): past the budget, the files used longest ago are
deleted; a file's last use is the later of its mtime and this process's last use of its key.
"""

from __future__ import annotations

import os
from typing import Callable, Iterable, Mapping, Protocol, Sequence, TypeVar

E = TypeVar("E")  # an entry (tier.Entry); only its `nbytes` matters here


class ChainTier(Protocol[E]):
    """What `place` needs of a memory tier (memory.MemoryTier)."""

    evictions: int

    def fits(self, nbytes: int) -> bool: ...
    def admit(self, entry: E) -> E: ...
    def add(self, key: str, entry: E) -> None: ...
    def discard(self, key: str) -> E | None: ...
    def over_budget(self) -> bool: ...
    def pop_lru(self) -> tuple[str, E]: ...


def fits(budget: int | None, nbytes: int) -> bool:
    """Whether `nbytes` fits within `budget` at all."""
    return budget is None or nbytes <= budget


def place(chain: Sequence[ChainTier[E]], key: str, entry: E) -> E | None:
    """Insert `entry` under `key` into the first tier of `chain` (fastest first) that can hold
    it, demoting least-recently-used entries past budgets. Returns the entry as that tier
    holds it, or None if no tier takes it. Call with the store's lock held."""
    for tier in chain:
        tier.discard(key)
    return _settle(chain, 0, key, entry)


def _settle(chain: Sequence[ChainTier[E]], start: int, key: str, entry: E) -> E | None:
    for i in range(start, len(chain)):
        tier = chain[i]
        if not tier.fits(entry.nbytes):
            continue
        entry = tier.admit(entry)
        tier.add(key, entry)
        while tier.over_budget():
            old_key, old = tier.pop_lru()
            tier.evictions += 1
            _settle(chain, i + 1, old_key, old)
        return entry
    return None


def oldest_first(files: Mapping[str, os.stat_result],
                 used: Callable[[str], tuple[int, int]]) -> list[str]:
    """The names of `files`, used longest ago first. `used(name)` is this process's last use
    of the file's key as (ns, sequence), (0, -1) if none; the file's mtime counts too."""
    last_use = {name: max((info.st_mtime_ns, -1), used(name)) for name, info in files.items()}
    return [name for _, name in sorted((when, name) for name, when in last_use.items())]


def trim_to_budget(total: int, budget: int, order: Iterable[str],
                   remove: Callable[[str], int]) -> None:
    """Remove entries in `order` until `total` bytes fit `budget`; `remove(name)` returns the
    bytes it freed (0 if the entry could not be removed)."""
    for name in order:
        if total <= budget:
            break
        total -= remove(name)
