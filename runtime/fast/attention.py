"""pl_attend inside the RoPE attention (runtime/model/attention.py), for the common case.

The adapter hands a NativeAttention down with every pass it runs (the `promptlang_attend`
keyword). The attention calls it when every past key is visible and the new tokens are
causal among themselves (no mask), for one sequence without dropout; it serves up to
MAX_QUERIES new tokens on a CPU in one pass over every piece of keys -- the buffer's and
those read in place from stored units -- and answers None wherever it does not apply.
"""

from __future__ import annotations

import torch

import promptlang.runtime.fast.native as native
from promptlang.runtime.fast.pieces import layer_pieces

# New tokens up to which pl_attend serves a pass (it computes each causal block whole, so
# long causal passes stay on SDPA's causal kernel).
MAX_QUERIES = 64


class NativeAttention:
    """pl_attend over every past key and causally over the new ones."""

    __slots__ = ()

    def __call__(self, layer: int | None, shared, query: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, scaling: float | None) -> torch.Tensor | None:
        """[1, H_kv, G*Q, D] (the G query heads of a KV head as its rows), or None."""
        # query: [1, H, Q, D]; key, value: [1, H_kv, K, D], new tokens last
        q = query.shape[2]
        k = key.shape[2]
        if q > MAX_QUERIES or query.device.type != "cpu" or not native.enabled():
            return None
        pieces = [(keys[0], values[0], False)
                  for _, _, keys, values in layer_pieces(layer, shared, key, value, k - q)]
        pieces.append((key[0, :, k - q:], value[0, :, k - q:], True))
        b, heads, _, d = query.shape
        rows = query.reshape(b, key.shape[1], heads // key.shape[1] * q, d)[0]
        if not native.attend_fits(rows, pieces) or not native.available():
            return None
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        out, _ = native.attend(rows, pieces, q, scale)
        return out[None]
