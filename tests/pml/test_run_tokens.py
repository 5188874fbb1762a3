"""Text runs tokenized as the whole text tokenizes them (promptlang/tokenizer.py `encode_run`,
`joins_space_to_word`; the layout's parameter and tail leads).

The oracle is the tokenizer itself on the whole text: the tokens promptlang puts at a run's
boundaries must be the ones `tokenizer(whole text)` gives there."""

from __future__ import annotations

import re

import pytest

from promptlang.errors import ArgumentTooLongError, EmptyPromptError
from promptlang.pml.binding import bind
from promptlang.pml.layout import lay_out
from promptlang.pml.parser import parse_prompt, parse_schema
from promptlang.tokenizer import WordTokenizer, encode_run, joins_space_to_word


def pieces(tok, ids) -> list[str]:
    return [tok.decode([i]) for i in ids]


def whole(tok, text: str) -> list[int]:
    return tok.tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("text", [".\n\n", "Hello there.\n\n", "a \n\n", "end.\n", "x\t\n"])
def test_a_run_ending_in_whitespace_is_tokenized_as_before_a_word(default_tokenizer, text):
    tok = default_tokenizer
    ours = encode_run(tok, text, followed=True)
    assert ours + tok.encode("Source") == whole(tok, text + "Source")
    assert tok.decode(ours) == text


def test_the_default_tokenizer_splits_a_blank_line_before_a_word(default_tokenizer):
    tok = default_tokenizer
    assert pieces(tok, encode_run(tok, "done.\n\n", followed=True)) == ["done", ".", "\n", "\n"]
    # at the prompt's end (or before a control token) the run is tokenized alone
    assert encode_run(tok, "done.\n\n", followed=False) == tok.encode("done.\n\n")
    assert pieces(tok, tok.encode("done.\n\n")) == ["done", ".", "\n\n"]


def test_where_the_next_word_takes_a_space_the_rest_of_the_run_is_tokenized_alone(
        default_tokenizer):
    tok = default_tokenizer
    ours = encode_run(tok, "x  ", followed=True)
    # the whole text "x  y" is "x", " ", " y": the run keeps the tokens that are its own
    # and its last space alone (the next word's token cannot be cut in two)
    assert pieces(tok, ours) == ["x", " ", " "]
    assert pieces(tok, whole(tok, "x  y")) == ["x", " ", " y"]


@pytest.mark.parametrize("text", ["é\n\n", "日本 \t\n", "   ", "\n", "<|im_end|>\n\n",
                                  "Ünïcödé  \n \n"])
def test_encode_run_keeps_every_character(default_tokenizer, text):
    tok = default_tokenizer
    ours = encode_run(tok, text, followed=True)
    assert tok.decode(ours) == text
    assert tok.control_ids.isdisjoint(ours)


def test_runs_not_ending_in_whitespace_are_tokenized_alone(default_tokenizer, wordtok):
    for tok in (default_tokenizer, wordtok):
        assert encode_run(tok, "Query:", followed=True) == tok.encode("Query:")
        assert encode_run(tok, "", followed=True) == []


class SpaceApart(WordTokenizer):
    """Spaces are tokens of their own: a space never joins the next word."""

    _piece = re.compile(r"\S+|\s+")

    @property
    def fingerprint(self) -> str:
        return "space-apart-" + super().fingerprint


def test_joining_a_space_to_the_next_word_is_read_from_the_tokenizer(default_tokenizer):
    assert joins_space_to_word(default_tokenizer)
    assert joins_space_to_word(WordTokenizer())
    assert not joins_space_to_word(SpaceApart())


SCHEMA = parse_schema('<schema name="s">Intro.<module name="m">Query: <param name="q" len="2"/>'
                      ' done.</module>Answer: </schema>')


