"""The attention of RoPE models: new tokens against a long cache, without Q x K masks.

transformers calls `attention` in every layer (registered under ATTENTION by the RoPE
adapter, runtime/model/schemes.py). A mask of None means: every past key visible, the new
tokens causal among themselves (they are the last Q keys) -- the common cached prefill,
every decode step and every plain causal pass. The paths, in the order they are tried:

    contexts    APE's attention over contexts encoded apart (`promptlang_contexts`, a
                ParallelContexts over every key slot): scores in float32, any mask
    native      the adapter's fast attention (pl_attend, runtime/fast/attention.py), no mask
    shared      past slots read in place from stored units: each piece attended apart
    causal      no past, no mask: SDPA's own causal kernel
    past+new    (CPU) past keys and the new ones attended apart, merged by log-sum-exp
    masked      many query rows: SDPA with the 4-D mask as given
    packed      grouped-query heads folded into query rows, mask repeated per group

Grouped-query heads are never expanded by transformers' `repeat_kv` copy of every cached
key and value: query heads i*G..i*G+G-1 share KV head i. Masks are built or packed once per
forward pass, in the `promptlang_masks` dict the adapter passes down, and reused by every
layer. A call without that dict comes from outside the runtime and is transformers' own
SDPA, as if the model were not adapted.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from promptlang.runtime.fast.pieces import layer_pieces
from promptlang.runtime.model.internals import (FLASH_WITH_LSE, causal_mask_function,
                                                sdpa_attention_forward, sdpa_mask)

ATTENTION = "promptlang_sdpa"
_PACK_MAX_QUERIES = 512     # beyond it, enough rows to keep every core busy unpacked


def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
              is_causal=None, **kwargs):
    """SDPA for new tokens against a long cache; (out [B, Q, H, D], None)."""
    # query: [B, H, Q, D]; key, value: [B, H_kv, K, D] (past first, new last); mask: [B|1, 1, Q, K]
    if kwargs.get("promptlang_masks") is None:
        return _outside_attention(module, query, key, value, attention_mask, dropout, scaling,
                                  is_causal, kwargs)
    sink = kwargs.get("promptlang_query")
    if sink is not None:                # the last token's rotated query (capture_query)
        sink[module.layer_idx] = query[-1, :, -1].float()
    shared = kwargs.get("promptlang_shared")
    needs_sdpa = (kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None
                  or kwargs.get("output_attentions"))
    if not shared and needs_sdpa:
        if attention_mask is None and query.shape[2] != key.shape[2]:
            attention_mask = _memo(kwargs, ("causal", 1, query.shape[2], key.shape[2]),
                                   lambda: _causal_mask(1, query.shape[2], key.shape[2],
                                                        query.dtype, query.device))
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=True, **kwargs)
    b, heads, q, d = query.shape
    kv_heads = key.shape[1]
    k = key.shape[2]
    groups = heads // kv_heads
    out = None
    native = kwargs.get("promptlang_attend")
    contexts = kwargs.get("promptlang_contexts")
    if contexts is not None:
        out = _parallel(module.layer_idx, shared, query, key, value, attention_mask, scaling,
                        contexts, kwargs)
    elif native is not None and attention_mask is None and b == 1 and not dropout:
        out = native(getattr(module, "layer_idx", None), shared, query, key, value, scaling)
    if out is not None:
        pass                                     # the native kernel served it
    elif shared:
        out = _with_shared(module.layer_idx, shared, query, key, value, attention_mask,
                           scaling, kwargs)
    elif attention_mask is None and q == k:
        out = F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, scale=scaling,
                                             is_causal=q > 1, enable_gqa=groups > 1)
    elif attention_mask is None and q > 1 and _splits_past(query, dropout):
        out = _past_and_new(query, key, value, scaling, kwargs)
    elif q > _PACK_MAX_QUERIES:
        out = _masked(query, key, value, attention_mask, dropout, scaling, kwargs)
    else:
        out = _packed(query, key, value, attention_mask, dropout, scaling, kwargs)
    out = out.reshape(b, heads, q, value.shape[-1]).transpose(1, 2).contiguous()
    return out, None                                                   # [B, Q, H, D]


def attention_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0,
                   mask_function=causal_mask_function, attention_mask=None, local_size=None,
                   allow_is_causal_skip=True, **kwargs):
    """transformers' mask hook for `attention`: None where `attention` reads None right
    (plain causal, the new tokens last, no padding), else SDPA's boolean mask."""
    plain_causal = (allow_is_causal_skip and mask_function is causal_mask_function
                    and local_size is None)
    new_last = kv_offset == 0 and int(q_offset) == kv_length - q_length
    if plain_causal and new_last and (attention_mask is None or bool(attention_mask.all())):
        return None
    return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function,
                     attention_mask, local_size=local_size, allow_is_causal_skip=False, **kwargs)


