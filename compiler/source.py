"""Where a @prompt function's code comes from: its source text, positioned as in its file.

`inspect` gives the function's lines (decorators included). A method's lines are
indented, so they are parsed under an `if 1:` header placed on the line above,
after blank lines: every libcst position is then the position in the file itself,
and no line is re-indented (re-indenting would change multi-line strings).
"""

from __future__ import annotations

import inspect
import linecache
import os
from dataclasses import dataclass

from promptlang.errors import Span


@dataclass(frozen=True)
class FunctionSource:
    file: str                 # the code object's file name, as tracebacks show it
    start: int                # 1-based line of the first decorator (or of `def`)
    text: str                 # parses on its own; its line/column numbers are the file's
    indented: bool            # True when the function sits under the `if 1:` header
    lines: tuple[str, ...]    # the file's lines, for the text shown under a diagnostic

    def span(self, line: int, column: int) -> Span:
        """The Span of a libcst position (1-based line, 0-based column)."""
        text = self.lines[line - 1].rstrip("\r\n") if 0 < line <= len(self.lines) else ""
        return Span(self.file, line, column + 1, text)


def function_source(fn) -> FunctionSource:
    """The source of `fn`; raises OSError or TypeError when inspect cannot find it."""
    block, start = inspect.getsourcelines(fn)
    file = fn.__code__.co_filename
    lines = tuple(linecache.getlines(file)) or tuple(block)
    first = block[0]
    indent = first[:len(first) - len(first.lstrip(" \t"))]
    body = "".join(block)
    if not body.endswith("\n"):
        body += "\n"
    if indent:
        if start < 2:
            raise OSError(f"an indented function cannot start on line {start}")
        text = "\n" * (start - 2) + "if 1:\n" + body
    else:
        text = "\n" * (start - 1) + body
    return FunctionSource(file, start, text, bool(indent), lines)


def module_name_for_file(path: str) -> str:
    """The dotted module name a file is imported under: its stem, behind the names of the
    package folders (those with `__init__.py`) that contain it."""
    path = os.path.abspath(path)
    parts = [os.path.splitext(os.path.basename(path))[0]]
    folder = os.path.dirname(path)
    while os.path.isfile(os.path.join(folder, "__init__.py")):
        parts.insert(0, os.path.basename(folder))
        folder = os.path.dirname(folder)
    return ".".join(parts)
