"""`promptlang check FILE...`: one check for both kinds of input, chosen by each file's kind.

    promptlang check app.py                       @prompt diagnostics (compile.py)
    promptlang check prompts/rag.j2               Jinja2 template diagnostics (compile.py)
    promptlang check travel.pml                   PML: parse, lay out, print the layout table
    promptlang check SCHEMA.pml PROMPT.pml        ... and bind the prompt (pml.py)

A `.py` file is imported (its top-level code runs) and its @prompt functions compiled;
every other file is read as PML, all PML files of the call together, so that a prompt
binds against a schema given beside it. `promptlang pml check` is the PML half alone.
The exit status is the worst of the files': 0 ok, 1 errors in an input, 2 usage errors.
"""

from __future__ import annotations

import argparse
from typing import Any

from promptlang.cli import compile, pml
from promptlang.cli.templates import EXTENSIONS as TEMPLATE_EXTENSIONS


def register(commands: Any) -> None:
    check = commands.add_parser(
        "check", help="check @prompt (.py: runs it), template (.j2) and PML files",
        description="Check each FILE by its kind. A .py FILE is imported to find its @prompt "
                    "functions: its top-level code runs, as with `python FILE`, so check "
                    "only files you trust to run; what cannot be cached prints as "
                    "file:line:col: severity: message [code]. A Jinja2 template (.j2, .jinja, "
                    ".jinja2) is parsed and checked the same way (its loops are read as "
                    "computed per request: compile --documents caches documents). Every "
                    "other FILE is PML: "
                    + pml.DESCRIPTION)
    check.add_argument("files", nargs="+", metavar="FILE",
                       help="Python files with @prompt functions, or PML schema and prompt "
                            "files")
    pml.add_options(check)
    check.set_defaults(func=check_files)


def check_files(args: argparse.Namespace) -> int:
    python = [path for path in args.files if path.endswith(".py")]
    templates = [path for path in args.files if path.lower().endswith(TEMPLATE_EXTENSIONS)]
    markup = [path for path in args.files if path not in python and path not in templates]
    status = 0
    for path in python:
        status = max(status, compile.check_file(path))
    for path in templates:
        status = max(status, compile.check_template(path))
    if markup:
        status = max(status, pml.check_files(argparse.Namespace(**{**vars(args),
                                                                    "files": markup})))
    return status
