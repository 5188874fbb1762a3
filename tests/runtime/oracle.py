"""The DESIGN.md oracle: what a cached prefill must equal, computed in ONE forward pass.

The pass runs over every token occurrence of the request: each unit the request
serves plus its context units (placeholders included; a unit that is both served
and a context unit, or whose tokens another unit also holds, e.g. a scaffold's
modules, is one occurrence per unit), then the uncached segments. Tokens of
different occurrences may share a position (an argument sits in its placeholder's
slot). The 4-D mask is the visibility rule written out directly:

- a unit token t attends u iff u belongs to t's unit or (guaranteed context) to one
  of its context units, and pos(u) <= pos(t);
- an uncached token q attends u iff u is a non-placeholder token of a served unit or
  an uncached token, and pos(u) <= pos(q).

Recomputed tokens (`recomputed` positions, docs/RECOMPUTE.md) are uncached tokens like
any other: their served-unit occurrence stays in the pass (the unit's later tokens were
encoded against it) but leaves the request's tokens, replaced by an uncached copy.

A request without uncached tokens computes its last (highest-positioned) token
per request (generate.py): here that token becomes the one uncached query, and its
served occurrence drops out of the request's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection

import torch

from promptlang.pml.binding import BoundPrompt
from promptlang.runtime.model import ModelAdapter


@dataclass
class OracleResult:
    logits: torch.Tensor      # [Q, V] of the uncached tokens, position order
    keys: torch.Tensor        # [L, H, N, D] of the request's tokens, position order
    values: torch.Tensor      # [L, H, N, D]
    positions: torch.Tensor   # [N] sorted


def oracle_prefill(adapter: ModelAdapter, bound: BoundPrompt, isolate: bool = False,
                   recomputed: Collection[int] = frozenset()) -> OracleResult:
    layout = bound.layout
    units: list[str] = []

    def need(unit_id: str) -> None:
        if unit_id in units:
            return
        unit = layout.units[unit_id]
        for context_id in ([] if isolate else unit.context):
            need(context_id)
        units.append(unit_id)

    for unit_id in bound.units:
        need(unit_id)

    # one row per token occurrence
    ids, pos, owner, placeholder = [], [], [], []
    for unit_id in units:
        for seg in layout.units[unit_id].segments:
            for i, token in enumerate(seg.token_ids):
                ids.append(token)
                pos.append(seg.start + i)
                owner.append(unit_id)
                placeholder.append(seg.kind == "param")
    for seg in bound.uncached:
        for i, token in enumerate(seg.token_ids):
            ids.append(token)
            pos.append(seg.start + i)
            owner.append("uncached")
            placeholder.append(False)
    served = {unit_id for unit_id in bound.units}
    copies = [i for i in range(len(ids))
              if owner[i] in served and not placeholder[i] and pos[i] in recomputed]
    assert len(copies) == len(set(recomputed)), "a recomputed position holds no served token"
    for i in copies:
        ids.append(ids[i])
        pos.append(pos[i])
        owner.append("uncached")
        placeholder.append(False)
    request = [i for i in range(len(ids))
               if (owner[i] in served and not placeholder[i] and pos[i] not in recomputed)
               or owner[i] == "uncached"]
    last = max(request, key=lambda i: pos[i])
    if owner[last] != "uncached":      # the last token is computed per request
        ids.append(ids[last])
        pos.append(pos[last])
        owner.append("uncached")
        placeholder.append(False)
        request = [i for i in request if i != last] + [len(ids) - 1]

    n = len(ids)
    in_request = torch.zeros(n, dtype=torch.bool)
    in_request[request] = True
    position = torch.tensor(pos)
    allowed = torch.zeros(n, n, dtype=torch.bool)
    for t in range(n):
        if owner[t] == "uncached":
            visible = in_request.clone()
        else:
            unit = layout.units[owner[t]]
            sees = {owner[t]} | (set() if isolate else set(unit.context))
            visible = torch.tensor([o in sees for o in owner])
        allowed[t] = visible & (position <= pos[t])

    queries = torch.tensor([i for i in range(n) if owner[i] == "uncached"])
    queries = queries[torch.argsort(position[queries])]
    chunk_size, adapter.chunk_size = adapter.chunk_size, 1 << 30   # truly one pass
    try:
        step = adapter.forward(torch.tensor(ids), position, None, allowed, queries)
    finally:
        adapter.chunk_size = chunk_size
    order = torch.tensor(request)[torch.argsort(position[request])]
    return OracleResult(step.logits, step.keys[:, :, order], step.values[:, :, order],
                        position[order])
