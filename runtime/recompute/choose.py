"""Which cached tokens a request recomputes: a policy (policy.py) -> positions.

`choose_positions` is the one entry point the engine calls; the engine turns its answer
into a RecomputePlan (plan.py).

- first:K -- the first K cached tokens of every unit but the root (`first_tokens`).
- deviation:F -- the ceil(F x candidates) candidates whose layer-1 KV differs most from a
  full prefill's (deviation.py).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

from promptlang.pml.binding import BoundPrompt
from promptlang.runtime.kv import UnitKV
from promptlang.runtime.model import ModelAdapter
from promptlang.runtime.recompute.deviation import deviations
from promptlang.runtime.recompute.policy import Recompute


def choose_positions(adapter: ModelAdapter, bound: BoundPrompt, units: dict[str, UnitKV],
                     policy: Recompute, context_of: Callable[[str], Sequence[str]]) -> list[int]:
    """Positions of the cached tokens `policy` recomputes for `bound`. `units`: the KV of
    each of bound.units; `context_of(unit id)`: the units it was encoded against."""
    if policy.kind == "first":
        return first_tokens(bound, int(policy.amount))
    if policy.kind == "deviation":
        scores = deviations(adapter, bound, units, context_of)
        count = math.ceil(policy.amount * len(scores))
        ranked = sorted(scores, key=lambda p: (-scores[p], p))
        return sorted(ranked[:count])
    return []


def first_tokens(bound: BoundPrompt, k: int) -> list[int]:
    """Positions of the first `k` cached tokens of every unit of `bound` but the root
    (EPIC-style recompute at module seams: each module's first tokens otherwise act as
    spurious attention sinks)."""
    positions = []
    for unit in bound.units:
        if not bound.layout.units[unit].modules[0]:
            continue                                   # the root: nothing precedes it
        tokens = [seg.start + i for seg in bound.layout.units[unit].segments
                  if seg.kind != "param" for i in range(len(seg.token_ids))]
        positions += sorted(tokens)[:k]
    return positions
