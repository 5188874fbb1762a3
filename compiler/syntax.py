"""Syntax helpers of the analysis (`analyze.py`): facts read off libcst nodes alone.

The dedent rule of a text block, whether a statement is the docstring, the holes of
an f-string, dotted names, role calls, and `ScopeScan`: what a function body holds
outside nested scopes (calls, assigned names, `yield`, `await`). Nothing here looks
at positions or makes IR.
"""

from __future__ import annotations

import textwrap

import libcst as cst

from promptlang.pml.nodes import ROLES


def dedent_block(text: str) -> str:
    """The dedent rule for a multi-line triple-quoted text statement (analyze.py's doc)."""
    first, _, rest = text.partition("\n")
    if not _:
        return text
    rest = textwrap.dedent(rest)
    return rest if not first.strip() else first + "\n" + rest


def is_block_literal(value) -> bool:
    if not isinstance(value, (cst.SimpleString, cst.FormattedString)):
        return False
    if isinstance(value, cst.SimpleString):
        quote = value.value.lstrip("rRbBuU")[:3]
        raw = value.value
    else:
        quote = value.start.lstrip("rRfF")[:3]
        raw = value.start + "".join(
            p.value if isinstance(p, cst.FormattedStringText) else "{}" for p in value.parts)
    return quote in ('"""', "'''") and "\n" in raw


def is_docstring(statement) -> bool:
    """Whether a first statement is what Python takes as the docstring (a str literal)."""
    if not isinstance(statement, cst.Expr):
        return False
    strings = [statement.value]
    while strings and isinstance(strings[-1], cst.ConcatenatedString):
        last = strings.pop()
        strings += [last.left, last.right]
    return all(isinstance(s, cst.SimpleString) and "b" not in s.prefix.lower() for s in strings)


def hole_nodes(value) -> list[cst.FormattedStringExpression]:
    if isinstance(value, cst.ConcatenatedString):
        return hole_nodes(value.left) + hole_nodes(value.right)
    if isinstance(value, cst.FormattedString):
        return [p for p in value.parts if isinstance(p, cst.FormattedStringExpression)]
    return []


def dotted(node) -> tuple[str, ...] | None:
    if isinstance(node, cst.Name):
        return (node.value,)
    if isinstance(node, cst.Attribute):
        base = dotted(node.value)
        return None if base is None else base + (node.attr.value,)
    return None


def role_call(node) -> tuple[tuple[str, ...], str] | None:
    """(path, role) when `node` looks like `user()` / `pl.user()`."""
    if isinstance(node, cst.Call):
        path = dotted(node.func)
        if path is not None and path[-1] in ROLES:
            return path, path[-1]
    return None


def normalise(code: str) -> str:
    return " ".join(code.split())


class ScopeScan(cst.CSTVisitor):
    """What a function body contains, not counting nested functions, lambdas and classes:
    calls, names it assigns, `yield` and `await`."""

    def __init__(self):
        super().__init__()
        self.calls: list[cst.Call] = []
        self.stores: set[str] = set()
        self.yields: list[cst.CSTNode] = []
        self.awaits: list[cst.CSTNode] = []

    def visit_FunctionDef(self, node) -> bool:
        self.stores.add(node.name.value)
        return False

    def visit_ClassDef(self, node) -> bool:
        self.stores.add(node.name.value)
        return False

    def visit_Lambda(self, node) -> bool:
        return False

    def visit_Call(self, node: cst.Call) -> None:
        self.calls.append(node)

    def visit_Yield(self, node) -> None:
        self.yields.append(node)

    def visit_Await(self, node) -> None:
        self.awaits.append(node)

    def _targets(self, node) -> None:
        if isinstance(node, cst.Name):
            self.stores.add(node.value)
        elif isinstance(node, (cst.Tuple, cst.List)):
            for element in node.elements:
                self._targets(element.value)
        elif isinstance(node, cst.StarredElement):
            self._targets(node.value)

    def visit_AssignTarget(self, node) -> None:
        self._targets(node.target)

    def visit_AnnAssign(self, node) -> None:
        self._targets(node.target)

    def visit_AugAssign(self, node) -> None:
        self._targets(node.target)

    def visit_For(self, node) -> None:
        self._targets(node.target)

    def visit_AsName(self, node) -> None:
        self._targets(node.name)

    def visit_NamedExpr(self, node) -> None:
        self._targets(node.target)

    def visit_MatchAs(self, node) -> None:
        if node.name is not None:
            self.stores.add(node.name.value)

    def visit_MatchStar(self, node) -> None:
        if node.name is not None:
            self.stores.add(node.name.value)

    def visit_ImportAlias(self, node) -> None:
        if node.asname is None:
            name = node.name
            while isinstance(name, cst.Attribute):
                name = name.value
            if isinstance(name, cst.Name):
                self.stores.add(name.value)
