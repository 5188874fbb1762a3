"""Helpers for the compiler tests: load a dedented source as a module inspect can read."""

from __future__ import annotations

import ast
import functools
import itertools
import linecache
import sys
import textwrap
import types

_numbers = itertools.count()


def load(source: str, name: str | None = None) -> types.ModuleType:
    """Run dedented `source` as a fresh module named `name` (default: a unique name), from a
    file name registered with linecache so that inspect finds each function's source."""
    source = textwrap.dedent(source)
    name = name or f"case{next(_numbers)}"
    filename = f"{name}.py"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    module = types.ModuleType(name)
    module.__file__ = filename
    sys.modules[name] = module
    exec(compile(source, filename, "exec", dont_inherit=True), module.__dict__)
    return module


# -- the oracle: a @prompt source run as plain Python string building ------------------------
#
# Written with the standard `ast` module, independently of the compiler: every expression
# statement of a @prompt function (not the docstring, not in nested functions) appends
# `str(value)` to a buffer unless the value is None; a multi-line triple-quoted text
# statement is dedented (docs/COMPILER.md); role blocks append the tokenizer's affixes;
# a @prompt callee appends to the same buffer and returns None.

_ORACLE_NAMES = ("prompt", "system", "user", "assistant")


def _is_prompt_decorator(node: ast.expr) -> bool:
    target = node.func if isinstance(node, ast.Call) else node
    name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
    return name == "prompt"


class _Emitting(ast.NodeTransformer):
    """Rewrites the expression statements of one function body into _oracle_emit calls."""

    def __init__(self, source: str):
        self.source = source

    def visit_FunctionDef(self, node):
        return node       # nested functions are ordinary code

    visit_AsyncFunctionDef = visit_FunctionDef
    visit_ClassDef = visit_FunctionDef

    def visit_Expr(self, node: ast.Expr):
        value = node.value
        segment = ast.get_source_segment(self.source, value) or ""
        block = segment.lstrip("rRfFuU")[:3] in ('"""', "'''") and "\n" in segment
        if block and isinstance(value, ast.JoinedStr):
            consts = ast.Tuple([v if isinstance(v, ast.Constant) else ast.Constant(None)
                                for v in value.values], ast.Load())
            holes = ast.Tuple([ast.JoinedStr([v]) for v in value.values
                               if isinstance(v, ast.FormattedValue)], ast.Load())
            call = ast.Call(ast.Name("_oracle_emit_block_f", ast.Load()), [consts, holes], [])
        elif block:
            call = ast.Call(ast.Name("_oracle_emit_block", ast.Load()), [value], [])
        else:
            call = ast.Call(ast.Name("_oracle_emit", ast.Load()), [value], [])
        return ast.copy_location(ast.Expr(call), node)


class _PromptFunctions(ast.NodeTransformer):
    def __init__(self, source: str):
        self.source = source

    def visit_FunctionDef(self, node: ast.FunctionDef):
        self.generic_visit(node)
        if not any(_is_prompt_decorator(d) for d in node.decorator_list):
            return node
        node.decorator_list = [ast.Name("_oracle_prompt", ast.Load())]
        body = node.body
        start = 1 if (body and isinstance(body[0], ast.Expr) and isinstance(
            body[0].value, ast.Constant) and isinstance(body[0].value.value, str)) else 0
        emit = _Emitting(self.source)
        node.body = body[:start] + [emit.visit(s) for s in body[start:]] or [ast.Pass()]
        return node

    def visit_ImportFrom(self, node: ast.ImportFrom):
        if (node.module or "").startswith("promptlang"):   # the oracle's own names stay
            node.names = [a for a in node.names if a.name not in _ORACLE_NAMES] or None
            return node if node.names else ast.Pass()
        return node


def _oracle_dedent(template: str) -> str:
    first, newline, rest = template.partition("\n")
    if not newline:
        return template
    rest = textwrap.dedent(rest)
    return rest if not first.strip() else first + "\n" + rest


def oracle_module(source: str, tokenizer) -> dict:
    """Run `source` with @prompt functions turned into string builders. Call
    `ns["_oracle_render"](callable, *args, **kwargs)` for the text of one call."""
    source = textwrap.dedent(source)
    tree = _PromptFunctions(source).visit(ast.parse(source))
    ast.fix_missing_locations(tree)
    out: list[str] = []
    hole = "\ue001"

    def emit(value):
        if value is not None:
            out.append(str(value))

    def emit_block_f(consts, holes):
        template = "".join(hole if c is None else c.value for c in consts)
        pieces = _oracle_dedent(template).split(hole)
        out.append(pieces[0] + "".join(h + p for h, p in zip(holes, pieces[1:])))

    class Role:
        def __init__(self, role):
            self.role = role

        def __call__(self):
            return self

        def __enter__(self):
            out.append(tokenizer.role_affixes(self.role)[0])

        def __exit__(self, *exc):
            if exc[0] is None:
                out.append(tokenizer.role_affixes(self.role)[1])
            return False

    def oracle_prompt(fn=None, **options):
        def wrap(f):
            def run(*args, **kwargs):
                f(*args, **kwargs)
            return functools.wraps(f)(run)
        return wrap if fn is None else wrap(fn)

    def render(fn, *args, **kwargs) -> str:
        out.clear()
        fn(*args, **kwargs)
        return "".join(out)

    ns = {"__name__": "oracle", "_oracle_emit": emit, "_oracle_emit_block": lambda v: out.append(
        _oracle_dedent(v)), "_oracle_emit_block_f": emit_block_f, "_oracle_prompt": oracle_prompt,
        "prompt": oracle_prompt, "system": Role("system"), "user": Role("user"),
        "assistant": Role("assistant"), "_oracle_render": render}
    exec(compile(tree, "<oracle>", "exec", dont_inherit=True), ns)
    return ns
