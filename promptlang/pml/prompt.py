"""`Prompt`: a schema and one PML prompt against it, with the arguments that made it.

What calling a @prompt function returns (the compiler builds it), and what an agent
or any other caller can build from PML nodes alone. The runtime runs it
(`llm.generate(prompt)` reads `.schema` and `.doc`); `bind` lays the schema out for
a tokenizer and binds the prompt to it; `render` shows the plain text a model would see.
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
    function: str                  # what made it: a @prompt function's qualified name
    schema: nodes.Schema
    doc: nodes.PromptDoc
    arguments: Mapping[str, Any]   # the call's arguments by parameter name, defaults applied

    def bind(self, tokenizer: Tokenizer) -> BoundPrompt:
        """The request this prompt makes against its schema's layout."""
        self.check(tokenizer)
        return bind(self.doc, lay_out(self.schema, tokenizer), tokenizer)

    def check(self, tokenizer: Tokenizer) -> None:
        """Raise before binding what the maker of this prompt can locate better than the
        layout can (the compiler's prompts locate a bound in Python source); nothing here."""

    def render(self, tokenizer: Tokenizer) -> str:
        """The plain text of this prompt, as the model would see it without caching."""
        return self.bind(tokenizer).render()

    def schema_pml(self) -> str:
        return write(self.schema)

    def prompt_pml(self) -> str:
        return write(self.doc)

    def __repr__(self) -> str:
        return f"<Prompt of {self.function}: {self.prompt_pml()}>"
