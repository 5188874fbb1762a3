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




def bytes_per_token(layers: int, kv_heads: int, key_dim: int, value_dim: int,
                    dtype: torch.dtype) -> int:
    """The bytes `UnitKV.nbytes` counts per token when keys and values are kept in `dtype`:
    the keys and values of every layer, plus its position, token id and placeholder flag."""
    kv = layers * kv_heads * (key_dim + value_dim) * dtype.itemsize
    return kv + torch.int64.itemsize * 2 + torch.bool.itemsize
