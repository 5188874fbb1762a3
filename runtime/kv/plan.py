"""A request's recompute plan: which cached tokens it computes again, as uncached tokens.

The language's `BoundPrompt` says what a request serves from the store (`units`) and what
it computes (`uncached`); the runtime's `RecomputePlan` moves some cached tokens from the
first to the second for one request. The engine builds it from a policy's choice
(choose.py) and applies it in two places:

- `plan.uncached(bound)`: the bound prompt's uncached segments plus one "recompute"
  segment per chosen token, position order -- the list the prefill computes;
- `Assembler.assemble(..., plan)`: the chosen tokens' stored copies stay out of the
  request's buffer (runtime/kv/assembler.py).

A recomputed token attends to every request token at a position <= its own, like any
uncached token; the cached tokens after it keep the KV they were encoded with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from promptlang.errors import InvalidArgumentError
from promptlang.pml.layout import Segment


@dataclass(frozen=True)
class RecomputePlan:
    positions: frozenset[int] = frozenset()     # cached tokens' positions computed again
    segments: tuple[Segment, ...] = ()          # one "recompute" segment each, position order

    @classmethod
    def of(cls, bound, positions: Iterable[int]) -> "RecomputePlan":
        """The plan recomputing the cached tokens of `bound` (a BoundPrompt) at `positions`."""
        chosen = frozenset(positions)
        if not chosen:
            return cls()
        cached = {p: t for t, p, origin in bound.sequence() if origin != "uncached"}
        missing = sorted(p for p in chosen if p not in cached)
        if missing:
            raise InvalidArgumentError(f"position {missing[0]} holds no cached token of this "
                                       "request")
        return cls(chosen, tuple(Segment((cached[p],), p, "recompute") for p in sorted(chosen)))

    def uncached(self, bound) -> tuple[Segment, ...]:
        """What the request computes: `bound.uncached` and the recomputed tokens, by start."""
        if not self.segments:
            return bound.uncached
        return tuple(sorted(bound.uncached + self.segments, key=lambda s: s.start))

    def __len__(self) -> int:
        return len(self.positions)


NO_RECOMPUTE = RecomputePlan()
