"""The layout: the position id of every token of a schema, for one tokenizer.

Walk the schema in document order. Each text run (text between structural
tags; comments are invisible and do not split a run) is tokenized on its own,
cut where the whole text's tokens are cut (`encode_run`): where the tokenizer
joins a space to the next word, a space ending the text before a parameter is
the slot's first position (each argument is tokenized with it) and a space
ending the schema is given to the prompt's own text (`tail_lead`).
A module starts where its previous sibling ended; the members of a union all
start at the union's start and the union reserves its longest member; a
parameter reserves `length` positions (one more with its lead); the tokenizer's
prefix (a BOS) sits at position 0. Positions of modules a prompt does not import are simply absent
from that request.

The layout also names the *units* the encoder works in: one per module (its own
tokens, not its children's) and one per scaffold (its modules' tokens, encoded
jointly). A unit's `context` lists the units its tokens may attend to under the
guaranteed-context rule: the schema root and the module's ancestors.

Size is checked before it is built: a first pass sums what the parameters reserve
(no tokenizing, no allocation) and fails at the parameter that passes the model's
context, or `nodes.MAX_POSITIONS` in all (the same bound stands in for the context
when the tokenizer does not know it); the walk checks each slot again before filling
it, and slots without `scaffold=` text share one filler tuple per length. Text (a
`src=` document included) is bounded before it is tokenized: a run whose fewest
possible tokens (`min_token_count`) already pass the limit fails without encoding.

`lay_out` is pure and memoised per (schema, tokenizer fingerprint).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Mapping

from promptlang.errors import ContextLengthError, SchemaError, Span
from promptlang.pml import nodes
from promptlang.tokenizer import Tokenizer, encode_run, joins_space_to_word, min_token_count

ModulePath = tuple[str, ...]          # () is the schema root (its anonymous text)
# prefix: the tokenizer's BOS; text/role: schema text and chat-role affixes; param:
# placeholders in a parameter slot; argument: a prompt's argument; prompt: prompt text
SegmentKind = Literal["prefix", "text", "role", "param", "argument", "prompt"]


@dataclass(frozen=True)
class Segment:
    """Tokens at consecutive positions [start, start + len(token_ids))."""

    token_ids: tuple[int, ...]
    start: int
    kind: SegmentKind
    param: str | None = None          # for "param" (placeholders) and "argument" segments
    text: str = ""                    # the source text these tokens came from
    role: str | None = None           # for "role" segments: "user" opens, "/user" closes
    span: Span | None = field(default=None, compare=False, repr=False)

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)

    @property
    def positions(self) -> range:
        return range(self.start, self.end)


@dataclass(frozen=True)
class ParamSlot:
    """A parameter's positions. `lead` is text taken from before the parameter (a space,
    where the tokenizer joins it to the next word): an argument is tokenized with it, and
    `length` counts one position for it beyond the parameter's own bound."""

    name: str
    start: int
    length: int
    span: Span | None = field(default=None, compare=False)
    lead: str = ""


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
    # a space taken from the end of its text where the schema ends there: the prompt's own
    # text after the schema starts with it (a tokenizer that joins a space to the next word
    # then tokenizes that word as the whole text does)
    tail_lead: str = ""

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


def role_segment(tokenizer: Tokenizer, marker: nodes.RoleOpen | nodes.RoleClose, pos: int,
                 kind: SegmentKind = "role") -> Segment:
    """The chat template's prefix (RoleOpen) or suffix (RoleClose) text of a role, at `pos`."""
    prefix, suffix = tokenizer.role_affixes(marker.role)
    opening = isinstance(marker, nodes.RoleOpen)
    text = prefix if opening else suffix
    ids = tokenizer.role_affix_ids(marker.role)[0 if opening else 1]   # may hold control ids
    return Segment(ids, pos, kind, text=text,
                   role=marker.role if opening else "/" + marker.role, span=marker.span)


