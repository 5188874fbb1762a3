"""The request-buffer pool (runtime/kv/assembler.py): bounded by a byte budget and a keep count,
and invisible in the results."""

from __future__ import annotations

import gc
import random

import pytest

from promptlang.errors import PromptLangError
from promptlang.runtime.kv import assembler as assembler_mod
from promptlang.runtime.kv.assembler import Assembler
from promptlang.runtime.engine import LLM
from promptlang.runtime.model import adapt
from promptlang.runtime.store import ModuleStore
from promptlang.tokenizer import WordTokenizer
from .test_engine import PROMPTS, SCHEMA, VOCAB
from .tiny import tiny_llama


@pytest.fixture(scope="module")
def model():
    return tiny_llama(7, VOCAB)


@pytest.fixture(scope="module")
def adapter(model):
    return adapt(model)


def bytes_per_token(adapter) -> int:
    buffer = Assembler(adapter, budget_bytes=0).acquire(1)
    return buffer.nbytes


def test_idle_buffers_beyond_the_keep_count_are_freed(adapter):
    pool = Assembler(adapter, budget_bytes=1 << 40, keep_idle=2)
    held = [pool.acquire(100) for _ in range(6)]        # six requests at once
    assert pool.allocations == 6 and pool.in_use_bytes == sum(b.nbytes for b in held)
    for buffer in held:
        pool.release(buffer)
    assert len(pool._free) == 2 and pool.dropped == 4
    assert pool.in_use_bytes == 0
    assert pool._free == held[-2:]                       # the most recently used are kept
    again = pool.acquire(100)
    assert pool.allocations == 6 and any(again is b for b in held)


def test_the_pool_stays_under_its_budget_after_many_requests_of_different_sizes(adapter):
    per_token = bytes_per_token(adapter)
    budget = 600 * per_token
    pool = Assembler(adapter, budget_bytes=budget, keep_idle=4)
    rng = random.Random(3)
    in_flight = []
    for _ in range(200):
        if in_flight and (len(in_flight) >= 3 or rng.random() < 0.5):
            pool.release(in_flight.pop(rng.randrange(len(in_flight))))
        else:
            in_flight.append(pool.acquire(rng.randint(1, 400)))
        # idle buffers are kept only within the budget (what is in use may exceed it)
        assert pool.idle_bytes == 0 or pool.idle_bytes + pool.in_use_bytes <= budget
        assert len(pool._free) <= 4
    for buffer in in_flight:
        pool.release(buffer)
    assert pool.in_use_bytes == 0 and 0 < pool.idle_bytes <= budget
    assert pool.dropped > 0


def test_a_buffer_bigger_than_the_budget_is_handed_out_and_freed_on_release(adapter):
    per_token = bytes_per_token(adapter)
    pool = Assembler(adapter, budget_bytes=50 * per_token)
    small = pool.acquire(10)
    pool.release(small)
    big = pool.acquire(1000)                     # a request may use more than the budget
    assert big.capacity >= 1000 and big.nbytes > pool.budget_bytes
    assert pool._free == []                      # the idle small one went to make room
    pool.release(big)
    assert pool._free == [] and pool.idle_bytes == 0


def test_a_buffer_that_is_never_released_does_not_count_against_the_budget_forever(adapter):
    pool = Assembler(adapter, budget_bytes=1 << 40)
    pool.acquire(100)                            # dropped by its caller without release()
    gc.collect()
    assert pool.in_use_bytes == 0


def test_an_idle_buffer_pins_no_store_tensors(adapter):
    pool = Assembler(adapter, budget_bytes=1 << 40)
    buffer = pool.acquire(10)
    buffer.shared = [object()]
    buffer.shared_keys = ["unit"]
    pool.release(buffer)
    assert buffer.shared == [] and buffer.shared_keys == []


def test_releasing_a_buffer_twice_keeps_it_once(adapter):
    pool = Assembler(adapter, budget_bytes=1 << 40)
    buffer = pool.acquire(10)
    pool.release(buffer)
    pool.release(buffer)
    assert len(pool._free) == 1


