"""The CPU kernels (runtime/kernels.c) against PyTorch, and the runtime's use of them.

Skipped where the kernels cannot be built (no AVX2/FMA, no C compiler, PROMPTLANG_NATIVE=0);
the oracle tests then cover the PyTorch paths instead.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from promptlang.runtime import model as model_mod
from promptlang.runtime import fused, native
from promptlang.runtime.model import adapt
from .tiny import tiny_llama

pytestmark = pytest.mark.skipif(not native.available(), reason="CPU kernels unavailable here")


@pytest.mark.parametrize("m,k,n,bias", [(1, 64, 7, False), (2, 576, 576, True), (4, 64, 33, True),
                                        (19, 576, 1536, False), (19, 1536, 576, True),
                                        (64, 128, 130, False), (3, 8, 1, True)])
def test_linear_equals_f_linear(m, k, n, bias):
    g = torch.Generator().manual_seed(m * 1000 + n)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    got = native.linear(x, w, b)
    want = F.linear(x, w, b)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4 * k ** 0.5)


def test_linear_keeps_leading_dims():
    x = torch.randn(1, 5, 64)
    w = torch.randn(24, 64)
    torch.testing.assert_close(native.linear(x, w, None), F.linear(x, w), rtol=1e-5, atol=1e-4)


@torch.no_grad()
def test_linear_fits_only_small_float32_inputs():
    w = torch.randn(16, 64)
    assert native.linear_fits(torch.randn(19, 64), w, 64)
    assert not native.linear_fits(torch.randn(65, 64), w, 64)              # too many rows
    assert not native.linear_fits(torch.randn(4, 64, dtype=torch.float64), w.double(), 64)
    assert not native.linear_fits(torch.randn(4, 60), torch.randn(16, 60), 64)   # k % 8
    assert not native.linear_fits(torch.randn(4, 64), torch.randn(64, 16).t(), 64)
    with torch.enable_grad():
        assert not native.linear_fits(torch.randn(4, 64), w, 64)     # autograd needs F.linear


def _reference(rows, pieces, new_tokens, scale):
    """The same attention as one masked softmax over the concatenated keys."""
    keys = torch.cat([p[0] for p in pieces], 1)
    values = torch.cat([p[1] for p in pieces], 1)
    r = rows.shape[1]
    allowed = torch.ones(r, keys.shape[1], dtype=torch.bool)
    at = 0
    token = torch.arange(r) % new_tokens
    for k, _, causal in pieces:
        n = k.shape[1]
        if causal:
            allowed[:, at:at + n] = torch.arange(n)[None, :] <= token[:, None]
        at += n
    scores = (rows @ keys.transpose(1, 2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, -1) @ values, torch.logsumexp(scores, -1)


@pytest.mark.parametrize("heads,groups,new,d,lengths", [
    (3, 3, 19, 64, [200, 300, 7]),        # the default model's shape, three past pieces
    (2, 2, 1, 16, [1000]),                # a decode step
    (1, 1, 5, 8, []),                     # no past at all
    (2, 4, 20, 32, [129, 1, 64]),         # 80 rows per head: two row blocks
    (1, 2, 3, 128, [130]),                # wide heads; key blocks with remainders
])
def test_attend_equals_masked_softmax(heads, groups, new, d, lengths):
    g = torch.Generator().manual_seed(new * 7 + d)
    rows = torch.randn(heads, groups * new, d, generator=g)
    buffer_k = torch.randn(heads, sum(lengths) + new + 3, d, generator=g)
    buffer_v = torch.randn(heads, sum(lengths) + new + 3, d, generator=g)
    pieces, at = [], 0
    for i, n in enumerate(lengths):
        if i % 2:       # a stored unit's own tensor, read in place
            pieces.append((torch.randn(heads, n, d, generator=g),
                           torch.randn(heads, n, d, generator=g), False))
        else:           # a slice of the buffer (head stride > n * d)
            pieces.append((buffer_k[:, at:at + n], buffer_v[:, at:at + n], False))
            at += n
    pieces.append((buffer_k[:, at:at + new], buffer_v[:, at:at + new], True))
    scale = d ** -0.5 * 2.0                       # peaked scores: a wrong key shows
    assert native.attend_fits(rows, pieces)
    out, lse = native.attend(rows, pieces, new, scale, with_lse=True)
    want_out, want_lse = _reference(rows, pieces, new, scale)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=2e-5)


def test_attend_fits_rejects_what_it_cannot_read():
    rows = torch.randn(2, 6, 16)
    ok = (torch.randn(2, 10, 16), torch.randn(2, 10, 16), False)
    assert native.attend_fits(rows, [ok])
    assert not native.attend_fits(rows, [(ok[0].half(), ok[1], False)])
    assert not native.attend_fits(rows, [(ok[0][:, :, :8], ok[1][:, :, :8], False)])
    strided = torch.randn(2, 16, 10).transpose(1, 2)            # rows of keys not contiguous
    assert not native.attend_fits(rows, [(strided, ok[1], False)])
    assert not native.attend_fits(torch.randn(2, 6, 12), [(torch.randn(2, 4, 12),) * 2 + (False,)])


@pytest.fixture
def unfused():
    with fused.disabled():
        yield


def test_adapter_passes_take_the_kernels_and_match_pytorch(monkeypatch, unfused):
    """A cached pass (past + causal new tokens) through the adapter's transformers layers
    takes pl_attend and pl_linear, and its logits and new KV equal the same pass on
    PyTorch's kernels."""
    hf = tiny_llama(0, 97, max_positions=256)
    adapter = adapt(hf)
    calls = {"attend": 0, "linear": 0}
    real_attend, real_linear = native.attend, native.linear

    def attend(*a, **kw):
        calls["attend"] += 1
        return real_attend(*a, **kw)

    def linear(*a, **kw):
        calls["linear"] += 1
        return real_linear(*a, **kw)

    monkeypatch.setattr(native, "attend", attend)
    monkeypatch.setattr(native, "linear", linear)
    past_ids = torch.randint(0, 97, (40,))
    new_ids = torch.randint(0, 97, (6,))
    keys, values = adapter.empty_kv(64)
    adapter.forward(past_ids, torch.arange(40), model_mod.Past(keys, values, torch.arange(0)),
                    None)
    past = model_mod.Past(keys, values, torch.arange(40))
    calls.update(attend=0, linear=0)
    step = adapter.forward(new_ids, torch.arange(40, 46), past, None,
                           logits_rows=torch.arange(6))
    assert calls["attend"] == 2 and calls["linear"] > 0      # one attention per layer
    fast = (step.logits.clone(), step.keys.clone(), step.values.clone())

    calls.update(attend=0, linear=0)
    with native.disabled():                                    # every kernel back to PyTorch
        step = adapter.forward(new_ids, torch.arange(40, 46), past, None,
                               logits_rows=torch.arange(6))
    assert calls == {"attend": 0, "linear": 0}
    torch.testing.assert_close(fast[0], step.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fast[1], step.keys, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast[2], step.values, rtol=1e-5, atol=1e-5)


