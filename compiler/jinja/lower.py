"""A Jinja2 template's AST -> a PML schema and the plan a call follows (`plan.py`).

The template is parsed with Jinja2's own parser (`Environment.parse`) and walked once,
never rendered. What each construct becomes (docs/COMPILER.md, "From Jinja2 templates"):

    literal text                          module text
    {{ q | maxlen(64) }}                  <param name="q" len="64"/> (or params={"q": 64})
    {{ name }} with no bound              the start of the uncached tail
    {% if %}/{% elif %}/{% else %}        a union of modules (a lone `if`: an optional one)
    {% include "x.j2" %}                  a nested module, the included template's text
    {{ macro("const") }}                  a nested module, the macro's text for those args
    {% for d in docs %} over documents    a module per document, selected at call time
    {% for m in messages %} otherwise     the start of the uncached tail
    {% block system|user|assistant %}     a chat role around the block's text

Expressions that a module's text depends on only through constants (a document's
fields, a macro's constant arguments, `{% set x = "..." %}`) are computed here, by
Jinja2 (`expressions.value`). Everything after the tail starts is rendered by Jinja2
per request. A construct the frontend cannot cache is a located error (PL402), or,
when lenient, the start of the tail.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any, Mapping, Sequence

import jinja2
from jinja2 import nodes as jn

import promptlang.compiler.jinja.expressions as ex
from promptlang.compiler.diagnostics import Diagnostic
from promptlang.compiler.jinja.plan import (Arm, Branch, Documents, Hole, Member, Nested,
                                            Step, TailPiece, TemplatePlan)
from promptlang.errors import PromptLangError, Span
from promptlang.pml import nodes

ROLE_BLOCKS = nodes.ROLES
_RESERVED = nodes.ROLES + ("scaffold",)
MAX_INCLUDE_DEPTH = 32


class Uncacheable(Exception):
    """A construct that ends the cached part: `kind` says why (unbounded / loop / unsupported)."""

    def __init__(self, kind: str, message: str, span: Span, suggestion: str | None = None):
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.span = span
        self.suggestion = suggestion


@dataclass(frozen=True)
class Marker:
    """A role block's start or end in the flattened top-level sequence."""

    kind: str          # "open" or "close"
    role: str


@dataclass
class _Builder:
    """The children and steps of one module being built, and the names its children took."""

    children: list = field(default_factory=list)
    steps: list = field(default_factory=list)
    taken: set = field(default_factory=set)

    def text(self, text: str) -> None:
        """Add text, joined to the text before it (PML's normal form has no two in a row)."""
        if not text:
            return
        if self.children and isinstance(self.children[-1], nodes.Text):
            text = self.children.pop().text + text
        self.children.append(nodes.Text(text))

    def unique(self, base: str) -> str:
        base = base or "part"
        if base in _RESERVED or not (base[0].isalpha() or base[0] == "_"):
            base = f"t-{base}"
        name = base
        number = 2
        while name in self.taken:
            name = f"{base}-{number}"
            number += 1
        self.taken.add(name)
        return name


@dataclass(frozen=True)
class Options:
    documents: Mapping[str, Sequence[Any]]
    params: Mapping[str, int]
    role: str | None           # the role around a template without role blocks
    lenient: bool


def lower(environment: jinja2.Environment, name: str, file: str, source: str,
          options: Options) -> tuple[TemplatePlan | None, list[Diagnostic]]:
    """The plan of the template `name` (its text `source`, shown as `file`), and every
    diagnostic; the plan is None where there is an error."""
    lowerer = _Lowerer(environment, name, file, source, options)
    plan = lowerer.run()
    failed = any(d.severity == "error" for d in lowerer.diagnostics)
    return (None if failed else plan), lowerer.diagnostics


