"""`select`'s options scored in one pass: laid out side by side, then each one's log-prob.

Every option continues the same past from the same position, so the options' tokens go into
one forward pass: each option's tokens at consecutive positions from that position, each in
an attention group of its own (an option sees the past and its own earlier tokens only).
The pass's logits then give each option's total log-probability (the past's last logits
predict its first token) and its per-token mean.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from promptlang.runtime.decoding.sampling import sequence_logprob


@dataclass(frozen=True, kw_only=True)
class PackedOptions:
    """The options' tokens as one pass's input: `starts[i]` is option i's first row."""

    starts: tuple[int, ...]
    token_ids: tuple[int, ...]
    positions: tuple[int, ...]
    groups: tuple[int, ...]         # the option each row belongs to


def pack_options(encoded: Sequence[Sequence[int]], position: int) -> PackedOptions:
    """The options' token ids (`encoded`, each non-empty) laid out for one pass, every
    option from `position`."""
    starts = []
    ids = []
    positions = []
    groups = []
    for index, option in enumerate(encoded):
        starts.append(len(ids))
        ids += option
        positions += range(position, position + len(option))
        groups += [index] * len(option)
    return PackedOptions(starts=tuple(starts), token_ids=tuple(ids),
                         positions=tuple(positions), groups=tuple(groups))


def option_scores(context: torch.Tensor, logits: torch.Tensor, packed: PackedOptions,
                  encoded: Sequence[Sequence[int]]) -> tuple[list[float], list[float]]:
    """(total, mean) log-probability of each option: `context` [V] is the past's last
    logits, `logits` [Q, V] the packed pass's."""
    sums = []
    means = []
    for start, option in zip(packed.starts, encoded):
        predictions = torch.cat([context[None], logits[start:start + len(option) - 1]])
        total = sequence_logprob(predictions, option)
        sums.append(total)
        means.append(total / len(option))
    return sums, means
