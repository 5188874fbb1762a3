"""The cache must stay honest: a cached prefill equals ONE masked forward pass (docs/DESIGN.md).

For tiny randomly initialised float32 models of every supported position scheme
(RoPE with GQA, learned absolute positions, ALiBi), the runtime's cached prefill --
units encoded separately at their layout positions, assembled, then the uncached
tokens computed in one pass -- must give the logits (uncached rows) and KV (every
request token) of tests/runtime/oracle.py within 1e-4: one forward pass of a fresh,
unmodified transformers model over the same token occurrences, positions and visibility.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from promptlang.errors import ModelError
from promptlang.runtime.engine import LLM
from promptlang.runtime.model import SCHEMES, Past, adapt, causal_allowed
from promptlang.runtime.store import ModuleStore
from promptlang.tokenizer import WordTokenizer

from .oracle import oracle_prefill, reference_model
from .tiny import tiny_model

TOL = 1e-4
VOCAB = 1000

SCHEMA = """\
<schema name="s">
  <system>You are a careful assistant.</system>
  <module name="a">Alpha text one two three.</module>
  <module name="b">Bravo text four five.</module>
  <module name="parent">Parent before the child
    <module name="child">child text <param name="who" len="4"/> after param
      <module name="grandchild">deep inside here</module>
    </module>
    parent after the child.
  </module>
  <module name="plan">Plan for <param name="days" len="5"/> days.
    <union>
      <module name="tokyo">about Tokyo</module>
      <module name="paris">all about lovely old Paris</module>
    </union>
    Then decide.
  </module>
  <module name="live" cache="false">Live numbers follow here.</module>
  <scaffold name="docs">
    <module name="doc-a">Document A one two</module>
    <module name="doc-b">Document B three four five</module>
  </scaffold>
  <module name="last">The last module.</module>
  <user>
</schema>
"""

PROMPTS = {
    "two modules with a gap": '<prompt schema="s"><a/><last/>Question?</user></prompt>',
    "nested modules": ('<prompt schema="s"><parent><child who="Bob"><grandchild/></child>'
                       '</parent>Who?</user></prompt>'),
    "union": '<prompt schema="s"><plan days="three"><paris/></plan><b/>Go?</user></prompt>',
    "shorter argument": ('<prompt schema="s"><plan days="two"><tokyo/></plan>'
                         'When?</user></prompt>'),
    "scaffold": '<prompt schema="s"><scaffold name="docs"/><a/>Compare them.</user></prompt>',
    "scaffold member alone": '<prompt schema="s"><doc-b/>Summarise.</user></prompt>',
    "cache false": '<prompt schema="s"><a/><live/><last/>Numbers?</user></prompt>',
    "no uncached tokens": '<prompt schema="s"><a/><b/></prompt>',
}

ARCHITECTURES = ["llama", "gpt2", "bloom"]


@pytest.fixture(scope="module")
def models():
    return {kind: tiny_model(kind) for kind in SCHEMES}


def make_llm(model, tmp_path, isolate=False, recompute="none") -> LLM:
    """Serves every cached token as encoded (recompute "none"): the rule under test here;
    the policies that recompute some are held to the oracle in test_recompute.py."""
    store = ModuleStore(disk_dir=tmp_path / "kv")
    llm = LLM.from_model(model, WordTokenizer(VOCAB, bos=True), store=store, isolate=isolate,
                         recompute=recompute)
    llm.add_schema(SCHEMA)
    return llm


def assert_matches_oracle(llm: LLM, prompt: str, isolate: bool) -> None:
    cached = llm.prefill(prompt, all_logits=True)
    expected = oracle_prefill(llm.adapter, llm.bind(prompt), isolate=isolate)
    order = torch.argsort(cached.positions)
    assert torch.equal(cached.positions[order], expected.positions)
    assert cached.logits.shape == expected.logits.shape
    assert (cached.logits - expected.logits).abs().max() < TOL
    assert (cached.keys[:, :, order] - expected.keys).abs().max() < TOL
    assert (cached.values[:, :, order] - expected.values).abs().max() < TOL


@pytest.mark.parametrize("isolate", [False, True], ids=["guaranteed", "isolate"])
@pytest.mark.parametrize("case", list(PROMPTS))
@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_cached_prefill_equals_one_masked_pass(models, tmp_path, kind, case, isolate, kernels):
    llm = make_llm(models[kind], tmp_path, isolate=isolate)
    assert_matches_oracle(llm, PROMPTS[case], isolate)


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_long_inputs_in_chunks_match_the_oracle(models, tmp_path, kind):
    """Units and prefills longer than the chunk size run as several passes, exactly."""
    llm = make_llm(models[kind], tmp_path)
    llm.adapter.chunk_size = 3
    try:
        for case in ("nested modules", "shorter argument", "cache false", "no uncached tokens"):
            assert_matches_oracle(llm, PROMPTS[case], isolate=False)
    finally:
        llm.adapter.chunk_size = type(llm.adapter).chunk_size


@pytest.mark.parametrize("kind", [k for k, s in SCHEMES.items() if s == "rope"])
def test_every_supported_rope_model_matches_the_oracle(models, tmp_path, kind):
    llm = make_llm(models[kind], tmp_path)
    for case in ("nested modules", "union"):
        assert_matches_oracle(llm, PROMPTS[case], isolate=False)


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_isolate_and_guaranteed_context_give_different_kv(models, tmp_path, kind):
    prompt = PROMPTS["nested modules"]
    guaranteed = make_llm(models[kind], tmp_path / "g").prefill(prompt)
    isolated = make_llm(models[kind], tmp_path / "i", isolate=True).prefill(prompt)
    assert (guaranteed.logits - isolated.logits).abs().max() > 1e-3


SCAFFOLD_SCHEMA = """\
<schema name="joint">
  <system>Read both documents.</system>
  <scaffold name="all">
    <module name="one">First document text here.</module>
    <module name="two">Second document with more text.</module>
    <module name="three">Third and final document.</module>
  </scaffold>
