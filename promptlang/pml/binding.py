"""Binding: a prompt against its schema's layout -> what one request computes.

A bound prompt lists the cached units to serve (the root always; each imported
module, or a scaffold's joint unit when all of its modules are imported) and
the uncached segments computed per request, each at its layout position:
arguments in their parameter slots (a shorter argument leaves a gap), the own
tokens of imported `cache="false"` modules, and the prompt's text after the
schema's end.

Visibility (DESIGN.md): a cached token attends to its own unit and its context
units at positions <= its own; an uncached token attends to every request token
(cached tokens of `units` except parameter placeholders, and uncached tokens)
whose position is <= its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from promptlang.pml import nodes
from promptlang.pml.layout import ModulePath, SchemaLayout, Segment
from promptlang.tokenizer import Tokenizer


@dataclass(frozen=True)
class BoundPrompt:
    layout: SchemaLayout
    prompt: nodes.PromptDoc
    modules: tuple[ModulePath, ...]   # imported modules, document order, root first
    units: tuple[str, ...]            # cached unit ids served from the store, position order
    uncached: tuple[Segment, ...]     # computed per request, position order
    end: int                          # one past the request's last position

    def sequence(self) -> list[tuple[int, int, str]]:
        """(token id, position, origin) of every token the model sees, position order,
        placeholders excluded. origin is a unit id, or "uncached"."""
        raise NotImplementedError("being written")

    def token_ids(self) -> list[int]:
        """The request's tokens in position order (the baseline's input)."""
        return [t for t, _, _ in self.sequence()]

    def render(self) -> str:
        """The plain text the model would see without caching."""
        raise NotImplementedError("being written")


def bind(prompt: nodes.PromptDoc, layout: SchemaLayout, tokenizer: Tokenizer) -> BoundPrompt:
    """Validate `prompt` against `layout` and compute the request's pieces."""
    raise NotImplementedError("being written")
