"""A Hugging Face tokenizer behind the `Tokenizer` protocol of the PML layer.

The chat-role text (`<user>` -> prefix, `</user>` -> suffix) is derived from the
tokenizer's own jinja2 chat template, never hard-coded: conversations whose
contents are sentinel strings are rendered, and the text around each sentinel
is cut out (chat_template.py, `derive_role_affixes`). When a template has no such per-role
split, a plain format is used instead (`PLAIN_AFFIXES`):

    System: ...\\n\\n   User: ...\\n\\n   Assistant: ...\\n\\n

Only those affixes are tokenized with special-token strings recognised
(`role_affix_ids`). All other text goes through `encode` with transformers'
`split_special_tokens=True` (fast and slow tokenizers alike): "<|im_end|>" in an
argument is the tokens of "<", "|", "im", ... and text without such strings
tokenizes exactly as it always did. transformers applies that option by setting a
flag on the shared backend tokenizer before each call, so calls are serialised by
a lock. Added tokens that are not special (which the option leaves whole) are
broken up by cutting the text inside them; a result that still holds a control id
is refused (`ModelError`), never passed on.

transformers is imported inside functions only: `import promptlang` stays light.
"""

from __future__ import annotations

import copy
import hashlib
import json
import threading
from pathlib import Path
from typing import Any, Iterable, Sequence

from promptlang.chat_template import PLAIN_AFFIXES, derive_role_affixes
from promptlang.errors import ChatTemplateError, ModelError, RoleError
from promptlang.pml.nodes import ROLES
from promptlang.tokenizer import PreparedIds

_SANE_MAX_LENGTH = 10_000_000       # tokenizers without a limit report ~1e30


