"""The `promptlang` command: one argparse tree, one module per command group.

    promptlang check FILE...        @prompt files (.py) and PML files, by kind   (check.py)
    promptlang compile FILE         @prompt functions -> PML                      (compile.py)
    promptlang pml check FILE...    PML only (the alias `check` dispatches to)    (pml.py)
    promptlang run SCHEMA PROMPT    answer a prompt from cached modules          (run.py)
    promptlang serve                the OpenAI HTTP API over one engine          (serve.py)
    promptlang tune [SOURCE...]     learn the model's seam adapter                (tune.py)
    promptlang cache ls|clear       the KV store's disk tier                      (cache.py)
    promptlang bench ...            latency, memory, accuracy benchmarks          (bench.py)

Each group module has `register(commands)`, which adds its subparsers with
`set_defaults(func=handler)`; `handler(args) -> int` is the exit status. The groups import
the compiler, the runtime and the benchmarks inside their handlers: building the parser
stays light (no torch), and this package is where those layers meet.

Exit status: 0 success, 1 errors in the input (each printed as `file:line:col: message`,
never a traceback), 2 usage errors.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Sequence

from promptlang.cli import bench, cache, check, compile, pml, run, serve, tune
from promptlang.cli.pml import format_binding, format_layout     # noqa: F401 - public helpers
from promptlang.errors import PromptLangError

# in the order `--help` lists them
GROUPS = (check, compile, pml, run, serve, tune, cache, bench)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit:                 # --help, --version, usage errors
        return exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 2)
    func: Callable[[argparse.Namespace], int] | None = getattr(args, "func", None)
    if func is None:
        (getattr(args, "group_parser", None) or parser).print_help(sys.stderr)
        return 2
    try:
        return int(func(args) or 0)
    except PromptLangError as err:
        print(err, file=sys.stderr)
        return 1
    except BrokenPipeError:            # `promptlang ... | head`: stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="promptlang",
        description="Prompt programs served from modular attention (KV) caches.")
    parser.add_argument("--version", action="version", version=f"promptlang {_version()}")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")
    for group in GROUPS:
        group.register(commands)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("promptlang")
    except PackageNotFoundError:
        return "unknown (not installed)"
