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

The reused tokens are exactly what the earlier request's pass computed for them; the new
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
from dataclasses import dataclass
from typing import Sequence

import torch

from promptlang.runtime.kv import UnitKV

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

    @property
    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() + \
            self.values.numel() * self.values.element_size()

    def piece(self, n: int) -> tuple[str, UnitKV]:
        """Its first `n` tokens as a unit a request buffer is assembled from, with a key
        naming exactly them."""
        digest = hashlib.sha256(repr((self.context, self.token_ids[:n],
                                      self.positions[:n])).encode()).hexdigest()[:24]
        device = self.keys.device
        return f"tail:{digest}", UnitKV(
            self.keys[:, :, :n], self.values[:, :, :n],
            torch.tensor(self.positions[:n], dtype=torch.int64, device=device),
            torch.tensor(self.token_ids[:n], dtype=torch.int64, device=device),
            torch.zeros(n, dtype=torch.bool, device=device))


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
            raise ValueError(f"tail_budget_bytes must be >= 0, not {budget_bytes!r}")
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
        with the request's, and that length; at most all but the last token (whose output
        the request needs). (None, 0) if none shares MIN_REUSE tokens."""
        limit = len(token_ids) - 1
        best, length = None, 0
        with self._lock:
            for ident, tail in self._tails.items():
                if tail.context != context:
                    continue
                n = 0
                for a, b, p, q in zip(tail.token_ids, token_ids, tail.positions, positions):
                    if a != b or p != q:
                        break
                    n += 1
                n = min(n, limit)
                if n > length:
                    best, length, key = tail, n, ident
            if best is None or length < MIN_REUSE:
                return None, 0
            self._tails.move_to_end(key)
            self.hits += 1
            self.reused_tokens += length
        return best, length

    def remember(self, context: str, token_ids: Sequence[int], positions: Sequence[int],
                 keys: torch.Tensor, values: torch.Tensor) -> None:
        """Keep a request's tail (`keys`, `values`: [L, H_kv, n, D], kept as given: tensors
        nothing else writes to); kept tails it extends (a prefix of its tokens, same
        context) are dropped."""
        n = len(token_ids)
        if n == 0 or not self.fits(keys.numel() * keys.element_size() * 2):
            return
        tail = Tail(context, tuple(int(t) for t in token_ids), tuple(int(p) for p in positions),
                    keys, values)
        with self._lock:
            for ident, old in list(self._tails.items()):
                if old.context == context and len(old.token_ids) <= n and \
                        old.token_ids == tail.token_ids[:len(old.token_ids)] and \
                        old.positions == tail.positions[:len(old.positions)]:
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
    start: int | None = None        # buffer slot of the first computed token (once kept)

    def serve(self, units: list, ids: list[int], positions: list[int]
              ) -> tuple[list, list[int], list[int]]:
        """The request's units with the reused prefix as one more, and the tokens it still
        computes."""
        if self.reused is None or not self.length:
            return units, ids, positions
        n = self.length
        return units + [self.reused.piece(n)], ids[n:], positions[n:]

    def keep(self, cache: TailCache, buffer) -> None:
        """After the prefill: keep the whole tail (the reused prefix, then the KV the pass
        appended to `buffer`)."""
        self.start = buffer.length - (len(self.token_ids) - self.length)
        self._remember(cache, buffer)

    def keep_decoded(self, cache: TailCache, buffer) -> None:
        """When the request ends: keep the tail with the tokens decoded after it (their KV
        is in `buffer` up to its length; the last picked token was never computed), so that
        a request that goes on from the answer reuses it too."""
        if self.start is not None and buffer.length > self.start + len(self.token_ids) \
                - self.length:
            self._remember(cache, buffer)

    def _remember(self, cache: TailCache, buffer) -> None:
        start, end = self.start, buffer.length
        row = buffer.slot_keys[:, :, :1]                  # one token's keys
        if not cache.fits(row.numel() * row.element_size() * 2 * (self.length + end - start)):
            return                                        # not copied only to be dropped
        ids = self.token_ids[:self.length] + buffer.token_ids[start:end].tolist()
        positions = self.positions[:self.length] + buffer.positions[start:end].tolist()
        keys = buffer.slot_keys[:, :, start:end]
        values = buffer.slot_values[:, :, start:end]
        if self.reused is not None and self.length:      # new tensors, as are the clones
            keys = torch.cat([self.reused.keys[:, :, :self.length], keys], dim=2)
            values = torch.cat([self.reused.values[:, :, :self.length], values], dim=2)
        else:                                            # the buffer is reused after us
            keys, values = keys.clone(), values.clone()
        cache.remember(self.context, ids, positions, keys, values)


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