</schema>
"""


@pytest.mark.parametrize("question", ["<user>Which is longest?</user>", ""],
                         ids=["with question", "without uncached text"])
@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_scaffold_covering_all_modules_equals_plain_prefill(models, tmp_path, kind, question):
    llm = make_llm(models[kind], tmp_path)
    llm.add_schema(SCAFFOLD_SCHEMA)
    prompt = f'<prompt schema="joint"><scaffold name="all"/>{question}</prompt>'
    cached = llm.prefill(prompt, all_logits=True)
    plain = llm.prefill(prompt, baseline=True, all_logits=True)
    order = torch.argsort(cached.positions)
    assert torch.equal(cached.token_ids[order], plain.token_ids)
    assert torch.equal(cached.positions[order], torch.arange(len(plain.token_ids)))
    rows = cached.logits.shape[0]
    assert (cached.logits - plain.logits[-rows:]).abs().max() < TOL
    assert (cached.keys[:, :, order] - plain.keys).abs().max() < TOL
    assert (cached.values[:, :, order] - plain.values).abs().max() < TOL


# --- the adapter itself ------------------------------------------------------------------------

@pytest.mark.parametrize("kind", list(SCHEMES))
def test_adapter_reproduces_the_models_own_forward(models, kind):
    """Contiguous positions, causal: our explicit inputs give what the unmodified
    transformers model computes from the token ids alone."""
    model = models[kind]
    adapter = adapt(model)
    ids = torch.randint(3, VOCAB, (12,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        reference = reference_model(model)(input_ids=ids[None]).logits[0]
    explicit = adapter.forward(ids, torch.arange(12), None, causal_allowed(0, 12), torch.arange(12))
    implicit = adapter.forward(ids, torch.arange(12), None, None, torch.arange(12))
    assert (explicit.logits - reference).abs().max() < TOL
    assert (implicit.logits - reference).abs().max() < TOL
    # the same tokens fed as a prefix then one at a time (decode) agree too
    keys, values = adapter.empty_kv(12)
    step = adapter.forward(ids[:8], torch.arange(8), Past(keys, values, torch.arange(0)), None,
                           torch.arange(8))
    logits = [step.logits]
    for i in range(8, 12):
        step = adapter.forward(ids[i:i + 1], torch.tensor([i]),
                               Past(keys, values, torch.arange(i)), None, torch.tensor([0]))
        logits.append(step.logits)
    assert (torch.cat(logits) - reference).abs().max() < TOL
    assert keys.shape[:2] == (adapter.kv_shape.layers, adapter.kv_shape.kv_heads)


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_positions_are_honoured(models, kind):
    """A gap between two pieces changes the result: the model sees real positions."""
    adapter = adapt(models[kind])
    ids = torch.randint(3, VOCAB, (10,), generator=torch.Generator().manual_seed(1))
    contiguous = adapter.forward(ids, torch.arange(10), None, None, torch.arange(10))
    gapped_pos = torch.cat([torch.arange(5), torch.arange(40, 45)])
    gapped = adapter.forward(ids, gapped_pos, None, None, torch.arange(10))
    assert (contiguous.logits[:5] - gapped.logits[:5]).abs().max() < TOL
    assert (contiguous.logits[5:] - gapped.logits[5:]).abs().max() > 1e-3


def test_unsupported_architecture_is_a_model_error():
    config = transformers.MptConfig(vocab_size=VOCAB, d_model=64, n_heads=4, n_layers=1)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ModelError, match=r"unsupported architecture: mpt \(supported: llama"):
        LLM.from_model(model, WordTokenizer(VOCAB))


# --- the default model ---------------------------------------------------------------------------

DEFAULT_SCHEMA = """\
<schema name="facts">
  <system>You answer in one short sentence.</system>
  <module name="cats">Cats sleep most of the day.</module>
  <module name="dogs">Dogs like to play fetch.</module>
  <user>
</schema>
"""


@pytest.fixture(scope="module")
def default_llm(tmp_path_factory):
    from promptlang.runtime.model.loading import load_hf_model
    model, tokenizer = load_hf_model()
    store = ModuleStore(disk_dir=tmp_path_factory.mktemp("kv"))
    return LLM(adapt(model), tokenizer, store, recompute="none")


def test_default_model_greedy_tokens_equal_baseline_for_a_scaffold_like_prefix(default_llm):
    """On the real model, a prompt whose modules see everything before them gives the
    baseline's greedy tokens: the cache changes nothing but speed."""
    llm = default_llm
    llm.add_schema(DEFAULT_SCHEMA.replace('<module name="dogs">Dogs like to play fetch.</module>',
                                          ""))
    prompt = '<prompt schema="facts"><cats/>What do cats do?</user><assistant></prompt>'
    cached = llm.generate(prompt, max_new_tokens=8)
    baseline = llm.generate(prompt, max_new_tokens=8, baseline=True)
    assert cached.cached_tokens > 0 and baseline.cached_tokens == 0
    assert cached.token_ids == baseline.token_ids
    assert cached.text


def test_default_model_matches_the_oracle(default_llm, kernels):
    llm = default_llm
    llm.add_schema(DEFAULT_SCHEMA)
    prompt = '<prompt schema="facts"><cats/><dogs/>Which animal plays?</user><assistant></prompt>'
    assert_matches_oracle(llm, prompt, isolate=False)
