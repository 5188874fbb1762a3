"""The instrumented twin of a @prompt function: the same Python, reporting what it emits.

The analysed `def` is rewritten so that the statements the IR knows report to
`_promptlang_rt` (a `trace.Hooks`) by item id; every other statement is untouched:

    "text"                    ->  _promptlang_rt.text(3)
    question                  ->  _promptlang_rt.value(4, question)
    f"Hi {name:>8}"           ->  _promptlang_rt.fstring(5, (f'{name:>8}',))
    header(name, formal=True) ->  _promptlang_rt.call(6, header, name, formal=True)
    if c: <body>              ->  if c: _promptlang_rt.enter(8); <body>; _promptlang_rt.leave(8)
    with user(): <body>       ->  with _promptlang_rt.role(9, 10): <body>

Calling it with the real arguments is how a call learns, with Python's own
semantics, which arms run and what each hole holds. A module arm is marked by two
calls, not a `with` block: the rewrite adds no block, so a body that CPython accepts
(at most 20 statically nested blocks) still compiles; a module an early `return`
leaves open is closed by the trace when the function returns.

The rewrite works on CPython's `ast` (the analysis uses libcst) because an AST
compiles with the original line and column of every expression: a traceback
from inside a @prompt function points at the user's own file, line and column.
Statements are matched to items by the `place` each IR item carries (the position
CPython's parser gives its statement); an arm is rewritten only when the plan makes
it a module. The new
`def` is compiled inside a factory whose parameters are the original's free
variables (the function is then built on the original closure cells), under a
class of the same name for a method (private names mangle the same way and
`super()` finds `__class__`).
"""

from __future__ import annotations

import ast
import types

import promptlang.compiler.ir as ir   # not `from promptlang.compiler`: that names the package
from promptlang.compiler.analyze import Analysis
from promptlang.compiler.plan import FunctionPlan

RT = "_promptlang_rt"
_FACTORY = "_promptlang_factory"


def instrument(fn, analysis: Analysis, plan: FunctionPlan, hooks) -> types.FunctionType:
    """A function with `fn`'s signature, defaults, globals and closure that reports to
    `hooks` while it runs."""
    tree = ast.parse(analysis.source.text, analysis.source.file)
    ast.increment_lineno(tree, analysis.source.offset)     # the file's lines (source.py)
    node = tree.body[0]
    if analysis.source.indented:
        node = node.body[0]
    new_def = _plain_signature(_Instrument(_places(analysis.ir, plan), node).visit(node))
    freevars = [n for n in fn.__code__.co_freevars if n != "__class__"]
    factory = ast.FunctionDef(
        name=_FACTORY, args=_arguments([RT, *freevars]),
        body=[new_def, ast.Return(ast.Name(fn.__name__, ast.Load()))], decorator_list=[])
    owner = _mangling_class(fn.__qualname__)
    top = factory if owner is None else ast.ClassDef(
        name=owner, bases=[], keywords=[], body=[factory], decorator_list=[])
    module = ast.Module(body=[top], type_ignores=[])
    _locate(module, node)
    code = compile(module, fn.__code__.co_filename, "exec", dont_inherit=True)
    inner = _find_code(_find_code(code, _FACTORY), fn.__code__.co_name)
    cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or ()))
    closure = tuple(types.CellType(hooks) if name == RT else cells.get(name, types.CellType())
                    for name in inner.co_freevars)
    new = types.FunctionType(inner, fn.__globals__, fn.__name__, fn.__defaults__,
                             closure or None)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__qualname__ = fn.__qualname__
    new.__module__ = fn.__module__
    return new


def _places(fir: ir.FunctionIR, plan: FunctionPlan) -> dict:
    """The items to rewrite by their statement's place: every item that reports, and
    the arms the plan makes modules."""
    places = {}
    for item in fir.walk():
        if isinstance(item, ir.BranchItem):
            places.update((arm.place, arm) for arm in item.arms
                          if plan.items[arm.id].module is not None)
        elif hasattr(item, "place"):
            places[item.place] = item
    return places


def _rt(method: str, *args: ast.expr, keywords=()) -> ast.Call:
    return ast.Call(func=ast.Attribute(ast.Name(RT, ast.Load()), method, ast.Load()),
                    args=list(args), keywords=list(keywords))


