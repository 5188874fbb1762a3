"""kernels.c's few-rows attention (`native.few`): units of 1-3 query rows per KV head -- a
decode step's -- take scores straight from the stored key rows (no transposed blocks) and
read 16-bit stores without widening them into a buffer. Another summation order than the
tiles': the same numbers within float tolerance, equal to a float64 softmax, and bit for bit
the same whether a stored piece is 16-bit or its exact float32 widening. On CPUs without
AVX-512F the path does not exist and these tests skip."""

from __future__ import annotations

import pytest
import torch

from promptlang.runtime.fast import native
from promptlang.runtime.fast.fused import FusedDecoder
from promptlang.runtime.fast.pieces import Piece

from .test_fused import TOL, VOCAB, tiny

pytestmark = pytest.mark.skipif(not native.available() or not native.wide(),
                                reason="CPU kernels with 512-bit tiles unavailable here")


@pytest.fixture
def few_on():
    before = native.few()
    native.few(True)
    yield
    native.few(before)


def reference(rows, pieces, new, scale):
    """Softmax attention in float64: row r (token r % new) sees every past key and the new
    keys up to its own token."""
    heads, r, d = rows.shape
    keys = torch.cat([k for k, _, _ in pieces], 1).double()
    values = torch.cat([v for _, v, _ in pieces], 1).double()
    scores = rows.double() @ keys.transpose(1, 2) * scale
    past = keys.shape[1] - new
    for i in range(r):
        scores[:, i, past + i % new + 1:] = float("-inf")
    return torch.softmax(scores, -1) @ values


def case(heads, groups, d, lengths, new, seed):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(heads, groups * new, d, generator=g)
    pieces = [(torch.randn(heads, n, d, generator=g), torch.randn(heads, n, d, generator=g), False)
              for n in lengths]
    pieces.append((torch.randn(heads, new, d, generator=g), torch.randn(heads, new, d, generator=g),
                   True))
    return rows, pieces


@pytest.mark.parametrize("groups", [1, 2, 3])
@pytest.mark.parametrize("d", [16, 64, 80, 128])
@pytest.mark.parametrize("lengths", [[300], [130, 47], [5], [1, 9, 700]])
def test_few_rows_equal_the_tiles_and_a_float64_softmax(few_on, groups, d, lengths):
    rows, pieces = case(2, groups, d, lengths, 1, seed=d + groups)
    few, few_lse = native.attend(rows, pieces, 1, d ** -0.5, with_lse=True)
    native.few(False)
    tiles, tiles_lse = native.attend(rows, pieces, 1, d ** -0.5, with_lse=True)
    torch.testing.assert_close(few, tiles, rtol=0, atol=1e-5)
    torch.testing.assert_close(few_lse, tiles_lse, rtol=0, atol=1e-5)
    torch.testing.assert_close(few.double(), reference(rows, pieces, 1, d ** -0.5), rtol=0,
                               atol=1e-5)


def test_the_two_paths_really_differ(few_on):
    """Summation order: the switch chooses another kernel (else the test above proves nothing)."""
    rows, pieces = case(3, 3, 64, [300, 47], 1, seed=5)
    few = native.attend(rows, pieces, 1, 0.125)[0]
    native.few(False)
    assert not torch.equal(few, native.attend(rows, pieces, 1, 0.125)[0])


def test_more_rows_than_three_take_the_tiles(few_on):
    """2 new tokens x 3 query heads = 6 rows a KV head: the switch changes nothing."""
    rows, pieces = case(2, 3, 64, [300], 2, seed=6)
    few = native.attend(rows, pieces, 2, 0.125)[0]
    native.few(False)
    assert torch.equal(few, native.attend(rows, pieces, 2, 0.125)[0])


@pytest.fixture(scope="module")
def decoder64():
    """A tiny Llama with 64-dim heads (the default model's), 2 query heads per KV head."""
    found = FusedDecoder.of(tiny("llama", hidden_size=128, num_attention_heads=2,
                                 num_key_value_heads=1), "Llama")
    assert found is not None and found.head_dim == 64
    return found


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_a_16_bit_store_gives_its_float32_widening_bit_for_bit(few_on, decoder64, dtype):
    """A decode step over 16-bit pieces widens them in registers: the very numbers of the
    same pieces widened to float32 first (exact), over blocks of whole and partial keys."""
    dec = decoder64
    layers, heads, d = len(dec.layers), dec.kv_heads, dec.head_dim
    g = torch.Generator().manual_seed(9)
    half = [Piece(torch.randn(layers, heads, n, d, generator=g).to(dtype),
                  torch.randn(layers, heads, n, d, generator=g).to(dtype)) for n in (301, 13)]
    wide = [Piece(p.keys.float(), p.values.float()) for p in half]
    ids, positions = torch.tensor([7]), torch.tensor([314])

    def step(pieces):
        keys, values = torch.zeros(layers, heads, 1, d), torch.zeros(layers, heads, 1, d)
        logits = dec.forward(ids, positions, pieces, keys, values, torch.arange(1))
        assert logits is not None
        return logits, keys, values

    got, want = step(half), step(wide)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    native.few(False)
    for a, b in zip(step(half), got):                 # the tiles: the same within tolerance
        torch.testing.assert_close(a, b, rtol=0, atol=TOL)
    assert VOCAB == got[0].shape[-1]
