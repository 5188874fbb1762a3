"""Recompute passes on the fused layers: the positional rule without a mask.

A pass whose new tokens include recomputed ones is masked: a recomputed token sees only the
request tokens at positions <= its own. That rule is positional, so pl_decoder serves it with
the positions of the past keys instead of a [Q, S + Q] mask (runtime/model/adapter.py
`_fused_by_position`, in runs of fused.MAX_TOKENS). Every case here compares the fused pass
with transformers' layers on PyTorch's kernels given the explicit mask; the recompute oracle
(test_recompute.py) holds the whole request to docs/DESIGN.md's one masked forward pass.
"""

from __future__ import annotations

import pytest
import torch

from promptlang.runtime.fast import fused, native
from promptlang.runtime.model import Past, SharedKV, adapt
from promptlang.runtime.passes.prefill import visibility

from .test_fused import TOL, VOCAB, assert_close, encoded_past, tiny

pytestmark = pytest.mark.skipif(not native.available(), reason="CPU kernels unavailable here")


@pytest.fixture(scope="module")
def llama():
    return tiny("llama")


def spread(count: int, total: int, seed: int, sort: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(past positions, new positions): `count` of range(total) for the past, in slot order
    (shuffled unless `sort`), the rest increasing for the new tokens."""
    g = torch.Generator().manual_seed(seed)
    taken = torch.randperm(total, generator=g)
    past, new = taken[:count], taken[count:].sort().values
    return (past.sort().values if sort else past), new


def passes(adapter, ids, positions, past, rows, calls):
    """(fused pass, reference) as (logits, keys, values); the reference runs transformers'
    layers on PyTorch with the explicit positional mask."""
    allowed = visibility(past.positions, positions)
    assert allowed is not None
    out = []
    for reference in (False, True):
        copy = Past(past.keys.clone(), past.values.clone(), past.positions, past.shared)
        before = len(calls)
        if reference:
            with fused.disabled(), native.disabled():
                step = adapter.forward(ids, positions, copy, allowed, rows, by_position=True)
            assert len(calls) == before
        else:
            step = adapter.forward(ids, positions, copy, allowed, rows, by_position=True)
        out.append((step.logits, step.keys.clone(), step.values.clone()))
    return out


@pytest.fixture
def counted(monkeypatch):
    calls = []
    real = native.decoder
    monkeypatch.setattr(native, "decoder", lambda *a, **k: calls.append(a[-1] is not None) or real(*a, **k))
    return calls


@pytest.mark.parametrize("sort", [True, False], ids=["sorted past", "shuffled past"])
@pytest.mark.parametrize("new", [1, 9, 64, 100, 200])
def test_positional_pass_is_fused_and_equals_the_masked_layers(llama, counted, new, sort):
    adapter = adapt(llama)
    past_positions, new_positions = spread(600, 600 + new, seed=new, sort=sort)
    past = encoded_past(adapter, 600, 600 + new, seed=1)
    past = Past(past.keys, past.values, past_positions)
    ids = torch.randint(0, VOCAB, (new,), generator=torch.Generator().manual_seed(new))
    results = passes(adapter, ids, new_positions, past, torch.arange(new), counted)
    assert counted == [True] * -(-new // fused.MAX_TOKENS)     # one call per run, positions given
    assert_close(results)


def test_positional_pass_over_shared_and_16_bit_pieces(llama, counted):
    """Units read in place (stale buffer slots) and a bfloat16 unit, the past positions in
    unit order rather than sorted, recomputed tokens early in the layout."""
    adapter = adapt(llama)
    past = encoded_past(adapter, 500, 580)
    # slots: [0, 100) copied unit at positions 400..500, then units read in place
    positions = torch.cat([torch.arange(400, 500), torch.arange(0, 250), torch.arange(250, 400)])
    half = SharedKV(350, 500, past.keys[:, :, 350:500].to(torch.bfloat16),
                    past.values[:, :, 350:500].to(torch.bfloat16))
    plain = SharedKV(100, 350, past.keys[:, :, 100:350].clone(), past.values[:, :, 100:350].clone())
    keys, values = past.keys.clone(), past.values.clone()
    keys[:, :, 350:500] = half.keys.float()                # the reference reads them widened
    values[:, :, 350:500] = half.values.float()
    widened = Past(keys, values, positions)
    stale_keys, stale_values = keys.clone(), values.clone()
    stale_keys[:, :, 100:500], stale_values[:, :, 100:500] = 1e3, -1e3
    shared = Past(stale_keys, stale_values, positions, (plain, half))
    # recomputed-like tokens between units, then the question after everything
    new_positions = torch.tensor([120, 260, 261, 455] + list(range(500, 576)))     # 80 tokens
    ids = torch.randint(0, VOCAB, (80,), generator=torch.Generator().manual_seed(5))
    rows = torch.tensor([79, 0, 3])                         # out of order on purpose
    fast = passes(adapter, ids, new_positions, shared, rows, counted)[0]
    want = passes(adapter, ids, new_positions, widened, rows, counted)[1]
    assert counted[0] is True
    assert_close([fast, want])              # bfloat16 widens exactly: only the order of sums


def test_a_pass_with_option_groups_is_not_taken_as_positional(llama, counted):
    """`select` options scored side by side see only their own group: not the positional
    rule, so prefill never calls it that (the masked layers serve it)."""
    from promptlang.runtime.kv.assembler import Assembler
    from promptlang.runtime.passes.prefill import prefill

    adapter = adapt(llama)
    buffer = Assembler(adapter).acquire(40)
    prefill(adapter, buffer, list(range(3, 23)), list(range(20)))
    counted.clear()
    prefill(adapter, buffer, [5, 6, 7, 8], [20, 21, 20, 21], groups=[0, 0, 1, 1])
    assert counted == []
