"""The encoder: one layout unit -> its KV at its layout positions, in ONE forward pass.

A unit's tokens (placeholders in parameter slots included) attend causally, by
position, to the unit's own tokens and, under the default guaranteed-context rule,
to the KV of the units in `Unit.context` (the schema root and the module's
ancestors) at positions <= their own. With `isolate=True` they attend only to
themselves (the paper's rule). Context units are taken from the store, or encoded
first, recursively.

The store key of a unit is a digest of everything that determines its KV: the
model fingerprint, the rule, the tokenizer fingerprint, the unit's token ids,
positions and placeholder flags, and (guaranteed context) the same for the part of
each context unit it can see (the tokens up to its own last position). Editing one
module therefore re-encodes that module and the units that see it, nothing else;
text that moves *after* a module (e.g. the root's closing role tag when the last
module changes length) re-encodes the unit holding that text, not the module.

A primed encoding (recompute policies "P+primed", runtime/recompute/primer.py) puts the
unit's lead token just before it, attending to the unit's context; the unit's tokens
attend to it, and its own KV is dropped. Its key adds the lead; `primed` (the units a
request serves primed) also decides which encoding of each context unit a unit saw.
"""

from __future__ import annotations

import hashlib
import threading
import time
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import torch

from promptlang.pml.layout import SchemaLayout, Unit
from promptlang.runtime.kv.unit import UnitKV
from promptlang.runtime.model import ModelAdapter, Past
from promptlang.runtime.passes.prefill import visibility
from promptlang.runtime.recompute.primer import lead as lead_of

KEY_VERSION = "promptlang-unit-v1"


@dataclass(frozen=True)
class UnitPlan:
    """A unit's tokens as tensors, and its store key."""

    unit: Unit
    key: str
    token_ids: torch.Tensor      # [S] int64
    positions: torch.Tensor      # [S] int64
    placeholder: torch.Tensor    # [S] bool
    lead: tuple[int, int] | None = None   # primed: (token id, position) encoded before it

    @property
    def length(self) -> int:
        return int(self.positions.shape[0])


@dataclass
class EncodeStats:
    """What one request spent encoding units the store lacked."""

    calls: int = 0
    seconds: float = 0.0
    tiers: dict[str, int] = field(default_factory=dict)   # units served, by store tier

    def served(self, tier: str) -> None:
        self.tiers[tier] = self.tiers.get(tier, 0) + 1


