"""How a located error prints (`file:line:col: message`, the line, a caret under the column),
and the hierarchy every error class belongs to."""

import pickle

import pytest

from promptlang import errors
from promptlang.errors import EXCERPT_WIDTH, PromptLangError, Span


def shown(line: str, col: int) -> tuple[str, str]:
    text = str(PromptLangError("bad", Span("f.pml", 1, col, line)))
    _, source, caret = text.split("\n")
    return source[4:], caret[4:]


def test_short_line_is_shown_whole_with_the_caret_under_the_column():
    source, caret = shown("ab <c", 4)
    assert source == "ab <c" and caret == "   ^"


def test_long_line_is_cut_to_a_window_and_the_caret_still_points_at_the_column():
    line = "x" * 100_000 + "<" + "y" * 100_000
    source, caret = shown(line, 100_001)
    assert len(source) <= EXCERPT_WIDTH + 6
    assert source[len(caret) - 1] == "<"
    assert source.startswith("...") and source.endswith("...")


def test_long_line_keeps_its_start_or_end_when_the_column_is_near_it():
    line = "<" + "a" * 5_000
    source, caret = shown(line, 1)
    assert source.startswith("<") and source.endswith("...") and caret == "^"
    line = "a" * 5_000 + "<"
    source, caret = shown(line, 5_001)
    assert source.startswith("...") and source.endswith("<") and source[len(caret) - 1] == "<"


# ---------------------------------------------------------------------------------------------
# The hierarchy: every class is a PromptLangError; those raised where a builtin was raised
# before are that builtin too, so `except ValueError` (TypeError, RuntimeError) still works.

ERROR_CLASSES = [c for c in vars(errors).values()
                 if isinstance(c, type) and issubclass(c, BaseException)]

ALSO_BUILTIN = {
    "InvalidArgumentError": ValueError, "ConfigError": ValueError,
    "UnsupportedModelError": ValueError, "InvalidArgumentTypeError": TypeError,
    "ChatTemplateError": TypeError, "InternalError": RuntimeError,
    "ServerStartError": RuntimeError, "AdapterFileError": ValueError, "TuneError": ValueError,
}


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda c: c.__name__)
def test_every_error_class_is_a_promptlang_error_with_a_docstring(cls):
    assert issubclass(cls, PromptLangError)
    assert cls.__doc__ and cls.__doc__.strip()


@pytest.mark.parametrize("name, builtin", sorted(ALSO_BUILTIN.items(), key=lambda kv: kv[0]))
def test_classes_raised_for_builtins_are_those_builtins(name, builtin):
    cls = getattr(errors, name)
    assert issubclass(cls, PromptLangError) and issubclass(cls, builtin)
    with pytest.raises(builtin, match="bad value"):
        raise cls("bad value")


def test_no_other_class_takes_a_builtin_base():
    for cls in ERROR_CLASSES:
        for builtin in (ValueError, TypeError, RuntimeError):
            if issubclass(cls, builtin):
                assert ALSO_BUILTIN.get(cls.__name__) is builtin, cls.__name__


# the classes with a constructor of their own: tested below
OWN_CONSTRUCTOR = {errors.CompileError, errors.HTTPError}


@pytest.mark.parametrize("cls", [c for c in ERROR_CLASSES if c not in OWN_CONSTRUCTOR],
                         ids=lambda c: c.__name__)
def test_every_error_pickles_and_prints_with_its_location(cls):
    error = cls("went wrong", Span("f.pml", 2, 3, "abcdef"))
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is cls and str(back) == str(error)
    assert str(back).startswith("f.pml:2:3: went wrong")
    assert str(cls("no place")) == "no place"


def test_a_compile_error_pickles_with_its_diagnostics_sorted_by_place():
    from promptlang.compiler.diagnostics import CODES, Diagnostic

    code = next(c for c, entry in CODES.items() if entry.severity == "error")
    late = Diagnostic(code, "second", Span("app.py", 9, 1, "x = 1"))
    early = Diagnostic(code, "first", Span("app.py", 2, 5, "def f(): ..."))
    error = errors.CompileError([late, early])
    assert [d.message for d in error.diagnostics] == ["first", "second"]
    assert error.span == early.span and error.message == f"first [{code}] (and 1 more error)"
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is errors.CompileError and back.diagnostics == error.diagnostics
    assert str(back) == str(error) and str(back).startswith(f"app.py:2:5: error: first [{code}]")


def test_an_http_error_pickles_with_its_status_kind_and_parameter():
    error = errors.HTTPError(413, "too big", "invalid_request_error", param="prompt", close=True)
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is errors.HTTPError and str(back) == "too big"
    assert (back.status, back.kind, back.param, back.close) == (413, "invalid_request_error",
                                                                "prompt", True)
