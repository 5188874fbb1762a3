"""Selective recompute (docs/RECOMPUTE.md) keeps the cache honest.

Recomputed tokens are uncached tokens: with them, a cached prefill must still equal the
docs/DESIGN.md oracle (one masked forward pass in which they attend to every request token
at a position <= theirs and their stored copies leave the request), for every position
scheme, both encoding rules, units copied or read in place, and tokens taken from the
start, the middle or the end of a unit.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from promptlang.errors import PromptLangError, Span
from promptlang.pml.binding import bind
from promptlang.pml.layout import lay_out
from promptlang.pml.parser import parse_prompt, parse_schema
from promptlang.runtime import engine as engine_module
from promptlang.runtime import recompute
from promptlang.runtime.engine import LLM
from promptlang.errors import RecomputeSpecError
from promptlang.runtime.recompute import contiguous
from promptlang.runtime.recompute import (Recompute, RecomputePlan,
                                          first_tokens, schema_policy)
from promptlang.runtime.store import ModuleStore
from promptlang.tokenizer import WordTokenizer

from .oracle import oracle_prefill
from .test_oracle import ARCHITECTURES, PROMPTS, SCHEMA, TOL, VOCAB, make_llm, tiny_model


@pytest.fixture(scope="module")
def models():
    return {kind: tiny_model(kind) for kind in ARCHITECTURES}


def assert_matches_oracle(llm: LLM, prompt: str, isolate: bool, **options):
    cached = llm.prefill(prompt, all_logits=True, **options)
    # units served from exact entries (an earlier `exact` request's) saw every token before
    # them, as recomputed tokens do
    exact = {p for _, p, origin in cached.bound.sequence() if origin in cached.exact}
    # a request renumbered (recompute/contiguous.py) computes every token after its first
    # gap at its rank among the request's tokens
    numbers = contiguous.renumbering(cached.bound) if cached.renumbered else None
    expected = oracle_prefill(llm.adapter, cached.bound, isolate=isolate,
                              recomputed=cached.recompute.positions | exact,
                              renumber=None if numbers is None else numbers.map)
    order = torch.argsort(cached.positions)
    assert torch.equal(cached.positions[order], expected.positions)
    computed = expected.positions[~expected.cached]              # the oracle's logits rows
    rows = torch.tensor([int(p) not in exact for p in computed], dtype=torch.bool)
    assert cached.logits.shape == expected.logits[rows].shape
    assert (cached.logits - expected.logits[rows]).abs().max() < TOL
    assert (cached.keys[:, :, order] - expected.keys).abs().max() < TOL
    assert (cached.values[:, :, order] - expected.values).abs().max() < TOL
    return cached


# --- policies as text -----------------------------------------------------------------------

@pytest.mark.parametrize("text, parsed", [
    ("none", Recompute()), ("first:8", Recompute("first", 8)), ("first:0", Recompute()),
    ("deviation:0.15", Recompute("deviation", 0.15)), ("deviation:15%", Recompute("deviation", 0.15)),
    (" Deviation:1 ", Recompute("deviation", 1.0)), ("exact", Recompute("exact", 1)),
    (" Exact", Recompute("exact", 1)), ("seams", Recompute("seams", 1)),
    ("SEAMS ", Recompute("seams", 1)),
])
def test_policies_parse_and_print_back(text, parsed):
    assert Recompute.parse(text) == parsed
    assert Recompute.parse(str(parsed)) == parsed


@pytest.mark.parametrize("text", ["first", "first:-1", "first:2.5", "deviation:2", "deviation:x",
                                  "blend:0.1", "deviation:nan", "exact:1", "exact:",
                                  "seams:1", "seam"])
def test_malformed_policies_are_rejected_with_what_is_expected(text):
    with pytest.raises(RecomputeSpecError, match="recompute policy"):
        Recompute.parse(text)


def test_a_bad_policy_is_a_promptlang_error_located_where_the_schema_gives_one():
    at = Span("app.pml", 1, 29, '<schema name="s" recompute="first:two">')
    schema = SimpleNamespace(recompute="first:two", recompute_span=at)
    with pytest.raises(RecomputeSpecError) as caught:
        schema_policy(schema)
    assert isinstance(caught.value, PromptLangError) and caught.value.span == at
    assert str(caught.value).startswith("app.pml:1:29: bad recompute policy 'first:two'")
    assert schema_policy(SimpleNamespace(recompute=None)) is None
    assert schema_policy(SimpleNamespace(recompute=" First:3 ")) == Recompute("first", 3)


def test_a_schema_attribute_with_a_bad_policy_is_refused_at_the_attribute(models, tmp_path):
    """Wherever the check runs (parser or runtime), the error points at the attribute."""
    llm = make_llm(models["llama"], tmp_path)
    with pytest.raises(PromptLangError) as caught:
        llm.add_schema(parse_schema('<schema name="t" recompute="first:two"><module name="m">'
                                    'one two</module></schema>', file="app.pml"))
        llm.generate('<prompt schema="t"><m/>three</prompt>', max_new_tokens=1)
    assert str(caught.value).startswith("app.pml:1:29: bad recompute policy 'first:two'")


# --- the oracle -----------------------------------------------------------------------------

CASES = ["two modules with a gap", "nested modules", "union", "shorter argument", "scaffold",
         "cache false", "no uncached tokens"]


@pytest.mark.parametrize("policy", ["first:2", "deviation:0.3", "deviation:1", "exact", "seams"])
@pytest.mark.parametrize("isolate", [False, True], ids=["guaranteed", "isolate"])
@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_recomputed_prefill_equals_one_masked_pass(models, tmp_path, kind, isolate, policy):
    llm = make_llm(models[kind], tmp_path, isolate=isolate)
    for case in CASES:
        cached = assert_matches_oracle(llm, PROMPTS[case], isolate, recompute=policy)
        if policy == "exact":                   # at contiguous positions wherever gaps are
            gaps = contiguous.renumbering(cached.bound) is not None
            assert cached.renumbered == gaps
        # nothing left to recompute only where earlier requests made every unit exact, or
        # (seams) where the only thing missed is an argument
        arguments_only = policy == "seams" and case == "shorter argument" and not isolate
        assert cached.recompute.positions or cached.exact or arguments_only, \
            f"{case}: {policy} did nothing"


@pytest.mark.parametrize("shared", [False, True], ids=["copied", "read in place"])
@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_any_recomputed_positions_match_the_oracle(models, tmp_path, monkeypatch, kind, shared):
    """Tokens from the start, middle and end of units -- holes that split a unit read in
    place into several runs -- and the request's last token."""
    llm = make_llm(models[kind], tmp_path)
    if shared:
        llm.assembler.share_min_tokens = 1
    def every_third(adapter, bound, units, policy, context_of):
        cached = [p for _, p, origin in bound.sequence() if origin != "uncached"]
        return cached[1::3] + [cached[-1]]
    monkeypatch.setattr(engine_module, "choose_positions", every_third)
    for case in CASES:
        assert_matches_oracle(llm, PROMPTS[case], False, recompute="first:1")
        assert_matches_oracle(llm, PROMPTS[case], False, recompute="first:1")   # buffer reused
    if shared and llm.adapter.reads_shared:
        assert llm.assembler.shared_tokens > 0


