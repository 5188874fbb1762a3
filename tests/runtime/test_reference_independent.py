"""The oracle's reference owes nothing to promptlang, and neither does a plain call of an
adapted model.

- The reference (tests/runtime/oracle.py) is a fresh transformers model: no hooks, no
  swapped forwards, a stock attention implementation, its own copy of the weights; its
  pass makes no call into runtime/fast/ (kernels.c, the fused layers), the adapter or
  runtime/model/'s attention, whichever kernels the runtime itself runs with.
- Its explicit inputs (position ids, a 4-D mask; BLOOM's blocks called with ALiBi from
  positions) reproduce the stock forward of plain token ids.
- runtime/model/'s promise: calls from outside the runtime's own `ModelAdapter.forward`
  -- `hf_model(ids)`, a cached continuation, another thread while the runtime runs a
  pass -- take no kernel and compute what the unmodified model computes.
"""

from __future__ import annotations

import threading
from collections import defaultdict

import pytest
import torch
from torch.nn.modules import module as nn_module
from transformers import AttentionInterface

from promptlang.runtime.fast import fused, native
from promptlang.runtime.fast.attention import NativeAttention
from promptlang.runtime.fast.linear import NativeLinear
from promptlang.runtime.model import attention as model_py
from promptlang.runtime.engine import LLM
from promptlang.runtime.model import ATTENTION, SCHEMES, ModelAdapter
from promptlang.runtime.model.state import adapted
from promptlang.runtime.store import ModuleStore
from promptlang.tokenizer import WordTokenizer

from .oracle import oracle_prefill, reference_model, reference_pass
from .tiny import tiny_model

VOCAB = 1000
ARCHITECTURES = ["llama", "qwen2", "gpt2", "bloom"]

SCHEMA = """\
<schema name="s">
  <system>You are a careful assistant.</system>
  <module name="a">Alpha text one two three.</module>
  <module name="child-host">Host text <param name="who" len="3"/> after the param.</module>
  <user>
</schema>
"""
PROMPT = '<prompt schema="s"><a/><child-host who="Bob"/>Who is it?</user></prompt>'


@pytest.fixture(scope="module")
def models():
    return {kind: tiny_model(kind, VOCAB) for kind in ARCHITECTURES}


class _Calls:
    """Calls into promptlang's compute paths, by entry point, with the calling thread."""

    def __init__(self):
        self.threads: dict[str, list[int]] = defaultdict(list)

    def total(self, thread: int | None = None) -> int:
        return sum(1 for ids in self.threads.values() for t in ids
                   if thread is None or t == thread)

    def wrap(self, name: str, function):
        def counted(*args, **kwargs):
            self.threads[name].append(threading.get_ident())
            return function(*args, **kwargs)
        return counted


class _CountingLibrary:
    """Stands for the loaded kernels library: every pl_* call is counted, then made."""

    def __init__(self, lib, calls: _Calls):
        self._lib, self._calls = lib, calls

    def __getattr__(self, name):
        return self._calls.wrap(f"kernels.c:{name}", getattr(self._lib, name))


@pytest.fixture
def promptlang_calls(monkeypatch):
    """Counts every call into the kernels (the C library and native.py's entry points), the
    fused layers, the adapter's forward, and runtime/model/'s attention functions and nn.Linear
    replacement. (The ALiBi pre-hooks sit on the adapted model's modules: the reference
    is checked to carry no hooks at all.)"""
    calls = _Calls()
    if native.available():
        monkeypatch.setattr(native, "_lib", _CountingLibrary(native._lib, calls))
    for name in ("linear", "attend", "decoder"):
        monkeypatch.setattr(native, name, calls.wrap(f"native.{name}", getattr(native, name)))
    monkeypatch.setattr(fused.FusedDecoder, "forward",
                        calls.wrap("FusedDecoder.forward", fused.FusedDecoder.forward))
    monkeypatch.setattr(ModelAdapter, "forward",
                        calls.wrap("ModelAdapter.forward", ModelAdapter.forward))
    monkeypatch.setattr(NativeLinear, "__call__",
                        calls.wrap("_NativeLinear", NativeLinear.__call__))
    monkeypatch.setattr(NativeAttention, "__call__",
                        calls.wrap("_native_attention", NativeAttention.__call__))
    for name in ("_with_shared", "_past_and_new", "_outside_attention"):
        monkeypatch.setattr(model_py, name, calls.wrap(name, getattr(model_py, name)))
    registered = AttentionInterface._global_mapping.get(ATTENTION)
    if registered is not None:
        monkeypatch.setitem(AttentionInterface._global_mapping, ATTENTION,
                            calls.wrap("_attention", registered))
    return calls


def make_llm(hf_model, tmp_path) -> LLM:
    llm = LLM.from_model(hf_model, WordTokenizer(VOCAB, bos=True),
                         store=ModuleStore(disk_dir=tmp_path / "kv"))
    llm.add_schema(SCHEMA)
    return llm


def _hooks(module: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
               for m in module.modules())


# --- the reference model ----------------------------------------------------------------------

