"""pl_causal (runtime/fast/kernels.c): the attention of a long pass -- the n new tokens last
among nk keys, each seeing the keys before it and itself -- served to every pass of more
than 64 new tokens by fast/attention.py: in float32 where the 512-bit tiles are on, in
bfloat16 (products bfloat16, sums float32: the bfloat16 twin's passes) on a CPU with
AVX512-BF16.

Its oracle is the attention of the same inputs in float64 with an explicit causal mask. In
float32 its error is float32's, as PyTorch's float32 SDPA's; in bfloat16 it is bfloat16's
(the output's rounding, P's), the size of PyTorch's own bfloat16 SDPA error on the same
inputs. Elsewhere the pass stays on SDPA.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from promptlang.runtime.fast import attention as fast_attention
from promptlang.runtime.fast import native
from promptlang.runtime.model.compute import attach_bf16

HAS_KERNELS = native.available()
HAS_BF16 = HAS_KERNELS and native.products_available("bf16")
HAS_WIDE = HAS_KERNELS and native.wide()
needs_bf16 = pytest.mark.skipif(not HAS_BF16, reason="needs the CPU kernels and AVX512_BF16")
needs_wide = pytest.mark.skipif(not HAS_WIDE, reason="needs the CPU kernels and AVX-512F")
DTYPES = [pytest.param(torch.float32, marks=needs_wide),
          pytest.param(torch.bfloat16, marks=needs_bf16)]


def _inputs(heads, kv_heads, n, past, d, dtype=torch.bfloat16, seed=0):
    torch.manual_seed(seed)
    q = torch.randn(heads, n, d).to(dtype)
    k = torch.randn(kv_heads, past + n, d).to(dtype)
    v = torch.randn(kv_heads, past + n, d).to(dtype)
    return q, k, v


def _oracle(q, k, v, *, causal=True):
    """float64 attention of the inputs, explicit mask (row t sees keys <= past + t)."""
    heads, n, d = q.shape
    groups = heads // k.shape[0]
    keys = k.double().repeat_interleave(groups, 0)
    values = v.double().repeat_interleave(groups, 0)
    past = k.shape[1] - n
    mask = torch.ones(n, past + n, dtype=torch.bool)
    if causal:
        mask = mask.tril(past)
    return F.scaled_dot_product_attention(q.double(), keys, values, attn_mask=mask,
                                          scale=d ** -0.5)


def _sdpa(q, k, v):
    n = q.shape[1]
    past = k.shape[1] - n
    mask = torch.ones(n, past + n, dtype=torch.bool).tril(past)
    out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask,
                                         scale=q.shape[-1] ** -0.5, enable_gqa=True)
    return out[0].double()


# (heads, kv_heads, new tokens, past keys, head size): chunk (64 tokens) and block (128 keys)
# edges, grouped heads, a past before the new tokens, one new token, three head sizes
SHAPES = [(4, 2, 300, 0, 64), (9, 3, 65, 0, 64), (2, 1, 129, 127, 32), (6, 3, 130, 500, 64),
          (2, 1, 1, 40, 64), (3, 3, 200, 7, 128), (2, 2, 64, 64, 32), (1, 1, 257, 0, 64)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_equals_the_oracle_within_its_dtype(shape, dtype):
    q, k, v = _inputs(*shape, dtype=dtype)
    assert native.causal_fits(q, k, v)
    out = native.causal(q, k, v, q.shape[-1] ** -0.5)
    assert out.dtype == dtype and out.shape == q.shape
    expected = _oracle(q, k, v)
    error = (out.double() - expected).abs()
    torch_error = (_sdpa(q, k, v) - expected).abs()
    # as close as torch's own SDPA in the same dtype (bfloat16: the output's rounding)
    bound = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -18
    assert error.max() <= bound * expected.abs().max()
    assert error.mean() <= 2 * torch_error.mean() + 1e-12
    # the check can fail: without the causal mask the outputs move far beyond it
    if shape[2] > 1:
        wrong = _oracle(q, k, v, causal=False)
        assert (wrong - expected).abs().max() > 50 * error.max()


@pytest.mark.parametrize("dtype", DTYPES)
def test_reads_heads_in_place_from_a_larger_buffer(dtype):
    q, k, v = _inputs(4, 2, 150, 20, 64, dtype=dtype)
    buffer_k = torch.zeros(2, 400, 64, dtype=dtype)
    buffer_v = torch.zeros(2, 400, 64, dtype=dtype)
    buffer_k[:, :170] = k
    buffer_v[:, :170] = v
    in_place = native.causal(q, buffer_k[:, :170], buffer_v[:, :170], 0.125)
    assert torch.equal(in_place, native.causal(q, k, v, 0.125))


@needs_bf16
@needs_wide
def test_takes_only_the_shapes_it_serves():
    q, k, v = _inputs(4, 2, 100, 0, 64)
    assert native.causal_fits(q, k, v)
    assert native.causal_fits(q.float(), k.float(), v.float())
    assert not native.causal_fits(q.float(), k, v)                      # mixed dtypes
    assert not native.causal_fits(q.half(), k.half(), v.half())         # float16: SDPA's
    assert not native.causal_fits(q, k[:, :50], v[:, :50])             # more new tokens than keys
    assert not native.causal_fits(q[:3], k, v)                          # 3 heads over 2
    assert not native.causal_fits(q[..., :16], k[..., :16], v[..., :16])   # d % 32 != 0
    assert not native.causal_fits(q, k.transpose(1, 2).contiguous().transpose(1, 2), v)


def _llm(dtype):
    """A tiny Llama with heads of 32 (the kernel's multiple), sharp weights; in bfloat16 its
    passes run on its bfloat16 twin."""
    import transformers

    from promptlang.runtime.engine import LLM
    from promptlang.runtime.store import ModuleStore
    from promptlang.tokenizer import WordTokenizer
    torch.manual_seed(3)
    config = transformers.LlamaConfig(vocab_size=500, hidden_size=128, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=512)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():               # peaked attention: a wrong key moves the outputs
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.1)
    llm = LLM.from_model(model, WordTokenizer(500, bos=True), store=ModuleStore(disk_dir=None),
                         exact_reuse=False)
    if dtype == torch.bfloat16:
        attach_bf16(llm.adapter, min_rows=1)
    return llm


def _tolerance(dtype) -> float:
    """Two computations of one pass in `dtype`, relative to the logits' size: a few units of
    bfloat16's last place, or float32's."""
    return 0.02 if dtype == torch.bfloat16 else 1e-4


def _forward(llm, tokens):
    n = tokens.shape[0]
    return llm.adapter.forward(tokens, torch.arange(n), None, None, torch.arange(n))


def _counting(monkeypatch, calls: list) -> None:
    kernel = native.causal

    def counting(q, k, v, scale):
        calls.append((q.shape[1], k.shape[1], q.dtype))
        return kernel(q, k, v, scale)

    monkeypatch.setattr(native, "causal", counting)


@pytest.mark.parametrize("dtype", DTYPES)
def test_long_passes_take_it_and_agree_with_sdpa(monkeypatch, dtype):
    llm = _llm(dtype)
    calls = []
    _counting(monkeypatch, calls)
    tokens = torch.randint(1, 500, (200,))
    served = _forward(llm, tokens)
    assert calls == [(200, 200, dtype)] * 2          # both layers, every new token
    with fast_attention.long_causal_off():
        reference = _forward(llm, tokens)
    assert len(calls) == 2
    assert served.logits.dtype == reference.logits.dtype
    difference = (served.logits.float() - reference.logits.float()).abs().max()
    assert difference < _tolerance(dtype) * reference.logits.float().abs().max()
    short = _forward(llm, tokens[:40])                # pl_attend's rows, never this kernel
    assert len(calls) == 2 and short.logits.shape[0] == 40


def test_a_cpu_without_the_units_keeps_sdpa(monkeypatch):
    monkeypatch.setattr(native, "products_available", lambda kind="bf16": False)
    monkeypatch.setattr(native, "wide", lambda on=None: False)
    for dtype in (torch.bfloat16, torch.float32):
        q, k, v = _inputs(4, 2, 100, 0, 64, dtype=dtype)
        assert not native.causal_fits(q, k, v)
        served = fast_attention.NativeAttention()(None, None, q[None], k[None], v[None], None)
        assert served is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_exact_over_stored_modules_equals_one_causal_pass(monkeypatch, dtype):
    """A new combination under `exact`: the modules after the first recomputed in one pass
    over the first read in place from the store (copied beside the rest for the kernel) --
    as one causal pass over the request's tokens, in the same dtype."""
    llm = _llm(dtype)
    llm.recompute = "exact"
    words = [f"w{i}" for i in range(300)]
    llm.encode('<schema name="long"><module name="a">' + " ".join(words[:90])
               + '</module><module name="b">' + " ".join(words[90:200])
               + '</module><module name="c">' + " ".join(words[200:])
               + "</module></schema>")
    calls = []
    _counting(monkeypatch, calls)
    prompt = '<prompt schema="long"><a/><c/>w5 w6 w7</prompt>'
    exact = llm.prefill(prompt, recompute="exact")
    assert len(exact.recompute) > 64 and exact.approximate_tokens == 0
    assert calls and all(k > q for q, k, _ in calls)    # the past (module a) read too
    sequence = llm.bind(prompt).sequence()
    ids = torch.tensor([t for t, _, _ in sequence])
    full = _forward(llm, ids)
    scale = full.logits[-1].float().abs().max()
    difference = (exact.logits[-1].float() - full.logits[-1].float()).abs().max()
    assert difference < _tolerance(dtype) * scale
    served = llm.prefill(prompt, recompute="none")      # the check can fail
    assert (served.logits[-1].float() - full.logits[-1].float()).abs().max() > 0.2 * scale
