"""What lowering a template decides, and what a call of it follows (`template.py`).

A `TemplatePlan` holds the schema (one root module, named after the template), the
steps that turn a call's variables into the PML prompt's arguments and imports, and
the tail: the part of the template rendered by Jinja2 per request.

    Hole       a bounded `{{ ... }}`: the argument of parameter `param`
    Branch     an if/elif/else: the first arm whose test holds imports its module
    Nested     an include or a macro call: its module, always imported
    Documents  a documents loop: a module per document the call's list names
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence, Union

import jinja2

from promptlang.errors import Span
from promptlang.pml import nodes


@dataclass(frozen=True)
class Hole:
    param: str
    template: jinja2.Template          # renders the value, from the call's variables
    scope: Mapping[str, Any]           # constants it also reads (a document, a macro's args)
    span: Span

    def inner(self) -> tuple:
        return ()


@dataclass(frozen=True)
class Arm:
    module: str | None                 # None: the arm adds no text
    test: jinja2.Template | None       # renders "1" where the arm is taken; None: else
    scope: Mapping[str, Any]
    steps: tuple["Step", ...]


@dataclass(frozen=True)
class Branch:
    arms: tuple[Arm, ...]

    def inner(self) -> tuple:
        return tuple(arm.steps for arm in self.arms)


@dataclass(frozen=True)
class Nested:
    module: str
    steps: tuple["Step", ...]

    def inner(self) -> tuple:
        return (self.steps,)


@dataclass(frozen=True)
class Member:
    module: str
    index: int                         # its place in the documents' list
    steps: tuple["Step", ...]


@dataclass(frozen=True)
class Documents:
    name: str                          # the call's variable that lists the documents
    corpus: tuple[Any, ...]            # every document, in the order given at compile time
    members: tuple[Member, ...]
    span: Span

    def inner(self) -> tuple:
        return tuple(member.steps for member in self.members)


Step = Union[Hole, Branch, Nested, Documents]


@dataclass(frozen=True)
class TailPiece:
    kind: str                          # "text", "open" or "close"
    role: str = ""
    nodes: tuple = ()                  # text: the Jinja2 nodes it renders
    template: jinja2.Template | None = None


@dataclass(frozen=True)
class TemplatePlan:
    name: str                          # the template's loader name
    schema: nodes.Schema
    root: str                          # the root module's name
    steps: tuple[Step, ...]
    tail: tuple[TailPiece, ...]
    tail_start: Span | None            # where the uncached part starts; None: all cached
    tail_reason: str                   # why it starts there ("`question` has no length bound")
    documents: Sequence[str]           # the variables documents loops read