@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_reference_model_is_a_fresh_unmodified_copy(models, tmp_path, kind):
    hf = models[kind]
    make_llm(hf, tmp_path)                      # the runtime adapts (hooks, wraps) the original
    reference = reference_model(hf)
    assert reference is not hf
    assert reference.config._attn_implementation in ("sdpa", "eager")
    assert "_promptlang_state" not in reference.__dict__
    assert adapted(hf) and not adapted(reference)          # no promptlang state
    assert _hooks(reference) == 0
    assert not (nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks)
    assert not any("forward" in m.__dict__ for m in reference.modules())   # no swapped forward
    ours = {p.data_ptr() for p in hf.parameters()}
    assert not any(p.data_ptr() in ours for p in reference.parameters())   # its own weights
    for (name, mine), (_, theirs) in zip(hf.state_dict().items(),
                                         reference.state_dict().items()):
        assert torch.equal(mine, theirs), name
    if kind == "bloom":          # the original does carry the runtime's pre-hooks
        assert _hooks(hf) > 0


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_reference_pass_makes_no_call_into_promptlang(models, tmp_path, kind, kernels,
                                                      promptlang_calls):
    llm = make_llm(models[kind], tmp_path)
    bound = llm.bind(PROMPT)
    llm.prefill(PROMPT)                         # the runtime's own path, counted
    runtime = promptlang_calls.total()
    assert runtime > 0
    if kernels != "pytorch":
        assert any(name.startswith("kernels.c:") for name in promptlang_calls.threads)
    promptlang_calls.threads.clear()
    expected = oracle_prefill(llm.adapter, bound)
    assert dict(promptlang_calls.threads) == {}
    assert expected.logits.shape[0] > 0 and torch.isfinite(expected.logits).all()


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_reference_inputs_reproduce_the_stock_forward_of_plain_ids(models, kind):
    """Contiguous positions and a causal mask passed explicitly (BLOOM: its blocks called
    with ALiBi from positions) give what the stock model computes from the ids alone."""
    reference = reference_model(models[kind])
    ids = torch.randint(3, VOCAB, (20,), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        stock = reference(input_ids=ids[None])
    causal = torch.ones(20, 20, dtype=torch.bool).tril()
    logits, keys, values = reference_pass(reference, ids, torch.arange(20), causal,
                                          torch.arange(20))
    assert (logits - stock.logits[0]).abs().max() < 1e-5
    stock_keys = torch.stack([layer.keys[0] for layer in stock.cache.layers])
    assert (keys - stock_keys).abs().max() < 1e-5
    # and a shifted copy: only relative positions matter to RoPE and ALiBi, not to GPT-2
    shifted, _, _ = reference_pass(reference, ids, torch.arange(20) + 7, causal,
                                   torch.arange(20))
    moved = (shifted - logits).abs().max()
    assert moved > 1e-3 if kind == "gpt2" else moved < 1e-4


# --- calls of an adapted model from outside the runtime ------------------------------------------

@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_plain_call_of_an_adapted_model_takes_no_kernel_and_equals_a_fresh_model(
        models, tmp_path, kind, promptlang_calls):
    hf = models[kind]
    llm = make_llm(hf, tmp_path)
    llm.prefill(PROMPT)                         # kernels built and in use by the runtime
    assert promptlang_calls.total() > 0
    promptlang_calls.threads.clear()
    ids = torch.randint(3, VOCAB, (24,), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        plain = hf(input_ids=ids[None]).logits[0]
        head = hf(input_ids=ids[None, :16], use_cache=True)
        tail = hf(input_ids=ids[None, 16:], cache=head.cache, use_cache=True).logits[0]
    kernel_calls = {name: len(threads) for name, threads in promptlang_calls.threads.items()
                    if name.startswith(("kernels.c:", "native.", "FusedDecoder"))
                    or name in ("_native_attention", "ModelAdapter.forward")}
    assert kernel_calls == {}
    with torch.inference_mode():
        fresh = reference_model(hf)(input_ids=ids[None]).logits[0]
    assert (plain - fresh).abs().max() < 1e-5
    assert (tail - fresh[16:]).abs().max() < 1e-5      # a cached continuation too


def test_call_from_another_thread_during_a_runtime_pass_takes_no_kernel(models, tmp_path,
                                                                         monkeypatch):
    """The runtime's pass on one thread turns the kernels on for that thread only: a plain
    call made meanwhile on another thread stays on transformers' own layers."""
    if not native.available():
        pytest.skip("CPU kernels unavailable here")
    hf = models["llama"]
    llm = make_llm(hf, tmp_path)
    ids = torch.randint(3, VOCAB, (10,), generator=torch.Generator().manual_seed(4))
    calls = _Calls()
    outside: dict[str, torch.Tensor] = {}

    def plain_call():
        with torch.inference_mode():
            outside["logits"] = hf(input_ids=ids[None]).logits[0]
        outside["thread"] = threading.get_ident()

    def meanwhile(name, function):
        def run(*args, **kwargs):
            calls.threads[name].append(threading.get_ident())
            if not outside:                      # the runtime is inside its pass now
                outside["started"] = True
                other = threading.Thread(target=plain_call)
                other.start()
                other.join()
            return function(*args, **kwargs)
        return run

    for name in ("linear", "attend", "decoder"):
        monkeypatch.setattr(native, name, meanwhile(f"native.{name}", getattr(native, name)))
    llm.prefill(PROMPT)
    assert calls.total(threading.get_ident()) > 0
    assert calls.total(outside["thread"]) == 0
    with torch.inference_mode():
        fresh = reference_model(hf)(input_ids=ids[None]).logits[0]
    assert (outside["logits"] - fresh).abs().max() < 1e-5


def test_every_position_scheme_is_covered_here():
    assert {SCHEMES[kind] for kind in ARCHITECTURES} == set(SCHEMES.values())