class HFTokenizer:
    """`Tokenizer` protocol around a transformers tokenizer.

    `max_positions` is the model's context length when the caller knows it (from
    the model config); otherwise the tokenizer's `model_max_length` when sane.
    `eos_ids` adds end-of-generation ids (a generation config's) to the
    tokenizer's own eos token.
    """

    def __init__(self, tokenizer: Any, *, max_positions: int | None = None,
                 eos_ids: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.name = str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)
        if max_positions is None:
            limit = getattr(tokenizer, "model_max_length", None)
            max_positions = int(limit) if limit and limit < _SANE_MAX_LENGTH else None
        self._max_positions = max_positions
        own_eos = tokenizer.eos_token_id
        self._eos_ids = _unique(([own_eos] if own_eos is not None else []) + list(eos_ids))
        self._prefix_ids = _added_prefix(tokenizer)
        self._fingerprint: str | None = None
        self._max_token_chars: int | None | bool = False     # False: not computed yet
        self._placeholder: int | None = None                  # placeholder_id, once known
        self._affixes: dict[str, tuple[str, str]] | None = None
        self._affix_ids: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        self._affix_source = ""
        self._lock = threading.Lock()           # the backend's split flag is shared state
        self._controls = _control_tokens(tokenizer)
        self._control_ids = frozenset(self._controls)
        # plain text may need the unk token (a character the vocabulary cannot spell)
        self._forbidden = self._control_ids - {tokenizer.unk_token_id}
        self.prepared: PreparedIds | None = None   # ids of long texts tokenized ahead

    @classmethod
    def from_pretrained(cls, name_or_path: str | Path, *, max_positions: int | None = None,
                        local_files_only: bool = True, **kwargs: Any) -> "HFTokenizer":
        """Load the tokenizer of a transformers model id or folder. The model's
        config and generation config are read when present, for the context
        length and the end-of-generation ids."""
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        source = str(name_or_path)
        try:
            tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=local_files_only,
                                                      **kwargs)
        except (OSError, ValueError) as err:
            raise ModelError(_not_found(source, "tokenizer", local_files_only, err)) from None
        _drop_build_copies(tokenizer)
        if max_positions is None:
            try:
                config = AutoConfig.from_pretrained(source, local_files_only=local_files_only)
            except (OSError, ValueError):
                config = None               # a tokenizer-only folder
            max_positions = context_length(config) if config is not None else None
        try:
            generation = GenerationConfig.from_pretrained(source,
                                                          local_files_only=local_files_only)
            eos_ids = _as_ids(generation.eos_token_id)
        except (OSError, ValueError):
            eos_ids = []
        return cls(tokenizer, max_positions=max_positions, eos_ids=eos_ids)

    # --- the Tokenizer protocol -------------------------------------------------------

    @property
    def fingerprint(self) -> str:
        """sha256 over the tokenizer's full definition and its chat template."""
        if self._fingerprint is None:
            digest = hashlib.sha256()
            digest.update(_definition(self.tokenizer).encode())
            digest.update(b"\0chat-template\0")
            digest.update(json.dumps(self.tokenizer.chat_template, sort_keys=True).encode())
            self._fingerprint = "hf-" + digest.hexdigest()
        return self._fingerprint

    def adopt_fingerprint(self, fingerprint: str) -> None:
        """Take `fingerprint` as this tokenizer's: one computed earlier from the same files
        (a converted model's load record), not computed again."""
        self._fingerprint = fingerprint

    @property
    def max_positions(self) -> int | None:
        return self._max_positions

    @property
    def max_token_chars(self) -> int | None:
        """The longest vocabulary entry (added tokens included) in characters, times 4
        under NFC/NFKC normalisation (a composed character stands for at most 4), for a
        fast BPE tokenizer whose normaliser and pre-tokenizer drop no characters and
        whose unknown characters are never fused into one token; None otherwise.
        Byte-level vocabularies write one character per byte, and a character is at
        least one byte, so an entry's length bounds the characters it covers."""
        if self._max_token_chars is False:
            self._max_token_chars = _max_token_chars(self.tokenizer)
        return None if self._max_token_chars is None else self._max_token_chars[0]

    @property
    def vanishing_chars(self) -> frozenset[str]:
        """Characters the tokenizer drops without a token (a byte-level vocabulary lacking
        some bytes, and no unknown token): `min_token_count` does not count them. Empty
        where `max_token_chars` is None."""
        self.max_token_chars                    # computes both
        return frozenset() if self._max_token_chars is None else self._max_token_chars[1]

    @property
    def placeholder_id(self) -> int:
        """A space where the tokenizer writes " " as one plain (non-control) token, else
        the pad, unknown or end-of-sequence token. The filler is what a module's later
        tokens see in a parameter slot: a control token there (the default model's pad is
        its end-of-turn "<|im_end|>") tells the model a message ended mid-module, and a
        space is text without meaning. Measured: docs/BENCHMARKS.md, "The placeholder
        token"."""
        if self._placeholder is None:
            space = self._tokenize(" ", split_special=True)
            if (len(space) == 1 and space[0] not in self._control_ids
                    and self.decode(space) == " "):
                self._placeholder = int(space[0])
            else:
                for candidate in (self.tokenizer.pad_token_id, self.tokenizer.unk_token_id,
                                  self.tokenizer.eos_token_id):
                    if candidate is not None:
                        self._placeholder = int(candidate)
                        break
                else:
                    raise ModelError(f"tokenizer {self.name} has no one-token space, nor a "
                                     "pad, unk or eos token to use as a placeholder")
        return self._placeholder

    @property
    def prefix_ids(self) -> tuple[int, ...]:
        return self._prefix_ids

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return self._eos_ids

    @property
    def control_ids(self) -> frozenset[int]:
        """Ids of the tokenizer's special and added tokens."""
        return self._control_ids

    def twin(self) -> "HFTokenizer":
        """A tokenizer giving the same ids with a backend of its own, so that it can run
        on another thread while this one runs (each serialises its own calls)."""
        return HFTokenizer(copy.deepcopy(self.tokenizer), max_positions=self._max_positions,
                           eos_ids=self._eos_ids)

    def encode(self, text: str) -> list[int]:
        ready = None if self.prepared is None else self.prepared.get(text)
        if ready is not None:
            return ready
        ids = self._tokenize(text, split_special=True)
        if self._forbidden.isdisjoint(ids):
            return ids
        ids = [i for piece in _cut_inside(text, self._controls.values())
               for i in self._tokenize(piece, split_special=True)]
        forged = sorted(self._forbidden.intersection(ids))
        if forged:
            raise ModelError(f"tokenizer {self.name} turns plain text into the control token "
                             f"{self._controls[forged[0]]!r} (id {forged[0]}); promptlang "
                             "refuses to pass it to the model")
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False,
                                     clean_up_tokenization_spaces=False)

    def role_affixes(self, role: str) -> tuple[str, str]:
        if role not in ROLES:
            raise RoleError(f"unknown role {role!r} (expected one of {', '.join(ROLES)})")
        return self._role_affixes()[role]

    def role_affix_ids(self, role: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
        ids = self._affix_ids.get(role)
        if ids is None:
            prefix, suffix = self.role_affixes(role)
            ids = (tuple(self._tokenize(prefix, split_special=False)),
                   tuple(self._tokenize(suffix, split_special=False)))
            self._affix_ids[role] = ids
        return ids

    def _tokenize(self, text: str, *, split_special: bool) -> list[int]:
        if not text:
            return []
        with self._lock:
            return list(self.tokenizer(text, add_special_tokens=False,
                                       split_special_tokens=split_special).input_ids)

    # --- chat template -------------------------------------------------------------

    @property
    def affix_source(self) -> str:
        """Where the role affixes come from: "chat template", "chat template (system
        rendered as user: ...)" or "plain format (...)"."""
        self._role_affixes()
        return self._affix_source

    def _role_affixes(self) -> dict[str, tuple[str, str]]:
        if self._affixes is None:
            if not self.tokenizer.chat_template:
                self._affixes = dict(PLAIN_AFFIXES)
                self._affix_source = "plain format (no chat template)"
            else:
                bos_text = self.decode(self._prefix_ids) if self._prefix_ids else ""
                self._affixes, self._affix_source = derive_role_affixes(self._render, bos_text)
        return self._affixes

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)
        if not isinstance(text, str):
            raise ChatTemplateError(f"chat template rendered {type(text).__name__}, not text")
        return text

    def __repr__(self) -> str:
        return f"HFTokenizer({self.name!r}, max_positions={self._max_positions})"


