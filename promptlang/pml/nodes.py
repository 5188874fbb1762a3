"""The PML syntax tree: frozen dataclasses, each with the `span` it came from.

Spans never take part in equality, so `parse(write(tree)) == tree` compares
content only.

Role tags are *markers* (`RoleOpen`, `RoleClose`) rather than blocks: the
reference dialect lets a schema open `<user>` and a prompt close it, so a role
need not nest inside one element. Whether the markers of one request pair up is
checked when a prompt is bound (`binding.py`).

Schema children:   Text | Comment | RoleOpen | RoleClose | Module | Union | Scaffold
Module children:   Text | Comment | RoleOpen | RoleClose | Module | Union | Param
Union children:    Module | Comment
Scaffold children: Module | Comment
Prompt children:   Text | Comment | RoleOpen | RoleClose | ModuleRef | ScaffoldRef
ModuleRef children: ModuleRef | Comment
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Literal, Union as TypingUnion

from promptlang.errors import Span

ROLES = ("system", "user", "assistant")
# The most positions a parameter may reserve, and a layout may hold when the tokenizer
# does not know its model's context: past every context promptlang runs (2**24).
MAX_POSITIONS = 1 << 24
Role = Literal["system", "user", "assistant"]


def _span() -> Span | None:
    return field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class ParseWarning:
    """Something the parser accepted but the author may not have meant (a bare `<`
    read as text). Prints as `file:line:col: warning: message`."""

    message: str
    span: Span | None = None

    def __str__(self) -> str:
        return f"{self.span}: warning: {self.message}" if self.span else \
            f"warning: {self.message}"


def _warnings() -> tuple[ParseWarning, ...]:
    return field(default=(), compare=False, repr=False)


@dataclass(frozen=True)
class Text:
    """Literal text; the writer escapes it (or wraps it in CDATA) as needed."""

    text: str
    span: Span | None = _span()


@dataclass(frozen=True)
class Comment:
    """`<!-- text -->`: kept for round trips, ignored by the layout."""

    text: str
    span: Span | None = _span()


@dataclass(frozen=True)
class RoleOpen:
    """`<system>`, `<user>` or `<assistant>`: the role's prefix in the model's chat template."""

    role: Role
    span: Span | None = _span()


@dataclass(frozen=True)
class RoleClose:
    """`</system>`, `</user>` or `</assistant>`: the role's suffix in the chat template."""

    role: Role
    span: Span | None = _span()


@dataclass(frozen=True)
class Param:
    """`<param name len>` or `<parameter name length [scaffold]>`: `length` positions
    reserved for an argument supplied by each prompt. `scaffold` (reference dialect)
    is placeholder text encoded in the slot instead of the default filler."""

    name: str
    length: int
    scaffold: str | None = None
    span: Span | None = _span()


@dataclass(frozen=True)
class Module:
    """`<module name [cache="false"] [src="file"]>`: a unit of reuse. With `src`,
    `children` holds the file's text as one `Text` (the writer writes `src` back)."""

    name: str
    children: tuple["ModuleChild", ...] = ()
    cache: bool = True
    src: str | None = None
    span: Span | None = _span()


@dataclass(frozen=True)
class Union:
    """`<union [scaffold="member"]>`: at most one member per prompt; members share a
    start position. `scaffold` is accepted and validated, and changes nothing."""

    children: tuple[TypingUnion[Module, Comment], ...] = ()
    scaffold: str | None = None
    span: Span | None = _span()

    @property
    def members(self) -> tuple[Module, ...]:
        return tuple(c for c in self.children if isinstance(c, Module))


@dataclass(frozen=True)
class Scaffold:
    """`<scaffold name>`: modules encoded jointly (full attention among them)."""

    name: str
    children: tuple[TypingUnion[Module, Comment], ...] = ()
    span: Span | None = _span()

    @property
    def members(self) -> tuple[Module, ...]:
        return tuple(c for c in self.children if isinstance(c, Module))


@dataclass(frozen=True)
class Schema:
    """`<schema name>`: everything that may be reused, in document order.
    `base_dir` is where `src=` paths were resolved from (not compared); `recompute` is
    the schema's default recompute policy as written (stripped; the runtime parses it,
    locating its errors at `recompute_span`, not compared); `warnings` are the
    parser's (not compared)."""

    name: str
    children: tuple["SchemaChild", ...] = ()
    span: Span | None = _span()
    base_dir: str | None = field(default=None, compare=False, repr=False)
    recompute: str | None = None
    warnings: tuple[ParseWarning, ...] = _warnings()
    recompute_span: Span | None = _span()


@dataclass(frozen=True)
class Argument:
    """`name="value"` on a module reference: the argument for parameter `name`."""

    name: str
    value: str
    span: Span | None = _span()


@dataclass(frozen=True)
class ModuleRef:
    """`<name arg="value">...</name>` in a prompt: imports module `name`;
    nested refs import its children."""

    name: str
    args: tuple[Argument, ...] = ()
    children: tuple[TypingUnion["ModuleRef", Comment], ...] = ()
    span: Span | None = _span()


@dataclass(frozen=True)
class ScaffoldRef:
    """`<scaffold name="x"/>` in a prompt: imports all of scaffold x's modules."""

    name: str
    span: Span | None = _span()


@dataclass(frozen=True)
class PromptDoc:
    """`<prompt schema="name">`: imports, arguments and new (uncached) text; `warnings`
    are the parser's (not compared)."""

    schema: str
    children: tuple["PromptChild", ...] = ()
    span: Span | None = _span()
    warnings: tuple[ParseWarning, ...] = _warnings()


ModuleChild = TypingUnion[Text, Comment, RoleOpen, RoleClose, Module, Union, Param]
SchemaChild = TypingUnion[Text, Comment, RoleOpen, RoleClose, Module, Union, Scaffold]
PromptChild = TypingUnion[Text, Comment, RoleOpen, RoleClose, ModuleRef, ScaffoldRef]
Node = TypingUnion[Schema, Module, Union, Scaffold, Param, Text, Comment, RoleOpen, RoleClose,
                   PromptDoc, ModuleRef, ScaffoldRef, Argument]


def iter_modules(node: Schema | Module | Union | Scaffold,
                 path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Module]]:
    """Every module below `node` with its path of names, in document order."""
    for child in node.children:
        if isinstance(child, Module):
            yield path + (child.name,), child
            yield from iter_modules(child, path + (child.name,))
        elif isinstance(child, (Union, Scaffold)):
            yield from iter_modules(child, path)
