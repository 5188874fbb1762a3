"""The recompute policy query:K (docs/RECOMPUTE.md): the K candidates the request's last
token attends to most, recomputed.

Two contracts, each against the unmodified reference model:
- the choice: in one masked pass of the request as served by `none` (the docs/DESIGN.md
  oracle's pass, with an attention that records its weights), the chosen positions are the
  K candidates whose stored tokens get the most attention from the request's last token,
  summed over layers and heads;
- the answer: with those positions recomputed, the prefill equals the oracle's pass in
  which they are uncached tokens (as for every policy, test_recompute.py).
"""

from __future__ import annotations

import pytest
import torch
import transformers

from promptlang.errors import PromptLangError
from promptlang.runtime.recompute import Recompute, candidates

from .oracle import masked_scores, oracle_prefill
from .test_oracle import PROMPTS, make_llm, tiny_model
from .test_recompute import CASES, assert_matches_oracle

RECORDING = "oracle_recording"
WEIGHTS: dict[int, torch.Tensor] = {}        # layer -> [heads, n, n] of the last recorded pass


def _recording_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                         **kwargs):
    """Eager attention over the mask (float64), keeping each layer's weights."""
    scores, value = masked_scores(query, key, value, attention_mask, scaling)
    weights = torch.softmax(scores, dim=-1)
    WEIGHTS[module.layer_idx] = weights[0]
    out = (weights @ value).to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


transformers.AttentionInterface.register(RECORDING, _recording_attention)


@pytest.fixture(scope="module")
def models():
    return {kind: tiny_model(kind) for kind in ("llama", "gpt2")}


def reference_choice(llm, prompt: str, k: int) -> list[int]:
    """query:K's positions from the reference model: the request as `none` serves it, one
    masked pass, the last token's attention weights to the candidates' stored tokens."""
    served = llm.prefill(prompt, recompute="none")
    bound = served.bound
    context_of = lambda unit: llm.encoder.context_of(bound.layout.units[unit])  # noqa: E731
    wanted = {p for found in candidates(bound, context_of).values() for p in found}
    WEIGHTS.clear()
    expected = oracle_prefill(llm.adapter, bound, attention=RECORDING)
    position, in_request, computed = expected.occurrences
    rows = torch.nonzero(computed)[:, 0]
    last = int(rows[torch.argmax(position[rows])])
    mass = sum(w[:, last].sum(0) for w in WEIGHTS.values())                   # [n]
    stored = [i for i in range(position.shape[0])
              if in_request[i] and not computed[i] and int(position[i]) in wanted]
    ranked = sorted(stored, key=lambda i: (-float(mass[i]), int(position[i])))
    return sorted(int(position[i]) for i in ranked[:k])


def test_query_parses_and_prints_back():
    assert Recompute.parse("query:8") == Recompute("query", 8)
    assert Recompute.parse(" Query:016") == Recompute("query", 16)
    assert Recompute.parse("query:0") == Recompute()
    assert str(Recompute("query", 32)) == "query:32"
    for bad in ("query", "query:", "query:-1", "query:2.5", "query:x"):
        with pytest.raises(PromptLangError, match="recompute policy"):
            Recompute.parse(bad)


@pytest.mark.parametrize("k", [1, 3])
def test_query_recomputes_what_the_last_token_attends_to_most(models, tmp_path, kernels, k):
    llm = make_llm(models["llama"], tmp_path)
    llm.exact_reuse = False
    chose = 0
    for case in CASES:
        cached = llm.prefill(PROMPTS[case], recompute=f"query:{k}")
        expected = reference_choice(llm, PROMPTS[case], k)
        assert sorted(cached.recompute.positions) == expected, case
        chose += bool(expected)
    assert chose >= 4, "too few cases with candidates to test the choice"