class UnitEncoder:
    """Serves units' KV from the store, encoding (and storing) the ones it lacks.

    `calls` counts encoded units (one forward pass each, or one per chunk of a long unit);
    `encoded` holds the latest encoded keys, oldest first.
    """

    def __init__(self, adapter: ModelAdapter, store, tokenizer_fingerprint: str,
                 isolate: bool = False):
        self.adapter = adapter
        self.store = store
        self.tokenizer_fingerprint = tokenizer_fingerprint
        self.isolate = isolate
        self.rule = "isolate" if isolate else "guaranteed-context"
        self.calls = 0
        self.encoded: deque[str] = deque(maxlen=1024)   # keys of the latest encodes
        self._plans: OrderedDict[int, tuple[SchemaLayout, dict[str, UnitPlan]]] = OrderedDict()
        self._plans_lock = threading.Lock()

    # --- keys -----------------------------------------------------------------------------

    def plan(self, layout: SchemaLayout, unit_id: str,
             primed: frozenset[str] = frozenset()) -> UnitPlan:
        """The unit's tensors and store key (memoised per layout). `primed`: the units the
        request serves primed (the unit's own encoding, and its context units')."""
        with self._plans_lock:
            hit = self._plans.get(id(layout))
            if hit is None or hit[0] is not layout:
                hit = (layout, {})
                self._plans[id(layout)] = hit
                if len(self._plans) > 64:
                    self._plans.popitem(last=False)
            self._plans.move_to_end(id(layout))
            plans = hit[1]
        unit = layout.units[unit_id]
        primed = primed & {unit_id, *self.context_of(unit)}     # what this unit's KV depends on
        memo = (unit_id, primed) if primed else unit_id
        plan = plans.get(memo)
        if plan is None:
            plan = self._make_plan(layout, unit, primed)
            plans[memo] = plan
        return plan

    def _make_plan(self, layout: SchemaLayout, unit: Unit, primed: frozenset[str]) -> UnitPlan:
        ids, pos, hold = _tokens_of(unit)
        last = max(pos, default=-1)
        key = self._digest(layout, unit, ids, pos, hold, last, primed)
        lead = self.lead(layout, unit.id) if unit.id in primed else None
        return UnitPlan(unit, key, torch.tensor(ids, dtype=torch.int64),
                        torch.tensor(pos, dtype=torch.int64), torch.tensor(hold, dtype=torch.bool),
                        lead)

    def lead(self, layout: SchemaLayout, unit_id: str) -> tuple[int, int] | None:
        """The (token id, position) a primed encoding of the unit puts before it (primer.py)."""
        return lead_of(layout, unit_id, lambda u: self.context_of(layout.units[u]))

    def _digest(self, layout: SchemaLayout, unit: Unit, ids, pos, hold, last: int,
                primed: frozenset[str] = frozenset()) -> str:
        """What determines the KV of `unit`'s tokens at positions <= `last`: those tokens,
        its lead where it is primed, and the same for its context units (a context token
        after `last` is never seen, so text that moves after a module does not invalidate
        it)."""
        keep = [i for i, p in enumerate(pos) if p <= last]
        h = hashlib.sha256()
        for part in (KEY_VERSION, self.adapter.fingerprint, self.rule, self.tokenizer_fingerprint):
            h.update(part.encode() + b"\0")
        h.update(array("q", [ids[i] for i in keep]).tobytes() + b"\0")
        h.update(array("q", [pos[i] for i in keep]).tobytes() + b"\0")
        h.update(bytes(hold[i] for i in keep) + b"\0")
        lead = self.lead(layout, unit.id) if unit.id in primed else None
        if lead is not None and lead[1] <= last:
            h.update(b"lead\0" + array("q", lead).tobytes() + b"\0")
        for context_id in self.context_of(unit):
            context = layout.units[context_id]
            c_ids, c_pos, c_hold = _tokens_of(context)
            h.update(self._digest(layout, context, c_ids, c_pos, c_hold, last, primed).encode()
                     + b"\0")
        return h.hexdigest()

    def context_of(self, unit: Unit) -> tuple[str, ...]:
        return () if self.isolate else unit.context

    def key(self, layout: SchemaLayout, unit_id: str, primed: frozenset[str] = frozenset()) -> str:
        return self.plan(layout, unit_id, primed).key

    # --- serving ----------------------------------------------------------------------------

    def get(self, layout: SchemaLayout, unit_id: str, stats: EncodeStats | None = None,
            *, context: bool = False, primed: frozenset[str] = frozenset()) -> UnitKV:
        """The unit's KV: from the store, or encoded now (context units first) and stored.
        `stats.tiers` counts where it came from, unless it is fetched as another unit's
        `context`. `primed`: the units the request serves primed (primer.py)."""
        tally = None if stats is None or context else stats
        plan = self.plan(layout, unit_id, primed)
        if plan.length == 0:
            return self._empty()
        kv, tier = self._lookup(plan.key)
        if kv is None:
            with self.adapter.lock:      # one encoder of a key at a time; others then hit
                kv, tier = self._lookup(plan.key)
                if kv is None:
                    kv = self._encode_stored(layout, plan, stats, primed)
                    tier = "encoded"
        if tally is not None:
            tally.served(tier)
        return kv

    def _encode_stored(self, layout: SchemaLayout, plan: UnitPlan, stats: EncodeStats | None,
                       primed: frozenset[str] = frozenset()) -> UnitKV:
        """Encode the unit (its context units first, from the store or encoded) and store it."""
        context = [self.get(layout, c, stats, context=True, primed=primed)
                   for c in self.context_of(plan.unit)]
        started = time.perf_counter()
        kv = self.encode(plan, context)
        rule = self.rule if plan.lead is None else f"{self.rule}, primed"
        self.store.put(plan.key, kv, {"unit": plan.unit.id, "schema": layout.schema.name,
                                      "tokens": str(plan.length), "rule": rule})
        if getattr(self.store, "dtype", None) not in (None, kv.keys.dtype):
            # a lossy store dtype: serve what every later request will get
            kv = self.store.get(plan.key) or kv
        if stats is not None:
            stats.calls += 1
            stats.seconds += time.perf_counter() - started
        return kv

    def _lookup(self, key: str) -> tuple[UnitKV | None, str]:
        """(KV, the tier that held it) from the store; a store without tiers says "memory"."""
        lookup = getattr(self.store, "lookup", None)
        if lookup is None:
            return self.store.get(key), "memory"
        return lookup(key)

    def warm(self, layout: SchemaLayout) -> int:
        """Make sure every cached unit of `layout` is in the store; returns units encoded."""
        before = self.calls
        for unit_id, unit in layout.units.items():
            if unit.cache:
                self.get(layout, unit_id)
        return self.calls - before

    @torch.inference_mode()
    def encode(self, plan: UnitPlan, context: list[UnitKV]) -> UnitKV:
        """One forward pass over the unit's tokens at their positions, against `context`
        (after its lead, whose KV is dropped, where the plan is primed)."""
        device = self.adapter.device
        ids = plan.token_ids.to(device)
        pos = plan.positions.to(device)
        if plan.lead is not None:
            ids = torch.cat([torch.tensor([plan.lead[0]], device=device), ids])
            pos = torch.cat([torch.tensor([plan.lead[1]], device=device), pos])
        last = int(pos.max())
        # context tokens after the unit's last token are never attended: leave them out
        pieces = [(kv, kv.positions <= last) for kv in context]
        past_len = sum(int(keep.sum()) for _, keep in pieces)
        keys, values = self.adapter.empty_kv(past_len + plan.length)
        past_pos = torch.empty(past_len, dtype=torch.int64, device=device)
        at = 0
        for kv, keep in pieces:
            n = int(keep.sum())
            if n == 0:
                continue
            if n == kv.length:
                keys[:, :, at:at + n] = kv.keys
                values[:, :, at:at + n] = kv.values
            else:
                keys[:, :, at:at + n] = kv.keys[:, :, keep]
                values[:, :, at:at + n] = kv.values[:, :, keep]
            past_pos[at:at + n] = kv.positions[keep]
            at += n
        step = self.adapter.forward(ids, pos, Past(keys, values, past_pos),
                                    visibility(past_pos, pos))
        self.calls += 1
        self.encoded.append(plan.key)
        skip = 0 if plan.lead is None else 1

        def own(t: torch.Tensor) -> torch.Tensor:
            return t[:, :, skip:].clone(memory_format=torch.contiguous_format)

        return UnitKV(own(step.keys), own(step.values), pos[skip:].clone(), ids[skip:].clone(),
                      plan.placeholder.to(device))

    def _empty(self) -> UnitKV:
        keys, values = self.adapter.empty_kv(0)
        empty = torch.empty(0, dtype=torch.int64, device=self.adapter.device)
        return UnitKV(keys, values, empty, empty.clone(),
                        torch.empty(0, dtype=torch.bool, device=self.adapter.device))


def _tokens_of(unit: Unit) -> tuple[list[int], list[int], list[bool]]:
    """A unit's token ids, their positions, and which are parameter placeholders."""
    ids: list[int] = []
    pos: list[int] = []
    hold: list[bool] = []
    for seg in unit.segments:
        ids += seg.token_ids
        pos += seg.positions
        hold += [seg.kind == "param"] * len(seg.token_ids)
    return ids, pos, hold
