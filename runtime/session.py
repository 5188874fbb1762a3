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
- `generate` decodes with `sampling.Decoding` and keeps the KV of the tokens that make
  up the returned text: an end-of-sequence token and the text of a stop string are
  not part of the conversation (a stop string inside a token leaves that token's text
  before the stop, re-tokenized).
- `select` scores every option in ONE forward pass (each option attends to the
  conversation and to its own earlier tokens, all starting at the same position),
  keeps the winner's KV and drops the others.
- `fork` copies the live slice of the KV buffer (cheap next to recomputing it; a CPU
  memcpy of 46 KB per token for the default model) into a buffer of its own.

A session is not thread-safe; `close()` (or `with`) gives its buffer back to the
engine's pool, as does garbage collection.
"""

from __future__ import annotations

import collections
import time
import weakref
from dataclasses import dataclass
from typing import Literal, Sequence

import torch

from promptlang.errors import ContextLengthError, PromptLangError, RoleError
from promptlang.pml.nodes import ROLES
from promptlang.runtime.engine import Timings
from promptlang.runtime.sampling import Decoding, SamplingParams, sequence_logprob

_REPLACEMENT = "\ufffd"
_KEPT_LOGITS = 8           # logits kept per decode step, for rolling back to a stop string


@dataclass(frozen=True)
class Opening:
    """What opening the session cost: the prompt's cached and computed tokens."""

    cached_tokens: int           # served from cached modules
    prefill_tokens: int          # computed (the prompt's uncached tokens)
    timings: Timings             # bind, retrieve, encode, assemble, prefill, total


@dataclass(frozen=True)
class Choice:
    """The outcome of `select`: every option's score and the winner.

    `scores[i]` is the total log-probability of option i's tokens (a sum over its
    tokens); `mean_scores[i]` that sum divided by its token count. The winner maximises
    the one named by `normalise`; ties go to the first option."""

    text: str
    index: int
    options: tuple[str, ...]
    scores: tuple[float, ...]
    mean_scores: tuple[float, ...]
    token_counts: tuple[int, ...]
    normalise: Literal["sum", "mean"]


@dataclass(frozen=True)
class Turn:
    """One `generate` or `select` on a session.

    prefill_tokens: tokens queued since the previous turn (new text, role markers),
        computed in one pass before the first decoded token; earlier turns' tokens are
        never computed again.
    generated_tokens: tokens the turn itself added to the KV (the kept generated tokens,
        or the chosen option).
    forward_tokens: every token the turn ran through the model (prefill, decode steps,
        all options of a select, a stop string's re-tokenized remainder).
    timings: prefill, first_token (from the call to the first picked token or to the
        select's decision) and total, in seconds.
    """

    kind: Literal["generate", "select"]
    name: str | None
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None          # "stop", "eos", "length"; None for select
    prefill_tokens: int
    generated_tokens: int
    forward_tokens: int
    timings: Timings
    choice: Choice | None = None
    started_at: float = 0.0            # time.perf_counter() when the turn was called


@dataclass
class _Piece:
    kind: Literal["text", "affix", "tokens"]   # text joins with its neighbours; an affix
    text: str                                  # or token ids stand alone (an affix's ids
                                               # are the template's: control ids allowed)
    token_ids: tuple[int, ...] = ()


@dataclass
class _Counters:
    tokens: int = 0                    # tokens computed by flushes since the last turn
    seconds: float = 0.0


