"""The docs/DESIGN.md oracle: what a cached prefill must equal, computed in ONE forward pass of
an unmodified transformers model.

The reference model (`reference_model`) is a fresh instance of the model's class, built
from a copy of its config with a stock attention implementation ("sdpa" where the class
has one, else "eager") and loaded with a copy of its state dict. promptlang never touched
it: no hooks, no swapped forwards, no promptlang attention, no CPU kernels.
tests/runtime/test_reference_independent.py checks that, and that the reference pass
makes no call into promptlang.

The pass runs over every token occurrence of the request: each unit the request
serves plus its context units (placeholders included; a unit that is both served
and a context unit, or whose tokens another unit also holds, e.g. a scaffold's
modules, is one occurrence per unit), then the uncached segments. Tokens of
different occurrences may share a position (an argument sits in its placeholder's
slot). The 4-D mask is the visibility rule written out directly:

- a unit token t attends u iff u belongs to t's unit or (guaranteed context) to one
  of its context units, and pos(u) <= pos(t);
- an uncached token q attends u iff u is a non-placeholder token of a served unit or
  an uncached token, and pos(u) <= pos(q).

Recomputed tokens (`recomputed` positions, docs/RECOMPUTE.md) are uncached tokens like
any other: their served-unit occurrence stays in the pass (the unit's later tokens were
encoded against it) but leaves the request's tokens, replaced by an uncached copy.

Primed modules (recompute policies "P+primed", runtime/recompute/primer.py): a served unit
whose first token comes after a request token of another unit or of per-request text (not
an argument) gets one more occurrence, its *lead*: the token of its context units at the
highest position below the unit's first, placed at the position just before it (none
where that token already sits there). The lead attends to the unit's context units, and
only the unit's tokens attend to it. The rule is written out here again, from its
definition in docs/RECOMPUTE.md, not taken from the runtime.

A request without uncached tokens computes its last (highest-positioned) token
per request (engine.py): here that token becomes the one uncached query, and its
served occurrence drops out of the request's tokens.

How each position scheme gets the real positions, with the model's own code only:

- RoPE (Llama family) and learned positions (GPT-2): the model's forward takes
  `position_ids` and a 4-D float mask of 0 / -inf, so the pass is one plain call of
  the stock model.
- ALiBi (BLOOM): the stock forward builds its biases from the 2-D mask's cumulative
  sum (or the cache index) and rejects a 4-D mask, so no call of it can express
  occurrences that share a position. The reference is instead the stock forward
  written out over the model's own modules -- word embeddings, their layer norm,
  every `BloomBlock` called as is, the final norm, the LM head -- with the two inputs
  BloomModel.forward would have built passed explicitly: the 4-D mask above and the
  biases `slope_h * position(key)` (slopes from transformers' own
  `build_alibi_tensor`). Softmax is shift-invariant per row, so these equal the
  stock `slope_h * key index` whenever positions are contiguous (checked against the
  stock forward by test_reference_independent.py). A layout with filler tokens at
  the gaps (index == position) was rejected: a placeholder and its argument share a
  position, and the unit tokens after the placeholder must see the placeholder while
  the uncached tokens must see the argument, which no single index layout allows.
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass
from typing import Callable, Collection

import torch
import transformers
from transformers.cache_utils import DynamicCache

from promptlang.pml.binding import BoundPrompt


@dataclass
class OracleResult:
    logits: torch.Tensor      # [Q, V] of the uncached tokens, position order
    keys: torch.Tensor        # [L, H, N, D] of the request's tokens, position order
    values: torch.Tensor      # [L, H, N, D]
    positions: torch.Tensor   # [N] sorted
    token_ids: torch.Tensor   # [N]
    cached: torch.Tensor      # [N] bool: served from a unit (else computed per request)
    # every token occurrence of the pass, in pass order: position, in the request's tokens,
    # computed per request (the pass's query rows)
    occurrences: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    leads: int = 0            # primed units (their lead occurrences)


def oracle_prefill(adapter, bound: BoundPrompt, isolate: bool = False,
                   recomputed: Collection[int] = frozenset(),
                   parallel: "Parallel | None" = None,
                   attention: str | None = None, primed: bool = False,
                   renumber: Callable[[int], int] | None = None) -> OracleResult:
    """The reference prefill of `bound` for the model behind `adapter` (a ModelAdapter or
    the transformers model itself; only its weights and config are read). `recomputed`:
    positions of served tokens the request computes again (their uncached copies).
    `parallel`: APE (see `Parallel`) -- every uncached token attends to the request's served
    tokens at `parallel.positions` as contexts. `attention`: the reference's attention
    implementation where `parallel` is None (a test's recording one; default: stock).
    `primed`: the request's modules are primed (see the module docstring). `renumber`: the
    position each token computed per request is at (a request at contiguous positions:
    its served tokens all come before its first gap, where numbers do not change)."""
    layout = bound.layout
    units: list[str] = []

    def need(unit_id: str) -> None:
        if unit_id in units:
            return
        unit = layout.units[unit_id]
        for context_id in ([] if isolate else unit.context):
            need(context_id)
        units.append(unit_id)

    for unit_id in bound.units:
        need(unit_id)

    # one row per token occurrence; owner: index into `units`, len(units) for uncached
    uncached = len(units)
    ids, pos, owner, placeholder = [], [], [], []
    for index, unit_id in enumerate(units):
        for seg in layout.units[unit_id].segments:
            ids += seg.token_ids
            pos += range(seg.start, seg.start + len(seg.token_ids))
            owner += [index] * len(seg.token_ids)
            placeholder += [seg.kind == "param"] * len(seg.token_ids)
    for seg in bound.uncached:
        ids += seg.token_ids
        pos += range(seg.start, seg.start + len(seg.token_ids))
        owner += [uncached] * len(seg.token_ids)
        placeholder += [False] * len(seg.token_ids)
    served = {units.index(unit_id) for unit_id in bound.units}
    copies = [i for i in range(len(ids))
              if owner[i] in served and not placeholder[i] and pos[i] in recomputed]
    assert len(copies) == len(set(recomputed)), "a recomputed position holds no served token"
    for i in copies:
        ids.append(ids[i])
        pos.append(pos[i])
        owner.append(uncached)
        placeholder.append(False)
    request = [i for i in range(len(ids))
               if (owner[i] in served and not placeholder[i] and pos[i] not in recomputed)
               or owner[i] == uncached]
    last = max(request, key=lambda i: pos[i])
    if owner[last] != uncached:        # the last token is computed per request
        ids.append(ids[last])
        pos.append(pos[last])
        owner.append(uncached)
        placeholder.append(False)
        request = [i for i in request if i != last] + [len(ids) - 1]

    if renumber is not None:
        pos = [renumber(p) if owner[i] == uncached else p for i, p in enumerate(pos)]
    leads = _leads(bound, units, served, ids, pos, owner, placeholder) if primed and not isolate else []
    for unit, (token, at) in enumerate(leads, start=1):
        ids.append(token)
        pos.append(at[1])
        owner.append(uncached + unit)
        placeholder.append(False)

    n = len(ids)
    in_request = torch.zeros(n, dtype=torch.bool)
    in_request[request] = True
    position = torch.tensor(pos)
    code = torch.tensor(owner)
    # sees[a, b]: a token of occurrence a may attend the tokens of occurrence b
    sees = torch.eye(uncached + 1 + len(leads), dtype=torch.bool)
    if not isolate:
        for a, unit_id in enumerate(units):
            for context_id in layout.units[unit_id].context:
                sees[a, units.index(context_id)] = True
    for extra, (_, (a, _)) in enumerate(leads, start=uncached + 1):
        sees[extra, :uncached] = sees[a, :uncached]      # the lead sees the unit's context
        sees[extra, a] = False
        sees[a, extra] = True                            # and only the unit sees the lead
    allowed = sees[code][:, code]                                          # [n, n]
    allowed[code == uncached] = in_request
    allowed &= position[None, :] <= position[:, None]

    queries = torch.nonzero(code == uncached)[:, 0]
    queries = queries[torch.argsort(position[queries])]
    hf_model = getattr(adapter, "model", adapter)
    if parallel is None:
        logits, keys, values = reference_pass(reference_model(hf_model, attention),
                                              torch.tensor(ids), position, allowed, queries)
    else:
        served_token = in_request & (code != uncached)
        context = served_token & torch.isin(position, torch.tensor(sorted(parallel.positions),
                                                                    dtype=position.dtype))
        logits, keys, values = reference_pass(
            reference_model(hf_model, PARALLEL_ATTENTION), torch.tensor(ids), position,
            allowed, queries, parallel=(code == uncached, context, parallel.temperature,
                                        parallel.scale))
    order = torch.tensor(request)[torch.argsort(position[request])]
    return OracleResult(logits, keys[:, :, order], values[:, :, order], position[order],
                        torch.tensor(ids)[order], code[order] != uncached,
                        (position, in_request, code == uncached), len(leads))


def _leads(bound: BoundPrompt, units: list[str], served: set[int], ids, pos, owner,
           placeholder) -> list[tuple[int, tuple[int, int]]]:
    """(token id, (occurrence, position)) of each primed unit's lead (module docstring)."""
    layout = bound.layout
    arguments = {p for seg in bound.uncached if seg.kind == "argument"
                 for p in range(seg.start, seg.end)}
    uncached = len(units)
    found = []
    for a in sorted(served):
        unit = layout.units[units[a]]
        mine = [p for seg in unit.segments for p in range(seg.start, seg.end)]
        if not mine:
            continue
        first = min(mine)
        contexts = {units.index(c) for c in unit.context}
        before = [i for i in range(len(ids)) if pos[i] < first and owner[i] != a
                  and not placeholder[i]
                  and owner[i] not in contexts and (owner[i] in served or owner[i] == uncached)
                  and not (owner[i] == uncached and pos[i] in arguments)]
        context = [i for i in range(len(ids)) if owner[i] in contexts and pos[i] < first]
        if not before or not context:
            continue
        nearest = max(context, key=lambda i: pos[i])
        if pos[nearest] != first - 1:
            found.append((ids[nearest], (a, first - 1)))
    return found


def oracle_over_stored(adapter, expected: OracleResult, store_dtype: torch.dtype) -> OracleResult:
    """The reference for a store that keeps units at `store_dtype` (e.g. bfloat16): the
    request's cached tokens keep `expected`'s KV rounded to that dtype and widened back,
    and the uncached tokens are computed again over it -- one pass of the reference model
    with that KV as its cache, each uncached token attending to every request token at a
    position <= its own. (Units encoded against rounded context units carry a second-order
    difference this does not model; the tests bound it.)"""
    reference = reference_model(getattr(adapter, "model", adapter))
    dtype = expected.keys.dtype
    cached = expected.cached
    past_keys = expected.keys[:, :, cached].to(store_dtype).to(dtype)
    past_values = expected.values[:, :, cached].to(store_dtype).to(dtype)
    past_positions = expected.positions[cached]
    new_positions = expected.positions[~cached]                     # sorted: position order
    key_positions = torch.cat([past_positions, new_positions])
    allowed = key_positions[None, :] <= new_positions[:, None]      # [Q, S + Q]
    logits, keys, values = reference_pass(
        reference, expected.token_ids[~cached], new_positions, allowed,
        torch.arange(int(new_positions.shape[0])), (past_keys, past_values, past_positions))
    all_keys = torch.cat([past_keys, keys], dim=2)
    all_values = torch.cat([past_values, values], dim=2)
    order = torch.argsort(key_positions)
    return OracleResult(logits, all_keys[:, :, order], all_values[:, :, order],
                        key_positions[order], torch.cat([expected.token_ids[cached],
                                                         expected.token_ids[~cached]])[order],
                        torch.cat([torch.ones_like(past_positions, dtype=torch.bool),
                                   torch.zeros_like(new_positions, dtype=torch.bool)])[order])


# --- the unmodified reference model ---------------------------------------------------------------

_REFERENCES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def reference_model(hf_model: torch.nn.Module, attention: str | None = None) -> torch.nn.Module:
    """A fresh, unmodified instance of `hf_model`'s class holding a copy of its weights,
    kept while `hf_model` lives and its parameters are the same tensors, unchanged.
    `attention`: the attention implementation (default: "sdpa" where the class has one,
    else "eager"; PARALLEL_ATTENTION for APE's)."""
    params = tuple((p.data_ptr(), p._version) for p in hf_model.parameters())
    cached = _REFERENCES.setdefault(hf_model, {})
    hit = cached.get(attention)
    if hit is not None and hit[0] == params:
        return hit[1]
    config = copy.deepcopy(hf_model.config)
    name = attention or ("sdpa" if type(hf_model)._supports_sdpa else "eager")
    dtype = next(hf_model.parameters()).dtype
    reference = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=name,
                                                              dtype=dtype)
    reference.load_state_dict(hf_model.state_dict())      # copies into its own parameters
    reference.to(next(hf_model.parameters()).device).eval()
    cached[attention] = (params, reference)
    return reference


