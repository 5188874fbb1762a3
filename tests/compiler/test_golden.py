"""Golden tests: a dedented @prompt source -> the PML it compiles to (writer output), and
the PML prompt of one call. Every schema here also parses back and lays out."""

from __future__ import annotations

import os
import sys
import types

import pytest

from promptlang.errors import ArgumentTooLongError
from promptlang.pml.layout import lay_out
from promptlang.pml.parser import parse_prompt, parse_schema
from promptlang.pml.writer import write
from promptlang.tokenizer import WordTokenizer

from .support import load

TOKENIZER = WordTokenizer()
DEMO = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "compile_demo.py")


def compiled(source: str, name: str, function: str):
    """The @prompt function `function` of `source`, loaded as module `name`; its schema
    must round-trip through the PML parser and lay out with the word tokenizer."""
    value = load(source, name)
    for part in function.split("."):
        value = getattr(value, part)
    schema = value.schema
    assert parse_schema(write(schema)) == schema
    lay_out(schema, TOKENIZER)
    return value


def assert_prompt(result, expected_pml: str) -> None:
    assert result.prompt_pml() == expected_pml
    assert parse_prompt(expected_pml) == result.doc
    result.bind(TOKENIZER)          # a prompt the binder accepts against its own schema


def test_text_statements_docstring_and_dedent():
    f = compiled('''
        from promptlang import prompt

        @prompt
        def f():
            """The docstring is documentation, not text."""
            "One, "
            "two; " "three\\n"
            """
            A block:
              indented.
            """
            """Inline first line
            and a second.
            """
            42
            None
            ...
        ''', "app_text", "f")
    assert f.schema_pml() == (
        '<schema name="app_text.f"><module name="f">One, two; three\nA block:\n  indented.\n'
        'Inline first line\nand a second.\n42</module></schema>')
    assert_prompt(f(), '<prompt schema="app_text.f"><f/></prompt>')


def test_if_without_else_is_an_optional_child_module():
    f = compiled('''
        from promptlang import prompt

        @prompt
        def f(verbose: bool, lang: str):
            """The first string is the docstring: Python's rule."""
            "Answer"
            if verbose:
                " in detail"
            if not verbose and lang != "en":
                " briefly"
            "."
        ''', "app_if", "f")
    assert f.schema_pml() == (
        '<schema name="app_if.f"><module name="f">Answer<module name="verbose"> in detail'
        '</module><module name="not-verbose-and-lang-ne-en"> briefly</module>.</module>'
        '</schema>')
    assert_prompt(f(True, "en"), '<prompt schema="app_if.f"><f><verbose/></f></prompt>')
    assert_prompt(f(False, "fr"), '<prompt schema="app_if.f"><f><not-verbose-and-lang-ne-en/>'
                                  '</f></prompt>')


def test_if_elif_else_is_a_union_of_the_arms_that_emit():
    f = compiled('''
        from promptlang import prompt

        @prompt
        def f(city: str, budget: int):
            if city == "tokyo":
                "Tokyo."
            elif city == "paris" and budget > 100:
                "Paris."
            elif city.startswith("r"):
                pass
            else:
                "Elsewhere."
            if budget:
                x = 1
            else:
                " No budget."
        ''', "app_ifelse", "f")
    assert f.schema_pml() == (
        '<schema name="app_ifelse.f"><module name="f"><union><module name="city-tokyo">Tokyo.'
        '</module><module name="city-paris-and-budget-gt-100">Paris.</module>'
        '<module name="else">Elsewhere.</module></union><module name="not-budget"> No budget.'
        '</module></module></schema>')
    assert_prompt(f("paris", 200), '<prompt schema="app_ifelse.f"><f>'
                                   '<city-paris-and-budget-gt-100/></f></prompt>')
    assert_prompt(f("rome", 0), '<prompt schema="app_ifelse.f"><f><not-budget/></f></prompt>')
    assert_prompt(f("oslo", 5), '<prompt schema="app_ifelse.f"><f><else/></f></prompt>')


def test_if_else_arms_are_named_after_the_condition():
    f = compiled('''
        from promptlang import prompt

        @prompt
        def f(formal, quiet):
            if formal:
                "Dear"
            else:
                "Hi"
            if not quiet:
                "!"
            else:
                "."
        ''', "app_ifnames", "f")
    assert f.schema_pml() == (
        '<schema name="app_ifnames.f"><module name="f"><union><module name="formal">Dear'
        '</module><module name="not-formal">Hi</module></union><union><module name="not-quiet">'
        '!</module><module name="quiet">.</module></union></module></schema>')


