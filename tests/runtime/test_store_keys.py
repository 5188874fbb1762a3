"""What a stored unit is keyed by: every weight byte, the config and the dtypes of the model,
and the store dtype, so no process is served KV another model or precision encoded."""

from __future__ import annotations

import pytest
import torch

from promptlang.runtime.engine import LLM
from promptlang.runtime.model import model_fingerprint
from promptlang.runtime.store import ModuleStore
from promptlang.tokenizer import WordTokenizer
from .test_engine import SCHEMA, UNITS, VOCAB
from .tiny import tiny_llama


@pytest.fixture(scope="module")
def model():
    return tiny_llama(7, VOCAB)


def make_llm(model, disk_dir, **store_args) -> LLM:
    llm = LLM.from_model(model, WordTokenizer(VOCAB, bos=True),
                         store=ModuleStore(disk_dir=disk_dir, **store_args))
    llm.add_schema(SCHEMA)
    return llm


def test_editing_one_weight_by_one_ulp_changes_the_fingerprint(model):
    edited = tiny_llama(7, VOCAB)
    before = model_fingerprint(edited)
    weight = edited.model.layers[1].mlp.down_proj.weight
    with torch.no_grad():
        weight[17, 3] = torch.nextafter(weight[17, 3], torch.tensor(1.0))
    assert model_fingerprint(edited) != before
    with torch.no_grad():
        weight[17, 3] = model.model.layers[1].mlp.down_proj.weight[17, 3]
    assert model_fingerprint(edited) == before


def test_identical_weights_in_a_fresh_model_give_the_same_fingerprint(model):
    assert model_fingerprint(tiny_llama(7, VOCAB)) == model_fingerprint(model)
    assert model_fingerprint(tiny_llama(8, VOCAB)) != model_fingerprint(model)


def test_the_fingerprint_covers_the_weights_dtype_and_the_config(model):
    half = tiny_llama(7, VOCAB).to(torch.bfloat16)
    assert model_fingerprint(half) != model_fingerprint(model)
    other_config = tiny_llama(7, VOCAB)
    other_config.config.rope_theta = 5000.0
    assert model_fingerprint(other_config) != model_fingerprint(model)


def test_a_model_with_ten_edited_embedding_rows_re_encodes_every_unit(model, tmp_path):
    make_llm(model, tmp_path).encode(SCHEMA)
    edited = tiny_llama(7, VOCAB)
    with torch.no_grad():
        edited.model.embed_tokens.weight[100:110] += 0.01
    second = make_llm(edited, tmp_path)              # another process sharing the disk tier
    second.encode(SCHEMA)
    assert second.encoder_calls == UNITS and second.store.stats.disk_hits == 0
    same = make_llm(model, tmp_path)
    same.encode(SCHEMA)
    assert same.encoder_calls == 0 and same.store.stats.disk_hits == UNITS


def test_stores_of_different_dtypes_never_serve_each_others_kv(model, tmp_path):
    half = make_llm(model, tmp_path, dtype=torch.bfloat16)
    half.encode(SCHEMA)
    full = make_llm(model, tmp_path)
    full.encode(SCHEMA)
    assert full.encoder_calls == UNITS and full.store.stats.disk_hits == 0
    assert len(list(tmp_path.glob("*.bfloat16.safetensors"))) == UNITS
    assert len(list(tmp_path.glob("*.put.safetensors"))) == UNITS
    again = make_llm(model, tmp_path, dtype=torch.bfloat16)
    again.encode(SCHEMA)
    assert again.encoder_calls == 0 and again.store.stats.disk_hits == UNITS