class Session:
    """A bound prompt's KV plus a growing tail of computed tokens (see the module doc)."""

    def __init__(self, llm, prompt, *, schema=None, baseline: bool = False,
                 add_generation_prompt: bool = False, room: int = 256, recompute=None):
        opened = llm.open(prompt, schema=schema, baseline=baseline, room=room,
                          add_generation_prompt=add_generation_prompt, recompute=recompute)
        self._setup(llm, prompt, opened.bound, baseline, opened.buffer)
        self.position = opened.position
        self.logits = opened.logits
        self.opening = Opening(opened.cached_tokens, opened.prefill_tokens, opened.timings)
        self.role = _open_role(opened.bound)
        self.static_text = opened.bound.render()

    def _setup(self, llm, prompt, bound, baseline: bool, buffer) -> None:
        self.llm = llm
        self.prompt = prompt
        self.bound = bound
        self.baseline = baseline
        self.buffer = buffer
        self.turns: list[Turn] = []
        self._pending: list[_Piece] = []
        self._log: list[_Piece] = []             # everything after the prompt, for replay
        self._since = _Counters()
        self._release = weakref.finalize(self, llm.assembler.release, buffer)

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
            raise PromptLangError("this session is closed")

    # --- adding text ---------------------------------------------------------------------

    def append(self, text: str) -> "Session":
        """Queue `text` (computed with the next generate/select/flush)."""
        self._check_open()
        if not isinstance(text, str):
            raise PromptLangError(f"a session appends text, not {type(text).__name__}")
        if text:
            self._queue(_Piece("text", text))
        return self

    def append_tokens(self, token_ids: Sequence[int]) -> "Session":
        """Queue token ids as they are (no tokenization, control ids included: ids from a
        trusted source, e.g. another session's tokens; text goes through `append`)."""
        self._check_open()
        ids = tuple(int(t) for t in token_ids)
        vocab = self.llm.adapter.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise PromptLangError(f"token ids must be in [0, {vocab})")
        if ids:
            self._queue(_Piece("tokens", self.llm.tokenizer.decode(ids), ids))
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

    def _queue(self, piece: _Piece) -> None:
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
        self._log.append(_Piece("tokens", "".join(p.text for p in self._pending), tuple(ids)))
        self._pending.clear()
        if not ids:
            return 0
        mark = time.perf_counter()
        self.logits = self._forward(ids)[-1]
        self._since.tokens += len(ids)
        self._since.seconds += time.perf_counter() - mark
        return len(ids)

    def _token_ids(self, pieces: Sequence[_Piece]) -> list[int]:
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

    @torch.inference_mode()
    def _forward(self, ids: Sequence[int], positions: Sequence[int] | None = None,
                 allowed: torch.Tensor | None = None, all_rows: bool = False) -> torch.Tensor:
        """Run `ids` against the session's KV and keep their KV; returns logits [R, V]
        (every row, or the last). Default positions continue after the last token;
        `allowed` as in ModelAdapter.forward (None: causal, all past visible)."""
        n = len(ids)
        if positions is None:
            positions = range(self.position, self.position + n)
        limit = self.llm.max_positions
        top = max(positions) + 1
        if limit is not None and top > limit:
            raise ContextLengthError(f"the session needs {top} positions; the model has {limit}")
        buffer = self.buffer
        if buffer.length + n > buffer.capacity:
            buffer.reserve(max(buffer.length + n, int(buffer.capacity * 1.5) + 1))
        device = self.llm.adapter.device
        ids_t = torch.tensor(list(ids), dtype=torch.int64, device=device)
        pos_t = torch.tensor(list(positions), dtype=torch.int64, device=device)
        rows = torch.arange(n, device=device) if all_rows else torch.tensor([n - 1],
                                                                           device=device)
        step = self.llm.adapter.forward(ids_t, pos_t, buffer.past(), allowed, rows)
        buffer.append(ids_t, pos_t)
        self.position = max(self.position, top)
        return step.logits

    def _truncate(self, length: int, position: int) -> None:
        """Drop the KV of every token from slot `length` on."""
        self.buffer.forget_from(length)
        self.buffer.length = length
        self.position = position

    def _start_turn(self) -> tuple[float, float, int]:
        """Flush the queue; returns (started, prefill seconds, prefill tokens) and resets
        the per-turn counters."""
        started = time.perf_counter()
        self.flush()
        since, self._since = self._since, _Counters()
        return started, since.seconds, since.tokens

    # --- generating -----------------------------------------------------------------------

    def generate(self, max_new_tokens: int = 256, *, stop: str | Sequence[str] = (),
                 temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                 seed: int | None = None, name: str | None = None) -> Turn:
        """Decode a continuation and keep it in the session (see the module doc)."""
        self._check_open()
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                                top_p=top_p, top_k=top_k, seed=seed, stop=stop)
        started, prefill_seconds, prefill_tokens = self._start_turn()
        base_length, base_position, base_logits = self.length, self.position, self.logits
        decoding = Decoding(params, self.llm.tokenizer)
        limit = self.llm.max_positions
        recent: collections.deque = collections.deque(maxlen=_KEPT_LOGITS)   # (count, logits)
        logits, forwarded, first_token = base_logits, 0, None
        while True:
            if limit is not None and self.position >= limit:   # no position for a token
                decoding.finish("length")
                break
            token, _, finished = decoding.step(logits)
            if first_token is None:
                first_token = time.perf_counter() - started
            if finished:
                break
            logits = self._forward([token])[-1]
            forwarded += 1
            recent.append((forwarded, logits))
        text, ids, reason = decoding.result()
        kept, settled = self._keep(text, ids, forwarded, base_length, base_position,
                                   base_logits, recent)
        self._log.append(_Piece("tokens", text, tuple(kept)))
        turn = Turn("generate", name, text, tuple(kept), reason, prefill_tokens, len(kept),
                    prefill_tokens + forwarded + settled,
                    Timings(prefill=prefill_seconds, first_token=first_token or 0.0,
                            total=time.perf_counter() - started), started_at=started)
        self.turns.append(turn)
        return turn

    def _keep(self, text: str, ids: list[int], forwarded: int, base_length: int,
              base_position: int, base_logits: torch.Tensor, recent) -> tuple[list[int], int]:
        """Make the KV after `base_length` hold exactly `text`: the longest run of generated
        tokens that decodes to a prefix of it, plus the rest of it re-tokenized. Returns
        the kept token ids and how many tokens this had to compute."""
        decode = self.llm.tokenizer.decode
        count, prefix = 0, ""
        for k in range(len(ids), 0, -1):
            candidate = decode(ids[:k])
            if text.startswith(candidate) and not candidate.endswith(_REPLACEMENT):
                count, prefix = k, candidate
                break
        computed = 0
        if count <= forwarded:
            kept_logits = base_logits if count == 0 else dict(recent).get(count)
            if kept_logits is None:           # too far back: recompute the last kept token
                self._truncate(base_length + count - 1, base_position + count - 1)
                kept_logits = self._forward(ids[count - 1:count])[-1]
                computed += 1
            else:
                self._truncate(base_length + count, base_position + count)
            self.logits = kept_logits
        else:                                 # the last picked token is kept: compute it
            self.logits = self._forward(ids[forwarded:count])[-1]
            computed += count - forwarded
        kept = list(ids[:count])
        rest = text[len(prefix):]
        if rest:
            rest_ids = self.llm.tokenizer.encode(rest)
            self.logits = self._forward(rest_ids)[-1]
            computed += len(rest_ids)
            kept += rest_ids
        return kept, computed

    def assistant_gen(self, max_new_tokens: int = 256, **options) -> Turn:
        """The assistant's reply as one message: open the assistant role (unless it is
        open), generate, close the role. Options as for `generate`."""
        if self.role != "assistant":
            self.open_role("assistant")
        turn = self.generate(max_new_tokens, **options)
        self.close_role("assistant")
        return turn

    @torch.inference_mode()
    def select(self, options: Sequence[str], *, name: str | None = None,
               normalise: Literal["sum", "mean"] = "sum") -> Choice:
        """Append the option the model finds most likely (exact, not sampled).

        Scores: the total log-probability of each option's tokens (tokenized on their
        own) given the session so far, and the per-token average; `normalise` picks
        which one decides (default "sum": the option's probability). All options run in
        one forward pass; the winner's KV is kept."""
        self._check_open()
        options = tuple(options)
        if not options or len(set(options)) != len(options) or \
                any(not isinstance(o, str) or not o for o in options):
            raise PromptLangError(f"select needs distinct non-empty option strings: {options!r}")
        if normalise not in ("sum", "mean"):
            raise PromptLangError(f"normalise is 'sum' or 'mean', not {normalise!r}")
        encoded = [self.llm.tokenizer.encode(o) for o in options]
        if any(not e for e in encoded):
            raise PromptLangError(f"an option of {options!r} has no tokens")
        started, prefill_seconds, prefill_tokens = self._start_turn()
        base_length, base_position, context = self.length, self.position, self.logits
        starts, ids, positions = [], [], []
        for e in encoded:
            starts.append(len(ids))
            ids += e
            positions += range(base_position, base_position + len(e))
        q = len(ids)
        # allowed: [Q, S + Q]: the whole past, and the option's own earlier tokens
        allowed = torch.zeros(q, base_length + q, dtype=torch.bool,
                              device=self.llm.adapter.device)
        allowed[:, :base_length] = True
        for start, e in zip(starts, encoded):
            block = slice(base_length + start, base_length + start + len(e))
            allowed[start:start + len(e), block] = torch.ones(len(e), len(e),
                                                              dtype=torch.bool).tril()
        logits = self._forward(ids, positions, allowed, all_rows=True)         # [Q, V]
        sums, means = [], []
        for start, e in zip(starts, encoded):
            predictions = torch.cat([context[None], logits[start:start + len(e) - 1]])
            total = sequence_logprob(predictions, e)
            sums.append(total)
            means.append(total / len(e))
        decisive = sums if normalise == "sum" else means
        index = max(range(len(options)), key=lambda i: (decisive[i], -i))
        decided = time.perf_counter() - started
        start, n = starts[index], len(encoded[index])
        self._keep_slot_range(base_length + start, base_length, n)
        self._truncate(base_length + n, base_position + n)
        self.logits = logits[start + n - 1]
        choice = Choice(options[index], index, options, tuple(sums), tuple(means),
                        tuple(len(e) for e in encoded), normalise)
        self._log.append(_Piece("tokens", options[index], tuple(encoded[index])))
        self.turns.append(Turn("select", name, options[index], tuple(encoded[index]), None,
                               prefill_tokens, n, prefill_tokens + q,
                               Timings(prefill=prefill_seconds, first_token=decided,
                                       total=time.perf_counter() - started), choice,
                               started_at=started))
        return choice

    def _keep_slot_range(self, source: int, target: int, n: int) -> None:
        """Move the KV of slots [source, source + n) to [target, target + n)."""
        if source == target:
            return
        b = self.buffer
        for tensor in (b.keys, b.values):       # [L, H_kv, C, D]
            tensor[:, :, target:target + n] = tensor[:, :, source:source + n].clone()
        for tensor in (b.positions, b.token_ids):
            tensor[target:target + n] = tensor[source:source + n].clone()

    # --- branching --------------------------------------------------------------------------

    def fork(self) -> "Session":
        """A new session with this one's state: queued text is computed first (once, for
        both), then the live KV slice is copied into a buffer of the fork's own."""
        self.flush()
        n = self.buffer.length
        buffer = self.llm.assembler.acquire(max(self.buffer.capacity, n + 1))
        with torch.inference_mode():
            for name in ("keys", "values"):
                getattr(buffer, name)[:, :, :n] = getattr(self.buffer, name)[:, :, :n]
            for name in ("positions", "token_ids"):
                getattr(buffer, name)[:n] = getattr(self.buffer, name)[:n]
        buffer.length = n
        buffer.held = list(self.buffer.held)
        other = object.__new__(Session)
        other._setup(self.llm, self.prompt, self.bound, self.baseline, buffer)
        other.position, other.logits, other.opening = self.position, self.logits, self.opening
        other.role, other.static_text = self.role, self.static_text
        other.turns = list(self.turns)
        other._log = list(self._log)
        other._since = _Counters()        # what was computed so far, this session computed
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


def _affix(tokenizer, role: str, which: int) -> _Piece:
    """The queued prefix (`which` 0) or suffix (1) of `role`, with the template's ids."""
    return _Piece("affix", tokenizer.role_affixes(role)[which],
                  tokenizer.role_affix_ids(role)[which])


def _open_role(bound) -> str | None:
    """The role a bound prompt leaves open (its last role marker opens one), if any."""
    role = None
    for segment, _ in bound.segments():
        if segment.role is not None:
            role = None if segment.role.startswith("/") else segment.role
    return role
