"""Exact reuse: a unit served as the full prefill computes it, where its request was seen before.

A unit's stored KV was encoded without the optional modules, arguments and new text that a
request puts before it (its *candidates* missed them: deviation.py). A request under the
`exact` policy recomputes every candidate, so afterwards each such unit's KV in the request's
buffer is exactly what one full prefill of that request computes. That KV depends on nothing
but the unit's own tokens and the request's other tokens before the unit's last position, so
it is stored under a key made of both (`exact_key`): prefix caching at module granularity.
Any later request -- whatever its policy -- whose tokens before that unit are the same, serves
the unit from that entry: it has no candidates left and costs what a cached unit costs.
Only new combinations of modules pay the approximation (or the recompute).

Any policy can make a unit exact: it is, after the prefill, when every candidate at a position
below its last token was recomputed (its own, and every other unit's whose KV it attended
to: `made_exact`). Under `exact` that is every unit; under `seams` every unit before the first
token that missed only an argument.

Flow (runtime/engine.py): `lookup` before choosing what to recompute (the units it finds are
treated as having seen every request token: `context_with`), the assembler serves their
entries instead of the units' own KV, and after the prefill `remember` stores the units the
request made exact.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Callable, Sequence

import torch

from promptlang.errors import InternalError
from promptlang.pml.binding import BoundPrompt
from promptlang.pml.layout import Segment
from promptlang.runtime.kv.unit import UnitKV
from promptlang.runtime.recompute.contiguous import Renumbering

EXACT_VERSION = "promptlang-exact-v2"


def exact_key(unit_key: str, segments: Sequence[tuple[Segment, str]], unit_id: str) -> str | None:
    """The store key of `unit_id`'s exact KV in a request made of `segments`
    (BoundPrompt.segments(), or renumbered: contiguous.py; position order): a digest of the
    unit's own key, the positions of its own tokens, and every other token (id and position)
    of the request below the unit's last position. None for a unit with no token in the
    request."""
    mine = [seg for seg, origin in segments if origin == unit_id and seg.token_ids]
    if not mine:
        return None
    last = max(seg.end for seg in mine) - 1
    h = hashlib.sha256()
    h.update(EXACT_VERSION.encode() + b"\0" + unit_key.encode() + b"\0")
    h.update(array("q", [n for seg in mine for n in (seg.start, len(seg.token_ids))]).tobytes())
    h.update(b"\0")
    for seg, origin in segments:
        if seg.start >= last:
            break
        if origin == unit_id or not seg.token_ids:
            continue
        ids = seg.token_ids[:last - seg.start]       # consecutive positions from seg.start
        h.update(array("q", (seg.start, len(ids), *ids)).tobytes())
    return h.hexdigest()


def lookup(store, bound: BoundPrompt, keys: dict[str, str], missed: Sequence[str],
           numbers: Renumbering | None = None) -> dict[str, tuple[str, UnitKV]]:
    """The units of `missed` (ids with candidates) whose exact entry `store` holds, as
    unit id -> (entry key, KV). `keys`: each unit's own store key; `numbers`: the request's
    renumbering where it is computed at contiguous positions."""
    if not missed:
        return {}
    segments = bound.segments() if numbers is None else numbers.segments(bound.segments())
    found = {}
    for unit_id in missed:
        key = exact_key(keys[unit_id], segments, unit_id)
        kv = None if key is None or not store.contains(key) else store.get(key)
        if kv is not None:
            found[unit_id] = (key, kv)
    return found


def context_with(context_of: Callable[[str], Sequence[str]], bound: BoundPrompt,
                 exact: Sequence[str]) -> Callable[[str], Sequence[str]]:
    """`context_of`, except that a unit served exactly saw every token of the request before
    it (so it has no candidates)."""
    if not exact:
        return context_of
    everything = (*bound.units, "uncached")
    served = frozenset(exact)
    return lambda unit_id: everything if unit_id in served else context_of(unit_id)


def made_exact(bound: BoundPrompt, missed: dict[str, list[int]], recomputed: frozenset[int],
               served: Sequence[str]) -> list[str]:
    """The units of `missed` (unit id -> its candidates) not in `served` that a request
    recomputing `recomputed` leaves exact: no candidate left as stored (of any unit not
    served exactly) at a position below the unit's last token."""
    skipped = frozenset(served)
    approximate = [p for unit, found in missed.items() if unit not in skipped
                   for p in found if p not in recomputed]
    first_approximate = min(approximate, default=None)
    last: dict[str, int] = {}
    for seg, origin in bound.segments():
        if seg.token_ids and origin in missed:
            last[origin] = max(last.get(origin, -1), seg.end - 1)
    return [unit for unit in missed if unit not in skipped and unit in last
            and (first_approximate is None or first_approximate > last[unit])]


@torch.inference_mode()
def remember(store, bound: BoundPrompt, buffer, keys: dict[str, str], units: Sequence[str],
             schema: str, numbers: Renumbering | None = None) -> int:
    """Store the exact KV of `units` (made exact by the request: `made_exact`) from the
    request's `buffer` after its prefill (at the positions of `numbers` where the request
    was renumbered); returns how many entries were written."""
    if not units:
        return 0
    segments = bound.segments() if numbers is None else numbers.segments(bound.segments())
    sequence = bound.sequence()
    n = buffer.length
    slots_by_position = torch.argsort(buffer.positions[:n])
    sorted_positions = buffer.positions[:n][slots_by_position]
    # shared spans copied in first
    keys_all = buffer.keys
    values_all = buffer.values
    written = 0
    for unit_id in units:
        key = exact_key(keys[unit_id], segments, unit_id)
        if key is None or store.contains(key):
            continue
        mine = [p for _, p, origin in sequence if origin == unit_id]
        positions = torch.tensor(mine if numbers is None else numbers.positions(mine),
                                 dtype=torch.int64, device=buffer.positions.device)
        at = torch.searchsorted(sorted_positions, positions)
        slots = slots_by_position[at]
        if not torch.equal(buffer.positions[slots], positions):
            raise InternalError(f"unit {unit_id!r} is not in the request's buffer")
        # keys_all: [L, H_kv, C, D]
        kv = UnitKV(keys_all[:, :, slots].clone(), values_all[:, :, slots].clone(), positions,
                    buffer.token_ids[slots].clone(), torch.zeros_like(positions, dtype=torch.bool))
        store.put(key, kv, {"unit": unit_id, "schema": schema, "tokens": str(len(positions)),
                            "rule": "exact"})
        written += 1
    return written
