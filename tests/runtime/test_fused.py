"""The fused decoder layers (runtime/fast/fused.py, pl_decoder) against transformers' layers.

Every case runs the same pass twice through the adapter -- fused, and with the fused path
off (transformers' layers on PyTorch's kernels) -- and compares the logits and the keys and
values the pass wrote into the buffer. The oracle tests (test_oracle.py, the `kernels`
fixture) hold the fused path to docs/DESIGN.md's oracle as well.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from promptlang.runtime.fast import fused, native
from promptlang.runtime.fast.fused import FusedDecoder
from promptlang.runtime.model import Past, SharedKV, adapt

pytestmark = pytest.mark.skipif(not native.available(), reason="CPU kernels unavailable here")

VOCAB = 101
TOL = 2e-5


def tiny(kind: str, **extra) -> torch.nn.Module:
    torch.manual_seed(7)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    configs = {
        "llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
        "gemma": transformers.GemmaConfig, "olmo2": transformers.Olmo2Config,
        "granite": transformers.GraniteConfig,
    }
    if kind == "mistral":
        extra.setdefault("sliding_window", None)
    if kind in ("qwen3", "gemma"):
        extra.setdefault("head_dim", 16)
    model = transformers.AutoModelForCausalLM.from_config(configs[kind](**{**common, **extra}))
    with torch.no_grad():                       # sharp attention: errors show
        for param in model.parameters():
            param.normal_(0.0, 0.1 if param.dim() >= 2 else 0.5)
    return model.eval()


@pytest.fixture(scope="module")
def llama():
    return tiny("llama")


def run_both(adapter, input_ids, positions, past, rows):
    """(logits, new keys, new values) fused and unfused, each on a copy of the buffer."""
    results = []
    for off in (False, True):
        copy = Past(past.keys.clone(), past.values.clone(), past.positions, past.shared)
        if off:
            with fused.disabled(), native.disabled():
                step = adapter.forward(input_ids, positions, copy, None, rows)
        else:
            step = adapter.forward(input_ids, positions, copy, None, rows)
        s = past.positions.shape[0]
        assert torch.equal(copy.keys[:, :, :s], past.keys[:, :, :s])      # the past untouched
        results.append((step.logits, step.keys.clone(), step.values.clone()))
    return results


def encoded_past(adapter, length: int, capacity: int, seed: int = 0) -> Past:
    ids = torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))
    keys, values = adapter.empty_kv(capacity)
    with fused.disabled(), native.disabled():
        adapter.forward(ids, torch.arange(length), Past(keys, values, torch.arange(0)), None)
    return Past(keys, values, torch.arange(length))


def assert_close(results):
    (fl, fk, fv), (ul, uk, uv) = results
    assert fl.shape == ul.shape and fk.shape == uk.shape and fv.shape == uv.shape
    for a, b in ((fl, ul), (fk, uk), (fv, uv)):
        torch.testing.assert_close(a, b, rtol=0, atol=TOL)


@pytest.mark.parametrize("kind,extra", [
    ("llama", {}),
    ("llama", {"attention_bias": True, "mlp_bias": True}),
    ("mistral", {}),
    ("qwen2", {}),                                  # q/k/v biases
    ("llama", {"num_key_value_heads": 4}),          # no grouping
    ("llama", {"num_key_value_heads": 1, "head_dim": 24}),   # head_dim * heads != hidden
])
@pytest.mark.parametrize("new", [1, 6, 19])
def test_fused_pass_equals_transformers_layers(kind, extra, new):
    adapter = adapt(tiny(kind, **extra))
    assert adapter.fast.decoder is not None
    past = encoded_past(adapter, 150, 150 + new)
    ids = torch.randint(0, VOCAB, (new,), generator=torch.Generator().manual_seed(new))
    positions = torch.arange(150, 150 + new) + 3               # positions need not follow slots
    assert_close(run_both(adapter, ids, positions, past, torch.arange(new)))


def test_fused_pass_without_a_past_and_with_no_logits(llama):
    adapter = adapt(llama)
    keys, values = adapter.empty_kv(9)
    ids = torch.arange(9) + 5
    results = run_both(adapter, ids, torch.arange(9), Past(keys, values, torch.arange(0)),
                       torch.arange(0))
    assert results[0][0].shape == (0, VOCAB)
    assert_close(results)


def test_fused_pass_reads_shared_units_in_place(llama):
    """Past slots read from stored units' tensors (SharedKV): the buffer's own copy of those
    slots is garbage, and the fused pass must not look at it."""
    adapter = adapt(llama)
    past = encoded_past(adapter, 300, 310)
    shared = []
    for start, end in ((10, 90), (90, 95), (200, 290)):
        shared.append(SharedKV(start, end, past.keys[:, :, start:end].clone(),
                               past.values[:, :, start:end].clone()))
    keys, values = past.keys.clone(), past.values.clone()
    for seg in shared:                                # stale in the buffer
        keys[:, :, seg.start:seg.end] = 1e3
        values[:, :, seg.start:seg.end] = -1e3
    ids = torch.tensor([3, 1, 4, 1, 5, 9, 2])
    positions = torch.arange(300, 307)
    with_shared = run_both(adapter, ids, positions, Past(keys, values, past.positions,
                                                         tuple(shared)), torch.arange(7))
    assert_close(with_shared)
    plain = run_both(adapter, ids, positions, past, torch.arange(7))
    assert (with_shared[0][0] - plain[0][0]).abs().max() < TOL


def test_fused_path_serves_the_pass(llama, monkeypatch):
    """The pass does take pl_decoder (and no per-layer kernel call)."""
    adapter = adapt(llama)
    calls = []
    real = native.decoder
    monkeypatch.setattr(native, "decoder", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(native, "attend", lambda *a, **k: pytest.fail("pl_attend called"))
    past = encoded_past(adapter, 20, 25)
    adapter.forward(torch.arange(5), torch.arange(20, 25), past, None, torch.arange(5))
    assert calls == [1]


@pytest.mark.parametrize("kind", ["qwen3", "gemma", "olmo2", "granite"])
def test_other_structures_are_not_fused(kind):
    """Models with q/k norms, scaled embeddings, other norm placements or multipliers take
    transformers' layers: the registry names no decoder for them, nor are they taken as Llama."""
    model = tiny(kind)
    assert adapt(model).fast.decoder is None
    assert FusedDecoder.of(model, "Llama") is None


