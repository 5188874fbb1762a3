"""A pass's past slots as pieces: spans of the request buffer, and units' KV read in place.

A Past (runtime/model/adapter.py) holds its keys/values in one buffer, except the slot spans
listed in `shared`, whose keys/values are read from a stored unit's own tensors. Every
attention path over such a past walks the same pieces in slot order: these helpers.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Piece(NamedTuple):
    """Past keys/values of every layer, [L, H_kv, n, D] (rows of D contiguous)."""

    keys: torch.Tensor
    values: torch.Tensor


def slot_spans(shared, end: int):
    """Slots [0, end) as (start, stop, kv) in slot order: `kv` is the SharedKV (start,
    end, keys, values) whose tensors hold those slots, or None for the buffer's own."""
    spans = []
    at = 0
    for kv in sorted(shared or ()):
        if kv.start > at:
            spans.append((at, kv.start, None))
        spans.append((kv.start, kv.end, kv))
        at = kv.end
    if end > at:
        spans.append((at, end, None))
    return spans


def past_pieces(keys: torch.Tensor, values: torch.Tensor, shared, end: int) -> list[Piece]:
    """Past slots [0, end) of a buffer ([L, H_kv, C, D]) as pieces in slot order, the spans
    in `shared` read from their own tensors."""
    return [Piece(keys[:, :, a:b], values[:, :, a:b]) if kv is None else
            Piece(kv.keys, kv.values) for a, b, kv in slot_spans(shared, end)]


def layer_pieces(layer: int | None, shared, key: torch.Tensor, value: torch.Tensor, end: int):
    """Slots [0, end) of one layer as (first slot, end slot, keys, values) pieces in slot
    order: the SharedKV spans read from their units' tensors, the slots between them from
    `key`/`value` ([B, H_kv, K, D]); keys and values of every piece [B, H_kv, n, D]."""
    return [(a, b, key[:, :, a:b], value[:, :, a:b]) if kv is None else
            (a, b, kv.keys[layer][None], kv.values[layer][None])
            for a, b, kv in slot_spans(shared, end)]


def flagged_pieces(keys: torch.Tensor, values: torch.Tensor, shared, end: int,
                   flags: torch.Tensor) -> tuple[list[Piece], list[bool]]:
    """`past_pieces`, each piece cut where `flags` (bool per slot; slots past its end: False)
    changes, and each piece's flag: APE's contexts as whole pieces (runtime/model/adapter.py,
    ParallelContexts)."""
    flags = flags[:end].to(torch.bool).cpu()
    if flags.shape[0] < end:
        flags = torch.cat([flags, torch.zeros(end - flags.shape[0], dtype=torch.bool)])
    cuts = set((torch.nonzero(flags[1:] != flags[:-1])[:, 0] + 1).tolist())
    pieces = []
    marks = []
    for a, b, kv in slot_spans(shared, end):
        bounds = [a, *sorted(c for c in cuts if a < c < b), b]
        for x, y in zip(bounds, bounds[1:]):
            if kv is None:
                pieces.append(Piece(keys[:, :, x:y], values[:, :, x:y]))
            else:
                pieces.append(Piece(kv.keys[:, :, x - kv.start:y - kv.start],
                                    kv.values[:, :, x - kv.start:y - kv.start]))
            marks.append(bool(flags[x]))
    return pieces, marks