def test_recomputing_every_token_that_missed_something_gives_the_full_prefill(models, tmp_path):
    """deviation:1 recomputes every candidate; the rest saw exactly what a full prefill
    sees, so the request equals one causal pass over its tokens at their positions."""
    llm = make_llm(models["llama"], tmp_path)
    llm.exact_reuse = False      # each request as its policy says (no unit made exact before)
    prompt = PROMPTS["two modules with a gap"]
    sequence = llm.bind(prompt).sequence()
    full = llm.adapter.forward(torch.tensor([t for t, _, _ in sequence]),
                               torch.tensor([p for _, p, _ in sequence]), None, None,
                               torch.tensor([len(sequence) - 1]))
    cached = llm.prefill(prompt, recompute="deviation:1")
    assert cached.recompute.positions
    assert (cached.logits[-1] - full.logits[-1]).abs().max() < TOL
    none = llm.prefill(prompt, recompute="none")
    assert (none.logits[-1] - full.logits[-1]).abs().max() > 1e-3   # the test can fail
    # exact: the same candidates without the pass, and -- the request has a gap (b left
    # out) -- every token after it again at contiguous positions: the plain prompt's prefill
    exact = llm.prefill(prompt, recompute="exact")
    assert exact.recompute.positions >= cached.recompute.positions and exact.renumbered
    assert exact.timings.select < cached.timings.select
    plain = llm.prefill(prompt, baseline=True)
    assert (exact.logits[-1] - plain.logits[-1]).abs().max() < TOL
    assert (plain.logits[-1] - full.logits[-1]).abs().max() > 1e-3  # the positions matter


