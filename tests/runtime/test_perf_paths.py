"""The fast paths compute what the slow ones do.

The runtime's attention for RoPE models (runtime/model/attention.py) serves a mask of None as
"every past key visible, the new tokens causal among themselves", folds grouped-query
heads into query rows and builds each mask once per forward pass; a baseline prefill
runs in one pass on SDPA's causal kernel; a 16-bit store hands out its tensors as they
are and the assembler widens them. Each test pins one of those shortcuts to a plain
reference (eager attention, the chunked path, a float32 store).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import transformers

from promptlang.runtime.model import attention as attention_module
from promptlang.runtime.engine import LLM
from promptlang.runtime.fast.attention import NativeAttention
from promptlang.runtime.model import (ATTENTION, Past, RopeAdapter, adapt, causal_allowed,
                                      float_mask)
from promptlang.runtime.store import ModuleStore
from promptlang.tokenizer import WordTokenizer
from .tiny import tiny_llama

TOL = 1e-4
VOCAB = 1000


def llama(kv_heads: int = 2, layers: int = 3) -> torch.nn.Module:
    return tiny_llama(11, VOCAB, layers=layers, kv_heads=kv_heads)


def reference_attention(query, key, value, allowed: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) masked) v with every KV head repeated: [B, Q, H, D]."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = query @ key.transpose(-1, -2) / math.sqrt(query.shape[-1])
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ value).transpose(1, 2)


def random_allowed(q: int, k: int, seed: int) -> torch.Tensor:
    allowed = torch.rand(q, k, generator=torch.Generator().manual_seed(seed)) < 0.6
    allowed[:, 0] = True                      # every query sees at least one key
    return allowed


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
@pytest.mark.parametrize("case", ["past, no mask", "decode, no mask", "no past, no mask",
                                  "float mask", "bool mask", "many queries, float mask",
                                  "many queries, no mask"])
def test_attention_equals_masked_softmax_reference(monkeypatch, kv_heads, case, kernels):
    heads, d, past = 4, 16, 9
    q = 1 if case.startswith("decode") else 6
    if case == "no past, no mask":
        past = 0
    if case.startswith("many queries"):
        monkeypatch.setattr(attention_module, "_PACK_MAX_QUERIES", 2)
    k = past + q
    gen = torch.Generator().manual_seed(kv_heads)
    query = torch.randn(1, heads, q, d, generator=gen)
    key = torch.randn(1, kv_heads, k, d, generator=gen)
    value = torch.randn(1, kv_heads, k, d, generator=gen)
    allowed = causal_allowed(past, q)                          # what None means
    mask = None
    if "float mask" in case:
        allowed = random_allowed(q, k, seed=kv_heads)
        mask = float_mask(allowed, torch.float32)
    elif case == "bool mask":
        allowed = random_allowed(q, k, seed=kv_heads + 10)
        mask = allowed[None, None]
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True)
    out, _ = attention_module.attention(module, query, key, value, mask,
                                        scaling=1 / math.sqrt(d), promptlang_masks={},
                                        promptlang_attend=NativeAttention())   # as adapters do
    expected = reference_attention(query, key, value, allowed)
    assert out.shape == (1, q, heads, d)
    assert (out - expected).abs().max() < TOL


def test_masks_are_built_once_per_forward_pass_not_per_layer(monkeypatch, pytorch_kernels):
    """On PyTorch's kernels (runtime/fast/kernels.c takes the unmasked passes without any mask)."""
    adapter = adapt(llama(layers=3))
    builds = []
    for name, sizes in (("_additive", slice(1, 4)), ("_causal_mask", slice(0, 3))):
        real = getattr(attention_module, name)      # record (name, groups, queries, keys)
        monkeypatch.setattr(attention_module, name,
                            lambda *args, _name=name, _real=real, _s=sizes:
                            builds.append((_name, *args[_s])) or _real(*args))
    keys, values = adapter.empty_kv(32)
    ids = torch.randint(3, VOCAB, (20,), generator=torch.Generator().manual_seed(2))
    adapter.forward(ids[:12], torch.arange(12), Past(keys, values, torch.arange(0)), None)
    assert builds == []                       # no past: SDPA's causal kernel, no mask at all
    adapter.forward(ids[12:], torch.arange(12, 20), Past(keys, values, torch.arange(12)), None)
    # past and new keys apart: only the new tokens' causal block, once for all 3 layers
    assert builds == [("_causal_mask", 2, 8, 8)]
    builds.clear()
    adapter.forward(ids[12:], torch.arange(12, 20), Past(keys, values, torch.arange(12)),
                    causal_allowed(12, 8))
    assert builds == [("_additive", 2, 8, 20)]            # an explicit mask: packed once
    builds.clear()
    adapter.forward(ids[12:13], torch.tensor([20]), Past(keys, values, torch.arange(20)), None)
    assert builds == []                       # a decode step needs no mask


