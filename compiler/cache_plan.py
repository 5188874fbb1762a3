"""What a schema will cost to cache, before any of it is encoded (`promptlang compile --plan`).

For each unit the layout makes (a module's own tokens; a scaffold's modules together): its
tokens, the bytes the store keeps for them in each store dtype, and the seconds encoding
it should take on this machine, from a measured rate. For the schema: the totals, how
many distinct combinations of modules its prompts may import (what the unions and
optional modules allow), and warnings where the cache would grow out of hand.

The caller supplies what needs a model: the tokenizer, the bytes one stored token takes
per dtype (`runtime/kv/unit.py bytes_per_token`), and the time model of an encode
(`runtime/model/encode_rate.py`). This module knows the PML layer only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

from promptlang.pml import nodes
from promptlang.pml.layout import SchemaLayout, lay_out
from promptlang.tokenizer import Tokenizer

# Warn when the cache of every combination an `exact` request may keep would pass this.
COMBINATION_WARN_BYTES = 8 << 30
# Warn when one parameter reserves more than this share of the model's context.
PARAM_WARN_SHARE = 0.25


@dataclass(frozen=True)
class PlanRow:
    unit: str                      # the layout's unit id ("module:rag/docs-0")
    tokens: int                    # positions the unit holds (parameter slots included)
    params: int                    # positions of those that are parameter slots
    bytes: Mapping[str, int]       # bytes the store keeps, by store dtype
    seconds: float                 # the encode's estimate on this machine
    cached: bool                   # False for cache="false" modules: computed per request


@dataclass(frozen=True)
class CachePlan:
    schema: str
    rows: tuple[PlanRow, ...]
    positions: int                 # the layout's end: every position the schema reserves
    context: int | None            # the model's, when the tokenizer knows it
    combinations: int              # distinct sets of modules a prompt may import
    warnings: tuple[str, ...]

    def total_bytes(self, dtype: str) -> int:
        return sum(r.bytes[dtype] for r in self.rows if r.cached)

    @property
    def total_tokens(self) -> int:
        return sum(r.tokens for r in self.rows if r.cached)

    @property
    def total_seconds(self) -> float:
        return sum(r.seconds for r in self.rows if r.cached)


def plan_schema(schema: nodes.Schema, tokenizer: Tokenizer,
                bytes_per_token: Mapping[str, int],
                encode_seconds: Callable[[int], float]) -> CachePlan:
    """The cache plan of `schema` under `tokenizer`; ContextLengthError (located) where the
    schema does not fit the model's context."""
    layout = lay_out(schema, tokenizer)
    rows = []
    for unit in layout.units.values():
        tokens = sum(len(seg.token_ids) for seg in unit.segments)
        params = sum(len(seg.token_ids) for seg in unit.segments if seg.kind == "param")
        if tokens == 0:
            continue
        rows.append(PlanRow(unit.id, tokens, params,
                            {d: tokens * b for d, b in bytes_per_token.items()},
                            encode_seconds(tokens), unit.cache))
    combinations = _combinations(layout)
    context = tokenizer.max_positions
    warnings = []                      # (past the context, lay_out has raised already)
    for module in layout.modules.values():
        for slot in module.params:
            if context is not None and slot.length > PARAM_WARN_SHARE * context:
                warnings.append(f"parameter {'/'.join(module.path + (slot.name,))} reserves "
                                f"{slot.length} positions, over {PARAM_WARN_SHARE:.0%} of the "
                                f"context: every prompt keeps them, used or not")
    smallest = min(bytes_per_token.values()) if bytes_per_token else 0
    kept = combinations * layout.end * smallest
    if kept > COMBINATION_WARN_BYTES:
        warnings.append(f"{_count(combinations)} combinations of modules: a store that kept "
                        f"each one's exact KV (`exact` reuse) could grow to {_size(kept)}; "
                        f"give the store a budget, or use a union where modules exclude "
                        f"each other")
    return CachePlan(schema.name, tuple(rows), layout.end, context, combinations,
                     tuple(warnings))


def _combinations(layout: SchemaLayout) -> int:
    """Distinct import sets: each module is in or out, a union's members exclusive."""
    def of(path) -> int:
        module = layout.modules[path]
        count = 1
        in_union: dict[int, int] = {}
        for child in module.children:
            union = layout.modules[child].union
            if union is None:
                count *= 1 + of(child)
            else:
                in_union[union] = in_union.get(union, 0) + of(child)
        for members in in_union.values():
            count *= 1 + members
        return count
    return of(())


def format_plan(plan: CachePlan, dtypes: tuple[str, ...], rate_note: str) -> str:
    """The plan as a table, its totals and its warnings."""
    headers = ["unit", "tokens", "params", *[f"KV {d}" for d in dtypes], "encode s"]
    lines = []
    for row in plan.rows:
        name = row.unit + ("" if row.cached else " (cache=false)")
        lines.append([name, str(row.tokens), str(row.params),
                      *[_size(row.bytes[d]) for d in dtypes], f"{row.seconds:.3g}"])
    lines.append(["total cached", str(plan.total_tokens), "",
                  *[_size(plan.total_bytes(d)) for d in dtypes], f"{plan.total_seconds:.3g}"])
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(headers)]
    out = [f"Cache plan of schema {plan.schema}",
           "  ".join(h.ljust(w) for h, w in zip(headers, widths)),
           "  ".join("-" * w for w in widths)]
    for line in lines:
        out.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                             for i, (c, w) in enumerate(zip(line, widths))))
    context = f" of the model's {plan.context}" if plan.context else ""
    out.append(f"positions reserved: {plan.positions}{context}; "
               f"combinations of modules a prompt may import: {_count(plan.combinations)}")
    out.append(rate_note)
    out.extend(f"warning: {w}" for w in plan.warnings)
    return "\n".join(out)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _count(n: int) -> str:
    return str(n) if n < 10 ** 9 else f"{n:.3e}"
