"""Serving a seam adapter (runtime/model/seam.py, policy `tuned`): the runtime's passes
against the tune loop's plain-PyTorch student, the exact paths untouched, decode steps and
batch steps on the adapter, and how an adapter is found and refused."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
from transformers import DynamicCache

from promptlang.errors import AdapterFileError, ConfigError
from promptlang.runtime.decoding.decode import Decoder, steps_together
from promptlang.runtime.decoding.sampling import Decoding, SamplingParams
from promptlang.runtime.engine import LLM
from promptlang.runtime.kv.assembler import KVBuffer
from promptlang.runtime.model import compute
from promptlang.runtime.model import seam as seam_mod
from promptlang.runtime.model.lora import SeamLoRA, attached, shape_of
from promptlang.home import ADAPTER_FILE
from promptlang.runtime.model.seam import find_seam_adapter
from promptlang.runtime.store import ModuleStore
from promptlang.runtime.tune.samples import make_sample, rag_prompt, rag_schema, student_logprobs
from promptlang.runtime.tune.train import plain_copy

from .test_tune import TEXTS, VOCAB, _trained_like
from .tiny import Words, tiny_llama

QUESTION = "Question: when does the choir sing?"


def _engine(model, **options) -> LLM:
    llm = LLM.from_model(model, Words(VOCAB, bos=True), store=ModuleStore(), **options)
    llm.add_schema(rag_schema("s", "answer from the notes", "notes:\n\n", TEXTS))
    return llm


def _adapter_file(tmp_path, llm: LLM, adapter: SeamLoRA, name: str = ADAPTER_FILE):
    path = tmp_path / name
    adapter.save(path, {"model_fingerprint": llm.adapter.fingerprint})
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = tiny_llama(0, VOCAB)
    model = plain_copy(base)
    adapter = _trained_like(SeamLoRA(shape_of(model, rank=4, alpha=8.0), seed=1))
    llm = _engine(base, recompute="none", exact_reuse=False)
    path = _adapter_file(tmp_path_factory.mktemp("seam"), llm, adapter)
    llm.use_seam_adapter(path)
    return llm, model, adapter, path


def _served_as_the_student(llm, model, adapter, docs):
    """`tuned`'s logits of the tokens after the modules, checked equal to the tune loop's
    student's; (those logits, the sample, the tail's length) for more checks."""
    prompt = rag_prompt("s", docs, QUESTION)
    sample = make_sample(llm, model, prompt, answer_tokens=3, end_ids={2})
    served = llm.prefill(prompt, recompute="tuned", all_logits=True)
    tail = len(served.token_ids) - served.cached_length
    expected = student_logprobs(model, sample, adapter)[:tail]
    got = torch.log_softmax(served.logits[-tail:].float(), dim=-1)
    assert torch.allclose(got, expected, atol=1e-4)
    return got, sample, tail


def test_tuned_serves_the_tokens_after_the_modules_as_the_tune_loop_s_student(setup):
    llm, model, adapter, _ = setup
    got, sample, tail = _served_as_the_student(llm, model, adapter, [0, 2, 3])
    # the adapter changes the answer's distribution: the check above can fail
    untuned = student_logprobs(model, sample, None)[:tail]
    assert not torch.allclose(got, untuned, atol=1e-2)
    # documents 2 and 3 left out: the student's question sits where `tuned` serves it
    _, gapped, _ = _served_as_the_student(llm, model, adapter, [0, 1])
    assert int(gapped.positions[0]) == int(gapped.cached_positions.max()) + 1


def _serving(folder, **form):
    """An engine serving a trained-like adapter of `form` (shape_of's options), the plain
    model the tune loop's student runs on, and the adapter."""
    base = tiny_llama(0, VOCAB)
    model = plain_copy(base)
    adapter = _trained_like(SeamLoRA(shape_of(model, rank=4, alpha=8.0, **form), seed=1))
    llm = _engine(base, recompute="none", exact_reuse=False)
    llm.use_seam_adapter(_adapter_file(folder, llm, adapter))
    return llm, model, adapter


@pytest.fixture(scope="module")
def encoding(tmp_path_factory):
    """An engine serving an adapter that also encodes the modules."""
    return _serving(tmp_path_factory.mktemp("encoding"), encodes=True)


def test_a_fresh_adapter_that_encodes_is_the_runtime_s_none(encoding):
    """The student's own encoding of the cached tokens (each seeing what the runtime's
    encoder lets it see) is the store's KV: with B = 0 it answers as `none`."""
    llm, model, adapter = encoding
    prompt = rag_prompt("s", [0, 2, 3], QUESTION)
    sample = make_sample(llm, model, prompt, answer_tokens=3, end_ids={2})
    fresh = SeamLoRA(adapter.shape, seed=5)
    assert torch.allclose(student_logprobs(model, sample, fresh),
                          student_logprobs(model, sample, None), atol=1e-5)


def test_an_adapter_that_encodes_is_served_as_the_tune_loop_s_student(encoding):
    llm, model, adapter = encoding
    got, sample, tail = _served_as_the_student(llm, model, adapter, [1, 2, 3])
    # the same LoRA on the tokens after the modules alone reads other KV: the check can fail
    after_only = SeamLoRA(replace(adapter.shape, encodes=False), seed=1)
    after_only.load_state_dict(adapter.state_dict())
    assert not torch.allclose(got, student_logprobs(model, sample, after_only)[:tail],
                              atol=1e-2)


def test_units_an_adapter_encodes_are_stored_apart_from_the_base_model_s(encoding):
    llm, model, adapter = encoding
    prompt = rag_prompt("s", [0, 1], QUESTION)
    tuned = llm.prefill(prompt, recompute="tuned", all_logits=False)
    layout = tuned.bound.layout
    for unit in tuned.bound.units:            # keys that name the adapter
        assert llm.seam_encoder.key(layout, unit) != llm.encoder.key(layout, unit)
        assert llm.store.get(llm.seam_encoder.key(layout, unit)) is not None
    served = llm.prefill(prompt, recompute="none", all_logits=False)
    fresh = _engine(tiny_llama(0, VOCAB), recompute="none", exact_reuse=False)
    alone = fresh.prefill(prompt, recompute="none", all_logits=False)
    assert torch.equal(served.keys, alone.keys)
    assert torch.allclose(served.logits, alone.logits, atol=1e-6)
    assert not torch.allclose(tuned.keys[:, :, :tuned.cached_length],
                              served.keys[:, :, :served.cached_length], atol=1e-3)


@pytest.fixture(scope="module")
def linked(tmp_path_factory):
    """An engine serving an adapter with link tokens (and its LoRA)."""
    return _serving(tmp_path_factory.mktemp("linked"), link_tokens=3)


def test_link_tokens_are_served_as_the_tune_loop_s_student_reads_them(linked):
    llm, model, adapter = linked
    prompt = rag_prompt("s", [0, 2, 3], QUESTION)
    sample = make_sample(llm, model, prompt, answer_tokens=3, end_ids={2})
    served = llm.prefill(prompt, recompute="tuned", all_logits=True)
    tail = len(sample.ids) - sample.answer_length
    # the buffer holds the cached units, the three link tokens, then the computed tail
    assert len(served.token_ids) == served.cached_length + 3 + tail
    links = served.positions[served.cached_length:served.cached_length + 3]
    assert links.tolist() == [int(sample.positions[0]) - 1] * 3
    expected = student_logprobs(model, sample, adapter)[:tail]
    got = torch.log_softmax(served.logits[-tail:].float(), dim=-1)
    assert torch.allclose(got, expected, atol=1e-4)
    without = SeamLoRA(adapter.shape, seed=1)          # the same LoRA, link values zero
    without.load_state_dict(adapter.state_dict())
    with torch.no_grad():
        without.link_values.zero_()
    assert not torch.allclose(got, student_logprobs(model, sample, without)[:tail], atol=1e-2)


def test_decode_steps_attend_to_the_link_tokens_as_the_student_does(linked):
    llm, model, adapter = linked
    prompt = rag_prompt("s", [1, 3], QUESTION)
    result = llm.generate(prompt, recompute="tuned", max_new_tokens=5, temperature=0.0,
                          token_healing=False)
    sample = make_sample(llm, model, prompt, answer_tokens=0, end_ids={2})
    picked = []
    with torch.no_grad():
        while len(picked) < len(result.token_ids):
            rows = student_logprobs(model, sample, adapter)
            token = int(rows[-1].argmax())
            picked.append(token)
            sample = replace(sample, ids=torch.cat([sample.ids, torch.tensor([token])]),
                             positions=torch.cat([sample.positions,
                                                  sample.positions[-1:] + 1]))
    assert list(result.token_ids) == picked


def test_a_prompt_ending_in_a_module_computes_its_last_token_after_the_link_tokens(linked):
    from promptlang.pml import nodes
    from promptlang.runtime.tune.samples import Sample

    llm, model, adapter = linked
    prompt = nodes.PromptDoc("s", (nodes.ModuleRef("doc-0"), nodes.ModuleRef("doc-2")))
    tuned = llm.prefill(prompt, recompute="tuned", all_logits=True)
    result = llm.generate(prompt, recompute="tuned", max_new_tokens=4, temperature=0.0,
                          token_healing=False)
    # the prompt's last token is cached: it is computed again (as under every policy), on
    # the adapter, after the link tokens; then every decode step
    served = llm.prefill(prompt, recompute="none", all_logits=False)
    n = len(served.token_ids)
    last_id = int(served.token_ids[-1])
    last = int(served.positions[-1])
    assert last == int(served.positions.max())
    picked = []
    with torch.no_grad():
        while True:
            sample = Sample(cached_keys=served.keys[:, :, :n - 1],
                            cached_values=served.values[:, :, :n - 1],
                            ids=torch.tensor([last_id, *picked]),
                            positions=torch.arange(last, last + 1 + len(picked)),
                            teacher=torch.zeros(0), answer_length=0)
            rows = student_logprobs(model, sample, adapter)
            if not picked:
                got = torch.log_softmax(tuned.logits[-1].float(), dim=-1)
                assert torch.allclose(got, rows[0], atol=1e-4)
                assert not torch.allclose(got, torch.log_softmax(served.logits[-1], dim=-1),
                                          atol=1e-2)
            if len(picked) == len(result.token_ids):
                break
            picked.append(int(rows[-1].argmax()))
    assert list(result.token_ids) == picked


def test_link_tokens_leave_the_pooled_buffers_writable_outside_inference_mode(linked):
    llm, _, adapter = linked
    prompt = rag_prompt("s", [0, 1], QUESTION)
    opened = llm.open(prompt, recompute="tuned", add_generation_prompt=False, room=0)
    buffer = opened.buffer
    try:
        assert buffer.capacity >= buffer.length          # room was made for the links
        # bench/rag.py's prefix writes a pooled buffer in place, outside inference mode
        assert not buffer.slot_keys.is_inference()
    finally:
        llm.release_buffer(buffer)
    # a buffer without room for them grows outside inference mode, from within it too
    shape = adapter.link_keys.shape                      # [L, H_kv, T, D]
    grown = KVBuffer(slot_keys=torch.zeros(shape[0], shape[1], 1, shape[3]),
                     slot_values=torch.zeros(shape[0], shape[1], 1, shape[3]),
                     positions=torch.zeros(1, dtype=torch.int64),
                     token_ids=torch.zeros(1, dtype=torch.int64))
    with torch.inference_mode():
        llm.seam.place_links(grown, 5)
    assert grown.length == 3 and not grown.slot_keys.is_inference()
    assert grown.positions[:3].tolist() == [4, 4, 4]


def test_an_exact_request_is_the_same_beside_an_adapter_with_link_tokens(linked):
    llm, _, _ = linked
    plain = _engine(tiny_llama(0, VOCAB), exact_reuse=False)
    prompt = rag_prompt("s", [3, 1], QUESTION)
    with_seam = llm.prefill(prompt, recompute="exact", all_logits=True)
    without = plain.prefill(prompt, recompute="exact", all_logits=True)
    assert torch.equal(with_seam.logits, without.logits)
    assert torch.equal(with_seam.token_ids, without.token_ids)


def test_a_fresh_adapter_serves_exactly_what_none_serves(tmp_path):
    base = tiny_llama(0, VOCAB)
    llm = _engine(base, exact_reuse=False)
    fresh = SeamLoRA(shape_of(plain_copy(base)), seed=4)          # B = 0
    llm.use_seam_adapter(_adapter_file(tmp_path, llm, fresh))
    prompt = rag_prompt("s", [3, 1], QUESTION)
    tuned = llm.prefill(prompt, recompute="tuned", all_logits=True)
    none = llm.prefill(prompt, recompute="none", all_logits=True)
    assert torch.equal(tuned.token_ids, none.token_ids)
    assert torch.allclose(tuned.logits, none.logits, atol=1e-4)


def test_a_request_with_gaps_is_computed_right_after_its_last_module(tmp_path):
    """Under `tuned` the question follows the last imported module's positions, not the
    left-out modules' (a fresh adapter: the base model at those positions); `none` keeps
    the layout's positions, and the two differ."""
    base = tiny_llama(0, VOCAB)
    llm = _engine(base, exact_reuse=False)
    fresh = SeamLoRA(shape_of(plain_copy(base)), seed=4)          # B = 0
    llm.use_seam_adapter(_adapter_file(tmp_path, llm, fresh))
    prompt = rag_prompt("s", [0, 2], QUESTION)                    # document 3 left out
    tuned = llm.prefill(prompt, recompute="tuned", all_logits=True)
    none = llm.prefill(prompt, recompute="none", all_logits=True)
    n = none.cached_length
    start = int(none.positions[:n].max()) + 1
    tail = len(none.token_ids) - n
    assert int(none.positions[n]) > start
    assert torch.equal(tuned.positions[n:], torch.arange(start, start + tail))
    assert torch.equal(tuned.positions[:n], none.positions[:n])
    model = plain_copy(base)
    cache = DynamicCache(config=model.config)
    for layer in range(none.keys.shape[0]):
        cache.update(none.keys[layer][None, :, :n], none.values[layer][None, :, :n], layer)
    with torch.no_grad():
        rows = model(input_ids=none.token_ids[None, n:],
                     position_ids=torch.arange(start, start + tail)[None], cache=cache,
                     use_cache=True).logits[0]
    assert torch.allclose(tuned.logits[-tail:], rows, atol=1e-4)
    assert not torch.allclose(tuned.logits[-tail:], none.logits[-tail:], atol=1e-3)


def test_decode_steps_run_on_the_adapter_as_the_student_s_greedy_answer(setup):
    llm, model, adapter, _ = setup
    prompt = rag_prompt("s", [1, 2], QUESTION)
    result = llm.generate(prompt, recompute="tuned", max_new_tokens=5, temperature=0.0,
                          token_healing=False)
    # reference: the served modules' KV as the past, then the tail (right after the last
    # module's positions: document 3 is left out) and each picked token through the plain
    # model with the adapter's hooks, greedily
    served = llm.prefill(prompt, recompute="none", all_logits=True)
    n = served.cached_length
    cache = DynamicCache(config=model.config)
    for layer in range(served.keys.shape[0]):
        cache.update(served.keys[layer][None, :, :n], served.values[layer][None, :, :n], layer)
    ids = served.token_ids[n:]
    start = int(served.positions[:n].max()) + 1
    assert int(served.positions[n]) > start           # `none` leaves the gap
    positions = torch.arange(start, start + len(ids))
    picked = []
    with torch.no_grad(), attached(model, adapter):
        rows = model(input_ids=ids[None], position_ids=positions[None], cache=cache,
                     use_cache=True).logits[0]
        position = int(positions[-1]) + 1
        while len(picked) < len(result.token_ids):
            token = int(rows[-1].argmax())
            picked.append(token)
            rows = model(input_ids=torch.tensor([[token]]),
                         position_ids=torch.tensor([[position]]), cache=cache,
                         use_cache=True).logits[0]
            position += 1
    assert list(result.token_ids) == picked


def test_an_exact_request_is_the_same_with_and_without_an_adapter(setup):
    llm, _, _, _ = setup
    plain = _engine(tiny_llama(0, VOCAB), exact_reuse=False)
    prompt = rag_prompt("s", [2, 0], QUESTION)
    with_seam = llm.prefill(prompt, recompute="exact", all_logits=True)
    without = plain.prefill(prompt, recompute="exact", all_logits=True)
    assert torch.equal(with_seam.logits, without.logits)
    assert len(with_seam.recompute) > 0               # the exact path did recompute


def test_a_batch_step_runs_a_tuned_request_on_its_own(setup):
    llm, _, _, _ = setup
    prompts = [rag_prompt("s", [0, 1], QUESTION), rag_prompt("s", [2, 3], QUESTION)]
    alone = [llm.generate(p, recompute=policy, max_new_tokens=4, temperature=0.0,
                          token_healing=False).token_ids
             for p, policy in zip(prompts, ("tuned", "none"))]
    decoders = []
    firsts = []
    for p, policy in zip(prompts, ("tuned", "none")):
        opened = llm.open(p, recompute=policy, add_generation_prompt=False)
        model = llm.adapter if opened.model is None else opened.model
        decoding = Decoding(SamplingParams(max_new_tokens=4, temperature=0.0), llm.tokenizer)
        decoders.append(Decoder(model, opened.buffer, decoding, opened.position))
        firsts.append(opened.logits)
    picked = [[], []]
    for index, token, _, _ in steps_together(decoders, firsts):
        if token is not None:
            picked[index].append(token)
    assert [tuple(p) for p in picked] == [tuple(a) for a in alone]


def test_tuned_without_an_adapter_says_how_to_make_one():
    llm = _engine(tiny_llama(0, VOCAB))
    with pytest.raises(ConfigError, match="promptlang tune"):
        llm.prefill(rag_prompt("s", [0], QUESTION), recompute="tuned")


def test_an_adapter_tuned_for_another_model_is_refused(tmp_path):
    llm = _engine(tiny_llama(0, VOCAB))
    other = tiny_llama(1, VOCAB)
    adapter = SeamLoRA(shape_of(plain_copy(other)), seed=0)
    path = tmp_path / ADAPTER_FILE
    adapter.save(path, {"model_fingerprint": "someone-else"})
    with pytest.raises(AdapterFileError, match="tuned for model 'someone-else'"):
        llm.use_seam_adapter(path)
    assert llm.seam is None


def test_the_home_s_adapter_is_found_before_the_shipped_one(tmp_path, monkeypatch):
    fingerprint = "0123456789abcdef" * 4
    home = tmp_path / "home" / "adapters"
    shipped = tmp_path / "shipped"
    monkeypatch.setenv("PROMPTLANG_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(seam_mod, "SHIPPED", shipped)
    assert find_seam_adapter(fingerprint) is None
    (shipped / fingerprint[:16]).mkdir(parents=True)
    (shipped / fingerprint[:16] / ADAPTER_FILE).write_bytes(b"shipped")
    assert find_seam_adapter(fingerprint) == shipped / fingerprint[:16] / ADAPTER_FILE
    (home / fingerprint[:16]).mkdir(parents=True, mode=0o700)
    home.chmod(0o700)
    mine = home / fingerprint[:16] / ADAPTER_FILE
    mine.write_bytes(b"mine")
    mine.chmod(0o600)
    assert find_seam_adapter(fingerprint) == mine
    mine.chmod(0o666)                      # others may write it: not loaded, the shipped one is
    assert find_seam_adapter(fingerprint) == shipped / fingerprint[:16] / ADAPTER_FILE
    assert os.path.exists(mine)


def test_the_rag_workload_times_promptlang_under_the_policy_it_is_given(setup):
    from dataclasses import replace

    from promptlang.bench.rag import RagOptions, run_rag

    llm, _, _, _ = setup
    report = run_rag(llm, replace(RagOptions.quick(), recompute="tuned"), progress=False)
    assert report.samples and all(s.promptlang > 0 for s in report.samples)
    bare = _engine(tiny_llama(0, VOCAB))
    with pytest.raises(ConfigError, match="promptlang tune"):
        run_rag(bare, replace(RagOptions.quick(), recompute="tuned"), progress=False)


@pytest.mark.skipif(not compute.cpu_bf16_units(), reason="no bfloat16 matrix units")
def test_tuned_passes_stay_float32_beside_bfloat16_compute(tmp_path):
    """The seam adapter's weights are folded into the float32 model only: its passes never
    take the bfloat16 twin, so they serve what they serve without it."""
    base = tiny_llama(0, VOCAB)
    adapter = _trained_like(SeamLoRA(shape_of(plain_copy(base), rank=4, alpha=8.0), seed=1))
    plain = _engine(base, recompute="none", exact_reuse=False)
    path = _adapter_file(tmp_path, plain, adapter)
    plain.use_seam_adapter(path)
    prompt = rag_prompt("s", [0, 2, 3], QUESTION)
    expected = plain.prefill(prompt, recompute="tuned", all_logits=True)
    twin = _engine(tiny_llama(0, VOCAB), recompute="none", exact_reuse=False)
    compute.attach_bf16(twin.adapter, min_rows=1)
    twin = LLM(twin.adapter, twin.tokenizer, ModuleStore(), recompute="none", exact_reuse=False)
    twin.add_schema(rag_schema("s", "answer from the notes", "notes:\n\n", TEXTS))
    twin.use_seam_adapter(path)
    # the units are the twin's (bfloat16) KV; the tail runs float32 with the adapter
    served = twin.prefill(prompt, recompute="tuned", all_logits=True)
    tail = len(served.token_ids) - served.cached_length
    assert served.logits.dtype == torch.float32
    bf16_units = twin.prefill(prompt, recompute="none", all_logits=True)
    assert not torch.allclose(served.logits[-tail:], bf16_units.logits[-tail:], atol=1e-2)
    # against the float32 engine, only the units' bfloat16 rounding differs
    assert torch.allclose(served.logits[-tail:], expected.logits[-tail:], atol=0.1)


def test_a_model_without_an_adapter_says_how_to_tune_one_once_per_home(tmp_path, monkeypatch,
                                                                       capsys):
    from promptlang.cli.tune import hint_when_untuned

    monkeypatch.setenv("PROMPTLANG_HOME", str(tmp_path / "home"))
    llm = _engine(tiny_llama(3, VOCAB))
    assert llm.seam is None
    hint_when_untuned(llm, "my-model.gguf")
    err = capsys.readouterr().err
    assert "no seam adapter" in err and "`promptlang tune --model my-model.gguf`" in err
    marker = (tmp_path / "home" / "adapters" / llm.adapter.weights_fingerprint[:16]
              / seam_mod.HINT_MARKER)
    assert marker.exists() and marker.stat().st_mode & 0o077 == 0       # private
    hint_when_untuned(llm, "my-model.gguf")
    assert capsys.readouterr().err == ""                                 # said once
    assert find_seam_adapter(llm.adapter.weights_fingerprint) is None    # still none


def test_a_model_with_an_adapter_gets_no_hint(tmp_path, monkeypatch, capsys):
    from promptlang.cli.tune import hint_when_untuned

    monkeypatch.setenv("PROMPTLANG_HOME", str(tmp_path / "home"))
    base = tiny_llama(3, VOCAB)
    llm = _engine(base)
    llm.use_seam_adapter(_adapter_file(tmp_path, llm, SeamLoRA(shape_of(plain_copy(base)),
                                                              seed=0)))
    hint_when_untuned(llm, None)
    assert capsys.readouterr().err == ""
    assert not (tmp_path / "home" / "adapters").exists()


def test_an_unwritable_home_leaves_the_hint_out(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.write_text("a file where the home folder should be")
    monkeypatch.setenv("PROMPTLANG_HOME", str(home))
    assert seam_mod.tune_hint_once("ab" * 32, "m") is None
