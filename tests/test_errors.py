"""How a located error prints: `file:line:col: message`, the line, a caret under the column."""

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
