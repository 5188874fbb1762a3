"""Exact reuse (runtime/recompute/exact.py): a unit an `exact` request made exact is served
exactly to every later request with the same tokens before it, and to no other.

The property: a request whose units are all served from exact entries (or exact anyway)
equals one causal pass of the model over its tokens at their positions; a request mixing
exact entries with approximate units equals docs/DESIGN.md's oracle in which the exact units'
tokens attend to every request token before them.
"""

from __future__ import annotations

import pytest
import torch

from promptlang.pml.layout import Segment
from promptlang.runtime.engine import LLM
from promptlang.runtime.recompute import exact
from promptlang.runtime.store import ModuleStore
from promptlang.tokenizer import WordTokenizer

from .oracle import oracle_prefill
from .test_oracle import PROMPTS, SCHEMA, TOL, VOCAB, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def make(model, path, recompute="none") -> LLM:
    """An LLM whose requests serve what they are not told to recompute as stored."""
    llm = LLM.from_model(model, WordTokenizer(VOCAB, bos=True),
                         store=ModuleStore(disk_dir=path / "kv"), recompute=recompute)
    llm.add_schema(SCHEMA)
    return llm


def full_pass(llm: LLM, prompt: str, contiguous: bool = True) -> torch.Tensor:
    """The last token's logits of one causal pass over the request at contiguous positions
    (the plain prompt's prefill: what `exact` equals), or at its layout positions."""
    sequence = llm.bind(prompt).sequence()
    positions = (torch.arange(len(sequence)) if contiguous
                 else torch.tensor([p for _, p, _ in sequence]))
    step = llm.adapter.forward(torch.tensor([t for t, _, _ in sequence]), positions, None, None,
                               torch.tensor([len(sequence) - 1]))
    return step.logits[-1]


def test_a_repeated_request_is_served_exactly_and_recomputes_nothing(model, tmp_path):
    llm = make(model, tmp_path)
    prompt = PROMPTS["two modules with a gap"]         # <a/><last/>: last and the tail missed a
    want = full_pass(llm, prompt)
    first = llm.prefill(prompt, recompute="exact")
    assert first.recompute.positions and first.exact_units == 0
    again = llm.prefill(prompt, recompute="exact")
    assert again.exact_units == 2 and not again.recompute.positions
    plain = llm.prefill(prompt, recompute="none")      # any policy reads the entries
    assert plain.exact_units == 2
    for got in (first, again, plain):
        assert (got.logits[-1] - want).abs().max() < TOL
        assert got.approximate_tokens == 0           # nothing served as encoded apart
    cold = make(model, tmp_path)                       # a new process: from the disk tier
    assert cold.generate(prompt, max_new_tokens=1).exact_units == 2
    approximate = make(model, tmp_path / "other").prefill(prompt)   # the test can fail
    assert (approximate.logits[-1] - want).abs().max() > 1e-3
    assert approximate.approximate_tokens == len(first.recompute.positions) > 0


def test_an_entry_serves_only_requests_with_the_same_tokens_before_it(model, tmp_path):
    llm = make(model, tmp_path)
    llm.prefill('<prompt schema="s"><a/><last/>Question?</user></prompt>', recompute="exact")
    # the text after the units differs: both units (last, the schema's tail) are hits
    assert llm.prefill('<prompt schema="s"><a/><last/>Another one?</user></prompt>'
                       ).exact_units == 2
    # another module before `last`: nothing is the same before it
    assert llm.prefill('<prompt schema="s"><b/><last/>Question?</user></prompt>'
                       ).exact_units == 0
    # an argument before a unit is part of what it saw
    llm.prefill(PROMPTS["union"], recompute="exact")
    assert llm.prefill(PROMPTS["union"]).exact_units > 0
    other = PROMPTS["union"].replace('days="three"', 'days="four"')
    assert llm.prefill(other).exact_units == 0


def test_exact_entries_beside_approximate_units_match_the_oracle(model, tmp_path):
    """b made exact after <a/>, then served to <a/><b/><last/>: b's tokens are as if they
    attended to every token before them; last is approximate (it missed a and b)."""
    llm = make(model, tmp_path)
    llm.prefill('<prompt schema="s"><a/><b/>Go?</user></prompt>', recompute="exact")
    prompt = '<prompt schema="s"><a/><b/><last/>Go?</user></prompt>'
    got = llm.prefill(prompt, all_logits=True)
    assert got.exact_units == 1
    bound = got.bound
    b_positions = {p for _, p, origin in bound.sequence() if origin == "module:b"}
    expected = oracle_prefill(llm.adapter, bound, recomputed=b_positions)
    order = torch.argsort(got.positions)
    assert torch.equal(got.positions[order], expected.positions)
    assert (got.keys[:, :, order] - expected.keys).abs().max() < TOL
    assert (got.values[:, :, order] - expected.values).abs().max() < TOL
    assert (got.logits[-1] - expected.logits[-1]).abs().max() < TOL
    plain = make(model, tmp_path / "other").prefill(prompt, all_logits=True)
    assert plain.exact_units == 0
    assert (plain.logits[-1] - expected.logits[-1]).abs().max() > 1e-3   # b matters


