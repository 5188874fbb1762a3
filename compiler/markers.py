"""The names a @prompt function uses besides plain Python: length bounds and role blocks.

    def answer(city: Annotated[str, MaxTokens(4)], question: str):
        with system():
            "You are a travel agent."
        ...

Both are markers the compiler recognises statically; at run time a role block only
works inside a @prompt function (where the compiler has replaced it).
"""

from __future__ import annotations

from dataclasses import dataclass

from promptlang.compiler.diagnostics import Diagnostic
from promptlang.compiler.source import caller_span
from promptlang.errors import CompileError, InvalidArgumentError, Span, StateError
from promptlang.pml.nodes import ROLES

MAX_TOKENS_CAP = 1 << 20     # no length bound or max_tokens above this many tokens (1,048,576)


def token_count_problem(value) -> str | None:
    """Why `value` is not a token count the compiler accepts (None when it is one): a
    whole number from 1 to MAX_TOKENS_CAP."""
    if isinstance(value, bool) or not isinstance(value, int):
        return f"a whole number of tokens, not {_short(value)}"
    if value < 1:
        return f"a positive number of tokens, not {value}"
    if value > MAX_TOKENS_CAP:
        return (f"at most {MAX_TOKENS_CAP} tokens, not {_short(value)} (no model has that "
                "much context)")
    return None


def bad_token_count(what: str, value, span: Span | None = None) -> CompileError:
    """The PL104 error for `what` (e.g. `MaxTokens`) given `value`, located at `span` or
    at the user's code that called into the compiler."""
    return CompileError([Diagnostic("PL104", f"{what} must be {token_count_problem(value)}",
                                    span or caller_span())])


def _short(value) -> str:
    text = repr(value) if not isinstance(value, int) or value.bit_length() < 64 else \
        f"a number of {value.bit_length()} bits"
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass(frozen=True)
class MaxTokens:
    """A length bound in tokens of the target tokenizer: `Annotated[str, MaxTokens(16)]`,
    from 1 to MAX_TOKENS_CAP (a CompileError located at the call otherwise)."""

    tokens: int

    def __post_init__(self):
        if token_count_problem(self.tokens) is not None:
            raise bad_token_count("MaxTokens(n)", self.tokens)


class RoleBlock:
    """What `system()` returns: a context manager the compiler rewrites in @prompt functions."""

    def __init__(self, role: str):
        self.role = role

    def __enter__(self):
        raise StateError(f"`with {self.role}():` only has a meaning directly inside a "
                         "@prompt function's body")

    def __exit__(self, *exc) -> bool:
        return False


class RoleHelper:
    """`system`, `user`, `assistant`: `with user(): ...` wraps text in that chat role."""

    def __init__(self, role: str):
        if role not in ROLES:
            raise InvalidArgumentError(f"unknown role {role!r}")
        self.role = role
        self.__name__ = self.__qualname__ = role
        self.__doc__ = f"`with {role}():` wraps the block's text in the {role} chat role."

    def __call__(self) -> RoleBlock:
        return RoleBlock(self.role)

    def __repr__(self) -> str:
        return f"promptlang.{self.role}"


system = RoleHelper("system")
user = RoleHelper("user")
assistant = RoleHelper("assistant")
