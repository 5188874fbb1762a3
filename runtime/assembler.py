"""The assembler: a request's cached units' KV, written into preallocated buffers.

A `KVBuffer` holds keys/values for every layer with room for `capacity` tokens;
the cached units' tokens (parameter placeholders left out) are written at the
front, the request's uncached and generated tokens are then written after them
in place by the model adapter. Buffers are pooled and reused across requests and
grow geometrically only when a request needs more room than any buffer has, so
a request never reallocates the whole cache.

A buffer remembers which units (by store key) sit at its front. A request whose
leading units are already there at the same offsets does not copy them again:
a repeated document costs no assembly at all.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from promptlang.runtime.kv import ModuleKV
from promptlang.runtime.model import ModelAdapter, Past


@dataclass(eq=False)          # identity, not tensor comparison
class KVBuffer:
    keys: torch.Tensor        # [L, H_kv, C, D_k]
    values: torch.Tensor      # [L, H_kv, C, D_v]
    positions: torch.Tensor   # [C] int64
    token_ids: torch.Tensor   # [C] int64
    length: int = 0           # tokens in use
    held: list[tuple[str, int]] = field(default_factory=list)   # (unit key, end) at the front

    @property
    def capacity(self) -> int:
        return int(self.positions.shape[0])

    def past(self) -> Past:
        """The tokens in use, as the adapter's past (new tokens go right after them)."""
        return Past(self.keys, self.values, self.positions[:self.length])

    def reserve(self, capacity: int) -> None:
        """Make room for `capacity` tokens, keeping the content (a decode that outgrew it)."""
        if capacity <= self.capacity:
            return
        for name in ("keys", "values", "positions", "token_ids"):
            old = getattr(self, name)
            new = old.new_empty(*old.shape[:-2], capacity, old.shape[-1]) if old.dim() == 4 \
                else old.new_zeros(capacity)
            if old.dim() == 4:
                new[:, :, :self.length] = old[:, :, :self.length]
            else:
                new[:self.length] = old[:self.length]
            setattr(self, name, new)

    def forget_from(self, index: int) -> None:
        """Slots from `index` on are about to change: drop the units that overlap them."""
        self.held = [(key, end) for key, end in self.held if end <= index]

    def append(self, token_ids: torch.Tensor, positions: torch.Tensor) -> None:
        """Record ids/positions of tokens whose KV the adapter just wrote after `length`."""
        n = int(positions.shape[0])
        self.positions[self.length:self.length + n] = positions
        self.token_ids[self.length:self.length + n] = token_ids
        self.length += n


@dataclass(eq=False)
class Assembler:
    """Hands out pooled KV buffers and writes units into them."""

    adapter: ModelAdapter
    growth: float = 1.5
    allocations: int = 0                       # buffers allocated so far (tests read it)
    copied_tokens: int = 0                     # tokens written by assemble() so far
    _free: list[KVBuffer] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def acquire(self, capacity: int, keys: list[str] = ()) -> KVBuffer:
        """A buffer with room for `capacity` tokens, length 0; among those that fit, the
        one already holding the longest run of `keys` at its front."""
        with self._lock:
            fitting = [b for b in self._free if b.capacity >= capacity]
            if fitting:
                buffer = max(fitting, key=lambda b: (_common_prefix(b.held, keys), -b.capacity))
                self._free.remove(buffer)
                buffer.length = 0
                return buffer
            if self._free:        # replace the largest free buffer by a bigger one
                largest = max(self._free, key=lambda b: b.capacity)
                self._free.remove(largest)
                capacity = max(capacity, int(largest.capacity * self.growth) + 1)
            self.allocations += 1
        keys_, values = self.adapter.empty_kv(capacity)
        device = self.adapter.device
        return KVBuffer(keys_, values, torch.zeros(capacity, dtype=torch.int64, device=device),
                        torch.zeros(capacity, dtype=torch.int64, device=device))

    def release(self, buffer: KVBuffer) -> None:
        with self._lock:
            self._free.append(buffer)

    @torch.inference_mode()
    def assemble(self, buffer: KVBuffer, units: list[tuple[str, ModuleKV]]) -> int:
        """Write `units` ((store key, KV) pairs; placeholders left out) at the front of
        `buffer`, skipping the leading ones it already holds; returns tokens written."""
        reuse = _common_prefix(buffer.held, [key for key, kv in units if kv.length])
        held = buffer.held[:reuse]
        at = held[-1][1] if held else 0
        for key, kv in [(k, kv) for k, kv in units if kv.length][reuse:]:
            # kv.keys: [L, H_kv, S, D]
            if bool(kv.placeholder.any()):
                keep = ~kv.placeholder
                n = int(keep.sum())
                buffer.keys[:, :, at:at + n] = kv.keys[:, :, keep]
                buffer.values[:, :, at:at + n] = kv.values[:, :, keep]
                buffer.positions[at:at + n] = kv.positions[keep]
                buffer.token_ids[at:at + n] = kv.token_ids[keep]
            else:
                n = kv.length
                buffer.keys[:, :, at:at + n] = kv.keys
                buffer.values[:, :, at:at + n] = kv.values
                buffer.positions[at:at + n] = kv.positions
                buffer.token_ids[at:at + n] = kv.token_ids
            at += n
            held.append((key, at))
            self.copied_tokens += n
        buffer.held = held
        buffer.length = at
        return at


def _common_prefix(held: list[tuple[str, int]], keys) -> int:
    n = 0
    for (key, _), wanted in zip(held, keys):
        if key != wanted:
            break
        n += 1
    return n