def load_tokenizer(name_or_path: str | Path | None = None) -> HFTokenizer:
    """The tokenizer of a model id or folder; None is the default model's (offline)."""
    if name_or_path is None:
        from promptlang.default_model import DEFAULT_MODEL_NAME, default_tokenizer_dir

        tokenizer = HFTokenizer.from_pretrained(default_tokenizer_dir(), local_files_only=True)
        tokenizer.name = f"{DEFAULT_MODEL_NAME} (default)"
        return tokenizer
    return HFTokenizer.from_pretrained(name_or_path)


def context_length(config: Any) -> int | None:
    """The context length a transformers model config declares, if any (ALiBi
    models such as BLOOM declare none)."""
    for attribute in ("max_position_embeddings", "n_positions", "n_ctx", "seq_length",
                      "max_sequence_length"):
        value = getattr(config, attribute, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _control_tokens(tokenizer: Any) -> dict[int, str]:
    """id -> text of every special and added token."""
    tokens = {int(i): str(token) for i, token in tokenizer.added_tokens_decoder.items()}
    tokens.update((int(i), str(t)) for i, t in zip(tokenizer.all_special_ids,
                                                  tokenizer.all_special_tokens))
    return tokens


def _cut_inside(text: str, tokens: Iterable[str]) -> list[str]:
    """`text` cut one character into every occurrence of every token string, so that
    no piece holds a whole one."""
    cuts = set()
    for token in tokens:
        at = text.find(token) if len(token) > 1 else -1
        while at >= 0:
            cuts.add(at + 1)
            at = text.find(token, at + 1)
    bounds = [0, *sorted(cuts), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:]) if a < b]


# Normalisers that never drop a character (NFD/NFKD/Lowercase only expand), and those
# that shrink text by at most a factor: canonical composition puts at most 4 code
# points (a canonical decomposition's longest) into one character.
_KEEPING_NORMALIZERS = {"NFD": 1, "NFKD": 1, "Lowercase": 1, "Prepend": 1,
                        "NFC": 4, "NFKC": 4}
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation",
                           "UnicodeScripts", "Split"}


