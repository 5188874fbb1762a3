"""Analysis: a @prompt function's source -> its IR (`ir.py`) and the diagnostics found on the way.

Runs at decoration time. It reads the source with `inspect` (`source.py`), parses
it with libcst and resolves `PositionProvider` metadata, then visits the body
statement by statement (`visit_<NodeClass>`). Nothing here looks at run-time
values: which calls reach @prompt functions, which bounds apply and what is cached
is decided later, in `lower.py`, when the function's module is complete.

Text rules (docs/COMPILER.md):
- the docstring is documentation, not text;
- a statement that is a string literal, an f-string or a bare expression emits its
  value as text (`str(value)`; a value of None emits nothing);
- a statement that is ONE triple-quoted literal spanning several lines is dedented:
  the line break right after the opening quotes is dropped, the common indentation
  of the other lines is removed, and whitespace-only lines become empty, so a block
  whose closing quotes sit on their own line ends with a newline. Every other
  literal is taken exactly as Python evaluates it.
"""

from __future__ import annotations

import ast
import linecache
from dataclasses import dataclass

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

import promptlang.compiler.ir as ir   # not `from promptlang.compiler`: that names the package
from promptlang.compiler.diagnostics import Diagnostic
from promptlang.compiler.source import FunctionSource, deepest_span, function_source
from promptlang.compiler.syntax import (ScopeScan, dedent_block, dotted, hole_nodes,
                                        is_block_literal, is_docstring, normalise, role_call)
from promptlang.errors import Span

GENERATOR_NAMES = ("gen", "select")   # what `x = name(...)` may call to be a generation
_HOLE = "\ue000"     # stands for a hole while the literal parts around it are dedented


@dataclass
class Analysis:
    """What the analysis of one function produced. `ir` is None when it could not start."""

    ir: ir.FunctionIR | None
    diagnostics: list[Diagnostic]
    source: FunctionSource | None = None


def analyze_function(fn, where: Span | None = None) -> Analysis:
    """Analyse `fn`'s body; never raises for problems in the user's code. `where`: the
    place it was decorated, for the diagnostics that have no source line of their own."""
    name = getattr(fn, "__qualname__", repr(fn))
    if fn.__name__ == "<lambda>":
        return Analysis(None, [Diagnostic("PL101", "a lambda cannot be a @prompt function: "
                                                   "its body is one expression, not statements",
                                          _code_span(fn) or where)])
    try:
        source = function_source(fn)
    except (OSError, TypeError) as e:
        return Analysis(None, [Diagnostic(
            "PL002", f"cannot read the source of {name} (defined by exec or in a REPL?): {e}",
            where or _code_span(fn))])
    try:
        return _analyze_source(fn, name, source)
    except RecursionError:
        span = deepest_span(source.padded_text(), source.file)
        return Analysis(None, [Diagnostic(
            "PL004", f"{name} nests too deeply for the compiler to analyse (a very long "
                     "expression or deeply nested blocks)", span)], source)


def _analyze_source(fn, name: str, source: FunctionSource) -> Analysis:
    try:
        wrapper = MetadataWrapper(cst.parse_module(source.text), unsafe_skip_copy=True)
    except cst.ParserSyntaxError as e:
        span = source.span(e.raw_line, e.raw_column)
        return Analysis(None, [Diagnostic(
            "PL002", f"the source of {name} in {source.file} does not parse (was the file "
                     f"edited after it was imported?): {e.message}", span)])
    module = wrapper.module
    top = module.body[0] if module.body else None
    if source.indented and isinstance(top, cst.If):
        top = top.body.body[0] if isinstance(top.body, cst.IndentedBlock) else None
    if not isinstance(top, cst.FunctionDef) or top.name.value != fn.__name__:
        return Analysis(None, [Diagnostic(
            "PL002", f"the source found for {name} in {source.file} is not its `def`",
            source.file_span(source.start, 0))])
    analyzer = _Analyzer(fn, source, module, top, wrapper.resolve(PositionProvider))
    return analyzer.run()


