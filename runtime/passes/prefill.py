"""Prefill: compute a run of new tokens at given positions into a request's KV buffer.

Every forward pass that extends a buffer goes through `prefill`: a request's uncached
tokens (engine.py), a session's queued text and `select` options (session.py), and
each decode step (decode.py). `visibility` is the one place the attention rule for
new tokens is written down; the encoder (encoder.py) uses it for a unit's tokens too.

Cached prefill. The buffer holds the request's cached tokens (assembled units,
placeholders left out). The uncached tokens (arguments in their parameter slots,
`cache="false"` modules, the prompt's own text), sorted by position, are computed
in ONE pass at their layout positions; each attends to every request token whose
position is <= its own, cached or not. A request with no uncached token computes its
last token (the highest position) this way instead of serving it from the cache: the
next-token distribution needs that token's output (`take_last`).

Baseline. The same token ids at contiguous positions 0..N-1, causal, no reuse: what
the model computes without promptlang, for A/B comparisons.
"""

from __future__ import annotations

from typing import Sequence

import torch

from promptlang.errors import EmptyPromptError
from promptlang.pml.layout import Segment
from promptlang.runtime.kv.assembler import KVBuffer
from promptlang.runtime.model import ModelAdapter


def visibility(past: torch.Tensor, positions: torch.Tensor,
               groups: torch.Tensor | None = None) -> torch.Tensor | None:
    """Which keys each new token attends to: [Q, S + Q] bool, past keys first.

    A new token sees every past key and every new key whose position is <= its own;
    with `groups`, only the new keys of its own group (options scored side by side).
    None when that is plain causal order after the whole past: the adapter's fast path.
    """
    # past: [S] int64 positions; positions: [Q] int64; groups: [Q]
    in_order = groups is None and bool((positions[1:] > positions[:-1]).all())
    if in_order and not (past.numel() and int(past.max()) >= int(positions.min())):
        return None
    new = positions[None, :] <= positions[:, None]
    if groups is not None:
        new &= groups[None, :] == groups[:, None]
    return torch.cat([past[None, :] <= positions[:, None], new], dim=1)


@torch.inference_mode()
def prefill(adapter: ModelAdapter, buffer: KVBuffer, token_ids: Sequence[int],
            positions: Sequence[int], all_logits: bool = False, *,
            groups: Sequence[int] | None = None, after_past: bool = False) -> torch.Tensor:
    """Compute `token_ids` at `positions` against the buffer's tokens and append their KV.

    Attention follows `visibility` (`groups` as there). `after_past`: the caller knows
    the positions increase and follow every buffer token (a decode step), so no mask
    is checked for. The buffer grows when it is full. Returns logits [Q, V]
    (all_logits) or [1, V] (the last token's).
    """
    return extend(adapter, buffer, token_ids, positions, all_logits, groups, after_past)


def extend(adapter: ModelAdapter, buffer: KVBuffer, token_ids: Sequence[int],
           positions: Sequence[int], all_logits: bool, groups: Sequence[int] | None,
           after_past: bool) -> torch.Tensor:
    """`prefill` for a caller already in inference mode (the decode loop, per step)."""
    device = adapter.device
    ids = torch.tensor(list(token_ids), dtype=torch.int64, device=device)
    pos = torch.tensor(list(positions), dtype=torch.int64, device=device)
    q = int(ids.shape[0])
    if buffer.length + q > buffer.capacity:
        buffer.reserve(max(buffer.length + q, int(buffer.capacity * 1.5) + 1))
    allowed = None
    if not after_past:
        group_ids = None if groups is None else torch.tensor(list(groups), device=device)
        allowed = visibility(buffer.positions[:buffer.length], pos, group_ids)
    # without groups, a mask over increasing positions is the positional rule itself
    by_position = allowed is not None and groups is None and bool((pos[1:] > pos[:-1]).all())
    rows = torch.arange(q, device=device) if all_logits else torch.tensor([q - 1], device=device)
    step = adapter.forward(ids, pos, buffer.past(), allowed, rows, by_position=by_position)
    buffer.append(ids, pos)
    return step.logits


@torch.inference_mode()
def baseline_prefill(adapter: ModelAdapter, buffer: KVBuffer, token_ids: Sequence[int],
                     all_logits: bool = False) -> torch.Tensor:
    """The plain forward: `token_ids` at positions 0..N-1, causal, no cached KV."""
    buffer.length = 0
    buffer.forget_from(0)
    return prefill(adapter, buffer, token_ids, range(len(token_ids)), all_logits)


def uncached_tokens(segments: Sequence[Segment]) -> tuple[list[int], list[int]]:
    """(token ids, positions) of the uncached segments, position order."""
    ids = []
    positions = []
    for seg in sorted(segments, key=lambda s: s.start):
        ids += seg.token_ids
        positions += seg.positions
    return ids, positions


def with_last(buffer: KVBuffer, ids: list[int], positions: list[int]
              ) -> tuple[list[int], list[int]]:
    """The tokens a request computes over `buffer` (its cached tokens assembled): `ids` at
    `positions` (increasing), plus -- where the request's highest position holds a cached
    token -- that token, taken out of the buffer (`take_last`): the next-token distribution
    needs its output."""
    if not ids or (buffer.length and
                   int(buffer.positions[:buffer.length].max()) > positions[-1]):
        token, position = take_last(buffer)
        at = sum(p < position for p in positions)
        ids = ids[:at] + [token]
        positions = positions[:at] + [position]
    return ids, positions


def take_last(buffer: KVBuffer) -> tuple[int, int]:
    """Remove the highest-positioned token from the buffer (it will be recomputed);
    returns its (token id, position). Its slot is filled by the buffer's last token.
    An empty buffer (a request with no token at all) is an EmptyPromptError.
    """
    n = buffer.length
    if n == 0:
        raise EmptyPromptError("the prompt is empty: no token to compute the next one from")
    buffer.materialize()           # slot n - 1 may be a shared one: its KV moves below
    last = int(torch.argmax(buffer.positions[:n]))
    buffer.forget_from(last)
    token = int(buffer.token_ids[last])
    position = int(buffer.positions[last])
    if last != n - 1:
        for t in (buffer.keys, buffer.values):      # [L, H_kv, C, D]
            t[:, :, last] = t[:, :, n - 1]
        buffer.positions[last] = buffer.positions[n - 1]
        buffer.token_ids[last] = buffer.token_ids[n - 1]
    buffer.length = n - 1
    return token, position


def truncate(buffer: KVBuffer, length: int) -> None:
    """Drop the KV of every token from slot `length` on (a rollback)."""
    buffer.forget_from(length)
    buffer.length = length


def move_slots(buffer: KVBuffer, source: int, target: int, n: int) -> None:
    """Move the KV of slots [source, source + n) to [target, target + n)."""
    if source == target:
        return
    for tensor in (buffer.keys, buffer.values):       # [L, H_kv, C, D]
        tensor[:, :, target:target + n] = tensor[:, :, source:source + n].clone()
    for tensor in (buffer.positions, buffer.token_ids):
        tensor[target:target + n] = tensor[source:source + n].clone()
