"""Primed modules ("P+primed", docs/RECOMPUTE.md; runtime/recompute/primer.py): a module that
follows another module or per-request text is served as encoded after its lead -- its
context's last token before it, repeated at the position just before it, seen by the
module's encoding only.

The contract is the docs/DESIGN.md oracle with the lead as one more occurrence
(tests/runtime/oracle.py, `primed=True`), for every policy it combines with, on every
position scheme, units copied and read in place; a module that comes first is served its
plain (exact) encoding; the two encodings are two store entries.
"""

from __future__ import annotations

import pytest
import torch

from promptlang.errors import PromptLangError
from promptlang.runtime.recompute import Recompute

from .oracle import oracle_prefill
from .test_oracle import ARCHITECTURES, PROMPTS, TOL, make_llm, tiny_model
from .test_recompute import CASES


@pytest.fixture(scope="module")
def models():
    return {kind: tiny_model(kind) for kind in ARCHITECTURES}


def assert_primed_matches_oracle(llm, prompt: str, isolate: bool = False, **options):
    cached = llm.prefill(prompt, all_logits=True, **options)
    expected = oracle_prefill(llm.adapter, cached.bound, isolate=isolate,
                              recomputed=cached.recompute.positions, primed=True)
    order = torch.argsort(cached.positions)
    assert torch.equal(cached.positions[order], expected.positions)
    assert len(cached.primed) == expected.leads
    assert cached.logits.shape == expected.logits.shape
    assert (cached.logits - expected.logits).abs().max() < TOL
    assert (cached.keys[:, :, order] - expected.keys).abs().max() < TOL
    assert (cached.values[:, :, order] - expected.values).abs().max() < TOL
    return cached, expected


@pytest.mark.parametrize("text, parsed", [
    ("primed", Recompute(primed=True)), ("none+primed", Recompute(primed=True)),
    ("first:4+primed", Recompute("first", 4, primed=True)),
    (" Query:8 + Primed", Recompute("query", 8, primed=True)),
    ("query:8+ape+primed", Recompute("query", 8, 0.9, 0.9, primed=True)),
    ("ape:0.8+primed", Recompute("ape", 1, 0.8, 0.9, primed=True)),
    ("deviation:10%+primed", Recompute("deviation", 0.1, primed=True)),
])
def test_primed_parses_and_prints_back(text, parsed):
    assert Recompute.parse(text) == parsed
    assert Recompute.parse(str(parsed)) == parsed
    assert not Recompute.parse("primed")              # it recomputes nothing


@pytest.mark.parametrize("bad, reason", [
    ("seams+primed", "would change nothing"), ("exact+primed", "would change nothing"),
    ("primed+primed", "given twice"), ("query:4+primed+ape", "expected none"),
    ("first:x+primed", "whole number"), ("primed+first:2", "expected none"),
])
def test_bad_primed_policies_say_what_is_wrong(bad, reason):
    with pytest.raises(PromptLangError, match=reason) as error:
        Recompute.parse(bad)
    assert repr(bad) in str(error.value)              # the whole text the user wrote


@pytest.mark.parametrize("policy", ["primed", "first:2+primed", "deviation:0.3+primed"])
@pytest.mark.parametrize("isolate", [False, True], ids=["guaranteed", "isolate"])
@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_primed_prefill_equals_one_masked_pass(models, tmp_path, kind, isolate, policy):
    llm = make_llm(models[kind], tmp_path, isolate=isolate)
    llm.exact_reuse = False
    applied = 0
    for case in CASES:
        _, expected = assert_primed_matches_oracle(llm, PROMPTS[case], isolate,
                                                   recompute=policy)
        applied += expected.leads
        assert_primed_matches_oracle(llm, PROMPTS[case], isolate, recompute=policy)  # stored
    # the isolate rule encodes a module without context: there is no lead to give it
    assert applied == 0 if isolate else applied >= 4, applied


@pytest.mark.parametrize("shared", [False, True], ids=["copied", "read in place"])
@pytest.mark.parametrize("policy", ["primed", "query:2+primed"])
def test_primed_on_the_fused_layers(models, tmp_path, kernels, shared, policy):
    llm = make_llm(models["llama"], tmp_path)
    llm.exact_reuse = False
    if shared:
        llm.assembler.share_min_tokens = 1
    for case in CASES:
        assert_primed_matches_oracle(llm, PROMPTS[case], recompute=policy)


def test_primed_with_ape_equals_the_reference_pass(models, tmp_path):
    from .oracle import Parallel

    llm = make_llm(models["llama"], tmp_path)
    llm.exact_reuse = False
    applied = 0
    for case in CASES:
        cached = llm.prefill(PROMPTS[case], all_logits=True, recompute="ape:0.7:1.1+primed")
        parallel = Parallel(cached.parallel, 0.7, 1.1) if cached.parallel else None
        expected = oracle_prefill(llm.adapter, cached.bound, primed=True, parallel=parallel,
                                  recomputed=cached.recompute.positions)
        order = torch.argsort(cached.positions)
        assert (cached.logits - expected.logits).abs().max() < TOL, case
        assert (cached.keys[:, :, order] - expected.keys).abs().max() < TOL
        applied += bool(parallel) and expected.leads > 0
    assert applied >= 3


