"""A pass's past slots as pieces: runs of the request buffer, and runs read in place.

A Past (runtime/model/adapter.py) holds its keys/values in one buffer, except the slot runs
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


def slot_runs(shared, end: int):
    """Slots [0, end) as (start, stop, run) in slot order: `run` is the SharedKV (start,
    end, keys, values) whose tensors hold those slots, or None for the buffer's own."""
    runs = []
    at = 0
    for seg in sorted(shared or ()):
        if seg.start > at:
            runs.append((at, seg.start, None))
        runs.append((seg.start, seg.end, seg))
        at = seg.end
    if end > at:
        runs.append((at, end, None))
    return runs


def past_pieces(keys: torch.Tensor, values: torch.Tensor, shared, end: int) -> list[Piece]:
    """Past slots [0, end) of a buffer ([L, H_kv, C, D]) as pieces in slot order, the runs
    in `shared` read from their own tensors."""
    return [Piece(keys[:, :, a:b], values[:, :, a:b]) if run is None else
            Piece(run.keys, run.values) for a, b, run in slot_runs(shared, end)]


def layer_pieces(layer: int | None, shared, key: torch.Tensor, value: torch.Tensor, end: int):
    """Slots [0, end) of one layer as (first slot, end slot, keys, values) pieces in slot
    order: the SharedKV runs read from their units' tensors, the slots between them from
    `key`/`value` ([B, H_kv, K, D]); keys and values of every piece [B, H_kv, n, D]."""
    return [(a, b, key[:, :, a:b], value[:, :, a:b]) if run is None else
            (a, b, run.keys[layer][None], run.values[layer][None])
            for a, b, run in slot_runs(shared, end)]


def flagged_pieces(keys: torch.Tensor, values: torch.Tensor, shared, end: int,
                   flags: torch.Tensor) -> tuple[list[Piece], list[bool]]:
    """`past_pieces`, each run cut where `flags` (bool per slot; slots past its end: False)
    changes, and each piece's flag: APE's contexts as whole pieces (runtime/model/adapter.py,
    ParallelContexts)."""
    flags = flags[:end].to(torch.bool).cpu()
    if flags.shape[0] < end:
        flags = torch.cat([flags, torch.zeros(end - flags.shape[0], dtype=torch.bool)])
    cuts = set((torch.nonzero(flags[1:] != flags[:-1])[:, 0] + 1).tolist())
    pieces = []
    marks = []
    for a, b, run in slot_runs(shared, end):
        bounds = [a, *sorted(c for c in cuts if a < c < b), b]
        for x, y in zip(bounds, bounds[1:]):
            if run is None:
                pieces.append(Piece(keys[:, :, x:y], values[:, :, x:y]))
            else:
                pieces.append(Piece(run.keys[:, :, x - run.start:y - run.start],
                                    run.values[:, :, x - run.start:y - run.start]))
            marks.append(bool(flags[x]))
    return pieces, marks
