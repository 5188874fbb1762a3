"""The unit of storage: the attention keys and values of one encoded unit.

A unit is what the encoder encodes in one pass and the store keeps under one key: a
module, or a scaffold's modules jointly (promptlang/pml/layout.py `Unit`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class UnitKV:
    """Keys and values of one unit (a module, or a scaffold's modules jointly),
    for every layer, at `num_key_value_heads` (never after repeat_kv)."""

    keys: torch.Tensor          # [L, H_kv, S, D_k]
    values: torch.Tensor        # [L, H_kv, S, D_v]
    positions: torch.Tensor     # [S] int64: layout position of each token
    token_ids: torch.Tensor     # [S] int64
    placeholder: torch.Tensor   # [S] bool: parameter placeholders, left out of requests

    @property
    def length(self) -> int:
        return int(self.positions.shape[0])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in
                   (self.keys, self.values, self.positions, self.token_ids, self.placeholder))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "UnitKV":
        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=non_blocking)

        return UnitKV(move(self.keys), move(self.values), move(self.positions),
                      move(self.token_ids), move(self.placeholder))


