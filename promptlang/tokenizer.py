"""What the PML layer needs from a tokenizer, and a deterministic one for tests.

The layout and the binder only ever see this protocol. `hf_tokenizer.py` wraps a
Hugging Face tokenizer (and derives chat-role text from its jinja2 template);
`WordTokenizer` is a tiny stand-in whose token counts can be worked out by hand.
"""

from __future__ import annotations

import re
import zlib
from typing import Protocol, Sequence, runtime_checkable


@runtime_checkable
class Tokenizer(Protocol):
    """The tokenizer interface of the PML layer (no torch, no model)."""

    @property
    def fingerprint(self) -> str:
        """Identifies vocabulary and normalisation; layouts and cache keys depend on it."""

    @property
    def max_positions(self) -> int | None:
        """The model's context length in positions, when known."""

    @property
    def placeholder_id(self) -> int:
        """Filler token encoded in parameter slots that have no `scaffold=` text."""

    @property
    def prefix_ids(self) -> tuple[int, ...]:
        """Tokens the model expects at position 0 of every sequence (a BOS), possibly none."""

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Tokens that end a generation."""

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, adding no special tokens of its own."""

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`."""

    def role_affixes(self, role: str) -> tuple[str, str]:
        """(prefix, suffix) text that the chat template puts around a `role` message."""


class WordTokenizer:
    """Deterministic test tokenizer: one token per word with its leading spaces.

    "Plan a trip" -> ["Plan", " a", " trip"]: 3 tokens. Role prefixes are "[user]"
    etc. (1 token each: no spaces), suffixes "[/user]". Ids are stable across
    processes (crc32), so tests can hard-code counts and positions.
    """

    _piece = re.compile(r"\s*\S+|\s+")

    def __init__(self, vocab_size: int = 1000, max_positions: int | None = 4096,
                 bos: bool = False):
        self.vocab_size = vocab_size
        self._max_positions = max_positions
        self._bos = bos
        self._text_of: dict[int, str] = {0: "<pad>", 1: "<bos>", 2: "<eos>"}

    @property
    def fingerprint(self) -> str:
        return f"word-tokenizer-v1-{self.vocab_size}-{int(self._bos)}"

    @property
    def max_positions(self) -> int | None:
        return self._max_positions

    @property
    def placeholder_id(self) -> int:
        return 0

    @property
    def prefix_ids(self) -> tuple[int, ...]:
        return (1,) if self._bos else ()

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return (2,)

    def encode(self, text: str) -> list[int]:
        ids = []
        for piece in self._piece.findall(text):
            token = 3 + zlib.crc32(piece.encode()) % (self.vocab_size - 3)
            self._text_of.setdefault(token, piece)
            ids.append(token)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self._text_of.get(int(i), "<unk>") for i in ids)

    def role_affixes(self, role: str) -> tuple[str, str]:
        return f"[{role}]", f"[/{role}]"