@torch.inference_mode()
def reference_pass(reference: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
                   allowed: torch.Tensor, logits_rows: torch.Tensor, past=None, parallel=None):
    """One forward pass of the reference model: logits [R, V] of `logits_rows` and the new
    tokens' keys/values [L, H_kv, Q, D].

    input_ids, positions: [Q]; allowed: [Q, S + Q] bool (past keys first); past: None or
    (keys [L, H_kv, S, D], values, positions [S]) put in the model's own DynamicCache.
    """
    device = next(reference.parameters()).device
    dtype = next(reference.parameters()).dtype
    input_ids, positions = input_ids.to(device), positions.to(device)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    mask.masked_fill_(~allowed.to(device), float("-inf"))
    mask = mask[None, None]                                                  # [1, 1, Q, S+Q]
    cache = DynamicCache(config=reference.config)
    past_len = 0
    key_positions = positions
    if past is not None:
        past_keys, past_values, past_positions = past
        for layer in range(past_keys.shape[0]):
            cache.update(past_keys[layer][None].to(device), past_values[layer][None].to(device),
                         layer)
        past_len = int(past_positions.shape[0])
        key_positions = torch.cat([past_positions.to(device), positions])
    if reference.config.model_type == "bloom":
        hidden = _bloom_layers(reference, input_ids, key_positions, mask, cache)
        logits = reference.lm_head(hidden[logits_rows.to(device)])
    else:
        extra = {} if parallel is None else {"oracle_parallel": parallel}
        out = reference(input_ids=input_ids[None], position_ids=positions[None],
                        attention_mask=mask, cache=cache, use_cache=True,
                        logits_to_keep=logits_rows.to(device), **extra)
        logits = out.logits[0]
    keys = torch.stack([layer.keys[0, :, past_len:] for layer in cache.layers])
    values = torch.stack([layer.values[0, :, past_len:] for layer in cache.layers])
    return logits, keys, values


