"""What the PML layer needs from a tokenizer, and a deterministic one for tests.

The layout and the binder only ever see this protocol. `hf_tokenizer.py` wraps a
Hugging Face tokenizer (and derives chat-role text from its jinja2 template);
`WordTokenizer` is a tiny stand-in whose token counts can be worked out by hand.

Two kinds of tokenization, one rule: only the role affixes (`role_affix_ids`, text
derived from the chat template) and `prefix_ids` (the tokenizer's BOS) may hold
control ids. Everything else -- schema text, `src=` documents, arguments, prompt
text, session turns, tool observations, generated text fed back -- goes through
`encode`, which splits special-token strings such as "<|im_start|>" into ordinary
tokens, so no input can forge a turn.
"""

from __future__ import annotations

import re
import threading
import zlib
from array import array
from collections import OrderedDict
from typing import Protocol, Sequence, runtime_checkable

from promptlang.errors import InvalidArgumentError


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
    def max_token_chars(self) -> int | None:
        """An upper bound on the characters of text one token of `encode` covers (the
        longest vocabulary entry's length, times what normalisation may shrink text by),
        or None where there is none. A text of n characters then needs at least
        ceil(n / max_token_chars) tokens (`min_token_count`; characters in a tokenizer's
        `vanishing_chars`, dropped without a token, not counted): the layout and the
        binder refuse text that cannot fit before they tokenize it."""

    @property
    def placeholder_id(self) -> int:
        """Filler token encoded in parameter slots that have no `scaffold=` text."""

    @property
    def prefix_ids(self) -> tuple[int, ...]:
        """Tokens the model expects at position 0 of every sequence (a BOS), possibly none."""

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Tokens that end a generation."""

    @property
    def control_ids(self) -> frozenset[int]:
        """Ids of special and added tokens: `encode` never returns one of them."""

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` as plain text: adds no special tokens, and special-token
        strings inside `text` become ordinary tokens, never `control_ids` (an unk
        token aside, for characters the vocabulary cannot spell)."""

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids` (control tokens written out as their strings)."""

    def role_affixes(self, role: str) -> tuple[str, str]:
        """(prefix, suffix) text that the chat template puts around a `role` message."""

    def role_affix_ids(self, role: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Token ids of `role_affixes(role)`, special-token strings recognised: the only
        text whose tokens may be control ids."""


class PreparedIds:
    """Token ids of long texts computed ahead, on another thread (the server tokenizes a
    request's long texts with a twin of the engine's tokenizer before queueing it, so the
    engine thread does not stall the others): a tokenizer given one (`tokenizer.prepared`)
    takes a text's ids from it instead of tokenizing it again, until the text is
    `discard`ed. Only texts of at least `MIN_CHARS` characters are kept, at most `LIMIT` of
    them (the oldest go first), their ids packed (8 bytes each)."""

    MIN_CHARS = 4096
    LIMIT = 32

    def __init__(self):
        self._ids: OrderedDict[str, array] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, text: str, ids: Sequence[int]) -> None:
        if len(text) < self.MIN_CHARS:
            return
        with self._lock:
            self._ids[text] = array("q", ids)
            while len(self._ids) > self.LIMIT:
                self._ids.popitem(last=False)

    def get(self, text: str) -> list[int] | None:
        """The ids put for `text`, or None."""
        if len(text) < self.MIN_CHARS:
            return None
        with self._lock:
            ids = self._ids.get(text)
        return None if ids is None else ids.tolist()

    def discard(self, texts: Sequence[str]) -> None:
        with self._lock:
            for text in texts:
                self._ids.pop(text, None)

    def __contains__(self, text: object) -> bool:
        return text in self._ids

    def __len__(self) -> int:
        return len(self._ids)


def min_token_count(tokenizer: Tokenizer, text: str, enough: int | None = None) -> int:
    """A cheap lower bound on `len(tokenizer.encode(text))`: ceil(n / max_token_chars)
    over the n characters of `text` that are not among the tokenizer's
    `vanishing_chars` (dropped without a token), or 1 for non-empty text when the
    tokenizer gives no bound (or predates `max_token_chars`). With `enough`, the text is
    counted a piece at a time and the count stops once the bound passes `enough` (a
    request of megabytes is known to pass a context from its first piece)."""
    if not text:
        return 0
    chars = getattr(tokenizer, "max_token_chars", None)
    if not isinstance(chars, int) or isinstance(chars, bool) or chars < 1:
        return 1
    vanishing = tuple(getattr(tokenizer, "vanishing_chars", ()))
    step = len(text) if enough is None else max(chars * (enough + 1), 1 << 16)
    n = 0
    for start in range(0, len(text), step):
        end = min(start + step, len(text))
        n += end - start - sum(text.count(c, start, end) for c in vanishing)
        if enough is not None and -(-n // chars) > enough:
            break
    return -(-n // chars)


# A letter standing for the text that follows a run: pre-tokenizers split whitespace before
# a word differently from whitespace at the end of a text (GPT-2's "\n\n" alone is one
# token, before a word two).
_NEXT_WORD = "a"
_TAIL_TRIES = 8                 # tokens dropped from the end, at most, to find the run's end
_joins_memo: dict[str, bool] = {}


def encode_run(tokenizer: Tokenizer, text: str, *, followed: bool) -> list[int]:
    """Token ids of `text`, one run of a prompt (a module's text, an argument, the text
    between them), as the whole prompt's text tokenizes those characters when `followed`
    by more text: a run ending in whitespace is tokenized with a letter after it, and the
    tokens up to the run's end kept (the rest of the run, where the letter's token took
    some of its whitespace, tokenized alone). Where no token ends exactly there, or
    nothing follows (`followed` false: the prompt's end, a control token), `encode`."""
    if not followed or not text or not text[-1].isspace():
        return tokenizer.encode(text)
    ids = tokenizer.encode(text + _NEXT_WORD)
    for keep in range(len(ids) - 1, max(len(ids) - 1 - _TAIL_TRIES, 0), -1):
        head = tokenizer.decode(ids[:keep])
        if text.startswith(head):
            rest = text[len(head):]
            return ids[:keep] + (tokenizer.encode(rest) if rest else [])
    return tokenizer.encode(text)


def joins_space_to_word(tokenizer: Tokenizer) -> bool:
    """Whether the tokenizer writes a space before a word into the word's token ("x y" is
    "x" + " y", not "x " + "y"): the layout then gives a parameter the space before it,
    so that an argument's first word is tokenized as in the whole text."""
    key = tokenizer.fingerprint
    known = _joins_memo.get(key)
    if known is None:
        whole = tokenizer.encode("x y")
        known = (whole == tokenizer.encode("x") + tokenizer.encode(" y")
                 and whole != tokenizer.encode("x ") + tokenizer.encode("y"))
        _joins_memo[key] = known
    return known


class WordTokenizer:
    """Deterministic test tokenizer: one token per word with its leading spaces.

    "Plan a trip" -> ["Plan", " a", " trip"]: 3 tokens. Role prefixes are "[user]"
    etc., suffixes "[/user]": special tokens, like "<pad>", "<bos>" and "<eos>", with
    the fixed ids 0-8 (`SPECIAL_TOKENS`). `role_affix_ids` gives them those ids;
    `encode` gives "[user]" inside text an ordinary word id, as a Hugging Face
    tokenizer splits "<|im_start|>" inside text. Word ids are stable across processes
    (crc32), so tests can hard-code counts and positions.
    """

    SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "[system]", "[/system]", "[user]",
                      "[/user]", "[assistant]", "[/assistant]")
    _piece = re.compile(r"\s*\S+|\s+")
    _special = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))

    def __init__(self, vocab_size: int = 1000, max_positions: int | None = 4096,
                 bos: bool = False):
        if vocab_size <= len(self.SPECIAL_TOKENS):
            raise InvalidArgumentError(f"vocab_size must exceed the {len(self.SPECIAL_TOKENS)} "
                                       "special tokens")
        self.vocab_size = vocab_size
        self._max_positions = max_positions
        self._bos = bos
        self._text_of: dict[int, str] = dict(enumerate(self.SPECIAL_TOKENS))
        self.prepared: PreparedIds | None = None   # ids of long texts tokenized ahead

    @property
    def fingerprint(self) -> str:
        return f"word-tokenizer-v2-{self.vocab_size}-{int(self._bos)}"

    @property
    def max_positions(self) -> int | None:
        return self._max_positions

    @property
    def max_token_chars(self) -> int | None:
        return None                     # a word (with its leading spaces) may be any length

    @property
    def placeholder_id(self) -> int:
        return 0

    @property
    def prefix_ids(self) -> tuple[int, ...]:
        return (1,) if self._bos else ()

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return (2,)

    @property
    def control_ids(self) -> frozenset[int]:
        return frozenset(range(len(self.SPECIAL_TOKENS)))

    def twin(self) -> "WordTokenizer":
        """A tokenizer giving the same ids, safe to use on another thread at once."""
        twin = WordTokenizer(self.vocab_size, self._max_positions, self._bos)
        twin._text_of = self._text_of          # one decoding table for both
        return twin

    def encode(self, text: str) -> list[int]:
        ids = None if self.prepared is None else self.prepared.get(text)
        if ids is not None:
            return ids
        words = len(self.SPECIAL_TOKENS)
        ids = []
        for piece in self._piece.findall(text):
            token = words + zlib.crc32(piece.encode()) % (self.vocab_size - words)
            self._text_of.setdefault(token, piece)
            ids.append(token)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self._text_of.get(int(i), "<unk>") for i in ids)

    def role_affixes(self, role: str) -> tuple[str, str]:
        return f"[{role}]", f"[/{role}]"

    def role_affix_ids(self, role: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
        prefix, suffix = self.role_affixes(role)
        return tuple(self._encode_control(prefix)), tuple(self._encode_control(suffix))

    def _encode_control(self, text: str) -> list[int]:
        """Special-token strings become their ids; the text between them, words."""
        ids = []
        start = 0
        for match in self._special.finditer(text):
            ids += self.encode(text[start:match.start()])
            ids.append(self.SPECIAL_TOKENS.index(match.group()))
            start = match.end()
        return ids + self.encode(text[start:])