def test_the_environment_variable_turns_the_kernels_off():
    assert native.off_by_env({"PROMPTLANG_NATIVE": "0"})
    assert native.off_by_env({"PROMPTLANG_NATIVE": " Off "})
    assert not native.off_by_env({"PROMPTLANG_NATIVE": "1"})
    assert not native.off_by_env({})


def test_linears_are_plain_outside_the_adapter(monkeypatch):
    """transformers' own calls on a model the runtime wraps never take pl_linear."""
    hf = tiny_llama(0, 97, max_positions=256)
    adapt(hf)
    used = []
    monkeypatch.setattr(native, "linear", lambda *a: used.append(1))
    with torch.no_grad():
        hf(torch.randint(0, 97, (1, 5)))
    assert used == []


def test_without_a_working_compiler_the_runtime_falls_back_with_a_warning(monkeypatch, tmp_path):
    monkeypatch.setenv("PROMPTLANG_HOME", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    with pytest.warns(RuntimeWarning, match="no C compiler"):
        assert native._build_and_load() is None
    monkeypatch.setenv("CC", "false")                  # a compiler that fails
    with pytest.warns(RuntimeWarning, match="could not build the CPU kernels"):
        assert native._build_and_load() is None
    assert not list((tmp_path / "native").glob("*.so"))
