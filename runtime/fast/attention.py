"""pl_attend and pl_causal inside the RoPE attention (runtime/model/attention.py), for the
common case.

The adapter hands a NativeAttention down with every pass it runs (the `promptlang_attend`
keyword). The attention calls it when every past key is visible and the new tokens are
causal among themselves (no mask), for one sequence without dropout. It serves up to
MAX_QUERIES new tokens on a CPU in one pass over every piece of keys -- the buffer's and
those read in place from stored units (pl_attend); a longer pass (a module's encode, a new
combination's recompute, a long prefill) takes pl_causal: in float32 where the 512-bit tiles
are on (AVX-512F), in bfloat16 (the bfloat16 twin's passes: runtime/model/compute.py) on a
CPU with AVX512-BF16, whose products are then bfloat16 as the pass's own are. It answers
None wherever neither applies (PyTorch's SDPA then serves the pass).
"""

from __future__ import annotations

import torch

import promptlang.runtime.fast.native as native
from promptlang.runtime.fast.pieces import layer_pieces

# New tokens up to which pl_attend serves a pass (it computes each causal block whole, so
# longer passes take pl_causal).
MAX_QUERIES = 64

# Inside `with long_causal_off():` long passes stay on SDPA (A/B measurements, tests).
_long_causal = native.Switch()
long_causal_off = _long_causal.off


class NativeAttention:
    """pl_attend over every past key and causally over the new ones."""

    __slots__ = ()

    def __call__(self, layer: int | None, shared, query: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, scaling: float | None) -> torch.Tensor | None:
        """[1, H_kv, G*Q, D] (the G query heads of a KV head as its rows), or None."""
        # query: [1, H, Q, D]; key, value: [1, H_kv, K, D], new tokens last
        q = query.shape[2]
        k = key.shape[2]
        if query.device.type != "cpu" or not native.enabled():
            return None
        if q > MAX_QUERIES:
            return _long_causal_pass(layer, shared, query, key, value, scaling)
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


def _long_causal_pass(layer: int | None, shared, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, scaling: float | None) -> torch.Tensor | None:
    """pl_causal for a long pass; else None. Past slots read in place from stored units
    (`shared`) are first copied beside the rest, in the pass's dtype: a few MB a layer,
    against the pass's quadratic attention."""
    # query: [1, H, Q, D]; key, value: [1, H_kv, K, D], new tokens last
    dtype = query.dtype
    _, heads, q, d = query.shape
    if not _long_causal or query.shape[0] != 1 or d % 32:
        return None
    if not native.available() or not native.causal_serves(dtype):       # before any copy
        return None
    past = key.shape[2] - q
    if shared:
        pieces = layer_pieces(layer, shared, key, value, past)
        key = torch.cat([keys.to(dtype) for _, _, keys, _ in pieces] + [key[:, :, past:]],
                        dim=2)
        value = torch.cat([values.to(dtype) for _, _, _, values in pieces]
                          + [value[:, :, past:]], dim=2)
    if not native.causal_fits(query[0], key[0], value[0]):
        return None
    kv_heads = key.shape[1]
    scale = scaling if scaling is not None else d ** -0.5
    out = native.causal(query[0], key[0], value[0], scale)
    return out.reshape(1, kv_heads, heads // kv_heads * q, d)
