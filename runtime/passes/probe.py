"""The query policy's measure: how much the request's last token attends to each cached token.

`query:K` recomputes the K candidates (cached tokens whose encoding missed a request token
before them; deviation.candidates) that matter most to this request's answer, judged by the
request itself: a probe pass computes the request's own tokens over its cached ones as
stored (what `none` serves), the last token's rotated query of every layer is captured
(ModelAdapter.capture_query), and each cached token's score is the attention that query
gives it, summed over layers and heads (each head's softmax over every key the token sees).
The probe costs one cached prefill; the recompute pass then computes the K tokens and the
request's own tokens again. Why the last token: docs/RECOMPUTE.md, "query:K".
"""

from __future__ import annotations

import torch

from promptlang.errors import InternalError, UnsupportedModelError
from promptlang.runtime.kv.assembler import request_keys
from promptlang.runtime.fast.pieces import past_pieces
from promptlang.runtime.model import Past
from promptlang.runtime.passes.prefill import prefill, uncached_tokens, with_last
from promptlang.runtime.kv.plan import NO_RECOMPUTE


def attention_mass(query: torch.Tensor, past: Past, length: int,
                   scaling: float) -> torch.Tensor:
    """[length] per slot: the attention `query` ([L, heads, D], rotated, unscaled) gives
    each of the first `length` slots of `past` (a buffer's, the query's own token among
    them), summed over layers and heads; each head's softmax runs over all of them."""
    layers, heads, d = query.shape
    pieces = [p.keys for p in past_pieces(past.keys, past.values, past.shared, length)]
    kv_heads = pieces[0].shape[1]
    grouped = query.reshape(layers, kv_heads, heads // kv_heads, d)
    scores = torch.cat([torch.einsum("lhgd,lhnd->lhgn", grouped, keys.float())
                        for keys in pieces], dim=-1) * scaling        # [L, H_kv, G, S]
    weights = torch.softmax(scores, dim=-1)
    return weights.sum(dim=(0, 1, 2))


def top_candidates(mass: torch.Tensor, slot_positions: torch.Tensor, candidates: list[int],
                   k: int) -> list[int]:
    """The positions of the `k` candidates with the largest `mass` (per slot, slots at
    `slot_positions`), ties to the lower position; position order."""
    if k <= 0 or not candidates:
        return []
    where = {int(p): i for i, p in enumerate(slot_positions.tolist())}
    ranked = sorted((p for p in candidates if p in where),
                    key=lambda p: (-float(mass[where[p]]), p))
    return sorted(ranked[:k])


def probe_choice(adapter, assembler, bound, units, found: dict[str, list[int]],
                 k: int) -> list[int]:
    """query:K for one request: the positions of the `k` candidates (`found`, per unit)
    its last token attends to most when its own tokens are computed over the cached ones
    as stored. `units`: the (key, UnitKV) pairs the request serves (engine.py), assembled
    into a buffer of the assembler's for the probe and released after it."""
    if not adapter.attends_in_parallel:
        raise UnsupportedModelError(f"recompute policy 'query:{k}' needs a RoPE model (Llama "
                                    f"family) with promptlang's attention; this one is "
                                    f"{adapter.model_type!r}")
    wanted = [p for positions in found.values() for p in positions]
    if k <= 0 or not wanted:
        return []
    ids, positions = uncached_tokens(bound.uncached)
    cached = sum(int((~kv.placeholder).sum()) for _, kv in units)
    buffer = assembler.acquire(cached + len(ids) + 1, request_keys(units, NO_RECOMPUTE))
    try:
        assembler.assemble(buffer, units, NO_RECOMPUTE)
        ids, positions = with_last(buffer, ids, positions)       # as the engine does
        with adapter.capture_query() as query:
            prefill(adapter, buffer, ids, positions, all_logits=False)
        if not bool(query.any()):                        # a path that does not capture it
            raise InternalError("the probe pass did not capture the last token's query")
        mass = attention_mass(query, buffer.past(), buffer.length, attention_scaling(adapter))
        return top_candidates(mass, buffer.positions[:buffer.length], wanted, k)
    finally:
        assembler.release(buffer)


def attention_scaling(adapter) -> float:
    """The factor the model's attention scales its scores by (1/sqrt(head_dim) unless its
    attention modules say otherwise)."""
    for module in adapter.model.modules():
        scaling = getattr(module, "scaling", None)
        if isinstance(scaling, float):
            return scaling
    return adapter.kv_shape.key_dim ** -0.5
