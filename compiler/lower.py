"""Lowering: a function's IR -> what is cached (a `plan.FunctionPlan`) and its PML.

Runs once per @prompt function, the first time it is called or its schema is
asked for, when the module that defines it (and its callees) is complete. Names
(callees, role helpers) and length bounds are resolved first (`resolve.py`); then
the body is walked in source order and split in two:

- the *cached* part: everything before the first text that cannot be laid out
  statically (a hole without a bound, a loop or `try` that emits text, a call to
  a non-@prompt function, a callee that ends in such text). It becomes the
  function's module: Text, Param, role markers, child modules for `if` arms,
  `match` cases and @prompt calls (named by `names.py`), unions for alternatives;
- the *tail*: everything after. It runs as plain Python at call time and becomes
  the prompt's uncached text. A separate literal text statement in the tail is an
  error located at what started the tail: it looks cached but cannot be.

A call to `gen()` / `select()` (`generation.py`) also starts the tail, and lifts
that rule: text after a generation is live text of a program run, which could
never be cached, so it is no error (`promptlang/programs.py` runs it on a session).

The result is one `PlannedItem` per item (and arm): what `trace.py` needs to know
when the instrumented body reports the item.
"""

from __future__ import annotations

import builtins
import weakref
from dataclasses import dataclass
from typing import Any

import promptlang.compiler.ir as ir   # not `from promptlang.compiler`: that names the package
from promptlang.compiler.diagnostics import Diagnostic, errors
from promptlang.compiler.generate_calls import is_generator
from promptlang.compiler.markers import RoleHelper
from promptlang.compiler.names import arm_base, module_base, param_base
from promptlang.compiler.plan import FunctionPlan, PlannedItem, merge_text, prompt_function_of
from promptlang.compiler.resolve import bound, read_bounds, resolve, warn_unused_bounds
from promptlang.errors import CompileError, Span
from promptlang.pml import nodes

_KINDS = {ir.TextItem: "text", ir.ValueItem: "value", ir.FStringItem: "fstring",
          ir.CallItem: "call", ir.AssignCallItem: "assign", ir.BranchItem: "branch",
          ir.BlockItem: "block", ir.ReturnItem: "return"}


@dataclass(frozen=True)
class _Source:
    """Something that starts the uncached tail."""

    code: str
    what: str
    span: Span
    generation: bool = False       # a gen()/select(): what follows is live program text


@dataclass
class _Flow:
    sources: tuple[_Source, ...] = ()
    cuts: tuple[ir.ReturnItem, ...] = ()


# The most @prompt calls that may nest below one function, itself included: each call is a
# module inside its caller's, each branch a union and a module, and PML nests elements at
# most 100 deep (promptlang/pml/parser.py MAX_DEPTH).
MAX_CALL_DEPTH = 48


def call_depth(function) -> int:
    """The longest chain of @prompt calls from `function` (itself 1; a recursive call adds
    nothing: PL108 reports it), computed once per function from the analysed calls, without
    planning and without recursion (a chain of thousands costs no Python stack)."""
    known = _CALL_DEPTHS.get(function)
    if known is not None:
        return known
    stack = [(function, iter(_callees(function)))]
    on_path = {function}
    best = {function: 1}
    while stack:
        current, pending = stack[-1]
        callee = next(pending, None)
        if callee is None:
            stack.pop()
            on_path.discard(current)
            _CALL_DEPTHS[current] = best[current]
            if stack:
                caller = stack[-1][0]
                best[caller] = max(best[caller], 1 + best[current])
            continue
        if callee in on_path:
            continue
        done = _CALL_DEPTHS.get(callee)
        if done is not None:
            best[current] = max(best[current], 1 + done)
            continue
        on_path.add(callee)
        best[callee] = 1
        stack.append((callee, iter(_callees(callee))))
    return _CALL_DEPTHS[function]


_CALL_DEPTHS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _callees(function) -> list:
    """The @prompt functions `function`'s call statements name (as resolved now)."""
    fir = function.analysis.ir
    if fir is None:
        return []
    found = []
    for item in fir.walk():
        if isinstance(item, ir.CallItem):
            target = prompt_function_of(resolve(function, fir, item.path))
            if target is not None and target not in found:
                found.append(target)
    return found


def plan_function(function, stack: tuple = ()) -> FunctionPlan:
    """The plan of `function` (a PromptFunction); raises CompileError with every error."""
    analysis = function.analysis
    if analysis.ir is None:
        raise CompileError(analysis.diagnostics)
    planner = _Planner(function, analysis.ir, stack)
    return planner.run()


