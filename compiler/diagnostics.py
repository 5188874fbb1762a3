"""Diagnostics: what the compiler tells a user about a `@prompt` function.

A `Diagnostic` has a stable code from `CODES`, a severity, a message, a `Span`
and a suggestion, and prints mypy-style so editors and CI can read it:

    app.py:14:9: error: dynamic text without a length bound before cached text (line 16) [PL203]
        question
        ^
    app.py:14:9: note: add a length bound: Annotated[str, MaxTokens(n)] or @prompt(params=...)

Every diagnostic of a function (and, in `promptlang check`, of a file) is
collected before anything stops; errors are then raised together as one
`CompileError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Literal

from promptlang.errors import InvalidArgumentError, Span

Severity = Literal["error", "warning"]


@dataclass(frozen=True)
class Code:
    """One entry of the registry: the code, what it means, and how to fix it in general."""

    code: str
    severity: Severity
    title: str
    suggestion: str


CODES: dict[str, Code] = {c.code: c for c in (
    # -- the file or the function as a whole
    Code("PL001", "error", "Python syntax error", "fix the syntax; the file does not compile"),
    Code("PL002", "error", "the source of a @prompt function cannot be read",
         "define the function in a .py file (the compiler reads its source with inspect)"),
    Code("PL003", "error", "importing the file raised an exception",
         "the file must import cleanly for its @prompt functions to be compiled"),
    Code("PL004", "error", "nested too deeply for the compiler",
         "split the expression or the nested blocks: assign parts to variables, or move "
         "inner branches into @prompt functions of their own"),
    Code("PL005", "error", "the file is not text the compiler reads",
         "save the file as UTF-8 (a UTF-8 BOM is fine)"),
    Code("PL006", "error", "the file is over the size cap for Python sources",
         "split the @prompt functions over several files, or raise "
         "PROMPTLANG_MAX_PYTHON_BYTES"),
    # -- constructs the compiler does not accept anywhere
    Code("PL101", "error", "unsupported kind of function",
         "make it a plain `def` (not async, not a generator)"),
    Code("PL102", "error", "`return` with a value",
         "a @prompt function's result is its prompt: emit text instead of returning it"),
    Code("PL103", "error", "a length bound names nothing the function uses",
         "name a parameter, a local variable, or the exact expression of a text hole"),
    Code("PL104", "error", "invalid length bound",
         "a bound is a positive number of tokens: params={'x': 16} or MaxTokens(16)"),
    Code("PL105", "error", "two different length bounds for one name",
         "declare the bound once, in the annotation or in params="),
    Code("PL106", "error", "misused role block",
         "write `with system():`, `with user():` or `with assistant():` alone, not nested, "
         "using promptlang's helpers"),
    Code("PL107", "error", "a @prompt function called inside an expression",
         "call it as a statement of its own to include its text"),
    Code("PL108", "error", "recursive @prompt call",
         "a schema is finite: unroll the recursion or make the inner part a loop in the "
         "uncached tail"),
    Code("PL109", "error", "a statement that cannot be text",
         "emit str values: decode bytes first"),
    Code("PL110", "error", "gen() or select() called inside an expression",
         "call it as a statement (`gen(\"x\")`) or assign its result (`x = gen(\"x\")`), "
         "so that the compiler sees where generation starts"),
    Code("PL111", "error", "@prompt applied twice",
         "decorate the function once; pass name= and params= to that one @prompt"),
    Code("PL112", "error", "@prompt calls nest too deep",
         "a schema nests its modules at most MAX_CALL_DEPTH (48) calls deep: flatten the "
         "chain, calling several functions from one instead of each from the last"),
    # -- text that cannot be cached because of where it is
    Code("PL201", "error", "text emitted in a `for` loop before cached text",
         "move the loop after the last cached text, or give each item its own @prompt call "
         "or branch"),
    Code("PL202", "error", "text emitted in a `while` loop before cached text",
         "move the loop after the last cached text"),
    Code("PL203", "error", "dynamic text without a length bound before cached text",
         "add a length bound: Annotated[str, MaxTokens(n)] or @prompt(params={...: n}), or "
         "move it after the last cached text"),
    Code("PL204", "error", "a call to a function that is not a @prompt function emits text "
                           "before cached text",
         "decorate the callee with @prompt, assign its result (`_ = f(...)`) if it is called "
         "for its side effects, or move it after the last cached text"),
    Code("PL205", "error", "text emitted inside `try` before cached text",
         "compute values in the `try` and emit text after it"),
    Code("PL206", "error", "text emitted inside a `with` block that is not a role block "
                           "before cached text",
         "compute values inside the `with` and emit text after it"),
    Code("PL207", "error", "`return` before cached text",
         "use if/else instead of an early return: text after the return would be in the "
         "schema but not in this call's prompt"),
    Code("PL208", "error", "a @prompt call that ends in uncached text before cached text",
         "call it after the last cached text, or bound the callee's dynamic text"),
    # -- Jinja2 templates (compiler/jinja/)
    Code("PL401", "error", "template syntax error",
         "fix the template: Jinja2 cannot parse it"),
    Code("PL402", "error", "a template construct the compiler cannot cache",
         "use names, constants, attribute lookups and Jinja2's own filters and tests in "
         "cached text, or compile with --lenient to compute it per request"),
    Code("PL403", "error", "cached template text after the uncached part",
         "bound the variable that starts the uncached part (`{{ q | maxlen(64) }}`, or "
         "params=), or move it after the last cached construct"),
    Code("PL404", "error", "an included or imported template cannot be read",
         "name a template the environment's loader finds (a string constant), and include "
         "no template from itself"),
    Code("PL405", "error", "invalid length bound in a template",
         "a bound is a positive whole number of tokens: `{{ q | maxlen(64) }}`"),
    Code("PL406", "error", "text outside the role blocks of a template",
         "put every text inside `{% block system %}`, `{% block user %}` or "
         "`{% block assistant %}` once a template has role blocks"),
    # -- warnings
    Code("PL301", "warning", "a length bound that no text hole uses",
         "remove the bound, or use the name as a text hole"),
    Code("PL302", "warning", "two @prompt functions with the same schema name",
         "rename one of them, or give it its own @prompt(name=...); the later definition "
         "replaces the earlier one, and compile -o writes one .pml file for both"),
)}


@dataclass(frozen=True)
class Diagnostic:
    """One finding, located in the user's source."""

    code: str
    message: str
    span: Span | None = None
    suggestion: str | None = None       # None: the registry's general suggestion

    def __post_init__(self):
        if self.code not in CODES:
            raise InvalidArgumentError(f"unregistered diagnostic code {self.code}")

    @property
    def severity(self) -> Severity:
        return CODES[self.code].severity

    @property
    def hint(self) -> str:
        return self.suggestion if self.suggestion is not None else CODES[self.code].suggestion

    def format(self) -> str:
        """`file:line:col: severity: message [code]`, the source line with a caret, a note."""
        where = f"{self.span}: " if self.span is not None else ""
        lines = [f"{where}{self.severity}: {self.message} [{self.code}]"]
        if self.span is not None and self.span.line_text:
            lines.append("    " + self.span.line_text.expandtabs(1))
            lines.append("    " + " " * (self.span.col - 1) + "^")
        lines.append(f"{where}note: {self.hint}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


def errors(diagnostics: Iterable[Diagnostic]) -> list[Diagnostic]:
    return [d for d in diagnostics if d.severity == "error"]