def text_follows(tokenizer: Tokenizer, marker: nodes.RoleOpen | nodes.RoleClose) -> bool:
    """Whether the role marker's text starts as plain text (a plain format's "User: "),
    not with a control token, before which the text of a run ends as at the prompt's end."""
    prefix_ids, suffix_ids = tokenizer.role_affix_ids(marker.role)
    ids = prefix_ids if isinstance(marker, nodes.RoleOpen) else suffix_ids
    return not ids or ids[0] not in tokenizer.control_ids


_memo: dict[tuple[int, str], tuple[nodes.Schema, SchemaLayout]] = {}
_MEMO_SIZE = 64


def lay_out(schema: nodes.Schema, tokenizer: Tokenizer) -> SchemaLayout:
    """Positions for every token of `schema` under `tokenizer` (memoised)."""
    memo_key = (hash(schema), tokenizer.fingerprint)
    hit = _memo.get(memo_key)
    if hit is not None and hit[0] == schema:
        return hit[1]
    layout = _Walker(tokenizer).run(schema)
    if len(_memo) >= _MEMO_SIZE:
        _memo.pop(next(iter(_memo)))
    _memo[memo_key] = (schema, layout)
    return layout


class _Walker:
    """One document-order walk that assigns positions and collects units."""

    def __init__(self, tokenizer: Tokenizer):
        self.tok = tokenizer
        known = tokenizer.max_positions
        self.limit = min(known, nodes.MAX_POSITIONS) if known else nodes.MAX_POSITIONS
        self.limit_text = (f"the model has {known}" if known else
                           f"a layout holds at most {nodes.MAX_POSITIONS} when the model's "
                           "context is unknown")
        self.fillers: dict[int, tuple[int, ...]] = {}   # placeholder runs, shared per length
        self.modules: dict[ModulePath, ModuleLayout] = {}
        self.unions: list[UnionLayout] = []
        self.scaffolds: dict[str, tuple[ModulePath, ...]] = {}
        self.schema_name = ""
        self.first_over: Span | None = None     # the first segment's past the limit
        self.tail_leads: dict[ModulePath, str] = {}

    def run(self, schema: nodes.Schema) -> SchemaLayout:
        self.schema_name = schema.name
        prefix = tuple(self.tok.prefix_ids)
        self._check_reservation(schema, len(prefix))
        own = [Segment(prefix, 0, "prefix", text=self.tok.decode(prefix))] if prefix else []
        params: list[ParamSlot] = []
        children: list[ModulePath] = []
        end = self._lay_children(schema.children, (), len(prefix), own, params, children,
                                 cache=True, at_end=True)
        root = ModuleLayout((), 0, end, tuple(own), (), tuple(children), True, None, None,
                            schema.span, tail_lead=self.tail_leads.get((), ""))
        modules = {(): root, **self.modules}
        if end > self.limit:
            over = next((seg.span for m in modules.values() for seg in m.segments
                         if seg.end > self.limit and seg.span is not None), schema.span)
            raise ContextLengthError(
                f"schema {schema.name!r} needs {end} positions; {self.limit_text}", over)
        return SchemaLayout(schema, self.tok.fingerprint, modules, tuple(self.unions),
                            dict(self.scaffolds), self._units(modules), end)

    def _lay_children(self, children, path: ModulePath, pos: int, own: list[Segment],
                      params: list[ParamSlot], child_paths: list[ModulePath],
                      cache: bool, scaffold: str | None = None, at_end: bool = False) -> int:
        """Lay out `children` of the module at `path` from `pos`; return the end position.
        `at_end`: nothing of the schema follows these children."""
        run: list[str] = []                       # pending text of the current run
        span: list[Span | None] = [None]          # where the pending run starts
        last = max((i for i, c in enumerate(children) if not isinstance(c, nodes.Comment)),
                   default=-1)

        def flush(pos: int, followed: bool = True) -> int:
            text = "".join(run)
            run.clear()
            if not text:
                return pos
            least = pos + min_token_count(self.tok, text)
            if least > self.limit:               # cannot fit: fail before tokenizing
                raise ContextLengthError(
                    f"schema {self.schema_name!r} needs at least {least} positions; "
                    f"{self.limit_text}", self.first_over or span[0])
            ids = tuple(encode_run(self.tok, text, followed=followed))
            self._note_over(pos + len(ids), span[0])
            own.append(Segment(ids, pos, "text", text=text, span=span[0]))
            return pos + len(ids)

        for index, child in enumerate(children):
            ends = at_end and index == last       # the schema ends with this child
            if isinstance(child, nodes.Text):
                if not run:
                    span[0] = child.span
                run.append(child.text)
            elif isinstance(child, nodes.Comment):
                continue
            elif isinstance(child, (nodes.RoleOpen, nodes.RoleClose)):
                pos = flush(pos, text_follows(self.tok, child))
                segment = role_segment(self.tok, child, pos)
                self._note_over(segment.end, segment.span)
                own.append(segment)
                pos = segment.end
            elif isinstance(child, nodes.Param):
                lead = self._take_lead(run)
                pos = flush(pos)
                length = child.length + len(lead)
                if pos + length > self.limit:
                    raise ContextLengthError(
                        f"parameter {child.name!r} reserves {length} positions from "
                        f"position {pos}, to {pos + length}; {self.limit_text}",
                        child.span)
                ids = self._placeholder(child, lead)
                own.append(Segment(ids, pos, "param", param=child.name, span=child.span))
                params.append(ParamSlot(child.name, pos, length, child.span, lead))
                pos += length
            elif isinstance(child, nodes.Module):
                pos = flush(pos)
                child_paths.append(path + (child.name,))
                pos = self._lay_module(child, path, pos, cache, None, scaffold, ends)
            elif isinstance(child, nodes.Union):
                pos = flush(pos)
                pos = self._lay_union(child, path, pos, child_paths, cache, ends)
            elif isinstance(child, nodes.Scaffold):
                pos = flush(pos)
                members = []
                for member in child.members:
                    child_paths.append(path + (member.name,))
                    members.append(path + (member.name,))
                    pos = self._lay_module(member, path, pos, cache, None, child.name)
                self.scaffolds[child.name] = tuple(members)
            else:  # pragma: no cover - the parser admits nothing else
                raise SchemaError(f"unexpected {type(child).__name__} in a schema",
                                  getattr(child, "span", None))
        if at_end:
            self.tail_leads[path] = self._take_lead(run)
        return flush(pos)

    def _lay_module(self, module: nodes.Module, parent: ModulePath, start: int,
                    cache: bool, union: int | None, scaffold: str | None,
                    at_end: bool = False) -> int:
        path = parent + (module.name,)
        cache = cache and module.cache
        own: list[Segment] = []
        params: list[ParamSlot] = []
        children: list[ModulePath] = []
        self.modules[path] = None  # type: ignore[assignment]  # keeps document order
        end = self._lay_children(module.children, path, start, own, params, children, cache,
                                 at_end=at_end)
        self.modules[path] = ModuleLayout(path, start, end, tuple(own), tuple(params),
                                          tuple(children), cache, union, scaffold, module.span,
                                          tail_lead=self.tail_leads.get(path, ""))
        return end

    def _lay_union(self, union: nodes.Union, parent: ModulePath, start: int,
                   child_paths: list[ModulePath], cache: bool, at_end: bool = False) -> int:
        index = len(self.unions)
        self.unions.append(None)  # type: ignore[arg-type]  # reserve the index
        end = start
        members = []
        for member in union.members:
            path = parent + (member.name,)
            child_paths.append(path)
            members.append(path)
            end = max(end, self._lay_module(member, parent, start, cache, index, None, at_end))
        self.unions[index] = UnionLayout(index, parent, start, end - start, tuple(members),
                                         union.span)
        return end

    def _take_lead(self, run: list[str]) -> str:
        """The space that ends the pending run, taken from it, where the tokenizer joins a
        space to the word after it (the parameter's argument then starts with it); else ""."""
        if not run or not run[-1].endswith(" ") or not joins_space_to_word(self.tok):
            return ""
        run[-1] = run[-1][:-1]
        return " "

    def _placeholder(self, param: nodes.Param, lead: str) -> tuple[int, ...]:
        length = param.length + len(lead)
        if not param.scaffold:
            filler = self.fillers.get(length)
            if filler is None:
                filler = self.fillers[length] = (self.tok.placeholder_id,) * length
            return filler
        least = min_token_count(self.tok, param.scaffold)
        if least > param.length:                # cannot fit: fail before tokenizing
            raise SchemaError(
                f"the scaffold text of parameter {param.name!r} has at least {least} "
                f"tokens; the parameter reserves {param.length}", param.span)
        ids = encode_run(self.tok, lead + param.scaffold, followed=True)
        if len(ids) > length:
            raise SchemaError(
                f"the scaffold text of parameter {param.name!r} has {len(ids) - len(lead)} "
                f"tokens; the parameter reserves {param.length}", param.span)
        return tuple(ids) + (self.tok.placeholder_id,) * (length - len(ids))

    def _note_over(self, end: int, span: Span | None) -> None:
        """Remember the first segment (walk order) that ends past the limit."""
        if end > self.limit and self.first_over is None and span is not None:
            self.first_over = span

    def _check_reservation(self, schema: nodes.Schema, start: int) -> None:
        """Fail at the first parameter whose slot passes the limit, counting parameter
        slots only (text is tokenized later), or past MAX_POSITIONS reserved in all --
        before a token is encoded or a slot allocated."""
        total = 0

        def walk(children, pos: int) -> int:
            nonlocal total
            for child in children:
                if isinstance(child, nodes.Param):
                    length = child.length
                    if not isinstance(length, int) or isinstance(length, bool) or length < 1:
                        raise SchemaError(f"parameter {child.name!r} must reserve a positive "
                                          f"whole number of positions, not {length!r}",
                                          child.span)
                    if pos + length > self.limit:
                        raise ContextLengthError(
                            f"parameter {child.name!r} reserves {length} positions: with the "
                            f"parameters before it the schema needs at least {pos + length}; "
                            f"{self.limit_text}", child.span)
                    total += length
                    if total > nodes.MAX_POSITIONS:
                        raise ContextLengthError(
                            f"the schema's parameters reserve more than {nodes.MAX_POSITIONS} "
                            f"positions in all (union members and modules counted one by "
                            f"one), passed at parameter {child.name!r}", child.span)
                    pos += length
                elif isinstance(child, nodes.Module):
                    pos = walk(child.children, pos)
                elif isinstance(child, nodes.Scaffold):
                    for member in child.members:
                        pos = walk(member.children, pos)
                elif isinstance(child, nodes.Union):
                    pos = max((walk(m.children, pos) for m in child.members), default=pos)
            return pos

        walk(schema.children, start)

    def _units(self, modules: dict[ModulePath, ModuleLayout]) -> dict[str, Unit]:
        units: dict[str, Unit] = {}
        for path, module in modules.items():
            context = tuple(module_unit_id(path[:i]) for i in range(len(path)))
            units[module_unit_id(path)] = Unit(module_unit_id(path), (path,), module.segments,
                                               context, module.cache)
        for name, members in self.scaffolds.items():
            segments = tuple(s for m in members for s in modules[m].segments)
            parent = members[0][:-1] if members else ()
            context = tuple(module_unit_id(parent[:i]) for i in range(len(parent) + 1))
            cache = all(modules[m].cache for m in members)
            units[scaffold_unit_id(name)] = Unit(scaffold_unit_id(name), members,
                                                 tuple(sorted(segments, key=lambda s: s.start)),
                                                 context, cache)
        return units