def _bloom_layers(reference, input_ids, key_positions, mask, cache) -> torch.Tensor:
    """BloomModel.forward over the model's own modules, with the ALiBi biases of the real
    key positions and the 4-D mask passed in; the final hidden states [Q, hidden]."""
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    base = reference.transformer
    heads = reference.config.n_head
    dtype = next(reference.parameters()).dtype
    # slope_h * 1: the stock biases of key index 1
    slopes = build_alibi_tensor(torch.ones(1, 2, device=input_ids.device), heads,
                                torch.float32)[:, 0, 1]                       # [H]
    alibi = (slopes[:, None, None] * key_positions.to(torch.float32)).to(dtype)   # [H, 1, K]
    hidden = base.word_embeddings_layernorm(base.word_embeddings(input_ids[None]))
    for block in base.h:
        hidden = block(hidden, alibi=alibi, attention_mask=mask, layer_past=cache,
                       use_cache=True)[0]
    return base.ln_f(hidden)[0]


# --- APE's attention, written out for the reference ------------------------------------------

@dataclass(frozen=True)
class Parallel:
    """APE (arXiv 2502.05431) for the oracle: the served tokens at `positions` are the
    contexts; each uncached token's attention is a mix of two softmaxes -- over the
    context keys with their scores divided by `temperature`, and over the other keys it
    sees -- weighted by softmax(scale * temperature * L_C, L_O), L the log-sum-exps of the
    two parts' (tempered) scores."""

    positions: frozenset[int]
    temperature: float
    scale: float


