"""`Prompt`: what calling a @prompt function returns.

It holds the function's schema (what may be reused), the PML prompt of this call
(which modules it imports, with which arguments, and its uncached text) and the
call's arguments. The runtime runs it (`llm.generate(prompt)` reads `.schema` and
`.doc`); `render` shows the plain text a model would see.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

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
        """The request this prompt makes against its schema's layout."""
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
