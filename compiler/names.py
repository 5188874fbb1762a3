"""PML names derived from Python source: a function's module, an arm's, a hole's parameter.

`lower.py` names what it caches with these: a function's module is its name; an arm
is named after its condition or pattern (`city == "paris"` -> `city-paris`, `else`,
`case _` -> `default`); a hole after its expression. Making siblings unique (`-2`,
`-3`) is the lowering's job.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize

import promptlang.compiler.ir as ir   # not `from promptlang.compiler`: that names the package
from promptlang.pml import nodes

RESERVED = nodes.ROLES + ("scaffold",)
_NAME_CHARS = re.compile(r"[^\w.-]+")
_OPERATORS = {"<": "lt", "<=": "le", ">": "gt", ">=": "ge", "!=": "ne", "|": "or", "&": "and",
              "+": "plus", "-": "minus", "*": "times", "/": "div", "%": "mod", "~": "inv"}
_MAX_NAME = 40


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
    try:
        value = ast.literal_eval(token)
    except (ValueError, SyntaxError):
        return token
    return value if isinstance(value, str) else str(value)


def module_base(function_name: str) -> str:
    name = _NAME_CHARS.sub("-", function_name).strip("-") or "prompt"
    return f"fn-{name}" if name in RESERVED else name


def arm_base(branch: ir.BranchItem, arm: ir.Arm) -> str:
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


def param_base(hole: ir.Hole) -> str:
    if _NAME_CHARS.search(hole.code) is None:
        return hole.code
    return slug(hole.code) or "value"
