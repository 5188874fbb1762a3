"""Lowering: a function's IR -> what is cached (a `FunctionPlan`) and its PML.

Runs once per @prompt function, the first time it is called or its schema is
asked for, when the module that defines it (and its callees) is complete. Here
the compiler resolves names (callees, role helpers), reads length bounds, and
walks the body in source order to split it in two:

- the *cached* part: everything before the first text that cannot be laid out
  statically (a hole without a bound, a loop or `try` that emits text, a call to
  a non-@prompt function, a callee that ends in such text). It becomes the
  function's module: Text, Param, role markers, child modules for `if` arms,
  `match` cases and @prompt calls, unions for alternatives;
- the *tail*: everything after. It runs as plain Python at call time and becomes
  the prompt's uncached text. A separate literal text statement in the tail is an
  error located at what started the tail: it looks cached but cannot be.

A call to `gen()` / `select()` (`generation.py`) also starts the tail, and lifts
that rule: text after a generation is live text of a program run, which could
never be cached, so it is no error (`program.py` runs it against a session).

Names are derived from the source: a function's module is its name; an arm is
named after its condition or pattern (`city == "paris"` -> `city-paris`, `else`,
`case _` -> `default`); a call after its callee; `-2`, `-3` make siblings unique.
"""

from __future__ import annotations

import builtins
import inspect
import io
import re
import tokenize
import typing
from dataclasses import dataclass

from promptlang.compiler import ir
from promptlang.compiler.diagnostics import CompileError, Diagnostic, errors
from promptlang.compiler.generation import GENERATORS
from promptlang.compiler.markers import MaxTokens, RoleHelper, token_count_problem
from promptlang.errors import Span
from promptlang.pml import nodes

RESERVED = nodes.ROLES + ("scaffold",)
_NAME_CHARS = re.compile(r"[^\w.-]+")
_OPERATORS = {"<": "lt", "<=": "le", ">": "gt", ">=": "ge", "!=": "ne", "|": "or", "&": "and",
              "+": "plus", "-": "minus", "*": "times", "/": "div", "%": "mod", "~": "inv"}
_MAX_NAME = 40
_UNRESOLVED = object()