@pytest.mark.parametrize("extra", [{"hidden_size": 60, "head_dim": 16},
                                   {"intermediate_size": 90}, {"head_dim": 12}])
def test_shapes_the_kernel_cannot_take_are_not_fused(extra):
    assert FusedDecoder.of(tiny("llama", **extra), "Llama") is None


def test_a_hook_on_the_model_turns_the_fused_path_off(llama):
    adapter = adapt(llama)
    past = encoded_past(adapter, 20, 22)
    seen = []
    handle = llama.model.layers[1].mlp.register_forward_hook(lambda *a: seen.append(1))
    try:
        adapter.forward(torch.arange(2), torch.arange(20, 22), past, None, torch.arange(2))
    finally:
        handle.remove()
    assert seen == [1]


def test_a_masked_pass_or_a_unit_it_cannot_read_takes_transformers_layers(llama, monkeypatch):
    adapter = adapt(llama)
    monkeypatch.setattr(native, "decoder", lambda *a, **k: pytest.fail("pl_decoder called"))
    past = encoded_past(adapter, 20, 23)
    allowed = torch.ones(3, 23, dtype=torch.bool).tril(20)
    allowed[:, 5] = False
    adapter.forward(torch.arange(3), torch.arange(20, 23), past, allowed, torch.arange(3))
    columns_first = past.keys[:, :, :10].transpose(2, 3).contiguous().transpose(2, 3)
    unit = SharedKV(0, 10, columns_first, past.values[:, :, :10])     # rows not contiguous
    adapter.forward(torch.arange(3), torch.arange(20, 23),
                    Past(past.keys, past.values, past.positions, (unit,)), None, torch.arange(3))


def test_a_replaced_weight_is_read_from_its_new_tensor(llama):
    model = tiny("llama")
    adapter = adapt(model)
    past = encoded_past(adapter, 30, 34)
    ids = torch.tensor([1, 2, 3, 4])
    before = run_both(adapter, ids, torch.arange(30, 34), past, torch.arange(4))
    with torch.no_grad():
        layer = model.model.layers[2].mlp.down_proj
        layer.weight = torch.nn.Parameter(layer.weight * -2.0)
    after = run_both(adapter, ids, torch.arange(30, 34), past, torch.arange(4))
    assert_close(after)
    assert (after[0][0] - before[0][0]).abs().max() > 1e-2


