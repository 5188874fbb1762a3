"""`promptlang compile TEMPLATE.j2`: the Jinja2 frontend's command-line options.

    --documents NAME=FILE.json   every document loop variable NAME may take: a JSON list
                                 of strings or objects (repeatable)
    --param NAME=N               a length bound in tokens for variable NAME (repeatable)
    --role user|system|assistant|none   the chat role around a template without role blocks
    --lenient                    what cannot be cached is computed per request, not an error

With --call, a documents variable may list document numbers (`docs=[0, 2]`): the
documents at those places in its --documents file.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from promptlang.errors import UsageError

MAX_DOCUMENTS_BYTES = 256 * 1024 * 1024
EXTENSIONS = (".j2", ".jinja", ".jinja2")


def add(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Jinja2 templates (.j2, .jinja, .jinja2)")
    group.add_argument("--documents", action="append", default=[], metavar="NAME=FILE.json",
                       help="the documents a loop over NAME may take, each cached as a module: "
                            "a JSON list of strings or objects (repeatable)")
    group.add_argument("--param", action="append", default=[], metavar="NAME=N",
                       help="a length bound in tokens for variable NAME (repeatable)")
    group.add_argument("--role", default="user", choices=("user", "system", "assistant", "none"),
                       help="the chat role around a template without role blocks "
                            "(default: user; none: plain text)")
    group.add_argument("--lenient", action="store_true",
                       help="constructs that cannot be cached are computed per request "
                            "instead of being errors")


def compile_template(args: argparse.Namespace):
    """The TemplatePrompt of args.file; UsageError for a malformed option or unreadable file."""
    from promptlang.compiler.jinja import from_template
    from promptlang.errors import SourceFileError

    documents = dict(_documents(spec) for spec in args.documents)
    params = dict(_param(spec) for spec in args.param)
    try:
        return from_template(args.file, documents=documents, params=params,
                             role=None if args.role == "none" else args.role,
                             lenient=args.lenient)
    except SourceFileError as e:
        raise UsageError(str(e)) from None


def call_template(template, documents_files: list[str], kwargs: dict[str, Any]):
    """The Prompt of a --call's keyword arguments; document numbers become documents."""
    corpora = dict(_documents(spec) for spec in documents_files)
    context = dict(kwargs)
    for name, corpus in corpora.items():
        given = context.get(name)
        if isinstance(given, list) and all(isinstance(i, int) for i in given):
            bad = [i for i in given if not 0 <= i < len(corpus)]
            if bad:
                raise UsageError(f"--call: {name} has {len(corpus)} documents; "
                                 f"no number {bad[0]}")
            context[name] = [corpus[i] for i in given]
    return template(context)


def _documents(spec: str) -> tuple[str, list]:
    from promptlang.inputs import decode_utf8, read_bytes

    name, _, path = spec.partition("=")
    if not name or not path:
        raise UsageError(f"--documents {spec!r}: write NAME=FILE.json")
    data = read_bytes(path, max_bytes=MAX_DOCUMENTS_BYTES, error=UsageError)
    try:
        value = json.loads(decode_utf8(data, path, error=UsageError))
    except json.JSONDecodeError as e:
        raise UsageError(f"{path}:{e.lineno}:{e.colno}: not JSON: {e.msg}") from None
    if not isinstance(value, list):
        raise UsageError(f"{path}: --documents takes a JSON list, not {type(value).__name__}")
    return name, value


def _param(spec: str) -> tuple[str, int]:
    name, _, bound = spec.partition("=")
    if not name or not bound.isdigit() or not 0 < int(bound) <= 1 << 24:
        raise UsageError(f"--param {spec!r}: write NAME=N, N a positive number of tokens")
    return name, int(bound)
