"""Prompt tails seen before: prefix reuse, token by token, after the last cached unit.

A request's *tail* is its run of uncached tokens after every cached one (typically the
question and the chat template's closing after a schema's modules). Its KV depends only on
what it attends to -- the served units, each at its positions -- and on its own tokens
before it. So after a request, the tail's KV is kept (`TailCache.remember`) under a digest of
the served units and the numerics that computed it; a later request with the same units and
numerics whose tail starts with the same tokens at the same positions is served that common
prefix from it and computes only the rest (`TailCache.match`). This is the prefix cache
llama.cpp and vLLM keep, applied after promptlang's modules: a new question that repeats the
previous one's opening, a retried request, or a conversation's next turn computes what is new.
A tail also keeps the logits its pass gave after its last prompt token, so a request whose
whole tail was seen before (a repeated request) computes nothing and starts from exactly the
logits the first one had: the same answer by construction, not only up to the rounding of
recomputing that token in a pass of another shape (which int8 inputs can turn into another
greedy pick).

The reused KV is copied into the request's buffer at the slots the earlier pass wrote it to
(after the assembled units), so the request's passes see the pieces the first one saw. The
reused tokens are exactly what the earlier request's pass computed for them; the new
request's own tokens then attend to them as to any cached token (the oracle: one masked pass
over the request; tests/runtime/test_tails.py). Requests that recompute cached tokens, attend
in parallel (APE), or have uncached tokens between units neither use nor leave tails.
Memory: at most `budget_bytes` of tails in all (least recently used dropped first), held on
the device of the request buffers; `LLM(tail_budget_bytes=0)` turns reuse off.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

import torch

from promptlang.errors import InvalidArgumentError
from promptlang.runtime.kv.unit import UnitKV

DEFAULT_BUDGET = 64 << 20        # bytes of tail KV kept per LLM
MIN_REUSE = 1                    # tokens a match must reuse to be served


@dataclass(frozen=True)
class Tail:
    """The KV of one request's tail ([L, H_kv, n, D]) and its tokens."""

    context: str
    token_ids: tuple[int, ...]
    positions: tuple[int, ...]
    keys: torch.Tensor
    values: torch.Tensor
    logits: dict[int, torch.Tensor] = field(default_factory=dict)   # n -> after n tokens

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.keys, self.values, *self.logits.values()))


def tail_context(unit_keys: Sequence[str], numerics: tuple) -> str:
    """The digest a tail is kept under: the served units' keys in order (a unit's key names
    its tokens, positions and encoding) and the numerics of the passes."""
    return hashlib.sha256(repr((tuple(unit_keys), numerics)).encode()).hexdigest()


def is_tail(positions: Sequence[int], cached_end: int) -> bool:
    """Whether uncached tokens at `positions` (increasing) all follow every cached token
    (`cached_end`: the highest cached position + 1)."""
    return bool(positions) and positions[0] >= cached_end and all(
        b > a for a, b in zip(positions, positions[1:]))


class TailCache:
    """Tails of recent requests, least recently used dropped first beyond `budget_bytes`."""

    def __init__(self, budget_bytes: int = DEFAULT_BUDGET):
        if budget_bytes < 0:
            raise InvalidArgumentError(f"tail_budget_bytes must be >= 0, not {budget_bytes!r}")
        self.budget_bytes = budget_bytes
        self.hits = 0                   # requests served a tail prefix
        self.reused_tokens = 0          # tokens those requests did not compute
        self._tails: OrderedDict[int, Tail] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._bytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._tails)

    def match(self, context: str, token_ids: Sequence[int], positions: Sequence[int]
              ) -> tuple[Tail | None, int]:
        """The kept tail under `context` sharing the longest prefix (ids and positions)
        with the request's, and that length: all of the request's tokens where the tail
        kept the logits after them (the request computes nothing), else at most all but the
        last (whose output the request needs). (None, 0) if none shares MIN_REUSE tokens."""
        whole = len(token_ids)
        best = None
        length = 0
        with self._lock:
            for ident, tail in self._tails.items():
                if tail.context != context:
                    continue
                n = 0
                for a, b, p, q in zip(tail.token_ids, token_ids, tail.positions, positions):
                    if a != b or p != q:
                        break
                    n += 1
                if n < whole or whole not in tail.logits:
                    n = min(n, whole - 1)
                if n > length:
                    best = tail
                    length = n
                    key = ident
            if best is None or length < MIN_REUSE:
                return None, 0
            self._tails.move_to_end(key)
            self.hits += 1
            self.reused_tokens += length
        return best, length

    def remember(self, context: str, token_ids: Sequence[int], positions: Sequence[int],
                 keys: torch.Tensor, values: torch.Tensor,
                 logits: dict[int, torch.Tensor] | None = None) -> None:
        """Keep a request's tail (`keys`, `values`: [L, H_kv, n, D]; `logits`: the
        next-token logits [V] after its first k tokens, by k; all kept as given: tensors
        nothing else writes to); kept tails it extends (a prefix of its tokens, same
        context) are dropped, their logits kept with it."""
        n = len(token_ids)
        rows = sum(t.numel() * t.element_size() for t in (logits or {}).values())
        if n == 0 or not self.fits(keys.numel() * keys.element_size() * 2 + rows):
            return
        tail = Tail(context, tuple(int(t) for t in token_ids), tuple(int(p) for p in positions),
                    keys, values, dict(logits or {}))
        with self._lock:
            for ident, old in list(self._tails.items()):
                is_prefix = (len(old.token_ids) <= n
                             and old.token_ids == tail.token_ids[:len(old.token_ids)]
                             and old.positions == tail.positions[:len(old.positions)])
                if old.context == context and is_prefix:
                    for k, row in old.logits.items():
                        tail.logits.setdefault(k, row)
                    self._bytes -= old.nbytes
                    del self._tails[ident]
            self._tails[id(tail)] = tail
            self._bytes += tail.nbytes
            while self._bytes > self.budget_bytes:
                _, old = self._tails.popitem(last=False)
                self._bytes -= old.nbytes

    def fits(self, nbytes: int) -> bool:
        """Whether a tail of `nbytes` (keys and values) may be kept."""
        return self.enabled and nbytes <= self.budget_bytes

    def clear(self) -> None:
        with self._lock:
            self._tails.clear()
            self._bytes = 0