PARALLEL_ATTENTION = "oracle_parallel"


def masked_scores(query, key, value, attention_mask, scaling):
    """(scores, values): eager attention's scores over the mask and the values, float64,
    grouped KV heads repeated. query: [B, H, Q, D]; key, value: [B, H_kv, K, D]."""
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1).double()
    value = value.repeat_interleave(groups, dim=1).double()
    scores = query.double() @ key.transpose(-1, -2) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask.double()
    return scores, value


def _parallel_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                        **kwargs):
    """Eager attention over the mask, written out per query row and per key set: plain
    softmax for the rows APE leaves alone, APE's mix for the others; (out [B, Q, H, D], None).
    `oracle_parallel` (from reference_pass): (rows [Q] bool, context [K] bool, T, S)."""
    # query: [B, H, Q, D]; key, value: [B, H_kv, K, D]; attention_mask: [B, 1, Q, K]
    scores, value = masked_scores(query, key, value, attention_mask, scaling)
    probabilities = torch.softmax(scores, dim=-1)
    parallel = kwargs.get("oracle_parallel")
    if parallel is not None:
        rows, context, temperature, scale = parallel
        for i in torch.nonzero(rows)[:, 0].tolist():
            row = scores[:, :, i]                                           # [B, H, K]
            tempered = row[..., context] / temperature
            other = row[..., ~context]
            lse = torch.stack([torch.logsumexp(tempered, -1) * scale * temperature,
                               torch.logsumexp(other, -1)])                # [2, B, H]
            share = torch.softmax(lse, dim=0)
            mixed = torch.zeros_like(row)
            if context.any():
                mixed[..., context] = share[0, ..., None] * torch.softmax(tempered, -1).nan_to_num()
            mixed[..., ~context] = share[1, ..., None] * torch.softmax(other, -1)
            probabilities[:, :, i] = mixed
    out = (probabilities @ value).to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


transformers.AttentionInterface.register(PARALLEL_ATTENTION, _parallel_attention)
