"""Binding a prompt to its schema: imports, arguments, unions, and every binding error."""

import textwrap

import pytest

from promptlang.errors import (ArgumentTooLongError, ContextLengthError, MissingArgumentError,
                               PromptLangError, RoleError, UnionConflictError,
                               UnknownModuleError, UnknownParameterError, UnknownSchemaError)
from promptlang.pml.binding import bind
from promptlang.pml.layout import lay_out
from promptlang.pml.parser import parse_prompt, parse_schema
from promptlang.tokenizer import WordTokenizer

SCHEMA = textwrap.dedent("""\
    <schema name="travel">
      <system>You are a travel agent.</system>
      <module name="trip-plan">Plan a trip lasting <param name="duration" len="4"/>.
        <union>
          <module name="tokyo">about Tokyo</module>
          <module name="paris">all about lovely Paris</module>
        </union>
      </module>
      <module name="extra" cache="false">Live prices follow.</module>
      <scaffold name="docs">
        <module name="doc-a">A one two</module>
        <module name="doc-b">B three</module>
      </scaffold>
      <user>
    </schema>
    """)


@pytest.fixture
def tok():
    return WordTokenizer()


@pytest.fixture
def layout(tok):
    return lay_out(parse_schema(SCHEMA, file="travel.pml"), tok)


def bind_text(text, layout, tok):
    return bind(parse_prompt(textwrap.dedent(text), file="prompt.pml"), layout, tok)


def test_bound_prompt_renders_the_plain_text_the_model_sees(layout, tok):
    bound = bind_text("""\
        <prompt schema="travel">
          <trip-plan duration="3 days"><paris/></trip-plan>
          What first?</user><assistant>
        </prompt>""", layout, tok)
    assert bound.render() == ("[system]You are a travel agent.[/system]Plan a trip lasting "
                              "3 days.all about lovely Paris[user]What first?[/user][assistant]")
    assert bound.modules == ((), ("trip-plan",), ("trip-plan", "paris"))
    assert bound.units == ("module:", "module:trip-plan", "module:trip-plan/paris")


def test_argument_sits_in_its_slot_and_shorter_argument_leaves_a_gap(layout, tok):
    bound = bind_text('<prompt schema="travel"><trip-plan duration="3 days"><tokyo/>'
                      '</trip-plan>Go</prompt>', layout, tok)
    slot = layout.modules[("trip-plan",)].params[0]
    (arg,) = [s for s in bound.uncached if s.kind == "argument"]
    assert (arg.start, len(arg.token_ids)) == (slot.start, 2)
    positions = [p for _, p, _ in bound.sequence()]
    assert slot.start + 2 not in positions and slot.start + 3 not in positions
    assert positions == sorted(positions)


def test_prompt_text_starts_after_the_schema_end(layout, tok):
    bound = bind_text('<prompt schema="travel">Hello there</prompt>', layout, tok)
    (text,) = bound.uncached
    assert text.start == layout.end and bound.end == layout.end + 2


def test_cache_false_module_is_computed_per_request(layout, tok):
    bound = bind_text('<prompt schema="travel"><extra/>Q</prompt>', layout, tok)
    assert "module:extra" not in bound.units
    assert any(s.text == "Live prices follow." for s in bound.uncached)


def test_importing_all_of_a_scaffold_uses_its_joint_unit(layout, tok):
    both = bind_text('<prompt schema="travel"><doc-a/><doc-b/>Q</prompt>', layout, tok)
    named = bind_text('<prompt schema="travel"><scaffold name="docs"/>Q</prompt>', layout, tok)
    one = bind_text('<prompt schema="travel"><doc-b/>Q</prompt>', layout, tok)
    assert both.units == named.units == ("module:", "scaffold:docs")
    assert one.units == ("module:", "module:doc-b")


def test_unknown_schema(layout, tok):
    with pytest.raises(UnknownSchemaError, match="'hotels'") as err:
        bind_text('<prompt schema="hotels">Q</prompt>', layout, tok)
    assert (err.value.span.file, err.value.span.line, err.value.span.col) == ("prompt.pml", 1, 1)


