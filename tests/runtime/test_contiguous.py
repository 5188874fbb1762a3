"""`exact` at contiguous positions (runtime/recompute/contiguous.py): a request with gaps in its
layout positions -- a module left out, an argument shorter than its bound -- answers as the
plain prompt's own prefill does, checked against transformers run on the plain tokens."""

from __future__ import annotations

import pytest
import torch

from promptlang.pml.layout import Segment
from promptlang.runtime.engine import LLM
from promptlang.runtime.recompute import contiguous, exact
from promptlang.runtime.store import ModuleStore
from promptlang.tokenizer import WordTokenizer

from .oracle import reference_model
from .test_oracle import PROMPTS, SCHEMA, TOL, VOCAB, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def make(model, path, schema=SCHEMA, recompute="exact") -> LLM:
    llm = LLM.from_model(model, WordTokenizer(VOCAB, bos=True),
                         store=ModuleStore(disk_dir=path / "kv"), recompute=recompute)
    llm.add_schema(schema)
    return llm


def plain_logits(model, ids: list[int]) -> torch.Tensor:
    """transformers' own forward over the plain tokens (positions 0..n-1): the last row."""
    with torch.no_grad():
        return reference_model(model)(torch.tensor([ids])).logits[0, -1]


def plain_greedy(model, ids: list[int], count: int) -> list[int]:
    """transformers' greedy continuation of the plain tokens, one full pass per token."""
    ids = list(ids)
    out = []
    for _ in range(count):
        out.append(int(plain_logits(model, ids).argmax()))
        ids.append(out[-1])
    return out


@pytest.mark.parametrize("case", sorted(PROMPTS))
def test_exact_answers_as_transformers_does_on_the_plain_prompt(model, tmp_path, case):
    """Every prompt, gaps or none: the first request (modules encoded apart, recomputed) and
    the repeated one (served from exact entries) give transformers' logits on the plain
    tokens, and its greedy answer token for token."""
    llm = make(model, tmp_path)
    ids = llm.bind(PROMPTS[case]).token_ids()
    want = plain_logits(model, ids)
    gaps = contiguous.renumbering(llm.bind(PROMPTS[case])) is not None
    for _ in range(2):
        got = llm.prefill(PROMPTS[case])
        assert got.renumbered == gaps
        assert (got.logits[-1] - want).abs().max() < TOL
    answer = llm.generate(PROMPTS[case], max_new_tokens=6)
    assert answer.renumbered == gaps
    assert answer.token_ids == plain_greedy(model, ids, len(answer.token_ids))
    assert len(answer.token_ids) > 0


def test_the_cases_have_gaps_and_layout_positions_would_differ(model, tmp_path):
    """The test above can fail: at layout positions (policy none after the first request
    of the same prompt, an exact entry aside) the gap cases differ from the plain prefill."""
    llm = make(model, tmp_path, recompute="none")
    llm.exact_reuse = False
    gapped = [case for case in PROMPTS if contiguous.renumbering(llm.bind(PROMPTS[case]))]
    assert {"two modules with a gap", "shorter argument"} <= set(gapped)
    for case in gapped:
        got = llm.prefill(PROMPTS[case], recompute="deviation:1")   # exact at layout positions
        want = plain_logits(model, llm.bind(PROMPTS[case]).token_ids())
        assert not got.renumbered
        assert (got.logits[-1] - want).abs().max() > 1e-3


GAPS = """\
<schema name="g">
  <system>System words here.</system>
  <module name="a">Aa</module>
  <module name="c">Cee cee cee</module>
  <module name="u">You you you you you you</module>
  <user>
</schema>"""


def test_an_entry_is_served_beside_a_unit_computed_again_whose_layout_numbers_it_holds(
        model, tmp_path):
    """a left out: c and u move down by a's length. u served from its exact entry sits at
    numbers c's stored copy holds in the layout; c, whose entry is gone, is computed again.
    Each keeps its own tokens: the request equals the plain prefill."""
    llm = make(model, tmp_path, schema=GAPS)
    prompt = '<prompt schema="g"><c/><u/>Why?</user></prompt>'
    bound = llm.bind(prompt)
    numbers = contiguous.renumbering(bound)
    c_layout = {p for _, p, origin in bound.sequence() if origin == "module:c"}
    u_numbers = {numbers.map(p) for _, p, origin in bound.sequence() if origin == "module:u"}
    assert c_layout & u_numbers                     # the collision the assembler must avoid
    first = llm.prefill(prompt)
    assert first.exact_units == 0 and first.renumbered
    keys = {u: llm.encoder.key(bound.layout, u) for u in bound.units}
    c_entry = exact.exact_key(keys["module:c"], numbers.segments(bound.segments()), "module:c")
    assert llm.store.evict(c_entry)
    again = llm.prefill(prompt)
    assert "module:u" in again.exact and "module:c" not in again.exact
    assert c_layout <= again.recompute.positions
    assert (again.logits[-1] - plain_logits(model, bound.token_ids())).abs().max() < TOL


def test_entries_of_contiguous_and_layout_positions_never_meet(model, tmp_path):
    """An entry made at contiguous positions is not served to a request at layout positions
    with the same tokens before the unit, and the other way round: a unit's key names the
    positions of its own tokens."""
    def seg(ids, start, kind="text"):
        return Segment(tuple(ids), start, kind)

    before = (seg([1, 2], 0), "uncached")
    at_two = [before, (seg([5, 6], 2), "module:u")]
    at_four = [before, (seg([5, 6], 4), "module:u")]      # the same tokens before it
    assert exact.exact_key("k", at_two, "module:u") != exact.exact_key("k", at_four, "module:u")


def test_a_renumbering_ranks_the_positions_after_the_first_gap():
    layout = [(Segment((1, 2, 3), 0, "text"), "module:()"),
              (Segment((4, 5), 7, "text"), "module:b"),
              (Segment((6,), 12, "text"), "uncached")]

    class Bound:                                 # the two BoundPrompt methods it reads
        def segments(self):
            return layout

        def sequence(self):
            return [(t, seg.start + i, origin) for seg, origin in layout
                    for i, t in enumerate(seg.token_ids)]

    numbers = contiguous.renumbering(Bound())
    assert (numbers.opening, numbers.end) == (3, 6)
    assert numbers.positions([0, 2, 7, 8, 12]) == [0, 2, 3, 4, 5]
    assert [seg.start for seg, _ in numbers.segments(layout)] == [0, 3, 5]
    assert contiguous.moved(Bound(), numbers) == {"module:b": [7, 8]}
    assert contiguous.merged({"module:b": [8, 9]}, {"module:b": [7, 8], "x": [1]}) == {
        "module:b": [7, 8, 9], "x": [1]}

    layout[1:] = [(Segment((4, 5), 3, "text"), "module:b")]      # no gap
    assert contiguous.renumbering(Bound()) is None