# --- selection ------------------------------------------------------------------------------

def test_seams_recomputes_what_missed_a_module_but_not_what_missed_only_an_argument(models,
                                                                                    tmp_path):
    """seams: every candidate except those whose only miss is an argument (the tokens of a
    module after its own parameter keep the KV computed against the placeholders)."""
    llm = make_llm(models["llama"], tmp_path)
    llm.exact_reuse = False         # every request chooses afresh (none is served exactly)
    for case in CASES:
        bound = llm.bind(PROMPTS[case])
        context = lambda u: llm.encoder.context_of(bound.layout.units[u])   # noqa: E731
        every = recompute.candidates(bound, context)
        seams = recompute.candidates(bound, context, arguments=False)
        result = llm.prefill(PROMPTS[case], recompute="seams")
        assert sorted(result.recompute.positions) == sorted(p for ps in seams.values()
                                                            for p in ps)
        assert result.recompute.positions <= {p for ps in every.values() for p in ps}
        assert result.approximate_tokens == sum(len(ps) for ps in every.values()) \
            - len(result.recompute)
    # <plan days="two"><tokyo/></plan>: plan's " days." and tokyo inside it missed the
    # argument alone: seams serves them as stored (exact recomputes them); plan's text after
    # the union missed tokyo, and the schema's tail missed both: seams recomputes those
    shorter = PROMPTS["shorter argument"]
    seams, every = (llm.prefill(shorter, recompute=p) for p in ("seams", "exact"))
    assert 0 < len(seams.recompute) < len(every.recompute)
    assert seams.recompute.positions < every.recompute.positions
    assert seams.approximate_tokens > 0 == every.approximate_tokens
    # <a/><live/><last/>: the cache="false" module is text computed per request, a seam
    live = llm.prefill(PROMPTS["cache false"], recompute="seams")
    assert live.approximate_tokens == 0 and len(live.recompute) > 0


@pytest.mark.parametrize("case", ["two modules with a gap", "shorter argument"])
def test_the_default_policy_is_exact_and_makes_every_request_one_causal_pass(models, tmp_path,
                                                                            case):
    """No policy anywhere: exact. A request whose modules were encoded apart -- and one
    whose module holds an argument its encoding did not see (seams would serve the tokens
    after it as stored) -- then equals one causal pass over its tokens at contiguous
    positions: the plain prompt's own prefill (both have gaps: a module left out, an
    argument shorter than its bound)."""
    llm = LLM.from_model(models["llama"], WordTokenizer(VOCAB, bos=True),
                         store=ModuleStore(disk_dir=tmp_path / "kv"), exact_reuse=False)
    llm.add_schema(SCHEMA)
    assert llm.recompute == Recompute("exact", 1) == Recompute.parse(recompute.DEFAULT_POLICY)
    prompt = PROMPTS[case]
    sequence = llm.bind(prompt).sequence()
    full = llm.adapter.forward(torch.tensor([t for t, _, _ in sequence]),
                               torch.arange(len(sequence)), None, None,
                               torch.tensor([len(sequence) - 1]))
    default = llm.prefill(prompt)
    assert len(default.recompute) > 0 and default.approximate_tokens == 0
    assert (default.logits[-1] - full.logits[-1]).abs().max() < TOL
    for other in ("none", "seams"):
        served = llm.prefill(prompt, recompute=other)
        if other == "seams" and case != "shorter argument":
            continue                                   # seams is exact at module seams
        assert served.approximate_tokens > 0
        assert (served.logits[-1] - full.logits[-1]).abs().max() > 1e-3   # the test can fail

