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

from promptlang.errors import PromptLangError
from promptlang.pml.nodes import ROLES


@dataclass(frozen=True)
class MaxTokens:
    """A length bound in tokens of the target tokenizer: `Annotated[str, MaxTokens(16)]`."""

    tokens: int

    def __post_init__(self):
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or self.tokens < 1:
            raise PromptLangError(f"MaxTokens needs a positive whole number of tokens, "
                                  f"not {self.tokens!r}")


class RoleBlock:
    """What `system()` returns: a context manager the compiler rewrites in @prompt functions."""

    def __init__(self, role: str):
        self.role = role

    def __enter__(self):
        raise PromptLangError(f"`with {self.role}():` only has a meaning directly inside a "
                              "@prompt function's body")

    def __exit__(self, *exc) -> bool:
        return False


class RoleHelper:
    """`system`, `user`, `assistant`: `with user(): ...` wraps text in that chat role."""

    def __init__(self, role: str):
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}")
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
