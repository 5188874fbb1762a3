"""Requests the runtime must refuse: each a clear PromptLangError, raised before anything
is encoded, so the store is exactly as it was."""

from __future__ import annotations

import pytest
import torch
import transformers

from promptlang.errors import (ArgumentTooLongError, ContextLengthError, PromptLangError,
                               TokenizerMismatchError, UnknownModuleError, UnknownSchemaError)
from promptlang.pml.layout import lay_out
from promptlang.pml.parser import parse_schema
from promptlang.runtime.engine import LLM
from promptlang.runtime.store import ModuleStore
from promptlang.tokenizer import WordTokenizer

VOCAB = 1000
CONTEXT = 64

SCHEMA = """\
<schema name="shop">
  <system>You are a shop assistant.</system>
  <module name="catalog">We sell <param name="item" len="3"/> and more.</module>
  <module name="returns">Returns are free within thirty days.</module>
  <user>
</schema>
"""


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(3)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, max_position_embeddings=CONTEXT)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture
def llm(model, tmp_path):
    # the tokenizer allows more positions than the model: the model's limit must win
    llm = LLM.from_model(model, WordTokenizer(VOCAB, max_positions=4096, bos=True),
                         store=ModuleStore(disk_dir=tmp_path / "kv"))
    llm.add_schema(SCHEMA)
    llm.generate('<prompt schema="shop"><returns/>Hi</user></prompt>', max_new_tokens=1)
    return llm


def snapshot(llm):
    return (sorted((e.key, e.tiers) for e in llm.store.entries()), llm.encoder_calls,
            sorted(p.name for p in llm.store.disk_dir.iterdir()))


@pytest.mark.parametrize("prompt, error, message", [
    ('<prompt schema="shop"><refunds/>Hi</user></prompt>', UnknownModuleError,
     "has no module 'refunds' (known: catalog, returns)"),
    ('<prompt schema="shop"><catalog item="red and blue shoes"/>Hi</user></prompt>',
     ArgumentTooLongError, "parameter 'item' is 4 tokens long; the parameter allows 3"),
    ('<prompt schema="shop"><catalog item="hats"/>' + "word " * 60 + '</user></prompt>',
     ContextLengthError, f"the prompt needs 86 positions; the model has {CONTEXT}"),
    ('<prompt schema="shop"></prompt>', PromptLangError, "the prompt is empty"),
    ('<prompt schema="shops"><returns/>Hi</user></prompt>', UnknownSchemaError,
     "unknown schema 'shops' (registered: shop)"),
], ids=["unknown module", "argument too long", "longer than the context", "empty prompt",
        "unknown schema"])
def test_bad_request_is_a_clear_error_and_leaves_the_store_unchanged(llm, prompt, error,
                                                                     message):
    before = snapshot(llm)
    with pytest.raises(error) as info:
        llm.generate(prompt, max_new_tokens=4)
    assert message in str(info.value)
    assert str(info.value).startswith("<prompt>:1:")          # located in the prompt
    assert snapshot(llm) == before


def test_a_schema_laid_out_for_another_tokenizer_is_refused(llm):
    other = lay_out(parse_schema(SCHEMA.replace("shop", "elsewhere")), WordTokenizer(500))
    before = snapshot(llm)
    for attempt in (lambda: llm.encode(other),
                    lambda: llm.generate('<prompt schema="elsewhere"><returns/>Hi</user></prompt>',
                                         schema=other)):
        with pytest.raises(TokenizerMismatchError, match="laid out for tokenizer"):
            attempt()
    assert snapshot(llm) == before


def test_a_schema_longer_than_the_context_is_refused_before_encoding(llm):
    before = snapshot(llm)
    long_schema = SCHEMA.replace("Returns are free", "Returns " + "are free " * 40)
    with pytest.raises(ContextLengthError, match=f"the model has {CONTEXT}"):
        llm.encode(long_schema)
    assert snapshot(llm) == before


def test_bad_sampling_arguments_are_refused_before_encoding(llm):
    before = snapshot(llm)
    with pytest.raises(PromptLangError, match="temperature must be >= 0"):
        llm.generate('<prompt schema="shop"><catalog item="hats"/>Hi</user></prompt>',
                     temperature=-1.0)
    assert snapshot(llm) == before


def test_generation_stops_at_the_end_of_the_context(llm):
    prompt = '<prompt schema="shop"><returns/>' + "word " * 30 + "</user></prompt>"
    bound = llm.bind(prompt)
    result = llm.generate(prompt, max_new_tokens=100)
    assert result.finish_reason in ("length", "eos")
    # the request is at contiguous positions (exact): its tokens, then the generated ones
    assert len(bound.token_ids()) + len(result.token_ids) <= CONTEXT + 1
