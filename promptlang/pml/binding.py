"""Binding: a prompt against its schema's layout -> what one request computes.

A bound prompt lists the cached units to serve (the root always; each imported
module, or a scaffold's joint unit when all of its modules are imported) and
the uncached segments computed per request, each at its layout position:
arguments in their parameter slots (a shorter argument leaves a gap), the own
tokens of imported `cache="false"` modules, and the prompt's text after the
schema's end.

Visibility (docs/DESIGN.md): a cached token attends to its own unit and its context
units at positions <= its own; an uncached token attends to every request token
(cached tokens of `units` except parameter placeholders, and uncached tokens)
whose position is <= its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from promptlang.errors import (ArgumentTooLongError, ContextLengthError, DuplicateNameError,
                               EmptyPromptError, MissingArgumentError, RoleError, Span,
                               TokenizerMismatchError, UnionConflictError, UnknownModuleError,
                               UnknownParameterError, UnknownSchemaError)
from promptlang.pml import nodes
from promptlang.pml.layout import (ModuleLayout, ModulePath, SchemaLayout, Segment,
                                   module_unit_id, role_segment, scaffold_unit_id, text_follows)
from promptlang.tokenizer import Tokenizer, encode_run, min_token_count


@dataclass(frozen=True)
class BoundPrompt:
    layout: SchemaLayout
    prompt: nodes.PromptDoc
    modules: tuple[ModulePath, ...]   # imported modules, document order, root first
    units: tuple[str, ...]            # cached unit ids served from the store, position order
    uncached: tuple[Segment, ...]     # computed per request, position order
    end: int                          # one past the request's last position

    def segments(self) -> list[tuple[Segment, str]]:
        """(segment, origin) of everything the model sees, position order, placeholders
        excluded. origin is a unit id, or "uncached"."""
        pieces = [(seg, unit) for unit in self.units for seg in self.layout.units[unit].segments
                  if seg.kind != "param"]
        pieces += [(seg, "uncached") for seg in self.uncached]
        return sorted(pieces, key=lambda piece: piece[0].start)

    def sequence(self) -> list[tuple[int, int, str]]:
        """(token id, position, origin) of every token the model sees, position order."""
        return [(token, seg.start + i, origin) for seg, origin in self.segments()
                for i, token in enumerate(seg.token_ids)]

    def token_ids(self) -> list[int]:
        """The request's tokens in position order (the baseline's input)."""
        return [t for t, _, _ in self.sequence()]

    @property
    def cached_token_count(self) -> int:
        return sum(len(seg.token_ids) for seg, origin in self.segments() if origin != "uncached")

    @property
    def uncached_token_count(self) -> int:
        return sum(len(seg.token_ids) for seg in self.uncached)

    def render(self) -> str:
        """The plain text the model would see without caching."""
        return "".join(seg.text for seg, _ in self.segments())


def bind(prompt: nodes.PromptDoc, layout: SchemaLayout, tokenizer: Tokenizer, *,
         add_generation_prompt: bool = False) -> BoundPrompt:
    """Validate `prompt` against `layout` and compute the request's pieces.

    With `add_generation_prompt`, a request that uses chat roles and leaves none open at
    its end gets the assistant's prefix appended (as `apply_chat_template` does), so the
    model answers as the assistant instead of opening a turn of its own."""
    return _Binder(layout, tokenizer).run(prompt, add_generation_prompt)


class _Binder:
    def __init__(self, layout: SchemaLayout, tokenizer: Tokenizer):
        if tokenizer.fingerprint != layout.tokenizer_fingerprint:
            raise TokenizerMismatchError(
                f"schema {layout.schema.name!r} was laid out for another tokenizer "
                f"({layout.tokenizer_fingerprint[:16]}), not {tokenizer.fingerprint[:16]}")
        self.layout = layout
        self.tok = tokenizer
        self.imported: dict[ModulePath, Span | None] = {(): None}
        self.union_choice: dict[int, tuple[ModulePath, Span | None]] = {}
        self.uncached: list[Segment] = []

    def run(self, prompt: nodes.PromptDoc, add_generation_prompt: bool = False) -> BoundPrompt:
        layout = self.layout
        if prompt.schema != layout.schema.name:
            raise UnknownSchemaError(
                f"prompt names schema {prompt.schema!r}, but it is bound against "
                f"{layout.schema.name!r}", prompt.span)
        for child in prompt.children:
            if isinstance(child, nodes.ModuleRef):
                self._import(child, ())
            elif isinstance(child, nodes.ScaffoldRef):
                self._import_scaffold(child)
        pos = layout.end
        run: list[nodes.Text] = []
        # the space the schema's last text gave up starts the prompt's own text
        lead = ["".join(layout.modules[path].tail_lead for path in self.imported)]

        def flush(pos: int, followed: bool) -> int:
            text = lead[0] + "".join(t.text for t in run)
            lead[0] = ""
            if not text:
                return pos
            ids = tuple(encode_run(self.tok, text, followed=followed))
            where = run[0].span if run else prompt.span
            self.uncached.append(Segment(ids, pos, "prompt", text=text, span=where))
            run.clear()
            return pos + len(ids)

        for child in prompt.children:
            if isinstance(child, nodes.Text):
                run.append(child)
            elif isinstance(child, (nodes.RoleOpen, nodes.RoleClose)):
                pos = flush(pos, text_follows(self.tok, child))
                segment = role_segment(self.tok, child, pos, kind="prompt")
                self.uncached.append(segment)
                pos = segment.end
        pos = flush(pos, followed=False)          # the answer follows
        adds = any(isinstance(c, (nodes.RoleOpen, nodes.RoleClose))
                   or (isinstance(c, nodes.Text) and c.text) for c in prompt.children)
        if len(self.imported) == 1 and not adds:
            raise EmptyPromptError("the prompt is empty: it imports no module and adds no text",
                                   prompt.span)

        modules = tuple(p for p in layout.modules if p in self.imported)
        units = self._units(modules)
        for path in modules:
            if not layout.modules[path].cache:
                self.uncached += [s for s in layout.modules[path].segments if s.kind != "param"]
        uncached = tuple(sorted((s for s in self.uncached if s.token_ids),
                                key=lambda s: s.start))
        bound = BoundPrompt(layout, prompt, modules, units, uncached, 0)
        used_roles, open_role = _check_roles(bound.segments(), prompt.span)
        if add_generation_prompt and used_roles and open_role is None:
            opening = role_segment(self.tok, nodes.RoleOpen("assistant"), pos, kind="prompt")
            uncached += (opening,) if opening.token_ids else ()
            bound = BoundPrompt(layout, prompt, modules, units, uncached, 0)
        sequence = bound.sequence()
        end = sequence[-1][1] + 1 if sequence else 0
        limit = self.tok.max_positions
        if limit is not None and end > limit:
            raise ContextLengthError(
                f"the prompt needs {end} positions; the model has {limit}", prompt.span)
        return BoundPrompt(layout, prompt, modules, units, uncached, end)

    def _import(self, ref: nodes.ModuleRef, parent: ModulePath) -> None:
        layout = self.layout
        path = parent + (ref.name,)
        module = layout.modules.get(path)      # parent + (name,): a child of parent if present
        if module is None:
            where = f"module {'/'.join(parent)!r}" if parent else f"schema {layout.schema.name!r}"
            known = ", ".join(p[-1] for p in layout.modules[parent].children) or "none"
            hint = ""
            elsewhere = [p for p in layout.modules if p and p[-1] == ref.name]
            if elsewhere:
                hint = f"; it is declared at {'/'.join(elsewhere[0])}: import it through its parent"
            raise UnknownModuleError(
                f"{where} has no module {ref.name!r} (known: {known}){hint}", ref.span)
        if path in self.imported:
            raise DuplicateNameError(f"module {'/'.join(path)!r} is imported twice", ref.span)
        if module.union is not None:
            chosen = self.union_choice.get(module.union)
            if chosen is not None:
                first, first_span = chosen
                at = f" (imported at {first_span})" if first_span else ""
                raise UnionConflictError(
                    f"{ref.name!r} and {first[-1]!r} are members of one union; a prompt may "
                    f"import at most one of them{at}", ref.span)
            self.union_choice[module.union] = (path, ref.span)
        self.imported[path] = ref.span
        self._arguments(ref, module)
        for child in ref.children:
            if isinstance(child, nodes.ModuleRef):
                self._import(child, path)

    def _import_scaffold(self, ref: nodes.ScaffoldRef) -> None:
        members = self.layout.scaffolds.get(ref.name)
        if members is None:
            known = ", ".join(self.layout.scaffolds) or "none"
            raise UnknownModuleError(f"schema {self.layout.schema.name!r} has no scaffold "
                                     f"{ref.name!r} (known: {known})", ref.span)
        for path in members:
            self._import(nodes.ModuleRef(path[-1], span=ref.span), path[:-1])

    def _arguments(self, ref: nodes.ModuleRef, module: ModuleLayout) -> None:
        slots = {slot.name: slot for slot in module.params}
        given = set()
        for arg in ref.args:
            slot = slots.get(arg.name)
            if slot is None:
                known = ", ".join(slots) or "none"
                raise UnknownParameterError(
                    f"module {ref.name!r} has no parameter {arg.name!r} (parameters: {known})",
                    arg.span)
            bound = slot.length - len(slot.lead)       # the parameter's own, as declared
            least = min_token_count(self.tok, arg.value)
            if least > bound:                   # cannot fit: fail before tokenizing
                raise ArgumentTooLongError(
                    f"argument for parameter {arg.name!r} is at least {least} tokens long; "
                    f"the parameter allows {bound}", arg.span,
                    parameter=arg.name, bound=bound, count=least)
            text = slot.lead + arg.value
            ids = tuple(encode_run(self.tok, text, followed=True))
            count = len(ids) - self._lead_alone(ids, slot.lead)
            if count > bound:
                raise ArgumentTooLongError(
                    f"argument for parameter {arg.name!r} is {count} tokens long; "
                    f"the parameter allows {bound}", arg.span,
                    parameter=arg.name, bound=bound, count=count)
            given.add(arg.name)
            self.uncached.append(Segment(ids, slot.start, "argument", param=arg.name,
                                         text=text, span=arg.span))
        missing = [name for name in slots if name not in given]
        if missing:
            raise MissingArgumentError(
                f"module {ref.name!r} needs an argument for parameter {missing[0]!r}",
                ref.span)

    def _lead_alone(self, ids: tuple[int, ...], lead: str) -> int:
        """1 where the argument's first token is the lead alone (a space the tokenizer did
        not join to the argument's first word), which the parameter's bound does not count;
        else 0."""
        return int(bool(lead) and bool(ids) and self.tok.decode(ids[:1]) == lead)

    def _units(self, modules: tuple[ModulePath, ...]) -> tuple[str, ...]:
        layout = self.layout
        units = []
        seen = set()
        whole = {}
        for path in modules:
            module = layout.modules[path]
            if not module.cache:
                continue
            scaffold = module.scaffold
            if scaffold is not None and scaffold not in whole:      # once per scaffold
                whole[scaffold] = all(m in self.imported for m in layout.scaffolds[scaffold])
            if scaffold is not None and whole[scaffold]:
                unit = scaffold_unit_id(scaffold)
                if unit not in seen:
                    seen.add(unit)
                    units.append(unit)
            else:
                units.append(module_unit_id(path))
        return tuple(units)


def _check_roles(segments: list[tuple[Segment, str]],
                 where: Span | None) -> tuple[bool, Segment | None]:
    """Role markers of one request must pair up; the last role may stay open.
    Returns whether any role marker was seen, and the role left open at the end."""
    open_role: Segment | None = None
    used = False
    for seg, _ in segments:
        if seg.role is None:
            continue
        used = True
        if not seg.role.startswith("/"):
            if open_role is not None:
                raise RoleError(f"<{seg.role}> opens while <{open_role.role}> is still open",
                                seg.span or where)
            open_role = seg
        elif open_role is None or open_role.role != seg.role[1:]:
            opened = f"<{open_role.role}> is open" if open_role else "no role is open"
            raise RoleError(f"<{seg.role}> closes a role that is not open ({opened})",
                            seg.span or where)
        else:
            open_role = None
    return used, open_role
