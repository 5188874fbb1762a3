"""Untrusted text is bounded before it is tokenized, and `src=` reads are capped in all.

A `src=` document or schema text that cannot fit the model's context, and an argument
that cannot fit its parameter, fail with their located errors without being encoded
(`Tokenizer.max_token_chars` gives a lower bound on the token count); the `src=` files
of one schema together read at most the input cap.
"""

from __future__ import annotations

import math
import textwrap
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from promptlang.errors import ArgumentTooLongError, ContextLengthError, SourceFileError
from promptlang.pml import binding, layout as layout_mod
from promptlang.pml.binding import bind
from promptlang.pml.layout import lay_out
from promptlang.pml.parser import parse_file, parse_prompt, parse_schema
from promptlang.tokenizer import Tokenizer, WordTokenizer, min_token_count

BIG = 2 * 1024 * 1024
PEAK_LIMIT = 40 * 1024 * 1024


@pytest.fixture
def no_long_encode(default_tokenizer, monkeypatch):
    """Fails a test that hands the tokenizer a long text."""
    real = default_tokenizer.encode

    def encode(text):
        assert len(text) < 100_000, f"tokenized {len(text)} characters"
        return real(text)

    monkeypatch.setattr(default_tokenizer, "encode", encode)
    return default_tokenizer


def _peak(call):
    tracemalloc.start()
    try:
        call()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


# --- the bound ------------------------------------------------------------------------

def test_tokenizers_offer_a_bound(default_tokenizer):
    assert isinstance(default_tokenizer, Tokenizer) and isinstance(WordTokenizer(), Tokenizer)
    assert isinstance(default_tokenizer.max_token_chars, int)
    assert default_tokenizer.max_token_chars >= 1
    assert default_tokenizer.max_token_chars is default_tokenizer.max_token_chars  # cached
    assert WordTokenizer().max_token_chars is None
    assert min_token_count(WordTokenizer(), "a" * 10_000) == 1
    assert min_token_count(WordTokenizer(), "") == 0
    assert min_token_count(default_tokenizer, "x" * (3 * default_tokenizer.max_token_chars
                                                      + 1)) == 4


class _FourChars:
    max_token_chars = 4
    vanishing_chars = ("\x06",)


def test_a_bound_asked_only_past_enough_stops_counting_early_and_stays_a_bound():
    text = "ab\x06" * 100_000 + "cd" * 7                  # 200,014 kept: 50,004 tokens at least
    full = min_token_count(_FourChars(), text)
    assert full == 50_004
    early = min_token_count(_FourChars(), text, enough=10)
    assert 10 < early < full                               # stopped after its first piece
    assert min_token_count(_FourChars(), text, enough=full) == full
    assert min_token_count(_FourChars(), text, enough=full - 1) == full
    assert min_token_count(_FourChars(), "abcdefghi", enough=0) == 3


_runs = st.lists(st.tuples(st.sampled_from(" \n\t0123456789-=_#*.a\x04\x06"),
                           st.integers(1, 400)), max_size=8).map(
    lambda parts: "".join(c * n for c, n in parts))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.text(max_size=400), st.text(st.characters(max_codepoint=127),
                                                 max_size=400), _runs))
def test_bound_never_exceeds_the_token_count(text):
    tok = _default()
    count = len(tok.encode(text))
    kept = len(text) - sum(text.count(c) for c in tok.vanishing_chars)
    assert count >= math.ceil(kept / tok.max_token_chars) == min_token_count(tok, text)


def test_characters_the_vocabulary_cannot_spell_are_not_counted(default_tokenizer):
    """The default vocabulary lacks the byte-level symbols of a few ASCII control
    characters and has no unknown token: they vanish, and the bound leaves them out."""
    tok = default_tokenizer
    assert "\x06" in tok.vanishing_chars and "a" not in tok.vanishing_chars
    for text in ("\x06", "\x06" * 500, "a\x06b", "\x04\x06\x13" * 99 + "word"):
        assert len(tok.encode(text)) >= min_token_count(tok, text)
    assert min_token_count(tok, "\x06" * 500) == 0 == len(tok.encode("\x06" * 500))


_TOK = None


def _default():      # hypothesis tests cannot take function-scoped fixtures
    global _TOK
    if _TOK is None:
        from promptlang.hf_tokenizer import load_tokenizer
        _TOK = load_tokenizer()
    return _TOK


# --- the layout -----------------------------------------------------------------------