def test_mask_hook_skips_only_the_plain_causal_mask():
    hook = attention_module.attention_mask
    assert hook(1, 5, 12, q_offset=7) is None                  # new tokens last, no padding
    assert hook(1, 5, 12, q_offset=7, attention_mask=torch.ones(1, 12, dtype=torch.bool)) is None
    padded = torch.ones(1, 12, dtype=torch.bool)
    padded[0, 0] = False
    mask = hook(1, 5, 12, q_offset=7, attention_mask=padded)
    assert mask.shape == (1, 1, 5, 12) and not bool(mask[0, 0, :, 0].any())
    assert hook(1, 5, 12, q_offset=0) is not None              # not bottom-right aligned
    window = transformers.masking_utils.sliding_window_causal_mask_function(3)
    assert hook(1, 5, 12, q_offset=7, mask_function=window) is not None


def test_transformers_own_forward_and_generate_are_unchanged_on_an_adapted_model():
    """adapt() switches the model's attention implementation; transformers' own calls
    (a left-padded batch, generate with a growing cache) must still give stock results."""
    stock = llama()
    adapted = llama()
    adapt(adapted)
    assert adapted.config._attn_implementation == ATTENTION
    ids = torch.randint(3, VOCAB, (2, 10), generator=torch.Generator().manual_seed(4))
    padding = torch.ones(2, 10, dtype=torch.long)
    padding[1, :3] = 0
    with torch.inference_mode():
        expected = stock(input_ids=ids, attention_mask=padding).logits
        got = adapted(input_ids=ids, attention_mask=padding).logits
        assert (got[0] - expected[0]).abs().max() < TOL
        assert (got[1, 3:] - expected[1, 3:]).abs().max() < TOL
        args = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(adapted.generate(ids[:1], **args), stock.generate(ids[:1], **args))


@pytest.mark.parametrize("past", [0, 7], ids=["baseline", "after a past"])
@pytest.mark.parametrize("pack_max", [512, 4], ids=["packed", "unpacked"])
def test_a_long_causal_pass_is_one_pass_and_equals_the_chunked_one(monkeypatch, past, pack_max):
    """A baseline prefill (no past) or a long unit after its context runs in one pass, with
    no Q x K mask, and equals the chunked computation."""
    monkeypatch.setattr(attention_module, "_PACK_MAX_QUERIES", pack_max)
    adapter = adapt(llama())
    adapter.chunk_size = 8
    ids = torch.randint(3, VOCAB, (30,), generator=torch.Generator().manual_seed(5))
    keys, values = adapter.empty_kv(past + 30)
    if past:
        adapter.forward(ids[:past], torch.arange(past), Past(keys, values, torch.arange(0)), None)
    passes = []
    handle = adapter.model.register_forward_pre_hook(lambda *args: passes.append(1))

    def run():
        step = adapter.forward(ids, torch.arange(past, past + 30),
                               Past(keys, values, torch.arange(past)), None, torch.arange(30))
        return step.logits, keys.clone(), values.clone()

    try:
        one = run()
        assert len(passes) == 1
        monkeypatch.setattr(RopeAdapter, "unmasked_in_one_pass", lambda self, past: False)
        chunked = run()
        assert len(passes) == 1 + 4
    finally:
        handle.remove()
    for a, b in zip(one, chunked):
        assert (a - b).abs().max() < TOL


SCHEMA = """\
<schema name="s">
  <system>You are a careful assistant.</system>
  <module name="doc">Alpha bravo charlie delta echo foxtrot golf hotel india.</module>
  <user>
</schema>
"""
PROMPT = '<prompt schema="s"><doc/>What comes after golf?</user></prompt>'


def test_a_16_bit_store_halves_kv_and_serves_float32_buffers(tmp_path):
    model = llama()
    full = LLM.from_model(model, WordTokenizer(VOCAB, bos=True),
                          store=ModuleStore(disk_dir=tmp_path / "f32"), recompute="none")
    half = LLM.from_model(model, WordTokenizer(VOCAB, bos=True),
                          store=ModuleStore(disk_dir=tmp_path / "bf16", dtype=torch.bfloat16,
                                            compute_dtype=torch.bfloat16), recompute="none")
    for llm in (full, half):
        llm.add_schema(SCHEMA)
    expected = full.prefill(PROMPT)
    first = half.prefill(PROMPT)            # encodes the units
    again = half.prefill(PROMPT)            # served from the store
    assert first.keys.dtype == again.keys.dtype == torch.float32
    # what a request sees does not depend on whether its units were just encoded
    assert torch.equal(first.logits, again.logits) and torch.equal(first.keys, again.keys)
    entries = {e.key: e.nbytes for e in half.store.entries()}
    assert sum(entries.values()) < 0.6 * sum(e.nbytes for e in full.store.entries())
    assert all(half.store.get(key).keys.dtype == torch.bfloat16 for key in entries)
    assert (again.logits - expected.logits).abs().max() < 0.05 * expected.logits.abs().max()