class _Instrument(ast.NodeTransformer):
    def __init__(self, places: dict, root: ast.FunctionDef):
        self.places = places
        self.root = root

    def at(self, kind: str, node: ast.AST, *extra):
        """The item whose statement is `node` (an `else` and a `case` by their `if` / `match`)."""
        return self.places.get((kind, node.lineno, node.col_offset, *extra))

    # nested scopes are ordinary code: their strings are not this prompt's text
    def visit_FunctionDef(self, node):
        return self.generic_visit(node) if node is self.root else node

    def visit_AsyncFunctionDef(self, node):
        return node

    def visit_ClassDef(self, node):
        return node

    def visit_Lambda(self, node):
        return node

    def visit_Expr(self, node: ast.Expr):
        item = self.at("expr", node)
        if item is None:
            return node
        number = ast.Constant(item.id)
        value = node.value
        if isinstance(item, ir.TextItem):
            call = _rt("text", number)
        elif isinstance(item, ir.ValueItem):
            call = _rt("value", number, value)
        elif isinstance(item, ir.FStringItem):
            holes = [ast.copy_location(ast.JoinedStr([v]), v) for v in value.values
                     if isinstance(v, ast.FormattedValue)]
            call = _rt("fstring", number, ast.Tuple(holes, ast.Load()))
        else:
            call = _rt("call", number, value.func, *value.args, keywords=value.keywords)
        return ast.copy_location(ast.Expr(ast.copy_location(call, value)), node)

    def module(self, item_id: int, body: list[ast.stmt]) -> list[ast.stmt]:
        enter = ast.Expr(_rt("enter", ast.Constant(item_id)))
        leave = ast.Expr(_rt("leave", ast.Constant(item_id)))
        return [ast.copy_location(enter, body[0]), *body, ast.copy_location(leave, body[-1])]

    def visit_If(self, node: ast.If):
        else_arm = self.at("else", node)    # before the visit: the orelse may change
        self.generic_visit(node)
        arm = self.at("if", node)
        if arm is not None:
            node.body = self.module(arm.id, node.body)
        if else_arm is not None:
            node.orelse = self.module(else_arm.id, node.orelse)
        return node

    def visit_Match(self, node: ast.Match):
        self.generic_visit(node)
        for index, case in enumerate(node.cases):
            arm = self.at("case", node, index)
            if arm is not None:
                case.body = self.module(arm.id, case.body)
        return node

    def visit_With(self, node: ast.With):
        item = self.at("with", node)
        self.generic_visit(node)
        if item is not None:
            role = _rt("role", ast.Constant(item.open_id), ast.Constant(item.close_id))
            node.items = [ast.withitem(ast.copy_location(role, node.items[0].context_expr))]
        return node


def _plain_signature(node: ast.FunctionDef) -> ast.FunctionDef:
    """No decorators and no annotations (evaluated once already); defaults stand in as
    None, and the function object gets the real ones."""
    args = node.args
    for a in (*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg):
        if a is not None:
            a.annotation = None
    args.defaults = [ast.copy_location(ast.Constant(None), d) for d in args.defaults]
    args.kw_defaults = [None if d is None else ast.copy_location(ast.Constant(None), d)
                        for d in args.kw_defaults]
    node.decorator_list = []
    node.returns = None
    return node


def _arguments(names: list[str]) -> ast.arguments:
    return ast.arguments(posonlyargs=[], args=[ast.arg(n) for n in names], vararg=None,
                         kwonlyargs=[], kw_defaults=[], kwarg=None, defaults=[])


def _locate(tree: ast.AST, where: ast.AST) -> None:
    """The factory (and class) get the `def`'s position; other new nodes their parent's."""
    ast.copy_location(tree.body[0], where)
    ast.fix_missing_locations(tree)


def _mangling_class(qualname: str) -> str | None:
    """The innermost class whose body (at any depth) holds the function: it decides how
    `__private` names are mangled."""
    parts = qualname.split(".")[:-1]
    for index in range(len(parts) - 1, -1, -1):
        followed_by_locals = index + 1 < len(parts) and parts[index + 1] == "<locals>"
        if parts[index] != "<locals>" and not followed_by_locals:
            return parts[index]
    return None


def _find_code(code: types.CodeType, name: str) -> types.CodeType:
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            if const.co_name == name:
                return const
            try:
                return _find_code(const, name)
            except LookupError:
                pass
    raise LookupError(name)
