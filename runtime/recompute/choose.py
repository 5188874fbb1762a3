"""Which cached tokens a request recomputes: a policy (policy.py) -> positions.

`choose_positions` is the one entry point the engine calls; the engine turns its answer
into a RecomputePlan (plan.py).

- first:K -- the first K cached tokens of every unit that missed something (`first_tokens`;
  EPIC's LegoLink, which skips the first module: tokens that saw all they would see in a
  full prefill are exact already, and recomputing them changes nothing).
- deviation:F -- the ceil(F x candidates) candidates whose layer-1 KV differs most from a
  full prefill's (deviation.py).
- query:K -- not here: its choice needs a probe pass over the assembled request, which the
  engine runs (query.py, `probe_choice`).
- exact -- every candidate: what the full prefill computes, without deviation's pass.
- seams -- every candidate that missed another module or text computed per request, not
  one that missed only an argument (`candidates(..., arguments=False)`).
- ape -- the candidates of the schema's own text (the root unit: what follows the modules,
  APE's query side); the modules stay as encoded, and `parallel_contexts` says which
  tokens the request's new ones attend to as APE's contexts.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from promptlang.pml.binding import BoundPrompt
from promptlang.pml.layout import module_unit_id
from promptlang.runtime.kv.unit import UnitKV
from promptlang.runtime.model import ModelAdapter, ParallelContexts
from promptlang.runtime.recompute.deviation import candidates, deviations
from promptlang.runtime.recompute.policy import Recompute


def choose_positions(adapter: ModelAdapter, bound: BoundPrompt, units: dict[str, UnitKV],
                     policy: Recompute, context_of: Callable[[str], Sequence[str]]) -> list[int]:
    """Positions of the cached tokens `policy` recomputes for `bound`. `units`: the KV of
    each of bound.units; `context_of(unit id)`: the units it was encoded against."""
    if policy.kind == "first":
        return first_tokens(bound, int(policy.amount), context_of)
    if policy.kind in ("exact", "seams"):
        found = candidates(bound, context_of, arguments=policy.kind == "exact")
        return sorted(p for positions in found.values() for p in positions)
    if policy.kind == "ape":
        return candidates(bound, context_of).get(ROOT, [])
    if policy.kind == "deviation":
        scores = deviations(adapter, bound, units, context_of)
        count = math.ceil(policy.amount * len(scores))
        ranked = sorted(scores, key=lambda p: (-scores[p], p))
        return sorted(ranked[:count])
    return []


ROOT = module_unit_id(())           # the schema's own text


def parallel_contexts(bound: BoundPrompt, units: dict[str, UnitKV], policy: Recompute,
                      approximate: Sequence[str],
                      recomputed: frozenset[int] = frozenset()) -> ParallelContexts | None:
    """APE's contexts for `bound` under "ape" (or "query:K+ape"): every token of the
    modules' units (all but the root) but the `recomputed` ones, by position; None --
    plain attention -- unless some module is served as encoded apart (`approximate`: the
    units whose missed tokens stay as stored)."""
    if not policy.parallel or not any(unit != ROOT for unit in approximate):
        return None
    context = torch.zeros(bound.end, dtype=torch.bool)
    for unit, kv in units.items():
        if unit != ROOT:
            context[kv.positions[~kv.placeholder].cpu()] = True
    if recomputed:               # computed per request: they attend and are seen as usual
        context[torch.tensor(sorted(recomputed))] = False
    return ParallelContexts(context, policy.temperature, policy.scale)


def first_tokens(bound: BoundPrompt, k: int,
                 context_of: Callable[[str], Sequence[str]]) -> list[int]:
    """Positions of the first `k` candidates of every unit of `bound` (deviation.candidates:
    its cached tokens whose encoding missed a request token before them), position order.
    EPIC-style recompute at module seams: a module's first tokens otherwise act as spurious
    attention sinks. A unit that missed nothing (the first module after the schema's text,
    a module whose optional siblings before it are all absent) recomputes nothing."""
    return sorted(p for found in candidates(bound, context_of).values() for p in found[:k])
