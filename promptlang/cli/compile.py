"""`promptlang compile` and the Python half of `promptlang check`.

    promptlang compile app.py [-o DIR] [--call 'f(x=1)'] [--plan] [--compact]
    promptlang compile prompts/rag.j2 [--documents docs=FILE.json] [--param q=64] [--call ...]
    promptlang compile schema.pml --plan
    promptlang check app.py

A Python file is imported (compiler/pyfile.py): its top-level code RUNS, so compile or check
only files you would run. A Jinja2 template (.j2, .jinja, .jinja2) is parsed, never rendered
(compiler/jinja/; its options: templates.py). `compile` writes one schema per function or
template (`DIR/<schema name>.pml`, or stdout), indented for reading unless --compact, and,
with `--call`, the PML prompt of that call, whose arguments must be Python literals;
`--plan` prints what each schema will cost to cache instead (plan.py); `check` prints every
diagnostic, mypy-style (`app.py:14:9: error: ... [PL203]`).

Exit status: 0 ok (warnings allowed), 1 diagnostics (syntax errors included),
2 usage errors (no such file, a malformed --call, an unknown function).
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import sys
from typing import Any

from promptlang.cli import plan, templates
from promptlang.errors import UsageError


def register(subparsers: Any) -> None:
    """Add `compile` to the `promptlang` command's subparsers (check.py adds `check`)."""
    compile_ = subparsers.add_parser(
        "compile", help="compile @prompt functions (runs the file) or a template to PML",
        description="Write the PML schema of every @prompt function in FILE (one .pml each "
                    "in DIR, or to stdout); with --call, also the PML prompt of that call. "
                    "FILE is imported: its top-level code runs, as with `python FILE`.")
    compile_.add_argument("file", metavar="FILE",
                          help="a Python file, a Jinja2 template (.j2, .jinja, .jinja2) or, "
                               "with --plan, a PML schema")
    compile_.add_argument("-o", "--output", metavar="DIR", help="folder for the .pml files")
    compile_.add_argument("--call", metavar="CALL",
                          help="a call with literal arguments, e.g. 'answer(city=\"Paris\")'; "
                               "for a template, its variables: 'rag(question=\"Why?\")'")
    compile_.add_argument("--compact", action="store_true",
                          help="write PML without indentation (one line per document)")
    compile_.add_argument("--plan", action="store_true",
                          help="print each schema's cache plan: tokens, KV bytes, encode time, "
                               "combinations (loads the model; encodes nothing)")
    compile_.add_argument("--model", metavar="PATH",
                          help="with --plan: the model (default: the embedded SmolLM2-135M)")
    templates.add(compile_)
    compile_.set_defaults(func=run_compile)


def check_file(path: str) -> int:
    """Print the diagnostics of the Python file `path`; the exit status."""
    from promptlang.compiler.diagnostics import errors
    from promptlang.compiler.pyfile import print_diagnostics

    try:
        compiled = _compile(path)
    except UsageError as e:
        print(f"promptlang check: {e}", file=sys.stderr)
        return 2
    print_diagnostics(compiled.diagnostics, sys.stdout)
    if errors(compiled.diagnostics):
        return 1
    count = len(compiled.functions)
    print(f"{path}: {count} @prompt function{'s' if count != 1 else ''}, no errors")
    return 0


def check_template(path: str) -> int:
    """Print the diagnostics of the Jinja2 template `path`; the exit status."""
    from promptlang.compiler.jinja import from_template
    from promptlang.compiler.pyfile import print_diagnostics
    from promptlang.errors import CompileError, SourceFileError
    from promptlang.pml import nodes

    try:
        template = from_template(path)
    except SourceFileError as e:
        print(f"promptlang check: {e}", file=sys.stderr)
        return 2
    except CompileError as e:
        print_diagnostics(e.diagnostics, sys.stdout)
        return 1
    print_diagnostics(template.diagnostics, sys.stdout)
    modules = sum(1 for _ in nodes.iter_modules(template.schema)) - 1      # not the root
    print(f"{path}: schema {template.schema_name}, {modules} module"
          f"{'s' if modules != 1 else ''} under its root, no errors")
    return 0


def run_compile(args: argparse.Namespace) -> int:
    from promptlang.compiler.diagnostics import errors
    from promptlang.compiler.pyfile import located, print_diagnostics
    from promptlang.errors import PromptLangError

    suffix = os.path.splitext(args.file)[1].lower()
    if suffix in templates.EXTENSIONS:
        return _run_template(args)
    if suffix == ".pml":
        return _run_pml(args)
    try:
        call = _parse_call(args.call) if args.call else None
        compiled = _compile(args.file)
    except UsageError as e:
        print(f"promptlang compile: {e}", file=sys.stderr)
        return 2
    print_diagnostics(compiled.diagnostics, sys.stderr)
    if errors(compiled.diagnostics):
        return 1
    if args.plan:
        return plan.print_plans([f.schema for f in compiled.functions], args.model)
    outputs = [(f"{f.schema_name}.pml", _pml(f.schema, args)) for f in compiled.functions]
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
        except BaseException as e:  # noqa: BLE001 - the user's code failed: say where, no trace
            print(located(e, args.file, f"the call {args.call} raised"), file=sys.stderr)
            return 1
        outputs.append((f"{function.schema_name}.prompt.pml", _pml(result.doc, args)))
    return _emit(outputs, args)


