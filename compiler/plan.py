"""What lowering decides about a @prompt function: one record per item (`PlannedItem`)
in a `FunctionPlan`, read by `trace.py` when a call runs and by `instrument.py`.

`lower.py` builds a plan from the function's IR (`ir.py`); `instrument.py` rewrites
the statements of the items the plan needs to hear about; the instrumented body
reports item ids, and `trace.py` looks each id up here to learn what it means:
cached or not, its text, the parameters of its holes, the module it opens.

`PlannedFunction` is what lowering and tracing need of a @prompt function (the
decorator's `PromptFunction` is one); it lives here so that neither imports the decorator.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Literal, Mapping

import promptlang.compiler.ir as ir   # not `from promptlang.compiler`: that names the package
from promptlang.compiler.diagnostics import Diagnostic
from promptlang.errors import Span
from promptlang.pml import nodes

Kind = Literal["text", "value", "fstring", "call", "generation", "assign", "open", "close",
               "arm", "branch", "block", "return"]


@dataclass(frozen=True)
class PlannedItem:
    """One item of a function body (an arm, a role's open or close marker included) and
    what it means when it runs."""

    id: int
    kind: Kind         # "generation": a gen()/select() call or assignment; "assign": any other
    span: Span
    cached: bool = False                  # part of a module's fixed text (before the tail)
    text: str = ""                        # text: what it emits
    parts: tuple[str | None, ...] = ()    # f-string: its literal parts, None for each hole
    params: tuple[str, ...] = ()          # cached value / f-string: each hole's parameter
    role: str = ""                        # open / close: the chat role
    module: str | None = None             # cached arm / call: the child module it opens
    own: tuple[int, ...] = ()             # arm module: its own cached items, in order
    callee: typing.Any = None             # call: the PlannedFunction it was compiled as


@dataclass(frozen=True)
class FunctionPlan:
    """What one @prompt function caches, and what its run-time events mean."""

    function: "PlannedFunction"
    ir: ir.FunctionIR
    module_name: str                      # its module's name when it is a schema's root
    children: tuple                       # its module's content (PML nodes)
    own: tuple[int, ...]                  # the items of its module (not of child modules)
    items: Mapping[int, PlannedItem]      # every item by id
    has_tail: bool                        # some call may end in uncached text
    first_text: Span | None               # its first cached literal text
    diagnostics: tuple[Diagnostic, ...] = ()   # warnings (errors raise)
    generates: bool = False               # some call may generate (a program)

    def expected(self, key: int | None) -> tuple[int, ...]:
        """The own cached items of module `key` (None: the function's; else an arm id)."""
        return self.own if key is None else self.items[key].own


class PlannedFunction:
    """What lowering and tracing use of a @prompt function (`decorator.PromptFunction`
    implements it): `analysis` (analyze.Analysis), `options` (name, params),
    `schema_name`, `__wrapped__`, `__qualname__`, its plan and its instrumented twin."""

    def plan(self, stack: tuple = ()) -> FunctionPlan:
        raise NotImplementedError

    def instrumented(self) -> typing.Callable:
        raise NotImplementedError


def prompt_function_of(value) -> PlannedFunction | None:
    """The @prompt function `value` is (or a method bound from), else None."""
    if isinstance(value, PlannedFunction):
        return value
    func = getattr(value, "__func__", None)
    return func if isinstance(func, PlannedFunction) else None


def merge_text(children) -> tuple:
    """Normal form: adjacent Text nodes joined, empty ones dropped."""
    out: list = []
    for child in children:
        if isinstance(child, nodes.Text):
            if not child.text:
                continue
            if out and isinstance(out[-1], nodes.Text):
                out[-1] = nodes.Text(out[-1].text + child.text, out[-1].span)
                continue
        out.append(child)
    return tuple(out)