def test_unknown_module_names_known_ones_and_location(layout, tok):
    with pytest.raises(UnknownModuleError) as err:
        bind_text('<prompt schema="travel">\n  <trip-plan duration="x"><rome/></trip-plan>\n'
                  '</prompt>', layout, tok)
    assert "no module 'rome'" in err.value.message and "tokyo, paris" in err.value.message
    assert (err.value.span.line, err.value.span.col) == (2, 27)
    assert str(err.value).startswith("prompt.pml:2:27: module 'trip-plan' has no module 'rome'")


def test_child_must_be_imported_through_its_parent(layout, tok):
    with pytest.raises(UnknownModuleError, match="import it through its parent"):
        bind_text('<prompt schema="travel"><paris/></prompt>', layout, tok)


def test_unknown_parameter(layout, tok):
    with pytest.raises(UnknownParameterError, match="no parameter 'days'.*duration") as err:
        bind_text('<prompt schema="travel"><trip-plan days="3"/></prompt>', layout, tok)
    assert (err.value.span.line, err.value.span.col) == (1, 36)


def test_missing_argument(layout, tok):
    with pytest.raises(MissingArgumentError, match="parameter 'duration'") as err:
        bind_text('<prompt schema="travel"><trip-plan/></prompt>', layout, tok)
    assert (err.value.span.line, err.value.span.col) == (1, 25)


def test_argument_too_long_names_parameter_bound_and_count(layout, tok):
    with pytest.raises(ArgumentTooLongError) as err:
        bind_text('<prompt schema="travel"><trip-plan duration="one two three four five"/>'
                  '</prompt>', layout, tok)
    e = err.value
    assert (e.parameter, e.bound, e.count) == ("duration", 4, 5)
    assert "'duration' is 5 tokens long; the parameter allows 4" in e.message
    assert (e.span.line, e.span.col) == (1, 36)


def test_two_members_of_one_union(layout, tok):
    with pytest.raises(UnionConflictError, match="'paris' and 'tokyo'") as err:
        bind_text('<prompt schema="travel"><trip-plan duration="x"><tokyo/><paris/>'
                  '</trip-plan></prompt>', layout, tok)
    assert (err.value.span.line, err.value.span.col) == (1, 57)


def test_module_imported_twice(layout, tok):
    with pytest.raises(PromptLangError, match="imported twice"):
        bind_text('<prompt schema="travel"><extra/><extra/></prompt>', layout, tok)


def test_unbalanced_roles_across_schema_and_prompt(layout, tok):
    with pytest.raises(RoleError, match="<assistant> opens while <user> is still open"):
        bind_text('<prompt schema="travel">Q<assistant></prompt>', layout, tok)
    with pytest.raises(RoleError, match="closes a role that is not open"):
        bind_text('<prompt schema="travel"></user></system></prompt>', layout, tok)


def test_prompt_longer_than_context(tok):
    small = WordTokenizer(max_positions=30)
    layout = lay_out(parse_schema(SCHEMA, file="travel.pml"), small)
    with pytest.raises(ContextLengthError, match="the model has 30"):
        bind_text('<prompt schema="travel">' + "word " * 20 + '</prompt>', layout, small)


def test_empty_prompt_is_an_error(layout, tok):
    with pytest.raises(PromptLangError, match="the prompt is empty"):
        bind_text('<prompt schema="travel"></prompt>', layout, tok)


def test_layout_for_another_tokenizer_is_refused(layout):
    with pytest.raises(PromptLangError, match="laid out for another tokenizer"):
        bind_text('<prompt schema="travel">Q</prompt>', layout, WordTokenizer(bos=True))


def test_generation_prompt_opens_the_assistant_after_closed_roles(layout, tok):
    text = '<prompt schema="travel">What first?</user></prompt>'
    plain = bind_text(text, layout, tok)
    assert plain.render().endswith("What first?[/user]")
    bound = bind(parse_prompt(text), layout, tok, add_generation_prompt=True)
    assert bound.render().endswith("What first?[/user][assistant]")
    assert bound.end == plain.end + 1
    still_open = '<prompt schema="travel">What first?</user><assistant>Sure,</prompt>'
    assert bind(parse_prompt(still_open), layout, tok,
                add_generation_prompt=True).render().endswith("[assistant]Sure,")