def _normalizer_shrink(spec: Any) -> int | None:
    """How many characters of text one normalised character may stand for; None when
    the normaliser may drop characters (Strip, StripAccents, BERT's cleaning ...)."""
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind == "Sequence":
        factor = 1
        for part in spec.get("normalizers", ()):
            step = _normalizer_shrink(part)
            if step is None:
                return None
            factor *= step
        return factor
    if kind == "Replace":
        pattern = spec.get("pattern", {})
        content = spec.get("content", "")
        literal = pattern.get("String") if isinstance(pattern, dict) else None
        if isinstance(literal, str) and literal and isinstance(content, str) and content:
            return max(1, -(-len(literal) // len(content)))
        return None
    return _KEEPING_NORMALIZERS.get(kind)


def _pre_tokenizer_keeps(spec: Any) -> bool:
    """Whether the pre-tokenizer keeps every character (Whitespace, WhitespaceSplit and
    BERT's drop spaces; a Split may remove its matches)."""
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_pre_tokenizer_keeps(p) for p in spec.get("pretokenizers", ()))
    if kind == "Split" and str(spec.get("behavior", "")).lower() == "removed":
        return False
    return kind in _KEEPING_PRE_TOKENIZERS


def _byte_symbols() -> dict[int, str]:
    """The byte-level alphabet: byte -> the character a ByteLevel vocabulary spells it with
    (printable Latin-1 bytes as themselves, the other 68 as U+0100 on, in byte order)."""
    keep = set(range(33, 127)) | set(range(161, 173)) | set(range(174, 256))
    symbols = {}
    extra = 0
    for byte in range(256):
        if byte in keep:
            symbols[byte] = chr(byte)
        else:
            symbols[byte] = chr(256 + extra)
            extra += 1
    return symbols


def _byte_level(spec: Any) -> bool:
    if not spec:
        return False
    if spec.get("type") == "Sequence":
        return any(_byte_level(p) for p in spec.get("pretokenizers", ()))
    return spec.get("type") == "ByteLevel"


def _vanishing(definition: dict, model: dict) -> frozenset[str] | None:
    """The characters that produce no token at all (None: unknown, any might): with an
    unknown token or byte fallback, none; a byte-level vocabulary without them drops the
    bytes it lacks, so the ASCII characters among those vanish (a missing continuation
    byte would let longer characters vanish too: no bound then)."""
    if model.get("unk_token") is not None or model.get("byte_fallback"):
        return frozenset()
    if not _byte_level(definition.get("pre_tokenizer")):
        return None                     # any character outside the vocabulary vanishes
    vocab = model["vocab"]
    missing = [b for b, symbol in _byte_symbols().items() if symbol not in vocab]
    if any(0x80 <= b < 0xC0 for b in missing):
        return None
    return frozenset(chr(b) for b in missing if b < 0x80)


def _max_token_chars(tokenizer: Any) -> tuple[int, frozenset[str]] | None:
    """See `HFTokenizer.max_token_chars` (with the vanishing characters beside it)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None                     # a slow tokenizer: no definition to reason about
    try:
        definition = json.loads(backend.to_str())
    except (TypeError, ValueError):
        return None
    model = definition.get("model") or {}
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        return None                     # WordPiece/WordLevel/Unigram: an unk covers a word
    if model.get("dropout"):
        return None
    if model.get("unk_token") is not None and model.get("fuse_unk") \
            and not model.get("byte_fallback"):
        return None                     # a run of unknown characters becomes one token
    shrink = _normalizer_shrink(definition.get("normalizer"))
    vanishing = _vanishing(definition, model)
    if shrink is None or vanishing is None \
            or not _pre_tokenizer_keeps(definition.get("pre_tokenizer")):
        return None
    longest = max((len(entry) for entry in model["vocab"]), default=0)
    for added in definition.get("added_tokens") or ():
        longest = max(longest, len(str(added.get("content", ""))))
    return max(1, longest) * shrink, vanishing


# transformers' BPE tokenizer classes that keep the vocabulary and merges they built their
# backend from as Python objects (tens of MB for a 150k-token vocabulary) and read them
# nowhere after __init__ (the tokenizers backend holds its own)
_BUILD_COPIES = {"Qwen2Tokenizer": "transformers.models.qwen2.tokenization_qwen2",
                 "LlamaTokenizer": "transformers.models.llama.tokenization_llama",
                 "GPT2Tokenizer": "transformers.models.gpt2.tokenization_gpt2"}


def _drop_build_copies(tokenizer: Any) -> None:
    """Let go of the Python copies of the vocabulary and merges a tokenizer of _BUILD_COPIES
    keeps after building its backend."""
    kind = type(tokenizer)
    if _BUILD_COPIES.get(kind.__name__) != kind.__module__:
        return
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        return
    for name in ("_vocab", "_merges"):
        tokenizer.__dict__.pop(name, None)


def _added_prefix(tokenizer: Any) -> tuple[int, ...]:
    """The ids the tokenizer puts before the text when adding special tokens (a BOS)."""
    probe = "a"
    plain = list(tokenizer(probe, add_special_tokens=False).input_ids)
    full = list(tokenizer(probe, add_special_tokens=True).input_ids)
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return tuple(int(i) for i in full[:start])
    return ()


def _definition(tokenizer: Any) -> str:
    """The tokenizer as canonical JSON: vocabulary, merges, normalisation,
    pre-tokenisation and added tokens (not the padding/truncation settings that
    change with calls)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        definition = json.loads(backend.to_str())
        definition.pop("truncation", None)
        definition.pop("padding", None)
    else:
        definition = {"class": type(tokenizer).__name__,
                      "vocab": sorted(tokenizer.get_vocab().items()),
                      "special": tokenizer.all_special_tokens}
    return json.dumps(definition, sort_keys=True, ensure_ascii=False)


def _as_ids(value: int | Sequence[int] | None) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _unique(ids: Sequence[int]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(int(i) for i in ids))


def _not_found(source: str, what: str, local_files_only: bool, err: Exception) -> str:
    if local_files_only:
        where = ("was not found locally (promptlang does not download from the Hugging Face "
                 "hub: pass a folder that holds the model's files)")
    else:
        where = "could not be loaded"
    detail = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return f"{what} {source!r} {where}: {detail}"
