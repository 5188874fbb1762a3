"""The layout: the position id of every token of a schema, for one tokenizer.

Walk the schema in document order. Each text run (text between structural
tags; comments are invisible and do not split a run) is tokenized on its own.
A module starts where its previous sibling ended; the members of a union all
start at the union's start and the union reserves its longest member; a
parameter reserves `length` positions; the tokenizer's prefix (a BOS) sits at
position 0. Positions of modules a prompt does not import are simply absent
from that request.

The layout also names the *units* the encoder works in: one per module (its own
tokens, not its children's) and one per scaffold (its modules' tokens, encoded
jointly). A unit's `context` lists the units its tokens may attend to under the
guaranteed-context rule: the schema root and the module's ancestors.

`lay_out` is pure and memoised per (schema, tokenizer fingerprint).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Mapping

from promptlang.errors import ContextLengthError, SchemaError, Span
from promptlang.pml import nodes
from promptlang.tokenizer import Tokenizer

ModulePath = tuple[str, ...]          # () is the schema root (its anonymous text)
SegmentKind = Literal["prefix", "text", "role", "param", "argument", "prompt"]


@dataclass(frozen=True)
class Segment:
    """Tokens at consecutive positions [start, start + len(token_ids))."""

    token_ids: tuple[int, ...]
    start: int
    kind: SegmentKind
    param: str | None = None          # for "param" (placeholders) and "argument" segments
    text: str = ""                    # the source text these tokens came from

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)

    @property
    def positions(self) -> range:
        return range(self.start, self.end)


@dataclass(frozen=True)
class ParamSlot:
    name: str
    start: int
    length: int
    span: Span | None = field(default=None, compare=False)


@dataclass(frozen=True)
class ModuleLayout:
    """One module (or the root) laid out: its extent and its own tokens."""

    path: ModulePath
    start: int                        # first position of the module (children included)
    end: int                          # one past its last position
    segments: tuple[Segment, ...]     # its own tokens, position order, children excluded
    params: tuple[ParamSlot, ...]
    children: tuple[ModulePath, ...]  # direct child modules, union members included
    cache: bool                       # False for cache="false" modules and their subtrees
    union: int | None                 # index into SchemaLayout.unions when a union member
    scaffold: str | None              # the scaffold it belongs to, if any
    span: Span | None = field(default=None, compare=False)

    @property
    def name(self) -> str:
        return self.path[-1] if self.path else ""


@dataclass(frozen=True)
class UnionLayout:
    index: int
    parent: ModulePath
    start: int
    length: int                       # the longest member's length
    members: tuple[ModulePath, ...]
    span: Span | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Unit:
    """What the encoder computes in one forward pass."""

    id: str                           # "module:a/b", "module:" for the root, "scaffold:name"
    modules: tuple[ModulePath, ...]
    segments: tuple[Segment, ...]     # position order; intra-unit attention is causal by position
    context: tuple[str, ...]          # unit ids attended to under guaranteed context, root first
    cache: bool


@dataclass(frozen=True)
class SchemaLayout:
    schema: nodes.Schema
    tokenizer_fingerprint: str
    modules: Mapping[ModulePath, ModuleLayout]   # document order, root first
    unions: tuple[UnionLayout, ...]
    scaffolds: Mapping[str, tuple[ModulePath, ...]]
    units: Mapping[str, Unit]
    end: int                          # one past the schema's last position

    def module(self, path: ModulePath) -> ModuleLayout:
        return self.modules[path]


def module_unit_id(path: ModulePath) -> str:
    return "module:" + "/".join(path)


def scaffold_unit_id(name: str) -> str:
    return "scaffold:" + name


def lay_out(schema: nodes.Schema, tokenizer: Tokenizer) -> SchemaLayout:
    """Positions for every token of `schema` under `tokenizer` (memoised)."""
    raise NotImplementedError("being written")
