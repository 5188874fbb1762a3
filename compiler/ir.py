"""The compiler's view of one @prompt function body: what each statement emits.

`analyze.py` builds it from libcst nodes; `lower.py` decides what is cached and
turns it into PML and a `plan.FunctionPlan`; `instrument.py` finds each item's
statement by its `place` and rewrites it to report the item's `id` when it runs.
Items are in source order; ids are unique within a function.

    TextItem     "literal text"             always the same text
    ValueItem    question                   a bare expression: one hole
    FStringItem  f"Hello {name}."           literal parts and holes
    CallItem     header(name)               a call statement (a @prompt callee or not)
    RoleItem     with user(): ...           a chat-role block
    BranchItem   if/elif/else, match        alternatives (Arm), one runs
    BlockItem    for, while, try, with      a block that runs its text 0..n times
    ReturnItem   return                     the end of the prompt
    AssignCallItem  x = gen(...)            an assignment from a call that may be gen/select

A `gen(...)` / `select(...)` statement is a CallItem; `lower.py` tells generations
apart from other calls when it resolves the callee.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Union

from promptlang.errors import Span

# Where instrument.py finds an item's statement in CPython's `ast`: (kind, line, UTF-8 byte
# column[, case index]), kind one of expr / if / else / case / with; `else` has no ast
# node of its own and is placed by its `if`.
Place = tuple


@dataclass(frozen=True)
class Hole:
    """An expression whose value becomes text."""

    code: str                  # its source, whitespace-normalised: the key `params=` may use
    name: str | None           # the variable, when the expression is a plain name
    span: Span


@dataclass(frozen=True)
class TextItem:
    id: int
    text: str
    span: Span
    place: Place                   # its statement, for instrument.py


@dataclass(frozen=True)
class ValueItem:
    id: int
    hole: Hole
    span: Span
    place: Place                   # its statement, for instrument.py


@dataclass(frozen=True)
class FStringItem:
    id: int
    parts: tuple[Union[str, Hole], ...]     # literal text (evaluated, dedented) and holes
    span: Span
    place: Place                   # its statement, for instrument.py

    @property
    def holes(self) -> tuple[Hole, ...]:
        return tuple(p for p in self.parts if isinstance(p, Hole))


@dataclass(frozen=True)
class CallItem:
    id: int
    path: tuple[str, ...] | None   # `a.b.c(...)` -> ("a", "b", "c"); None if not a dotted name
    code: str                      # the callee expression's source
    span: Span
    place: Place                   # its statement, for instrument.py


@dataclass(frozen=True)
class RoleItem:
    open_id: int
    close_id: int
    role: str
    path: tuple[str, ...]          # how the helper is named: ("user",) or ("pl", "user")
    body: tuple["Item", ...]
    span: Span
    place: Place                   # its statement, for instrument.py


@dataclass(frozen=True)
class Arm:
    id: int
    label: str                     # source the module name is derived from; "" for else
    body: tuple["Item", ...]
    span: Span
    place: Place                   # its statement, for instrument.py


@dataclass(frozen=True)
class BranchItem:
    id: int
    kind: Literal["if", "match"]
    arms: tuple[Arm, ...]          # source order; `else` / `case _` included when written
    span: Span


@dataclass(frozen=True)
class BlockItem:
    id: int
    kind: Literal["for", "while", "try", "with"]
    body: tuple["Item", ...]       # every item anywhere inside the statement
    span: Span

    @property
    def emits(self) -> bool:
        return any(not isinstance(item, ReturnItem) for item in self.body)


@dataclass(frozen=True)
class AssignCallItem:
    """`x = f(...)` (or `x: T = f(...)`, `x += f(...)`) where `f` is named `gen` or
    `select`: a generation when it resolves to promptlang's, else ordinary code."""

    id: int
    path: tuple[str, ...]
    code: str                      # the callee expression's source
    span: Span


@dataclass(frozen=True)
class ReturnItem:
    id: int
    span: Span


Item = Union[TextItem, ValueItem, FStringItem, CallItem, RoleItem, BranchItem, BlockItem,
             ReturnItem, AssignCallItem]


@dataclass(frozen=True)
class ExpressionCall:
    """A call inside an expression (not a statement): fine unless it calls a @prompt function."""

    path: tuple[str, ...]
    code: str
    span: Span


@dataclass(frozen=True)
class FunctionIR:
    name: str
    qualname: str
    file: str
    span: Span                     # the `def` line
    parameters: tuple[str, ...]    # in signature order
    locals: frozenset[str]         # names the body assigns
    body: tuple[Item, ...]
    expression_calls: tuple[ExpressionCall, ...]
    params_span: Span | None       # the `params=` keyword of the decorator, when written

    def walk(self):
        """Every item, depth first, in source order."""
        return walk_items(self.body)


def walk_items(items):
    """`items` and every item inside them, depth first, in source order."""
    for item in items:
        yield item
        if isinstance(item, (RoleItem, BlockItem)):
            yield from walk_items(item.body)
        elif isinstance(item, BranchItem):
            for arm in item.arms:
                yield from walk_items(arm.body)