@dataclass
class FunctionPlan:
    """What one @prompt function caches, and what its run-time events mean."""

    function: typing.Any                       # the PromptFunction
    ir: ir.FunctionIR
    module_name: str                           # its module's name when it is a schema's root
    children: tuple                            # its module's content (PML nodes)
    cached: frozenset[int]                     # ids of items before the tail
    module_names: dict[int, str]               # arm / call id -> child module name
    param_names: dict[int, tuple[str, ...]]    # value / f-string id -> names of its holes
    texts: dict[int, str]                      # text id -> text
    fstrings: dict[int, tuple]                 # f-string id -> literal parts, None for holes
    roles: dict[int, str]                      # role open / close id -> role
    expected: dict[int | None, tuple[int, ...]]  # module key -> its own cached item ids
    callees: dict[int, typing.Any]             # call id -> PromptFunction, or None
    has_tail: bool                             # some call may end in uncached text
    first_text: Span | None                    # its first cached literal text
    spans: dict[int, Span]                     # item id -> where it is
    diagnostics: tuple[Diagnostic, ...] = ()   # warnings (errors raise)
    generations: frozenset[int] = frozenset()  # ids of gen()/select() calls
    generates: bool = False                    # some call may generate (a program)


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
        self.function, self.ir, self.stack = function, fir, stack
        self.diagnostics: list[Diagnostic] = list(function.analysis.diagnostics)
        self.cached: set[int] = set()
        self.module_names: dict[int, str] = {}
        self.param_names: dict[int, tuple[str, ...]] = {}
        self.texts: dict[int, str] = {}
        self.fstrings: dict[int, tuple] = {}
        self.roles: dict[int, str] = {}
        self.expected: dict[int | None, list[int]] = {None: []}
        self.used_names: dict[int | None, set[str]] = {}
        self.used_params: dict[int | None, set[str]] = {}
        self.callees: dict[int, typing.Any] = {}
        self.resolved: dict[int, typing.Any] = {}     # call id -> what its callee names
        self.callee_plans: dict[int, FunctionPlan] = {}
        self.reported: set = set()           # sources and cuts already reported
        self.broken: set[int] = set()        # calls whose callee has errors of its own
        self.first_text: Span | None = None
        self.spans: dict[int, Span] = {}
        self.declared: set[str] = set()      # the keys of params=
        self.generations: set[int] = set()   # gen()/select() call ids

    def report(self, code: str, message: str, span: Span | None, suggestion: str | None = None):
        self.diagnostics.append(Diagnostic(code, message, span, suggestion))

    # -- the whole function ---------------------------------------------------------------

    def run(self) -> FunctionPlan:
        for item in self.ir.walk():     # what every event means, cached or not
            if isinstance(item, ir.TextItem):
                self.texts[item.id] = item.text
            elif isinstance(item, ir.FStringItem):
                self.fstrings[item.id] = tuple(
                    None if isinstance(p, ir.Hole) else p for p in item.parts)
            elif isinstance(item, ir.RoleItem):
                self.roles[item.open_id] = self.roles[item.close_id] = item.role
        self.bounds = self.read_bounds()
        self.resolve_names()
        root: list = []
        flow = self.walk(self.ir.body, None, root, _Flow())
        self.warn_unused_bounds()
        if errors(self.diagnostics):
            raise CompileError(self.diagnostics)
        return FunctionPlan(
            function=self.function, ir=self.ir, module_name=module_base(self.ir.name),
            children=merge_text(root), cached=frozenset(self.cached),
            module_names=self.module_names, param_names=self.param_names, texts=self.texts,
            fstrings=self.fstrings, roles=self.roles,
            expected={k: tuple(v) for k, v in self.expected.items()}, callees=self.callees,
            has_tail=bool(flow.sources), first_text=self.first_text, spans=self.spans,
            diagnostics=tuple(d for d in self.diagnostics if d.severity != "error"),
            generations=frozenset(self.generations),
            generates=any(source.generation for source in flow.sources))

    # -- bounds ---------------------------------------------------------------------------

    def read_bounds(self) -> dict[str, int]:
        """Length bounds by name or hole expression: annotations, then `params=`."""
        fn = self.function.__wrapped__
        at = self.ir.params_span or self.ir.span
        bounds: dict[str, int] = {}
        for name, annotation in _annotations(fn).items():
            for meta in getattr(annotation, "__metadata__", ()):
                if isinstance(meta, MaxTokens):
                    bounds[name] = meta.tokens
        holes = {h.code for item in self.ir.walk() for h in _holes(item)}
        known = set(self.ir.parameters) | self.ir.locals | holes
        for key, value in (self.function.options.get("params") or {}).items():
            tokens = value.tokens if isinstance(value, MaxTokens) else value
            if not isinstance(key, str):
                self.report("PL103", f"params= keys are names or hole expressions, not "
                                     f"{key!r}", at)
                continue
            problem = token_count_problem(tokens)
            if problem is not None:
                self.report("PL104", f"the bound for {key!r} must be {problem}", at)
                continue
            key = " ".join(key.split())
            if key not in known:
                self.report("PL103", f"params= names {key!r}, which is not a parameter, a "
                                     f"local variable or a text hole of {self.ir.name}", at)
                continue
            if key in bounds and bounds[key] != tokens:
                self.report("PL105", f"{key!r} is bounded to {bounds[key]} tokens by its "
                                     f"annotation and to {tokens} by params=", at)
                continue
            bounds[key] = tokens
        self.declared = {" ".join(k.split()) for k in self.function.options.get("params") or {}
                         if isinstance(k, str)}
        return bounds

    def bound(self, hole: ir.Hole) -> int | None:
        for key in (hole.code, hole.name):
            if key is not None and key in self.bounds:
                return self.bounds[key]
        return None

    def warn_unused_bounds(self) -> None:
        for key in sorted(self.declared):
            if key in self.bounds and not any(
                    key in (h.code, h.name) for item in self.ir.walk() for h in _holes(item)):
                self.report("PL301", f"params= bounds {key!r}, but no text hole of "
                                     f"{self.ir.name} is {key!r}", self.ir.params_span or
                            self.ir.span)

    # -- names ------------------------------------------------------------------------------

    def resolve_names(self) -> None:
        for item in self.ir.walk():
            if isinstance(item, ir.CallItem):
                self.resolve_call(item)
            elif isinstance(item, ir.AssignCallItem):
                if is_generator(self.resolve(item.path)):
                    self.generations.add(item.id)
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
            self.generations.add(item.id)
        target = prompt_function_of(self.resolved[item.id])
        self.callees[item.id] = target
        if target is None:
            return
        if target is self.function or target in self.stack:
            chain = " -> ".join(f.__qualname__ for f in (*self.stack, self.function, target))
            self.report("PL108", f"recursive @prompt call: {chain}", item.span)
            self.callees[item.id] = None
            return
        try:
            self.callee_plans[item.id] = target.plan(self.stack + (self.function,))
        except CompileError as e:
            self.diagnostics.extend(e.diagnostics)
            self.broken.add(item.id)

    def resolve(self, path: tuple[str, ...] | None):
        """The object a dotted name refers to, looked up as Python would at call time;
        `_UNRESOLVED` when it depends on local values."""
        if not path:
            return _UNRESOLVED
        fn = self.function.__wrapped__
        first = path[0]
        owner = _owner_class(fn)
        if owner is not None and self.ir.parameters and first == self.ir.parameters[0]:
            value = owner
        elif first in self.ir.parameters or first in self.ir.locals:
            return _UNRESOLVED
        elif first in fn.__code__.co_freevars:
            cell = fn.__closure__[fn.__code__.co_freevars.index(first)]
            try:
                value = cell.cell_contents
            except ValueError:
                return _UNRESOLVED
        elif first in fn.__globals__:
            value = fn.__globals__[first]
        elif hasattr(builtins, first):
            value = getattr(builtins, first)
        else:
            return _UNRESOLVED
        for attribute in path[1:]:
            try:     # a module's attribute may be lazy (module __getattr__); a class's is not
                value = (getattr(value, attribute) if inspect.ismodule(value)
                         else inspect.getattr_static(value, attribute))
            except AttributeError:
                return _UNRESOLVED
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
        return value

    def unique(self, key: int | None, base: str, table: dict) -> str:
        used = table.setdefault(key, set())
        name, n = base, 1
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
        self.cached.add(item_id)
        if own:
            self.expected.setdefault(key, []).append(item_id)
        self.spans[item_id] = span

    def walk(self, items, key: int | None, out: list, flow: _Flow) -> _Flow:
        for item in items:
            if flow.sources:
                self.note_tail_item(item)
                flow = _Flow(self.tail(item, flow.sources), flow.cuts)
            else:
                flow = self.cached_item(item, key, out, flow)
        return flow

    def source_of(self, item) -> _Source | None:
        """What `item` starts the uncached tail with, if it does."""
        if getattr(item, "id", None) in self.generations:
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
                           generation=any(i.id in self.generations for i in ir.walk_items(
                               item.body) if isinstance(i, (ir.CallItem, ir.AssignCallItem))))
        if isinstance(item, ir.CallItem) and item.id not in self.broken:
            if self.resolved.get(item.id) is builtins.print:
                return None       # print() returns None: it emits nothing
            if self.callees.get(item.id) is None:
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
                    names.append(self.unique(key, _param_base(part), self.used_params))
                    out.append(nodes.Param(names[-1], self.bound(part), span=part.span))
                else:
                    self.first_text = self.first_text or item.span
                    out.append(nodes.Text(part, item.span))
            self.param_names[item.id] = tuple(names)
        elif isinstance(item, ir.RoleItem):
            self.keep(item.open_id, key, item.span, flow)
            out.append(nodes.RoleOpen(item.role, item.span))
            flow = self.walk(item.body, key, out, flow)
            if flow.sources:
                self.note_tail_item(item)
            else:
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
            self.note_tail_item(item)
            flow = _Flow(flow.sources + (source,), flow.cuts)
        return flow

    def cached_branch(self, item: ir.BranchItem, key, out: list, flow: _Flow) -> _Flow:
        members: list[nodes.Module] = []
        sources, cuts = flow.sources, flow.cuts
        for arm in item.arms:
            arm_out: list = []
            arm_flow = self.walk(arm.body, arm.id, arm_out, _Flow((), flow.cuts))
            sources += tuple(s for s in arm_flow.sources if s not in sources)
            cuts += tuple(c for c in arm_flow.cuts if c not in cuts)
            children = merge_text(arm_out)
            if children:
                name = self.unique(key, _arm_base(item, arm), self.used_names)
                self.module_names[arm.id] = name
                self.keep(arm.id, key, arm.span, flow, own=False)
                members.append(nodes.Module(name, children, span=arm.span))
        if len(members) == 1:
            out.append(members[0])
        elif members:
            out.append(nodes.Union(tuple(members), span=item.span))
        return _Flow(sources, cuts)

    def cached_call(self, item: ir.CallItem, key, out: list, flow: _Flow) -> None:
        plan = self.callee_plans[item.id]
        self.spans[item.id] = item.span
        if plan.children:
            self.keep(item.id, key, item.span, flow, own=False)
            name = self.unique(key, plan.module_name, self.used_names)
            self.module_names[item.id] = name
            out.append(nodes.Module(name, plan.children, span=item.span))
            self.first_text = self.first_text or plan.first_text

    def note_tail_item(self, item) -> None:
        for inner in ir.walk_items([item]):
            for attr in ("id", "open_id", "close_id"):
                if hasattr(inner, attr):
                    self.spans.setdefault(getattr(inner, attr), inner.span)

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
            isinstance(item, ir.AssignCallItem) and item.id not in self.generations)
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


