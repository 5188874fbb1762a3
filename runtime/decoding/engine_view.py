"""What a decode, a session or an agent needs from the engine, as a typed interface.

`runtime/engine.py`'s `LLM` is the one implementation. The classes that decode on an engine
(`open_decode.Generation`, `conversation.session.Session`, `conversation.agent.Agent`)
depend on this Protocol, not on the engine's fields, so the engine is free to change how it
stores its assembler, tails or store.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from promptlang.runtime.decoding.results import Opened
    from promptlang.runtime.kv.assembler import KVBuffer
    from promptlang.runtime.model import ModelAdapter


class EngineView(Protocol):
    """The engine as its decoders see it."""

    @property
    def tokenizer(self):
        """The model's tokenizer (promptlang.tokenizer.Tokenizer)."""

    @property
    def adapter(self) -> "ModelAdapter":
        """The model, behind the one interface that knows transformers."""

    @property
    def max_positions(self) -> int | None:
        """The most positions a request may use (None: no limit)."""

    def open(self, prompt, *, schema=None, baseline: bool = False, room: int = 256,
             add_generation_prompt: bool = False, recompute=None) -> "Opened":
        """Bind, retrieve, assemble and prefill `prompt`; the caller keeps its buffer."""

    def acquire_buffer(self, capacity: int) -> "KVBuffer":
        """A request buffer from the engine's pool with room for `capacity` tokens."""

    def release_buffer(self, buffer: "KVBuffer") -> None:
        """Give a request buffer back to the pool."""

    def finish(self, opened: "Opened") -> None:
        """The end of an opened request's decoding: its prompt tail is kept with the decoded
        tokens (runtime/kv/tails.py) and its buffer goes back to the pool."""
