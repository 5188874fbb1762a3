"""Sessions: a conversation that keeps its KV, so each turn computes only its new tokens.

    session = llm.session(persona("friendly"))       # cached modules, assembled and prefilled
    session.user("Hi! Who are you?")                  # queued: nothing computed yet
    turn = session.assistant_gen(max_new_tokens=64)   # new tokens prefilled in one pass, decode
    turn.text, turn.prefill_tokens                    # the reply; tokens this turn computed
    other = session.fork()                            # a branch that shares everything so far

A session starts from a bound prompt exactly as `LLM.generate` does (`LLM.open`: bind,
retrieve, assemble, prefill) and owns the request's KV buffer from then on. Everything
added later goes at increasing positions after the request's end (`bound.end`, or the
token count for a baseline session), attending to every token before it:

- `append(text)`, role markers (`open_role`, `close_role`, `user(text)`, ...) are queued
  and computed together, in one forward pass, when a result is needed (`generate`,
  `select`, `fork`, `flush`). Text runs are tokenized as the binder tokenizes a prompt:
  consecutive text joined, each role's prefix and suffix on their own, so a session
  that appends a prompt's uncached text computes the very tokens the prompt would.
  Only the role affixes hold control tokens: appended text, `select` options and the
  re-tokenized end of a generation are plain text ("<|im_start|>" in them is not a
  turn), as in a prompt.
- `generate` runs the decode loop (decode.py; sampling options as for `LLM.generate`)
  and keeps the KV of the tokens that make up the returned text: an end-of-sequence token
  and the text of a stop string are not part of the conversation (a stop string inside a
  token leaves that token's text before the stop, re-tokenized).
- `select` scores every option in ONE forward pass (each option attends to the
  conversation and to its own earlier tokens, all starting at the same position),
  keeps the winner's KV and drops the others.
- `fork` copies the live slice of the KV buffer (cheap next to recomputing it; a CPU
  memcpy of 46 KB per token for the default model) into a buffer of its own.

A session is not thread-safe; `close()` (or `with`) gives its buffer back to the
engine's pool, as does garbage collection.
"""

from __future__ import annotations

import dataclasses
import json
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Sequence

import torch

from promptlang.errors import (ContextLengthError, InternalError, InvalidArgumentError,
                               InvalidArgumentTypeError, RoleError, StateError)
from promptlang.pml.nodes import ROLES
from promptlang.runtime.decoding.constrain import Constraint, forced_drafts
from promptlang.runtime.decoding.decode import Decoder
from promptlang.runtime.decoding.engine_view import EngineView
from promptlang.runtime.decoding.healing import Healing, healable
from promptlang.runtime.passes.prefill import move_slots, prefill, truncate
from promptlang.runtime.decoding.results import Choice, Opening, Timings, Turn
from promptlang.runtime.decoding.options import option_scores, pack_options
from promptlang.runtime.decoding.sampling import Decoding, SamplingParams, options_to_params

if TYPE_CHECKING:
    from promptlang.pml.binding import BoundPrompt
    from promptlang.runtime.kv.assembler import KVBuffer

_REPLACEMENT = "\ufffd"
_KEPT_LOGITS = 8           # logits kept per decode step, for rolling back to a stop string
SCORED_TOKENS = 1024       # select scores options of at most this many tokens in all exactly


@dataclass
class _QueuedInput:
    kind: Literal["text", "affix", "tokens"]   # text joins with its neighbours; an affix
    text: str                                  # or token ids stand alone (an affix's ids
                                               # are the template's: control ids allowed)
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True, kw_only=True)
class _Start:
    """Where a session starts: its prompt's KV buffer and the state after its prefill."""

    bound: "BoundPrompt"
    buffer: "KVBuffer"                 # the buffer the session keeps
    position: int                      # the first position after what the buffer holds
    logits: torch.Tensor               # [V]: the prediction for `position`
    opening: Opening
    role: str | None                   # the role the prompt leaves open
    static_text: str                   # the prompt's text
    model: object = None               # what its passes run on (Opened.model; None: the
                                       # engine's adapter)


@dataclass
class _Counters:
    tokens: int = 0                    # tokens computed by flushes since the last turn
    seconds: float = 0.0