class _Lowerer:
    def __init__(self, environment: jinja2.Environment, name: str, file: str, source: str,
                 options: Options):
        self.env = environment
        self.name = name
        self.file = file
        self.source = source
        self.lines = source.splitlines()
        self.options = options
        self.diagnostics: list[Diagnostic] = []
        self.statics: dict[str, Any] = {}          # `{% set x = constant %}` at top level
        self.dynamic: set[str] = set()             # `{% set x = expression %}`
        self.macros: dict[str, jn.Macro] = {}
        self.namespaces: dict[str, dict[str, jn.Macro]] = {}
        self.definitions: list[jn.Node] = []       # what the tail's renderers run first
        self.including: list[str] = [name]
        self.sources: list[tuple[str, list[str]]] = [(file, self.lines)]  # where spans point
        self.macro_sources: dict[int, tuple[str, list[str]]] = {}      # id(macro) -> its file
        self.tail_start: Uncacheable | None = None

    # -- locations and diagnostics ---------------------------------------------------------

    def span(self, lineno: int, needle: str = "", file: str | None = None,
             lines: Sequence[str] | None = None) -> Span:
        """Where `needle` is on line `lineno` of the template being read (or of `file`)."""
        current_file, current_lines = self.sources[-1]
        lines = current_lines if lines is None else lines
        text = lines[lineno - 1] if 0 < lineno <= len(lines) else ""
        return Span(file or current_file, lineno, ex.column(text, needle), text)

    @contextlib.contextmanager
    def reading(self, file: str, lines: list[str]):
        """Spans point into `file` meanwhile (an included template, a macro's own file)."""
        self.sources.append((file, lines))
        try:
            yield
        finally:
            self.sources.pop()

    def report(self, code: str, message: str, span: Span, suggestion: str | None = None):
        self.diagnostics.append(Diagnostic(code, message, span, suggestion))

    # -- the whole template ----------------------------------------------------------------

    def run(self) -> TemplatePlan | None:
        try:
            tree = self.env.parse(self.source, self.name, self.file)
        except jinja2.TemplateSyntaxError as e:
            self.report("PL401", e.message or "syntax error", self.span(e.lineno or 1))
            return None
        root = ex.slug(jn.Name(PurePosixPath(self.name).stem or "template", "load"))
        builder = _Builder()
        builder.taken.add(root)
        tail: list[TailPiece] = []
        for item in self._sequence(tree.body):
            starts = False
            if self.tail_start is None:
                try:
                    self._cached(item, builder, dict(self.statics), top=True)
                    continue
                except Uncacheable as reason:
                    self._start_tail(reason)
                    starts = True
            self._tail(item, tail, starts)
        schema = nodes.Schema(root_schema_name(self.name),
                              (nodes.Module(root, tuple(builder.children)),))
        return TemplatePlan(name=self.name, schema=schema, root=root,
                            steps=tuple(builder.steps), tail=tuple(tail),
                            tail_start=None if self.tail_start is None else self.tail_start.span,
                            tail_reason="" if self.tail_start is None else self.tail_start.message,
                            documents=_document_names(builder.steps))

    def _sequence(self, body: Sequence[jn.Node]) -> list:
        """The top-level items in order: role blocks flattened into markers around their
        body, each `{{ ... }}` and text run of an output an item of its own."""
        blocks = [n for n in body if isinstance(n, jn.Block) and n.name in ROLE_BLOCKS]
        items: list = []
        if blocks:
            for node in body:
                if isinstance(node, jn.Block) and node.name in ROLE_BLOCKS:
                    items.append(Marker("open", node.name))
                    items.extend(_split(node.body))
                    items.append(Marker("close", node.name))
                elif isinstance(node, jn.Output) and all(
                        isinstance(p, jn.TemplateData) and not p.data.strip() for p in node.nodes):
                    continue
                elif isinstance(node, (jn.Output, jn.If, jn.For, jn.Include)):
                    self.report("PL406", "text outside the role blocks",
                                self.span(node.lineno))
                else:
                    items.append(node)
            return items
        role = self.options.role
        return ([Marker("open", role)] if role else []) + _split(body) + \
            ([Marker("close", role)] if role else [])

    def _start_tail(self, reason: Uncacheable) -> None:
        self.tail_start = reason
        if reason.kind == "unsupported" and not self.options.lenient:
            self.report("PL402", reason.message, reason.span, reason.suggestion)

    def _tail(self, item, tail: list[TailPiece], starts: bool) -> None:
        if isinstance(item, Marker):
            tail.append(TailPiece(item.kind, role=item.role))
            return
        demanded = None if starts else self._cached_construct(item)
        failed = self.tail_start.kind == "unsupported"         # already an error: no cascade
        if demanded is not None and not self.options.lenient and not failed:
            start = self.tail_start
            self.report("PL403", f"{demanded} would be cached but follows the uncached part, "
                                 f"which starts at {start.span.line}:{start.span.col} "
                                 f"({start.message})",
                        self.span(item.lineno, _needle(item)))
        if isinstance(item, (jn.Macro, jn.Import, jn.FromImport, jn.Assign)):
            self.definitions.append(item)
            return
        run = (item,)
        if tail and tail[-1].kind == "text":
            run = (*tail.pop().nodes, item)
        template = ex.renderer(self.env, [*self.definitions, *run])
        tail.append(TailPiece("text", nodes=run, template=template))

    def _cached_construct(self, item) -> str | None:
        """What in the tail the author may have meant to cache: documents, includes, macros."""
        if isinstance(item, jn.For) and isinstance(item.iter, jn.Name) and \
                item.iter.name in self.options.documents:
            return f"the documents loop over `{item.iter.name}`"
        if isinstance(item, jn.Include):
            return "an {% include %}"
        return None

    # -- cached constructs -----------------------------------------------------------------

    def _cached(self, item, into: _Builder, scope: dict[str, Any], top: bool = False) -> None:
        if isinstance(item, Marker):
            into.children.append(nodes.RoleOpen(item.role) if item.kind == "open"
                                 else nodes.RoleClose(item.role))
        elif isinstance(item, jn.Output):
            for piece in item.nodes:
                self._output(piece, into, scope)
        elif isinstance(item, jn.If):
            self._if(item, into, scope)
        elif isinstance(item, jn.For):
            self._for(item, into, scope)
        elif isinstance(item, jn.Include):
            self._include(item, into, scope)
        elif isinstance(item, (jn.Macro, jn.Import, jn.FromImport)):
            self._define(item, scope)
            if top:
                self.definitions.append(item)
        elif isinstance(item, jn.Assign) and top:
            self._assign(item)
        else:
            raise Uncacheable("unsupported", f"{_describe(item)} cannot be cached",
                              self.span(item.lineno, _needle(item)))

    def _body(self, body: Sequence[jn.Node], scope: dict[str, Any], what: str) -> _Builder:
        """The module built from `body`. What would start the tail inside it (an unbounded
        value, a loop over a request's list) cannot: the whole of `what` would silently
        lose its caching, so it is a construct that cannot be cached."""
        builder = _Builder()
        try:
            for node in _split(body):
                self._cached(node, builder, scope)
        except Uncacheable as reason:
            if reason.kind == "unsupported":
                raise
            raise Uncacheable("unsupported", f"{what} cannot be cached: {reason.message}",
                              reason.span, "bound the value (`| maxlen(N)`, or params=), or "
                              "compile with --lenient to compute the whole of it per "
                              "request") from None
        return builder

    def _output(self, piece: jn.Node, into: _Builder, scope: dict[str, Any]) -> None:
        if isinstance(piece, jn.TemplateData):
            into.text(piece.data)
            return
        if isinstance(piece, jn.Call) and self._macro_of(piece) is not None:
            self._macro_call(piece, into, scope)
            return
        span = self.span(piece.lineno, _needle(piece))
        inner, bound, problem = ex.bound_of(piece)
        part = ex.unsupported_part(inner)
        if part is not None:
            raise Uncacheable("unsupported", f"{part} in `{{{{ ... }}}}` cannot be cached", span)
        self._check_names(inner, scope, span)
        if ex.names_in(inner) <= scope.keys():
            into.text(ex.value(self.env, inner, scope))
            return
        if problem is not None:
            self.report("PL405", problem, span)
            return
        path = ex.path_of(inner)
        if bound is None and path is not None:
            bound = self.options.params.get(path)
        if bound is None:
            shown = path or "this value"
            raise Uncacheable("unbounded", f"`{shown}` has no length bound", span)
        name = _param_name(into, path or ex.slug(inner) or "value")
        into.children.append(nodes.Param(name, bound))
        into.steps.append(Hole(name, ex.value_template(self.env, inner), dict(scope), span))

    def _check_names(self, expr: jn.Node, scope: Mapping[str, Any], span: Span) -> None:
        for name in ex.names_in(expr):
            if name in scope:
                continue
            if name in self.dynamic:
                raise Uncacheable("unsupported", f"`{name}` is set from an expression computed "
                                                 f"per request", span)
            if name in ("loop", "caller", "varargs", "kwargs", "super", "self"):
                raise Uncacheable("unsupported", f"`{name}` cannot be cached", span,
                                  "a documents loop caches each document alone: use the "
                                  "document's own fields, not `loop`")

    def _if(self, node: jn.If, into: _Builder, scope: dict[str, Any]) -> None:
        arms: list[tuple[jn.Expr | None, Sequence[jn.Node], int]] = []
        current: jn.If | None = node
        while current is not None:
            arms.append((current.test, current.body, current.lineno))
            for elif_ in current.elif_:
                arms.append((elif_.test, elif_.body, elif_.lineno))
            else_ = current.else_
            current = None
            if else_:
                arms.append((None, else_, node.lineno))
        for test, _body, lineno in arms:
            if test is None:
                continue
            span = self.span(lineno, "if")
            part = ex.unsupported_part(test)
            if part is not None:
                raise Uncacheable("unsupported", f"{part} in an `if` cannot be cached", span)
            self._check_names(test, scope, span)
        if all(test is None or ex.names_in(test) <= scope.keys() for test, _, _ in arms):
            for test, body, _ in arms:
                if test is None or ex.holds(self.env, test, scope):
                    for child in _split(body):
                        self._cached(child, into, scope)
                    return
            return
        what = f"the `if` at {self.span(node.lineno, 'if')}"
        built: list[tuple[jn.Expr | None, _Builder]] = [(test, self._body(body, scope, what))
                                                         for test, body, _ in arms]
        members: list[nodes.Module] = []
        planned: list[Arm] = []
        conditions = [t for t, _ in built if t is not None]
        for test, body in built:
            empty = not body.children
            name = None if empty else into.unique(_arm_base(test, conditions))
            if name is not None:
                members.append(nodes.Module(name, tuple(body.children)))
            template = None if test is None else ex.condition_template(self.env, test)
            planned.append(Arm(name, template, dict(scope), tuple(body.steps)))
        if not members:
            return
        if len(arms) == 1:
            into.children.append(members[0])
        else:
            into.children.append(nodes.Union(tuple(members)))
        into.steps.append(Branch(tuple(planned)))

    def _for(self, node: jn.For, into: _Builder, scope: dict[str, Any]) -> None:
        span = self.span(node.lineno, "for")
        corpus_name = node.iter.name if isinstance(node.iter, jn.Name) else None
        corpus = self.options.documents.get(corpus_name) if corpus_name else None
        if corpus is None:
            if corpus_name is not None:
                raise Uncacheable("loop", f"the loop over `{corpus_name}` is computed per "
                                          f"request", span)
            raise Uncacheable("unsupported", "a loop over an expression cannot be cached",
                              span, "loop over a variable named in documents=")
        if not isinstance(node.target, jn.Name) or node.test is not None or node.else_ \
                or node.recursive:
            raise Uncacheable("unsupported", "a documents loop takes one variable, no `if`, no "
                                             "`else` and no `recursive`", span)
        members: list[Member] = []
        for index, item in enumerate(corpus):
            name = into.unique(f"{ex.slug(node.iter)}-{index}")
            body = self._body(node.body, {**scope, node.target.name: item},
                              f"the documents loop over `{corpus_name}` at {span}")
            into.children.append(nodes.Module(name, tuple(body.children)))
            members.append(Member(name, index, tuple(body.steps)))
        into.steps.append(Documents(corpus_name, tuple(corpus), tuple(members), span))

    def _include(self, node: jn.Include, into: _Builder, scope: dict[str, Any]) -> None:
        span = self.span(node.lineno, "include")
        if not isinstance(node.template, jn.Const) or not isinstance(node.template.value, str):
            raise Uncacheable("unsupported", "an {% include %} of a computed name cannot be "
                                             "cached", span)
        if not node.with_context:
            raise Uncacheable("unsupported", "an {% include ... without context %} cannot be "
                                             "cached", span)
        name = node.template.value
        loaded = self._load(name, span, node.ignore_missing)
        if loaded is None:
            return
        tree, file, lines = loaded
        self.including.append(name)
        try:
            with self.reading(file, lines):
                body = self._body(tree.body, scope, f"the include of {name!r} at {span}")
        finally:
            self.including.pop()
        module = into.unique(ex.slug(jn.Name(PurePosixPath(name).stem, "load")))
        into.children.append(nodes.Module(module, tuple(body.children)))
        into.steps.append(Nested(module, tuple(body.steps)))

    def _load(self, name: str, span: Span, missing_ok: bool = False
              ) -> tuple[jn.Template, str, list[str]] | None:
        """The template `name` parsed, its file and its lines; None (said) where it cannot be."""
        if name in self.including or len(self.including) > MAX_INCLUDE_DEPTH:
            self.report("PL404", f"{name!r} includes itself (through "
                                 f"{' -> '.join(self.including)})", span)
            return None
        loader = self.env.loader
        try:
            if loader is None:
                raise jinja2.TemplateNotFound(name)
            source, filename, _ = loader.get_source(self.env, name)
        except jinja2.TemplateNotFound:
            if not missing_ok:
                self.report("PL404", f"the loader finds no template {name!r}", span)
            return None
        except PromptLangError as e:        # too big, not UTF-8, not a regular file
            self.report("PL404", f"{name!r} cannot be read: {e.message}", span)
            return None
        lines = source.splitlines()
        try:
            return self.env.parse(source, name, filename), filename or name, lines
        except jinja2.TemplateSyntaxError as e:
            self.report("PL401", e.message or "syntax error",
                        self.span(e.lineno or 1, file=filename or name, lines=lines))
            return None

    def _define(self, node, scope: dict[str, Any]) -> None:
        if isinstance(node, jn.Macro):
            self.macros[node.name] = node
            self.macro_sources[id(node)] = self.sources[-1]
            return
        span = self.span(node.lineno, "import" if isinstance(node, jn.Import) else "from")
        if not isinstance(node.template, jn.Const):
            raise Uncacheable("unsupported", "an import of a computed name cannot be cached",
                              span)
        loaded = self._load(node.template.value, span)
        found = {}
        if loaded is not None:
            tree, file, lines = loaded
            found = {m.name: m for m in tree.find_all(jn.Macro)}
            for macro in found.values():
                self.macro_sources[id(macro)] = (file, lines)
        if isinstance(node, jn.Import):
            self.namespaces[node.target] = found
            return
        for entry in node.names:
            name, alias = entry if isinstance(entry, tuple) else (entry, entry)
            if name in found:
                self.macros[alias] = found[name]

    def _assign(self, node: jn.Assign) -> None:
        self.definitions.append(node)
        names = [n.name for n in node.target.find_all(jn.Name)] if not isinstance(
            node.target, jn.Name) else [node.target.name]
        try:
            constant = node.node.as_const()
        except jn.Impossible:
            self.dynamic.update(names)
            return
        if isinstance(node.target, jn.Name):
            self.statics[node.target.name] = constant
            self.dynamic.discard(node.target.name)
        else:
            self.dynamic.update(names)

    def _macro_of(self, call: jn.Call) -> jn.Macro | None:
        target = call.node
        if isinstance(target, jn.Name):
            return self.macros.get(target.name)
        if isinstance(target, jn.Getattr) and isinstance(target.node, jn.Name):
            return self.namespaces.get(target.node.name, {}).get(target.attr)
        return None

    def _macro_call(self, call: jn.Call, into: _Builder, scope: dict[str, Any]) -> None:
        macro = self._macro_of(call)
        line = self.lines[call.lineno - 1] if 0 < call.lineno <= len(self.lines) else ""
        span = Span(self.file, call.lineno, ex.call_column(line, macro.name), line)
        if call.dyn_args is not None or call.dyn_kwargs is not None:
            raise Uncacheable("unsupported", "a macro call with *args or **kwargs cannot be "
                                             "cached", span)
        values: dict[str, Any] = {}
        params = [a.name for a in macro.args]
        for position, arg in enumerate(call.args):
            if position >= len(params):
                raise Uncacheable("unsupported", f"too many arguments to {macro.name}()", span)
            values[params[position]] = self._constant(arg, scope, span)
        for keyword in call.kwargs:
            if keyword.key not in params:
                raise Uncacheable("unsupported", f"{macro.name}() has no argument "
                                                 f"{keyword.key!r}", span)
            values[keyword.key] = self._constant(keyword.value, scope, span)
        defaults = dict(zip(params[len(params) - len(macro.defaults):], macro.defaults))
        for param in params:
            if param not in values:
                values[param] = (self._constant(defaults[param], scope, span)
                                 if param in defaults else None)
        if any(n.name == "caller" for n in macro.find_all(jn.Name)):
            raise Uncacheable("unsupported", f"{macro.name}() uses caller()", span)
        with self.reading(*self.macro_sources.get(id(macro), self.sources[-1])):
            body = self._body(macro.body, {**self.statics, **values},
                              f"the call of {macro.name}() at {span}")
        words = [macro.name, *(str(v) for v in values.values() if isinstance(v, str))][:2]
        module = into.unique(ex.slug(jn.Name("-".join(words), "load")))
        into.children.append(nodes.Module(module, tuple(body.children)))
        into.steps.append(Nested(module, tuple(body.steps)))

    def _constant(self, expr: jn.Expr, scope: Mapping[str, Any], span: Span) -> Any:
        try:
            return expr.as_const()
        except jn.Impossible:
            pass
        if isinstance(expr, jn.Name) and expr.name in scope:
            return scope[expr.name]
        raise Uncacheable("unsupported", "a macro argument that is not a constant cannot be "
                                         "cached", span,
                          "call the macro with constants, or with --lenient compute it per "
                          "request")


