"""`promptlang.load("model.gguf")`: any GGUF file, converted once into PROMPTLANG_HOME.

The test writes its own tiny GGUF with the `gguf` package: a 2-layer Llama of random float32
weights, with the default model's tokenizer metadata (the chat template, and its first VOCAB
tokens and the merges among them, or all of them) copied from its GGUF. The loaded model must compute what the
same weights compute in a plain transformers model, and the second load must read the
converted copy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, CONTEXT = 32, 64, 2, 4, 2, 256
VOCAB = 2048


def _strings(field) -> list[str]:
    return [bytes(field.parts[i]).decode("utf-8") for i in field.data]


def _scalar(field):
    return field.parts[field.data[0]][0]


def write_tiny_gguf(path, seed: int = 0, hidden: int = HIDDEN, inter: int = INTER,
                    blocks=None, arch: str = "llama",
                    head_dim: int | None = None,
                    extra: dict[str, np.ndarray] | None = None,
                    rope_dims: int | None = None,
                    metadata: dict[str, int | float] | None = None,
                    vocab: int | None = VOCAB) -> dict[str, np.ndarray]:
    """A tiny GGUF written at `path`. Returns its tensors by GGUF name: float32 values, or None
    for a type the gguf package cannot dequantize.

    - arch: "llama" (tied embeddings), "qwen2" (with the q/k/v projections' biases),
      "qwen3" (with q and k norms) or "phi3" (fused q/k/v and gate/up projections, an
      output matrix of its own)
    - blocks(name, shape, rng), where given, may return (ggml type, [rows, bytes] uint8) for
      a tensor stored quantized (its values are then gguf's dequantized ones), or None
    - head_dim: the attention heads' size (default hidden / heads)
    - extra: more float32 tensors by name (llama.cpp's `rope_freqs.weight`)
    - rope_dims: the rotary dimension (default the head's); metadata: more keys (an int is
      written as uint32, a float as float32)
    - vocab: the default model's first `vocab` tokens and the merges within them (None: its
      whole tokenizer)
    """
    from promptlang import default_model

    head_dim = head_dim or hidden // HEADS

    source = gguf.GGUFReader(str(default_model.default_gguf_path()))
    f = source.fields
    # the default model's first `vocab` tokens (every single character among them) and the
    # merges within them: a smaller tokenizer, quicker to convert and to read
    tokens = _strings(f["tokenizer.ggml.tokens"])[:vocab]
    kept = set(tokens)
    merges = [m for m in _strings(f["tokenizer.ggml.merges"])
              if all(part in kept for part in m.split(" ")) and m.replace(" ", "") in kept]
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_rope_dimension_count(rope_dims or head_dim)
    for key, value in (metadata or {}).items():
        if isinstance(value, int):
            writer.add_uint32(key, value)
        else:
            writer.add_float32(key, value)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_file_type(0)                                   # all float32
    writer.add_tokenizer_model(bytes(f["tokenizer.ggml.model"].parts[-1]).decode())
    writer.add_tokenizer_pre(bytes(f["tokenizer.ggml.pre"].parts[-1]).decode())
    writer.add_token_list(tokens)
    writer.add_token_types([int(f["tokenizer.ggml.token_type"].parts[i][0])
                            for i in f["tokenizer.ggml.token_type"].data][:vocab])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(int(_scalar(f["tokenizer.ggml.bos_token_id"])))
    writer.add_eos_token_id(int(_scalar(f["tokenizer.ggml.eos_token_id"])))
    writer.add_unk_token_id(int(_scalar(f["tokenizer.ggml.unknown_token_id"])))
    writer.add_pad_token_id(int(_scalar(f["tokenizer.ggml.padding_token_id"])))
    writer.add_chat_template(bytes(f["tokenizer.chat_template"].parts[-1]).decode())
    kv = head_dim * KV_HEADS
    nq = head_dim * HEADS
    shapes = {"token_embd.weight": (len(tokens), hidden), "output_norm.weight": (hidden,)}
    if arch == "phi3":
        shapes["output.weight"] = (len(tokens), hidden)
    for i in range(LAYERS):
        if arch == "phi3":
            shapes |= {f"blk.{i}.attn_norm.weight": (hidden,),
                       f"blk.{i}.ffn_norm.weight": (hidden,),
                       f"blk.{i}.attn_qkv.weight": (nq + 2 * kv, hidden),
                       f"blk.{i}.attn_output.weight": (hidden, nq),
                       f"blk.{i}.ffn_up.weight": (2 * inter, hidden),
                       f"blk.{i}.ffn_down.weight": (hidden, inter)}
            continue
        shapes |= {f"blk.{i}.attn_norm.weight": (hidden,), f"blk.{i}.ffn_norm.weight": (hidden,),
                   f"blk.{i}.attn_q.weight": (nq, hidden),
                   f"blk.{i}.attn_k.weight": (kv, hidden), f"blk.{i}.attn_v.weight": (kv, hidden),
                   f"blk.{i}.attn_output.weight": (hidden, nq),
                   f"blk.{i}.ffn_gate.weight": (inter, hidden),
                   f"blk.{i}.ffn_up.weight": (inter, hidden),
                   f"blk.{i}.ffn_down.weight": (hidden, inter)}
        if arch == "qwen2":
            shapes |= {f"blk.{i}.attn_q.bias": (nq,), f"blk.{i}.attn_k.bias": (kv,),
                       f"blk.{i}.attn_v.bias": (kv,)}
        if arch == "qwen3":
            shapes |= {f"blk.{i}.attn_q_norm.weight": (head_dim,),
                       f"blk.{i}.attn_k_norm.weight": (head_dim,)}
    tensors = {}
    for name, shape in shapes.items():
        values = (1.0 + 0.1 * rng.standard_normal(shape) if name.endswith("norm.weight")
                  else 0.1 * rng.standard_normal(shape)).astype(np.float32)
        stored = blocks(name, shape, rng) if blocks is not None else None
        if stored is None:
            tensors[name] = values
            writer.add_tensor(name, values)
            continue
        qtype, raw = stored
        try:
            tensors[name] = gguf.quants.dequantize(raw, qtype).reshape(shape)
        except NotImplementedError:                  # a type gguf-py does not read
            tensors[name] = None
        writer.add_tensor(name, raw, raw_dtype=qtype)
    for name, values in (extra or {}).items():
        tensors[name] = values
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors


def test_a_gguf_file_loads_converted_once_and_computes_its_weights(tmp_path, monkeypatch):
    from promptlang.runtime import engine
    from promptlang.runtime.model import loading

    monkeypatch.setenv("PROMPTLANG_HOME", str(tmp_path / "home"))
    path = tmp_path / "tiny.gguf"
    tensors = write_tiny_gguf(path, vocab=None)       # the whole tokenizer: compared below
    llm = engine.load(str(path), recompute="none")
    model = llm.adapter.model
    assert model.config.num_hidden_layers == LAYERS and model.config.hidden_size == HIDDEN
    # the weights are the file's (q/k rows come back in transformers' order: compare v, norms)
    layer = model.model.layers[1]
    assert torch.equal(layer.self_attn.v_proj.weight, torch.from_numpy(tensors["blk.1.attn_v.weight"]))
    assert torch.equal(layer.mlp.down_proj.weight, torch.from_numpy(tensors["blk.1.ffn_down.weight"]))
    assert torch.equal(model.model.embed_tokens.weight,
                       torch.from_numpy(tensors["token_embd.weight"]))
    # the tokenizer is the GGUF's: the default model's vocabulary and chat template
    from promptlang.runtime.model.loading import load_hf_model
    _, default_tok = load_hf_model()
    text = "Hello, GGUF world!"
    assert llm.tokenizer.encode(text) == default_tok.encode(text)
    assert llm.tokenizer.role_affix_ids("user") == default_tok.role_affix_ids("user")
    result = llm.generate('<prompt schema="g"><user>Hi</user><assistant></prompt>',
                          schema='<schema name="g"><system>Tiny.</system></schema>',
                          max_new_tokens=3)
    assert len(result.token_ids) <= 3
    converted = list((tmp_path / "home" / "models" / "gguf").glob("tiny-*"))
    assert len(converted) == 1 and (converted[0] / "model.safetensors").is_file()
    assert (converted[0] / "model.safetensors").stat().st_mode & 0o077 == 0     # private
    calls = []
    monkeypatch.setattr(loading, "_convert_gguf", lambda *a, **k: calls.append(a))
    engine.load(str(path))                                   # the copy, no conversion
    assert calls == []


def test_a_missing_gguf_file_is_a_model_error(tmp_path):
    from promptlang.errors import ModelError
    from promptlang.runtime import engine

    with pytest.raises(ModelError, match="cannot read the GGUF file"):
        engine.load(str(tmp_path / "nothing.gguf"))


def _crafted(tmp_path, good: bytes) -> dict[str, bytes]:
    """Damaged copies of the GGUF file `good`: cut short at many places, a wrong magic, a
    version from the future, counts no file of its size can hold."""
    import struct

    head = good[:24]
    cases = {f"cut-{n}": good[:n] for n in (0, 3, 4, 8, 16, 23, 24, 40, 100, 400,
                                            len(good) // 2, len(good) - 1)}
    cases["magic"] = b"GGML" + good[4:]
    cases["version"] = good[:4] + struct.pack("<I", 99) + good[8:]
    cases["tensors"] = head[:8] + struct.pack("<Q", 1 << 60) + good[16:]
    cases["entries"] = head[:16] + struct.pack("<Q", 1 << 61) + good[24:]
    return cases


def test_every_damaged_gguf_file_is_one_model_error_naming_the_file(tmp_path, monkeypatch):
    from promptlang.errors import ModelError
    from promptlang.runtime import engine

    monkeypatch.setenv("PROMPTLANG_HOME", str(tmp_path / "home"))
    good = tmp_path / "good.gguf"
    write_tiny_gguf(good)
    for name, data in _crafted(tmp_path, good.read_bytes()).items():
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(data)
        with pytest.raises(ModelError) as caught:
            engine.load(str(path))
        message = str(caught.value)
        assert str(path) in message and "\n" not in message, (name, message)


def test_an_unsupported_architecture_or_tensor_type_names_itself_and_what_is_supported(
        tmp_path, monkeypatch):
    """Refused before any conversion, with the supported lists in the message."""
    from promptlang.errors import ModelError
    from promptlang.runtime import engine
    from promptlang.runtime.model import loading

    path = tmp_path / "other.gguf"
    write_tiny_gguf(path, arch="gemma2")
    monkeypatch.setenv("PROMPTLANG_HOME", str(tmp_path / "home"))
    with pytest.raises(ModelError) as caught:
        engine.load(str(path))
    assert str(caught.value) == (f"{path}: architecture 'gemma2' is not supported (supported "
                                 f"GGUF architectures: llama, qwen2, qwen3, phi3)")

    def q8_1(name, shape, rng):                 # a type gguf-py cannot dequantize
        if not name.endswith("ffn_down.weight"):
            return None
        qtype = gguf.GGMLQuantizationType.Q8_1
        per_block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        rows = rng.integers(0, 256, size=(shape[0], shape[1] // per_block * nbytes),
                            dtype=np.uint8)
        return qtype, rows

    with pytest.raises(NotImplementedError):     # the oracle: gguf-py refuses the type too
        gguf.quants.dequantize(np.zeros((1, 40), np.uint8), gguf.GGMLQuantizationType.Q8_1)
    path = tmp_path / "q8_1.gguf"
    monkeypatch.delenv("PROMPTLANG_HOME")
    write_tiny_gguf(path, blocks=q8_1)
    monkeypatch.setenv("PROMPTLANG_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(loading, "_convert_gguf", lambda *a, **k: pytest.fail("converted"))
    with pytest.raises(ModelError) as caught:
        engine.load(str(path))
    message = str(caught.value)
    assert message.startswith(f"{path}: tensor 'blk.0.ffn_down.weight' is of type Q8_1, which "
                              f"promptlang does not read (supported: F32, F16, BF16, ")
    assert "Q4_K" in message and "read as stored: Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K" in message
    assert "Q8_1" not in message.split("supported:")[1]


def native_available() -> bool:
    """Whether this CPU runs the kernels (CI requires it: PROMPTLANG_REQUIRE_NATIVE)."""
    from promptlang.runtime.fast import native

    return native.available()


# llama.cpp's Q4_K_M mix, on rows of whole 256-weight super-blocks
K_MIX = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q5_0",
         "ffn_gate": "Q5_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K"}


def _k_quant_blocks(name, shape, rng):
    """Random blocks (finite float16 scales) for the linear weights named in K_MIX."""
    from tests.runtime.test_kquants import random_blocks
    from promptlang.runtime.fast import native

    part = name.split(".")[2] if name.startswith("blk.") else ""
    if part not in K_MIX or not name.endswith(".weight"):
        return None
    qtype = getattr(gguf.GGMLQuantizationType, K_MIX[part])
    kind = next(k for k, (label, _, _) in native.KINDS.items() if label == K_MIX[part])
    raw = random_blocks(kind, shape[0], shape[1], seed=int(rng.integers(1 << 30))).numpy()
    return qtype, raw


@pytest.mark.skipif(not native_available(), reason="CPU kernels unavailable here")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])    # llama.cpp permutes a Llama's q, k rows
def test_a_k_quant_gguf_is_served_from_its_blocks_as_stored(tmp_path, monkeypatch, arch):
    from promptlang.runtime import engine
    from promptlang.runtime.fast import native
    from promptlang.runtime.model import quantize

    monkeypatch.setenv("PROMPTLANG_HOME", str(tmp_path / "home"))
    assert quantize.GGUF_SERVED == frozenset(native.KINDS)
    path = tmp_path / "kquants.gguf"
    tensors = write_tiny_gguf(path, hidden=256, inter=512, blocks=_k_quant_blocks, arch=arch)
    served = engine.load(str(path), recompute="none")
    plain = engine.load(str(path), recompute="none", quantized=False)
    # where the load's time went (`promptlang run` prints it)
    assert list(served.load_steps) == ["file", "weights", "tokenizer", "adapter", "blocks"]
    assert all(seconds >= 0 for seconds in served.load_steps.values())
    assert not served.adapter.fast.decoder.float_copies and plain.adapter.fast.decoder.float_copies
    layer = served.adapter.model.model.layers[1]
    assert torch.equal(layer.mlp.down_proj.weight,
                       torch.from_numpy(np.ascontiguousarray(tensors["blk.1.ffn_down.weight"])))
    assert served.adapter.fast.decoder.quantized_weights == LAYERS * len(K_MIX)
    assert plain.adapter.fast.decoder.quantized_weights == 0
    schema = '<schema name="k"><system>Tiny.</system></schema>'
    prompt = '<prompt schema="k"><user>Hi there</user><assistant></prompt>'
    ours = served.generate(prompt, schema=schema, max_new_tokens=6)
    theirs = plain.generate(prompt, schema=schema, max_new_tokens=6)
    assert ours.token_ids == theirs.token_ids and len(ours.token_ids) == 6
    wide = native.wide()
    try:
        native.wide(False)             # 256-bit tiles only: served from the blocks all the same
        narrow = engine.load(str(path))
        assert narrow.adapter.fast.decoder.quantized_weights == LAYERS * len(K_MIX)
        plain = engine.load(str(path), quantized=False)
        assert narrow.generate(prompt, schema=schema, max_new_tokens=6).token_ids == \
            plain.generate(prompt, schema=schema, max_new_tokens=6).token_ids
    finally:
        native.wide(wide)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3"])
def test_each_family_as_a_gguf_answers_as_transformers_does(tmp_path, monkeypatch, arch):
    """A tiny GGUF of each family, written here: promptlang's answer (its cache, its kernels)
    against transformers' own implementation of the family loading the same file."""
    from transformers import AutoModelForCausalLM

    from promptlang.runtime import engine

    monkeypatch.setenv("PROMPTLANG_HOME", str(tmp_path / "home"))
    path = tmp_path / f"{arch}.gguf"
    # transformers reads no head size from a qwen3 GGUF: its default, 128, as Qwen3's own
    write_tiny_gguf(path, seed=3, arch=arch, head_dim=128 if arch == "qwen3" else None)
    llm = engine.load(str(path))
    assert llm.adapter.model.config.model_type == arch
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                     dtype=torch.float32, local_files_only=True)
    reference.eval()
    schema = '<schema name="f"><system>You are tiny.</system><module name="m">Some notes.</module></schema>'
    prompt = '<prompt schema="f"><m/><user>Hi there</user><assistant></prompt>'
    ids = llm.bind(prompt, schema=schema).token_ids()
    ours = llm.generate(prompt, schema=schema, max_new_tokens=5)
    with torch.no_grad():
        theirs = reference.generate(torch.tensor([ids]), max_new_tokens=5, do_sample=False,
                                    pad_token_id=0)[0, len(ids):].tolist()
    assert ours.token_ids == theirs[:len(ours.token_ids)] and ours.token_ids


def test_a_phi_3_gguf_keeps_its_partial_rotary_and_long_context_factors(tmp_path, monkeypatch):
    """Phi-3.5/Phi-4-mini files carry a rotary dimension smaller than the head's and two sets
    of frequency factors, which transformers' GGUF loader drops: promptlang keeps them, and
    answers as transformers' Phi-3 with those parameters (up to the original context length,
    where the short factors hold)."""
    from transformers import AutoModelForCausalLM, Phi3ForCausalLM

    from promptlang.runtime import engine

    monkeypatch.setenv("PROMPTLANG_HOME", str(tmp_path / "home"))
    head_dim, rope_dims = HIDDEN // HEADS, 6
    rng = np.random.default_rng(4)
    short = (1.0 + rng.uniform(0.0, 3.0, rope_dims // 2)).astype(np.float32)
    long = (short * 4).astype(np.float32)
    path = tmp_path / "phi3.gguf"
    write_tiny_gguf(path, seed=5, arch="phi3", rope_dims=rope_dims,
                    extra={"rope_factors_short.weight": short, "rope_factors_long.weight": long},
                    metadata={"phi3.rope.scaling.original_context_length": 128,
                              "phi3.rope.scaling.attn_factor": 1.25})
    llm = engine.load(str(path))
    config = llm.adapter.model.config
    assert config.rope_parameters["partial_rotary_factor"] == rope_dims / head_dim
    assert config.rope_parameters["short_factor"] == short.tolist()
    assert config.rope_parameters["long_factor"] == long.tolist()
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                 dtype=torch.float32, local_files_only=True)
    stated = plain.config
    stated.rope_parameters = {"rope_type": "longrope", "rope_theta": 10000.0,
                              "partial_rotary_factor": rope_dims / head_dim,
                              "short_factor": short.tolist(), "long_factor": long.tolist(),
                              "original_max_position_embeddings": 128, "attention_factor": 1.25}
    reference = Phi3ForCausalLM(stated).eval()
    reference.load_state_dict(plain.state_dict())
    schema = ('<schema name="f"><system>You are tiny.</system>'
              '<module name="m">Some notes.</module></schema>')
    prompt = '<prompt schema="f"><m/><user>Hi there</user><assistant></prompt>'
    ids = llm.bind(prompt, schema=schema).token_ids()
    assert len(ids) + 5 < 128
    ours = llm.generate(prompt, schema=schema, max_new_tokens=5)
    with torch.no_grad():
        theirs = reference.generate(torch.tensor([ids]), max_new_tokens=5, do_sample=False,
                                    pad_token_id=0)[0, len(ids):].tolist()
        stated_logits = reference(torch.tensor([ids])).logits
        dropped_logits = plain(torch.tensor([ids])).logits
    assert ours.token_ids == theirs[:len(ours.token_ids)] and ours.token_ids
    # the parameters the loader drops change this model's numbers
    assert (stated_logits - dropped_logits).abs().max() > 1e-3


def llama3_rope_factors(head_dim: int, theta: float, factor: float, low: float, high: float,
                        original: int) -> np.ndarray:
    """The `rope_freqs.weight` llama.cpp's converter writes for Llama 3.x's rope scaling."""
    import math

    factors = []
    for i in range(0, head_dim, 2):
        wavelength = 2 * math.pi * theta ** (i / head_dim)
        if wavelength < original / high:
            factors.append(1.0)
        elif wavelength > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def test_a_llama_3_gguf_keeps_its_rope_scaling(tmp_path, monkeypatch):
    """llama.cpp stores Llama 3.x's rope scaling as per-frequency factors, which transformers'
    GGUF loader drops: promptlang keeps them, and answers as transformers' Llama with the
    "llama3" rope parameters the factors came from."""
    from transformers import AutoModelForCausalLM

    from promptlang.runtime import engine

    monkeypatch.setenv("PROMPTLANG_HOME", str(tmp_path / "home"))
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    factors = llama3_rope_factors(HIDDEN // HEADS, 10000.0, 8.0, 1.0, 4.0, 64)
    # the parameters reach both ends of llama3's rule and the smooth part between them
    assert factors.min() == 1.0
    assert factors.max() == 8.0
    assert ((factors > 1.0) & (factors < 8.0)).any()
    path = tmp_path / "llama3.gguf"
    write_tiny_gguf(path, seed=5, extra={"rope_freqs.weight": factors})
    llm = engine.load(str(path))
    assert llm.adapter.model.config.rope_parameters["rope_type"] == "longrope"
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                 dtype=torch.float32, local_files_only=True)
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                     dtype=torch.float32, local_files_only=True)
    config = reference.config
    config.rope_parameters = {"rope_type": "llama3", "rope_theta": 10000.0, **scaling}
    reference.model.rotary_emb = type(reference.model.rotary_emb)(config=config)
    schema = '<schema name="r"><system>Tiny.</system><module name="m">Notes here.</module></schema>'
    prompt = '<prompt schema="r"><m/><user>Hi there, how are you?</user><assistant></prompt>'
    ids = torch.tensor([llm.bind(prompt, schema=schema).token_ids()])
    with torch.no_grad():
        scaled = reference(ids).logits[0, -1]
        unscaled = plain(ids).logits[0, -1]
        theirs = reference.generate(ids, max_new_tokens=5, do_sample=False,
                                    pad_token_id=0)[0, ids.shape[1]:].tolist()
    assert (scaled - unscaled).abs().max() > 1e-3                # the factors change answers
    from promptlang.runtime.model import Past

    keys, values = llm.adapter.empty_kv(ids.shape[1])
    with torch.no_grad():
        step = llm.adapter.forward(ids[0], torch.arange(ids.shape[1]),
                                   Past(keys, values, torch.arange(0)), None,
                                   torch.tensor([ids.shape[1] - 1]))
    torch.testing.assert_close(step.logits[-1], scaled, rtol=0, atol=1e-4)
    ours = llm.generate(prompt, schema=schema, max_new_tokens=5)
    assert ours.token_ids and ours.token_ids == theirs[:len(ours.token_ids)]
