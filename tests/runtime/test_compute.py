"""bfloat16 compute (runtime/model/compute.py): which dtype `load(compute=...)` picks, the
measured switch point, and the bfloat16 passes held to the oracle computed in bfloat16
(one forward pass of the unmodified model, in bfloat16, with the explicit mask).

The float32 path is the rest of the suite (every oracle test runs with no twin). The
bfloat16 passes run only on a CPU with AMX or AVX512-BF16, and elsewhere those tests skip.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from promptlang.errors import ConfigError
from promptlang.runtime.engine import LLM
from promptlang.runtime.model import compute
from promptlang.runtime.model.compute import (Bf16Compute, attach_bf16, measure_min_rows,
                                              read_min_rows, resolve, write_min_rows)
from promptlang.runtime.store import ModuleStore
from promptlang.tokenizer import WordTokenizer

from .oracle import oracle_prefill
from .test_oracle import PROMPTS, SCHEMA, VOCAB
from .tiny import tiny_model

HAS_UNITS = bool(compute.cpu_bf16_units())
needs_units = pytest.mark.skipif(not HAS_UNITS, reason="this CPU has no bfloat16 matrix units")

# bfloat16 keeps 8 bits of mantissa: two bfloat16 computations of one pass, summed in
# different orders, differ by a few units in the last place of each activation. The
# tiny models' logits are O(1); a wrong mask or position moves them by O(1) (checked below).
TOL = 0.05


def test_resolve_picks_float32_unless_asked_and_able(monkeypatch):
    monkeypatch.setattr(compute, "cpu_bf16_units", lambda: ())
    assert resolve("float32") == torch.float32
    assert resolve(None) == torch.float32
    assert resolve("auto") == torch.float32
    with pytest.raises(ConfigError, match="AMX or AVX512-BF16"):
        resolve("bfloat16")
    monkeypatch.setattr(compute, "cpu_bf16_units", lambda: ("amx_bf16",))
    assert resolve("auto") == torch.bfloat16
    assert resolve("bfloat16") == torch.bfloat16
    assert resolve(torch.bfloat16) == torch.bfloat16
    with pytest.raises(ConfigError, match="float32, bfloat16, auto"):
        resolve("float16")


def test_the_switch_point_is_where_bfloat16_stays_faster():
    costs = {8: (1.0, 2.0), 16: (2.0, 1.5), 32: (4.0, 4.5), 64: (8.0, 5.0), 128: (16.0, 8.0)}
    rows, timings = measure_min_rows(lambda n, bf16: costs[n][bf16], rows=tuple(costs),
                                     repeats=1)
    assert rows == 64               # 16 wins once, but 32 does not: the switch is above it
    assert timings["64"] == {"float32": 8000.0, "bfloat16": 5000.0}
    never, _ = measure_min_rows(lambda n, bf16: 1.0 + bf16, rows=(8, 16), repeats=1)
    assert never == 32              # beyond the range measured


def test_the_switch_point_is_kept_privately(tmp_path, monkeypatch):
    monkeypatch.setenv("PROMPTLANG_HOME", str(tmp_path))
    path = compute.calibration_file("f" * 32)
    assert path.parent == tmp_path / "compute"
    assert read_min_rows(path) is None
    write_min_rows(path, 48, {"48": {"float32": 2.0, "bfloat16": 1.0}})
    assert read_min_rows(path) == 48
    assert path.stat().st_mode & 0o777 == 0o600
    path.chmod(0o666)               # a file others may write is not read
    assert read_min_rows(path) is None
    path.chmod(0o600)
    path.write_text(json.dumps({"min_rows": "many"}))
    assert read_min_rows(path) is None


def test_a_compute_that_serves_nothing_while_turned_off():
    state = Bf16Compute(model=torch.nn.Identity(), min_rows=16)
    assert state.serves(16) and not state.serves(15)
    state.disabled_depth = 1
    assert not state.serves(1000)


def test_a_request_decides_its_passes_side_whatever_their_rows():
    state = Bf16Compute(model=torch.nn.Identity(), min_rows=16)
    assert state.for_request(16) and not state.for_request(15)
    with state.passes(True):
        assert state.serves(1)
        with state.passes(False):
            assert not state.serves(10_000)
        assert state.serves(1)
    assert not state.serves(1) and state.serves(16)        # no decision: the row count
    state.disabled_depth = 1
    with state.passes(True):
        assert not state.serves(1)                         # a seam's passes stay float32


def _llm(tmp_path, recompute="none") -> LLM:
    model = tiny_model("llama", VOCAB)
    llm = LLM.from_model(model, WordTokenizer(VOCAB, bos=True),
                         store=ModuleStore(disk_dir=tmp_path / "kv"), recompute=recompute,
                         exact_reuse=False)
    llm.add_schema(SCHEMA)
    return llm


@needs_units
def test_the_twin_is_a_bfloat16_copy_and_names_itself(tmp_path):
    llm = _llm(tmp_path)
    adapter = llm.adapter
    before = adapter.fingerprint
    state = attach_bf16(adapter, min_rows=1)
    assert adapter.compute is state
    assert adapter.compute_dtype == torch.bfloat16
    assert adapter.weights_fingerprint == before != adapter.fingerprint
    params = list(state.model.parameters())
    assert {p.dtype for p in params} == {torch.bfloat16}
    originals = {p.data_ptr() for p in adapter.model.parameters()}
    assert not originals & {p.data_ptr() for p in params}
    assert {p.dtype for p in adapter.model.parameters()} == {torch.float32}
    with adapter.lock, adapter.float32_passes():
        assert not state.serves(10_000)
    assert state.serves(1)


@needs_units
@pytest.mark.parametrize("case", ["nested modules", "union", "scaffold", "cache false"])
def test_bfloat16_prefill_equals_the_oracle_in_bfloat16(tmp_path, case):
    llm = _llm(tmp_path)
    state = attach_bf16(llm.adapter, min_rows=1)
    prompt = PROMPTS[case]
    cached = llm.prefill(prompt, all_logits=True)
    bound = llm.bind(prompt)
    twin = SimpleNamespace(model=state.model)     # oracle_prefill reads `.model`
    expected = oracle_prefill(twin, bound)
    wrong = oracle_prefill(twin, bound, isolate=True)
    order = torch.argsort(cached.positions)
    assert torch.equal(cached.positions[order], expected.positions)
    assert cached.keys.dtype == torch.float32            # KV stays float32
    logits = expected.logits.float()
    assert (cached.logits - logits).abs().max() < TOL
    assert (cached.keys[:, :, order] - expected.keys.float()).abs().max() < TOL
    assert (cached.values[:, :, order] - expected.values.float()).abs().max() < TOL
    # the check can fail: another visibility moves the outputs far beyond the tolerance
    assert (wrong.logits.float() - logits).abs().max() > 10 * TOL


@needs_units
def test_exact_in_bfloat16_equals_one_causal_pass_in_bfloat16(tmp_path):
    """`exact` over modules encoded apart, on the twin, equals one causal pass of the twin
    over the request's tokens at contiguous positions (the float32 contract, in bfloat16)."""
    llm = _llm(tmp_path, recompute="exact")
    attach_bf16(llm.adapter, min_rows=1)
    prompt = PROMPTS["two modules with a gap"]
    sequence = llm.bind(prompt).sequence()
    full = llm.adapter.forward(torch.tensor([t for t, _, _ in sequence]),
                               torch.arange(len(sequence)), None, None,
                               torch.tensor([len(sequence) - 1]))
    exact = llm.prefill(prompt)
    assert len(exact.recompute) > 0 and exact.approximate_tokens == 0
    order = torch.argsort(exact.positions)
    assert (exact.logits[-1] - full.logits[-1]).abs().max() < TOL
    assert (exact.keys[:, :, order] - full.keys).abs().max() < TOL
    served = llm.prefill(prompt, recompute="none")      # the test can fail
    order = torch.argsort(served.positions)
    assert (served.logits[-1] - full.logits[-1]).abs().max() > 4 * TOL
    assert (served.keys[:, :, order] - full.keys).abs().max() > 10 * TOL


