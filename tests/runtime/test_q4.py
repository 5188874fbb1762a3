"""Linear weights served from Q4_1 blocks (a GGUF's, as stored) in the fused decoder layers
(runtime/fast/fused.py attach_blocks, kernels.c dots_q4) for passes of up to 3 rows: the same
values as the float32 weights, so every pass gives the float path's results exactly, reading
~6.4x fewer weight bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from promptlang.runtime.fast import native
from promptlang.runtime.fast.fused import _WEIGHTS
from promptlang.runtime.model import Past, adapt
from tests.runtime.test_fused import VOCAB, encoded_past, tiny

pytestmark = pytest.mark.skipif(not native.available(), reason="CPU kernels unavailable here")

LINEARS = [name for name in _WEIGHTS if name.endswith("proj.weight")]


def q4_model(**extra):
    """A tiny Llama whose linear weights are exactly Q4_1 values; with their blocks."""
    model = tiny("llama", hidden_size=64, intermediate_size=128, **extra)
    blocks = {}
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            for name in LINEARS:
                weight = layer.get_parameter(name)
                q = quantize(weight.numpy(), GGMLQuantizationType.Q4_1)
                weight.copy_(torch.from_numpy(dequantize(q, GGMLQuantizationType.Q4_1)))
                blocks[(i, name)] = torch.from_numpy(np.ascontiguousarray(q))
    return model, blocks


def passes(adapter, new: int, past_len: int = 40):
    past = encoded_past(adapter, past_len, past_len + new)
    ids = torch.randint(0, VOCAB, (new,), generator=torch.Generator().manual_seed(new))
    copy = Past(past.keys.clone(), past.values.clone(), past.positions, past.shared)
    step = adapter.forward(ids, torch.arange(past_len, past_len + new), copy, None,
                           torch.arange(new))
    return step.logits, step.keys.clone(), step.values.clone()


def test_dequantized_blocks_are_gguf_s_values_bit_for_bit():
    w = torch.randn(48, 96)
    q = quantize(w.numpy(), GGMLQuantizationType.Q4_1)
    ours = native.q_dequant(torch.from_numpy(np.ascontiguousarray(q)), 96)
    assert torch.equal(ours, torch.from_numpy(dequantize(q, GGMLQuantizationType.Q4_1)))


@pytest.mark.parametrize("extra", [{}, {"attention_bias": True, "mlp_bias": True}])
@pytest.mark.parametrize("new", [1, 2, 3, 7, 19])
def test_a_pass_from_q4_blocks_equals_the_float_pass_exactly(extra, new):
    model, blocks = q4_model(**extra)
    adapter = adapt(model)
    decoder = adapter.fast.decoder
    float_pass = passes(adapter, new)
    assert decoder.attach_blocks(blocks) == len(blocks) == 3 * len(LINEARS)
    quantized = passes(adapter, new)
    for a, b in zip(float_pass, quantized):
        assert torch.equal(a, b)


def test_blocks_that_are_not_the_weights_values_stay_float():
    model, blocks = q4_model()
    wrong = dict(blocks)
    key = (1, "mlp.up_proj.weight")
    wrong[key] = wrong[key].clone()
    wrong[key][0, 5] ^= 0x11                      # one byte of one block
    decoder = adapt(model).fast.decoder
    assert decoder.attach_blocks(wrong) == len(blocks) - 1


def test_a_float_weight_changed_later_turns_the_blocks_off():
    model, blocks = q4_model()
    adapter = adapt(model)
    assert adapter.fast.decoder.attach_blocks(blocks) == len(blocks)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(-1.0)      # in place
    assert adapter.fast.decoder.quantized_weights == 0
    changed = passes(adapter, 5)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(-1.0)
    assert not torch.equal(changed[0], passes(adapter, 5)[0])      # the change was seen


def test_q8_0_blocks_dequantize_to_gguf_s_values_and_serve_the_lm_head():
    w = torch.randn(70, 64)
    q = torch.from_numpy(np.ascontiguousarray(quantize(w.numpy(), GGMLQuantizationType.Q8_0)))
    exact = torch.from_numpy(dequantize(q.numpy(), GGMLQuantizationType.Q8_0))
    assert torch.equal(native.q_dequant(q, 64, kind=8), exact)
    model, _ = q4_model()
    with torch.no_grad():
        model.lm_head.weight = torch.nn.Parameter(torch.randn(VOCAB, 64))
        head = quantize(model.lm_head.weight.numpy(), GGMLQuantizationType.Q8_0)
        model.lm_head.weight.copy_(torch.from_numpy(dequantize(head, GGMLQuantizationType.Q8_0)))
    adapter = adapt(model)
    float_pass = passes(adapter, 2)
    assert adapter.fast.decoder.attach_q8_head(torch.from_numpy(np.ascontiguousarray(head)))
    # the same weight values; torch's head sums in an order of its own
    torch.testing.assert_close(passes(adapter, 2)[0], float_pass[0], rtol=0, atol=1e-5)
    assert not adapter.fast.decoder.attach_q8_head(torch.zeros_like(torch.from_numpy(head)))


def test_passes_of_up_to_three_rows_are_handed_the_blocks(monkeypatch):
    model, blocks = q4_model()
    adapter = adapt(model)
    adapter.fast.decoder.attach_blocks(blocks)
    handed = []
    real = native.decoder

    def spy(*args, **kwargs):
        handed.append(kwargs.get("quantized") is not None)
        return real(*args, **kwargs)
    monkeypatch.setattr(native, "decoder", spy)
    passes(adapter, 1)
    assert handed == [True]     # (kernels.c takes float weights above 3 rows -- 64 with the
                                # 512-bit tiles -- itself)


def test_the_default_model_serves_its_gguf_s_q4_1_weights():
    from promptlang.runtime import engine

    quantized, plain = engine.load(), engine.load(quantized=False)
    config = quantized.adapter.model.config
    assert quantized.adapter.fast.decoder.quantized_weights == 7 * config.num_hidden_layers
    assert quantized.adapter.fast.decoder._q8_head is not None      # the tied Q8_0 head
    assert plain.adapter.fast.decoder.quantized_weights == 0
    prompt = "<prompt schema='q4'><doc/><user>Where is the tower?</user><assistant></prompt>"
    schema = ("<schema name='q4'><system>Answer briefly.</system><module name='doc'>The tower "
              "stands in the old town, by the river.</module></schema>")
    texts = []
    for llm in (quantized, plain):
        llm.add_schema(schema)
        texts.append(llm.generate(prompt, max_new_tokens=8, temperature=0).token_ids)
    assert texts[0] == texts[1]
