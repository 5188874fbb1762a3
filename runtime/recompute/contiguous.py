"""`exact` at contiguous positions: a request's tokens numbered without the schema's gaps.

A schema lays each module and parameter out at fixed positions (docs/DESIGN.md), so a
request that leaves a module out, or gives an argument shorter than its parameter's bound,
has gaps in its positions. The plain prompt a user compares with has none: its full prefill
puts token i at position i. Under `exact` a request equals that prefill: every token from
the first gap on (the *opening* ends there) is numbered by its rank among the request's
tokens, and every cached token at or after the opening is computed again at its new
number -- a stored unit's KV is valid only at the positions it was encoded at. The tokens
of the opening keep their numbers, so its units (the schema's leading text, the first
modules) are served as stored, as before.

Exact reuse (exact.py) keeps working across gaps: the units a renumbered request computes
are stored under keys made from the renumbered tokens, so a later request with the same
tokens before a unit is served it at the same numbers. A request under another policy is
renumbered too when every unit it moves is served that way (it then equals the full
prefill); otherwise it keeps the layout's positions.

The engine (runtime/engine.py) renumbers the positions it computes at, the units it
assembles (`Renumbering.unit`: the recompute plan the assembler reads is renumbered with
them) and the request's end; candidates, plans and the exact entries' bookkeeping keep
naming tokens by their layout positions.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable

import torch

from promptlang.pml.binding import BoundPrompt
from promptlang.pml.layout import Segment
from promptlang.runtime.kv.unit import UnitKV


@dataclass(frozen=True)
class Renumbering:
    """Layout positions -> contiguous ones for one request with gaps."""

    opening: int                     # positions below this keep their number
    numbers: dict[int, int]          # each request position >= opening -> its rank
    end: int                         # the request's token count (its renumbered end)

    def map(self, position: int) -> int:
        return position if position < self.opening else self.numbers[position]

    def positions(self, positions: Iterable[int]) -> list[int]:
        return [self.map(p) for p in positions]

    def unit(self, kv: UnitKV) -> UnitKV:
        """`kv` (a unit as stored, at layout positions) with its positions renumbered; a
        token the request does not hold (a placeholder) gets -1. Only its tokens below the
        opening are ever served, and those keep their numbers: the rest are computed
        again, and renumbering them keeps their numbers apart from those of the exact
        entries served beside them."""
        mapped = [p if p < self.opening else self.numbers.get(p, -1)
                  for p in kv.positions.tolist()]
        positions = torch.tensor(mapped, dtype=torch.int64, device=kv.positions.device)
        return UnitKV(kv.keys, kv.values, positions, kv.token_ids, kv.placeholder)

    def segments(self, segments: list[tuple[Segment, str]]) -> list[tuple[Segment, str]]:
        """`segments` (BoundPrompt.segments()) at their new numbers: a segment's tokens are
        at consecutive positions in both numberings (a gap is only ever between segments)."""
        return [(seg if seg.start < self.opening or not seg.token_ids
                 else replace(seg, start=self.numbers[seg.start]), origin)
                for seg, origin in segments]


def renumbering(bound: BoundPrompt) -> Renumbering | None:
    """The request's renumbering, or None where its positions have no gap."""
    positions = [p for _, p, _ in bound.sequence()]
    opening = next((i for i, p in enumerate(positions) if p != i), None)
    if opening is None:
        return None
    numbers = {p: i for i, p in enumerate(positions) if i >= opening}
    return Renumbering(opening, numbers, len(positions))


def moved(bound: BoundPrompt, numbers: Renumbering) -> dict[str, list[int]]:
    """Per unit, the layout positions of its cached tokens at or after the opening: what a
    renumbered request computes again unless an exact entry serves the unit."""
    found: dict[str, list[int]] = {}
    for _, position, origin in bound.sequence():
        if origin != "uncached" and position >= numbers.opening:
            found.setdefault(origin, []).append(position)
    return found


def merged(missed: dict[str, list[int]], more: dict[str, list[int]]) -> dict[str, list[int]]:
    """Each unit's positions in either, sorted."""
    units = {**missed, **more}
    return {unit: sorted({*missed.get(unit, ()), *more.get(unit, ())}) for unit in units}


def closed_tail(positions: list[int], last_cached: int) -> tuple[list[int], int]:
    """A fast request's computed tokens (`positions`, increasing) with those after its last
    cached token (at `last_cached`) moved down, keeping their order, so the first sits
    right after it; the tokens before it keep theirs. Returns the new positions and how far
    the moved ones went (0: no gap before them).

    Under `tuned` the question and the answer are computed right after the last module the
    request imports, as in the plain prompt, not after the positions of the modules it
    leaves out: the cached modules keep their layout positions (their KV is valid only
    there), the computed tokens are free to take any."""
    after = [p for p in positions if p > last_cached]
    if not after:
        return list(positions), 0
    shift = after[0] - (last_cached + 1)
    return [p - shift if p > last_cached else p for p in positions], shift
