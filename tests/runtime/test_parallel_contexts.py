"""APE, the recompute policy "ape" (docs/RECOMPUTE.md): held to the oracle.

Under "ape" the schema's own text after the modules is recomputed, the modules are served
as encoded, and every token the request computes -- its prefill and each decode step --
attends to the modules' tokens as APE's contexts: their scores divided by a temperature,
their softmax mixed with the other keys' by softmax(scale * temperature * L_C, L_O). The
reference (tests/runtime/oracle.py) writes that attention out per row over the unmodified
weights, in one pass over the request's tokens with the docs/DESIGN.md mask.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from promptlang.errors import PromptLangError
from promptlang.pml.layout import Segment
from promptlang.errors import RecomputeSpecError
from promptlang.runtime.recompute import Recompute

from .oracle import Parallel, oracle_prefill
from .test_oracle import PROMPTS, TOL, make_llm, tiny_model
from .test_recompute import CASES

ROOT = "module:"


@pytest.fixture(scope="module")
def models():
    return {kind: tiny_model(kind) for kind in ("llama", "gpt2")}


def module_positions(bound) -> frozenset[int]:
    """The positions of every served module token (all units but the schema's own text),
    placeholders left out: APE's contexts, read from the layout."""
    return frozenset(p for unit in bound.units if unit != ROOT
                     for seg in bound.layout.units[unit].segments if seg.kind != "param"
                     for p in range(seg.start, seg.start + len(seg.token_ids)))


def assert_ape_matches_oracle(llm, prompt, policy: str):
    cached = llm.prefill(prompt, all_logits=True, recompute=policy)
    parsed = Recompute.parse(policy)
    parallel = None
    if cached.parallel:
        assert cached.parallel == module_positions(cached.bound)
        parallel = Parallel(cached.parallel, parsed.temperature, parsed.scale)
    root = {p for seg in cached.bound.layout.units[ROOT].segments
            for p in range(seg.start, seg.start + len(seg.token_ids))}
    assert cached.recompute.positions <= root          # only the schema's own text
    expected = oracle_prefill(llm.adapter, cached.bound, recomputed=cached.recompute.positions,
                              parallel=parallel)
    order = torch.argsort(cached.positions)
    assert torch.equal(cached.positions[order], expected.positions)
    assert (cached.logits - expected.logits).abs().max() < TOL
    assert (cached.keys[:, :, order] - expected.keys).abs().max() < TOL
    assert (cached.values[:, :, order] - expected.values).abs().max() < TOL
    return cached


@pytest.mark.parametrize("text, parsed", [
    ("ape", Recompute("ape", 1, 0.9, 0.9)), ("APE:0.5", Recompute("ape", 1, 0.5, 0.9)),
    ("ape:0.7: 1.5", Recompute("ape", 1, 0.7, 1.5)), ("ape:1:1", Recompute("ape", 1, 1, 1)),
])
def test_ape_parses_and_prints_back(text, parsed):
    assert Recompute.parse(text) == parsed
    assert Recompute.parse(str(parsed)) == parsed


@pytest.mark.parametrize("text", ["ape:", "ape:0", "ape:x", "ape:1:2:3", "ape:5", "ape:nan",
                                  "ape:-1:1"])
def test_malformed_ape_is_rejected(text):
    with pytest.raises(RecomputeSpecError, match="recompute policy"):
        Recompute.parse(text)


@pytest.mark.parametrize("shared", [False, True], ids=["copied", "read in place"])
@pytest.mark.parametrize("policy", ["ape", "ape:0.5:1.7", "ape:1.6:0.4"])
def test_ape_prefill_equals_the_reference_pass(models, tmp_path, policy, shared, kernels):
    llm = make_llm(models["llama"], tmp_path)
    llm.exact_reuse = False
    if shared:
        llm.assembler.share_min_tokens = 1
    applied = 0
    for case in CASES:
        cached = assert_ape_matches_oracle(llm, PROMPTS[case], policy)
        assert_ape_matches_oracle(llm, PROMPTS[case], policy)       # the buffer reused
        applied += bool(cached.parallel)
    assert applied >= 4, "APE applied to too few of the cases to test it"
    if shared:
        assert llm.assembler.shared_tokens > 0


def test_ape_changes_the_answer_and_reduces_to_plain_attention_at_one(models, tmp_path):
    """The test can fail: APE's logits differ from plain attention's; at T = S = 1 they are
    plain attention's (the oracle without contexts, root text recomputed)."""
    llm = make_llm(models["llama"], tmp_path)
    llm.exact_reuse = False
    prompt = PROMPTS["two modules with a gap"]
    plain = llm.prefill(prompt, recompute="ape:1:1")
    assert plain.parallel
    expected = oracle_prefill(llm.adapter, plain.bound, recomputed=plain.recompute.positions)
    assert (plain.logits[-1] - expected.logits[-1]).abs().max() < TOL
    tempered = llm.prefill(prompt, recompute="ape:0.5:1.7")
    assert (tempered.logits[-1] - plain.logits[-1]).abs().max() > 1e-3


def test_a_request_with_nothing_encoded_apart_attends_as_usual(models, tmp_path):
    """One module after the schema's text (prefix-shaped): nothing is approximate, no
    contexts; the schema's closing text recomputed makes it the full prefill."""
    llm = make_llm(models["llama"], tmp_path)
    llm.exact_reuse = False
    prompt = '<prompt schema="s"><a/>Question?</user></prompt>'
    cached = llm.prefill(prompt, recompute="ape:0.5:1.7")
    assert not cached.parallel and cached.approximate_tokens == 0
    sequence = cached.bound.sequence()
    full = llm.adapter.forward(torch.tensor([t for t, _, _ in sequence]),
                               torch.tensor([p for _, p, _ in sequence]), None, None,
                               torch.tensor([len(sequence) - 1]))
    assert (cached.logits[-1] - full.logits[-1]).abs().max() < TOL


def test_decode_steps_attend_to_the_contexts_too(models, tmp_path, kernels):
    """Each generated token is a new token like the prefill's: greedy decoding under ape
    follows the reference pass over the prompt with the tokens generated so far appended
    (uncached tokens after it), step by step."""
    llm = make_llm(models["llama"], tmp_path)
    llm.exact_reuse = False
    policy, prompt = "ape:0.5:1.7", PROMPTS["two modules with a gap"]
    tokens = llm.generate(prompt, max_new_tokens=4, recompute=policy, temperature=0).token_ids
    cached = llm.prefill(prompt, recompute=policy)
    bound, parallel = cached.bound, Parallel(cached.parallel, 0.5, 1.7)
    assert parallel.positions
    for token in tokens:
        expected = oracle_prefill(llm.adapter, bound, recomputed=cached.recompute.positions,
                                  parallel=parallel)
        assert int(expected.logits[-1].argmax()) == token
        bound = dataclasses.replace(bound, end=bound.end + 1, uncached=bound.uncached + (
            Segment((token,), bound.end, "text"),))
    plain = llm.generate(prompt, max_new_tokens=4, recompute="none", temperature=0).token_ids
    assert plain != tokens, "ape and plain attention decode alike: the test cannot fail"


def test_ape_needs_a_rope_model_and_says_so(models, tmp_path):
    llm = make_llm(models["gpt2"], tmp_path)
    with pytest.raises(PromptLangError, match="needs a RoPE model"):
        llm.prefill(PROMPTS["two modules with a gap"], recompute="ape")


def test_the_fused_layers_serve_ape_prefill_and_decode(models, tmp_path, monkeypatch):
    """Where the CPU kernels run, APE's passes take the fused layers (pl_decoder with the
    pieces cut at the contexts' edges), prefill and decode steps alike."""
    from promptlang.runtime.fast import fused, native

    if not native.available():
        pytest.skip("CPU kernels unavailable here")
    seen = []
    forward = fused.FusedDecoder.forward

    def recording(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        seen.append((kwargs.get("contexts"), out is not None))
        return out
    monkeypatch.setattr(fused.FusedDecoder, "forward", recording)
    llm = make_llm(models["llama"], tmp_path)
    llm.exact_reuse = False
    llm.generate(PROMPTS["two modules with a gap"], max_new_tokens=3, recompute="ape",
                 temperature=0)
    served = [flags for (flags, _, _), ran in ((c, r) for c, r in seen if c is not None) if ran]
    assert len(served) >= 3                        # the prefill and the decode steps
    assert all(any(flags) and not all(flags) for flags in served)
