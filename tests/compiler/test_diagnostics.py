"""Each construct the compiler cannot cache (or accept) is reported with its stable code at
the line and column of the construct; all diagnostics of a function are collected."""

from __future__ import annotations

import pickle

import pytest

from promptlang.compiler import CompileError, prompt
from promptlang.compiler.decorator import collecting
from promptlang.compiler.diagnostics import CODES, Diagnostic
from promptlang.errors import PromptLangError, Span

from .support import load


def diagnose(source: str) -> list[tuple[str, int, int]]:
    """(code, line, column) of every diagnostic of every @prompt function in `source`."""
    with collecting() as found:
        load(source)
    diagnostics = []
    for function in found:
        diagnostics += function.analysis.diagnostics
        if function.analysis.ir is None:
            continue
        try:
            function.plan()
        except CompileError as e:
            diagnostics += e.diagnostics
        else:
            diagnostics += function.diagnostics
    return sorted({(d.code, d.span.line, d.span.col) for d in diagnostics})


HEADER = """\
from typing import Annotated
from promptlang import prompt, MaxTokens, system, user

def helper(x):
    return x

"""


@pytest.mark.parametrize("body, expected", [
    # -- what cannot be cached: reported where the uncached text starts
    ("""
    @prompt
    def f(items):
        for i in items:
            i
        "cached"
    """, [("PL201", 10, 5)]),
    ("""
    @prompt
    def f(n):
        while n:
            "again"
            n -= 1
        "cached"
    """, [("PL202", 10, 5)]),
    ("""
    @prompt
    def f(question):
        question
        "cached"
    """, [("PL203", 10, 5)]),
    ("""
    @prompt
    def f(city, name: Annotated[str, MaxTokens(3)]):
        f"Hi {name}, welcome to {city.title()}."
        "cached"
    """, [("PL203", 10, 30)]),
    ("""
    @prompt
    def f(x):
        helper(x)
        "cached"
    """, [("PL204", 10, 5)]),
    ("""
    @prompt
    def f(x):
        try:
            "risky"
        except ValueError:
            pass
        "cached"
    """, [("PL205", 10, 5)]),
    ("""
    @prompt
    def f(path):
        with open(path) as handle:
            "reading"
        "cached"
    """, [("PL206", 10, 5)]),
    ("""
    @prompt
    def f(short):
        "Intro."
        if short:
            "Short."
            return
        "Long part."
    """, [("PL207", 13, 9)]),
    ("""
    @prompt
    def g(q):
        "Question: "
        q

    @prompt
    def f(q):
        g(q)
        "cached"
    """, [("PL208", 15, 5)]),
    # -- constructs refused anywhere
    ("""
    @prompt
    async def f():
        "x"
    """, [("PL101", 9, 11)]),
    ("""
    @prompt
    def f(xs):
        "x"
        yield xs
    """, [("PL101", 11, 5)]),
    ("""
    @prompt
    def f():
        "x"
        return "y"
    """, [("PL102", 11, 5)]),
    ("""
    @prompt(params={"nope": 3})
    def f(x):
        x
    """, [("PL103", 8, 9)]),
    ("""
    @prompt(params={"x": 0})
    def f(x):
        x
    """, [("PL104", 8, 9)]),
    ("""
    @prompt(params={"x": 10**9})
    def f(x):
        x
    """, [("PL104", 8, 9)]),
    ("""
    @prompt(params={"x": 4})
    def f(x: Annotated[str, MaxTokens(2)]):
        x
    """, [("PL105", 8, 9)]),
    ("""
    @prompt
    def f():
        with system():
            with user():
                "nested"
    """, [("PL106", 11, 9)]),
    ("""
    @prompt
    def f():
        with user() as turn:
            "bound"
    """, [("PL106", 10, 5)]),
    ("""
    def user():
        return open("log")

    @prompt
    def f():
        with user():
            "not promptlang's user"
    """, [("PL106", 13, 5)]),
    ("""
    @prompt
    def g():
        "g"

    @prompt
    def f():
        x = [g()]
    """, [("PL107", 14, 10)]),
    ("""
    @prompt
    def f(n):
        "x"
        if n:
            f(n - 1)
    """, [("PL108", 12, 9)]),
    ("""
    @prompt
    def f():
        "x"
        b"bytes"
    """, [("PL109", 11, 5)]),
    ("""
    @prompt(params={"x": 3})
    def f(x, y):
        "uses neither"
        y
    """, [("PL301", 8, 9)]),
])
def test_each_construct_gives_its_code_at_its_line_and_column(body, expected):
    assert diagnose(HEADER + body.replace("\n    ", "\n")) == expected


