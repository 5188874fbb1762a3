"""Prompt tails seen before (runtime/kv/tails.py): a request whose last uncached run starts
like an earlier request's, after the same units, is served that common prefix and computes
the rest.

The property: such a request equals docs/DESIGN.md's oracle (one masked pass over the request,
its uncached tokens attending to the served units and to each other), as it does without
the reuse; what it reuses is exactly what the earlier request computed.
"""

from __future__ import annotations

import pytest
import torch

from promptlang.runtime.engine import LLM
from promptlang.runtime.passes.prefill import prefill
from promptlang.runtime.store import ModuleStore
from promptlang.runtime.kv.tails import TailCache
from promptlang.tokenizer import WordTokenizer

from .oracle import oracle_prefill
from .test_oracle import SCHEMA, TOL, VOCAB, tiny_model

FIRST = '<prompt schema="s"><a/><last/>Question one two three?</user></prompt>'
SECOND = '<prompt schema="s"><a/><last/>Question one two four?</user></prompt>'


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def make(model, tail_budget_bytes=1 << 20) -> LLM:
    llm = LLM.from_model(model, WordTokenizer(VOCAB, bos=True),
                         store=ModuleStore(disk_budget_bytes=0), recompute="none")
    llm.tails = TailCache(tail_budget_bytes)
    llm.add_schema(SCHEMA)
    return llm


def last_logits(llm: LLM, prompt: str):
    """The request's prefill (the last token's logits only, so a tail may be reused)."""
    return llm.prefill(prompt, all_logits=False)


def test_a_new_question_reuses_the_previous_ones_opening_and_equals_the_oracle(model):
    llm, plain = make(model), make(model, tail_budget_bytes=0)
    first = last_logits(llm, FIRST)
    assert len(llm.tails) == 1
    second = last_logits(llm, SECOND)
    alone = last_logits(plain, SECOND)
    want = oracle_prefill(llm.adapter, llm.bind(SECOND)).logits[-1]
    # "Question one two" (and what precedes it in the user turn) came from the first request
    reused = second.cached_length - alone.cached_length
    assert reused >= 3 and llm.tails.hits == 1 and llm.tails.reused_tokens == reused
    assert plain.tails.hits == 0 and len(plain.tails) == 0
    for got in (second, alone):
        assert (got.logits[-1] - want).abs().max() < TOL
    assert (first.logits[-1] - want).abs().max() > 1e-3          # the test can fail
    computed = lambda p: p.positions.shape[0] - p.cached_length   # noqa: E731
    assert 1 <= computed(second) == computed(alone) - reused


def test_a_repeated_request_computes_nothing_and_starts_from_the_first_ones_logits(model):
    llm, plain = make(model), make(model, tail_budget_bytes=0)
    first = llm.generate(FIRST, max_new_tokens=1)
    again = llm.generate(FIRST, max_new_tokens=6)
    alone = plain.generate(FIRST, max_new_tokens=6)
    assert first.prefill_tokens == alone.prefill_tokens > 1
    assert again.prefill_tokens == 0 and again.tail_tokens == alone.prefill_tokens
    assert again.cached_tokens == alone.cached_tokens + again.tail_tokens
    assert again.token_ids == alone.token_ids and alone.tail_tokens == 0
    # the very logits of the first request's pass, not a recomputation of its last token
    once = last_logits(llm, FIRST)
    want = oracle_prefill(llm.adapter, llm.bind(FIRST)).logits[-1]
    assert once.positions.shape[0] == once.cached_length          # nothing computed
    assert torch.equal(once.logits[-1], last_logits(llm, FIRST).logits[-1])
    assert (once.logits[-1] - want).abs().max() < TOL
    (tail,) = llm.tails._tails.values()
    kept = tail.logits[alone.prefill_tokens]              # after the prompt's tail
    once.logits[-1].add_(1.0)                                     # the caller's copy
    assert not torch.equal(once.logits[-1], kept)


def test_a_tail_serves_only_the_same_units_at_the_same_numerics(model, monkeypatch):
    llm = make(model)
    llm.generate(FIRST, max_new_tokens=1)
    other_units = FIRST.replace("<a/>", "<b/>")
    assert llm.generate(other_units, max_new_tokens=1).tail_tokens == 0
    assert llm.generate(FIRST.replace("Question", "Query"), max_new_tokens=1).tail_tokens == 0
    monkeypatch.setattr(type(llm.adapter), "numerics", property(lambda self: ("other",)))
    assert llm.generate(FIRST, max_new_tokens=1).tail_tokens == 0
    monkeypatch.undo()
    assert llm.generate(FIRST, max_new_tokens=1).tail_tokens > 0


def test_requests_that_recompute_or_read_all_logits_neither_use_nor_leave_tails(model):
    llm = make(model)
    llm.generate(FIRST, max_new_tokens=1, recompute="exact")   # a new seam: recomputed
    assert len(llm.tails) == 0
    llm.prefill(FIRST)                                          # every token's logits
    assert len(llm.tails) == 0
    llm.generate(FIRST, max_new_tokens=1)
    assert len(llm.tails) == 1 and llm.prefill(FIRST).cached_length < llm.prefill(
        FIRST, all_logits=False).cached_length


