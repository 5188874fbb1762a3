"""Python semantics are preserved: for any arguments, a @prompt call renders (through its
schema, its PML prompt, the layout and the binder) exactly the text the same function
builds when run as plain Python string building (the oracle in support.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from promptlang.pml.parser import parse_prompt, parse_schema
from promptlang.tokenizer import WordTokenizer

from .support import load, oracle_module

TOKENIZER = WordTokenizer(vocab_size=1 << 30)

# words: one WordTokenizer token each, with PML's special characters in them
_word = st.text(alphabet="ab<&>\"'xé]", min_size=1, max_size=4)


def bounded(n: int):
    """Text of at most n tokens."""
    return st.lists(_word, max_size=n).map(" ".join)


free_text = st.text(alphabet="ab \n<&>]]x", max_size=12)


BRANCHES = '''
from typing import Annotated
from promptlang.compiler import prompt, MaxTokens, system, user

@prompt
def travel(city: str, days: Annotated[str, MaxTokens(3)], budget: bool, question: str):
    """Plans trips: the docstring is not text."""
    with system():
        "You are a travel agent."
    f"Plan a trip of {days} days."
    if city == "tokyo":
        " Tokyo: temples."
        if budget:
            " Cheap eats."
        " Trains."
    elif city == "paris":
        """
        Paris:
          museums & <art>.
        """
    elif city.startswith("r"):
        pass
    else:
        f" Somewhere {'else'}."
    note = "Be brief." if budget else "Be thorough."
    with user():
        f"{note} {question}"
'''


MATCH = '''
import enum
from dataclasses import dataclass
from typing import Annotated
from promptlang.compiler import prompt, MaxTokens

class Color(enum.Enum):
    RED = 1
    BLUE = 2

@dataclass
class Point:
    x: int
    y: int

@prompt(params={"n": 2})
def pick(item, n: int):
    "Item: "
    match item:
        case "a" | "b":
            "a letter"
        case int(x) if x > 10:
            "a big number"
        case int():
            "a small number"
        case Color.RED:
            "red"
        case {"k": v}:
            "a mapping"
        case [first, *rest]:
            "a sequence"
        case Point(x=0):
            "on the axis"
        case _:
            "something else"
    ", n="
    n
'''


CALLS = '''
from typing import Annotated
from promptlang.compiler import prompt, MaxTokens, user

@prompt
def greet(name: Annotated[str, MaxTokens(4)], formal: bool):
    if formal:
        f"Dear {name},\\n"
    else:
        f"Hi {name}!\\n"

@prompt
def sign(formal):
    if not formal:
        "Cheers"
    else:
        "Regards"

@prompt
def letter(to: Annotated[str, MaxTokens(4)], formal: bool, body: str):
    greet(to, formal)
    "Thanks for your message.\\n"
    greet(to, formal=not formal)
    sign(formal)
    with user():
        body
'''


CHAT = '''
from promptlang.compiler import prompt, system, user, assistant

@prompt
def chat(history: list, question: str, persona: str):
    with system():
        "You are helpful."
        style = persona.lower()
        if style == "pirate":
            " Talk like a pirate."
    for asked, answered in history:
        with user():
            asked
        with assistant():
            answered
    with user():
        f"{question}?"
'''


METHODS = '''
from promptlang.compiler import prompt

class Agent:
    def __init__(self, name):
        self.name = name

    @prompt(params={"self.name": 4})
    def intro(self, verbose: bool):
        f"I am {self.name}."
        if verbose:
            self.details(3)

    @prompt
    def details(self, count):
        """A docstring, so that the next string is text."""
        " Details"
        if count > 2:
            " follow."
'''


VALUES = '''
from promptlang.compiler import prompt

def shout(x):
    return x.upper()

@prompt(params={"tag": 3, "count": 2})
def misc(tag, count: int, extra=None, docs=()):
    tag
    " items: "
    count
    42
    None
    if docs:
        "Documents:\\n"
    for d in docs:
        f"- {d}\\n"
    try:
        f"count={len(docs)}"
    except Exception:
        pass
    if not docs:
        return
    extra
    shout(tag)
'''


WHITESPACE = r"""
from promptlang.compiler import prompt

@prompt
def spaces(flag: bool):
    '''Doc.'''
    "a\tb" "c\n"
    r"raw\n"
    f"{{braces}}"
    '''One line.'''
    '''
        indented block
          deeper

        after blank
    '''
    if flag:
        '''first line
        second line
        '''
    "\n\n  trailing  \n  "
    "<![CDATA[ ]]> & < >"
"""


CORPUS = {
    "branches": (BRANCHES, "travel", st.fixed_dictionaries({
        "city": st.sampled_from(["tokyo", "paris", "rome", "oslo"]), "days": bounded(3),
        "budget": st.booleans(), "question": free_text})),
    "match": (MATCH, "pick", st.fixed_dictionaries({
        "item": st.one_of(st.sampled_from(["a", "b", "c", (), (1, 2), {"k": 1}, {"j": 2}]),
                          st.integers(-5, 20)),
        "n": st.integers(0, 99)})),
    "calls": (CALLS, "letter", st.fixed_dictionaries({
        "to": bounded(4), "formal": st.booleans(), "body": free_text})),
    "chat": (CHAT, "chat", st.fixed_dictionaries({
        "history": st.lists(st.tuples(free_text, free_text), max_size=3),
        "question": free_text, "persona": st.sampled_from(["Pirate", "plain"])})),
    "values": (VALUES, "misc", st.fixed_dictionaries({
        "tag": bounded(3), "count": st.integers(0, 99),
        "extra": st.one_of(st.none(), free_text), "docs": st.lists(free_text, max_size=3)})),
    "whitespace": (WHITESPACE, "spaces", st.fixed_dictionaries({"flag": st.booleans()})),
}


@pytest.mark.parametrize("case", sorted(CORPUS))
def test_rendered_prompt_equals_plain_python_rendering(case):
    source, name, arguments = CORPUS[case]
    module = load(source)
    oracle = oracle_module(source, TOKENIZER)
    function = getattr(module, name)
    schema = parse_schema(function.schema_pml())
    assert schema == function.schema

    @settings(max_examples=40, deadline=None, database=None)
    @given(arguments)
    def check(kwargs):
        result = function(**kwargs)
        assert parse_prompt(result.prompt_pml()) == result.doc
        assert result.render(TOKENIZER) == oracle["_oracle_render"](oracle[name], **kwargs)

    check()


def test_methods_render_like_plain_python():
    module = load(METHODS)
    oracle = oracle_module(METHODS, TOKENIZER)

    @settings(max_examples=20, deadline=None, database=None)
    @given(bounded(4), st.booleans())
    def check(name, verbose):
        result = module.Agent(name).intro(verbose)
        expected = oracle["_oracle_render"](oracle["Agent"](name).intro, verbose)
        assert result.render(TOKENIZER) == expected

    check()