def _code_span(fn) -> Span | None:
    """The first line of `fn`'s code, when its file is one inspect can read."""
    code = fn.__code__
    text = linecache.getline(code.co_filename, code.co_firstlineno)
    if not text:
        return None
    column = text.find("lambda") if fn.__name__ == "<lambda>" else -1
    return Span(code.co_filename, code.co_firstlineno,
                column + 1 if column >= 0 else len(text) - len(text.lstrip()) + 1,
                text.rstrip("\r\n"))


class _Analyzer:
    def __init__(self, fn, source: FunctionSource, module: cst.Module, node: cst.FunctionDef,
                 positions):
        self.fn = fn
        self.source = source
        self.module = module
        self.node = node
        self.positions = positions
        self.diagnostics: list[Diagnostic] = []
        self.lines = source.text.split("\n")
        self.statement_calls: set[cst.Call] = set()
        self.next_id = 0
        self.in_role = False

    # -- helpers --------------------------------------------------------------------------

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def span(self, node: cst.CSTNode) -> Span:
        start = self.positions[node].start
        return self.source.span(start.line, start.column)

    def place(self, kind: str, node: cst.CSTNode, *extra) -> tuple:
        """`node`'s position as CPython's ast gives it: line and UTF-8 byte column."""
        start = self.positions[node].start
        line = self.lines[start.line - 1]
        return (kind, start.line + self.source.offset, len(line[:start.column].encode("utf-8")),
                *extra)

    def code(self, node: cst.CSTNode) -> str:
        return self.module.code_for_node(node)

    def report(self, code: str, message: str, node: cst.CSTNode, suggestion: str | None = None):
        self.diagnostics.append(Diagnostic(code, message, self.span(node), suggestion))

    # -- the function -------------------------------------------------------------------------

    def run(self) -> Analysis:
        node = self.node
        if node.asynchronous is not None:
            self.report("PL101", f"{node.name.value} is an async function; a @prompt function "
                                 "is a plain `def`", node.name)
        scan = ScopeScan()
        node.body.visit(scan)
        for y in scan.yields:
            self.report("PL101", "a @prompt function cannot be a generator (`yield`)", y)
        for a in scan.awaits:
            self.report("PL101", "a @prompt function cannot `await`", a)
        statements = self.body_statements(node.body)
        body = self.block(statements, docstring=True)
        calls = tuple(ir.ExpressionCall(path, self.code(c.func), self.span(c))
                      for c in scan.calls if c not in self.statement_calls
                      for path in [dotted(c.func)] if path is not None)
        params = node.params
        names = tuple(p.name.value for p in (
            *params.posonly_params, *params.params,
            *([params.star_arg] if isinstance(params.star_arg, cst.Param) else []),
            *params.kwonly_params, *([params.star_kwarg] if params.star_kwarg else [])))
        function = ir.FunctionIR(
            name=node.name.value, qualname=self.fn.__qualname__, file=self.source.file,
            span=self.span(node.name), parameters=names, locals=frozenset(scan.stores),
            body=body, expression_calls=calls, params_span=self.params_span())
        return Analysis(function, self.diagnostics, self.source)

    def params_span(self) -> Span | None:
        for decorator in self.node.decorators:
            if isinstance(decorator.decorator, cst.Call):
                for arg in decorator.decorator.args:
                    if arg.keyword is not None and arg.keyword.value == "params":
                        return self.span(arg)
        return None

    # -- statements ---------------------------------------------------------------------------

    @staticmethod
    def body_statements(body) -> list[cst.CSTNode]:
        """The statements of a block, a one-line suite's small statements included."""
        if isinstance(body, cst.SimpleStatementSuite):
            return list(body.body)
        out: list[cst.CSTNode] = []
        for statement in body.body:
            if isinstance(statement, cst.SimpleStatementLine):
                out.extend(statement.body)
            else:
                out.append(statement)
        return out

    def block(self, statements, docstring: bool = False) -> tuple[ir.Item, ...]:
        items: list[ir.Item] = []
        for index, statement in enumerate(statements):
            if docstring and index == 0 and is_docstring(statement):
                continue
            visit = getattr(self, "visit_" + type(statement).__name__, None)
            if visit is not None:
                items.extend(visit(statement))
        return tuple(items)

    def suite(self, body) -> tuple[ir.Item, ...]:
        return self.block(self.body_statements(body))

    def visit_Expr(self, node: cst.Expr) -> list[ir.Item]:
        value = node.value
        if isinstance(value, (cst.SimpleString, cst.ConcatenatedString, cst.FormattedString)):
            return self.string_statement(node, value)
        if isinstance(value, cst.Call):
            self.statement_calls.add(value)
            return [ir.CallItem(self.new_id(), dotted(value.func), self.code(value.func),
                                self.span(value), self.place("expr", node))]
        if isinstance(value, cst.Ellipsis) or (isinstance(value, cst.Name)
                                               and value.value == "None"):
            return []           # `...` is a placeholder; None emits nothing
        if isinstance(value, (cst.Yield, cst.Await)):
            return []           # reported as PL101
        is_number = isinstance(value, (cst.Integer, cst.Float, cst.Imaginary))
        is_bool = isinstance(value, cst.Name) and value.value in ("True", "False")
        if is_number or is_bool:
            try:
                text = str(ast.literal_eval(value.value))
            except ValueError as e:     # an int past the digit limit of str()
                self.report("PL109", f"this number cannot be printed as text: {e}", value,
                            "write the number as a string literal")
                return []
            return [ir.TextItem(self.new_id(), text, self.span(node), self.place("expr", node))]
        hole = ir.Hole(normalise(self.code(value)),
                       value.value if isinstance(value, cst.Name) else None, self.span(value))
        return [ir.ValueItem(self.new_id(), hole, self.span(node), self.place("expr", node))]

    def string_statement(self, node: cst.Expr, value) -> list[ir.Item]:
        code = self.code(value)
        try:
            tree = ast.parse("(" + code + "\n)", mode="eval").body
        except SyntaxError as e:      # libcst accepted what CPython rejects: say so, located
            self.report("PL001", f"invalid string literal: {e.msg}", value)
            return []
        if isinstance(tree, ast.Constant) and isinstance(tree.value, bytes):
            self.report("PL109", "a bytes literal is not text", value)
            return []
        pieces = tree.values if isinstance(tree, ast.JoinedStr) else [tree]
        expressions = hole_nodes(value)
        template = "".join(p.value if isinstance(p, ast.Constant) else _HOLE for p in pieces)
        if is_block_literal(value):
            template = dedent_block(template)
        literal = template.split(_HOLE)
        holes = [ir.Hole(normalise(self.code(e.expression)),
                         e.expression.value if isinstance(e.expression, cst.Name) else None,
                         self.span(e.expression)) for e in expressions]
        place = self.place("expr", node)
        if not holes:
            item: ir.Item = ir.TextItem(self.new_id(), template, self.span(node), place)
        else:
            parts: list[str | ir.Hole] = []
            for k, hole in enumerate(holes):
                parts.extend([literal[k], hole])
            parts.append(literal[-1])
            item = ir.FStringItem(self.new_id(), tuple(p for p in parts if p != ""),
                                  self.span(node), place)
        return [item]

    def assignment(self, node, value) -> list[ir.Item]:
        """`x = gen(...)`: an item when the call may be a generation (decided in lower.py);
        any other assignment is ordinary code."""
        path = dotted(value.func) if isinstance(value, cst.Call) else None
        if path is None or path[-1] not in GENERATOR_NAMES:
            return []
        self.statement_calls.add(value)
        return [ir.AssignCallItem(self.new_id(), path, self.code(value.func), self.span(value))]

    def visit_Assign(self, node: cst.Assign) -> list[ir.Item]:
        return self.assignment(node, node.value)

    def visit_AnnAssign(self, node: cst.AnnAssign) -> list[ir.Item]:
        return self.assignment(node, node.value)

    def visit_AugAssign(self, node: cst.AugAssign) -> list[ir.Item]:
        return self.assignment(node, node.value)

    def visit_Return(self, node: cst.Return) -> list[ir.Item]:
        if node.value is not None:
            self.report("PL102", "a @prompt function cannot return a value: calling it returns "
                                 "its Prompt", node)
        return [ir.ReturnItem(self.new_id(), self.span(node))]

    def visit_If(self, node: cst.If) -> list[ir.Item]:
        arms: list[ir.Arm] = []
        branch_id = self.new_id()
        current: cst.If | cst.Else | None = node
        owner = node
        while current is not None:
            arm_id = self.new_id()
            if isinstance(current, cst.If):
                arms.append(ir.Arm(arm_id, self.code(current.test), self.suite(current.body),
                                   self.span(current), self.place("if", current)))
                owner = current
                current = current.orelse
            else:    # CPython's ast has no node for `else`: it is placed by its `if`
                arms.append(ir.Arm(arm_id, "", self.suite(current.body), self.span(current),
                                   self.place("else", owner)))
                current = None
        if not any(arm.body for arm in arms):
            return []
        return [ir.BranchItem(branch_id, "if", tuple(arms), self.span(node))]

    def visit_Match(self, node: cst.Match) -> list[ir.Item]:
        branch_id = self.new_id()
        arms = []
        for index, case in enumerate(node.cases):
            arm_id = self.new_id()
            label = self.code(case.pattern)
            if case.guard is not None:
                label += " if " + self.code(case.guard)
            arms.append(ir.Arm(arm_id, label, self.suite(case.body), self.span(case),
                               self.place("case", node, index)))
        if not any(arm.body for arm in arms):
            return []
        return [ir.BranchItem(branch_id, "match", tuple(arms), self.span(node))]

    def loop(self, node, kind) -> list[ir.Item]:
        block_id = self.new_id()
        body = self.suite(node.body)
        if node.orelse is not None:
            body += self.suite(node.orelse.body)
        return [ir.BlockItem(block_id, kind, body, self.span(node))] if body else []

    def visit_For(self, node: cst.For) -> list[ir.Item]:
        return self.loop(node, "for")

    def visit_While(self, node: cst.While) -> list[ir.Item]:
        return self.loop(node, "while")

    def visit_Try(self, node) -> list[ir.Item]:
        block_id = self.new_id()
        body = self.suite(node.body)
        for handler in node.handlers:
            body += self.suite(handler.body)
        for extra in (node.orelse, node.finalbody):
            if extra is not None:
                body += self.suite(extra.body)
        return [ir.BlockItem(block_id, "try", body, self.span(node))] if body else []

    visit_TryStar = visit_Try

    def visit_With(self, node: cst.With) -> list[ir.Item]:
        roles = [(item, role_call(item.item)) for item in node.items]
        if any(role is not None for _, role in roles):
            problem = None
            if len(node.items) > 1:
                problem = "a role block takes one context manager: `with user():`"
            elif node.asynchronous is not None:
                problem = "a role block cannot be `async with`"
            elif roles[0][0].asname is not None:
                problem = "a role block binds no name: drop `as ...`"
            elif roles[0][0].item.args:
                problem = "a role helper takes no arguments"
            elif self.in_role:
                problem = "a role block inside another role block: close the first one before"
            if problem is not None:
                self.report("PL106", problem, node)
                return list(self.suite(node.body))
            path, role = roles[0][1]
            open_id = self.new_id()
            close_id = self.new_id()
            self.in_role = True
            try:
                body = self.suite(node.body)
            finally:
                self.in_role = False
            return [ir.RoleItem(open_id, close_id, role, path, body, self.span(node),
                                self.place("with", node))]
        block_id = self.new_id()
        body = self.suite(node.body)
        return [ir.BlockItem(block_id, "with", body, self.span(node))] if body else []
