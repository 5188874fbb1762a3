"""Where a @prompt function's code comes from: its source text, positioned as in its file.

`inspect` gives the function's lines (decorators included). A method's lines are
indented, so they are parsed under an `if 1:` header placed on the line above,
after blank lines: every libcst position is then the position in the file itself,
and no line is re-indented (re-indenting would change multi-line strings).
"""

from __future__ import annotations

import ast
import inspect
import io
import itertools
import linecache
import os
import sys
import tokenize
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


_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def caller_span(skip: int = 1) -> Span | None:
    """Where the user's code called into the compiler: the innermost frame outside this
    package whose source lines can be read (code run by `exec` is located at the `exec`)."""
    frame = sys._getframe(skip)
    while frame is not None:
        file = frame.f_code.co_filename
        line = frame.f_lineno or 1
        if not os.path.abspath(file).startswith(_PACKAGE + os.sep):
            text = linecache.getline(file, line).rstrip("\r\n")
            if text:
                return Span(file, line, _frame_column(frame, text), text)
        frame = frame.f_back
    return None


def _frame_column(frame, text: str) -> int:
    """The 1-based column of the expression the frame is running (1 when unknown)."""
    index = frame.f_lasti // 2       # one position per 2-byte code unit
    position = next(itertools.islice(frame.f_code.co_positions(), index, None), None)
    if position is not None and position[2] is not None:
        return len(text.encode("utf-8")[:position[2]].decode("utf-8", "replace")) + 1
    return len(text) - len(text.lstrip()) + 1


def deepest_span(text: str, file: str, first_line: int = 1) -> Span:
    """The place in `text` (Python source) where the syntax tree nests deepest: where a
    'too deeply nested' diagnostic points. Walks the tree without recursion."""
    lines = text.split("\n")
    try:
        tree = ast.parse(text)
    except (SyntaxError, RecursionError, MemoryError, ValueError):
        return _longest_statement(text, lines, file, first_line)
    best = None
    best_depth = -1
    stack = [(tree, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > best_depth and hasattr(node, "lineno"):
            best = node
            best_depth = depth
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))
    if best is None:
        return _line_span(lines, file, first_line, 0)
    return _line_span(lines, file, best.lineno, best.col_offset)


def _longest_statement(text: str, lines, file: str, first_line: int) -> Span:
    """Where the longest logical line starts: the likely culprit when even
    `ast.parse` gives up (it nests as deeply as it is long)."""
    best = (first_line, 0)
    best_count = 0
    start = None
    count = 0
    try:
        for token in tokenize.generate_tokens(io.StringIO(text).readline):
            if token.type in (tokenize.NEWLINE, tokenize.ENDMARKER):
                if start is not None and count > best_count:
                    best = start
                    best_count = count
                start = None
                count = 0
            elif token.type not in (tokenize.NL, tokenize.COMMENT, tokenize.INDENT,
                                    tokenize.DEDENT):
                start = start or token.start
                count += len(token.string)
    except (tokenize.TokenError, SyntaxError):
        pass
    line, column = best
    text_of_line = lines[line - 1].rstrip("\r") if 0 < line <= len(lines) else ""
    return Span(file, line, column + 1, text_of_line)


def _line_span(lines, file: str, line: int, byte_column: int) -> Span:
    text = lines[line - 1].rstrip("\r") if 0 < line <= len(lines) else ""
    column = len(text.encode("utf-8")[:byte_column].decode("utf-8", "replace"))
    return Span(file, line, column + 1, text)
