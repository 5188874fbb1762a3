"""K-quant (Q4_K, Q5_K, Q6_K), Q5_0, Q8_0 and Q4_1 blocks read as a GGUF stores them
(kernels.c: the 256-bit kq_chunk8 and the 512-bit kq_chunk, their row functions and tiles;
native.q_dequant, native.linear_q), on the 256-bit tiles and on the 512-bit ones where the
CPU has AVX-512F.

The oracle is the `gguf` package's own reference dequantizers, which we did not write: block
by block, the kernels' float32 weights must be theirs bit for bit. gguf-py cannot quantize to
the K-quants, so the blocks are random bytes with finite float16 scales written in: every
byte pattern of the quantized parts is a valid block."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from promptlang.errors import InvalidArgumentError
from promptlang.runtime.fast import native

pytestmark = pytest.mark.skipif(not native.available(), reason="CPU kernels unavailable here")


@pytest.fixture(params=["256-bit", "512-bit"], autouse=True)
def tiles(request):
    """Every test on the 256-bit tiles and again on the 512-bit ones (where the CPU has
    AVX-512F): each makes the weights its own way."""
    was = native.wide()
    if request.param == "512-bit" and not native.wide(True):
        native.wide(was)
        pytest.skip("this CPU has no AVX-512F")
    native.wide(request.param == "512-bit")
    yield request.param
    native.wide(was)

# kind -> (ggml type, offsets of the float16 fields in a block)
KINDS = {4: (GGMLQuantizationType.Q4_1, (0, 2)), 6: (GGMLQuantizationType.Q5_0, (0,)),
         8: (GGMLQuantizationType.Q8_0, (0,)),
         12: (GGMLQuantizationType.Q4_K, (0, 2)),
         13: (GGMLQuantizationType.Q5_K, (0, 2)),
         14: (GGMLQuantizationType.Q6_K, (208,))}


def random_blocks(kind: int, rows: int, k: int, seed: int = 0) -> torch.Tensor:
    """[rows, k / block * bytes] uint8: random quantized bytes, finite random scales."""
    _, per_block, nbytes = native.KINDS[kind]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * (k // per_block), nbytes), dtype=np.uint8)
    for offset in KINDS[kind][1]:
        scales = rng.uniform(-0.05, 0.05, size=blocks.shape[0]).astype(np.float16)
        blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(np.ascontiguousarray(blocks.reshape(rows, -1)))


def gguf_weights(kind: int, blocks: torch.Tensor, k: int) -> torch.Tensor:
    values = dequantize(blocks.numpy(), KINDS[kind][0])
    return torch.from_numpy(np.ascontiguousarray(values)).reshape(blocks.shape[0], k)


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("k", [256, 768, 4864])
def test_blocks_dequantize_to_gguf_s_values_bit_for_bit(kind, k):
    blocks = random_blocks(kind, 7, k, seed=k + kind)
    ours = native.q_dequant(blocks, k, kind=kind)
    theirs = gguf_weights(kind, blocks, k)
    assert theirs.abs().sum() > 0 and torch.isfinite(theirs).all()
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("m", [1, 2, 3, 5, 17])
def test_a_linear_layer_from_the_blocks_equals_the_float_weights_one(kind, m):
    k, n = 512, 40
    blocks = random_blocks(kind, n, k, seed=m)
    weights = gguf_weights(kind, blocks, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    ours = native.linear_q(x, blocks, kind)
    assert ours.shape == (m, n)
    torch.testing.assert_close(ours, x @ weights.T, rtol=1e-4, atol=1e-4)   # another order
    assert torch.equal(ours, native.linear_q(x, blocks, kind))       # deterministic


def test_the_float_pass_over_the_same_values_gives_the_same_bits():
    """pl_linear over gguf's float weights and pl_linear_q over the blocks: the same tiles in
    the same order, so the same sums."""
    k, n = 512, 24
    for kind in sorted(KINDS):
        blocks = random_blocks(kind, n, k, seed=kind)
        weights = gguf_weights(kind, blocks, k).contiguous()
        for m in (1, 3, 9):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            assert torch.equal(native.linear_q(x, blocks, kind), native.linear(x, weights, None)), \
                (kind, m)


def test_blocks_of_the_wrong_shape_or_kind_are_refused():
    blocks = random_blocks(12, 2, 256)
    with pytest.raises(InvalidArgumentError, match="k a multiple of 256"):
        native.q_dequant(blocks, 96, kind=12)
    with pytest.raises(InvalidArgumentError, match="no block kind 99; the kernels read"):
        native.q_dequant(blocks, 256, kind=99)
    with pytest.raises(InvalidArgumentError, match="Q6_K blocks"):
        native.linear_q(torch.randn(1, 256), blocks, 14)


# a GGUF's usual mix (llama.cpp's Q4_K_M): K-quants where a row is whole super-blocks
MIX = {"self_attn.q_proj.weight": 12, "self_attn.k_proj.weight": 12,
       "self_attn.v_proj.weight": 14, "self_attn.o_proj.weight": 6,
       "mlp.gate_proj.weight": 13, "mlp.up_proj.weight": 12, "mlp.down_proj.weight": 14}


def kquant_model():
    """A tiny Llama (rows of 256 and 512 weights) whose linear weights are exactly the values
    of random blocks of the kinds in MIX; with those blocks, as (kind, blocks) pairs."""
    from tests.runtime.test_fused import tiny

    model = tiny("llama", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                 num_key_value_heads=2)
    blocks = {}
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            for j, (name, kind) in enumerate(MIX.items()):
                weight = layer.get_parameter(name)
                q = random_blocks(kind, weight.shape[0], weight.shape[1], seed=10 * i + j)
                weight.copy_(gguf_weights(kind, q, weight.shape[1]) * 0.1)
                blocks[(i, name)] = (kind, q)
    return model, blocks


@pytest.mark.parametrize("new", [1, 3, 9])
def test_a_pass_from_a_mix_of_k_quant_blocks_equals_the_float_pass_exactly(new):
    from promptlang.runtime.model import adapt
    from tests.runtime.test_q4 import passes

    model, blocks = kquant_model()
    adapter = adapt(model)
    decoder = adapter.fast.decoder
    float_pass = passes(adapter, new)
    # the weights hold a tenth of the blocks' values: none is attached
    assert decoder.attach_blocks(blocks, kind=None) == 0
    with torch.no_grad():
        for (i, name), (kind, q) in blocks.items():
            weight = model.model.layers[i].get_parameter(name)
            weight.copy_(gguf_weights(kind, q, weight.shape[1]))
    float_pass = passes(adapter, new)
    assert decoder.attach_blocks(blocks, kind=None) == len(blocks) == 3 * len(MIX)
    quantized = passes(adapter, new)
    for a, b in zip(float_pass, quantized):
        assert torch.isfinite(a).all()
        assert torch.equal(a, b)


def test_the_pass_reads_the_blocks_themselves():
    """A block changed after it was attached (and checked) changes the pass: the kernels read
    the blocks, not the float copy."""
    from promptlang.runtime.model import adapt
    from tests.runtime.test_q4 import passes

    model, blocks = kquant_model()
    with torch.no_grad():
        for (i, name), (kind, q) in blocks.items():
            weight = model.model.layers[i].get_parameter(name)
            weight.copy_(gguf_weights(kind, q, weight.shape[1]))
    adapter = adapt(model)
    assert adapter.fast.decoder.attach_blocks(blocks, kind=None) == len(blocks)
    before = passes(adapter, 2)[0]
    kind, q = blocks[(1, "mlp.down_proj.weight")]
    q[:, 208:210] = 0                    # every Q6_K super-block's d: the weights become 0
    assert not torch.equal(passes(adapter, 2)[0], before)