def test_a_longer_tail_replaces_the_one_it_extends_and_the_budget_holds():
    cache = TailCache(budget_bytes=2 * 2 * 3 * 4 * 4)   # two tails of 3 tokens (keys, values)
    kv = lambda n: torch.zeros(1, 1, n, 4)                        # noqa: E731
    cache.remember("c", [1, 2], [5, 6], kv(2), kv(2))
    cache.remember("c", [1, 2, 3], [5, 6, 7], kv(3), kv(3))
    assert len(cache) == 1
    tail, n = cache.match("c", [1, 2, 3, 9], [5, 6, 7, 8])
    assert n == 3 and tail.token_ids == (1, 2, 3)
    assert cache.match("c", [1, 2, 3], [5, 6, 7])[1] == 2          # the last is computed
    cache.remember("c", [1, 2, 3], [5, 6, 7], kv(3), kv(3), {3: torch.zeros(2)})
    assert cache.match("c", [1, 2, 3], [5, 6, 7])[1] == 3          # with its logits: all
    cache.remember("c", [1, 2, 3, 4], [5, 6, 7, 8], kv(4), kv(4))  # extends it, keeps them
    (longer,) = cache._tails.values()
    assert set(longer.logits) == {3} and cache.match("c", [1, 2, 3], [5, 6, 7])[1] == 3
    assert cache.match("c", [1, 2, 3, 4], [5, 6, 7, 8])[1] == 3    # no logits after 4
    cache.clear()
    cache.remember("c", [1, 2, 3], [5, 6, 7], kv(3), kv(3))
    assert cache.match("c", [1, 2, 3], [6, 7, 8]) == (None, 0)     # other positions
    assert cache.match("d", [1, 2, 3, 9], [5, 6, 7, 8]) == (None, 0)
    cache.remember("c", [4, 4, 4], [5, 6, 7], kv(3), kv(3))
    cache.remember("c", [8, 8, 8], [5, 6, 7], kv(3), kv(3))       # the least recent goes
    assert len(cache) == 2 and cache.nbytes <= cache.budget_bytes
    assert cache.match("c", [1, 2, 3, 9], [5, 6, 7, 8]) == (None, 0)
    with pytest.raises(ValueError, match="tail_budget_bytes"):
        TailCache(-1)


def test_a_request_keeps_its_decoded_tokens_with_the_tail_as_one_pass_computes_them(model):
    llm, plain = make(model), make(model, tail_budget_bytes=0)
    first = llm.generate(FIRST, max_new_tokens=5)
    assert first.finish_reason == "length" and len(llm.tails) == 1
    (tail,) = llm.tails._tails.values()
    decoded = first.token_ids[:-1]                 # the last picked token was never computed
    assert list(tail.token_ids[-len(decoded):]) == decoded
    # the prompt's last token and the decoded ones in one pass over the same request
    # (`open` leaves the prompt's last token to the caller's first step)
    n = len(decoded) + 1
    opened = plain.open(FIRST, room=8)
    try:
        start = opened.buffer.length
        prefill(plain.adapter, opened.buffer, list(tail.token_ids[-n:]),
                list(tail.positions[-n:]))
        want_keys = opened.buffer.slot_keys[:, :, start:start + n].clone()
        want_values = opened.buffer.slot_values[:, :, start:start + n].clone()
    finally:
        plain.assembler.release(opened.buffer)
    assert tail.positions[-n] == opened.position
    assert (tail.keys[:, :, -n:] - want_keys).abs().max() < TOL
    assert (tail.values[:, :, -n:] - want_values).abs().max() < TOL
    # the same request again reuses the kept prompt tail (the decoded tokens follow it)
    assert llm.generate(FIRST, max_new_tokens=1).prefill_tokens == 0


@pytest.mark.parametrize("in_place", [False, True], ids=["copied", "read-in-place"])
def test_a_repeated_request_decodes_bit_for_bit_as_the_first_did(model, in_place):
    """The reused tail sits in the buffer where the first request's pass wrote it, so every
    decode step sees the same pieces in the same order: the decoded tokens' KV equals the
    first request's exactly (not only within rounding; int8 inputs would turn rounding
    into other greedy picks), whether the units are copied or read in place."""
    llm = make(model)
    if in_place:
        llm.assembler.share_min_tokens = 1
    first = llm.generate(FIRST, max_new_tokens=8)
    (kept,) = llm.tails._tails.values()
    keys, values = kept.keys.clone(), kept.values.clone()
    again = llm.generate(FIRST, max_new_tokens=8)
    assert again.prefill_tokens == 0 and again.token_ids == first.token_ids
    (tail,) = llm.tails._tails.values()
    assert tail is not kept and tail.token_ids == kept.token_ids
    assert torch.equal(tail.keys, keys) and torch.equal(tail.values, values)
    assert (llm.assembler.shared_tokens > 0) == in_place
