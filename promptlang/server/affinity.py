"""Module affinity: which replica should serve a request, by the stored units it needs.

A request for documents {3, 5, 7} is cheapest on the replica that already holds those
documents' KV in its faster tiers, whatever their order and whatever else the request
brings. `AffinityTable` keeps, per replica, the unit keys it holds (as it reports them) or
was recently sent (optimistic, until its next report), with their sizes, least recently
used first, and the replica's memory capacity when it reported one. `rank_replicas` turns
a request's unit keys (-> sizes) into ranks of replicas, most preferred first:

- load first: when the replicas' queue lengths differ by more than `imbalanced_threshold`,
  the least loaded replicas come first, whatever they hold (as Ray Serve LLM's prefix
  router falls back to power-of-two choices when load is imbalanced);
- else by cost: what the replica lacks of the request (to load from disk or encode) plus
  what placing it there would evict (what it lacks beyond its free capacity), the lowest
  first; ties go to the replica holding less in all, then to the shorter queue. So a
  request goes where most of it is held, and new modules go where there is room rather
  than evicting what another request will want;
- a match under `min_match` of the request (only a shared unit such as the schema's system
  text, say) counts as no match, so that it does not pull unrelated modules onto one
  replica (as Ray Serve LLM's prefix router ignores matches below its match-rate
  threshold).

Pure Python, no Ray: the Ray Serve router (router.py) wraps it; tests drive it directly.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Hashable, Mapping, Sequence

from promptlang.errors import InvalidArgumentError

DEFAULT_IMBALANCED_THRESHOLD = 4        # queued requests between busiest and idlest replica
DEFAULT_REPLICA_BYTES = 8 << 30         # unit bytes remembered per replica, at most
DEFAULT_MIN_MATCH = 0.1                 # share of a request's bytes a replica must hold


@dataclass
class AffinityTable:
    """Unit keys (-> bytes) per replica, least recently used first, at most `max_bytes`
    per replica (the oldest forgotten first). `clock`: seconds, for how recent a record is."""

    max_bytes: int = DEFAULT_REPLICA_BYTES
    clock: Callable[[], float] = time.monotonic
    _held: dict[Hashable, OrderedDict] = field(default_factory=dict)
    _sent: dict[Hashable, dict[str, float]] = field(default_factory=dict)   # key -> when
    _capacity: dict[Hashable, float] = field(default_factory=dict)
    _totals: dict[Hashable, int] = field(default_factory=dict)   # bytes held, per replica

    def __post_init__(self):
        if self.max_bytes <= 0:
            raise InvalidArgumentError("an affinity table needs max_bytes > 0")

    def observe(self, replica: Hashable, held: Mapping[str, int], grace: float = 0.0,
                capacity: float | None = None) -> None:
        """What `replica` reports it holds, least recently used first (and its memory
        capacity in the same units; None: unlimited or unknown): replaces what the table
        believed of it, except keys recorded in the last `grace` seconds (a report may
        have been taken before the replica saw them)."""
        now = self.clock()
        recent = {key: when for key, when in self._sent.get(replica, {}).items()
                  if now - when <= grace}
        kept = {key: size for key, size in self._held.get(replica, {}).items()
                if key in recent and key not in held}
        self._held[replica] = OrderedDict()
        self._totals[replica] = 0
        self._sent[replica] = recent
        if capacity is None:
            self._capacity.pop(replica, None)
        else:
            self._capacity[replica] = float(capacity)
        self._put(replica, held)
        self._put(replica, kept)

    def free(self, replica: Hashable) -> float:
        """Room left in `replica`'s memory (inf when its capacity is not known)."""
        capacity = self._capacity.get(replica)
        return float("inf") if capacity is None else max(0.0, capacity - self.held_bytes(replica))

    def record(self, replica: Hashable, keys: Mapping[str, int]) -> None:
        """`replica` was sent a request needing `keys` (-> bytes): it will hold them."""
        now = self.clock()
        self._sent.setdefault(replica, {}).update((key, now) for key in keys)
        self._put(replica, keys)

    def _put(self, replica: Hashable, keys: Mapping[str, int]) -> None:
        table = self._held.setdefault(replica, OrderedDict())
        total = self._totals.get(replica, 0)
        for key, size in keys.items():
            total -= table.pop(key, 0)
            table[key] = size = max(0, int(size))
            total += size
        while table and total > self.max_bytes:
            total -= table.popitem(last=False)[1]
        self._totals[replica] = total

    def drop(self, replica: Hashable) -> None:
        """`replica` died or was removed: it holds nothing any more."""
        self._held.pop(replica, None)
        self._sent.pop(replica, None)
        self._capacity.pop(replica, None)
        self._totals.pop(replica, None)

    def keep_only(self, replicas: Sequence[Hashable]) -> None:
        """Forget every replica not in `replicas` (the current set)."""
        for gone in set(self._held) - set(replicas):
            self.drop(gone)

    def held_bytes(self, replica: Hashable, keys: Mapping[str, int] | None = None) -> int:
        """The bytes `replica` holds of `keys` (key -> bytes, as the request weighs them, so
        that every replica is measured alike), or in all if `keys` is None."""
        if keys is None:
            return self._totals.get(replica, 0)
        table = self._held.get(replica)
        if not table:
            return 0
        return sum(size for k, size in keys.items() if k in table)


def rank_replicas(keys: Mapping[str, int], replicas: Sequence[Hashable],
                  queue_lengths: Mapping[Hashable, int], table: AffinityTable,
                  imbalanced_threshold: float = DEFAULT_IMBALANCED_THRESHOLD,
                  min_match: float = DEFAULT_MIN_MATCH) -> list[list[Hashable]]:
    """Ranks of `replicas` for a request needing unit `keys` (-> sizes): the first rank
    holds the preferred replicas (see the module docstring); every replica appears once.
    A replica missing from `queue_lengths` counts as idle."""
    if not replicas:
        return []
    queued = {r: int(queue_lengths.get(r, 0)) for r in replicas}
    loads = list(queued.values())
    if max(loads) - min(loads) > imbalanced_threshold:
        least = min(loads)
        by_load = sorted(replicas, key=lambda r: queued[r])
        return _ranks([r for r in by_load if queued[r] == least],
                      [r for r in by_load if queued[r] != least])
    total = sum(keys.values())
    held = {r: table.held_bytes(r, keys) for r in replicas}
    if max(held.values()) < min_match * total:
        held = dict.fromkeys(replicas, 0)
    def rank(r: Hashable) -> tuple[float, int]:
        lacking = total - held[r]
        return lacking + max(0.0, lacking - table.free(r)), table.held_bytes(r)
    ranked = {r: rank(r) for r in replicas}
    best = min(ranked.values())
    first = sorted((r for r in replicas if ranked[r] == best), key=lambda r: queued[r])
    rest = sorted((r for r in replicas if ranked[r] != best),
                  key=lambda r: (ranked[r], queued[r]))
    return _ranks(first, rest)


def _ranks(first: list, rest: list) -> list[list]:
    return [first, rest] if rest else [first]
