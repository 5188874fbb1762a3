"""Bounds: numeric attributes are checked before anything is built from them, a layout's
size before it is allocated, and parsing stays linear (spans share line text, the
duplicate-attribute check is a set); the parse_scaling bench prints one row per case."""

import re
import tracemalloc

import pytest

from promptlang.errors import ContextLengthError, PMLSyntaxError, SchemaError
from promptlang.pml import nodes as n
from promptlang.pml.layout import lay_out
from promptlang.pml.parser import (MAX_NUMBER_DIGITS, MAX_RECOMPUTE_CHARS, parse_prompt,
                                   parse_schema)
from promptlang.tokenizer import WordTokenizer


def param_schema(length: str) -> str:
    return f'<schema name="s">\n<module name="m">Hi <param name="p" len="{length}"/></module></schema>'


def peak_bytes(work):
    """(what work() raised or returned, the peak traced allocation while it ran)."""
    tracemalloc.start()
    try:
        try:
            result = work()
        except Exception as error:      # noqa: BLE001 - returned for the caller to check
            result = error
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return result, peak


# --- numeric attributes -----------------------------------------------------------------

@pytest.mark.parametrize("length", ["999999999", "99999999999", "9" * 4300, "16777217"])
def test_oversized_len_is_a_located_schema_error_before_any_allocation(length):
    error, peak = peak_bytes(lambda: parse_schema(param_schema(length), file="big.pml"))
    assert isinstance(error, SchemaError)
    assert "too large: at most 16777216 tokens" in error.message
    assert (error.span.file, error.span.line, error.span.col) == ("big.pml", 2, 42)
    assert peak < 2_000_000


@pytest.mark.parametrize("length", ["+5", "5.0", "0x10", "\u0663", " 5", "", "0", "000"])
def test_len_must_be_ascii_digits_and_positive(length):
    with pytest.raises(SchemaError, match="positive whole number of tokens") as info:
        parse_schema(param_schema(length))
    assert (info.value.span.line, info.value.span.col) == (2, 42)


def test_len_with_leading_zeros_counts_its_digits_after_them():
    schema = parse_schema(param_schema("0" * 5000 + "7"))
    assert schema.children[0].children[1] == n.Param("p", 7)
    assert MAX_NUMBER_DIGITS == 9


def test_parameter_spelling_length_is_bounded_too():
    with pytest.raises(SchemaError, match="length=99999999999 is too large"):
        parse_schema('<schema name="s"><module name="m">'
                     '<parameter name="p" length="99999999999"/></module></schema>')


@pytest.mark.parametrize("policy", ["first:" + "9" * 4300, "deviation:" + "1" * 80,
                                    "x" * (MAX_RECOMPUTE_CHARS + 1)])
def test_recompute_text_past_64_characters_is_a_located_error(policy):
    with pytest.raises(SchemaError, match=f"at most {MAX_RECOMPUTE_CHARS}") as info:
        parse_schema(f'<schema name="s"\n recompute="{policy}"/>')
    assert (info.value.span.line, info.value.span.col) == (2, 13)
    assert MAX_RECOMPUTE_CHARS == 64


def test_recompute_text_of_64_characters_is_kept_for_the_runtime_to_read():
    # the number's digits are the runtime's to bound (it parses the policy)
    policy = "first:" + "9" * (MAX_RECOMPUTE_CHARS - len("first:"))
    schema = parse_schema(f'<schema name="s"\n recompute=" {policy} "/>', file="s.pml")
    assert schema.recompute == policy
    assert (schema.recompute_span.file, schema.recompute_span.line,
            schema.recompute_span.col) == ("s.pml", 2, 13)


# --- the layout's size, checked before it is built --------------------------------------

def test_slot_past_the_context_fails_at_the_parameter_before_tokenizing():
    schema = parse_schema(param_schema("8000000"), file="s.pml")
    tok = WordTokenizer(max_positions=8192)
    error, peak = peak_bytes(lambda: lay_out(schema, tok))
    assert isinstance(error, ContextLengthError)
    assert "parameter 'p' reserves 8000000 positions" in error.message
    assert "the model has 8192" in error.message
    assert (error.span.file, error.span.line, error.span.col) == ("s.pml", 2, 21)
    assert peak < 1_000_000


