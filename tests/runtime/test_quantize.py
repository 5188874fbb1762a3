"""Weight-only quantization of a float checkpoint (runtime/model/quantize.py, `load(quantize=)`):
the model computes with its blocks' values everywhere, the fused layers read the blocks
(Q4_1, or Q8_0: kernels.c's second block kind for decoder layers), every pass equals the
float pass over those values, the docs/DESIGN.md oracle holds, and bad requests are clear errors."""

from __future__ import annotations

import pytest
import torch

from promptlang.errors import ModelError
from promptlang.runtime import engine
from promptlang.runtime.fast import native
from promptlang.runtime.model import adapt
from promptlang.runtime.model.quantize import LINEARS, SCHEMES, attach, quantize_model

from .test_oracle import PROMPTS, assert_matches_oracle, make_llm
from .test_q4 import passes
from .tiny import tiny_model

pytestmark = pytest.mark.skipif(not native.available(), reason="CPU kernels unavailable here")

# relative error of a random normal weight matrix after quantization, at most (Q4_1: 16
# levels per block of 32; Q8_0: 255)
BOUND = {"q4_1": 0.15, "q8_0": 0.01}


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_every_linear_weight_becomes_its_blocks_values(scheme):
    model = tiny_model("llama")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    linears, head = quantize_model(model, scheme)
    assert set(linears) == {(i, name) for i in range(len(model.model.layers))
                            for name in LINEARS}
    for (i, name), blocks in linears.items():
        weight = model.model.layers[i].get_parameter(name)
        assert torch.equal(native.q_dequant(blocks, weight.shape[1], kind=SCHEMES[scheme]),
                           weight)
        original = before[f"model.layers.{i}.{name}"]
        assert 0 < ((weight - original).norm() / original.norm()).item() < BOUND[scheme]
    assert torch.equal(native.q_dequant(head, model.config.hidden_size, kind=8),
                       model.lm_head.weight)
    for name, p in model.named_parameters():          # the norms stay as they were
        if p.dim() == 1:
            assert torch.equal(p, before[name])


@pytest.mark.parametrize("new", [1, 3, 7, 19, 40])
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_a_pass_from_the_blocks_equals_the_float_pass_over_their_values(scheme, new):
    model = tiny_model("llama")
    blocks = quantize_model(model, scheme)
    adapter = adapt(model)
    float_pass = passes(adapter, new)
    attach(adapter.fast.decoder, blocks, scheme)
    assert adapter.fast.decoder.quantized_weights == len(model.model.layers) * len(LINEARS)
    assert adapter.fast.decoder._q8_head is not None
    logits, keys, values = passes(adapter, new)
    assert torch.equal(keys, float_pass[1]) and torch.equal(values, float_pass[2])
    # the Q8_0 head: the same weight values, summed in an order of its own
    torch.testing.assert_close(logits, float_pass[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_the_oracle_holds_on_a_quantized_model(scheme, tmp_path):
    model = tiny_model("llama")
    blocks = quantize_model(model, scheme)
    llm = make_llm(model, tmp_path)
    attach(llm.adapter.fast.decoder, blocks, scheme)
    assert llm.adapter.fast.decoder.quantized_weights > 0
    for case in ("nested modules", "union", "cache false"):
        assert_matches_oracle(llm, PROMPTS[case], isolate=False)


def test_load_quantizes_a_float_checkpoint_and_keys_its_kv_apart(tiny_model_dir):
    plain = engine.load(tiny_model_dir)
    eight = engine.load(tiny_model_dir, quantize="q8_0")
    layers = plain.adapter.model.config.num_hidden_layers
    assert plain.adapter.fast.decoder.quantized_weights == 0
    assert eight.adapter.fast.decoder.quantized_weights == layers * len(LINEARS)
    # other weights, so other KV: the store never serves the float model's to it
    assert eight.adapter.fingerprint != plain.adapter.fingerprint
    prompt = "<prompt schema='q'><doc/><user>Where is the tower?</user><assistant></prompt>"
    schema = ("<schema name='q'><system>Answer briefly.</system><module name='doc'>The tower "
              "stands in the old town, by the river.</module></schema>")
    eight.add_schema(schema)
    cached = eight.generate(prompt, max_new_tokens=6, temperature=0)
    baseline = eight.generate(prompt, max_new_tokens=6, temperature=0, baseline=True)
    assert cached.token_ids == baseline.token_ids      # a prefix-shaped request: exact


def test_what_cannot_be_quantized_is_a_clear_error(tiny_model_dir):
    with pytest.raises(ModelError, match="quantize must be one of q4_1, q8_0"):
        engine.load(tiny_model_dir, quantize="q5_k")
    with pytest.raises(ModelError, match="needs dtype=torch.float32"):
        engine.load(tiny_model_dir, quantize="q8_0", dtype=torch.bfloat16)
    with pytest.raises(ModelError, match="is for float checkpoints"):
        engine.load(str(tiny_model_dir / "model.gguf"), quantize="q4_1")
    with pytest.raises(ModelError, match="serves Llama-family models"):
        quantize_model(tiny_model("gpt2"), "q8_0")


def run_files(folder, tokens: int) -> list[str]:
    """`promptlang run`'s arguments for a one-module schema and a prompt written to `folder`."""
    (folder / "s.pml").write_text("<schema name='s'><system>Be brief.</system>"
                                  "<module name='doc'>The tower is old.</module></schema>")
    (folder / "p.pml").write_text("<prompt schema='s'><doc/><user>How old?</user>"
                                  "<assistant></prompt>")
    return [str(folder / "s.pml"), str(folder / "p.pml"), "--max-new-tokens", str(tokens)]


def test_the_commands_keep_cached_kv_at_the_kv_dtype(tiny_model_dir, tmp_path, capsys,
                                                     monkeypatch):
    from promptlang import cli
    from promptlang.runtime import engine

    loaded = []
    real_load = engine.load
    monkeypatch.setattr(engine, "load", lambda *a, **kw: loaded.append(real_load(*a, **kw))
                        or loaded[-1])
    files = run_files(tmp_path, 2)
    assert cli.main(["run", *files, "--model", str(tiny_model_dir), "--kv-dtype", "float16"]) == 0
    assert cli.main(["run", *files, "--model", str(tiny_model_dir)]) == 0
    half, plain = (llm.store for llm in loaded)
    assert half.dtype == torch.float16 and plain.dtype is None      # None: as computed (float32)
    stored = {store: [e.key for e in store.entries() if "disk" not in e.tiers[:1]]
              for store in (half, plain)}
    assert stored[half] and stored[half] == stored[plain]
    for key in stored[half]:                      # the same modules, in half the bytes
        assert half.get(key).keys.dtype == half.get(key).values.dtype == torch.float16
        assert half.get(key).keys.nbytes * 2 == plain.get(key).keys.nbytes
    capsys.readouterr()
    assert cli.main(["serve", "--ray", "--kv-dtype", "bfloat16"]) == 2
    assert "not available with --ray" in capsys.readouterr().err


def test_promptlang_run_takes_quantize(tiny_model_dir, tmp_path, capsys):
    from promptlang import cli

    files = run_files(tmp_path, 3)
    assert cli.main(["run", *files, "--model", str(tiny_model_dir), "--quantize", "q8_0"]) == 0
    capsys.readouterr()
    assert cli.main(["run", *files, "--quantize", "q4_1"]) == 1     # the default model: a GGUF
    assert "is for float checkpoints" in capsys.readouterr().err