def test_all_diagnostics_of_a_function_are_collected_before_stopping():
    module = load(HEADER + """
@prompt
def f(items, question):
    for i in items:
        i
    "cached one"
    question
    "cached two"
""")
    with pytest.raises(CompileError) as caught:
        module.f([], "?")
    codes = [(d.code, d.span.line) for d in caught.value.diagnostics]
    assert codes == [("PL201", 10), ("PL203", 13)]
    assert "and 1 more error" in caught.value.message


def test_analysis_errors_raise_at_decoration_time():
    with pytest.raises(CompileError) as caught:
        load(HEADER + """
@prompt
def f():
    "x"
    return 1
""")
    (diagnostic,) = caught.value.diagnostics
    assert diagnostic.code == "PL102"
    assert isinstance(caught.value, PromptLangError)


def test_a_function_without_source_is_reported_not_crashed():
    namespace: dict = {}
    exec("def f():\n    'x'\n", namespace)
    with pytest.raises(CompileError) as caught:
        prompt(namespace["f"])
    assert [d.code for d in caught.value.diagnostics] == ["PL002"]


def test_diagnostics_print_mypy_style_with_the_line_a_caret_and_a_note():
    span = Span("app.py", 14, 9, "        question")
    text = Diagnostic("PL203", "`question` has no length bound", span).format()
    assert text.splitlines() == [
        "app.py:14:9: error: `question` has no length bound [PL203]",
        "            question",
        "            ^",
        "app.py:14:9: note: " + CODES["PL203"].suggestion,
    ]


def test_compile_errors_pickle_with_their_diagnostics():
    error = CompileError([Diagnostic("PL201", "loop", Span("a.py", 1, 2, "x"))])
    copy = pickle.loads(pickle.dumps(error))
    assert copy.diagnostics == error.diagnostics
    assert str(copy) == str(error)


def test_every_code_has_a_title_a_severity_and_a_suggestion():
    for code, entry in CODES.items():
        assert code == entry.code and code.startswith("PL") and len(code) == 5
        assert entry.severity in ("error", "warning")
        assert entry.title and entry.suggestion


def test_the_hostile_input_codes_are_registered_with_their_severity():
    assert {c: CODES[c].severity for c in ("PL004", "PL005", "PL111", "PL302")} == {
        "PL004": "error", "PL005": "error", "PL111": "error", "PL302": "warning"}


def test_a_lambda_error_is_located_at_the_lambda():
    with collecting() as found:
        load("""\
            from promptlang import prompt
            f = prompt(lambda: "x")
            """)
    (diagnostic,) = found[0].analysis.diagnostics
    assert (diagnostic.code, diagnostic.span.line, diagnostic.span.col) == ("PL101", 2, 12)


def _chain(n: int) -> str:
    """n @prompt functions, each calling the next."""
    lines = ["from promptlang import prompt", ""]
    for i in range(n):
        lines += ["@prompt", f"def f{i}():", f'    "text {i}. "']
        lines += [f"    f{i + 1}()"] if i + 1 < n else []
        lines += [""]
    return "\n".join(lines)


def test_calls_nested_deeper_than_a_schema_holds_are_located_errors():
    from promptlang.compiler.lower import MAX_CALL_DEPTH

    module = load(_chain(MAX_CALL_DEPTH + 2))
    deepest_ok = getattr(module, "f2")                    # 48 functions below and itself
    assert deepest_ok.schema.name.endswith(".f2")
    with pytest.raises(CompileError) as e:
        module.f0.plan()
    [diagnostic] = [d for d in e.value.diagnostics if d.code == "PL112"]
    assert (diagnostic.span.line, diagnostic.span.col) == (6, 5)       # f0's call of f1
    assert "nest 50 deep from f0 through f1" in diagnostic.message
    with pytest.raises(CompileError):
        module.f1.plan()


def test_a_long_call_chain_is_refused_without_exhausting_the_stack():
    """3,000 nested calls once ran into Python's recursion limit (PL004) after minutes."""
    module = load(_chain(3000))
    with pytest.raises(CompileError) as e:
        module.f0.plan()
    assert {d.code for d in e.value.diagnostics} == {"PL112"}
    assert module.f2999.plan() is not None and module.f2960.schema is not None


def test_a_functions_source_text_starts_at_the_function():
    """Its libcst parse costs its own lines, not the lines above it (which made a file of n
    functions quadratic); positions still name the file's lines."""
    module = load("\n" * 5000 + "from promptlang import prompt\n\n@prompt\ndef late(q):\n"
                  "    q\n    \"cached text\"\n")
    source = module.late.analysis.source
    assert source.offset == 5002 and source.text.startswith("@prompt")
    with pytest.raises(CompileError) as e:
        module.late.schema
    diagnostic = e.value.diagnostics[0]
    assert (diagnostic.code, diagnostic.span.line, diagnostic.span.col) == ("PL203", 5005, 5)
    assert diagnostic.span.line_text == "    q"
