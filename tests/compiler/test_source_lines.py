"""Where a @prompt function's source comes from: `source_lines` reads only the function's
lines (inspect copies the rest of the file for each function), and the place a decorator was
applied is found from positions kept per code object (a frame's `f_lineno` walks the code's
whole line table). Both kept a file of n functions from costing n times its length."""

from __future__ import annotations

import inspect
import linecache
import textwrap

from promptlang.compiler.source import LinesFrom, caller_span, source_lines

from .support import load

SOURCE = '''\
import functools


def plain(x):
    return x


def decorated(f):
    @functools.wraps(f)
    def inner(*a):
        return f(*a)
    return inner


@decorated
def wrapped(a,
            b):
    """A docstring
with an unindented line."""
    return (a +
            b)


class Holder:
    def method(self):
        text = """
  not code
"""
        return text

    @staticmethod
    def static():
        pass


def outer():
    def nested():
        return 1
    return nested


def last(): return 2'''


def test_source_lines_is_what_inspect_gives_for_every_kind_of_function():
    module = load(SOURCE)
    for fn in (module.plain, module.wrapped, module.Holder.method, module.Holder.static,
               module.outer, module.outer(), module.last):
        assert source_lines(fn) == inspect.getsourcelines(fn), fn.__qualname__


class CountingList(list):
    def __init__(self, items):
        super().__init__(items)
        self.reads = 0

    def __getitem__(self, index):
        self.reads += 1 if isinstance(index, int) else 0
        return super().__getitem__(index)


def test_the_block_is_read_without_the_rest_of_the_file():
    function = ["def f():\n", "    return 1\n", "\n"]
    rest = [f"def g{i}():\n    pass\n" for i in range(5000)]
    lines = CountingList(["x = 1\n"] * 100 + function + rest)
    block = inspect.getblock(LinesFrom(lines, 100))
    assert block == function[:2]
    assert lines.reads <= 5                  # the function and the line that ends it


def test_lines_from_takes_only_a_slice_from_its_first_line():
    view = LinesFrom(["a\n", "b\n", "c\n"], 1)
    assert list(view) == ["b\n", "c\n"] and view[:1] == ["b\n"] and view[:9] == ["b\n", "c\n"]
    for bad in (0, slice(1, 2), slice(None, 2, 2), slice(None, None)):
        try:
            view[bad]
        except TypeError:
            continue
        raise AssertionError(f"{bad!r} was taken")


def test_the_callers_line_and_column_come_from_the_running_instruction():
    code = textwrap.dedent("""\
        x = [
            0, where(
                1)]
        y = 2 + where()
    """)
    spans = []
    namespace = {"where": lambda *args: spans.append(caller_span(2)) or 0}
    linecache.cache["placed.py"] = (len(code), None, code.splitlines(True), "placed.py")
    exec(compile(code, "placed.py", "exec"), namespace)
    assert [(s.file, s.line, s.col, s.line_text) for s in spans] == [
        ("placed.py", 2, 8, "    0, where("), ("placed.py", 4, 9, "y = 2 + where()")]
