"""Decoding policy: which token comes next, when to stop, and what text to stream.

Everything here is pure: no model, no cache. The decode loop in `decode.py` feeds
one logits vector per step into a `Decoding` and forwards the text deltas it returns:

    decoding = Decoding(params, tokenizer)
    while True:
        token, delta, finished = decoding.step(logits)   # logits: [V]
        ...                                              # stream `delta`
        if finished:
            break
        logits = next_logits(token)
    text, token_ids, finish_reason = decoding.result()

The pieces are usable alone: `Sampler` (greedy / temperature, top-k, top-p),
`StopChecker` (eos, stop tokens, stop strings spanning tokens, max tokens),
`IncrementalDetokenizer` (text deltas that never split a UTF-8 character) and
`sequence_logprob` (scoring a fixed continuation, for `select`).
"""

from __future__ import annotations

import dataclasses
import math
import operator
import secrets
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, Sequence

import torch

from promptlang.errors import InvalidArgumentError
from promptlang.tokenizer import Tokenizer

FinishReason = Literal["stop", "eos", "length"]

_REPLACEMENT = "\ufffd"  # what a decoder writes for bytes that are not (yet) a whole character


def _fail(message: str) -> InvalidArgumentError:
    return InvalidArgumentError(message)


def _as_int(value, name: str) -> int:
    if isinstance(value, bool):
        raise _fail(f"{name} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise _fail(f"{name} must be an integer, got {value!r}") from None


def _as_float(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise _fail(f"{name} must be finite, got {value!r}")
    return value


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop: every option of a generation, in one place.

    `LLM.generate(**options)` and `Session.generate(**options)` take these fields as
    keyword arguments (`options_to_params`), so a new option is a new field here.

    temperature 0 means greedy (top_p and top_k are then ignored); top_k 0 means no
    top-k cut; top_p 1 means no nucleus cut. `seed` makes sampling reproducible; None
    draws a fresh one per request. `stop` strings and `stop_token_ids` end generation
    with finish reason "stop"; neither appears in the returned text. A single string
    is accepted for `stop`, and lists for both tuples. `draft` > 0 turns on speculative
    decoding with up to `draft` prompt-lookup tokens verified per model pass
    (decode.py): faster when the answer copies from the prompt, never a different token.
    """

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    draft: int = 0
    # structured generation (runtime/decoding/constrain.py): at most one of these
    regex: str | None = None         # the output matches this regular expression
    json_schema: Any = None          # a JSON Schema: a dict, its JSON text, or a pydantic model
    grammar: str | None = None       # a Lark grammar (llguidance's dialect)
    token_healing: bool = True       # give a prompt ending mid-word its last token back

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        max_new_tokens = _as_int(self.max_new_tokens, "max_new_tokens")
        if max_new_tokens < 1:
            raise _fail(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        set_("max_new_tokens", max_new_tokens)

        temperature = _as_float(self.temperature, "temperature")
        if temperature < 0:
            raise _fail(f"temperature must be >= 0 (0 means greedy), got {temperature}")
        set_("temperature", temperature)

        top_p = _as_float(self.top_p, "top_p")
        if not 0 < top_p <= 1:
            raise _fail(f"top_p must be in (0, 1], got {top_p}")
        set_("top_p", top_p)

        top_k = _as_int(self.top_k, "top_k")
        if top_k < 0:
            raise _fail(f"top_k must be >= 0 (0 means no top-k cut), got {top_k}")
        set_("top_k", top_k)

        if self.seed is not None:
            seed = _as_int(self.seed, "seed")
            if not 0 <= seed < 2**64:
                raise _fail(f"seed must be in [0, 2**64), got {seed}")
            set_("seed", seed)

        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (tuple, list)):
            raise _fail(f"stop must be a string or a tuple of strings, got {self.stop!r}")
        for s in stop:
            if not isinstance(s, str) or not s:
                raise _fail(f"stop strings must be non-empty strings, got {s!r}")
        set_("stop", tuple(stop))

        if not isinstance(self.stop_token_ids, (tuple, list)):
            raise _fail(f"stop_token_ids must be a tuple of token ids, got {self.stop_token_ids!r}")
        ids = tuple(_as_int(i, "stop_token_ids entries") for i in self.stop_token_ids)
        if any(i < 0 for i in ids):
            raise _fail(f"stop_token_ids must be >= 0, got {ids}")
        set_("stop_token_ids", ids)

        draft = _as_int(self.draft, "draft")
        if draft < 0:
            raise _fail(f"draft must be >= 0 (0 means no drafting), got {draft}")
        set_("draft", draft)

        given = [n for n in ("regex", "json_schema", "grammar") if getattr(self, n) is not None]
        if len(given) > 1:
            raise _fail(f"give at most one of regex, json_schema and grammar, not "
                        f"{' and '.join(given)}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise _fail(f"{name} must be a non-empty string, got {value!r}")
        if self.json_schema is not None:
            set_("json_schema", schema_text(self.json_schema))

    @property
    def constrained(self) -> bool:
        return any(getattr(self, n) is not None for n in ("regex", "json_schema", "grammar"))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def schema_text(schema: Any) -> str:
    """A JSON Schema as JSON text, from a dict, JSON text, a JSON Schema file (a path:
    pathlib.Path, os.PathLike), or a pydantic model class (its `model_json_schema()`); key
    order is kept (an object's properties come out in it)."""
    import json
    import os

    where = "json_schema"
    if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
        schema = schema.model_json_schema()
    if isinstance(schema, os.PathLike):
        from promptlang.inputs import read_text

        where = os.fspath(schema)
        schema = read_text(schema)
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as error:
            raise _fail(f"{where}:{error.lineno}:{error.colno}: not valid JSON: "
                        f"{error.msg}") from None
    if not isinstance(schema, dict):
        raise _fail("json_schema must be a dict, JSON text of an object, a JSON Schema file "
                    f"(a path) or a pydantic model class, got {type(schema).__name__}")
    try:
        return json.dumps(schema)            # key order kept: properties come out in it
    except (TypeError, ValueError) as error:
        raise _fail(f"json_schema cannot be written as JSON: {error}") from None


def options_to_params(params: SamplingParams | None = None, **options) -> SamplingParams:
    """`params` (default: the defaults) with the keyword `options` that a generate() call
    got applied on top; a name that is no field of SamplingParams is a TypeError."""
    if params is None:
        return SamplingParams(**options)
    if not isinstance(params, SamplingParams):
        raise _fail(f"sampling must be a SamplingParams, got {type(params).__name__}")
    return dataclasses.replace(params, **options) if options else params


class Sampler:
    """Picks the next token from one logits vector, following `SamplingParams`.

    Sampling draws from a `torch.Generator` on the logits' device, seeded from
    `params.seed` (or, when None, from a fresh random seed kept in `self.seed`), so a
    seeded request replays exactly on the same device and torch version.
    """

    def __init__(self, params: SamplingParams):
        self.params = params
        self.seed = params.seed if params.seed is not None else secrets.randbits(63)
        self._generators: dict[torch.device, torch.Generator] = {}

    def pick(self, logits: torch.Tensor) -> int:
        # logits: [V], any float dtype, any device
        if logits.dim() != 1 or logits.shape[0] == 0:
            raise _fail(f"pick() takes one logits vector [V], got shape {tuple(logits.shape)}")
        logits = logits.to(torch.float32)
        if self.params.greedy:
            token = int(torch.argmax(logits))  # ties: the first maximal index, the lowest id
            _check_usable(float(logits[token]))
            return token
        return self._sample(logits)

    def _sample(self, logits: torch.Tensor) -> int:
        top = float(logits.max())
        _check_usable(top)
        if top == math.inf:  # only the +inf tokens can win; softmax would give NaN
            logits = torch.where(logits == math.inf, 0.0, -math.inf)
        # Shift before scaling so a tiny temperature cannot overflow to inf; in float64, so
        # a temperature below float32's smallest number does not become 0 (0 / 0: NaN).
        logits = (logits.double() - logits.max()) / self.params.temperature
        top_k = self.params.top_k
        top_p = self.params.top_p
        if not top_k and top_p >= 1.0:
            probs = torch.softmax(logits, dim=-1)
            return int(torch.multinomial(probs, 1, generator=self._generator(logits.device)))

        # Stable descending sort: among equal logits the lower id ranks first.
        sorted_logits, order = torch.sort(logits, descending=True, stable=True)
        if top_k:
            sorted_logits, order = sorted_logits[:top_k], order[:top_k]
        probs = torch.softmax(sorted_logits, dim=-1)
        if top_p < 1.0:
            mass_before = torch.cumsum(probs, dim=-1) - probs
            # Smallest prefix whose mass reaches top_p; the first token always stays.
            probs = torch.where(mass_before < top_p, probs, 0.0)
        choice = torch.multinomial(probs, 1, generator=self._generator(logits.device))
        return int(order[choice])

    def _generator(self, device: torch.device) -> torch.Generator:
        generator = self._generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            generator.manual_seed(self.seed)
            self._generators[device] = generator
        return generator


def _check_usable(best_logit: float) -> None:
    if math.isnan(best_logit) or best_logit == -math.inf:
        raise _fail(f"cannot pick a token: the logits are all -inf or contain NaN "
                    f"(best logit {best_logit})")


@dataclass(frozen=True)
class Stop:
    """Why generation ends and where the output text ends (`text[:end]`)."""

    reason: FinishReason
    end: int
    trigger: str | int | None = None  # the stop string or token id that matched


class StopChecker:
    """Decides when generation ends, fed each new token id and the text so far.

    `update(token_id, text)` takes the decoded text of every generated token including
    `token_id`. An eos or stop token ends generation with its own text left out; a stop
    string ends it at the string's first occurrence, even when the string spans tokens;
    `max_new_tokens` tokens end it with reason "length". Precedence on one token: the
    token itself (eos, stop token), then stop strings, then length.
    """

    def __init__(self, stop_strings: Sequence[str] = (), eos_ids: Sequence[int] = (),
                 stop_token_ids: Sequence[int] = (), max_new_tokens: int | None = None):
        self.stop_strings = tuple(stop_strings)
        if any(not s for s in self.stop_strings):
            raise _fail("stop strings must be non-empty")
        self.eos_ids = frozenset(int(i) for i in eos_ids)
        self.stop_token_ids = frozenset(int(i) for i in stop_token_ids)
        self.max_new_tokens = max_new_tokens
        self.count = 0
        self._previous_length = 0  # text length before the latest token
        self._searched = 0         # no stop string starts within text[:_searched - len(s) + 1]

    def update(self, token_id: int, text: str) -> Stop | None:
        token_id = int(token_id)
        self.count += 1
        previous_length, self._previous_length = self._previous_length, len(text)
        if token_id in self.eos_ids:
            return Stop("eos", previous_length, token_id)
        if token_id in self.stop_token_ids:
            return Stop("stop", previous_length, token_id)
        found = self._find(text)
        if found is not None:
            return found
        if self.max_new_tokens is not None and self.count >= self.max_new_tokens:
            return Stop("length", len(text))
        return None

    def _find(self, text: str) -> Stop | None:
        best: Stop | None = None
        for s in self.stop_strings:
            at = text.find(s, max(0, self._searched - len(s) + 1))
            if at != -1 and (best is None or at < best.end):
                best = Stop("stop", at, s)
        # Text ending in U+FFFD may still change there (a character split across tokens).
        self._searched = len(text.rstrip(_REPLACEMENT))
        return best

    def holdback(self, text: str) -> int:
        """Length of the longest suffix of `text` that could begin a stop string:
        text that must not be streamed yet."""
        longest = 0
        for s in self.stop_strings:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest


class IncrementalDetokenizer:
    """Turns token ids, fed one by one, into streamable text deltas.

    `push(token_id)` returns the new text that is safe to show: decoded text ending in
    U+FFFD (a character whose bytes are still arriving) is held back. `finish(end)`
    returns the rest, so the deltas always concatenate to `tokenizer.decode(ids)`
    (cut at `end`). To hold back text for stop strings as well, use `add` and
    `release(end)` with `StopChecker`, as `Decoding` does.

    Each step decodes all ids so far: exact for every tokenizer whose decode of a longer
    sequence extends that of a shorter one, at O(n) per token, small beside a model step.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.text = ""      # tokenizer.decode(token_ids)
        self.emitted = ""   # concatenation of every delta returned so far
        self.finished = False

    @property
    def stable_text(self) -> str:
        """The text without its trailing U+FFFD run (bytes of a character still to come)."""
        return self.text.rstrip(_REPLACEMENT)

    def add(self, token_id: int) -> str:
        """Add one token without releasing text; returns the whole decoded text."""
        if self.finished:
            raise _fail("this detokenizer has finished; start a new one")
        self.token_ids.append(int(token_id))
        self.text = self.tokenizer.decode(self.token_ids)
        return self.text

    def release(self, end: int | None = None) -> str:
        """The not yet emitted part of `stable_text[:end]`."""
        stable = self.stable_text
        end = len(stable) if end is None else min(end, len(stable))
        return self._emit(stable, end)

    def push(self, token_id: int) -> str:
        self.add(token_id)
        return self.release()

    def finish(self, end: int | None = None) -> str:
        """The rest of `text[:end]`, partial characters included; no more tokens after."""
        self.finished = True
        return self._emit(self.text, len(self.text) if end is None else end)

    def _emit(self, text: str, end: int) -> str:
        # A tokenizer whose decode rewrites text already shown cannot be streamed exactly;
        # hold everything back rather than show text that contradicts what was shown.
        if end <= len(self.emitted) or not text.startswith(self.emitted):
            return ""
        delta = text[len(self.emitted):end]
        self.emitted += delta
        return delta


class DecodeResult(NamedTuple):
    text: str
    token_ids: list[int]
    finish_reason: FinishReason


class Decoding:
    """One request's decode state: sampler, stop checker and detokenizer together.

    `step(logits)` picks a token and returns `(token_id, text_delta, finished)`; the
    deltas concatenate to `result().text`, which excludes eos/stop tokens' text and any
    stop string. `result().token_ids` holds every picked token, the final eos or stop
    token included.
    """

    def __init__(self, params: SamplingParams, tokenizer: Tokenizer):
        self.params = params
        self.sampler = Sampler(params)
        self.stops = StopChecker(params.stop, tokenizer.eos_ids, params.stop_token_ids,
                                 params.max_new_tokens)
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.finish_reason: FinishReason | None = None
        self._end = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def token_ids(self) -> list[int]:
        return self.detokenizer.token_ids

    def step(self, logits: torch.Tensor) -> tuple[int, str, bool]:
        # logits: [V], the model's prediction for the next token
        if self.finished:
            raise _fail("step() after generation finished")
        token = self.sampler.pick(logits)
        text = self.detokenizer.add(token)
        stop = self.stops.update(token, text)
        if stop is not None:
            return token, self._finish(stop.reason, stop.end), True
        stable = self.detokenizer.stable_text
        return token, self.detokenizer.release(len(stable) - self.stops.holdback(stable)), False

    def finish(self, reason: FinishReason = "length") -> str:
        """End early (e.g. the context is full); returns the last text delta."""
        if self.finished:
            raise _fail("finish() after generation finished")
        if reason not in ("stop", "eos", "length"):
            raise _fail(f"finish reason must be 'stop', 'eos' or 'length', got {reason!r}")
        return self._finish(reason, len(self.detokenizer.text))

    def _finish(self, reason: FinishReason, end: int) -> str:
        self.finish_reason = reason
        self._end = end
        return self.detokenizer.finish(end)

    def result(self) -> DecodeResult:
        if not self.finished:
            raise _fail("result() before generation finished")
        return DecodeResult(self.detokenizer.text[:self._end], list(self.token_ids),
                            self.finish_reason)


def sequence_logprob(logits: torch.Tensor, targets: torch.Tensor | Sequence[int]) -> float:
    """Sum over t of log_softmax(logits[t])[targets[t]]: the log-probability of a
    continuation, where logits[t] is the model's prediction for targets[t]."""
    # logits: [T, V]; targets: [T]
    targets = torch.as_tensor(targets, dtype=torch.long, device=logits.device)
    if logits.dim() != 2 or targets.dim() != 1 or logits.shape[0] != targets.shape[0]:
        raise _fail(f"sequence_logprob needs logits [T, V] and targets [T], got "
                    f"{tuple(logits.shape)} and {tuple(targets.shape)}")
    if targets.numel() == 0:
        return 0.0
    if int(targets.min()) < 0 or int(targets.max()) >= logits.shape[1]:
        raise _fail(f"targets must be token ids in [0, {logits.shape[1]})")
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)
    return float(logprobs.gather(1, targets[:, None]).to(torch.float64).sum())
