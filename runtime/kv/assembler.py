"""The assembler: a request's cached units' KV, written into preallocated buffers.

A `KVBuffer` holds keys/values for every layer with room for `capacity` tokens;
the cached units' tokens (parameter placeholders left out) are written at the
front, the request's uncached and generated tokens are then written after them
in place by the model adapter. Buffers are pooled and reused across requests and
grow geometrically only when a request needs more room than any buffer has, so
a request never reallocates the whole cache.

The pool is bounded: it keeps at most `keep_idle` idle buffers, and drops idle ones
(least recently used first) while the buffers in use plus the idle ones exceed
`budget_bytes` (default 1 GiB, or `$PROMPTLANG_POOL_BYTES`, e.g. `512M`; 0 keeps
none). The budget limits what is kept between requests, not what a request may use:
a request that needs a bigger buffer gets one, and it is freed when it comes back.

A buffer remembers which units (by store key) sit at its front. A request whose
leading units are already there at the same offsets does not copy them again:
a repeated document costs no assembly at all.

Long units are not copied at all when the adapter can read them in place
(`ModelAdapter.reads_shared`): their slots come after the copied units and are
served from the store's own tensors (`SharedKV`), which nothing ever writes. Code
that reads a buffer's `keys`/`values` directly gets every slot filled: shared slots
are copied in on first access (`materialize`).
"""

from __future__ import annotations

import hashlib
import os
import threading
import weakref
from dataclasses import dataclass, field

import torch

from promptlang.errors import ConfigError, InvalidArgumentError
from promptlang.runtime.kv.unit import UnitKV
from promptlang.runtime.model import ModelAdapter, ParallelContexts, Past, SharedKV
from promptlang.runtime.kv.plan import NO_RECOMPUTE, RecomputePlan

SHARE_MIN_TOKENS = 256     # shorter units are copied: cheaper than one more attention piece
MAX_SHARED_PIECES = 48     # spans read in place per request (each an attention piece; the
                           # fused layers take < 64 per request, fast/native.MAX_PIECES):
                           # a unit whose spans (holes: recomputed tokens) exceed what is
                           # left is copied instead
POOL_BUDGET_ENV = "PROMPTLANG_POOL_BYTES"
DEFAULT_POOL_BUDGET = 1 << 30   # bytes of request buffers (in use + idle) the pool keeps within
KEEP_IDLE = 2              # idle buffers kept for the next requests, at most
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def pool_budget(environ=os.environ) -> int:
    """The pool's byte budget from $PROMPTLANG_POOL_BYTES (bytes, or with a K/M/G/T suffix,
    powers of 1024), else DEFAULT_POOL_BUDGET."""
    text = environ.get(POOL_BUDGET_ENV, "").strip()
    if not text:
        return DEFAULT_POOL_BUDGET
    number = text.upper().rstrip("IB")
    unit = ""
    if number and number[-1] in _UNITS:
        unit = number[-1]
        number = number[:-1]
    try:
        value = int(float(number) * _UNITS[unit])
    except ValueError:
        value = -1
    if value < 0:
        raise ConfigError(f"{POOL_BUDGET_ENV} must be a number of bytes (0 or more, "
                          f"optionally with K, M or G), not {text!r}")
    return value


