"""What a request hands back: timings, results, and the records of session turns.

The engine (engine.py) and sessions (session.py) both return these; keeping them here
lets each import the other's types without importing the other module.

    LLM.generate  -> Result (or a TextStream whose .result is one)
    LLM.prefill   -> Prefilled (logits and KV copied out of the request buffer)
    LLM.open      -> Opened (the prefilled request; the caller keeps its buffer)
    Session       -> Opening, then a Turn per generate/select (Choice for a select)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Literal

import torch

from promptlang.runtime.kv.plan import NO_RECOMPUTE, RecomputePlan

if TYPE_CHECKING:
    from promptlang.pml.binding import BoundPrompt
    from promptlang.runtime.kv.assembler import KVBuffer
    from promptlang.runtime.kv.tails import TailUse


@dataclass
class Timings:
    """Seconds spent in each phase of one request. `encode` is the part of `retrieve`
    spent encoding units the store lacked; `select` is choosing the tokens to recompute
    (a deviation policy's pass); `first_token` runs from the call to the first picked
    token; `total` to the end."""

    bind: float = 0.0
    retrieve: float = 0.0
    assemble: float = 0.0
    prefill: float = 0.0
    first_token: float = 0.0
    total: float = 0.0
    encode: float = 0.0
    select: float = 0.0

    def __str__(self) -> str:
        parts = [f"{name} {getattr(self, name) * 1000:.1f} ms" for name in
                 ("bind", "retrieve", "encode", "select", "assemble", "prefill", "first_token",
                  "total")]
        return " | ".join(parts)


@dataclass(kw_only=True)
class Result:
    text: str
    token_ids: list[int]
    finish_reason: str
    timings: Timings
    prefill_tokens: int          # tokens computed by the prefill pass
    cached_tokens: int           # tokens served from cached units
    recomputed_tokens: int = 0   # cached tokens computed again (the recompute policy)
    exact_units: int = 0         # units served from exact entries (recompute/exact.py)
    renumbered: bool = False     # at contiguous positions, not the layout's (contiguous.py)
    # cached tokens served as encoded apart although they missed request tokens before them
    # (0: the prefill is the full prefill's, up to rounding; docs/RECOMPUTE.md)
    approximate_tokens: int = 0
    # under regex=, json_schema= or grammar=: whether the text is a whole output of it
    # (False: max_new_tokens or the context ended it first); None without a constraint
    complete: bool | None = None
    # the request's cached units by where they came from: "device", "host", "disk" (store
    # tiers) or "encoded" (no tier held them)
    units: dict[str, int] = field(default_factory=dict)
    primed_units: int = 0        # modules served primed ("P+primed": recompute/primer.py)
    # of cached_tokens: the opening of the request's last uncached run served from an
    # earlier request's (prompt tails seen before: runtime/kv/tails.py)
    tail_tokens: int = 0


@dataclass(kw_only=True)
class Opened:
    """A prefilled request and its KV buffer (`LLM.open`; what generate and a Session
    decode from). Whoever holds it gives the buffer back with
    `llm.assembler.release(opened.buffer)`."""

    buffer: KVBuffer
    logits: torch.Tensor | None  # [V]: the prediction for `position` (None while pending)
    position: int                # the first position after the request
    bound: BoundPrompt           # what was bound
    timings: Timings
    prefill_tokens: int          # tokens the prefill pass computed
    cached_tokens: int           # tokens served from cached units
    recomputed_tokens: int = 0
    started: float = 0.0         # time.perf_counter() when the request was made
    recompute: RecomputePlan = NO_RECOMPUTE   # the cached tokens computed again
    exact: tuple[str, ...] = ()  # units served from exact entries (recompute/exact.py)
    renumbered: bool = False     # as Result.renumbered
    approximate_tokens: int = 0  # as Result.approximate_tokens
    healed: str = ""             # the prompt's last token's text, given back (healing.py)
    pending: PendingPrefill | None = None     # a prefill left to the caller (logits None)
    units: dict[str, int] = field(default_factory=dict)   # as Result.units
    primed: tuple[str, ...] = ()  # units served primed (recompute/primer.py)
    tail: "TailUse | None" = None  # its prompt tail (runtime/kv/tails.py), kept at the end
    model: object = None           # what its later passes run on: a SeamModel under policy
                                   # tuned (runtime/model/seam.py); None: the engine's adapter

    @property
    def tail_tokens(self) -> int:
        """As Result.tail_tokens."""
        return 0 if self.tail is None else self.tail.length


@dataclass
class PendingPrefill:
    """An open request's prefill pass, left to run inside a batch (`LLM.start(defer=...)`):
    the tokens to compute at their positions against the request buffer (positions increase;
    each token sees the buffer's keys at positions <= its own and the tokens before it), and
    `finish(logits)` to call with the last token's logits [V] once their KV is appended;
    `bf16`: the side its request decided (runtime/model/compute.py): it runs there, so a
    twin-side prefill never joins the float32 batch."""

    token_ids: list[int]
    positions: list[int]
    finish: Callable[[torch.Tensor], None]
    bf16: bool = False           # its request's prompt passes run on the bfloat16 twin


@dataclass(kw_only=True)
class Prefilled:
    """A prefill's outputs, copied out of the request buffer (for tests and benchmarks).
    Token order: the assembled cached tokens, then the prefilled ones."""

    logits: torch.Tensor         # [R, V]: every prefilled token's, or the last one's
    keys: torch.Tensor           # [L, H_kv, N, D]
    values: torch.Tensor         # [L, H_kv, N, D]
    positions: torch.Tensor      # [N]
    token_ids: torch.Tensor      # [N]
    cached_length: int           # the first cached_length tokens came from the store
    timings: Timings
    bound: BoundPrompt | None = None   # what was bound
    recompute: RecomputePlan = NO_RECOMPUTE   # the cached tokens computed again
    exact: tuple[str, ...] = ()  # units served from exact entries (recompute/exact.py)
    renumbered: bool = False     # as Result.renumbered
    approximate_tokens: int = 0  # as Result.approximate_tokens
    parallel: frozenset[int] = frozenset()   # APE's context positions (policy "ape"; else none)
    primed: tuple[str, ...] = ()  # units served primed (recompute/primer.py)

    @property
    def exact_units(self) -> int:
        return len(self.exact)


@dataclass(frozen=True)
class Opening:
    """What opening a session cost: the prompt's cached and computed tokens."""

    cached_tokens: int           # served from cached modules
    prefill_tokens: int          # computed (the prompt's uncached and recomputed tokens)
    timings: Timings             # bind, retrieve, encode, assemble, prefill, total
    recomputed_tokens: int = 0   # cached tokens computed again (the recompute policy)
    approximate_tokens: int = 0  # as Result.approximate_tokens (0: the full prefill's KV)


@dataclass(frozen=True)
class Choice:
    """The outcome of `Session.select`: every option's score and the winner.

    `scores[i]` is the total log-probability of option i's tokens (a sum over its
    tokens); `mean_scores[i]` that sum divided by its token count. The winner maximises
    the one named by `normalise`; ties go to the first option. With normalise "grammar"
    the option was decoded greedily under a grammar of the options: no scores (empty)."""

    text: str
    index: int
    options: tuple[str, ...]
    scores: tuple[float, ...]
    mean_scores: tuple[float, ...]
    token_counts: tuple[int, ...]
    normalise: Literal["sum", "mean", "grammar"]


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
    complete: bool | None = None       # as Result.complete (regex=, json_schema=, grammar=)
    healed: str = ""                   # appended text given back by token healing: token_ids
                                       # spell it, then `text` (runtime/decoding/healing.py)