@needs_units
def test_short_passes_stay_float32(tmp_path):
    """Below the switch point every pass takes the float32 paths: the answers are the
    float32 model's to float32 precision."""
    reference = _llm(tmp_path / "a").prefill(PROMPTS["union"], all_logits=True)
    llm = _llm(tmp_path / "b")
    attach_bf16(llm.adapter, min_rows=10_000)
    got = llm.prefill(PROMPTS["union"], all_logits=True)
    assert (got.logits - reference.logits).abs().max() < 1e-4


@needs_units
def test_bfloat16_and_float32_kv_are_stored_apart(tmp_path):
    llm = _llm(tmp_path)
    schema = llm.layout(llm.add_schema(SCHEMA))
    made = llm.encoder.warm(schema)
    assert made > 0
    assert llm.encoder.warm(schema) == 0             # all stored
    attach_bf16(llm.adapter, min_rows=1)
    again = LLM(llm.adapter, llm.tokenizer, llm.store, exact_reuse=False)
    assert again.encoder.warm(again.layout(again.add_schema(SCHEMA))) == made   # none reused
    assert len(llm.store.entries()) == 2 * made


def test_bfloat16_compute_needs_the_units(monkeypatch, tiny_model_dir):
    from promptlang.runtime import engine

    monkeypatch.setattr(compute, "cpu_bf16_units", lambda: ())
    with pytest.raises(ConfigError, match="AMX or AVX512-BF16"):
        engine.load(tiny_model_dir, compute="bfloat16")
    llm = engine.load(tiny_model_dir, compute="auto")
    assert llm.adapter.compute is None