def test_the_space_before_a_parameter_is_tokenized_with_the_argument(wordtok):
    layout = lay_out(SCHEMA, wordtok)
    module = layout.modules[("m",)]
    slot = module.params[0]
    assert slot.lead == " " and slot.length == 3          # the space and the parameter's 2
    assert module.segments[0].text == "Query:"
    bound = bind(parse_prompt('<prompt schema="s"><m q="one two"/>Why?</prompt>'), layout,
                 wordtok)
    argument = next(seg for seg in bound.uncached if seg.kind == "argument")
    assert argument.text == " one two" and argument.start == slot.start
    assert bound.render() == "Intro.Query: one two done.Answer: Why?"
    assert argument.token_ids == tuple(wordtok.encode(" one two"))


def test_the_parameter_bounds_the_argument_s_own_tokens(wordtok, default_tokenizer):
    layout = lay_out(SCHEMA, wordtok)
    with pytest.raises(ArgumentTooLongError) as err:
        bind(parse_prompt('<prompt schema="s"><m q="one two three"/></prompt>'), layout,
             wordtok)
    assert (err.value.count, err.value.bound) == (3, 2)
    # a space the tokenizer keeps apart ("42": " ", "4", "2") is not the argument's
    layout = lay_out(SCHEMA, default_tokenizer)
    bound = bind(parse_prompt('<prompt schema="s"><m q="42"/></prompt>'), layout,
                 default_tokenizer)
    argument = next(seg for seg in bound.uncached if seg.kind == "argument")
    assert pieces(default_tokenizer, argument.token_ids) == [" ", "4", "2"]


def test_a_tokenizer_that_keeps_spaces_apart_leaves_them_in_the_text():
    tok = SpaceApart()
    module = lay_out(SCHEMA, tok).modules[("m",)]
    assert module.params[0].lead == "" and module.params[0].length == 2
    assert module.segments[0].text == "Query: "


def test_the_space_ending_the_schema_starts_the_prompt_s_text(default_tokenizer):
    tok = default_tokenizer
    layout = lay_out(SCHEMA, tok)
    assert layout.modules[()].tail_lead == " "
    bound = bind(parse_prompt('<prompt schema="s"><m q="Ann"/>How?</prompt>'), layout, tok)
    assert bound.token_ids() == whole(tok, bound.render())
    assert pieces(tok, bound.token_ids())[-2:] == [" How", "?"]
    # no text of its own: the space alone, where the schema had it
    alone = bind(parse_prompt('<prompt schema="s"><m q="Ann"/></prompt>'), layout, tok)
    assert alone.render().endswith("Answer: ")
    assert alone.token_ids() == whole(tok, alone.render())
    with pytest.raises(EmptyPromptError):
        bind(parse_prompt('<prompt schema="s"></prompt>'), layout, tok)


def test_a_module_that_ends_the_schema_gives_up_its_final_space(default_tokenizer):
    tok = default_tokenizer
    schema = parse_schema('<schema name="t"><system>Be brief.</system><user>Intro.'
                          '<module name="m">Docs.\n\nQuery: </module></user></schema>')
    layout = lay_out(schema, tok)
    assert layout.modules[("m",)].tail_lead == ""          # a role marker ends the schema
    schema = parse_schema('<schema name="t">Intro.<union><module name="a">A.\n\nQuery: </module>'
                          '<module name="b">B is longer.\n\nAsk: </module></union></schema>')
    layout = lay_out(schema, tok)
    assert [layout.modules[(name,)].tail_lead for name in "ab"] == [" ", " "]
    for name in "ab":
        bound = bind(parse_prompt(f'<prompt schema="t"><{name}/>Why so?</prompt>'), layout, tok)
        assert bound.token_ids() == whole(tok, bound.render())


def test_text_before_a_control_token_ends_as_at_the_prompt_s_end(default_tokenizer):
    tok = default_tokenizer
    schema = parse_schema('<schema name="c"><user><![CDATA[Read this.\n\n]]></user></schema>')
    bound = bind(parse_prompt('<prompt schema="c"><user><![CDATA[And this.\n\n]]></user>'
                              '</prompt>'), lay_out(schema, tok), tok)
    assert bound.token_ids() == whole(tok, bound.render())
    assert pieces(tok, bound.token_ids()).count("\n\n") == 2