@pytest.mark.parametrize("isolate", [False, True], ids=["guaranteed", "isolate"])
def test_first_k_takes_the_first_k_tokens_of_every_unit_that_missed_something(models, tmp_path,
                                                                              isolate):
    """LegoLink: the first module after the schema's text saw everything a full prefill
    shows it, so first:K skips it (under isolate it missed the system text: not skipped)."""
    llm = make_llm(models["llama"], tmp_path, isolate=isolate)
    for case in ("two modules with a gap", "nested modules", "union"):
        bound = llm.bind(PROMPTS[case])
        context = lambda u: llm.encoder.context_of(bound.layout.units[u])   # noqa: E731
        found = recompute.candidates(bound, context)
        result = llm.prefill(PROMPTS[case], recompute="first:2")
        assert sorted(result.recompute.positions) == first_tokens(bound, 2, context)
        assert sorted(result.recompute.positions) == sorted(
            p for positions in found.values() for p in positions[:2])
        assert len(result.recompute) == sum(min(2, len(ps)) for ps in found.values()) > 0
        # what is left of the candidates is served as encoded apart, and said so
        assert result.approximate_tokens == sum(len(ps) for ps in found.values()) \
            - len(result.recompute)
        assert llm.prefill(PROMPTS[case], recompute="exact").approximate_tokens == 0
        if case == "two modules with a gap":        # <a/><last/>: a is exact unless isolated
            assert ("module:a" in found) == isolate
            assert ("module:last" in found) and len(found["module:last"]) > 2


def test_a_plan_moves_the_chosen_cached_tokens_to_the_uncached_ones():
    tok = WordTokenizer(VOCAB, bos=True)
    layout = lay_out(parse_schema(SCHEMA), tok)
    bound = bind(parse_prompt(PROMPTS["union"]), layout, tok)
    chosen = first_tokens(bound, 2, lambda u: layout.units[u].context)
    plan_at, paris, b = (layout.modules[path].start for path in
                         [("plan",), ("plan", "paris"), ("b",)])
    tail = max(p for _, p, origin in bound.sequence() if origin == "module:")
    # b comes first in the schema: it saw all a full prefill shows it, and is left alone;
    # plan missed b, paris missed b and the argument, the schema's closing text missed all
    assert b < plan_at
    assert chosen == [plan_at, plan_at + 1, paris, paris + 1, tail]
    plan = RecomputePlan.of(bound, chosen)
    assert plan.positions == frozenset(chosen) and len(plan) == 5
    uncached = plan.uncached(bound)
    assert [s.start for s in uncached] == sorted(s.start for s in uncached)
    moved = [(s.start, s.token_ids) for s in uncached if s.kind == "recompute"]
    assert moved == [(p, (t,)) for t, p, _ in bound.sequence() if p in chosen]
    assert [s for s in uncached if s.kind != "recompute"] == list(bound.uncached)
    # served tokens minus the chosen ones, plus what is computed: the request's tokens
    kept = [(t, p) for t, p, origin in bound.sequence()
            if origin != "uncached" and p not in plan.positions]
    computed = [(t, s.start + i) for s in uncached for i, t in enumerate(s.token_ids)]
    assert sorted(kept + computed, key=lambda tp: tp[1]) == \
        [(t, p) for t, p, _ in bound.sequence()]
    assert RecomputePlan.of(bound, []).uncached(bound) is bound.uncached
    with pytest.raises(PromptLangError, match="holds no cached token"):
        RecomputePlan.of(bound, [layout.end])              # prompt text is not cached


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_layer_kv_is_the_full_prefills_kv_at_that_layer(models, kind):
    llm = LLM.from_model(models[kind], WordTokenizer(VOCAB, bos=True))
    ids = torch.randint(3, VOCAB, (9,), generator=torch.Generator().manual_seed(3))
    positions = torch.tensor([0, 1, 2, 5, 6, 7, 8, 20, 21])
    full = llm.adapter.forward(ids, positions, None, None, None)
    keys, values = recompute.layer_kv(llm.adapter, ids.tolist(), positions, 1)
    assert (keys - full.keys[1]).abs().max() < TOL
    assert (values - full.values[1]).abs().max() < TOL


