"""int8 linear layers (fused.py `attach_int8`, kernels.c I8_KIND): every decoder weight as
int8 rows with a scale per output row, every input row quantized to 12 bits with its own
scale in the pass, integer sums (AVX512_VNNI's or AVX2's: the same). An approximation of the float model, so its contract is a
reference that computes the same numbers another way: transformers' layers with each linear
layer replaced by that arithmetic in float64 (exact for these integer sums). Because the
sums are integers, a request's numbers do not depend on the other rows of its pass."""

from __future__ import annotations

import types

import pytest
import torch

from promptlang.runtime.fast import fused, native
from promptlang.runtime.fast.fused import FusedDecoder, int8_rows, int8_values
from promptlang.runtime.model import Past, adapt

from .test_fused import TOL, VOCAB, encoded_past, tiny
from .test_fused_batch import alone, piece, request

pytestmark = pytest.mark.skipif(
    not native.available() or not native.products_available("int8"),
    reason="needs the CPU kernels")


@pytest.fixture(params=["256-bit", "512-bit"], autouse=True)
def tiles(request):
    """Every test on AVX2's integer products and again on AVX512_VNNI's (the 512-bit tiles;
    where the CPU has them)."""
    was = native.wide()
    if request.param == "512-bit" and not (native.wide(True) and native.vnni()):
        native.wide(was)
        pytest.skip("this CPU has no AVX512_VNNI")
    native.wide(request.param == "512-bit")
    yield request.param
    native.wide(was)

X_MAX = 2047          # kernels.c: the inputs' 12 bits
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def model(**extra) -> torch.nn.Module:
    """A tiny Llama whose widths are multiples of 64 (the int8 tiles' step)."""
    return tiny("llama", hidden_size=128, intermediate_size=192, **extra)