def _holes(item) -> tuple[ir.Hole, ...]:
    if isinstance(item, ir.ValueItem):
        return (item.hole,)
    if isinstance(item, ir.FStringItem):
        return item.holes
    return ()


def _annotations(fn) -> dict[str, typing.Any]:
    try:
        return typing.get_type_hints(fn, include_extras=True)
    except Exception:     # noqa: BLE001 - an unresolvable annotation just declares no bound
        raw = getattr(fn, "__annotations__", {})
        return {k: v for k, v in raw.items() if not isinstance(v, str)}


def _owner_class(fn):
    """The class a method is defined in, found by its qualified name."""
    parts = fn.__qualname__.split(".")[:-1]
    if not parts or "<locals>" in parts:
        return None
    value = fn.__globals__.get(parts[0])
    for part in parts[1:]:
        value = getattr(value, part, None)
    return value if inspect.isclass(value) else None


def is_generator(value) -> bool:
    """Whether `value` is promptlang's gen() or select()."""
    return any(value is g for g in GENERATORS)


def prompt_function_of(value):
    """The PromptFunction `value` is (or a method bound from), else None."""
    from promptlang.compiler.decorator import PromptFunction   # it imports this module

    if isinstance(value, PromptFunction):
        return value
    func = getattr(value, "__func__", None)
    return func if isinstance(func, PromptFunction) else None


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