@pytest.mark.parametrize("shared", [False, True], ids=["copied", "read in place"])
@pytest.mark.parametrize("isolate", [False, True], ids=["guaranteed", "isolate"])
def test_query_prefill_equals_one_masked_pass(models, tmp_path, kernels, isolate, shared):
    llm = make_llm(models["llama"], tmp_path, isolate=isolate)
    llm.exact_reuse = False
    if shared:
        llm.assembler.share_min_tokens = 1
    for case in CASES:
        cached = assert_matches_oracle(llm, PROMPTS[case], isolate, recompute="query:3")
        assert len(cached.recompute.positions) <= 3
        assert_matches_oracle(llm, PROMPTS[case], isolate, recompute="query:3")  # buffer reused


def test_query_leaves_the_probe_buffer_to_the_pool_and_decodes(models, tmp_path):
    llm = make_llm(models["llama"], tmp_path)
    llm.exact_reuse = False
    prompt = PROMPTS["two modules with a gap"]
    plain = llm.generate(prompt, max_new_tokens=4, temperature=0, recompute="query:2")
    again = llm.generate(prompt, max_new_tokens=4, temperature=0, recompute="query:2")
    assert plain.text == again.text and plain.recomputed_tokens == 2
    assert llm.assembler.in_use_bytes == 0


def test_query_needs_a_rope_model_and_says_so(models, tmp_path):
    llm = make_llm(models["gpt2"], tmp_path)
    with pytest.raises(PromptLangError, match="needs a RoPE model"):
        llm.prefill(PROMPTS["two modules with a gap"], recompute="query:2")



def test_a_session_opens_with_the_policy_applied(models, tmp_path):
    from .test_oracle import TOL

    llm = make_llm(models["llama"], tmp_path)
    llm.exact_reuse = False
    prompt = PROMPTS["two modules with a gap"]
    expected = llm.prefill(prompt, recompute="query:2")
    assert len(expected.recompute.positions) == 2
    with llm.session(prompt, recompute="query:2", add_generation_prompt=True) as session:
        assert (session.logits - expected.logits[-1]).abs().max() < TOL


@pytest.mark.parametrize("text, parsed", [
    ("query:8+ape", Recompute("query", 8, 0.9, 0.9)),
    ("Query:4+APE:0.8", Recompute("query", 4, 0.8, 0.9)),
    ("query:4+ape:0.7:1.2", Recompute("query", 4, 0.7, 1.2)),
])
def test_query_with_ape_parses_and_prints_back(text, parsed):
    assert Recompute.parse(text) == parsed and parsed.parallel
    assert Recompute.parse(str(parsed)) == parsed
    assert not Recompute.parse("query:4").parallel
    for bad in ("query:4+", "query:4+first:2", "query:x+ape", "query:4+ape:9"):
        with pytest.raises(PromptLangError, match="recompute policy"):
            Recompute.parse(bad)


@pytest.mark.parametrize("shared", [False, True], ids=["copied", "read in place"])
def test_query_with_ape_equals_the_reference_pass(models, tmp_path, kernels, shared):
    """query:K+ape: the K tokens are computed per request (attending, and attended to, as
    usual); every other token of the modules is an APE context of the request's tokens --
    in the prefill and in each decode step."""
    from .oracle import Parallel
    from .test_oracle import TOL
    from .test_parallel_contexts import module_positions

    llm = make_llm(models["llama"], tmp_path)
    llm.exact_reuse = False
    if shared:
        llm.assembler.share_min_tokens = 1
    applied = 0
    for case in CASES:
        cached = llm.prefill(PROMPTS[case], all_logits=True, recompute="query:2+ape:0.6:1.3")
        parallel = None
        if cached.parallel:
            recomputed = cached.recompute.positions
            assert cached.parallel == module_positions(cached.bound) - recomputed
            parallel = Parallel(cached.parallel, 0.6, 1.3)
            applied += bool(recomputed)
        expected = oracle_prefill(llm.adapter, cached.bound,
                                  recomputed=cached.recompute.positions, parallel=parallel)
        order = torch.argsort(cached.positions)
        assert torch.equal(cached.positions[order], expected.positions)
        assert (cached.logits - expected.logits).abs().max() < TOL, case
        assert (cached.keys[:, :, order] - expected.keys).abs().max() < TOL
        assert (cached.values[:, :, order] - expected.values).abs().max() < TOL
    assert applied >= 3, "APE with recomputed tokens applied to too few of the cases"