def _run_template(args: argparse.Namespace) -> int:
    from promptlang.compiler.pyfile import print_diagnostics
    from promptlang.errors import CompileError, PromptLangError

    try:
        call = _parse_call(args.call) if args.call else None
        template = templates.compile_template(args)
    except UsageError as e:
        print(f"promptlang compile: {e}", file=sys.stderr)
        return 2
    except CompileError as e:
        print_diagnostics(e.diagnostics, sys.stderr)
        return 1
    print_diagnostics(template.diagnostics, sys.stderr)
    start = template.plan.tail_start
    if start is not None:
        print(f"{start}: note: cached up to here; from here on the prompt is computed per "
              f"request ({template.plan.tail_reason})", file=sys.stderr)
    if args.plan:
        return plan.print_plans([template.schema], args.model)
    outputs = [(f"{template.schema_name}.pml", _pml(template.schema, args))]
    if call is not None:
        _, args_, kwargs = call
        if args_:
            print("promptlang compile: --call: give a template's variables by name",
                  file=sys.stderr)
            return 2
        try:
            result = templates.call_template(template, args.documents, kwargs)
        except UsageError as e:
            print(f"promptlang compile: {e}", file=sys.stderr)
            return 2
        except PromptLangError as e:
            print(e, file=sys.stderr)
            return 1
        outputs.append((f"{template.schema_name}.prompt.pml", _pml(result.doc, args)))
    return _emit(outputs, args)


def _run_pml(args: argparse.Namespace) -> int:
    from promptlang.pml import nodes
    from promptlang.pml.parser import parse_file

    if args.call:
        print("promptlang compile: --call takes a Python file or a template", file=sys.stderr)
        return 2
    document = parse_file(args.file)
    for warning in document.warnings:
        print(warning, file=sys.stderr)
    if args.plan:
        if not isinstance(document, nodes.Schema):
            print(f"promptlang compile: {args.file} holds a prompt; --plan takes a schema",
                  file=sys.stderr)
            return 2
        return plan.print_plans([document], args.model)
    name = document.name if isinstance(document, nodes.Schema) else document.schema
    return _emit([(f"{name}.pml", _pml(document, args))], args)


def _pml(node, args: argparse.Namespace) -> str:
    from promptlang.pml.writer import write, write_pretty

    return write(node) if args.compact else write_pretty(node).rstrip("\n")


def _emit(outputs: list[tuple[str, str]], args: argparse.Namespace) -> int:
    if args.output:
        return _write_outputs(args.output, outputs)
    for _, text in outputs:
        print(text)
    return 0


_FILE_NAME = re.compile(r"[\w.-]{1,200}\Z")


def _write_outputs(folder: str, outputs: list[tuple[str, str]]) -> int:
    """Write each (file name, text) into `folder`; a name that is not a plain file name in
    that folder (a schema name with a path separator, `..`, a NUL) writes nothing at all."""
    for name, _ in outputs:
        if not _FILE_NAME.match(name) or name.startswith("."):
            print(f"promptlang compile: schema file name {name!r} is not a plain file name "
                  "(letters, digits, '-', '_', '.'); give the @prompt a name= like that",
                  file=sys.stderr)
            return 2
    try:
        os.makedirs(folder, exist_ok=True)
        for name, text in outputs:
            path = os.path.join(folder, name)
            with open(path, "w", encoding="utf-8") as f:
                f.write(text + "\n")
            print(path, file=sys.stderr)
    except OSError as err:
        where = err.filename or folder
        print(f"promptlang compile: cannot write {where}: {err.strerror or err}", file=sys.stderr)
        return 2
    return 0


def _compile(path: str):
    """The file's @prompt functions compiled; UsageError when the file cannot be read."""
    from promptlang.compiler.pyfile import compile_file
    from promptlang.errors import InputFileError

    try:
        return compile_file(path)
    except InputFileError as e:
        raise UsageError(e.message) from None


def _parse_call(text: str):
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except SyntaxError as e:
        raise UsageError(f"--call {text!r} is not a Python call: {e.msg}") from None
    if not isinstance(tree, ast.Call):
        raise UsageError(f"--call {text!r} is not a call like f(x=1)")
    path = _dotted(tree.func)
    if path is None:
        raise UsageError(f"--call {text!r}: call a function by its name")
    try:
        args = [ast.literal_eval(a) for a in tree.args]
        kwargs = {}
        for keyword in tree.keywords:
            if keyword.arg is None:
                raise UsageError(f"--call {text!r}: write each keyword argument out")
            kwargs[keyword.arg] = ast.literal_eval(keyword.value)
    except (ValueError, TypeError, SyntaxError):
        raise UsageError(f"--call {text!r}: arguments must be Python literals "
                          "(strings, numbers, lists, dicts, True/False/None)") from None
    return path, args, kwargs


def _find(compiled: Any, path: str, file: str) -> Any:
    """The @prompt function named `path` in the compiled file, or None (said on stderr)."""
    from promptlang.compiler.decorator import PromptFunction

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


