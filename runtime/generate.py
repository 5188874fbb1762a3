"""The generator: prefill of a request's uncached tokens, then decode one token at a time.

Cached prefill. The buffer holds the request's cached tokens (assembled units,
placeholders left out). The uncached tokens (arguments in their parameter slots,
`cache="false"` modules, the prompt's own text), sorted by position, are computed
in ONE forward pass at their layout positions; each attends to every request token
whose position is <= its own, cached or not. A request with no uncached token
computes its last token (the highest position) this way instead of serving it
from the cache: the next-token distribution needs that token's output.

Decode. Generated tokens take positions `end, end + 1, ...` and attend to
everything before them. Sampling, stop strings, max tokens and EOS come from
`sampling.Decoding`; `decode` yields `(token_id, text_delta, finished)`. Units the
prefill read in place (see assembler.py) are copied into the buffer after the
first token: once, instead of reading them in pieces at every step.

Baseline. The same token ids at contiguous positions 0..N-1, causal, no reuse:
what the model computes without promptlang, for A/B comparisons.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import torch

from promptlang.pml.layout import Segment
from promptlang.runtime.assembler import KVBuffer
from promptlang.runtime.model import ModelAdapter


def uncached_tokens(segments: Sequence[Segment]) -> tuple[list[int], list[int]]:
    """(token ids, positions) of the uncached segments, position order."""
    ids, positions = [], []
    for seg in sorted(segments, key=lambda s: s.start):
        ids += seg.token_ids
        positions += seg.positions
    return ids, positions


def take_last(buffer: KVBuffer) -> tuple[int, int]:
    """Remove the highest-positioned token from the buffer (it will be recomputed);
    returns its (token id, position). Its slot is filled by the buffer's last token."""
    n = buffer.length
    buffer.materialize()           # slot n - 1 may be a shared one: its KV moves below
    last = int(torch.argmax(buffer.positions[:n]))
    buffer.forget_from(last)
    token, position = int(buffer.token_ids[last]), int(buffer.positions[last])
    if last != n - 1:
        for t in (buffer.keys, buffer.values):
            t[:, :, last] = t[:, :, n - 1]
        buffer.positions[last] = buffer.positions[n - 1]
        buffer.token_ids[last] = buffer.token_ids[n - 1]
    buffer.length = n - 1
    return token, position


@torch.inference_mode()
def prefill(adapter: ModelAdapter, buffer: KVBuffer, token_ids: Sequence[int],
            positions: Sequence[int], all_logits: bool = False) -> torch.Tensor:
    """Compute `token_ids` at `positions` (sorted) against the buffer's cached tokens.

    Each new token attends to buffer tokens and new tokens at positions <= its own.
    Their KV is written into the buffer after the cached tokens. Returns logits
    [Q, V] (all_logits) or [1, V] (the last token's).
    """
    device = adapter.device
    ids = torch.tensor(list(token_ids), dtype=torch.int64, device=device)
    pos = torch.tensor(list(positions), dtype=torch.int64, device=device)
    q = int(ids.shape[0])
    cached = buffer.positions[:buffer.length]
    allowed = None    # causal in input order, every cached token visible: the common case
    ordered = bool((pos[1:] > pos[:-1]).all())
    if not ordered or (buffer.length and int(cached.max()) >= int(pos.min())):
        allowed = torch.cat([cached[None, :] <= pos[:, None], pos[None, :] <= pos[:, None]], dim=1)
    rows = torch.arange(q, device=device) if all_logits else torch.tensor([q - 1], device=device)
    step = adapter.forward(ids, pos, buffer.past(), allowed, rows)
    buffer.append(ids, pos)
    return step.logits


@torch.inference_mode()
def baseline_prefill(adapter: ModelAdapter, buffer: KVBuffer, token_ids: Sequence[int],
                     all_logits: bool = False) -> torch.Tensor:
    """The plain forward: `token_ids` at positions 0..N-1, causal, no cached KV."""
    buffer.length = 0
    buffer.forget_from(0)
    return prefill(adapter, buffer, token_ids, range(len(token_ids)), all_logits)


@torch.inference_mode()
def decode(adapter: ModelAdapter, buffer: KVBuffer, logits: torch.Tensor, position: int,
           decoding, max_positions: int | None = None) -> Iterator[tuple[int | None, str, bool]]:
    """Pick tokens from `logits` ([V], the prediction for `position`) onward.

    Yields (token id, text delta, finished); the last item has finished=True. When the
    model runs out of positions the generation ends with reason "length" (token None).
    """
    device = adapter.device
    while True:
        token, delta, finished = decoding.step(logits)
        if finished:
            yield token, delta, True
            return
        if max_positions is not None and position >= max_positions:
            yield token, delta, False
            yield None, decoding.finish("length"), True
            return
        yield token, delta, False
        # every step reads all of the KV: one contiguous piece is cheaper than reading
        # shared units in place, so they are copied in once, after the first token
        buffer.materialize()
        if buffer.length >= buffer.capacity:
            buffer.reserve(int(buffer.capacity * 1.5) + 1)
        ids = torch.tensor([token], dtype=torch.int64, device=device)
        pos = torch.tensor([position], dtype=torch.int64, device=device)
        step = adapter.forward(ids, pos, buffer.past(), None, torch.zeros(1, dtype=torch.int64,
                                                                          device=device))
        buffer.append(ids, pos)
        logits = step.logits[0]
        position += 1
