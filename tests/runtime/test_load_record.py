"""A converted copy's later loads (runtime/model/load_record.py, loading._load_converted,
loading._file_digest): what the first load computed -- the fingerprints, which blocks equal
the float weights, the GGUF's digest -- is taken from the record while the files are the
same, and computed again when they are not; the model read by _load_converted is the one
transformers' from_pretrained gives."""

from __future__ import annotations

import hashlib
import os
import time

import pytest
import torch

from promptlang.errors import ModelError
from promptlang.runtime.model import loading
from promptlang.runtime.model.load_record import RECORD, LoadRecord

gguf = pytest.importorskip("gguf")


def _folder(tmp_path):
    folder = tmp_path / "copy"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"weights")
    (folder / "config.json").write_text("{}")
    return folder


def test_a_value_comes_back_while_the_files_are_the_same(tmp_path):
    folder = _folder(tmp_path)
    LoadRecord(folder).put("answer", {"a": True})
    assert LoadRecord(folder).get("answer") == {"a": True}
    assert (folder / RECORD).stat().st_mode & 0o077 == 0               # private
    assert [p.name for p in folder.iterdir() if p.name.startswith(".record-")] == []


@pytest.mark.parametrize("change", ["rewritten", "added", "removed"])
def test_a_changed_file_forgets_every_value(tmp_path, change):
    folder = _folder(tmp_path)
    LoadRecord(folder).put("answer", 42)
    if change == "rewritten":
        time.sleep(0.02)
        (folder / "config.json").write_text('{"x": 1}')
    elif change == "added":
        (folder / "tokenizer.json").write_text("{}")
    else:
        (folder / "config.json").unlink()
    assert LoadRecord(folder).get("answer") is None


@pytest.mark.parametrize("text", ["not json", "[1, 2]", '{"version": 99}', "{" * 5000])
def test_a_damaged_record_is_no_record(tmp_path, text):
    folder = _folder(tmp_path)
    (folder / RECORD).write_text(text)
    record = LoadRecord(folder)
    assert record.get("answer") is None
    record.put("answer", 1)                                  # and is replaced whole
    assert LoadRecord(folder).get("answer") == 1


def test_a_folder_that_cannot_be_written_keeps_nothing_and_fails_nothing(tmp_path):
    folder = _folder(tmp_path)
    record = LoadRecord(folder)
    os.chmod(folder, 0o500)
    try:
        record.put("answer", 1)
        if os.access(folder, os.W_OK):                      # root writes anyway
            pytest.skip("this user writes into read-only folders")
        assert record.get("answer") == 1 and not (folder / RECORD).exists()
    finally:
        os.chmod(folder, 0o700)


def test_a_gguf_is_hashed_once_while_it_is_unchanged(tmp_path, monkeypatch):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"A" * 5000)
    root = tmp_path / "root"
    root.mkdir()
    hashed = []
    real = loading._sha256
    monkeypatch.setattr(loading, "_sha256", lambda p: hashed.append(p) or real(p))
    first = loading._file_digest(path, os.stat(path), root)
    assert first == hashlib.sha256(b"A" * 5000).hexdigest()[:16]
    assert loading._file_digest(path, os.stat(path), root) == first and len(hashed) == 1
    time.sleep(0.02)
    path.write_bytes(b"B" * 5000)                       # the same size, written again
    assert loading._file_digest(path, os.stat(path), root) == \
        hashlib.sha256(b"B" * 5000).hexdigest()[:16]
    assert len(hashed) == 2
    (root / loading.DIGESTS).write_text("{ damaged")
    assert loading._file_digest(path, os.stat(path), root) == \
        hashlib.sha256(b"B" * 5000).hexdigest()[:16]
    assert len(hashed) == 3


def _counting(monkeypatch, module, name, calls):
    real = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(name)
        return real(*args, **kwargs)
    monkeypatch.setattr(module, name, counted)