def test_match_is_a_union_of_literal_value_class_or_guard_and_wildcard_cases():
    f = compiled('''
        import enum
        from promptlang import prompt

        class Color(enum.Enum):
            RED = 1

        class Point:
            __match_args__ = ("x",)
            def __init__(self, x):
                self.x = x

        @prompt
        def f(item):
            match item:
                case "a" | "b":
                    "letter"
                case 1:
                    "one"
                case Color.RED:
                    "red"
                case Point(x=0):
                    "origin"
                case int(n) if n > 10:
                    "big"
                case _:
                    "other"
        ''', "app_match", "f")
    assert f.schema_pml() == (
        '<schema name="app_match.f"><module name="f"><union><module name="a-or-b">letter'
        '</module><module name="case-1">one</module><module name="Color-RED">red</module>'
        '<module name="Point-x-0">origin</module><module name="int-n-if-n-gt-10">big</module>'
        '<module name="default">other</module></union></module></schema>')
    module = sys.modules["app_match"]
    cases = {"b": "a-or-b", 1: "case-1", module.Color.RED: "Color-RED",
             module.Point(0): "Point-x-0", 12: "int-n-if-n-gt-10", 5: "default"}
    for value, member in cases.items():
        assert_prompt(f(value), f'<prompt schema="app_match.f"><f><{member}/></f></prompt>')


def test_nested_ifs_and_statements_between_texts():
    f = compiled('''
        from promptlang import prompt

        @prompt
        def f(a: bool, b: bool):
            """Nested."""
            "Start."
            if a:
                " A"
                shout = b and not a
                if b or shout:
                    " and B"
                " then A again"
            " End."
        ''', "app_nested", "f")
    assert f.schema_pml() == (
        '<schema name="app_nested.f"><module name="f">Start.<module name="a"> A'
        '<module name="b-or-shout"> and B</module> then A again</module> End.</module>'
        '</schema>')
    assert_prompt(f(True, False), '<prompt schema="app_nested.f"><f><a/></f></prompt>')
    assert_prompt(f(True, True), '<prompt schema="app_nested.f"><f><a><b-or-shout/></a></f>'
                                 '</prompt>')
    assert_prompt(f(False, True), '<prompt schema="app_nested.f"><f/></prompt>')


def test_prompt_calls_are_child_modules_and_arguments_flow_into_the_callee():
    f = compiled('''
        from typing import Annotated
        from promptlang import prompt, MaxTokens

        @prompt
        def greet(name: Annotated[str, MaxTokens(4)], formal: bool):
            if formal:
                f"Dear {name}. "
            else:
                f"Hi {name}! "

        @prompt
        def letter(to: Annotated[str, MaxTokens(4)], cc):
            greet(to, True)
            "Body. "
            greet(name=cc, formal=len(cc) > 3)
        ''', "app_calls", "letter")
    greet = ('<union><module name="formal">Dear <param name="name" len="4"/>. </module>'
             '<module name="not-formal">Hi <param name="name" len="4"/>! </module></union>')
    assert f.schema_pml() == (
        f'<schema name="app_calls.letter"><module name="letter"><module name="greet">{greet}'
        f'</module>Body. <module name="greet-2">{greet}</module></module></schema>')
    assert_prompt(f("Ada Lovelace", "Bob"), (
        '<prompt schema="app_calls.letter"><letter><greet><formal name="Ada Lovelace"/>'
        '</greet><greet-2><not-formal name="Bob"/></greet-2></letter></prompt>'))
    assert f("Ada", "Bobby").render(TOKENIZER) == "Dear Ada. Body. Dear Bobby. "


def test_holes_become_params_bounded_by_annotation_or_params_option():
    f = compiled('''
        from typing import Annotated
        from promptlang import prompt, MaxTokens

        @prompt(params={"city": 3, "price": 2, "user.name": 5})
        def f(city, days: Annotated[int, MaxTokens(2)], price: float, user, question: str):
            f"Trip to {city} for {days} days at {price:.2f} each, {city!r} again."
            city
            f" for {user.name}."
            " Thanks."
            f" Question: {question}?"
        ''', "app_holes", "f")
    assert f.schema_pml() == (
        '<schema name="app_holes.f"><module name="f">Trip to <param name="city" len="3"/> for '
        '<param name="days" len="2"/> days at <param name="price" len="2"/> each, '
        '<param name="city-2" len="3"/> again.<param name="city-3" len="3"/> for '
        '<param name="user.name" len="5"/>. Thanks.</module></schema>')
    user = types.SimpleNamespace(name="Ann Lee")
    result = f("Paris", 3, 9.5, user, "why & <how>")
    assert_prompt(result, (
        '<prompt schema="app_holes.f"><f city="Paris" days="3" price="9.50" city-2="\'Paris\'" '
        'city-3="Paris" user.name="Ann Lee"/> Question: why &amp; &lt;how&gt;?</prompt>'))
    assert result.render(TOKENIZER) == (
        "Trip to Paris for 3 days at 9.50 each, 'Paris' again.Paris for Ann Lee. Thanks. "
        "Question: why & <how>?")
    with pytest.raises(ArgumentTooLongError):
        f("Rio de Janeiro city", 3, 9.5, user, "?").render(TOKENIZER)


