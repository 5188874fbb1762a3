"""`promptlang compile` and `promptlang check`: the compiler on the command line.

    promptlang compile app.py [-o DIR] [--call 'f(x=1)']
    promptlang check app.py

Both import the file (as the module its package folders make it), with @prompt
collecting analysis errors instead of raising them, then lower every @prompt
function defined in it and print every diagnostic, mypy-style. `compile` writes
one schema per function (`DIR/<schema name>.pml`, or stdout) and, with `--call`,
the PML prompt of that call, whose arguments must be Python literals.

Exit status: 0 ok (warnings allowed), 1 diagnostics (syntax errors included),
2 usage errors (no such file, a malformed --call, an unknown function).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import sys
import traceback
from dataclasses import dataclass, field

from promptlang.compiler.decorator import PromptFunction, collecting
from promptlang.compiler.diagnostics import CompileError, Diagnostic, errors, sort_key
from promptlang.compiler.source import module_name_for_file
from promptlang.errors import PromptLangError, Span


def register(subparsers) -> None:
    """Add `compile` and `check` to the `promptlang` command's subparsers."""
    compile_ = subparsers.add_parser(
        "compile", help="compile the @prompt functions of a Python file to PML",
        description="Write the PML schema of every @prompt function in FILE (one .pml each "
                    "in DIR, or to stdout); with --call, also the PML prompt of that call.")
    compile_.add_argument("file", metavar="FILE", help="a Python file")
    compile_.add_argument("-o", "--output", metavar="DIR", help="folder for the .pml files")
    compile_.add_argument("--call", metavar="CALL",
                          help="a call with literal arguments, e.g. 'answer(city=\"Paris\")'")
    compile_.set_defaults(func=run_compile)
    check = subparsers.add_parser(
        "check", help="report the diagnostics of a Python file's @prompt functions",
        description="Compile every @prompt function in FILE and print what cannot be "
                    "cached, as file:line:col: severity: message [code].")
    check.add_argument("file", metavar="FILE", help="a Python file")
    check.set_defaults(func=run_check)


@dataclass
class _Compiled:
    functions: list[PromptFunction] = field(default_factory=list)
    diagnostics: list[Diagnostic] = field(default_factory=list)
    module: object = None


class _UsageError(Exception):
    pass


def run_check(args: argparse.Namespace) -> int:
    try:
        compiled = _compile_file(args.file)
    except _UsageError as e:
        print(f"promptlang check: {e}", file=sys.stderr)
        return 2
    _print(compiled.diagnostics, sys.stdout)
    if errors(compiled.diagnostics):
        return 1
    count = len(compiled.functions)
    print(f"{args.file}: {count} @prompt function{'s' if count != 1 else ''}, no errors")
    return 0


def run_compile(args: argparse.Namespace) -> int:
    try:
        call = _parse_call(args.call) if args.call else None
        compiled = _compile_file(args.file)
    except _UsageError as e:
        print(f"promptlang compile: {e}", file=sys.stderr)
        return 2
    _print(compiled.diagnostics, sys.stderr)
    if errors(compiled.diagnostics):
        return 1
    outputs = [(f"{f.schema_name}.pml", f.schema_pml()) for f in compiled.functions]
    if call is not None:
        path, args_, kwargs = call
        function = _find(compiled, path, args.file)
        if function is None:
            return 2
        try:
            result = function(*args_, **kwargs)
        except PromptLangError as e:
            print(e, file=sys.stderr)
            return 1
        except Exception as e:      # noqa: BLE001 - the user's code failed: say where, no trace
            print(_located(e, args.file, f"the call {args.call} raised"), file=sys.stderr)
            return 1
        outputs.append((f"{function.schema_name}.prompt.pml", result.prompt_pml()))
    if args.output:
        os.makedirs(args.output, exist_ok=True)
        for name, text in outputs:
            with open(os.path.join(args.output, name), "w", encoding="utf-8") as f:
                f.write(text + "\n")
            print(os.path.join(args.output, name), file=sys.stderr)
    else:
        for _, text in outputs:
            print(text)
    return 0