class Session:
    """A bound prompt's KV plus a growing tail of computed tokens (see the module doc)."""

    def __init__(self, llm: EngineView, prompt, *, schema=None, baseline: bool = False,
                 add_generation_prompt: bool = False, room: int = 256, recompute=None,
                 start: _Start | None = None):
        """`start`: the state to continue from instead of opening `prompt` (fork's)."""
        if start is None:
            opened = llm.open(prompt, schema=schema, baseline=baseline, room=room,
                              add_generation_prompt=add_generation_prompt, recompute=recompute)
            opening = Opening(opened.cached_tokens, opened.prefill_tokens, opened.timings,
                              opened.recomputed_tokens, opened.approximate_tokens)
            start = _Start(bound=opened.bound,
                           buffer=opened.buffer,
                           position=opened.position,
                           logits=opened.logits,
                           opening=opening,
                           role=_open_role(opened.bound),
                           static_text=opened.bound.render(),
                           model=opened.model)
        self.llm = llm
        self.model = llm.adapter if start.model is None else start.model
        self.prompt = prompt
        self.bound = start.bound
        self.baseline = baseline
        self.buffer = start.buffer
        self.position = start.position
        self.logits = start.logits
        self.opening = start.opening
        self.role = start.role
        self.static_text = start.static_text
        self.turns: list[Turn] = []
        self._pending: list[_QueuedInput] = []
        self._log: list[_QueuedInput] = []             # everything after the prompt, for replay
        self._since = _Counters()
        self._release = weakref.finalize(self, llm.release_buffer, start.buffer)

    # --- state ---------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return not self._release.alive

    @property
    def length(self) -> int:
        """Tokens whose KV the session holds (queued text not included)."""
        return self._closed_length if self.closed else self.buffer.length

    @property
    def pending(self) -> bool:
        """Whether text is queued and not computed yet."""
        return bool(self._pending)

    @property
    def text(self) -> str:
        """Everything the model has seen or will see: the prompt, then each turn."""
        return self.static_text + "".join(p.text for p in self._log)

    def tokens(self) -> list[tuple[int, int]]:
        """(token id, position) of every token in the KV, position order."""
        self._check_open()         # a closed session's buffer may serve another request
        n = self.buffer.length
        pairs = zip(self.buffer.token_ids[:n].tolist(), self.buffer.positions[:n].tolist())
        return sorted(pairs, key=lambda pair: pair[1])

    def close(self) -> None:
        """Give the KV buffer back to the engine's pool; the session is unusable after
        (its `text`, `turns`, `opening` and `length` stay readable)."""
        if not self.closed:
            self._closed_length = self.buffer.length
            self._release()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self.closed:
            raise StateError("this session is closed")

    # --- adding text ---------------------------------------------------------------------

    def append(self, text: str) -> "Session":
        """Queue `text` (computed with the next generate/select/flush)."""
        self._check_open()
        if not isinstance(text, str):
            raise InvalidArgumentTypeError(f"a session appends text, not {type(text).__name__}")
        if text:
            self._queue(_QueuedInput("text", text))
        return self

    def append_tokens(self, token_ids: Sequence[int]) -> "Session":
        """Queue token ids as they are (no tokenization, control ids included: ids from a
        trusted source, e.g. another session's tokens; text goes through `append`)."""
        self._check_open()
        ids = tuple(int(t) for t in token_ids)
        vocab = self.llm.adapter.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise InvalidArgumentError(f"token ids must be in [0, {vocab})")
        if ids:
            self._queue(_QueuedInput("tokens", self.llm.tokenizer.decode(ids), ids))
        return self

    def open_role(self, role: str) -> "Session":
        """Queue the chat template's prefix of `role`."""
        self._check_open()
        if role not in ROLES:
            raise RoleError(f"unknown role {role!r} (expected one of {', '.join(ROLES)})")
        if self.role is not None:
            raise RoleError(f"<{role}> opens while <{self.role}> is still open")
        self._queue(_affix(self.llm.tokenizer, role, 0))
        self.role = role
        return self

    def close_role(self, role: str | None = None) -> "Session":
        """Queue the suffix of the open role (`role`, when given, must be the open one)."""
        self._check_open()
        if self.role is None or (role is not None and role != self.role):
            opened = f"<{self.role}> is open" if self.role else "no role is open"
            raise RoleError(f"</{role or '?'}> closes a role that is not open ({opened})")
        self._queue(_affix(self.llm.tokenizer, self.role, 1))
        self.role = None
        return self

    def message(self, role: str, text: str) -> "Session":
        """Queue one whole message: the role's prefix, `text`, the role's suffix."""
        return self.open_role(role).append(text).close_role(role)

    def system(self, text: str) -> "Session":
        return self.message("system", text)

    def user(self, text: str) -> "Session":
        return self.message("user", text)

    def assistant(self, text: str) -> "Session":
        return self.message("assistant", text)

    def _queue(self, piece: _QueuedInput) -> None:
        self._pending.append(piece)
        self._log.append(piece)

    # --- computing ------------------------------------------------------------------------

    def flush(self) -> int:
        """Compute the queued tokens now, in one forward pass; returns how many."""
        self._check_open()
        if not self._pending:
            return 0
        ids = self._token_ids(self._pending)
        # the log keeps what was computed, so that a replay computes the very same tokens
        del self._log[-len(self._pending):]
        self._log.append(_QueuedInput("tokens", "".join(p.text for p in self._pending), tuple(ids)))
        self._pending.clear()
        if not ids:
            return 0
        mark = time.perf_counter()
        self.logits = self._forward(ids)[-1]
        self._since.tokens += len(ids)
        self._since.seconds += time.perf_counter() - mark
        return len(ids)

    def _token_ids(self, pieces: Sequence[_QueuedInput]) -> list[int]:
        """Tokens of queued pieces: consecutive text joined (plain text: no control
        ids), affixes and token ids on their own, as they are."""
        encode = self.llm.tokenizer.encode
        ids: list[int] = []
        run: list[str] = []
        for piece in pieces:
            if piece.kind == "text":
                run.append(piece.text)
                continue
            if run:
                ids += encode("".join(run))
                run.clear()
            ids += piece.token_ids
        if run:
            ids += encode("".join(run))
        return ids

    def _forward(self, ids: Sequence[int], positions: Sequence[int] | None = None,
                 groups: Sequence[int] | None = None, all_rows: bool = False) -> torch.Tensor:
        """Run `ids` against the session's KV and keep their KV; returns logits [R, V]
        (every row, or the last). Default positions continue after the last token;
        `groups` as in prefill.visibility."""
        n = len(ids)
        follows = positions is None       # right after every token held: plain causal
        if positions is None:
            positions = range(self.position, self.position + n)
        limit = self.llm.max_positions
        top = max(positions) + 1
        if limit is not None and top > limit:
            raise ContextLengthError(f"the session needs {top} positions; the model has {limit}")
        logits = prefill(self.model, self.buffer, ids, positions, all_rows,
                         groups=groups, after_past=follows)
        self.position = max(self.position, top)
        return logits

    def _start_turn(self) -> tuple[float, float, int]:
        """Flush the queue; returns (started, prefill seconds, prefill tokens) and resets
        the per-turn counters."""
        started = time.perf_counter()
        self.flush()
        since, self._since = self._since, _Counters()
        return started, since.seconds, since.tokens

    # --- generating -----------------------------------------------------------------------

    def generate(self, max_new_tokens: int | None = None, *, name: str | None = None,
                 sampling: SamplingParams | None = None, **options) -> Turn:
        """Decode a continuation and keep it in the session (see the module doc).
        max_new_tokens (default 256) and `options` (stop, temperature, top_p, top_k, seed,
        draft, ...) are the fields of SamplingParams, applied on top of `sampling`."""
        self._check_open()
        if max_new_tokens is not None:
            options["max_new_tokens"] = max_new_tokens
        params = options_to_params(sampling, **options)
        constraint = Constraint.of(params, self.llm.tokenizer)   # regex=, json_schema=, grammar=
        healed = self._heal() if params.token_healing and constraint is None else ""
        started, prefill_seconds, prefill_tokens = self._start_turn()
        decoding = Decoding(params, self.llm.tokenizer)
        decoder = Decoder(self.model, self.buffer, decoding, self.position,
                          limit=self.llm.max_positions, keep=_KEPT_LOGITS,
                          materialize=False,
                          constrain=Healing(healed, self.llm.tokenizer) if healed else constraint,
                          **forced_drafts(params, constraint))
        first_token = None
        for token, _, _ in decoder.steps(self.logits):
            if first_token is None and token is not None:
                first_token = time.perf_counter() - started
        self.position = decoder.position
        text, ids, reason = decoding.result()
        if healed and not text.startswith(healed):   # cut short while spelling it: keep it all
            text = healed
        kept, settled = self._keep(text, ids, decoder)
        self._log.append(_QueuedInput("tokens", text, tuple(kept)))
        text = text[len(healed):]                    # the answer: what follows the healed text
        turn = Turn("generate", name, text, tuple(kept), reason, prefill_tokens, len(kept),
                    prefill_tokens + decoder.computed + settled,
                    Timings(prefill=prefill_seconds, first_token=first_token or 0.0,
                            total=time.perf_counter() - started), started_at=started,
                    complete=None if constraint is None else constraint.complete, healed=healed)
        self.turns.append(turn)
        return turn

    def _heal(self) -> str:
        """Token healing (runtime/decoding/healing.py) at a generation: when the queued input ends
        with appended text whose last token could merge with what follows, that token is
        taken off the queue; returns its text (the generation spells it first), else "".
        Only text appended since the last computed token is healed, never a role marker or
        the session's prompt."""
        if not self._pending or self._pending[-1].kind != "text":
            return ""
        ids = self._token_ids(self._pending)
        joined = "".join(p.text for p in self._pending)
        healed = healable(self.llm.tokenizer, ids[-1]) if ids else None
        if not healed or not joined.endswith(healed):
            return ""
        del self._log[-len(self._pending):]
        self._pending[:] = [_QueuedInput("tokens", joined[:-len(healed)], tuple(ids[:-1]))]
        self._log.append(self._pending[0])
        return healed

    def _keep(self, text: str, ids: list[int], decoder: Decoder) -> tuple[list[int], int]:
        """Make the KV after the decode's start hold exactly `text`: the longest run of
        generated tokens that decodes to a prefix of it, plus the rest of it re-tokenized.
        Returns the kept token ids and how many tokens this had to compute."""
        decode = self.llm.tokenizer.decode
        count = 0
        prefix = ""
        for k in range(len(ids), 0, -1):
            candidate = decode(ids[:k])
            if text.startswith(candidate) and not candidate.endswith(_REPLACEMENT):
                count = k
                prefix = candidate
                break
        computed = 0
        if count <= decoder.fed:
            kept_logits = decoder.rollback(count)
            self.position = decoder.position
            if kept_logits is None:           # too far back: recompute the last kept token
                decoder.rollback(count - 1)
                self.position = decoder.position
                kept_logits = self._forward(ids[count - 1:count])[-1]
                computed += 1
            self.logits = kept_logits
        else:                                 # the last picked token is kept: compute it
            self.logits = self._forward(ids[decoder.fed:count])[-1]
            computed += count - decoder.fed
        kept = list(ids[:count])
        rest = text[len(prefix):]
        if rest:
            rest_ids = self.llm.tokenizer.encode(rest)
            self.logits = self._forward(rest_ids)[-1]
            computed += len(rest_ids)
            kept += rest_ids
        return kept, computed

    def assistant_gen(self, max_new_tokens: int | None = None, **options) -> Turn:
        """The assistant's reply as one message: open the assistant role (unless it is
        open), generate, close the role. Options as for `generate`."""
        if self.role != "assistant":
            self.open_role("assistant")
        turn = self.generate(max_new_tokens, **options)
        self.close_role("assistant")
        return turn

    @torch.inference_mode()
    def select(self, options: Sequence[str], *, name: str | None = None,
               normalise: Literal["sum", "mean", "grammar"] = "sum") -> Choice:
        """Append the option the model finds most likely (exact, not sampled).

        Scores: the total log-probability of each option's tokens (tokenized on their
        own) given the session so far, and the per-token average; `normalise` picks
        which one decides (default "sum": the option's probability). All options run in
        one forward pass; the winner's KV is kept. normalise="grammar": greedy decoding
        under a grammar of the options instead (llguidance; runtime/decoding/constrain.py), whose
        cost grows with the longest option rather than with the number of options -- also
        what a long list (more than SCORED_TOKENS option tokens in all) gets; the Choice
        says which (`normalise`)."""
        self._check_open()
        options = tuple(options)
        if not options or len(set(options)) != len(options) or \
                any(not isinstance(o, str) or not o for o in options):
            raise InvalidArgumentError(
                f"select needs distinct non-empty option strings: {options!r}")
        if normalise not in ("sum", "mean", "grammar"):
            raise InvalidArgumentError(
                f"normalise is 'sum', 'mean' or 'grammar', not {normalise!r}")
        if normalise == "grammar":
            return self._select_by_grammar(options, name)
        encoded = [self.llm.tokenizer.encode(o) for o in options]
        if any(not e for e in encoded):
            raise InvalidArgumentError(f"an option of {options!r} has no tokens")
        if sum(len(e) for e in encoded) > SCORED_TOKENS:    # one pass over them all: too big
            return self._select_by_grammar(options, name)
        started, prefill_seconds, prefill_tokens = self._start_turn()
        base_length = self.length
        base_position = self.position
        packed = pack_options(encoded, base_position)
        q = len(packed.token_ids)
        # each option sees the whole past and its own earlier tokens, all from one position
        logits = self._forward(list(packed.token_ids), list(packed.positions),
                               list(packed.groups), all_rows=True)             # [Q, V]
        sums, means = option_scores(self.logits, logits, packed, encoded)
        decisive = sums if normalise == "sum" else means
        index = max(range(len(options)), key=lambda i: (decisive[i], -i))
        decided = time.perf_counter() - started
        start = packed.starts[index]
        n = len(encoded[index])
        move_slots(self.buffer, base_length + start, base_length, n)
        truncate(self.buffer, base_length + n)
        self.position = base_position + n
        self.logits = logits[start + n - 1]
        choice = Choice(options[index], index, options, tuple(sums), tuple(means),
                        tuple(len(e) for e in encoded), normalise)
        self._log.append(_QueuedInput("tokens", options[index], tuple(encoded[index])))
        self.turns.append(Turn("select", name, options[index], tuple(encoded[index]), None,
                               prefill_tokens, n, prefill_tokens + q,
                               Timings(prefill=prefill_seconds, first_token=decided,
                                       total=time.perf_counter() - started), choice,
                               started_at=started))
        return choice

    def _select_by_grammar(self, options: tuple[str, ...], name: str | None) -> Choice:
        """select(normalise="grammar"): the options as Lark literals, decoded greedily."""
        grammar = "start: " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options)
        # a token spells at least one character: the longest option fits, then the eos
        turn = self.generate(max(len(o) for o in options) + 1, grammar=grammar, name=name,
                             temperature=0.0)
        if turn.text not in options:
            raise InternalError(f"the grammar select ended on {turn.text!r}, not an option "
                                  f"(finish: {turn.finish_reason})")
        index = options.index(turn.text)
        choice = Choice(turn.text, index, options, (), (),
                        tuple(len(self.llm.tokenizer.encode(o)) for o in options), "grammar")
        self.turns[-1] = dataclasses.replace(turn, kind="select", finish_reason=None,
                                             choice=choice)
        return choice

    # --- branching --------------------------------------------------------------------------

    def fork(self) -> "Session":
        """A new session with this one's state: queued text is computed first (once, for
        both), then the live KV slice is copied into a buffer of the fork's own."""
        self.flush()
        n = self.buffer.length
        buffer = self.llm.acquire_buffer(max(self.buffer.capacity, n + 1))
        with torch.inference_mode():
            for name in ("keys", "values"):
                getattr(buffer, name)[:, :, :n] = getattr(self.buffer, name)[:, :, :n]
            for name in ("positions", "token_ids"):
                getattr(buffer, name)[:n] = getattr(self.buffer, name)[:n]
        buffer.length = n
        buffer.held = list(self.buffer.held)
        start = _Start(bound=self.bound,
                       buffer=buffer,
                       position=self.position,
                       logits=self.logits,
                       opening=self.opening,
                       role=self.role,
                       static_text=self.static_text,
                       model=self.model)
        other = Session(self.llm, self.prompt, baseline=self.baseline, start=start)
        other.turns = list(self.turns)
        other._log = list(self._log)
        return other

    def replay(self, *, baseline: bool = False) -> "Session":
        """A fresh session on the same prompt with this one's later tokens queued (the same
        token ids, generated ones included): what the same conversation costs from
        scratch, e.g. with `baseline=True` to compare with no reuse at all."""
        other = Session(self.llm, self.prompt, baseline=baseline)
        for piece in self._log:
            other._queue(piece)
        other.role = self.role
        return other

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.length} tokens, {len(self.turns)} turns"
        return f"<Session {self.bound.prompt.schema} ({state})>"


def _affix(tokenizer, role: str, which: int) -> _QueuedInput:
    """The queued prefix (`which` 0) or suffix (1) of `role`, with the template's ids."""
    return _QueuedInput("affix", tokenizer.role_affixes(role)[which],
                  tokenizer.role_affix_ids(role)[which])


def _open_role(bound) -> str | None:
    """The role a bound prompt leaves open (its last role marker opens one), if any."""
    role = None
    for segment, _ in bound.segments():
        if segment.role is not None:
            role = None if segment.role.startswith("/") else segment.role
    return role