@dataclass(eq=False)          # identity, not tensor comparison
class KVBuffer:
    slot_keys: torch.Tensor    # [L, H_kv, C, D_k]; slots in `shared` are stale here
    slot_values: torch.Tensor  # [L, H_kv, C, D_v]
    positions: torch.Tensor    # [C] int64
    token_ids: torch.Tensor    # [C] int64
    length: int = 0            # tokens in use
    held: list[tuple[str, int]] = field(default_factory=list)   # (unit key, end) at the front
    shared: list[SharedKV] = field(default_factory=list)        # slots read in place
    shared_keys: list[str | None] = field(default_factory=list)  # unit key on a unit's last span
    # APE (recompute policy "ape"): `context` indexed by POSITION, True at the contexts'
    # tokens; every pass over this buffer attends as ParallelContexts says
    contexts: ParallelContexts | None = None

    @property
    def capacity(self) -> int:
        return int(self.positions.shape[0])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.slot_keys, self.slot_values, self.positions, self.token_ids))

    @property
    def keys(self) -> torch.Tensor:
        """[L, H_kv, C, D_k], every slot in use filled (shared slots copied in first)."""
        self.materialize()
        return self.slot_keys

    @property
    def values(self) -> torch.Tensor:
        """[L, H_kv, C, D_v], every slot in use filled (shared slots copied in first)."""
        self.materialize()
        return self.slot_values

    def past(self) -> Past:
        """The tokens in use, as the adapter's past (new tokens go right after them)."""
        positions = self.positions[:self.length]
        contexts = None
        if self.contexts is not None:            # by position -> by slot
            by_position = self.contexts.context
            inside = positions < by_position.shape[0]
            flags = by_position[positions.clamp(max=by_position.shape[0] - 1)] & inside
            contexts = self.contexts._replace(context=flags)
        return Past(self.slot_keys, self.slot_values, positions, tuple(self.shared), contexts)

    def materialize(self) -> None:
        """Copy the shared slots into the buffer; they stop being shared (and a unit that
        continues the held prefix is held from now on)."""
        end = self.held[-1][1] if self.held else 0     # how far the held prefix reaches
        for kv, key in zip(self.shared, self.shared_keys):
            self.slot_keys[:, :, kv.start:kv.end] = kv.keys
            self.slot_values[:, :, kv.start:kv.end] = kv.values
            if end == kv.start:
                end = kv.end
                if key is not None:               # the unit's last span: the whole unit is in
                    self.held.append((key, end))
        self.shared = []
        self.shared_keys = []

    def reserve(self, capacity: int) -> None:
        """Make room for `capacity` tokens, keeping the content (a decode that outgrew it)."""
        if capacity <= self.capacity:
            return
        for name in ("slot_keys", "slot_values", "positions", "token_ids"):
            old = getattr(self, name)
            new = old.new_empty(*old.shape[:-2], capacity, old.shape[-1]) if old.dim() == 4 \
                else old.new_zeros(capacity)
            if old.dim() == 4:
                new[:, :, :self.length] = old[:, :, :self.length]
            else:
                new[:self.length] = old[:self.length]
            setattr(self, name, new)

    def forget_from(self, index: int) -> None:
        """Slots from `index` on are about to change: drop the units that overlap them
        (the part of a shared unit before `index` is copied in, it stays in use)."""
        self.held = [(key, end) for key, end in self.held if end <= index]
        for kv in self.shared:
            if kv.start < index < kv.end:
                self.slot_keys[:, :, kv.start:index] = kv.keys[:, :, :index - kv.start]
                self.slot_values[:, :, kv.start:index] = kv.values[:, :, :index - kv.start]
        kept = [(kv, key) for kv, key in zip(self.shared, self.shared_keys) if kv.end <= index]
        self.shared = [kv for kv, _ in kept]
        self.shared_keys = [key for _, key in kept]

    def append(self, token_ids: torch.Tensor, positions: torch.Tensor) -> None:
        """Record ids/positions of tokens whose KV the adapter just wrote after `length`."""
        n = int(positions.shape[0])
        self.positions[self.length:self.length + n] = positions
        self.token_ids[self.length:self.length + n] = token_ids
        self.length += n


