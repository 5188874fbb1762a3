"""`Prompt`: what calling a @prompt function returns.

It holds the function's schema (what may be reused), the PML prompt of this call
(which modules it imports, with which arguments, and its uncached text) and the
call's arguments. The runtime runs it (`llm.generate(prompt)` reads `.schema` and
`.doc`); `render` shows the plain text a model would see.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from promptlang.compiler.diagnostics import CompileError, Diagnostic
from promptlang.pml import nodes
from promptlang.pml.binding import BoundPrompt, bind
from promptlang.pml.layout import lay_out
from promptlang.pml.writer import write
from promptlang.tokenizer import Tokenizer


@dataclass(frozen=True)
class Prompt:
    function: str                  # the @prompt function's qualified name
    schema: nodes.Schema
    doc: nodes.PromptDoc
    arguments: Mapping[str, Any]   # the call's arguments by parameter name, defaults applied

    def bind(self, tokenizer: Tokenizer) -> BoundPrompt:
        """The request this prompt makes against its schema's layout. A length bound
        longer than the tokenizer's model context is a PL104 error at its hole."""
        check_bounds(self.schema, tokenizer.max_positions)
        return bind(self.doc, lay_out(self.schema, tokenizer), tokenizer)

    def render(self, tokenizer: Tokenizer) -> str:
        """The plain text of this prompt, as the model would see it without caching."""
        return self.bind(tokenizer).render()

    def schema_pml(self) -> str:
        return write(self.schema)

    def prompt_pml(self) -> str:
        return write(self.doc)

    def __repr__(self) -> str:
        return f"<Prompt of {self.function}: {self.prompt_pml()}>"


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