@pytest.mark.parametrize("isolate", [False, True], ids=["guaranteed", "isolate"])
def test_deviation_candidates_are_the_tokens_whose_kv_differs(models, tmp_path, isolate):
    """Every cached token outside the candidates has the full prefill's KV already; the
    chosen ones are those that deviate most."""
    llm = make_llm(models["llama"], tmp_path, isolate=isolate)
    bound = llm.bind(PROMPTS["nested modules"])
    units = {u: llm.encoder.get(bound.layout, u) for u in bound.units}
    context = lambda u: llm.encoder.context_of(bound.layout.units[u])   # noqa: E731
    candidates = {p for ps in recompute.candidates(bound, context).values() for p in ps}
    scores = recompute.deviations(llm.adapter, bound, units, context)
    assert set(scores) == candidates and candidates
    sequence = bound.sequence()
    positions = torch.tensor([p for _, p, _ in sequence])
    full = llm.adapter.forward(torch.tensor([t for t, _, _ in sequence]), positions, None, None)
    for unit, kv in units.items():
        for i, p in enumerate(kv.positions.tolist()):
            if kv.placeholder[i]:
                continue
            at = int(torch.searchsorted(positions, p))
            differs = float((full.keys[1][:, at] - kv.keys[1][:, i]).abs().max())
            if p in candidates:
                continue
            assert differs < TOL, f"position {p} of {unit} is no candidate but deviates"
    assert max(scores.values()) > 1e-6
    chosen = recompute.choose_positions(llm.adapter, bound, units, Recompute("deviation", 0.25),
                                        context)
    assert len(chosen) == -(-len(scores) // 4)
    assert min(scores[p] for p in chosen) >= max(scores[p] for p in scores if p not in chosen)


# --- where the policy comes from ------------------------------------------------------------

def test_request_policy_overrides_schema_default_which_overrides_the_llms(models, tmp_path):
    store = ModuleStore(disk_dir=tmp_path / "kv")
    llm = LLM.from_model(models["llama"], WordTokenizer(VOCAB, bos=True), store=store,
                         recompute="first:1", exact_reuse=False)   # each request chooses
    llm.add_schema(SCHEMA)
    prompt = PROMPTS["two modules with a gap"]     # <a/><last/>: last and the tail missed a
    missed = [len(found) for found in recompute.candidates(
        llm.bind(prompt), lambda u: llm.bind(prompt).layout.units[u].context).values()]
    first = lambda k: sum(min(k, n) for n in missed)          # noqa: E731  first:k's count
    assert len(missed) == 2 and first(1) == 2 and first(3) > first(2)
    assert llm.generate(prompt, max_new_tokens=1).recomputed_tokens == first(1)   # the LLM's
    assert llm.generate(prompt, max_new_tokens=1, recompute="none").recomputed_tokens == 0
    llm.add_schema(SCHEMA.replace('<schema name="s">', '<schema name="s" recompute="first:3">'))
    assert llm.generate(prompt, max_new_tokens=1).recomputed_tokens == first(3)   # the schema's
    assert llm.generate(prompt, max_new_tokens=1,
                        recompute="first:2").recomputed_tokens == first(2)
    assert llm.generate(prompt, max_new_tokens=1, baseline=True).recomputed_tokens == 0


def test_a_schema_that_says_none_overrides_the_llms_policy(models, tmp_path):
    llm = LLM.from_model(models["llama"], WordTokenizer(VOCAB, bos=True),
                         store=ModuleStore(disk_dir=tmp_path / "kv"), recompute="first:1")
    llm.add_schema(SCHEMA.replace('<schema name="s">', '<schema name="s" recompute="none">'))
    prompt = PROMPTS["two modules with a gap"]
    assert llm.generate(prompt, max_new_tokens=1).recomputed_tokens == 0
    assert llm.generate(prompt, max_new_tokens=1, recompute="first:1").recomputed_tokens == 2


def test_a_bad_policy_in_a_request_is_a_promptlang_error(models, tmp_path):
    llm = make_llm(models["llama"], tmp_path)
    with pytest.raises(PromptLangError, match="bad recompute policy 'first:x'"):
        llm.generate(PROMPTS["union"], recompute="first:x")


def test_recompute_keeps_decoding_equal_between_generate_and_prefill(models, tmp_path):
    """generate() serves the same first token as prefill() under a policy."""
    llm = make_llm(models["llama"], tmp_path)
    prompt = PROMPTS["union"]
    result = llm.generate(prompt, max_new_tokens=1, recompute="deviation:0.5")
    logits = llm.prefill(prompt, recompute="deviation:0.5").logits[-1]
    assert result.token_ids[0] == int(torch.argmax(logits))
    assert result.recomputed_tokens > 0 and result.timings.select > 0


def test_a_session_opens_with_the_policy_applied(models, tmp_path):
    llm = make_llm(models["llama"], tmp_path)
    prompt = PROMPTS["two modules with a gap"]
    expected = llm.prefill(prompt, recompute="first:2").logits[-1]
    with llm.session(prompt, recompute="first:2", add_generation_prompt=True) as session:
        assert (session.logits - expected).abs().max() < TOL
        plain = llm.prefill(prompt, recompute="none").logits[-1]
        assert (session.logits - plain).abs().max() > 1e-3
