"""@prompt as a decorator: forms, metadata, methods, closures, the Prompt it returns, and
names that are the same in every process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from promptlang.compiler import MaxTokens, Prompt, PromptFunction, prompt, system
from promptlang.errors import PromptLangError
from promptlang.tokenizer import WordTokenizer

from .support import load

TOKENIZER = WordTokenizer()
DEMO = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "compile_demo.py")


def test_bare_and_configured_forms_keep_name_docstring_and_signature():
    module = load('''
        from promptlang import prompt

        @prompt
        def bare(x):
            """Bare form."""
            "text"

        @prompt(name="configured", params={"x": 2})
        def configured(x, *, y="default"):
            """Configured form."""
            x
        ''', "app_forms")
    for function, doc in ((module.bare, "Bare form."), (module.configured, "Configured form.")):
        assert isinstance(function, PromptFunction)
        assert function.__doc__ == doc
        assert function.__wrapped__.__name__ == function.__name__
    assert module.bare.__name__ == "bare" and module.configured.__qualname__ == "configured"
    result = module.configured("hi")
    assert isinstance(result, Prompt)
    assert dict(result.arguments) == {"x": "hi", "y": "default"}
    assert result.schema is module.configured.schema
    assert result.schema_pml() == ('<schema name="configured"><module name="configured">'
                                   '<param name="x" len="2"/></module></schema>')
    assert result.prompt_pml() == '<prompt schema="configured"><configured x="hi"/></prompt>'
    with pytest.raises(TypeError):
        module.configured()            # Python's own argument checking


def test_methods_static_and_class_methods_private_names_and_super():
    module = load('''
        from promptlang import prompt

        class Base:
            @prompt
            def tone(self):
                """Doc."""
                "plain"

        class Agent(Base):
            __secret = "s3"

            def __init__(self, name):
                self.__name = name

            @prompt(params={"self.__name": 2, "self.__secret": 1})
            def intro(self, loud: bool):
                """Doc."""
                f"I am {self.__name} ({self.__secret})."
                if loud:
                    "!"
                parent = super().tone
                _ = parent

            @staticmethod
            @prompt
            def static(x):
                """Doc."""
                if x:
                    "static"

            @classmethod
            @prompt
            def klass(cls):
                """Doc."""
                f"{cls.__name__}"
        ''', "app_methods_forms")
    agent = module.Agent("Al")
    assert agent.intro(True).render(TOKENIZER) == "I am Al (s3).!"
    assert module.Agent.static(1).render(TOKENIZER) == "static"
    assert module.Agent.klass().render(TOKENIZER) == "Agent"


def test_closures_see_the_enclosing_variables_as_they_are_at_call_time():
    module = load('''
        from promptlang import prompt

        def make():
            greeting = "Hello"

            @prompt
            def greet(name):
                """Doc."""
                if greeting == "Hello":
                    "Hello "
                else:
                    "Bye "
                name

            def change():
                nonlocal greeting
                greeting = "Bye"
            return greet, change
        ''', "app_closures")
    greet, change = module.make()
    assert greet("Ann").render(TOKENIZER) == "Hello Ann"
    change()
    assert greet("Ann").render(TOKENIZER) == "Bye Ann"


def test_callees_may_be_defined_after_their_caller_and_defaults_are_the_originals():
    module = load('''
        from promptlang import prompt

        SEEN = []

        @prompt
        def caller(items=SEEN):
            """Doc."""
            callee()
            items.append(1)

        @prompt
        def callee():
            """Doc."""
            "from the callee"
        ''', "app_late")
    module.caller()
    assert module.SEEN == [1]
    assert module.caller().render(TOKENIZER) == "from the callee"


def test_print_is_allowed_and_unresolvable_prompt_calls_run_uncached():
    module = load('''
        from promptlang import prompt

        @prompt
        def part(x):
            """Doc."""
            "part "
            if x:
                "x"

        PARTS = {"p": part}

        @prompt
        def whole(key, flag):
            """Doc."""
            print("building", key)
            "whole "
            PARTS[key](flag)
        ''', "app_dynamic_calls")
    result = module.whole("p", True)
    assert result.prompt_pml() == ('<prompt schema="app_dynamic_calls.whole"><whole/>part x'
                                   '</prompt>')
    assert result.render(TOKENIZER) == "whole part x"


def test_role_helpers_only_work_inside_prompt_functions():
    with pytest.raises(PromptLangError):
        with system():
            pass


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "3"])
def test_max_tokens_needs_a_positive_whole_number(value):
    with pytest.raises(PromptLangError):
        MaxTokens(value)


def test_prompt_refuses_what_is_not_a_plain_function():
    with pytest.raises(TypeError):
        prompt(staticmethod(lambda: None))
    with pytest.raises(TypeError):
        prompt(len)
    with pytest.raises(TypeError):
        prompt(name="")(lambda: None)


def test_schemas_are_identical_across_processes_and_hash_seeds():
    script = ("import runpy, sys; sys.path.insert(0, 'examples'); import compile_demo as d; "
              "print(d.support.schema_pml()); "
              "print(d.support('router', 'pro', 'Ada', 'Hi?').prompt_pml())")
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    outputs = [subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True,
                              text=True, check=True, env={**os.environ, "PYTHONHASHSEED": seed}
                              ).stdout for seed in ("1", "2")]
    assert outputs[0] == outputs[1]
    assert outputs[0].startswith('<schema name="demo.support">')


def test_the_real_command_line_runs_the_compiler_commands(capsys):
    from promptlang.cli import main

    assert main(["check", DEMO]) == 0
    assert "no errors" in capsys.readouterr().out


def test_bounds_in_string_annotations_are_read():
    module = load('''
        from __future__ import annotations
        from typing import Annotated
        from promptlang import prompt, MaxTokens

        @prompt
        def f(name: Annotated[str, MaxTokens(3)]):
            """Doc."""
            f"Hi {name}."
        ''', "app_future")
    assert module.f.schema_pml() == ('<schema name="app_future.f"><module name="f">Hi '
                                     '<param name="name" len="3"/>.</module></schema>')