# -- steps ------------------------------------------------------------------------------------


def _compile_file(path: str) -> _Compiled:
    if not os.path.isfile(path):
        raise _UsageError(f"{path}: no such file")
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise _UsageError(f"{path}: cannot read it: {e}") from None
    compiled = _Compiled()
    try:
        compile(source, path, "exec", dont_inherit=True)
    except SyntaxError as e:
        line_text = (e.text or "").rstrip("\r\n")
        compiled.diagnostics.append(Diagnostic(
            "PL001", e.msg, Span(path, e.lineno or 1, e.offset or 1, line_text)))
        return compiled
    name = module_name_for_file(path)
    root = os.path.abspath(path)
    for _ in name.split("."):
        root = os.path.dirname(root)
    sys.path.insert(0, root)
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        with collecting() as found:
            try:
                spec.loader.exec_module(module)
            except CompileError as e:
                compiled.diagnostics.extend(e.diagnostics)
            except (Exception, SystemExit) as e:    # noqa: BLE001 - report it, located
                compiled.diagnostics.append(_import_failure(e, path))
        compiled.module = module
        here = os.path.abspath(path)
        compiled.functions = [f for f in found
                              if os.path.abspath(f.__wrapped__.__code__.co_filename) == here]
        for function in compiled.functions:
            compiled.diagnostics.extend(function.analysis.diagnostics)
            if function.analysis.ir is None:
                continue
            try:
                function.plan()
            except CompileError as e:
                compiled.diagnostics.extend(e.diagnostics)
            else:
                compiled.diagnostics.extend(function.diagnostics)
    finally:
        sys.path.remove(root)
    compiled.diagnostics = sorted(set(compiled.diagnostics), key=sort_key)
    return compiled


def _parse_call(text: str):
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except SyntaxError as e:
        raise _UsageError(f"--call {text!r} is not a Python call: {e.msg}") from None
    if not isinstance(tree, ast.Call):
        raise _UsageError(f"--call {text!r} is not a call like f(x=1)")
    path = _dotted(tree.func)
    if path is None:
        raise _UsageError(f"--call {text!r}: call a function by its name")
    try:
        args = [ast.literal_eval(a) for a in tree.args]
        kwargs = {}
        for keyword in tree.keywords:
            if keyword.arg is None:
                raise _UsageError(f"--call {text!r}: write each keyword argument out")
            kwargs[keyword.arg] = ast.literal_eval(keyword.value)
    except (ValueError, TypeError, SyntaxError):
        raise _UsageError(f"--call {text!r}: arguments must be Python literals "
                          "(strings, numbers, lists, dicts, True/False/None)") from None
    return path, args, kwargs


def _find(compiled: _Compiled, path: str, file: str) -> PromptFunction | None:
    value = compiled.module
    for part in path.split("."):
        value = getattr(value, part, None)
    if isinstance(value, PromptFunction) and value in compiled.functions:
        return value
    names = ", ".join(f.__qualname__ for f in compiled.functions) or "none"
    print(f"promptlang compile: no @prompt function {path!r} in {file} (found: {names})",
          file=sys.stderr)
    return None


def _dotted(node) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _import_failure(error: BaseException, path: str) -> Diagnostic:
    return Diagnostic("PL003", f"importing the file raised {type(error).__name__}: {error}",
                      _frame_span(error, path))


def _located(error: BaseException, path: str, what: str) -> str:
    span = _frame_span(error, path)
    where = f"{span}: " if span is not None else ""
    return f"{where}error: {what} {type(error).__name__}: {error}"


def _frame_span(error: BaseException, path: str) -> Span | None:
    """Where in `path` the exception passed last."""
    here = os.path.abspath(path)
    found = None
    for frame in traceback.extract_tb(error.__traceback__):
        if os.path.abspath(frame.filename) == here:
            found = frame
    if found is None:
        return None
    return Span(path, found.lineno or 1, (found.colno or 0) + 1, found.line or "")


def _print(diagnostics, stream) -> None:
    for d in diagnostics:
        print(d.format(), file=stream)