@dataclass(eq=False)
class Assembler:
    """Hands out pooled KV buffers and writes units into them (or shares long ones).

    budget_bytes: the pool drops idle buffers while the buffers in use plus the idle ones
    hold more (None: `pool_budget()`); keep_idle: idle buffers kept at most."""

    adapter: ModelAdapter
    growth: float = 1.5
    share_min_tokens: int | None = SHARE_MIN_TOKENS   # None: copy every unit
    budget_bytes: int | None = None
    keep_idle: int = KEEP_IDLE
    allocations: int = 0                       # buffers allocated so far (tests read it)
    dropped: int = 0                           # idle buffers freed so far
    copied_tokens: int = 0                     # tokens written by assemble() so far
    shared_tokens: int = 0                     # tokens assemble() served in place so far
    _free: list[KVBuffer] = field(default_factory=list)      # idle, least recently used first
    _in_use: weakref.WeakSet = field(default_factory=weakref.WeakSet)   # a lost one frees itself
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self):
        if self.budget_bytes is None:
            self.budget_bytes = pool_budget()
        if self.budget_bytes < 0 or self.keep_idle < 0:
            raise InvalidArgumentError("the buffer pool's budget_bytes and keep_idle must be >= 0")

    @property
    def idle_bytes(self) -> int:
        """Bytes of the idle buffers the pool keeps."""
        with self._lock:
            return sum(b.nbytes for b in self._free)

    @property
    def in_use_bytes(self) -> int:
        """Bytes of the buffers handed out and not yet released."""
        with self._lock:
            return sum(b.nbytes for b in self._in_use)

    def acquire(self, capacity: int, keys: list[str] = ()) -> KVBuffer:
        """A buffer with room for `capacity` tokens, length 0; among those that fit, the
        one already holding the longest prefix of `keys` at its front."""
        with self._lock:
            fitting = [b for b in self._free if b.capacity >= capacity]
            if fitting:
                buffer = max(fitting, key=lambda b: (_common_prefix(b.held, keys), -b.capacity))
                self._free.remove(buffer)
                buffer.length = 0
                self._in_use.add(buffer)
                return buffer
            if self._free:        # replace the largest free buffer by a bigger one
                largest = max(self._free, key=lambda b: b.capacity)
                self._free.remove(largest)
                capacity = max(capacity, int(largest.capacity * self.growth) + 1)
            self.allocations += 1
        keys_, values = self.adapter.empty_kv(capacity)
        device = self.adapter.device
        buffer = KVBuffer(keys_, values, torch.zeros(capacity, dtype=torch.int64, device=device),
                          torch.zeros(capacity, dtype=torch.int64, device=device))
        with self._lock:
            self._in_use.add(buffer)
            self._trim()                  # a bigger buffer in use leaves less room for idle ones
        return buffer

    def release(self, buffer: KVBuffer) -> None:
        """Take a buffer back: kept for the next request, unless the pool is over its budget
        or already keeps `keep_idle` idle buffers (then the least recently used go)."""
        # an idle buffer pins no store tensors
        buffer.shared = []
        buffer.shared_keys = []
        buffer.contexts = None
        with self._lock:
            self._in_use.discard(buffer)
            if not any(b is buffer for b in self._free):
                self._free.append(buffer)
            self._trim()

    def _trim(self) -> None:
        """Drop idle buffers, least recently used first, beyond `keep_idle` or while in use
        plus idle exceed the budget. Hold the lock."""
        total = sum(b.nbytes for b in self._free) + sum(b.nbytes for b in self._in_use)
        while self._free and (len(self._free) > self.keep_idle or total > self.budget_bytes):
            total -= self._free.pop(0).nbytes
            self.dropped += 1

    @torch.inference_mode()
    def assemble(self, buffer: KVBuffer, units: list[tuple[str, UnitKV]],
                 recompute: RecomputePlan = NO_RECOMPUTE) -> int:
        """Put `units` ((store key, KV) pairs) at the front of `buffer`, leaving out their
        placeholders and the tokens `recompute` computes per request: the copied ones
        first, skipping the leading ones it already holds, then the shared ones; returns
        the tokens in use."""
        units_in = [p for p in _served_units(units, recompute) if p.count]
        reuse = _common_prefix(buffer.held, [p.key for p in units_in])
        held = buffer.held[:reuse]
        at = held[-1][1] if held else 0
        shares = []
        budget = MAX_SHARED_PIECES
        for unit in units_in[reuse:]:               # in order, while their pieces fit the budget
            shares.append(self._shares(buffer, unit) and len(unit.spans) <= budget)
            budget -= len(unit.spans) if shares[-1] else 0
        shared = [p for p, share in zip(units_in[reuse:], shares) if share]
        copied = [p for p, share in zip(units_in[reuse:], shares) if not share]
        buffer.shared = []
        buffer.shared_keys = []
        for unit in copied:
            kv = unit.kv
            n = unit.count
            # kv.keys: [L, H_kv, S, D]
            if unit.keep is not None:
                buffer.slot_keys[:, :, at:at + n] = kv.keys[:, :, unit.keep]
                buffer.slot_values[:, :, at:at + n] = kv.values[:, :, unit.keep]
                buffer.positions[at:at + n] = kv.positions[unit.keep]
                buffer.token_ids[at:at + n] = kv.token_ids[unit.keep]
            else:
                buffer.slot_keys[:, :, at:at + n] = kv.keys
                buffer.slot_values[:, :, at:at + n] = kv.values
                buffer.positions[at:at + n] = kv.positions
                buffer.token_ids[at:at + n] = kv.token_ids
            at += n
            held.append((unit.key, at))
            self.copied_tokens += n
        buffer.held = held
        for unit in shared:
            kv = unit.kv
            for i, (start, end) in enumerate(unit.spans):
                n = end - start
                buffer.positions[at:at + n] = kv.positions[start:end]
                buffer.token_ids[at:at + n] = kv.token_ids[start:end]
                buffer.shared.append(SharedKV(at, at + n, kv.keys[:, :, start:end],
                                              kv.values[:, :, start:end]))
                # a unit counts as held once its last span is in place (materialize)
                buffer.shared_keys.append(unit.key if i == len(unit.spans) - 1 else None)
                at += n
                self.shared_tokens += n
        buffer.length = at
        return at

    def _shares(self, buffer: KVBuffer, unit: "_ServedUnit") -> bool:
        """Whether a unit may be served in place: long, without placeholders, on the
        buffer's device and in a dtype the adapter reads in place (the buffer's, or
        bfloat16 for the fused layers). `assemble` also keeps the request's spans read in
        place within MAX_SHARED_PIECES (each one more attention piece)."""
        kv = unit.kv
        return (self.share_min_tokens is not None and unit.count >= self.share_min_tokens
                and self.adapter.reads_shared and self.adapter.shares_dtype(kv.keys.dtype)
                and kv.keys.device == buffer.slot_keys.device
                and not bool(kv.placeholder.any()))