def unpack(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8_rows' (q, scale) of `weight`."""
    return int8_values(int8_rows(weight), *weight.shape)


def int8_forward(self, x: torch.Tensor) -> torch.Tensor:
    """nn.Linear as kernels.c computes it with I8_KIND weights."""
    q, sw = unpack(self.weight.detach())
    rows = x.reshape(-1, x.shape[-1]).float()
    m = rows.abs().amax(dim=1)
    qx = torch.round(rows * torch.where(m > 0, X_MAX / m, 0)[:, None])
    y = (qx.double() @ q.double().T).float() * ((m / X_MAX)[:, None] * sw[None, :])
    if self.bias is not None:
        y = y + self.bias
    return y.reshape(*x.shape[:-1], q.shape[0])


def reference(adapter, input_ids, positions, past: Past, rows=None):
    """(logits, keys, values) of transformers' layers with int8 linear layers."""
    layers = adapter.model.model.layers
    swapped = [layer.get_submodule(name) for layer in layers for name in LINEARS]
    for lin in swapped:
        lin.forward = types.MethodType(int8_forward, lin)
    try:
        copy = Past(past.keys.clone(), past.values.clone(), past.positions, past.shared)
        with fused.disabled(), native.disabled():
            step = adapter.forward(input_ids, positions, copy, None, rows)
        return step.logits, step.keys.clone(), step.values.clone()
    finally:
        for lin in swapped:
            del lin.forward


def per_token(diff: torch.Tensor) -> torch.Tensor:
    """The largest |difference| of each token: logits [Q, V], keys/values [L, H, Q, D]."""
    return diff.abs().amax(dim=1) if diff.dim() == 2 else diff.abs().amax(dim=(0, 1, 3))


def served(adapter, input_ids, positions, past: Past, rows=None):
    copy = Past(past.keys.clone(), past.values.clone(), past.positions, past.shared)
    step = adapter.forward(input_ids, positions, copy, None, rows)
    return step.logits, step.keys.clone(), step.values.clone()


@pytest.mark.parametrize("n", [8, 16, 40])        # rows only, one panel, panels and rows
def test_int8_rows_holds_each_row_s_quantized_values(n):
    w = torch.randn(n, 64) * torch.linspace(0.1, 3, n)[:, None]
    w[3] = 0.0
    q, scale = unpack(w)
    assert q.abs().max() == 127 and torch.equal(q[3], torch.zeros(64, dtype=torch.int8))
    assert ((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-6).all()
    buf = int8_rows(w)
    assert buf.numel() == n * (64 + 4)
    if n >= 16:                  # a panel: row j's weights i, i + 1 at (i / 2) * 32 + 2j
        assert buf[69] == q[2, 5].view(torch.uint8) and buf[33] == q[0, 3].view(torch.uint8)


@pytest.mark.parametrize("m,k,n", [(1, 64, 4), (5, 128, 36), (23, 576, 192), (4, 1536, 7),
                                   (30, 64, 33)])
def test_the_int8_linear_layer_is_its_integer_arithmetic_bit_for_bit(m, k, n):
    g = torch.Generator().manual_seed(m + k)
    x = torch.randn(m, k, generator=g) * torch.rand(k, generator=g) * 4
    x[0, 3] = 40.0                                       # an outlier channel
    if m > 2:
        x[2] = 0.0                                       # a zero row: scale 0
    lin = torch.nn.Linear(k, n, bias=False)
    torch.nn.init.normal_(lin.weight, generator=g)
    got = native.linear_i8(x, int8_rows(lin.weight.detach()), n)
    assert torch.equal(got, int8_forward(lin, x))
    assert not torch.equal(got, lin(x))
    # integer sums: each row's numbers are its own, whatever rows share the pass
    rows = int8_rows(lin.weight.detach())
    for i in range(m):
        assert torch.equal(native.linear_i8(x[i:i + 1], rows, n), got[i:i + 1])


@pytest.mark.parametrize("new,past_len", [(1, 0), (5, 0), (1, 300), (19, 300), (64, 120)])
@pytest.mark.parametrize("extra", [{}, {"attention_bias": True, "mlp_bias": True}],
                         ids=["plain", "biases"])
def test_the_fused_int8_pass_equals_the_int8_reference_and_not_the_float_model(
        new, past_len, extra):
    adapter = adapt(model(**extra))
    decoder = adapter.fast.decoder
    capacity = past_len + new
    past = encoded_past(adapter, past_len, capacity, seed=past_len) if past_len \
        else Past(*adapter.empty_kv(capacity), torch.arange(0))
    ids = torch.randint(0, VOCAB, (new,), generator=torch.Generator().manual_seed(new))
    positions = torch.arange(past_len, past_len + new)
    rows = torch.arange(new)
    served_float = served(adapter, ids, positions, past, rows)
    assert decoder.attach_int8() == 7 * len(decoder.layers)
    got = served(adapter, ids, positions, past, rows)
    want = reference(adapter, ids, positions, past, rows)
    for a, b, c in zip(got, want, served_float):
        assert a.shape == b.shape
        # the same integer sums (the linear layer alone: bit for bit, above); the float parts
        # around them differ from transformers' by summation order, which now and then moves
        # an input across a rounding boundary (one step of 4095: it then reaches the rows
        # after it through the attention), so rows are held to the reference by their median,
        # and the approximation to be real
        error, off = per_token(a - b), per_token(a - c)
        assert error.median() < 0.1 * off.median()
        assert off.min() > 0


def test_a_pass_the_fused_layers_do_not_take_is_the_float_model_s():
    adapter = adapt(model())
    new = 80                                      # > fused.MAX_TOKENS: transformers' layers
    past = Past(*adapter.empty_kv(new), torch.arange(0))
    ids, rows = torch.randint(0, VOCAB, (new,)), torch.arange(new)
    want = served(adapter, ids, torch.arange(new), past, rows)
    assert adapter.fast.decoder.attach_int8() > 0
    got = served(adapter, ids, torch.arange(new), past, rows)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_a_request_in_a_batch_differs_from_alone_by_an_input_rounding_at_most():
    """The linear layers give a row the same numbers in any batch (above); the attention's
    float sums may differ from alone in the last bits (the batch decides its tasks' key
    ranges: test_fused_batch's TOL), and that can move an input across a 12-bit rounding
    boundary: one step of 4095 of that input's row, not more."""
    dec = FusedDecoder.of(model(), "Llama")
    assert dec.attach_int8() > 0
    layers, heads, d = len(dec.layers), dec.kv_heads, dec.head_dim
    shared = piece(layers, heads, 90, d, 1)
    rs = [request(dec, [shared], 9, 90, 2), request(dec, [piece(layers, heads, 40, d, 3)], 1, 40, 4),
          request(dec, [shared, piece(layers, heads, 7, d, 5)], 30, 97, 6)]
    expected = [alone(dec, r) for r in rs]
    got = dec.forward_batch(rs)
    assert got is not None
    for r, logits, (want, keys, values) in zip(rs, got, expected):
        scale = want.abs().max().item()
        assert per_token(logits - want).median() < 1e-3 * scale
        assert (logits - want).abs().max() < 1e-2 * scale
        assert (r.new_keys - keys).abs().max() < 1e-2 * keys.abs().max()
        assert (r.new_values - values).abs().max() < 1e-2 * values.abs().max()


def test_a_replaced_weight_turns_int8_off_and_float_serves():
    adapter = adapt(model())
    decoder = adapter.fast.decoder
    assert decoder.attach_int8() == 21 and decoder.quantized_weights == 21
    with torch.no_grad():
        decoder.layers[0].mlp.up_proj.weight.mul_(1.5)
    assert decoder.quantized_weights == 0
    ids = torch.arange(4)
    past = Past(*adapter.empty_kv(4), torch.arange(0))
    rows = torch.arange(4)
    with fused.disabled(), native.disabled():
        want = served(adapter, ids, torch.arange(4), past, rows)[0]
    assert (served(adapter, ids, torch.arange(4), past, rows)[0] - want).abs().max() < TOL


def test_widths_the_int8_tiles_cannot_take_are_not_attached():
    dec = FusedDecoder.of(tiny("llama", hidden_size=96, intermediate_size=192), "Llama")
    assert dec.attach_int8() == 0 and dec.quantized_weights == 0


def test_load_serves_int8_and_keys_its_kv_apart(tiny_model_dir, tmp_path):
    import shutil

    from promptlang.runtime import engine

    folder = tmp_path / "wide"
    model(num_hidden_layers=2, vocab_size=49152).save_pretrained(folder)
    for path in tiny_model_dir.iterdir():
        if path.is_file() and "token" in path.name:
            shutil.copy(path, folder / path.name)
    plain = engine.load(folder)
    eight = engine.load(folder, int8_linears=True)
    both = engine.load(folder, int8_linears=True, bf16_attention=True)
    assert plain.adapter.fast.decoder.quantized_weights == 0
    assert eight.adapter.fast.decoder.quantized_weights == 2 * len(LINEARS)
    # KV computed with int8 products is not the float model's: stored apart from it (and
    # from bf16 attention's, where the CPU has it: else that one warns and stays float)
    assert eight.adapter.fingerprint != plain.adapter.fingerprint
    assert len({plain.adapter.fingerprint, eight.adapter.fingerprint,
                both.adapter.fingerprint}) == (3 if native.products_available("bf16") else 2)
    eight.add_schema("<schema name='q'><system>Answer briefly.</system><module name='doc'>The "
                     "tower stands in the old town, by the river.</module></schema>")
    result = eight.generate("<prompt schema='q'><doc/><user>Where is the tower?</user>"
                            "<assistant></prompt>", max_new_tokens=4, temperature=0)
    assert len(result.token_ids) == 4


def test_a_model_the_int8_tiles_cannot_take_loads_float_with_a_warning(tiny_model_dir):
    from promptlang.runtime import engine

    plain = engine.load(tiny_model_dir)                       # 32 wide
    with pytest.warns(RuntimeWarning, match="int8_linears needs the CPU kernels and layer widths"):
        eight = engine.load(tiny_model_dir, int8_linears=True)
    assert eight.adapter.fast.decoder.quantized_weights == 0
    assert eight.adapter.fingerprint == plain.adapter.fingerprint


def test_where_int8_cannot_run_what_was_attached_stays(monkeypatch):
    dec = FusedDecoder.of(model(), "Llama")
    assert dec.attach_int8() == 21
    monkeypatch.setattr(native, "products_available", lambda kind="bf16": False)
    assert dec.attach_int8() == 0
    assert dec.quantized_weights == 21


def test_the_commands_take_the_approximations(tiny_model_dir, tmp_path, capsys):
    from promptlang import cli

    from .test_quantize import run_files

    files = run_files(tmp_path, 2)
    with pytest.warns(RuntimeWarning, match="int8_linears needs"):     # 32 wide
        assert cli.main(["run", *files, "--model", str(tiny_model_dir), "--int8-linears",
                         "--bf16-attention"]) == 0
    capsys.readouterr()
    assert cli.main(["serve", "--ray", "--int8-linears"]) == 2
    assert "not available with --ray" in capsys.readouterr().err
