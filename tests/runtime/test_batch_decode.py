"""Decoding several requests together (decode.py `steps_together`, one fused pass per step
for all of them): each request's tokens are the ones it decodes alone -- greedy and seeded
sampling, prompts of different lengths, units read in place, one request finishing early."""

from __future__ import annotations

import pytest

from promptlang.runtime.decoding import decode
from promptlang.runtime.decoding.decode import Decoder, steps_together
from promptlang.runtime.engine import LLM
from promptlang.runtime.fast import fused, native
from promptlang.runtime.decoding.sampling import Decoding, SamplingParams
from promptlang.runtime.store import ModuleStore
from promptlang.tokenizer import WordTokenizer

from .tiny import tiny_llama

VOCAB = 1000
SCHEMA = """\
<schema name="b">
  <system>You answer briefly.</system>
  <module name="long">A long document about many things in many words that go on and on
    about rivers and towns and people and the weather in the hills over many years.</module>
  <module name="short">A short note.</module>
  <user>
</schema>
"""
PROMPTS = ['<prompt schema="b"><long/>What happened?</user></prompt>',
           '<prompt schema="b"><short/>Why?</user></prompt>',
           '<prompt schema="b"><long/><short/>Tell me everything you know now.</user></prompt>']


@pytest.fixture(scope="module")
def llm():
    llm = LLM.from_model(tiny_llama(3, VOCAB), WordTokenizer(VOCAB, bos=True),
                         store=ModuleStore(disk_budget_bytes=0), recompute="none")
    llm.add_schema(SCHEMA)
    return llm


def together(llm, prompts, params_list, share_min_tokens=None):
    if share_min_tokens is not None:
        llm.assembler.share_min_tokens = share_min_tokens
    opened = [llm.open(p, room=64, add_generation_prompt=True) for p in prompts]
    decoders = [Decoder(llm.adapter, o.buffer, Decoding(params, llm.tokenizer), o.position,
                        limit=llm.max_positions)
                for o, params in zip(opened, params_list)]
    try:
        for _ in steps_together(decoders, [o.logits for o in opened]):
            pass
    finally:
        for o in opened:
            llm.assembler.release(o.buffer)
    return [d.decoding.result()[1] for d in decoders]


@pytest.mark.parametrize("mode", ["fused", "per request"])
def test_each_request_decodes_as_it_does_alone(llm, monkeypatch, mode):
    params = [SamplingParams(max_new_tokens=12), SamplingParams(max_new_tokens=5),
              SamplingParams(max_new_tokens=9, temperature=0.9, seed=4)]
    alone = [llm.generate(p, sampling=s).token_ids for p, s in zip(PROMPTS, params)]
    batched_calls = []
    real = llm.adapter.forward_batch

    def counted(items):
        out = real(items)
        batched_calls.append((len(items), out is not None))
        return out
    monkeypatch.setattr(llm.adapter, "forward_batch", counted)
    if mode == "fused" and not native.available():
        pytest.skip("CPU kernels unavailable here")
    if mode == "per request":
        with fused.disabled():
            got = together(llm, PROMPTS, params)
        assert batched_calls and not any(ok for _, ok in batched_calls)
    else:
        got = together(llm, PROMPTS, params)
        assert any(n == 3 and ok for n, ok in batched_calls)    # three requests, one pass
    assert got == alone


def test_units_read_in_place_and_an_early_finish(llm):
    if not native.available():
        pytest.skip("CPU kernels unavailable here")
    params = [SamplingParams(max_new_tokens=2), SamplingParams(max_new_tokens=10),
              SamplingParams(max_new_tokens=10)]
    alone = [llm.generate(p, sampling=s).token_ids for p, s in zip(PROMPTS, params)]
    assert together(llm, PROMPTS, params, share_min_tokens=1) == alone


@pytest.mark.parametrize("first", [0, 8], ids=["with the decoders", "prefills first"])
@pytest.mark.parametrize("recompute", ["none", "seams", "ape:0.6:1.4", "query:2"])
def test_prefills_that_join_a_step_decode_as_alone(llm, monkeypatch, recompute, first):
    """Requests whose prefill runs inside a decode step (BatchStepper.join: LLM.start with
    `defer`), one joining while the others are already decoding; under `seams` a new
    combination's prefill recomputes the second module's tokens below the question (the
    positional rule inside the batch). With prefill_first_below, each joining prefill runs
    alone, one a step in the order they joined, while the others wait."""
    if not native.available():
        pytest.skip("CPU kernels unavailable here")
    params = [SamplingParams(max_new_tokens=8), SamplingParams(max_new_tokens=6),
              SamplingParams(max_new_tokens=7, temperature=0.8, seed=3)]
    llm.store.clear()                  # no exact entries of an earlier test's requests
    alone = [llm.generate(p, sampling=s, recompute=recompute).token_ids
             for p, s in zip(PROMPTS, params)]
    llm.store.clear()                  # the combination is new again: seams recompute
    llm.tails.clear()                  # and no prompt tail serves the whole request
    generations = [llm.start(p, sampling=s, recompute=recompute, defer=64)
                   for p, s in zip(PROMPTS, params)]
    assert all(g.opened.pending is not None and g.opened.logits is None for g in generations)
    if recompute in ("seams", "query:2"):      # query:2: the probe ran in start()
        assert generations[2].opened.recomputed_tokens > 0
    if recompute.startswith("ape"):     # <long/><short/>: short was encoded apart
        assert generations[2].opened.buffer.contexts is not None
    calls = []
    real = llm.adapter.forward_batch

    def counted(items):
        calls.append([by_position for *_, by_position in items])
        return real(items)
    monkeypatch.setattr(llm.adapter, "forward_batch", counted)
    stepper = decode.BatchStepper(llm.adapter, prefill_first_below=first)
    started = []
    try:
        for g in generations[:2]:
            stepper.join(g, g.decoder, g.opened.pending)
        started.append([e[0] for e in stepper.step()])   # with the decoders: both prefills
        if first:
            started.append([e[0] for e in stepper.step()])   # prefills first: the second
        stepper.join(generations[2], generations[2].decoder, generations[2].opened.pending)
        while len(stepper):
            stepper.step()
    finally:
        for g in generations:
            g.release()
    if first:           # one prefill a step, alone (no batched call); then the third alone
        assert started == [[generations[0]], [generations[1]]]
        assert calls[0] == [False, False, False]
    else:
        assert sorted(started[0], key=id) == sorted(generations[:2], key=id)
        assert calls[0] == [True, True]                   # two prefills in one pass
        assert sorted(calls[1]) == [False, False, True]   # the third joins two decoding
    assert [g.decoding.result()[1] for g in generations] == alone