def test_the_lead_changes_the_answer_and_only_where_a_module_follows_another(models, tmp_path):
    llm = make_llm(models["llama"], tmp_path)
    llm.exact_reuse = False
    prompt = PROMPTS["two modules with a gap"]
    plain = llm.prefill(prompt, recompute="none")
    primed, expected = assert_primed_matches_oracle(llm, prompt, recompute="primed")
    assert expected.leads == 1                    # <last> follows <a>; <a> follows the text
    assert (plain.logits[-1] - primed.logits[-1]).abs().max() > 1e-3
    # the first module's entry is shared; the second has a primed entry beside its plain one
    layout = primed.bound.layout
    units = [u for u in primed.bound.units if layout.units[u].context]
    plain_keys = {u: llm.encoder.key(layout, u) for u in units}
    primed_keys = {u: llm.encoder.key(layout, u, frozenset(units)) for u in units}
    changed = [u for u in units if plain_keys[u] != primed_keys[u]]
    assert len(changed) == 1 and all(llm.store.contains(k) for k in primed_keys.values())
    lead = llm.encoder.lead(layout, changed[0])
    assert lead is not None and lead[1] == min(
        seg.start for seg in layout.units[changed[0]].segments) - 1
    # serving it primed left the plain entries alone: none still equals its oracle
    again = llm.prefill(prompt, all_logits=True, recompute="none")
    expected_plain = oracle_prefill(llm.adapter, again.bound)
    assert (again.logits - expected_plain.logits).abs().max() < TOL


def test_a_module_alone_is_served_its_plain_exact_encoding(models, tmp_path):
    llm = make_llm(models["llama"], tmp_path)
    llm.exact_reuse = False
    prompt = PROMPTS["scaffold member alone"]           # one module after the schema's text
    _, expected = assert_primed_matches_oracle(llm, prompt, recompute="primed")
    assert expected.leads == 0
    plain = llm.prefill(prompt, recompute="none")
    cached = llm.prefill(prompt, recompute="primed")
    assert torch.equal(cached.logits[-1], plain.logits[-1])


def test_primed_decodes_and_opens_sessions(models, tmp_path):
    llm = make_llm(models["llama"], tmp_path)
    llm.exact_reuse = False
    prompt = PROMPTS["two modules with a gap"]
    first = llm.generate(prompt, max_new_tokens=4, temperature=0, recompute="query:1+primed")
    again = llm.generate(prompt, max_new_tokens=4, temperature=0, recompute="query:1+primed")
    assert first.text == again.text and first.recomputed_tokens == 1
    assert first.primed_units == 1 and first.approximate_tokens > 0
    expected = llm.prefill(prompt, recompute="primed")
    with llm.session(prompt, recompute="primed", add_generation_prompt=True) as session:
        assert (session.logits - expected.logits[-1]).abs().max() < TOL
    assert llm.assembler.in_use_bytes == 0


def test_exact_reuse_still_wins_over_a_primed_module(models, tmp_path):
    """A combination made exact before is served exactly, primed policy or not: it is what
    the full prefill computes, which no primer improves on."""
    llm = make_llm(models["llama"], tmp_path)
    prompt = PROMPTS["two modules with a gap"]
    full = llm.prefill(prompt, recompute="exact")        # the full prefill, and remembered
    cached = llm.prefill(prompt, recompute="primed")
    assert cached.exact and (cached.logits[-1] - full.logits[-1]).abs().max() < TOL


@pytest.mark.parametrize("kind", ["llama", "bloom"])
def test_modules_inside_a_primed_module_see_its_primed_kv(models, tmp_path, kind):
    """<parent> follows <a>: primed. Its child and grandchild follow parent's own text (no
    lead of their own) but were encoded against the parent's KV, so they are encoded
    against the primed one -- what the oracle's one pass gives them."""
    llm = make_llm(models[kind], tmp_path)
    llm.exact_reuse = False
    prompt = ('<prompt schema="s"><a/><parent><child who="Bob"><grandchild/></child>'
              '</parent>Who?</user></prompt>')
    cached, expected = assert_primed_matches_oracle(llm, prompt, recompute="primed")
    assert expected.leads == 1
    layout = cached.bound.layout
    nested = [u for u in cached.bound.units if u.startswith("module:parent/")]
    assert len(nested) == 2
    primed = frozenset({"module:parent"})
    for unit in nested:
        assert llm.encoder.lead(layout, unit) is None
        assert llm.encoder.key(layout, unit, primed) != llm.encoder.key(layout, unit)
