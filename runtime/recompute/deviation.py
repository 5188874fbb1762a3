"""The deviation policy's measure: how far each cached token's KV is from a full prefill's.

One pass over the whole request, every token at its position and attending causally by
position (what a full prefill computes), stopped once layer DEVIATION_LAYER has written
its keys and values (`layer_kv`). Each candidate's deviation is the squared distance
between those and its stored ones (keys and values each scaled by their mean squared
norm over the candidates). Candidates are the cached tokens whose encoding missed a
request token before them: a token of unit U is one iff some request token at a lower
position is neither in U nor (guaranteed context) in U's context units -- another
module, an argument, or uncached text. The others computed exactly what a full prefill
computes, up to rounding. The pass costs about (DEVIATION_LAYER + 1) / layers of a full
prefill.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from promptlang.errors import InternalError
from promptlang.pml.binding import BoundPrompt
from promptlang.runtime.kv.unit import UnitKV
from promptlang.runtime.model import ModelAdapter, Past

DEVIATION_LAYER = 1      # layer 0's KV depends on the token alone; layer 1's on its context


def candidates(bound: BoundPrompt, context_of: Callable[[str], Sequence[str]],
               arguments: bool = True) -> dict[str, list[int]]:
    """Per served unit, the positions of its cached tokens whose encoding missed a request
    token at a lower position (see the module docstring). With `arguments=False` an
    argument in a parameter slot does not count as missed (the `seams` policy: a module's
    tokens after its parameter keep the KV they computed against the placeholders)."""
    first_seen: dict[str, int] = {}         # each origin's first position that counts
    for seg, origin in bound.segments():
        if seg.token_ids and (arguments or seg.kind != "argument"):
            first_seen.setdefault(origin, seg.start)
    by_unit: dict[str, list] = {}
    for seg, origin in bound.segments():
        if seg.token_ids and origin != "uncached":
            by_unit.setdefault(origin, []).append(seg)
    found = {}
    for unit in bound.units:
        seen = {unit, *context_of(unit)}
        missed = [start for origin, start in first_seen.items() if origin not in seen]
        if not missed:
            continue
        first_missed = min(missed)
        mine = [p for seg in by_unit.get(unit, ()) if seg.end > first_missed
                for p in range(max(seg.start, first_missed + 1), seg.end)]
        if mine:
            found[unit] = mine
    return found


def deviations(adapter: ModelAdapter, bound: BoundPrompt, units: dict[str, UnitKV],
               context_of: Callable[[str], Sequence[str]]) -> dict[int, float]:
    """Each candidate's deviation (position -> score) at layer DEVIATION_LAYER."""
    chosen = candidates(bound, context_of)
    if not chosen:
        return {}
    sequence = bound.sequence()
    positions = torch.tensor([p for _, p, _ in sequence], device=adapter.device)
    layer = min(DEVIATION_LAYER, adapter.kv_shape.layers - 1)
    full_keys, full_values = layer_kv(adapter, [t for t, _, _ in sequence], positions, layer)
    dk = []
    dv = []
    nk = []
    nv = []
    where = []
    for unit, wanted in chosen.items():
        kv = units[unit]
        wanted_t = torch.tensor(wanted, device=kv.positions.device)
        index = torch.nonzero(torch.isin(kv.positions, wanted_t)).flatten()    # in the unit
        at = torch.searchsorted(positions, kv.positions[index].to(positions.device))
        # [H_kv, n, D] each
        stored_k = kv.keys[layer][:, index].to(full_keys.dtype)
        stored_v = kv.values[layer][:, index].to(full_values.dtype)
        fresh_k = full_keys[:, at]
        fresh_v = full_values[:, at]
        dk.append((fresh_k - stored_k).pow(2).sum((0, 2)))
        dv.append((fresh_v - stored_v).pow(2).sum((0, 2)))
        nk.append(stored_k.pow(2).sum((0, 2)))
        nv.append(stored_v.pow(2).sum((0, 2)))
        where += kv.positions[index].tolist()
    dk = torch.cat(dk)
    dv = torch.cat(dv)
    scale_k = float(torch.cat(nk).mean()) or 1.0
    scale_v = float(torch.cat(nv).mean()) or 1.0
    score = dk / scale_k + dv / scale_v
    return dict(zip(where, score.tolist()))


class _Stop(Exception):
    """Raised by a forward hook once the wanted layer's KV is written."""


@torch.inference_mode()
def layer_kv(adapter: ModelAdapter, token_ids: Sequence[int], positions: torch.Tensor,
             layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ([H_kv, N, D] each) of `layer` for `token_ids` at `positions`
    (sorted), each token attending to those at positions <= its own: a full prefill
    stopped after that layer's attention."""
    n = len(token_ids)
    keys, values = adapter.empty_kv(n)
    past = Past(keys, values, positions.new_empty(0))

    def stop(*_):
        raise _Stop

    hook = _attention_module(adapter, layer).register_forward_hook(stop)
    chunk_size = adapter.chunk_size
    adapter.chunk_size = 1 << 30     # one pass: stop once
    try:
        adapter.forward(torch.tensor(list(token_ids), device=adapter.device), positions,
                        past, None, None)
    except _Stop:
        pass
    else:
        raise InternalError("the forward pass never reached the layer's attention")
    finally:
        hook.remove()
        adapter.chunk_size = chunk_size
    return keys[layer], values[layer]


def _attention_module(adapter: ModelAdapter, layer: int) -> torch.nn.Module:
    """The attention block of decoder layer `layer` (where its KV is written)."""
    count = adapter.kv_shape.layers
    blocks = next((m for m in adapter.model.modules()
                   if isinstance(m, torch.nn.ModuleList) and len(m) == count), None)
    if blocks is None:
        raise InternalError(f"cannot find the decoder layers of {adapter.model_type}")
    block = blocks[layer]
    for name in ("self_attn", "self_attention", "attn", "attention"):
        child = getattr(block, name, None)
        if isinstance(child, torch.nn.Module):
            return child
    return block
