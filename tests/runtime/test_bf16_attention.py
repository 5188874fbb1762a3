"""Attention with bfloat16 products (fused.py `bf16_attention`, kernels.c `bf`): Q.K and P.V
from bf16-rounded inputs with float32 sums, for the rows of requests that bring at least
BF_MIN_TOKENS (8) new tokens. An approximation of the float32 pass, so it is measured against
it: close (bf16 rounding), never equal where it runs, equal where it does not (decode
steps, heads whose size is not a multiple of 32, the switch off), and a request's numbers
do not depend on the batch it runs in."""

from __future__ import annotations

import pytest
import torch

from promptlang.runtime.fast import native
from promptlang.runtime.fast.fused import FusedDecoder

from .test_fused import TOL, tiny
from .test_fused_batch import alone, piece, request

pytestmark = pytest.mark.skipif(
    not native.available() or not native.products_available("bf16"),
    reason="needs the CPU kernels and AVX512_BF16")

BF_MIN_TOKENS = 8     # kernels.c


def fused(hidden: int = 128) -> FusedDecoder:
    """A tiny Llama with 4 heads of hidden / 4 (32: the bf16 tiles' multiple)."""
    found = FusedDecoder.of(tiny("llama", hidden_size=hidden, intermediate_size=128), "Llama")
    assert found is not None
    return found


def both(dec: FusedDecoder, r):
    dec.bf16_attention = False
    exact = alone(dec, r)
    dec.bf16_attention = True
    try:
        return exact, alone(dec, r)
    finally:
        dec.bf16_attention = False


@pytest.mark.parametrize("hidden", [128, 256])
@pytest.mark.parametrize("tokens,past", [(8, 40), (20, 300), (64, 700)])
def test_a_prefill_s_attention_in_bf16_is_close_to_float32_and_not_equal(hidden, tokens, past):
    dec = fused(hidden)
    layers, heads, d = len(dec.layers), dec.kv_heads, dec.head_dim
    r = request(dec, [piece(layers, heads, past, d, 1)], tokens, past, 5)
    (logits, keys, values), (bf_logits, bf_keys, bf_values) = both(dec, r)
    scale = logits.abs().max().item()
    for a, b in ((logits, bf_logits), (keys, bf_keys), (values, bf_values)):
        assert not torch.equal(a, b)                       # the bf16 products ran
    # bf16 inputs: ~2^-9 relative each; through every layer of the tiny model
    assert (logits - bf_logits).abs().max().item() < 2e-2 * max(scale, 1.0)
    assert (keys - bf_keys).abs().max().item() < 5e-2


@pytest.mark.parametrize("tokens", [1, 3, BF_MIN_TOKENS - 1])
def test_decode_steps_and_short_passes_stay_float32(tokens):
    dec = fused()
    layers, heads, d = len(dec.layers), dec.kv_heads, dec.head_dim
    r = request(dec, [piece(layers, heads, 200, d, 2)], tokens, 200, 6)
    exact, bf = both(dec, r)
    for a, b in zip(exact, bf):
        assert torch.equal(a, b)


def test_heads_of_16_stay_float32():
    dec = fused(hidden=64)
    layers, heads, d = len(dec.layers), dec.kv_heads, dec.head_dim
    assert d == 16
    r = request(dec, [piece(layers, heads, 100, d, 3)], 12, 100, 7)
    exact, bf = both(dec, r)
    for a, b in zip(exact, bf):
        assert torch.equal(a, b)


@pytest.mark.parametrize("positioned", [False, True], ids=["all visible", "by position"])
def test_a_request_in_a_batch_differs_from_alone_by_bf16_rounding_only(positioned):
    """Rounding P to bf16 after the running maximum of each key range makes a request's
    numbers depend on how its keys are split into tasks (which the batch decides) at bf16
    level: close, never equal bit for bit -- said in docs. Alone, twice: the same."""
    dec = fused()
    layers, heads, d = len(dec.layers), dec.kv_heads, dec.head_dim
    shared = piece(layers, heads, 150, d, 4)          # a unit two requests read in place
    requests = [
        request(dec, [shared], 12, 150, 10, positioned),                       # bf16
        request(dec, [shared, piece(layers, heads, 9, d, 5)], 1, 159, 11, positioned),
        request(dec, [shared], 9, 150, 12, positioned),                        # bf16
        request(dec, [piece(layers, heads, 40, d, 6)], 3, 40, 13, positioned),
    ]
    dec.bf16_attention = True
    try:
        expected = [alone(dec, r) for r in requests]
        for r, (logits, keys, _) in zip(requests, expected):
            again = alone(dec, r)
            assert torch.equal(again[0], logits) and torch.equal(again[1], keys)
        got = dec.forward_batch(requests)
        for r, logits, (want, keys, values) in zip(requests, got, expected):
            tolerance = 2e-2 if r.input_ids.shape[0] >= BF_MIN_TOKENS else TOL
            assert (logits - want).abs().max() < tolerance
            assert (r.new_keys - keys).abs().max() < max(tolerance, TOL)
    finally:
        dec.bf16_attention = False


def test_load_turns_it_on(tiny_model_dir):
    from promptlang.runtime import engine

    assert engine.load(tiny_model_dir, bf16_attention=True).adapter.fast.decoder.bf16_attention
    assert not engine.load(tiny_model_dir).adapter.fast.decoder.bf16_attention
