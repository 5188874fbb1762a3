"""The linear layers' dot tiles on 512-bit vectors (kernels.c dots_w, `native.wide`) beside
the 256-bit ones: both equal F.linear within float tolerance, and in each a row's numbers do
not depend on how many rows its pass has -- what makes a request in a batch give the same
tokens as alone -- and the Q4_1 blocks still give the float weights' results bit for bit.
The 512-bit cases skip on CPUs without AVX-512F (the 256-bit path is then the only one)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from promptlang.runtime.fast import native
from promptlang.runtime.model import adapt
from tests.runtime.test_q4 import LINEARS, passes, q4_model

pytestmark = pytest.mark.skipif(not native.available(), reason="CPU kernels unavailable here")


@pytest.fixture(params=[False, True], ids=["256-bit", "512-bit"])
def tiles(request):
    before = native.wide()
    if request.param and not native.wide(True):
        native.wide(before)
        pytest.skip("this CPU has no AVX-512F")
    native.wide(request.param)
    yield request.param
    native.wide(before)


def test_the_switch_answers_what_it_set(tiles):
    assert native.wide() is tiles


# k = 72: not a multiple of 16, so the 256-bit tiles serve it in both modes
@pytest.mark.parametrize("k,n", [(64, 37), (576, 1536), (1536, 576), (72, 20)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 11, 13, 32, 64])
def test_linear_equals_f_linear(tiles, m, k, n):
    g = torch.Generator().manual_seed(m * 7 + k)
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    torch.testing.assert_close(native.linear(x, w, b), F.linear(x, w, b), rtol=1e-5,
                               atol=1e-4 * k ** 0.5)


@pytest.mark.parametrize("k", [64, 576, 72])
def test_a_row_gets_the_same_numbers_in_a_pass_of_any_size(tiles, k):
    g = torch.Generator().manual_seed(k)
    x, w = torch.randn(20, k, generator=g), torch.randn(45, k, generator=g)
    alone = torch.cat([native.linear(x[i:i + 1], w, None) for i in range(20)])
    for m in range(1, 21):
        assert torch.equal(native.linear(x[:m], w, None), alone[:m]), m


def test_the_two_widths_differ_by_summation_order_only():
    if not native.wide():
        pytest.skip("this CPU has no AVX-512F (or PROMPTLANG_AVX512=0)")
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(9, 576, generator=g), torch.randn(100, 576, generator=g)
    wide = native.linear(x, w, None)
    try:
        native.wide(False)
        narrow = native.linear(x, w, None)
    finally:
        native.wide(True)
    assert not torch.equal(wide, narrow)             # really two paths ...
    torch.testing.assert_close(wide, narrow, rtol=1e-5, atol=1e-4)    # ... the same sums


@pytest.mark.parametrize("new", [1, 3, 8, 19])
def test_q4_blocks_give_the_float_pass_bit_for_bit(tiles, new):
    model, blocks = q4_model()
    adapter = adapt(model)
    float_pass = passes(adapter, new)
    assert adapter.fast.decoder.attach_blocks(blocks) == 3 * len(LINEARS)
    for a, b in zip(float_pass, passes(adapter, new)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("new,lengths", [(1, [300]), (3, [130, 47]), (20, [700, 5, 260])])
def test_the_attention_s_wide_tiles_give_the_same_numbers_bit_for_bit(new, lengths):
    """The 512-bit QK and PV tiles do each lane's multiply-adds in the 256-bit order: the
    same outputs and log-sum-exps exactly (past segments of several lengths, causal new
    tokens; 3 query rows per KV head per new token, so 20 tokens take the wide tiles)."""
    if not native.wide():
        pytest.skip("this CPU has no AVX-512F (or PROMPTLANG_AVX512=0)")
    g = torch.Generator().manual_seed(new)
    heads, groups, d = 3, 3, 64
    rows = torch.randn(heads, groups * new, d, generator=g)
    pieces = [(torch.randn(heads, n, d, generator=g), torch.randn(heads, n, d, generator=g), False)
              for n in lengths]
    pieces.append((torch.randn(heads, new, d, generator=g), torch.randn(heads, new, d, generator=g),
                   True))
    few = native.few()               # 1 new token: 3 rows a KV head, the few-rows path's
    native.few(False)
    try:
        wide, wide_lse = native.attend(rows, pieces, new, 0.125, with_lse=True)
        native.wide(False)
        narrow, narrow_lse = native.attend(rows, pieces, new, 0.125, with_lse=True)
    finally:
        native.wide(True)
        native.few(few)
    assert torch.equal(wide, narrow) and torch.equal(wide_lse, narrow_lse)