def test_a_billion_token_parameter_built_without_the_parser_is_refused():
    # what the compiler's MaxTokens(10**9) turns into
    span = n.Module("m").span
    schema = n.Schema("s", (n.Module("m", (n.Text("ask"), n.Param("q", 10**9, span=span))),))
    for tok in (WordTokenizer(max_positions=8192), WordTokenizer(max_positions=None)):
        error, peak = peak_bytes(lambda: lay_out(schema, tok))
        assert isinstance(error, ContextLengthError), error
        assert "parameter 'q' reserves 1000000000 positions" in error.message
        assert peak < 1_000_000
    assert "at most 16777216 when the model's context is unknown" in error.message


def test_parameter_lengths_that_are_not_positive_integers_are_schema_errors():
    schema = n.Schema("s", (n.Module("m", (n.Param("q", -3),)),))
    with pytest.raises(SchemaError, match="positive whole number of positions, not -3"):
        lay_out(schema, WordTokenizer())


def test_union_members_reserving_too_much_in_all_fail_at_the_member_that_passes_the_cap():
    members = "".join(f'<module name="m{i}">\n<param name="p" len="8388608"/></module>'
                      for i in range(3))
    schema = parse_schema(f'<schema name="s"><union>{members}</union></schema>')
    error, peak = peak_bytes(lambda: lay_out(schema, WordTokenizer(max_positions=None)))
    assert isinstance(error, ContextLengthError)
    assert "reserve more than 16777216 positions in all" in error.message
    assert error.span.line == 4                       # the third member's parameter
    assert peak < 1_000_000


def test_union_members_share_one_filler_tuple_per_length():
    members = "".join(f'<module name="m{i}">x <param name="p" len="4000"/></module>'
                      for i in range(200))
    layout = lay_out(parse_schema(f'<schema name="s"><union>{members}</union></schema>'),
                     WordTokenizer(max_positions=8192))
    fillers = {id(seg.token_ids) for path, module in layout.modules.items() if path
               for seg in module.segments if seg.kind == "param"}
    assert len(fillers) == 1


def test_text_past_the_context_is_located_at_the_text_that_passes_it():
    schema = parse_schema('<schema name="s">one two\n<module name="m">\nthree four five six'
                          '</module></schema>')
    with pytest.raises(ContextLengthError, match="needs 6 positions; the model has 4") as info:
        lay_out(schema, WordTokenizer(max_positions=4))
    assert info.value.span.line == 3


# --- linear parsing ---------------------------------------------------------------------

def test_twenty_thousand_attributes_parse_and_a_late_duplicate_is_located():
    attrs = " ".join(f'a{i}="v"' for i in range(20_000))
    (ref,) = parse_prompt(f'<prompt schema="s"><m {attrs}/></prompt>').children
    assert len(ref.args) == 20_000
    with pytest.raises(PMLSyntaxError, match="duplicate attribute 'a7'") as info:
        parse_prompt(f'<prompt schema="s"><m {attrs} a7="again"/></prompt>')
    assert info.value.span.col == len(f'<prompt schema="s"><m {attrs} ') + 1


def test_spans_on_one_line_share_one_copy_of_its_text():
    members = "".join(f'<module name="m{i}">t{i}</module>' for i in range(50))
    schema = parse_schema(f'<schema name="s"><union>{members}</union></schema>')
    texts = {id(m.span.line_text) for m in schema.children[0].members}
    texts |= {id(m.children[0].span.line_text) for m in schema.children[0].members}
    assert len(texts) == 1


# --- the scaling bench --------------------------------------------------------------------

def test_parse_scaling_prints_one_row_per_case_with_three_times_and_an_exponent(capsys):
    from promptlang.bench import parse_scaling

    assert parse_scaling.main(["--size", "3", "--repeat", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("PML parse/layout/bind scaling")
    assert lines[1].split()[:2] == ["case", "1x"]
    rows = lines[2:]
    assert len(rows) == len(parse_scaling.CASES) >= 9
    for row, (name, unit, _) in zip(rows, parse_scaling.CASES):
        assert row.startswith(name) and f"3 {unit}" in row
        numbers = row.split()[-4:]
        assert all(re.fullmatch(r"-?\d+\.\d\d", x) for x in numbers), row


def test_parse_scaling_cases_build_valid_documents():
    from promptlang.bench import parse_scaling

    for _, _, build in parse_scaling.CASES:
        assert build(5)() is not None       # parses, lays out or binds without an error