def test_big_src_document_fails_located_without_tokenizing(tmp_path, no_long_encode):
    tok = no_long_encode
    (tmp_path / "big.txt").write_text("word " * (BIG // 5))
    schema_file = tmp_path / "s.pml"
    schema_file.write_text('<schema name="s">\n<system>Hi.</system>\n'
                           '<module name="doc" src="big.txt"/>\n</schema>\n')

    def run():
        lay_out(parse_file(schema_file), tok)

    with pytest.raises(ContextLengthError) as err:
        run()
    message = str(err.value)
    assert "schema 's' needs at least" in message and f"the model has {tok.max_positions}" in message
    span = err.value.span                               # where the document starts
    assert span is not None and span.file.endswith("big.txt") and (span.line, span.col) == (1, 1)


def test_big_src_document_peak_memory_is_small(tmp_path, default_tokenizer):
    (tmp_path / "big.txt").write_text("word " * (BIG // 5))
    schema_file = tmp_path / "s.pml"
    schema_file.write_text('<schema name="s"><module name="doc" src="big.txt"/></schema>')
    failed = []

    def run():
        try:
            lay_out(parse_file(schema_file), default_tokenizer)
        except ContextLengthError as e:
            failed.append(e)

    assert _peak(run) < PEAK_LIMIT and failed


def test_long_scaffold_text_fails_without_tokenizing(no_long_encode):
    text = "x " * 200_000
    schema = parse_schema(f'<schema name="s"><module name="m"><parameter name="p" length="4" '
                          f'scaffold="{text}"/></module></schema>')
    with pytest.raises(Exception, match="at least .* tokens; the parameter reserves 4"):
        lay_out(schema, no_long_encode)


def test_text_after_an_overflowing_run_fails_at_that_run(default_tokenizer):
    limit = default_tokenizer.max_positions
    first = "a b " * limit                              # crosses the limit, bound does not
    schema = parse_schema(f'<schema name="s">\n<module name="m">{first}</module>\n'
                          f'<module name="n">{"z " * 300_000}</module></schema>')
    with pytest.raises(ContextLengthError, match="needs at least") as err:
        lay_out(schema, default_tokenizer)
    assert err.value.span.line == 2


FITTING = textwrap.dedent("""\
    <schema name="fit">
      <system>You are a careful assistant.   Numbers: 1234567890 1234567890</system>
      <module name="a">Plan a trip lasting <param name="d" len="8"/> days.
        <union><module name="x">about Tokyo</module><module name="y">Paris!!</module></union>
      </module>
      <module name="b"><parameter name="s" length="6" scaffold="fill me"/> tail text</module>
      <user>
    </schema>
    """)
PROMPT = textwrap.dedent("""\
    <prompt schema="fit"><a d="three long days"><y/></a><b s="in"/>What first?</user>
    </prompt>""")


@pytest.mark.parametrize("tok_name", ["default", "word"])
def test_what_fits_lays_out_and_binds_as_without_the_precheck(tok_name, default_tokenizer,
                                                              monkeypatch):
    tok = default_tokenizer if tok_name == "default" else WordTokenizer()
    schema = parse_schema(FITTING)
    layout_mod._memo.clear()
    checked = lay_out(schema, tok)
    bound = bind(parse_prompt(PROMPT), checked, tok)
    monkeypatch.setattr(layout_mod, "min_token_count", lambda t, text: 0)
    monkeypatch.setattr(binding, "min_token_count", lambda t, text: 0)
    layout_mod._memo.clear()
    plain = lay_out(schema, tok)
    assert plain is not checked and plain == checked
    assert bind(parse_prompt(PROMPT), plain, tok) == bound
    layout_mod._memo.clear()


# --- binding --------------------------------------------------------------------------

def test_big_argument_fails_located_without_tokenizing(no_long_encode):
    tok = no_long_encode
    layout = lay_out(parse_schema('<schema name="s"><module name="m">Say '
                                  '<param name="p" len="8"/></module></schema>'), tok)
    value = "word " * (BIG // 5)
    prompt = parse_prompt(f'<prompt schema="s">\n<m p="{value}"/></prompt>', file="p.pml")
    failed = []

    def run():
        try:
            bind(prompt, layout, tok)
        except ArgumentTooLongError as e:
            failed.append(e)

    assert _peak(run) < PEAK_LIMIT
    (err,) = failed
    assert (err.parameter, err.bound) == ("p", 8)
    assert err.count == math.ceil(len(value) / tok.max_token_chars) > 8
    assert f"is at least {err.count} tokens long; the parameter allows 8" in str(err)
    assert err.span is not None and err.span.line == 2


def test_argument_just_over_its_slot_still_gets_the_exact_count(default_tokenizer):
    layout = lay_out(parse_schema('<schema name="s"><module name="m">Say '
                                  '<param name="p" len="2"/></module></schema>'),
                     default_tokenizer)
    with pytest.raises(ArgumentTooLongError) as err:
        bind(parse_prompt('<prompt schema="s"><m p="one two three four"/></prompt>'),
             layout, default_tokenizer)
    assert err.value.count == len(default_tokenizer.encode("one two three four"))
    assert "at least" not in str(err.value)


# --- the total src= cap ---------------------------------------------------------------

def test_src_files_together_read_at_most_the_cap(tmp_path, monkeypatch):
    monkeypatch.setenv("PROMPTLANG_MAX_INPUT_BYTES", "2000")
    (tmp_path / "big.txt").write_text("x" * 1200)
    refs = "".join(f'<module name="m{i}" src="big.txt"/>\n' for i in range(30))
    schema_file = tmp_path / "s.pml"
    schema_file.write_text(f'<schema name="s">\n{refs}</schema>\n')
    with pytest.raises(SourceFileError) as err:
        parse_file(schema_file)
    message = str(err.value)
    assert "cap of 2000 bytes on all the schema's src= files together" in message
    assert "1200 bytes read before it" in message
    assert err.value.span is not None and err.value.span.line == 3      # the second one

    schema_file.write_text('<schema name="s"><module name="m0" src="big.txt"/></schema>')
    assert parse_file(schema_file).children[0].children[0].text == "x" * 1200
