"""Where a @prompt function's code comes from: its source text, positioned as in its file.

`inspect` finds the function's lines (decorators included); only they are read
(`source_lines`). A method's lines are
indented, so they are parsed under an `if 1:` header placed on the line above (no line
is re-indented: re-indenting would change multi-line strings). The text starts at the
function (its first line is line 1, or 2 under the header); `offset` turns a line of
the text into the line of the file. Padding the text with the file's earlier lines
instead would make each function cost as much as the lines above it: a file of n
functions quadratic.
"""

from __future__ import annotations

import ast
import inspect
import io
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
    text: str                 # parses on its own; its line + offset is the file's line
    indented: bool            # True when the function sits under the `if 1:` header
    lines: tuple[str, ...]    # the file's lines, for the text shown under a diagnostic
    offset: int = 0           # file line = text line + offset

    def span(self, line: int, column: int) -> Span:
        """The Span of a position in the text (1-based line, 0-based column)."""
        return self.file_span(line + self.offset, column)

    def file_span(self, line: int, column: int) -> Span:
        """The Span of a position in the file (1-based line, 0-based column)."""
        text = self.lines[line - 1].rstrip("\r\n") if 0 < line <= len(self.lines) else ""
        return Span(self.file, line, column + 1, text)

    def padded_text(self) -> str:
        """The text behind as many blank lines as put its lines at the file's (error paths
        only: it costs the lines above the function)."""
        return "\n" * self.offset + self.text


def function_source(fn) -> FunctionSource:
    """The source of `fn`; raises OSError or TypeError when inspect cannot find it."""
    block, start = source_lines(fn)
    file = fn.__code__.co_filename
    lines = _file_lines(file) or tuple(block)
    first = block[0]
    indent = first[:len(first) - len(first.lstrip(" \t"))]
    body = "".join(block)
    if not body.endswith("\n"):
        body += "\n"
    if indent:
        if start < 2:
            raise OSError(f"an indented function cannot start on line {start}")
        return FunctionSource(file, start, "if 1:\n" + body, True, lines, start - 2)
    return FunctionSource(file, start, body, False, lines, start - 1)


def source_lines(fn) -> tuple[list[str], int]:
    """`inspect.getsourcelines(fn)` for a function, reading only the function's lines:
    inspect copies the file's lines from the function to the end of the file for each
    function, which makes a file of n functions cost n times its length."""
    fn = inspect.unwrap(fn)
    lines, index = inspect.findsource(fn)
    return inspect.getblock(LinesFrom(lines, index)), index + 1


class LinesFrom:
    """The lines of `lines` from `start` on, not copied: what `inspect.getblock` reads of
    the lines it is given (an iteration, then a slice from the first line)."""

    def __init__(self, lines: list[str], start: int):
        self.lines = lines
        self.start = start

    def __iter__(self):
        return map(self.lines.__getitem__, range(self.start, len(self.lines)))

    def __getitem__(self, part: slice) -> list[str]:
        if not isinstance(part, slice) or part.start not in (None, 0) \
                or part.step not in (None, 1) or part.stop is None or part.stop < 0:
            raise TypeError(f"LinesFrom takes a slice from the first line, not {part!r}")
        return self.lines[self.start:self.start + part.stop]


_shared_lines: dict[str, tuple[list, tuple[str, ...]]] = {}


def _file_lines(file: str) -> tuple[str, ...]:
    """The file's lines as linecache holds them, one tuple shared by all of the file's
    functions while linecache keeps the same lines (a copy each would make a file of n
    functions hold n copies of itself)."""
    current = linecache.getlines(file)
    kept = _shared_lines.get(file)
    if kept is not None and kept[0] is current:
        return kept[1]
    lines = tuple(current)
    _shared_lines[file] = (current, lines)
    return lines


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
        if not os.path.abspath(file).startswith(_PACKAGE + os.sep):
            position = _frame_position(frame)
            line = position[0] if position is not None and position[0] else frame.f_lineno or 1
            text = linecache.getline(file, line).rstrip("\r\n")
            if text:
                return Span(file, line, _frame_column(position, text), text)
        frame = frame.f_back
    return None


def _frame_position(frame) -> tuple | None:
    """(line, end line, column, end column) of the instruction the frame is running, from
    the positions kept for its code (`frame.f_lineno` walks the code's line table from its
    start each time: a module decorating n functions would be quadratic); None when unknown."""
    index = frame.f_lasti // 2       # one position per 2-byte code unit
    positions = _positions(frame.f_code)
    return positions[index] if 0 <= index < len(positions) else None


def _frame_column(position: tuple | None, text: str) -> int:
    """The 1-based column of `position` (a frame's) in its line `text` (the first
    non-blank when unknown)."""
    if position is not None and position[2] is not None:
        return len(text.encode("utf-8")[:position[2]].decode("utf-8", "replace")) + 1
    return len(text) - len(text.lstrip()) + 1


_last_positions: list = [None, ()]   # the code object last asked about, and its positions


def _positions(code) -> tuple:
    """`code.co_positions()` as a tuple, kept for the code object last asked about: a
    module decorating n functions asks n times about its one code object (walking its
    positions each time would make the file quadratic)."""
    if _last_positions[0] is not code:
        _last_positions[0] = code
        _last_positions[1] = tuple(code.co_positions())
    return _last_positions[1]


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