def _outside_attention(module, query, key, value, attention_mask, dropout, scaling, is_causal,
                       kwargs):
    """transformers' SDPA attention for a call from outside the runtime. `attention_mask`
    answers None for every causal pass with the new tokens last; SDPA's own causal flag
    aligns to the first key, so a None mask over a past is written out here."""
    # query: [B, H, Q, D]; key, value: [B, H_kv, K, D]
    q = query.shape[2]
    k = key.shape[2]
    if attention_mask is None and 1 < q != k:
        attention_mask = _causal_mask(1, q, k, query.dtype, query.device)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                  scaling=scaling, is_causal=is_causal, **kwargs)


def _masked(query, key, value, mask, dropout, scaling, kwargs) -> torch.Tensor:
    """SDPA with the mask (None: causal over the last Q keys) as one [Q, K] block."""
    # query: [B, H, Q, D]; key, value: [B, H_kv, K, D]
    q = query.shape[2]
    k = key.shape[2]
    groups = query.shape[1] // key.shape[1]
    block = _memo(kwargs, ("mask", id(mask), 1, q, k),
                  lambda: _additive(mask, 1, q, k, query.dtype, query.device))
    return F.scaled_dot_product_attention(query, key, value, attn_mask=block, dropout_p=dropout,
                                          scale=scaling, enable_gqa=groups > 1)


def _packed(query, key, value, mask, dropout, scaling, kwargs) -> torch.Tensor:
    """SDPA over the G query heads of each KV head packed as its rows; [B, H_kv, G*Q, D]."""
    # query: [B, H, Q, D]; key, value: [B, H_kv, K, D]
    q = query.shape[2]
    k = key.shape[2]
    groups = query.shape[1] // key.shape[1]
    block = None
    if mask is not None or q > 1:
        block = _memo(kwargs, ("mask", id(mask), groups, q, k),
                      lambda: _additive(mask, groups, q, k, query.dtype, query.device))
    return F.scaled_dot_product_attention(_rows(query, key.shape[1]), key, value,
                                          attn_mask=block, dropout_p=dropout, scale=scaling)


def _splits_past(query: torch.Tensor, dropout: float) -> bool:
    return FLASH_WITH_LSE is not None and query.device.type == "cpu" and not dropout


def _past_and_new(query, key, value, scaling, kwargs) -> torch.Tensor:
    """Attention of Q new tokens to every past key and causally to each other, as two
    unmasked (or tiny-masked) flash passes merged by log-sum-exp; [B, H_kv, G*Q, D]."""
    # query: [B, H, Q, D]; key, value: [B, H_kv, S + Q, D]
    past = key.shape[2] - query.shape[2]
    rows = _rows(query, key.shape[1])
    return _merge([FLASH_WITH_LSE(rows, key[:, :, :past], value[:, :, :past], scale=scaling),
                   _new_block(query, key[:, :, past:], value[:, :, past:], scaling, kwargs)])


def _with_shared(layer: int, shared, query, key, value, mask, scaling, kwargs) -> torch.Tensor:
    """Attention when some past slots are read from stored units' tensors (SharedKV) rather
    than from `key`/`value`: each piece of keys attended apart, the results merged by
    log-sum-exp; [B, H_kv, G*Q, D]. `mask` None or [B|1, 1, Q, K] as in `attention`."""
    # query: [B, H, Q, D]; key, value: [B, H_kv, K, D] over every slot, shared ones stale
    q = query.shape[2]
    k = key.shape[2]
    groups = query.shape[1] // key.shape[1]
    rows = _rows(query, key.shape[1])
    if mask is None:                             # every past key visible, the new ones causal
        parts = [FLASH_WITH_LSE(rows, keys, values, scale=scaling)
                 for _, _, keys, values in _pieces_as(query.dtype, layer, shared, key, value,
                                                      k - q)]
        parts.append(_new_block(query, key[:, :, k - q:], value[:, :, k - q:], scaling, kwargs))
        return _merge(parts)
    parts = []
    for start, end, keys, values in _pieces_as(query.dtype, layer, shared, key, value, k):
        piece_mask = _memo(kwargs, ("piece", id(mask), start, end, groups),
                           lambda: _additive(mask[..., start:end], groups, q, end - start,
                                             query.dtype, query.device))
        out, lse = FLASH_WITH_LSE(rows, keys, values, attn_mask=piece_mask, scale=scaling)
        # the kernel reports a log-sum-exp of 0 for a row that sees no key of the piece
        seen = (piece_mask > float("-inf")).any(-1)                  # [B|1, 1, G*Q]
        parts.append((out, lse.masked_fill(~seen, float("-inf"))))
    return _merge(parts)