def root_schema_name(template: str) -> str:
    """The schema name of template `template` (its loader name, without the extension)."""
    path = PurePosixPath(template)
    stem = str(path.with_suffix("")) if path.suffix in (".j2", ".jinja", ".jinja2") else str(path)
    return stem.replace("/", ".").strip(".") or "template"


def _split(body: Sequence[jn.Node]) -> list:
    """Each piece of each output an item of its own, other statements as they are."""
    items: list = []
    for node in body:
        if isinstance(node, jn.Output):
            items.extend(jn.Output([piece], lineno=piece.lineno) for piece in node.nodes)
        else:
            items.append(node)
    return items


def _arm_base(test: jn.Expr | None, conditions: list[jn.Expr]) -> str:
    if test is not None:
        return ex.slug(test) or "branch"
    if len(conditions) == 1:
        name = ex.slug(conditions[0]) or "branch"
        return name[4:] if name.startswith("not-") else "not-" + name
    return "else"


def _param_name(into: _Builder, base: str) -> str:
    existing = {c.name for c in into.children if isinstance(c, nodes.Param)}
    name = base
    number = 2
    while name in existing:
        name = f"{base}-{number}"
        number += 1
    return name


def _describe(node: jn.Node) -> str:
    kind = {jn.Block: "a {% block %} other than system/user/assistant",
            jn.Extends: "template inheritance ({% extends %})",
            jn.CallBlock: "a {% call %} block", jn.FilterBlock: "a {% filter %} block",
            jn.With: "a {% with %} block", jn.Assign: "a {% set %} inside a block",
            jn.AssignBlock: "a {% set %} block", jn.ExprStmt: "a {% do %} statement"}
    for cls, text in kind.items():
        if isinstance(node, cls):
            return text
    return f"a {type(node).__name__.lower()} statement"


def _needle(node) -> str:
    if isinstance(node, jn.Output) and node.nodes:
        return _needle(node.nodes[0])
    if isinstance(node, jn.Name):
        return node.name
    if isinstance(node, jn.Call):
        return _needle(node.node)
    if isinstance(node, (jn.Getattr, jn.Getitem, jn.Filter, jn.Test)) and node.node is not None:
        return _needle(node.node)
    words = {jn.If: "if", jn.For: "for", jn.Include: "include", jn.Block: "block",
             jn.Extends: "extends", jn.Macro: "macro", jn.Assign: "set", jn.AssignBlock: "set",
             jn.CallBlock: "call", jn.FilterBlock: "filter", jn.With: "with"}
    for cls, word in words.items():
        if isinstance(node, cls):
            return word
    return ""


def _document_names(steps: Sequence[Step]) -> tuple[str, ...]:
    found: list[str] = []
    for step in steps:
        if isinstance(step, Documents) and step.name not in found:
            found.append(step.name)
        for inner in step.inner():
            for name in _document_names(inner):
                if name not in found:
                    found.append(name)
    return tuple(found)
