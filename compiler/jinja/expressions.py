"""Jinja2 expressions as the template frontend reads them: which it may cache, what they
are named, and their values, computed by Jinja2 itself.

An expression is *cacheable* when it is made of names, constants, attribute and item
lookups, comparisons, `and`/`or`/`not`, and Jinja2's own filters and tests (not `random`):
no calls, no filter or test the application registered. Its value is never computed by
code written here: `value()` and `holds()` compile the expression, as Jinja2's AST, into a
one-line template of the same environment and render it, so every value is the one
Jinja2 would produce when rendering the whole template.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import jinja2
from jinja2 import nodes
from jinja2.filters import FILTERS
from jinja2.tests import TESTS

from promptlang.pml.nodes import MAX_POSITIONS

BOUND_FILTER = "maxlen"            # `{{ q | maxlen(64) }}`: a length bound in tokens
_IMPURE_FILTERS = frozenset({"random"})
_ALLOWED = (nodes.Name, nodes.Const, nodes.Getattr, nodes.Getitem, nodes.Filter, nodes.Test,
            nodes.Compare, nodes.Operand, nodes.Not, nodes.And, nodes.Or, nodes.CondExpr,
            nodes.Concat, nodes.Tuple, nodes.List, nodes.Slice, nodes.Neg, nodes.Pos)
_NAME_CHARS = re.compile(r"[^\w.-]+")
_MAX_NAME = 40


def bound_of(expr: nodes.Expr) -> tuple[nodes.Expr, int | None, str | None]:
    """(the expression without its outer `maxlen(N)`, N, a problem with the bound or None)."""
    if not (isinstance(expr, nodes.Filter) and expr.name == BOUND_FILTER):
        return expr, None, None
    inner = expr.node if expr.node is not None else nodes.Const("")
    args = expr.args
    if len(args) != 1 or expr.kwargs or not isinstance(args[0], nodes.Const):
        return inner, None, "maxlen takes one whole number of tokens: `| maxlen(64)`"
    n = args[0].value
    if not isinstance(n, int) or isinstance(n, bool) or n < 1 or n > MAX_POSITIONS:
        return inner, None, f"maxlen({n!r}) is not a positive whole number of tokens"
    return inner, n, None


def unsupported_part(expr: nodes.Node) -> str | None:
    """What keeps `expr` from being cached (a short phrase), or None where nothing does."""
    for node in (expr, *expr.find_all(nodes.Node)):
        if isinstance(node, nodes.Call):
            return "a call"
        if not isinstance(node, _ALLOWED):
            return f"a {type(node).__name__.lower()} expression"
        if isinstance(node, nodes.Filter):
            if node.name == BOUND_FILTER and node is not expr:
                return "maxlen inside an expression (it bounds a whole `{{ ... }}`)"
            if node.name != BOUND_FILTER and (node.name not in FILTERS
                                              or node.name in _IMPURE_FILTERS):
                return f"the filter {node.name!r} (not one of Jinja2's own)"
            if node.dyn_args is not None or node.dyn_kwargs is not None:
                return "a filter with *args or **kwargs"
        if isinstance(node, nodes.Test):
            if node.name not in TESTS:
                return f"the test {node.name!r} (not one of Jinja2's own)"
            if node.dyn_args is not None or node.dyn_kwargs is not None:
                return "a test with *args or **kwargs"
    return None


def names_in(expr: nodes.Node) -> set[str]:
    """The variables `expr` reads."""
    found = {n.name for n in expr.find_all(nodes.Name) if n.ctx == "load"}
    if isinstance(expr, nodes.Name) and expr.ctx == "load":
        found.add(expr.name)
    return found


def path_of(expr: nodes.Expr) -> str | None:
    """`user.name` for `user.name` or `user["name"]`; None for anything but such a path."""
    if isinstance(expr, nodes.Name):
        return expr.name
    if isinstance(expr, nodes.Getattr):
        base = path_of(expr.node)
        return None if base is None else f"{base}.{expr.attr}"
    if isinstance(expr, nodes.Getitem) and isinstance(expr.arg, nodes.Const):
        base = path_of(expr.node)
        key = expr.arg.value
        return None if base is None or not isinstance(key, (str, int)) else f"{base}.{key}"
    return None


def slug(expr: nodes.Expr) -> str:
    """A PML name made of an expression's words: `mode == "json"` -> mode-json."""
    words: list[str] = []
    _words(expr, words)
    name = _NAME_CHARS.sub("-", "-".join(words)).strip("-.")
    if len(name) > _MAX_NAME:
        cut = name.rfind("-", 0, _MAX_NAME + 1)
        name = name[:cut if cut > 0 else _MAX_NAME]
    return name


