"""PML's inputs from disk: a PML file's text, and a `src=` document's, read through
`promptlang.inputs` (a regular file, under the input cap, UTF-8 with located errors).

`parser.parse_file` reads a whole document with `read_pml`; the parser reads a
module's `src=` file with `read_src`, which refuses a path that leaves the schema's
folder before it opens anything. All the `src=` files of one schema together read at
most the input cap (`SrcBudget`): thirty references to one big file are refused, not
read thirty times.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, NoReturn

from promptlang.errors import InputFileError, PromptLangError, SourceFileError, Span, span_in
from promptlang.inputs import decode_utf8, max_input_bytes, read_bytes, read_text

__all__ = ["read_pml", "read_src", "SrcBudget"]


@dataclass
class SrcBudget:
    """The bytes one schema's `src=` files may still read, all together."""

    cap: int = field(default_factory=max_input_bytes)
    used: int = 0

    @property
    def left(self) -> int:
        return max(0, self.cap - self.used)


def read_pml(path: str | os.PathLike, *, error: type[PromptLangError] = InputFileError,
             span: Span | None = None, file: str | None = None) -> str:
    """The text of a PML or `src=` file through `promptlang.inputs.read_text` (a regular
    file, under the input cap, UTF-8 with located errors, a BOM dropped), its line
    endings normalised to '\\n'."""
    return _newlines(read_text(path, error=error, span=span, file=file))


def _newlines(text: str) -> str:
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    return text


def read_src(src: str, base_dir: str | None, fail: Callable[[str], NoReturn],
             span: Span, budget: SrcBudget | None = None) -> tuple[str, Span]:
    """The text of the `src=` file `src` and the span of its start. It must resolve
    inside `base_dir` (default: the current directory). `fail` is the parser's, located
    at the attribute's value, whose `span` also locates errors in reading the file.
    `budget` (one per schema) caps the bytes all its `src=` files read together; a file
    that would pass it fails before it is read."""
    base = base_dir if base_dir is not None else os.getcwd()
    if not src:
        fail("src may not be empty")
    if os.path.isabs(src) or src.startswith(("/", "\\")) or os.path.splitdrive(src)[0]:
        fail(f"src {src!r} must be a path relative to the schema's folder")
    try:
        real_base = os.path.realpath(base)
        target = os.path.realpath(os.path.join(real_base, src))
        inside = os.path.commonpath([real_base, target]) == real_base
    except ValueError as e:                 # a NUL byte, or another drive
        fail(f"src {src!r} is not a usable path: {e}")
    if not inside:
        fail(f"src {src!r} resolves outside the schema's folder {real_base} (to {target})")
    if not os.path.exists(target):
        fail(f"src file {src!r} does not exist (looked in {real_base})")
    shown = os.path.join(base_dir, src) if base_dir is not None else src
    if budget is None:
        budget = SrcBudget()
    try:
        size = os.stat(target).st_size
    except OSError:
        size = 0                            # read_bytes reports the problem, located
    if budget.left < size <= budget.cap:        # over the cap alone: read_bytes says so
        fail(f"src file {src!r} ({size} bytes) passes the cap of {budget.cap} bytes on all "
             f"the schema's src= files together ({budget.used} bytes read before it; set "
             "PROMPTLANG_MAX_INPUT_BYTES to change it)")
    data = read_bytes(target, max_bytes=budget.cap if size > budget.cap else budget.left,
                      error=SourceFileError, span=span)
    budget.used += len(data)
    text = _newlines(decode_utf8(data, shown, error=SourceFileError))
    return text, span_in(text, 0, shown)