def test_unbounded_text_after_the_last_cached_part_is_uncached_prompt_text():
    f = compiled('''
        from typing import Annotated
        from promptlang import prompt, MaxTokens, system, user, assistant

        @prompt
        def f(topic: Annotated[str, MaxTokens(2)], history: list, question: str):
            with system():
                f"You know {topic}."
            for asked, answered in history:
                with user():
                    asked
                with assistant():
                    answered
            with user():
                question
        ''', "app_tail", "f")
    assert f.schema_pml() == ('<schema name="app_tail.f"><module name="f"><system>You know '
                              '<param name="topic" len="2"/>.</system></module></schema>')
    assert_prompt(f("cats", [("hi", "hello")], "Why?"), (
        '<prompt schema="app_tail.f"><f topic="cats"/><user>hi</user><assistant>hello'
        '</assistant><user>Why?</user></prompt>'))


def test_role_blocks_become_role_markers_open_in_the_schema_closed_in_the_prompt():
    f = compiled('''
        from promptlang import prompt, system
        import promptlang as pl

        @prompt
        def f(question):
            with system():
                "Be nice."
            with pl.user():
                "Q: "
                question
        ''', "app_roles", "f")
    assert f.schema_pml() == ('<schema name="app_roles.f"><module name="f"><system>Be nice.'
                              '</system><user>Q: </module></schema>')
    result = f("What?")
    assert_prompt(result, '<prompt schema="app_roles.f"><f/>What?</user></prompt>')
    assert result.render(TOKENIZER) == "[system]Be nice.[/system][user]Q: What?[/user]"


def test_methods_calling_prompt_methods_through_self():
    intro = compiled('''
        from promptlang import prompt

        class Agent:
            def __init__(self, name):
                self.name = name

            @prompt(params={"self.name": 3})
            def intro(self, verbose: bool):
                f"I am {self.name}."
                if verbose:
                    self.details()

            @prompt
            def details(self):
                """More about the agent."""
                " Details."
        ''', "app_methods", "Agent.intro")
    agent = sys.modules["app_methods"].Agent
    assert intro.schema_pml() == (
        '<schema name="app_methods.Agent.intro"><module name="intro">I am '
        '<param name="self.name" len="3"/>.<module name="verbose"><module name="details"> '
        'Details.</module></module></module></schema>')
    assert_prompt(agent("Bo").intro(True), (
        '<prompt schema="app_methods.Agent.intro"><intro self.name="Bo"><verbose><details/>'
        '</verbose></intro></prompt>'))


def test_names_are_unique_and_never_reserved_words():
    f = compiled('''
        from promptlang import prompt

        @prompt
        def user(system, flag):
            if system:
                "a"
            if system:
                "b"
            if 3 > flag:
                "c"

        @prompt
        def outer():
            user(True, 1)
            user(False, 9)
        ''', "app_names", "outer")
    assert f.schema_pml() == (
        '<schema name="app_names.outer"><module name="outer"><module name="fn-user">'
        '<module name="if-system">a</module><module name="if-system-2">b</module>'
        '<module name="if-3-gt-flag">c</module></module><module name="fn-user-2">'
        '<module name="if-system">a</module><module name="if-system-2">b</module>'
        '<module name="if-3-gt-flag">c</module></module></module></schema>')
    assert_prompt(f(), '<prompt schema="app_names.outer"><outer><fn-user><if-system/>'
                       '<if-system-2/><if-3-gt-flag/></fn-user><fn-user-2/></outer></prompt>')


def test_schema_name_is_module_qualified_or_given():
    module = load('''
        from promptlang import prompt

        @prompt(name="shop.greeting")
        def named():
            "Hi"

        def factory():
            @prompt
            def inner():
                "Hi"
            return inner
        ''', "app_schema_names")
    assert module.named.schema.name == "shop.greeting"
    assert module.named().doc.schema == "shop.greeting"
    assert module.factory().schema.name == "app_schema_names.factory.inner"


@pytest.mark.parametrize("tokenizer", ["wordtok", "default_tokenizer"])
def test_demo_schemas_parse_and_lay_out(tokenizer, request):
    """The example app's schemas, through the PML parser and the layout, with the word
    tokenizer and with the default model's real tokenizer."""
    wordtok = request.getfixturevalue(tokenizer)
    with open(DEMO, encoding="utf-8") as f:
        demo = load(f.read(), "compile_demo_golden")
    for function in (demo.greeting, demo.support):
        schema = parse_schema(function.schema_pml())
        assert schema == function.schema
        layout = lay_out(schema, wordtok)
        assert layout.end > 0
    layout = lay_out(demo.support.schema, wordtok)
    for union in layout.unions:
        lengths = [layout.modules[m].end - layout.modules[m].start for m in union.members]
        assert union.length == max(lengths)
    result = demo.support("doorbell", "none", "Ada", "Hello?", formal=True)
    assert result.bind(wordtok).render() == result.render(wordtok)
    assert "Camera and doorbell manual" in result.render(wordtok)