def _words(node: nodes.Node, out: list[str]) -> None:
    if isinstance(node, nodes.Name):
        out.append(node.name)
    elif isinstance(node, nodes.Const):
        out.extend(re.findall(r"\w+", str(node.value)))
    elif isinstance(node, nodes.Getattr):
        _words(node.node, out)
        out.append(node.attr)
    elif isinstance(node, nodes.Not):
        out.append("not")
        _words(node.node, out)
    elif isinstance(node, nodes.Compare):
        _words(node.expr, out)
        for operand in node.ops:
            if operand.op not in ("eq", "in"):
                out.append(operand.op)
            _words(operand.expr, out)
    elif isinstance(node, nodes.Test):
        _words(node.node, out)
        out.append(node.name)
    else:
        for child in node.iter_child_nodes():
            _words(child, out)


def renderer(environment: jinja2.Environment, body: list[nodes.Node]) -> jinja2.Template:
    """A template of `environment` made of Jinja2 nodes (statements or outputs)."""
    tree = nodes.Template(body, lineno=1)
    tree.set_environment(environment)
    code = environment.compile(tree)
    return environment.template_class.from_code(environment, code,
                                                environment.make_globals(None))


def value_template(environment: jinja2.Environment, expr: nodes.Expr) -> jinja2.Template:
    """Renders the text Jinja2 writes for `{{ expr }}`."""
    return renderer(environment, [nodes.Output([expr])])


def condition_template(environment: jinja2.Environment, test: nodes.Expr) -> jinja2.Template:
    """Renders "1" where Jinja2 takes `{% if test %}`, else nothing."""
    taken = [nodes.Output([nodes.TemplateData("1")])]
    return renderer(environment, [nodes.If(test, taken, [], [])])


def value(environment: jinja2.Environment, expr: nodes.Expr, scope: Mapping[str, Any]) -> str:
    """The text Jinja2 writes for `{{ expr }}` with the variables of `scope`."""
    return value_template(environment, expr).render(scope)


def holds(environment: jinja2.Environment, test: nodes.Expr, scope: Mapping[str, Any]) -> bool:
    """Whether Jinja2 takes `{% if test %}` with the variables of `scope`."""
    return condition_template(environment, test).render(scope) == "1"


def column(line_text: str, needle: str) -> int:
    """The 1-based column of `needle` in a source line: first where it opens a `{{ ... }}`
    or a `{% ... %}`, else anywhere, else the line's first tag."""
    if needle:
        opened = re.search(r"(?:\{\{|\{%)[-+]?\s*(" + re.escape(needle) + ")", line_text)
        if opened:
            return opened.start(1) + 1
    at = line_text.find(needle) if needle else -1
    if at < 0:
        at = max(line_text.find("{%"), line_text.find("{{"))
    if at < 0:
        at = len(line_text) - len(line_text.lstrip())
    return at + 1


def call_column(line_text: str, name: str) -> int:
    """The 1-based column of a call of `name` inside `{{ ... }}` on a source line (a
    namespace's `ns.name(` included), else of `name` anywhere."""
    found = re.search(r"\{\{-?\s*((?:\w+\.)?" + re.escape(name) + r")\s*\(", line_text)
    return found.start(1) + 1 if found else column(line_text, name)
