"""Primed modules ("P+primed"): a module that follows others is served as encoded after a lead.

A module is encoded once, after its context (the schema's text before it, its ancestors),
at its own positions. When it is the first thing after that text, the full prefill
computes exactly that. When another module or per-request text comes between, the module
starts after a gap in what it saw: in the full prefill the position just before it holds
a token -- typically the separator the modules share ("\\n\\n", a closing tag, a role
marker) -- and the module's first tokens were encoded without one, so they act as a
fresh start (an extra attention sink; docs/RECOMPUTE.md).

A *primed* encoding gives the module that token back: its context units' last token
before the module (the *lead*) is repeated at the position just before the module's
first one, computed attending to the module's context, and the module's tokens attend to
it as to their context; the lead's own KV is dropped. Only the module's encoding ever
sees the lead -- the request's tokens do not. The primed encoding is a second store entry
(its key says so: encoder.py), made once; a request serves it where the module follows
something (`primed_units`) and the plain one where the module comes first, which is
exact there.

Nested modules: a unit's primed encoding attends to its context units as the request
serves them (primed or not), so a module inside a primed one sees the primed KV -- what
the oracle's one pass gives it (tests/runtime/oracle.py).
"""

from __future__ import annotations

from typing import Callable, Sequence

from promptlang.pml.binding import BoundPrompt
from promptlang.pml.layout import SchemaLayout


def lead(layout: SchemaLayout, unit_id: str,
         context_of: Callable[[str], Sequence[str]]) -> tuple[int, int] | None:
    """(token id, position) a primed encoding of the unit puts before it: its context
    units' token at the highest position below the unit's first, moved to the position
    just before the unit. None where the unit has no context token before it, or where
    that token already sits just before it (the unit always follows it: nothing to add)."""
    unit = layout.units[unit_id]
    starts = [seg.start for seg in unit.segments if seg.token_ids]
    if not starts:
        return None
    first = min(starts)
    best: tuple[int, int] | None = None              # (position, token id)
    for context_id in context_of(unit_id):
        for seg in layout.units[context_id].segments:
            if seg.token_ids and seg.start < first:
                at = min(seg.end, first) - 1
                if best is None or at > best[0]:
                    best = (at, seg.token_ids[at - seg.start])
    if best is None or best[0] == first - 1:
        return None
    return best[1], first - 1


def primed_units(bound: BoundPrompt, context_of: Callable[[str], Sequence[str]]) -> list[str]:
    """The units of `bound` a primed policy serves primed: those with a `lead` whose first
    token comes after a request token of another module or per-request text -- not their
    own, not their context's, not an argument's (an argument sits inside the text around
    it; what precedes the module there is the text). `context_of`: the units each one saw
    (exact.context_with's: a unit served exactly saw everything, and is never primed)."""
    first_seen: dict[str, int] = {}          # each origin's first position, arguments aside
    first_own: dict[str, int] = {}
    for seg, origin in bound.segments():
        if not seg.token_ids:
            continue
        if seg.kind != "argument":
            first_seen.setdefault(origin, seg.start)
    for unit_id in bound.units:
        starts = [seg.start for seg in bound.layout.units[unit_id].segments if seg.token_ids]
        if starts:
            first_own[unit_id] = min(starts)
    chosen = []
    for unit_id in bound.units:
        if unit_id not in first_own:
            continue
        seen = {unit_id, *context_of(unit_id)}
        before = [start for origin, start in first_seen.items()
                  if origin not in seen and start < first_own[unit_id]]
        if before and lead(bound.layout, unit_id, context_of) is not None:
            chosen.append(unit_id)
    return chosen