def test_a_weight_it_cannot_read_sends_the_pass_to_transformers(monkeypatch):
    model = tiny("llama")
    adapter = adapt(model)
    past = encoded_past(adapter, 30, 33)
    with torch.no_grad():
        layer = model.model.layers[0].self_attn.o_proj
        layer.weight = torch.nn.Parameter(layer.weight.t().contiguous().t())   # column-major
    monkeypatch.setattr(native, "decoder", lambda *a, **k: pytest.fail("pl_decoder called"))
    adapter.forward(torch.arange(3), torch.arange(30, 33), past, None, torch.arange(3))
    assert adapter.fast.decoder._weights() is None


HALVES = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("half", HALVES, ids=str)
def test_16_bit_units_are_read_in_place(llama, monkeypatch, half):
    """A 16-bit store's unit shared as it is: the fused pass reads it where it is and
    equals transformers' layers over the same values widened into the buffer; without the
    fused layers (or with a mask) the pass widens it into the buffer itself."""
    adapter = adapt(llama)
    assert adapter.shares_dtype(half)
    past = encoded_past(adapter, 300, 306)
    unit = SharedKV(20, 260, past.keys[:, :, 20:260].to(half),
                    past.values[:, :, 20:260].to(half))
    widened = Past(past.keys.clone(), past.values.clone(), past.positions)
    widened.keys[:, :, 20:260] = unit.keys.float()
    widened.values[:, :, 20:260] = unit.values.float()
    ids, positions, rows = torch.tensor([5, 6, 7, 8, 9, 10]), torch.arange(300, 306), torch.arange(6)
    with fused.disabled(), native.disabled():
        want = adapter.forward(ids, positions, widened, None, rows)
        want = (want.logits, want.keys.clone(), want.values.clone())

    def shared_past():
        keys, values = past.keys.clone(), past.values.clone()
        keys[:, :, 20:260] = 1e3                     # stale: must not be read
        values[:, :, 20:260] = -1e3
        return Past(keys, values, past.positions, (unit,))

    calls = []
    real = native.decoder
    monkeypatch.setattr(native, "decoder", lambda *a, **k: calls.append(1) or real(*a, **k))
    step = adapter.forward(ids, positions, shared_past(), None, rows)
    assert calls == [1]
    assert_close([(step.logits, step.keys, step.values), want])
    with fused.disabled():                           # transformers' layers, kernels on
        step = adapter.forward(ids, positions, shared_past(), None, rows)
    assert calls == [1]
    assert_close([(step.logits, step.keys, step.values), want])
    masked = torch.ones(6, 306, dtype=torch.bool)
    masked[:, 300:] = torch.ones(6, 6, dtype=torch.bool).tril()
    step = adapter.forward(ids, positions, shared_past(), masked, rows)   # same visibility
    assert calls == [1]
    assert_close([(step.logits, step.keys, step.values), want])


@pytest.mark.parametrize("half", HALVES, ids=str)
def test_a_16_bit_store_is_shared_not_copied_and_matches_pytorch(tmp_path, half):
    from promptlang.runtime.engine import LLM
    from promptlang.runtime.store import ModuleStore
    from promptlang.tokenizer import WordTokenizer

    from .test_oracle import PROMPTS, SCHEMA, VOCAB as WORDS, tiny_model

    store = ModuleStore(disk_dir=tmp_path, dtype=half, compute_dtype=half)
    # recompute "none": every unit served from the store as stored (under the default, exact,
    # the second request would be served the first one's exact entries instead)
    llm = LLM.from_model(tiny_model("llama"), WordTokenizer(WORDS, bos=True), store=store,
                         recompute="none")
    llm.add_schema(SCHEMA)
    llm.assembler.share_min_tokens = 1
    prompt = PROMPTS["nested modules"]
    llm.prefill(prompt)                              # encodes the units
    shared_before = llm.assembler.shared_tokens
    fast = llm.prefill(prompt, all_logits=True)
    assert llm.assembler.shared_tokens > shared_before
    with native.disabled():                          # PyTorch: units widened on assembly
        copied_before = llm.assembler.copied_tokens
        slow = llm.prefill(prompt, all_logits=True)
        assert llm.assembler.copied_tokens > copied_before
    torch.testing.assert_close(fast.logits, slow.logits, rtol=0, atol=1e-4)
    fast_order, slow_order = torch.argsort(fast.positions), torch.argsort(slow.positions)
    assert torch.equal(fast.positions[fast_order], slow.positions[slow_order])   # slots differ
    for a, b in ((fast.keys, slow.keys), (fast.values, slow.values)):
        torch.testing.assert_close(a[:, :, fast_order], b[:, :, slow_order], rtol=0, atol=1e-4)