def schema_of(function) -> nodes.Schema:
    plan = function.plan()
    root = nodes.Module(plan.module_name, plan.children, span=plan.ir.span)
    return nodes.Schema(function.schema_name, (root,), span=plan.ir.span)


class _Planner:
    def __init__(self, function, fir: ir.FunctionIR, stack: tuple):
        self.function = function
        self.ir = fir
        self.stack = stack
        self.diagnostics: list[Diagnostic] = list(function.analysis.diagnostics)
        self.notes: dict[int, dict[str, Any]] = {}   # item id -> its PlannedItem's fields
        self.own: list[int] = []                     # the function module's own items
        self.used_names: dict[int | None, set[str]] = {}
        self.used_params: dict[int | None, set[str]] = {}
        self.resolved: dict[int, Any] = {}           # call id -> what its callee names
        self.callee_plans: dict[int, FunctionPlan] = {}
        self.reported: set = set()           # sources and cuts already reported
        self.broken: set[int] = set()        # calls whose callee has errors of its own
        self.first_text: Span | None = None

    def report(self, code: str, message: str, span: Span | None, suggestion: str | None = None):
        self.diagnostics.append(Diagnostic(code, message, span, suggestion))

    # -- the whole function ---------------------------------------------------------------

    def run(self) -> FunctionPlan:
        self.note_items()
        self.bounds, declared = read_bounds(self.function, self.ir, self.report)
        self.resolve_names()
        root: list = []
        flow = self.walk(self.ir.body, None, root, _Flow())
        warn_unused_bounds(self.ir, self.bounds, declared, self.report)
        if errors(self.diagnostics):
            raise CompileError(self.diagnostics)
        items = {i: PlannedItem(id=i, **{k: tuple(v) if isinstance(v, list) else v
                                         for k, v in note.items()})
                 for i, note in self.notes.items()}
        return FunctionPlan(
            function=self.function, ir=self.ir, module_name=module_base(self.ir.name),
            children=merge_text(root), own=tuple(self.own), items=items,
            has_tail=bool(flow.sources), first_text=self.first_text,
            diagnostics=tuple(d for d in self.diagnostics if d.severity != "error"),
            generates=any(source.generation for source in flow.sources))

    def note_items(self) -> None:
        """What every item means, cached or not: its kind, place and fixed content."""
        for item in self.ir.walk():
            if isinstance(item, ir.RoleItem):
                for kind, item_id in (("open", item.open_id), ("close", item.close_id)):
                    self.notes[item_id] = {"kind": kind, "span": item.span, "role": item.role}
                continue
            note = self.notes[item.id] = {"kind": _KINDS[type(item)], "span": item.span}
            if isinstance(item, ir.TextItem):
                note["text"] = item.text
            elif isinstance(item, ir.FStringItem):
                note["parts"] = tuple(None if isinstance(p, ir.Hole) else p for p in item.parts)
            elif isinstance(item, ir.BranchItem):
                for arm in item.arms:
                    self.notes[arm.id] = {"kind": "arm", "span": arm.span}

    def is_generation(self, item) -> bool:
        note = self.notes.get(getattr(item, "id", None))
        return note is not None and note["kind"] == "generation"

    def bound(self, hole: ir.Hole) -> int | None:
        return bound(self.bounds, hole)

    # -- names ------------------------------------------------------------------------------

    def resolve_names(self) -> None:
        for item in self.ir.walk():
            if isinstance(item, ir.CallItem):
                self.resolve_call(item)
            elif isinstance(item, ir.AssignCallItem):
                if is_generator(self.resolve(item.path)):
                    self.notes[item.id]["kind"] = "generation"
            elif isinstance(item, ir.RoleItem):
                helper = self.resolve(item.path)
                if not (isinstance(helper, RoleHelper) and helper.role == item.role):
                    self.report("PL106", f"`{'.'.join(item.path)}` here is not promptlang's "
                                         f"{item.role} role helper", item.span,
                                f"import it: from promptlang import {item.role}")
        for call in self.ir.expression_calls:
            resolved = self.resolve(call.path)
            if is_generator(resolved):
                self.report("PL110", f"`{call.code}(...)` generates inside an expression; the "
                                     "compiler must see where generation starts", call.span)
            target = prompt_function_of(resolved)
            if target is not None:
                self.report("PL107", f"`{call.code}` is a @prompt function called inside an "
                                     "expression; its text would be lost", call.span)

    def resolve_call(self, item: ir.CallItem) -> None:
        self.resolved[item.id] = self.resolve(item.path)
        if is_generator(self.resolved[item.id]):
            self.notes[item.id]["kind"] = "generation"
        target = prompt_function_of(self.resolved[item.id])
        self.notes[item.id]["callee"] = target
        if target is None:
            return
        if target is self.function or target in self.stack:
            chain = " -> ".join(f.__qualname__ for f in (*self.stack, self.function, target))
            self.report("PL108", f"recursive @prompt call: {chain}", item.span)
            self.notes[item.id]["callee"] = None
            return
        depth = call_depth(target)
        if depth >= MAX_CALL_DEPTH:
            self.report("PL112", f"@prompt calls nest {depth + 1} deep from "
                                 f"{self.function.__qualname__} through "
                                 f"{target.__qualname__}; a schema holds at most "
                                 f"{MAX_CALL_DEPTH}", item.span)
            self.notes[item.id]["callee"] = None
            return
        try:
            self.callee_plans[item.id] = target.plan(self.stack + (self.function,))
        except CompileError as e:
            self.diagnostics.extend(e.diagnostics)
            self.broken.add(item.id)

    def resolve(self, path: tuple[str, ...] | None):
        return resolve(self.function, self.ir, path)

    def unique(self, key: int | None, base: str, table: dict) -> str:
        used = table.setdefault(key, set())
        name = base
        n = 1
        while name in used:
            n += 1
            name = f"{base}-{n}"
        used.add(name)
        return name

    # -- the walk: cached part and tail ------------------------------------------------------

    def keep(self, item_id: int, key: int | None, span: Span, flow: _Flow,
             own: bool = True) -> None:
        """Record a cached item (an own item of module `key` unless it opens a child
        module); a `return` that may run before it is an error."""
        for cut in flow.cuts:
            if cut not in self.reported:
                self.reported.add(cut)
                self.report("PL207", f"`return` here skips cached text that follows "
                                     f"({_where(span, cut.span)})", cut.span)
        self.notes[item_id]["cached"] = True
        if own:
            (self.own if key is None else self.notes[key].setdefault("own", [])).append(item_id)

    def walk(self, items, key: int | None, out: list, flow: _Flow) -> _Flow:
        for item in items:
            if flow.sources:
                flow = _Flow(self.tail(item, flow.sources), flow.cuts)
            else:
                flow = self.cached_item(item, key, out, flow)
        return flow

    def source_of(self, item) -> _Source | None:
        """What `item` starts the uncached tail with, if it does."""
        if self.is_generation(item):
            return _Source("PL204", f"`{item.code}(...)` generates", item.span, generation=True)
        if isinstance(item, ir.ValueItem) and self.bound(item.hole) is None:
            return _Source("PL203", f"`{item.hole.code}` has no length bound", item.hole.span)
        if isinstance(item, ir.FStringItem):
            unbounded = [h for h in item.holes if self.bound(h) is None]
            if unbounded:
                return _Source("PL203", f"the f-string hole `{{{unbounded[0].code}}}` has no "
                                        "length bound", unbounded[0].span)
        if isinstance(item, ir.BlockItem) and self.emits(item.body):
            code = {"for": "PL201", "while": "PL202", "try": "PL205", "with": "PL206"}[item.kind]
            what = {"for": "this `for` loop", "while": "this `while` loop",
                    "try": "this `try` statement",
                    "with": "this `with` block (not a role block)"}[item.kind]
            return _Source(code, what + " emits text", item.span,
                           generation=any(self.is_generation(i) for i in ir.walk_items(item.body)))
        if isinstance(item, ir.CallItem) and item.id not in self.broken:
            if self.resolved.get(item.id) is builtins.print:
                return None       # print() returns None: it emits nothing
            if self.notes[item.id].get("callee") is None:
                return _Source("PL204", f"`{item.code}` is not a @prompt function (or cannot be "
                                        "resolved before the call), so its result is text "
                                        "without a bound", item.span)
            if self.callee_plans[item.id].has_tail:
                return _Source("PL208", f"`{item.code}` ends in uncached text", item.span,
                               generation=self.callee_plans[item.id].generates)
        return None

    def cached_item(self, item, key, out: list, flow: _Flow) -> _Flow:
        source = self.source_of(item)
        if isinstance(item, ir.TextItem):
            self.keep(item.id, key, item.span, flow)
            if item.text:
                self.first_text = self.first_text or item.span
                out.append(nodes.Text(item.text, item.span))
        elif isinstance(item, (ir.ValueItem, ir.FStringItem)) and source is None:
            self.keep(item.id, key, item.span, flow)
            names = []
            parts = (item.hole,) if isinstance(item, ir.ValueItem) else item.parts
            for part in parts:
                if isinstance(part, ir.Hole):
                    names.append(self.unique(key, param_base(part), self.used_params))
                    out.append(nodes.Param(names[-1], self.bound(part), span=part.span))
                else:
                    self.first_text = self.first_text or item.span
                    out.append(nodes.Text(part, item.span))
            self.notes[item.id]["params"] = tuple(names)
        elif isinstance(item, ir.RoleItem):
            self.keep(item.open_id, key, item.span, flow)
            out.append(nodes.RoleOpen(item.role, item.span))
            flow = self.walk(item.body, key, out, flow)
            if not flow.sources:
                self.keep(item.close_id, key, item.span, flow)
                out.append(nodes.RoleClose(item.role, item.span))
        elif isinstance(item, ir.BranchItem):
            flow = self.cached_branch(item, key, out, flow)
        elif isinstance(item, ir.CallItem) and item.id in self.callee_plans:
            self.cached_call(item, key, out, flow)
        elif isinstance(item, ir.BlockItem) and not self.emits(item.body):
            flow = _Flow(flow.sources, flow.cuts + tuple(
                r for r in ir.walk_items(item.body) if isinstance(r, ir.ReturnItem)))
        elif isinstance(item, ir.ReturnItem):
            flow = _Flow(flow.sources, flow.cuts + (item,))
        if source is not None:
            flow = _Flow(flow.sources + (source,), flow.cuts)
        return flow

    def cached_branch(self, item: ir.BranchItem, key, out: list, flow: _Flow) -> _Flow:
        members: list[nodes.Module] = []
        sources = flow.sources
        cuts = flow.cuts
        for arm in item.arms:
            arm_out: list = []
            arm_flow = self.walk(arm.body, arm.id, arm_out, _Flow((), flow.cuts))
            sources += tuple(s for s in arm_flow.sources if s not in sources)
            cuts += tuple(c for c in arm_flow.cuts if c not in cuts)
            children = merge_text(arm_out)
            if children:
                name = self.unique(key, arm_base(item, arm), self.used_names)
                self.notes[arm.id]["module"] = name
                self.keep(arm.id, key, arm.span, flow, own=False)
                members.append(nodes.Module(name, children, span=arm.span))
        if len(members) == 1:
            out.append(members[0])
        elif members:
            out.append(nodes.Union(tuple(members), span=item.span))
        return _Flow(sources, cuts)

    def cached_call(self, item: ir.CallItem, key, out: list, flow: _Flow) -> None:
        plan = self.callee_plans[item.id]
        if plan.children:
            self.keep(item.id, key, item.span, flow, own=False)
            name = self.unique(key, plan.module_name, self.used_names)
            self.notes[item.id]["module"] = name
            out.append(nodes.Module(name, plan.children, span=item.span))
            self.first_text = self.first_text or plan.first_text

    def tail(self, item, sources: tuple[_Source, ...]) -> tuple[_Source, ...]:
        """`item` comes after uncached text: literal text in it is an error. Returns the
        sources of uncached text known after it."""
        source = self.source_of(item)
        if isinstance(item, ir.TextItem) and item.text:
            self.cached_after(sources, item.span)
        elif isinstance(item, ir.FStringItem) and source is None:
            if any(isinstance(p, str) for p in item.parts):
                self.cached_after(sources, item.span)
        elif isinstance(item, ir.RoleItem):
            for inner in item.body:
                sources = self.tail(inner, sources)
        elif isinstance(item, ir.BranchItem):
            after = sources
            for arm in item.arms:
                arm_sources = sources
                for inner in arm.body:
                    arm_sources = self.tail(inner, arm_sources)
                after += tuple(s for s in arm_sources if s not in after)
            sources = after
        elif isinstance(item, ir.CallItem):
            plan = self.callee_plans.get(item.id)
            if plan is not None and plan.first_text is not None:
                self.cached_after(sources, plan.first_text,
                                  f"the text of `{item.code}` called at line {item.span.line}")
        return sources if source is None else sources + (source,)

    def emits(self, items) -> bool:
        """Whether a block emits text (or generates): any item but a `return` and an
        assignment from a call that is not a generation."""
        return any(not isinstance(item, ir.ReturnItem) and not (
            isinstance(item, ir.AssignCallItem) and not self.is_generation(item))
            for item in ir.walk_items(items))

    def cached_after(self, sources, span: Span, what: str | None = None) -> None:
        if any(source.generation for source in sources):
            return       # after a generation, text is live program text: never cacheable
        for source in sources:
            if source in self.reported:
                continue
            self.reported.add(source)
            text = what or "cached text"
            self.report(source.code, f"{source.what} and comes before {text} "
                                     f"({_where(span, source.span)})", source.span)


# -- helpers -------------------------------------------------------------------------------


def _where(span: Span, relative_to: Span) -> str:
    if span.file == relative_to.file:
        return f"line {span.line}"
    return str(span)