@dataclass
class _ServedUnit:
    """One unit as a request is served it: the tokens it keeps (`keep`, None: every
    token), their spans of consecutive tokens, and the key a buffer holds it under (a unit
    missing recomputed tokens is held under a key of its own)."""

    key: str
    kv: UnitKV
    keep: torch.Tensor | None       # [S] bool
    count: int
    spans: list[tuple[int, int]]

    @classmethod
    def of(cls, key: str, kv: UnitKV, recomputed: torch.Tensor | None) -> "_ServedUnit":
        keep = ~kv.placeholder
        if recomputed is not None:
            dropped = torch.isin(kv.positions, recomputed.to(kv.positions.device))
            if bool(dropped.any()):
                keep = keep & ~dropped
                gone = kv.positions[dropped].tolist()
                key = f"{key}~" + hashlib.sha1(repr(gone).encode()).hexdigest()[:16]
        if bool(keep.all()):
            return cls(key, kv, None, kv.length, [(0, kv.length)])
        return cls(key, kv, keep, int(keep.sum()), _spans(keep.tolist()))


def request_keys(units: list[tuple[str, UnitKV]], recompute: RecomputePlan = NO_RECOMPUTE
                 ) -> list[str]:
    """The keys `assemble` holds `units` under (a unit missing recomputed tokens gets its
    own), for `Assembler.acquire` to pick the buffer that already holds them."""
    return [p.key for p in _served_units(units, recompute)]


def _served_units(units: list[tuple[str, UnitKV]], recompute: RecomputePlan
                  ) -> list[_ServedUnit]:
    """The non-empty `units` as the request is served them (recompute's tokens left out)."""
    recomputed = torch.tensor(sorted(recompute.positions)) if recompute.positions else None
    return [_ServedUnit.of(key, kv, recomputed) for key, kv in units if kv.length]


def _spans(keep: list[bool]) -> list[tuple[int, int]]:
    """[start, end) of each span of True in `keep`."""
    spans = []
    start = None
    for i, flag in enumerate(keep + [False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            spans.append((start, i))
            start = None
    return spans


def _common_prefix(held: list[tuple[str, int]], keys) -> int:
    n = 0
    for (key, _), wanted in zip(held, keys):
        if key != wanted:
            break
        n += 1
    return n