def slug(code: str) -> str:
    """A PML name made of the words of a Python expression: `city == "paris"` -> city-paris."""
    words: list[str] = []
    try:
        for token in tokenize.generate_tokens(io.StringIO(code).readline):
            if token.type in (tokenize.NAME, tokenize.NUMBER):
                words.append(token.string)
            elif token.type == tokenize.STRING:
                words.extend(re.findall(r"\w+", _string_value(token.string)))
            elif token.type == tokenize.OP and token.string in _OPERATORS:
                words.append(_OPERATORS[token.string])
    except (tokenize.TokenError, SyntaxError):
        words = re.findall(r"\w+", code)
    name = _NAME_CHARS.sub("-", "-".join(words)).strip("-")
    if len(name) > _MAX_NAME:
        cut = name.rfind("-", 0, _MAX_NAME + 1)
        name = name[:cut if cut > 0 else _MAX_NAME]
    return name


def _string_value(token: str) -> str:
    import ast

    try:
        value = ast.literal_eval(token)
    except (ValueError, SyntaxError):
        return token
    return value if isinstance(value, str) else str(value)


def module_base(function_name: str) -> str:
    name = _NAME_CHARS.sub("-", function_name).strip("-") or "prompt"
    return f"fn-{name}" if name in RESERVED else name


def _arm_base(branch: ir.BranchItem, arm: ir.Arm) -> str:
    """`city == "paris"` -> city-paris; `else` of a lone `if x` -> not-x (of `if not x` -> x),
    other `else` -> else; `case _` -> default; names that would be reserved or start with a
    digit get an `if-` / `case-` prefix."""
    if not arm.label:
        conditions = [a for a in branch.arms if a.label]
        if len(conditions) != 1:
            return "else"
        name = slug(conditions[0].label) or "branch"
        return name[4:] if name.startswith("not-") else "not-" + name
    if branch.kind == "match" and arm.label.strip() == "_":
        return "default"
    name = slug(arm.label) or "branch"
    if name in RESERVED or not (name[0].isalpha() or name[0] == "_"):
        name = f"{'if' if branch.kind == 'if' else 'case'}-{name}"
    return name


def _param_base(hole: ir.Hole) -> str:
    if _NAME_CHARS.search(hole.code) is None:
        return hole.code
    return slug(hole.code) or "value"