@dataclass
class TailUse:
    """One request's tail: its tokens, the context it is kept under, and what it reuses."""

    context: str
    token_ids: list[int]
    positions: list[int]
    reused: Tail | None = None
    length: int = 0                 # tokens served from `reused`
    start: int | None = None        # buffer slot of the tail's first token (once placed)

    @property
    def logits(self) -> torch.Tensor | None:
        """The logits after the request's whole tail, where it reuses all of it (then it
        computes nothing); a copy of the kept ones. None where it computes tokens."""
        if self.reused is None or self.length < len(self.token_ids):
            return None
        return self.reused.logits[self.length].clone()

    @torch.inference_mode()          # the buffer's tensors are inference tensors
    def place(self, buffer, ids: list[int], positions: list[int]
              ) -> tuple[list[int], list[int]]:
        """Write the reused prefix's KV into `buffer` right after its assembled units --
        the slots the earlier request's pass wrote it to, so every later pass sees the
        same pieces in the same order as there (the same numbers, not only up to
        rounding) -- and return the tokens the request still computes."""
        self.start = buffer.length
        n = self.length
        if self.reused is None or not n:
            return ids, positions
        at = buffer.length
        tail = self.reused
        buffer.slot_keys[:, :, at:at + n] = tail.keys[:, :, :n]
        buffer.slot_values[:, :, at:at + n] = tail.values[:, :, :n]
        buffer.positions[at:at + n] = torch.tensor(tail.positions[:n])
        buffer.token_ids[at:at + n] = torch.tensor(tail.token_ids[:n])
        buffer.length = at + n
        return ids[n:], positions[n:]

    def keep(self, cache: TailCache, buffer, last: torch.Tensor) -> None:
        """After the prefill: keep the whole tail, from `buffer`, with `last`, the logits
        after it."""
        self._remember(cache, buffer, {len(self.token_ids): last.detach().clone()})

    def keep_decoded(self, cache: TailCache, buffer) -> None:
        """When the request ends: keep the tail with the tokens decoded after it (their KV
        is in `buffer` up to its length; the last picked token was never computed), so that
        a request that goes on from the answer reuses it too."""
        if self.start is not None and buffer.length > self.start + len(self.token_ids):
            self._remember(cache, buffer)

    def _remember(self, cache: TailCache, buffer, logits=None) -> None:
        start = self.start
        end = buffer.length
        row = buffer.slot_keys[:, :, :1]                  # one token's keys
        if not cache.fits(row.numel() * row.element_size() * 2 * (end - start)):
            return                                        # not copied only to be dropped
        # the buffer is reused after us: copies
        cache.remember(self.context, buffer.token_ids[start:end].tolist(),
                       buffer.positions[start:end].tolist(),
                       buffer.slot_keys[:, :, start:end].clone(),
                       buffer.slot_values[:, :, start:end].clone(), logits)


def plan_tail(cache: TailCache, numerics: tuple, units: list[tuple[str, UnitKV]],
              ids: list[int], positions: list[int]) -> TailUse | None:
    """How a request whose uncached tokens are `ids` at `positions` (after its units, with
    nothing recomputed) uses and leaves a tail; None where it cannot (reuse off, or an
    uncached token before a cached one)."""
    if not cache.enabled or not ids:
        return None
    ends = [int(kv.positions[~kv.placeholder].max()) + 1 for _, kv in units
            if bool((~kv.placeholder).any())]
    if not is_tail(positions, max(ends, default=0)):
        return None
    use = TailUse(tail_context([key for key, _ in units], numerics), list(ids), list(positions))
    use.reused, use.length = cache.match(use.context, ids, positions)
    return use
