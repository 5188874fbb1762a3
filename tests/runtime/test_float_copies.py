"""Linear weights and the LM head kept as a GGUF's blocks only (runtime/fast/blocks.py
BlockLinear and BlockEmbedding, FusedDecoder.drop_float_copies): every pass -- the fused
decoder's of any row count, and transformers' own path past its 64 tokens -- gives exactly
what it gave with the float copies, and the copies are gone from the model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from promptlang.runtime.fast import native
from promptlang.runtime.fast.blocks import BlockEmbedding, BlockLinear
from promptlang.runtime.model import adapt
from tests.runtime.test_kquants import gguf_weights, random_blocks
from tests.runtime.test_q4 import passes

pytestmark = pytest.mark.skipif(not native.available(), reason="CPU kernels unavailable here")

MIX = {"self_attn.q_proj.weight": 12, "self_attn.k_proj.weight": 6,
       "self_attn.v_proj.weight": 14, "self_attn.o_proj.weight": 8,
       "mlp.gate_proj.weight": 13, "mlp.up_proj.weight": 4, "mlp.down_proj.weight": 14}


def served_model():
    """A tiny Llama with a tied head whose linear weights and embedding are exactly the
    values of blocks (a GGUF's mix of kinds, a Q8_0 embedding); its adapter, with the blocks
    attached."""
    from tests.runtime.test_fused import tiny

    model = tiny("llama", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=True)
    blocks = {}
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            for j, (name, kind) in enumerate(MIX.items()):
                weight = layer.get_parameter(name)
                if kind == 4:
                    q = quantize(weight.numpy(), GGMLQuantizationType.Q4_1)
                    q = torch.from_numpy(np.ascontiguousarray(q))
                else:
                    q = random_blocks(kind, weight.shape[0], weight.shape[1], seed=10 * i + j)
                values = native.q_dequant(q, weight.shape[1], kind=kind)
                weight.copy_(values)
                blocks[(i, name)] = (kind, q)
        embed = model.model.embed_tokens.weight
        head = quantize(embed.numpy(), GGMLQuantizationType.Q8_0)
        embed.copy_(torch.from_numpy(dequantize(head, GGMLQuantizationType.Q8_0)))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    adapter = adapt(model)
    decoder = adapter.fast.decoder
    served = len(model.model.layers) * len(MIX)
    assert decoder.attach_blocks(blocks, kind=None) == len(blocks) == served
    assert decoder.attach_q8_head(torch.from_numpy(np.ascontiguousarray(head)))
    return model, adapter


@pytest.mark.parametrize("new", [1, 3, 9, 70])
def test_every_pass_gives_the_float_copies_results_exactly(new):
    model, adapter = served_model()
    before = passes(adapter, new)
    weights = {name: p.clone() for name, p in model.named_parameters()}
    freed = adapter.fast.decoder.drop_float_copies()
    layer = model.model.layers[1]
    assert type(layer.mlp.down_proj) is BlockLinear and type(model.lm_head) is BlockLinear
    assert type(model.model.embed_tokens) is BlockEmbedding
    left = dict(model.named_parameters())
    assert not any(name.endswith("proj.weight") or "embed" in name for name in left)
    gone = sum(w.numel() * 4 for name, w in weights.items() if name not in left)
    assert freed == gone > 0          # the linear weights and the tied embedding, each once
    assert torch.equal(layer.mlp.down_proj.weight, weights["model.layers.1.mlp.down_proj.weight"])
    after = passes(adapter, new)
    for a, b in zip(before, after):
        assert torch.isfinite(a).all()
        assert torch.equal(a, b)


def test_the_narrow_tiles_read_the_blocks_for_every_row_count():
    """With the 256-bit tiles, passes of more than 3 rows took the float copies: kept as
    blocks only, pl_decoder reads the blocks for them (the same tiles, the same sums)."""
    wide = native.wide()
    try:
        native.wide(False)
        model, adapter = served_model()
        before = passes(adapter, 9)
        adapter.fast.decoder.drop_float_copies()
        after = passes(adapter, 9)
    finally:
        native.wide(wide)
    for a, b in zip(before, after):
        assert torch.equal(a, b)


def test_the_float_copies_come_back_inside_quantized_off_and_on_restore():
    model, adapter = served_model()
    decoder = adapter.fast.decoder
    float_values = {name: p.clone() for name, p in model.named_parameters()}
    decoder.drop_float_copies()
    assert not decoder.float_copies
    with decoder.quantized_off():
        assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear
        assert decoder.float_copies and decoder.quantized_weights == 0
        inside = passes(adapter, 2)
    assert type(model.model.layers[0].self_attn.q_proj) is BlockLinear
    assert decoder.quantized_weights == len(model.model.layers) * len(MIX)
    decoder.restore_float_copies()
    assert model.lm_head.weight is model.model.embed_tokens.weight      # tied again
    restored = dict(model.named_parameters())
    assert all(torch.equal(restored[name], value) for name, value in float_values.items())
    assert decoder.quantized_weights == len(model.model.layers) * len(MIX)     # still served
    decoder.drop_float_copies()
    with decoder.quantized_off():
        again = passes(adapter, 2)
    for a, b in zip(inside, again):
        assert torch.equal(a, b)


def test_the_layers_let_go_are_freed_at_once_not_by_the_collector():
    """A float copy left to the garbage collector keeps its whole mapped file resident until
    the collector runs: the layers replaced (and the head) must go when they are dropped."""
    import gc
    import weakref

    model, adapter = served_model()
    old = [weakref.ref(model.model.layers[0].mlp.down_proj),
           weakref.ref(model.model.layers[-1].self_attn.q_proj), weakref.ref(model.lm_head),
           weakref.ref(model.model.layers[-1].mlp.down_proj.weight)]
    gc.disable()
    try:
        adapter.fast.decoder.drop_float_copies()
        assert [ref() for ref in old] == [None] * len(old)
    finally:
        gc.enable()


def test_the_state_dict_is_the_float_models():
    """A copy of the model loads the state dict as its own: the same keys, the same values."""
    model, adapter = served_model()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    adapter.fast.decoder.drop_float_copies()
    after = model.state_dict()
    assert set(after) == set(before)
    assert all(torch.equal(after[name], value) for name, value in before.items())


def test_a_block_embedding_looks_up_the_tables_rows():
    blocks = random_blocks(8, 50, 64, seed=3)
    table = gguf_weights(8, blocks, 64)
    embedding = BlockEmbedding(torch.nn.Embedding(50, 64, device="meta"), blocks)
    ids = torch.tensor([[3, 0, 49], [7, 7, 12]])
    assert torch.equal(embedding(ids), table[ids])
    assert torch.equal(embedding.weight, table)
    with pytest.raises(IndexError, match="out of range for an embedding of 50 rows"):
        embedding(torch.tensor([50]))
    assert embedding.to(torch.bfloat16)(ids).dtype == torch.bfloat16     # a bfloat16 twin's


def test_a_seam_adapter_s_weights_are_read_where_the_float_copies_were_dropped():
    """Policy `tuned` swaps merged weights into the attention projections for its passes
    (runtime/model/seam.py): a layer kept as blocks must read the swapped weight, not its
    blocks, and the swap must reach the layers in the model now, not those it replaced."""
    from promptlang.runtime.model.lora import SeamLoRA, shape_of
    from promptlang.runtime.model.seam import SeamModel
    from tests.runtime.test_tune import _trained_like

    model, adapter = served_model()
    lora = _trained_like(SeamLoRA(shape_of(model, rank=4, alpha=8.0), seed=1))
    seam = SeamModel(adapter, lora, name="test", source="test")
    with_copies = passes(seam, 3)
    assert not torch.allclose(with_copies[0], passes(adapter, 3)[0], atol=1e-3)
    adapter.fast.decoder.drop_float_copies()
    assert type(model.model.layers[0].self_attn.q_proj) is BlockLinear
    dropped = passes(seam, 3)
    for a, b in zip(with_copies, dropped):      # F.linear against pl_linear's sums
        assert float((a - b).abs().max()) <= 1e-5 * float(a.abs().max())
    # and the base model's passes are the base model's again after the seam's
    assert model.model.layers[0].self_attn.q_proj._parameters["weight"] is None