def test_the_dtype_flag_reaches_load():
    import argparse

    from promptlang.cli import numerics

    parser = argparse.ArgumentParser()
    numerics.add(parser)
    assert numerics.load_options(parser.parse_args([])) == {}
    assert numerics.load_options(parser.parse_args(["--dtype", "auto"])) == {"compute": "auto"}
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "float16"])
    assert numerics.COMPUTE_CHOICES == compute.CHOICES


def _sides(monkeypatch, adapter) -> list[tuple[int, bool]]:
    """(rows, on the twin) of every pass of `adapter` from now on."""
    seen = []
    serves = adapter.compute.serves

    def record(rows):
        answer = serves(rows)
        seen.append((rows, answer))
        return answer
    monkeypatch.setattr(adapter.compute, "serves", record)
    return seen


@needs_units
def test_a_requests_passes_take_its_side_whatever_the_cache_holds(tmp_path, monkeypatch):
    """The side a prompt's passes run on follows the request alone: the same request, its
    exact entries cached, runs its short remaining pass on the twin as its long first one
    did (a short pass once ran in float32 there: answers moved with the cache's state);
    exact entries made on one side are never served to a request of the other."""
    llm = _llm(tmp_path, recompute="exact")
    llm.exact_reuse = True
    prompt = PROMPTS["two modules with a gap"]
    tokens = len(llm.bind(prompt).token_ids())
    attach_bf16(llm.adapter, min_rows=tokens)              # this request: the twin
    seen = _sides(monkeypatch, llm.adapter)
    first = llm.prefill(prompt)
    assert len(first.recompute) > 0
    seen.clear()
    again = llm.prefill(prompt)                           # its exact entries serve it now
    assert again.exact and len(again.recompute) == 0
    assert 0 < len(again.token_ids) - again.cached_length < tokens
    assert seen and all(twin for _rows, twin in seen)      # short passes, still the twin
    assert (again.logits[-1] - first.logits[-1]).abs().max() < TOL
    llm.adapter.compute.min_rows = tokens + 1               # now: float32 for this request
    seen.clear()
    third = llm.prefill(prompt)
    assert not third.exact and len(third.recompute) > 0     # the twin's entries: not its own
    assert seen and not any(twin for _rows, twin in seen)


@needs_units
def test_a_twin_side_prefill_never_joins_the_float32_batch(tmp_path, monkeypatch):
    from promptlang.runtime.decoding.decode import BatchStepper, Decoder  # noqa: F401
    from promptlang.runtime.decoding.sampling import SamplingParams

    llm = _llm(tmp_path, recompute="exact")
    prompt = PROMPTS["two modules with a gap"]
    attach_bf16(llm.adapter, min_rows=1)                  # every request: the twin
    batches = []
    real = llm.adapter.forward_batch
    monkeypatch.setattr(llm.adapter, "forward_batch",
                        lambda items: batches.append(len(items)) or real(items))
    params = SamplingParams(max_new_tokens=3)
    alone = llm.generate(prompt, max_new_tokens=3)
    started = [llm.start(prompt, sampling=params, defer=64) for _ in range(2)]
    assert all(s.opened.pending is not None and s.opened.pending.bf16 for s in started)
    stepper = BatchStepper(llm.adapter)
    for index, s in enumerate(started):
        stepper.join(index, s.decoder, s.opened.pending)
    tokens = {0: [], 1: []}
    for _ in range(10):
        for key, token, _delta, _done in stepper.step():
            if token is not None:
                tokens[key].append(token)
        if not len(stepper):
            break
    assert tokens[0] == tokens[1] == alone.token_ids
    assert batches and max(batches) >= 2                   # the decode steps were batched