def test_seams_leaves_exact_the_units_before_the_first_argument_it_serves_as_stored(model,
                                                                                   tmp_path):
    """Any policy can make units exact (exact.made_exact): under seams, every unit whose
    candidates were all recomputed and that attended to no approximate token."""
    llm = make(model, tmp_path, recompute="seams")
    prompt = PROMPTS["two modules with a gap"]           # no argument: all exact
    first = llm.prefill(prompt)
    assert first.recompute.positions and first.approximate_tokens == 0
    again = llm.prefill(prompt)
    assert again.exact_units == 2 and not again.recompute.positions
    assert (again.logits[-1] - full_pass(llm, prompt, contiguous=False)).abs().max() < TOL
    # <plan days="two"><tokyo/></plan>: plan's " days." is served as stored (it missed only
    # the argument), so plan's text after the union and the schema's tail, recomputed after
    # it, attended to approximate KV: neither is exact
    shorter = llm.prefill(PROMPTS["shorter argument"])
    assert shorter.recompute.positions and shorter.approximate_tokens > 0
    assert llm.prefill(PROMPTS["shorter argument"]).exact_units == 0


def test_made_exact_needs_every_candidate_below_the_unit_recomputed():
    """made_exact over a hand-made request: a: 0-1, b: 2-4 (candidates 2-4), c: 5-6
    (candidates 5-6)."""
    from types import SimpleNamespace

    segs = [(Segment((1, 2), 0, "text"), "a"), (Segment((3, 4, 5), 2, "text"), "b"),
            (Segment((6, 7), 5, "text"), "c")]
    bound = SimpleNamespace(segments=lambda: segs)
    missed = {"b": [2, 3, 4], "c": [5, 6]}
    assert exact.made_exact(bound, missed, frozenset({2, 3, 4, 5, 6}), []) == ["b", "c"]
    assert exact.made_exact(bound, missed, frozenset({2, 3, 4}), []) == ["b"]
    assert exact.made_exact(bound, missed, frozenset({2, 3, 5, 6}), []) == []   # 4 missed
    assert exact.made_exact(bound, missed, frozenset({5, 6}), ["b"]) == ["c"]  # b served
    assert exact.made_exact(bound, missed, frozenset(), []) == []


def test_the_key_covers_every_token_below_the_units_last_position():
    def seg(ids, start, origin):
        return Segment(tuple(ids), start, "text"), origin

    segments = [seg([5], 0, "module:"), seg([6], 1, "module:a"), seg([7], 2, "uncached"),
                seg([8], 3, "module:a"), seg([9, 10], 4, "module:b")]
    key = exact.exact_key("k", segments, "module:a")
    after = segments[:4] + [seg([1, 2], 4, "module:b")]              # tokens after it: same
    assert key == exact.exact_key("k", after, "module:a")
    changed = [*segments[:2], seg([70], 2, "uncached"), *segments[3:]]
    assert key != exact.exact_key("k", changed, "module:a")          # what it saw changed
    moved = [*segments[:2], seg([7], 2, "module:b"), *segments[3:]]
    assert key == exact.exact_key("k", moved, "module:a")    # the same tokens, whoever's
    assert key != exact.exact_key("other", segments, "module:a")     # the unit itself changed
    assert exact.exact_key("k", segments, "module:c") is None
    straddle = [seg([5], 0, "module:"), seg([6], 1, "module:a"), seg([7, 8, 9], 2, "uncached"),
                seg([11], 3, "module:a")]   # not a real layout: only positions < 3 count
    assert exact.exact_key("k", straddle, "module:a") == exact.exact_key(
        "k", [*straddle[:2], seg([7], 2, "uncached"), straddle[3]], "module:a")


def test_exact_reuse_off_keeps_and_serves_nothing(model, tmp_path):
    """What the benchmarks use to measure each setting apart from the others."""
    llm = LLM.from_model(model, WordTokenizer(VOCAB, bos=True),
                         store=ModuleStore(disk_dir=tmp_path / "kv"), exact_reuse=False)
    llm.add_schema(SCHEMA)
    prompt = PROMPTS["two modules with a gap"]
    want = full_pass(llm, prompt)
    for _ in range(2):
        got = llm.prefill(prompt, recompute="exact")
        assert got.recompute.positions and got.exact_units == 0
        assert (got.logits[-1] - want).abs().max() < TOL
    assert make(model, tmp_path).prefill(prompt).exact_units == 0     # nothing was stored