def _parallel(layer: int, shared, query, key, value, mask, scaling, contexts,
              kwargs) -> torch.Tensor:
    """APE's attention (ParallelContexts, runtime/model/adapter.py): the context keys'
    scores divided by the temperature and softmaxed apart from the other keys', the two
    parts mixed by softmax(scale * temperature * L_C, L_O); [B, H_kv, G*Q, D]. `mask` as
    in `attention`; `contexts.context`: [K] bool over every key slot."""
    # query: [B, H, Q, D]; key, value: [B, H_kv, K, D], shared slots stale there
    q = query.shape[2]
    k = key.shape[2]
    groups = query.shape[1] // key.shape[1]
    rows = _rows(query, key.shape[1]).float()
    pieces = layer_pieces(layer, shared, key, value, k)
    scores = torch.cat([rows @ keys.float().transpose(-1, -2) for _, _, keys, _ in pieces], -1)
    scores.mul_(scaling if scaling is not None else query.shape[-1] ** -0.5)   # [B, H_kv, R, K]
    scores += _memo(kwargs, ("contexts-mask", id(mask), groups, q, k),
                    lambda: _additive(mask, groups, q, k, torch.float32, query.device))
    flags = contexts.context[:k]
    scores = torch.where(flags, scores / contexts.temperature, scores)
    none = torch.tensor(float("-inf"), device=scores.device)
    lse_context = torch.where(flags, scores, none).logsumexp(-1, keepdim=True)
    lse_other = torch.where(flags, none, scores).logsumexp(-1, keepdim=True)
    mix = torch.softmax(torch.cat([lse_context * (contexts.scale * contexts.temperature),
                                   lse_other], -1), -1)                      # [B, H_kv, R, 2]
    # a row that sees no context key: L_C = -inf, its part weighs 0 (and is not NaN)
    lse_context = lse_context.masked_fill(lse_context == float("-inf"), 0)
    weights = torch.where(flags, (scores - lse_context).exp() * mix[..., :1],
                          (scores - lse_other).exp() * mix[..., 1:])
    out = None
    for start, end, _, values in pieces:
        part = weights[..., start:end] @ values.float()
        out = part if out is None else out.add_(part)
    return out.to(query.dtype)


def _pieces_as(dtype: torch.dtype, layer: int, shared, key, value, end: int):
    """layer_pieces, each piece's keys and values in `dtype` (a bfloat16 pass reads stored
    float32 units: runtime/model/compute.py)."""
    return [(start, stop, keys.to(dtype), values.to(dtype))
            for start, stop, keys, values in layer_pieces(layer, shared, key, value, end)]


def _rows(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, H, Q, D] -> [B, H_kv, G*Q, D]: the query heads sharing a KV head as its rows."""
    b, heads, q, d = query.shape
    return query.reshape(b, kv_heads, heads // kv_heads * q, d)


def _new_block(query, new_keys, new_values, scaling, kwargs):
    """(out, lse) of the Q new tokens attending causally to each other, in packed rows."""
    # query: [B, H, Q, D]; new_keys, new_values: [B, H_kv, Q, D]
    b, heads, q, d = query.shape
    kv_heads = new_keys.shape[1]
    groups = heads // kv_heads
    rows = _rows(query, kv_heads)
    if q == 1:
        return FLASH_WITH_LSE(rows, new_keys, new_values, scale=scaling)
    if q <= _PACK_MAX_QUERIES:                   # packed rows need a [G*Q, Q] causal block
        block = _memo(kwargs, ("causal", groups, q, q),
                      lambda: _causal_mask(groups, q, q, query.dtype, query.device))
        return FLASH_WITH_LSE(rows, new_keys, new_values, attn_mask=block, scale=scaling)
    out, lse = FLASH_WITH_LSE(query, new_keys, new_values, is_causal=True, scale=scaling)
    return out.reshape(b, kv_heads, groups * q, d), lse.reshape(b, kv_heads, groups * q)


def _merge(parts) -> torch.Tensor:
    """Attention over the union of disjoint key sets, from each set's (out, log-sum-exp)."""
    # out: [B, H_kv, R, D]; lse: [B, H_kv, R] float32
    if len(parts) == 2:
        (out_a, lse_a), (out_b, lse_b) = parts
        share = torch.sigmoid(lse_a - lse_b).unsqueeze(-1)           # weight of the first set
        return torch.lerp(out_b, out_a, share.to(out_a.dtype))
    weights = torch.softmax(torch.stack([lse for _, lse in parts]), 0).unsqueeze(-1)
    out = parts[0][0] * weights[0].to(parts[0][0].dtype)
    for (part, _), weight in zip(parts[1:], weights[1:]):
        out.add_(part * weight.to(part.dtype))
    return out


def _memo(kwargs, key, build):
    """`build()`, kept for the rest of this forward pass when the adapter passed a memo."""
    memo = kwargs.get("promptlang_masks")
    if memo is None:
        return build()
    hit = memo.get(key)
    if hit is None:
        hit = memo[key] = build()
    return hit


def _additive(mask, groups: int, q: int, k: int, dtype, device) -> torch.Tensor:
    """[B|1, 1, groups*Q, K] additive mask for query rows packed `groups` at a time; a mask
    of None is the causal block over the last Q keys with every earlier key visible."""
    if mask is None:
        return _causal_mask(groups, q, k, dtype, device)
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(~mask,
                                                                                float("-inf"))
    return mask if groups == 1 else mask.repeat(1, 1, groups, 1)


def _causal_mask(groups: int, q: int, k: int, dtype, device) -> torch.Tensor:
    mask = torch.zeros(groups, q, k, dtype=dtype, device=device)
    later = torch.ones(q, q, dtype=torch.bool, device=device).triu(1)
    mask[:, :, k - q:].masked_fill_(later, float("-inf"))
    return mask.view(1, 1, groups * q, k)