def test_a_second_load_of_a_gguf_takes_what_the_first_computed(tmp_path, monkeypatch):
    """The fingerprints, the blocks' comparison with the float weights and the file's digest
    come from the record: the second load computes none of them, and serves the same."""
    from promptlang import hf_tokenizer
    from promptlang.runtime import engine
    from promptlang.runtime.fast import native
    from promptlang.runtime.model import adapter as adapter_module
    from tests.runtime.test_gguf import K_MIX, LAYERS, _k_quant_blocks, write_tiny_gguf

    if not native.available():
        pytest.skip("CPU kernels unavailable here")
    monkeypatch.setenv("PROMPTLANG_HOME", str(tmp_path / "home"))
    path = tmp_path / "kquants.gguf"
    write_tiny_gguf(path, hidden=256, inter=512, blocks=_k_quant_blocks)
    schema = '<schema name="k"><system>Tiny.</system></schema>'
    prompt = '<prompt schema="k"><user>Hi there</user><assistant></prompt>'
    first = engine.load(str(path), recompute="none")
    answer = first.generate(prompt, schema=schema, max_new_tokens=6).token_ids
    calls: list[str] = []
    _counting(monkeypatch, adapter_module, "model_fingerprint", calls)
    _counting(monkeypatch, hf_tokenizer, "_definition", calls)
    _counting(monkeypatch, native, "q_dequant", calls)
    _counting(monkeypatch, loading, "_sha256", calls)
    second = engine.load(str(path), recompute="none")
    assert calls == []
    assert second.adapter.fingerprint == first.adapter.fingerprint
    assert second.tokenizer.fingerprint == first.tokenizer.fingerprint
    served = LAYERS * len(K_MIX)
    assert second.adapter.fast.decoder.quantized_weights == served
    assert second.generate(prompt, schema=schema, max_new_tokens=6).token_ids == answer
    # a converted copy whose files changed computes everything again
    (converted,) = (tmp_path / "home" / "models" / "gguf").glob("kquants-*")
    time.sleep(0.02)
    os.utime(converted / "config.json")
    third = engine.load(str(path), recompute="none")
    assert sorted(set(calls)) == ["_definition", "model_fingerprint", "q_dequant"]
    assert third.adapter.fingerprint == first.adapter.fingerprint
    assert third.adapter.fast.decoder.quantized_weights == served


def test_a_converted_copy_reads_as_from_pretrained_reads_it(tmp_path, monkeypatch):
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from promptlang.runtime import engine
    from tests.runtime.test_gguf import write_tiny_gguf

    monkeypatch.setenv("PROMPTLANG_HOME", str(tmp_path / "home"))
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    engine.load(str(path))
    (converted,) = (tmp_path / "home" / "models" / "gguf").glob("tiny-*")
    ours = loading._load_converted(str(converted), torch.float32)
    theirs = AutoModelForCausalLM.from_pretrained(str(converted), dtype=torch.float32)
    assert ours.lm_head.weight is ours.model.embed_tokens.weight        # tied, as stored
    mine, reference = ours.state_dict(), theirs.state_dict()
    assert mine.keys() == reference.keys()
    assert all(torch.equal(mine[name], reference[name]) for name in mine)
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(ours.named_buffers(),
                                                           theirs.named_buffers()))
    assert not ours.training
    half = loading._load_converted(str(converted), torch.bfloat16)
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    # a copy that lacks a weight, or holds one the model has not, is refused
    weights = load_file(str(converted / "model.safetensors"))
    for name, damaged in (("lacks", {k: v for k, v in weights.items()
                                     if not k.endswith("layers.1.mlp.up_proj.weight")}),
                          ("holds", {**weights, "model.extra.weight": torch.zeros(2)})):
        save_file(damaged, str(converted / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(ModelError, match=f"{name}.*delete the folder"):
            loading._load_converted(str(converted), torch.float32)
    shaped = dict(weights)
    (name,) = [k for k in weights if k.endswith("layers.0.mlp.down_proj.weight")]
    shaped[name] = torch.zeros(3, 5)
    save_file(shaped, str(converted / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelError, match="does not fit its config.*delete the folder"):
        loading._load_converted(str(converted), torch.float32)
    (converted / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ModelError, match="cannot be read.*delete the folder"):
        loading._load_converted(str(converted), torch.float32)
