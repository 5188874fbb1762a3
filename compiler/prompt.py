"""`CompiledPrompt`: the `Prompt` (promptlang/pml/prompt.py) a @prompt function call returns.

It is a PML-level Prompt whose `bind` first checks each length bound against the
model's context and reports one that does not fit as a PL104 `CompileError` at the
hole in the Python source (the schema's Param spans point there).
`promptlang.compiler.prompt.Prompt` is kept as an import path for compatibility.
"""

from __future__ import annotations

from promptlang.compiler.diagnostics import Diagnostic
from promptlang.errors import CompileError
from promptlang.pml import nodes
from promptlang.pml.prompt import Prompt
from promptlang.tokenizer import Tokenizer

__all__ = ["CompiledPrompt", "Prompt", "check_bounds"]


class CompiledPrompt(Prompt):
    """A Prompt made by the compiler: a length bound longer than the tokenizer's model
    context is a PL104 error at its hole when it is bound."""

    def check(self, tokenizer: Tokenizer) -> None:
        check_bounds(self.schema, tokenizer.max_positions)


def check_bounds(schema: nodes.Schema, limit: int | None) -> None:
    """Raise a located PL104 CompileError for each parameter that reserves more
    positions than the model has (`limit`; None: unknown, nothing to check)."""
    if limit is None:
        return
    found = [Diagnostic("PL104", f"the length bound of {p.name!r} is {p.length} tokens; the "
                                 f"model has {limit} positions in all", p.span)
             for p in _params(schema) if p.length > limit]
    if found:
        raise CompileError(found)


def _params(node):
    for child in getattr(node, "children", ()):
        if isinstance(child, nodes.Param):
            yield child
        else:
            yield from _params(child)