def _answers(model, tmp_path, **pool):
    llm = LLM.from_model(model, WordTokenizer(VOCAB, bos=True),
                         store=ModuleStore(disk_dir=tmp_path))
    if pool:
        llm.assembler = Assembler(llm.adapter, **pool)
    llm.add_schema(SCHEMA)
    answers = [llm.generate(p, max_new_tokens=6).token_ids for p in PROMPTS * 2]
    return answers, llm.assembler


def test_results_do_not_depend_on_the_pool_budget(model, tmp_path):
    unbounded, _ = _answers(model, tmp_path / "a", budget_bytes=1 << 40)
    nothing_kept, pool = _answers(model, tmp_path / "b", budget_bytes=0)
    assert nothing_kept == unbounded
    assert pool._free == [] and pool.allocations == len(PROMPTS) * 2   # every buffer freed
    default, pool = _answers(model, tmp_path / "c")
    assert default == unbounded
    assert pool.budget_bytes == assembler_mod.DEFAULT_POOL_BUDGET


def test_the_budget_is_read_from_the_environment(monkeypatch, adapter):
    read = assembler_mod.pool_budget
    assert read({}) == 1 << 30
    assert read({"PROMPTLANG_POOL_BYTES": "4096"}) == 4096
    assert read({"PROMPTLANG_POOL_BYTES": " 512M "}) == 512 << 20
    assert read({"PROMPTLANG_POOL_BYTES": "2GiB"}) == 2 << 30
    assert read({"PROMPTLANG_POOL_BYTES": "0"}) == 0
    for bad in ("-1", "lots", "1X"):
        with pytest.raises(PromptLangError, match="PROMPTLANG_POOL_BYTES must be"):
            read({"PROMPTLANG_POOL_BYTES": bad})
    monkeypatch.setenv("PROMPTLANG_POOL_BYTES", "1K")
    assert Assembler(adapter).budget_bytes == 1024
    assert Assembler(adapter, budget_bytes=7).budget_bytes == 7      # the argument wins



def _unit(adapter, start: int, n: int):
    import torch

    from promptlang.runtime.kv.unit import UnitKV

    keys, values = adapter.empty_kv(n)
    keys.copy_(torch.randn(keys.shape))
    values.copy_(torch.randn(values.shape))
    return UnitKV(keys, values, torch.arange(start, start + n), torch.arange(n) % 7 + 3,
                  torch.zeros(n, dtype=torch.bool))


def test_holes_keep_units_read_in_place_up_to_the_run_budget(adapter, monkeypatch):
    """Recomputed tokens split a unit read in place into runs (one attention piece each);
    the request keeps at most MAX_SHARED_PIECES of them in place, in unit order, and copies a
    unit whose runs would pass that -- the same slots, positions and KV either way."""
    from promptlang.runtime.recompute import RecomputePlan
    from promptlang.runtime.kv.plan import Segment

    monkeypatch.setattr(assembler_mod, "MAX_SHARED_PIECES", 6)
    units = [(f"u{i}", _unit(adapter, 100 * i, 40)) for i in range(3)]
    holes = [5, 15, 25] + [110, 120] + [205, 210, 215, 220]      # runs: 4, 3, 5
    plan = RecomputePlan(frozenset(holes), tuple(Segment((1,), p, "recompute") for p in holes))
    pool = Assembler(adapter, share_min_tokens=1)
    buffer = pool.acquire(200)
    assert pool.assemble(buffer, units, plan) == 120 - len(holes)
    runs = [(seg.start, seg.end) for seg in buffer.shared]
    assert len(runs) == 4                            # the first unit's 4 runs; 4 + 3 > 6
    kept = [p for _, kv in units for p in kv.positions.tolist() if p not in holes]
    slots = buffer.positions[:buffer.length].tolist()
    assert sorted(slots) == kept                                 # no token lost or doubled
    read = buffer.keys[:, :, :buffer.length]                      # shared spans copied in
    for at, p in enumerate(slots):
        kv = units[p // 100][1]
        assert bool((read[:, :, at] == kv.keys[:, :, p % 100]).all())
    pool.release(buffer)