def test_load_exposes_the_store_dtype(monkeypatch, tmp_path):
    from promptlang.runtime.model import loading
    from promptlang.runtime.engine import load

    monkeypatch.setenv("PROMPTLANG_HOME", str(tmp_path))
    monkeypatch.setattr(loading, "load_hf_model",
                        lambda *args, **kwargs: (llama(), WordTokenizer(VOCAB, bos=True)))
    llm = load(store_dtype=torch.float16)
    assert llm.store.dtype == torch.float16
    llm.add_schema(SCHEMA)
    assert llm.generate(PROMPT, max_new_tokens=2).token_ids


# --- long units served in place (assembler.share_min_tokens) -------------------------------

@pytest.fixture(scope="module")
def oracle_llama():
    from .test_oracle import tiny_model
    return tiny_model("llama")


@pytest.mark.parametrize("isolate", [False, True], ids=["guaranteed", "isolate"])
@pytest.mark.parametrize("chunk_size", [512, 3], ids=["one pass", "chunks"])
@pytest.mark.parametrize("case", ["two modules with a gap", "nested modules", "union",
                                  "scaffold", "cache false", "no uncached tokens"])
def test_units_read_in_place_match_the_oracle(oracle_llama, tmp_path, case, chunk_size,
                                              isolate, kernels):
    """Units the request reads from the store's tensors instead of copying them into its
    buffer (every unit without placeholders, here) give the oracle's logits and KV."""
    from .test_oracle import PROMPTS, assert_matches_oracle, make_llm

    llm = make_llm(oracle_llama, tmp_path, isolate=isolate)
    llm.assembler.share_min_tokens = 1
    llm.adapter.chunk_size = chunk_size
    try:
        assert_matches_oracle(llm, PROMPTS[case], isolate)
    finally:
        llm.adapter.chunk_size = type(llm.adapter).chunk_size
    assert llm.assembler.shared_tokens > 0


def pair(tmp_path, model):
    """Two engines on one model: one copies every unit, one reads them in place."""
    engines = []
    for name, share in (("copy", None), ("share", 1)):
        llm = LLM.from_model(model, WordTokenizer(VOCAB, bos=True),
                             store=ModuleStore(disk_dir=tmp_path / name), recompute="none")
        llm.assembler.share_min_tokens = share
        llm.add_schema(SCHEMA)
        engines.append(llm)
    return engines


def test_generation_reads_long_units_in_place_and_equals_copying(tmp_path):
    copy, share = pair(tmp_path, llama())
    other = '<prompt schema="s">Nothing cached here.</user></prompt>'
    for prompt in (PROMPT, other, PROMPT):   # the buffer is reused in between
        expected = copy.generate(prompt, max_new_tokens=6)
        got = share.generate(prompt, max_new_tokens=6)
        assert got.token_ids == expected.token_ids
    assert share.assembler.shared_tokens > 0
    assert share.assembler.copied_tokens < copy.assembler.copied_tokens
    # decoding read the shared unit in place too (the fused layers serve the steps): the next
    # request shares it again, and nothing is copied
    copied, shared = share.assembler.copied_tokens, share.assembler.shared_tokens
    assert share.generate(PROMPT, max_new_tokens=6).token_ids == expected.token_ids
    assert share.assembler.copied_tokens == copied and share.assembler.shared_tokens > shared


def test_a_session_over_units_read_in_place_equals_one_over_copies(tmp_path):
    def run(llm):
        session = llm.session(PROMPT)
        first = session.generate(max_new_tokens=4)
        branch = session.fork()
        branch.append(" and then")
        second = branch.generate(max_new_tokens=4)
        session.append(" or else")
        third = session.generate(max_new_tokens=3)
        return ([t.text for t in (first, second, third)], session.tokens(), branch.tokens(),
                session.logits)

    copy, share = pair(tmp_path, llama())
    expected, got = run(copy), run(share)
    assert got[:3] == expected[:3]
    assert (got[3] - expected[3]).abs().max() < TOL
    assert share.assembler.shared_tokens > 0
