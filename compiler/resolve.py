"""Resolution: what a @prompt function's names refer to, and the length bounds of its holes.

Part of lowering (`lower.py`), run when the function's module is complete: a dotted
name (`header`, `pl.user`, `self.intro`) is looked up as Python would at call time
(the function's globals, closure cells, builtins, the owning class for `self`);
bounds come from `Annotated[..., MaxTokens(n)]` annotations, then `params=`.
"""

from __future__ import annotations

import builtins
import inspect
import typing
from typing import Callable

import promptlang.compiler.ir as ir   # not `from promptlang.compiler`: that names the package
from promptlang.compiler.markers import MaxTokens, token_count_problem

UNRESOLVED = object()      # a name that depends on local values: unknown before the call

Report = Callable[..., None]     # report(code, message, span)


def resolve(function, fir: ir.FunctionIR, path: tuple[str, ...] | None):
    """The object a dotted name refers to, looked up as Python would at call time;
    `UNRESOLVED` when it depends on local values."""
    if not path:
        return UNRESOLVED
    fn = function.__wrapped__
    first = path[0]
    owner = _owner_class(fn)
    if owner is not None and fir.parameters and first == fir.parameters[0]:
        value = owner
    elif first in fir.parameters or first in fir.locals:
        return UNRESOLVED
    elif first in fn.__code__.co_freevars:
        cell = fn.__closure__[fn.__code__.co_freevars.index(first)]
        try:
            value = cell.cell_contents
        except ValueError:
            return UNRESOLVED
    elif first in fn.__globals__:
        value = fn.__globals__[first]
    elif hasattr(builtins, first):
        value = getattr(builtins, first)
    else:
        return UNRESOLVED
    for attribute in path[1:]:
        try:     # a module's attribute may be lazy (module __getattr__); a class's is not
            value = (getattr(value, attribute) if inspect.ismodule(value)
                     else inspect.getattr_static(value, attribute))
        except AttributeError:
            return UNRESOLVED
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
    return value


def read_bounds(function, fir: ir.FunctionIR, report: Report) -> tuple[dict[str, int], set[str]]:
    """Length bounds by name or hole expression: annotations, then `params=`; and the
    keys `params=` declares (normalised)."""
    fn = function.__wrapped__
    at = fir.params_span or fir.span
    bounds: dict[str, int] = {}
    for name, annotation in _annotations(fn).items():
        for meta in getattr(annotation, "__metadata__", ()):
            if isinstance(meta, MaxTokens):
                bounds[name] = meta.tokens
    known = set(fir.parameters) | fir.locals | {h.code for item in fir.walk() for h in holes(item)}
    for key, value in (function.options.get("params") or {}).items():
        tokens = value.tokens if isinstance(value, MaxTokens) else value
        if not isinstance(key, str):
            report("PL103", f"params= keys are names or hole expressions, not {key!r}", at)
            continue
        problem = token_count_problem(tokens)
        if problem is not None:
            report("PL104", f"the bound for {key!r} must be {problem}", at)
            continue
        key = " ".join(key.split())
        if key not in known:
            report("PL103", f"params= names {key!r}, which is not a parameter, a local "
                            f"variable or a text hole of {fir.name}", at)
            continue
        if key in bounds and bounds[key] != tokens:
            report("PL105", f"{key!r} is bounded to {bounds[key]} tokens by its annotation "
                            f"and to {tokens} by params=", at)
            continue
        bounds[key] = tokens
    declared = {" ".join(k.split()) for k in function.options.get("params") or {}
                if isinstance(k, str)}
    return bounds, declared


def bound(bounds: dict[str, int], hole: ir.Hole) -> int | None:
    for key in (hole.code, hole.name):
        if key is not None and key in bounds:
            return bounds[key]
    return None


def warn_unused_bounds(fir: ir.FunctionIR, bounds: dict[str, int], declared: set[str],
                       report: Report) -> None:
    for key in sorted(declared):
        if key in bounds and not any(
                key in (h.code, h.name) for item in fir.walk() for h in holes(item)):
            report("PL301", f"params= bounds {key!r}, but no text hole of {fir.name} is "
                            f"{key!r}", fir.params_span or fir.span)


def holes(item) -> tuple[ir.Hole, ...]:
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
