"""The seam adapter (runtime/tune/): its math against plain PyTorch, the student against the
runtime's own `none` prefill, and `tune` end to end on a tiny random model."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import torch

from promptlang.runtime.engine import LLM
from promptlang.runtime.store import ModuleStore
from promptlang.runtime.tune import corpus
from promptlang.runtime.model.lora import AdapterFileError, SeamLoRA, attached, shape_of
from promptlang.runtime.tune.samples import (kl_per_row, make_sample, rag_prompt, rag_schema,
                                             student_logprobs)
from promptlang.runtime.tune.train import (Replay, TuneOptions, _draw, plain_copy, tune,
                                           weighted_kl)

from .tiny import Words, tiny_llama

VOCAB = 1000
TEXTS = ["the red boat sails at dawn from the north pier with nine crew",
         "a baker in the old town sells rye bread every tuesday morning",
         "the clock museum opened in spring and shows forty clocks",
         "our choir sings on sundays and practises in the east hall"]


def _trained_like(adapter: SeamLoRA, seed: int = 3) -> SeamLoRA:
    """Nonzero B everywhere (a fresh adapter's B is zero and changes nothing), and link
    tokens' keys and values of a trained size where it has them."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in adapter.b:
            for b in layer.values():
                b.copy_(torch.randn(b.shape, generator=generator) * 0.05)
        if adapter.link_keys is not None:
            adapter.link_keys.copy_(torch.randn(adapter.link_keys.shape, generator=generator))
            adapter.link_values.copy_(torch.randn(adapter.link_values.shape,
                                                  generator=generator))
    return adapter


def _engine(model) -> LLM:
    return LLM.from_model(model, Words(VOCAB, bos=True), store=ModuleStore(),
                          recompute="none", exact_reuse=False)


def _baker_sample():
    """A plain copy of a tiny model and one combination's sample (documents 1 and 3)."""
    base = tiny_llama(0, VOCAB)
    llm = _engine(base)
    model = plain_copy(base)
    llm.add_schema(rag_schema("s", "answer from the notes", "notes:\n\n", TEXTS))
    sample = make_sample(llm, model, rag_prompt("s", [1, 3], "what does the baker sell?"),
                         answer_tokens=4, end_ids={2})
    return model, sample


def test_the_adapter_adds_scale_b_a_x_to_each_projection_as_plain_pytorch_computes_it():
    model = plain_copy(tiny_llama(0, VOCAB))
    adapter = _trained_like(SeamLoRA(shape_of(model, rank=4, alpha=8.0), seed=1))
    ids = torch.tensor([[5, 17, 99, 3, 42]])
    # reference: the same model with W + (alpha / rank) B A written into its weights
    reference = plain_copy(model)
    with torch.no_grad():
        for index, layer in enumerate(reference.model.layers):
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                linear = getattr(layer.self_attn, name)
                a = adapter.a[index][name]
                b = adapter.b[index][name]
                linear.weight += (b @ a) * (8.0 / 4)
    with attached(model, adapter):
        got = model(input_ids=ids).logits
    expected = reference(input_ids=ids).logits
    assert torch.allclose(got, expected, atol=1e-5)
    # outside the context the model is the base model again
    assert not torch.allclose(model(input_ids=ids).logits, expected, atol=1e-3)


def test_a_fresh_adapter_changes_nothing_and_a_saved_one_loads_the_same(tmp_path):
    model = plain_copy(tiny_llama(0, VOCAB))
    ids = torch.tensor([[5, 17, 99]])
    fresh = SeamLoRA(shape_of(model), seed=2)
    base = model(input_ids=ids).logits
    with attached(model, fresh):
        assert torch.allclose(model(input_ids=ids).logits, base, atol=0)
    trained = _trained_like(SeamLoRA(shape_of(model), seed=2))
    trained.save(tmp_path / "a.safetensors", {"model_fingerprint": "x"})
    loaded, meta = SeamLoRA.load(tmp_path / "a.safetensors")
    assert meta["model_fingerprint"] == "x"
    with attached(model, trained):
        want = model(input_ids=ids).logits
    with attached(model, loaded):
        assert torch.equal(model(input_ids=ids).logits, want)


def test_link_keys_are_rotated_as_transformers_rotates_a_key_at_that_position():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = plain_copy(tiny_llama(0, VOCAB))
    adapter = _trained_like(SeamLoRA(shape_of(model, link_tokens=3), seed=1))
    assert adapter.link_keys.shape == (2, 2, 3, 16)         # layers, KV heads, T, head size
    keys, values = adapter.link_kv(model, 37)
    ids = torch.full((1, 3), 37)
    cos, sin = model.model.rotary_emb(torch.zeros(1), ids)
    raw = adapter.link_keys.detach()
    _, expected = apply_rotary_pos_emb(raw, raw, cos, sin)    # [L, H, T, D]; cos [1, T, D]
    assert torch.allclose(keys.detach(), expected, atol=1e-6)
    assert torch.equal(values.detach(), adapter.link_values.detach())
    # another position, other keys: the rotation is not the identity
    assert not torch.allclose(adapter.link_kv(model, 38)[0].detach(), keys.detach(), atol=1e-3)


def test_link_tokens_save_load_and_reach_the_student_with_gradients(tmp_path):
    model, sample = _baker_sample()
    adapter = _trained_like(SeamLoRA(shape_of(model, link_tokens=4), seed=5))
    adapter.save(tmp_path / "a.safetensors", {"model_fingerprint": "x"})
    loaded, _ = SeamLoRA.load(tmp_path / "a.safetensors")
    assert loaded.shape == adapter.shape
    assert torch.equal(loaded.link_keys, adapter.link_keys)
    assert torch.equal(loaded.link_values, adapter.link_values)
    with torch.no_grad():
        for layer in adapter.b:                # the LoRA off: only the link tokens act
            for b in layer.values():
                b.zero_()
    student = student_logprobs(model, sample, adapter)
    none = student_logprobs(model, sample, None)
    assert not torch.allclose(student, none, atol=1e-3)
    student[0].sum().backward()
    assert float(adapter.link_values.grad.abs().sum()) > 0
    assert float(adapter.link_keys.grad.abs().sum()) > 0


def test_an_adapter_file_without_link_tokens_loads_with_none(tmp_path):
    model = plain_copy(tiny_llama(0, VOCAB))
    SeamLoRA(shape_of(model), seed=2).save(tmp_path / "a.safetensors", {})
    loaded, _ = SeamLoRA.load(tmp_path / "a.safetensors")
    assert loaded.shape.link_tokens == 0 and loaded.link_keys is None
    with pytest.raises(AdapterFileError, match="no link tokens"):
        loaded.link_kv(model, 3)


def test_a_file_that_is_not_an_adapter_is_a_clear_error(tmp_path):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(b"not a safetensors file")
    with pytest.raises(AdapterFileError, match="bad.safetensors"):
        SeamLoRA.load(path)


def test_the_student_without_adapter_is_the_runtime_s_none_prefill():
    base = tiny_llama(0, VOCAB)
    llm = _engine(base)
    model = plain_copy(base)
    llm.add_schema(rag_schema("s", "answer from the notes", "notes:\n\n", TEXTS))
    prompt = rag_prompt("s", [0, 2, 3], "Question: when does the choir sing?")
    sample = make_sample(llm, model, prompt, answer_tokens=4, end_ids={2})
    served = llm.prefill(prompt, recompute="none", all_logits=True)
    student = student_logprobs(model, sample, None)
    tail = len(served.token_ids) - served.cached_length
    expected = torch.log_softmax(served.logits[-tail:], dim=-1)
    assert torch.allclose(student[:tail], expected, atol=1e-4)
    # the teacher is the plain prompt's own prefill: its first rows are the baseline's
    plain = llm.prefill(prompt, baseline=True, all_logits=True)
    assert torch.allclose(sample.teacher[:tail], torch.log_softmax(plain.logits[-tail:], dim=-1),
                          atol=1e-4)
    # and documents encoded apart make the two differ: there is a gap to learn
    assert float(kl_per_row(sample.teacher, student).mean()) > 1e-4


def test_training_steps_lower_the_kl_of_the_sample_they_train_on():
    model, sample = _baker_sample()
    adapter = SeamLoRA(shape_of(model), seed=0)
    optimizer = torch.optim.AdamW(adapter.parameters(), lr=3e-3)
    losses = []
    for _ in range(12):
        loss = kl_per_row(sample.teacher, student_logprobs(model, sample, adapter)).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.5 * losses[0]


def test_the_loss_weighs_the_rows_that_predict_the_answer():
    """Rows: the question's, then the one after the prompt (predicts answer token 1), then
    each answer token's but the last (predicts the next), then the last one's."""
    from promptlang.runtime.tune.samples import Sample

    generator = torch.Generator().manual_seed(0)
    teacher = torch.log_softmax(torch.randn(7, 11, generator=generator), dim=-1)
    student = torch.log_softmax(torch.randn(7, 11, generator=generator), dim=-1)
    sample = Sample(cached_keys=torch.zeros(1), cached_values=torch.zeros(1),
                    ids=torch.arange(7), positions=torch.arange(7), teacher=teacher,
                    answer_length=3)                  # ids 4, 5, 6: the answer
    rows = [float((teacher[r].exp() * (teacher[r] - student[r])).sum()) for r in range(7)]
    weights = [1, 1, 1, 5, 5, 5, 1]                   # rows 3, 4, 5 predict ids 4, 5, 6
    expected = sum(w * r for w, r in zip(weights, rows)) / sum(weights)
    got = weighted_kl(sample=sample, student=student, answer_weight=5.0)
    assert abs(float(got) - expected) < 1e-5
    plain = weighted_kl(sample=sample, student=student, answer_weight=1.0)
    assert abs(float(plain) - sum(rows) / 7) < 1e-5


def test_replay_draws_distinct_recent_samples():
    replay = Replay(3, random.Random(0))
    assert replay.draw(2) == []
    for n in range(5):
        replay.add(n)
    assert replay.samples == [2, 3, 4]
    drawn = replay.draw(2)
    assert len(set(drawn)) == 2 and set(drawn) <= {2, 3, 4}
    assert sorted(replay.draw(9)) == [2, 3, 4]
    off = Replay(0, random.Random(0))
    off.add(1)
    assert off.draw(3) == []


def test_tune_runs_end_to_end_writes_its_files_and_resumes(tmp_path):
    llm = _engine(tiny_llama(0, VOCAB))
    options = TuneOptions(minutes=5, max_steps=3, written_docs=16, doc_tokens=12,
                          schema_docs=4, docs_per_request=(2,), answer_tokens=3, held_out=2)
    said = []
    report = tune(llm, tmp_path / "adapter", options, say=said.append)
    assert report.steps == 3
    assert report.adapter_path.exists()
    for name in ("corpus.json", "tune-log.jsonl", "checkpoint.pt", "seam-lora.safetensors"):
        assert (tmp_path / "adapter" / name).stat().st_mode & 0o077 == 0, name   # private
    _, meta = SeamLoRA.load(report.adapter_path)
    assert meta["model_fingerprint"] == llm.adapter.fingerprint
    assert report.evaluation.kl_before > 0
    resumed = tune(llm, tmp_path / "adapter",
                   TuneOptions(**{**options.__dict__, "max_steps": 6, "resume": True,
                                  "replay": 1, "answer_weight": 2.0}),
                   say=said.append)
    assert resumed.steps == 6
    assert any("resumed at step 3" in line for line in said)
    steps = [json.loads(line) for line in
             (tmp_path / "adapter" / "tune-log.jsonl").read_text().splitlines()
             if '"step"' in line]
    # a resumed run's replay starts empty: steps 4 and 5 new samples, 6 step 5's again
    assert [(s["step"], s["replayed"]) for s in steps[-3:]] == [(4, False), (5, False),
                                                                (6, True)]


def test_tune_with_link_tokens_trains_them_at_their_own_rate(tmp_path):
    llm = _engine(tiny_llama(0, VOCAB))
    options = TuneOptions(minutes=5, max_steps=3, written_docs=16, doc_tokens=12,
                          schema_docs=4, docs_per_request=(2,), answer_tokens=3, held_out=2,
                          link_tokens=2, link_lr=0.05)
    report = tune(llm, tmp_path / "adapter", options, say=lambda line: None)
    loaded, meta = SeamLoRA.load(report.adapter_path)
    assert loaded.shape.link_tokens == 2
    assert json.loads(meta["options"])["link_tokens"] == 2
    # three Adam steps at 0.05 moved the values off zero by about that much each
    assert 0.02 < float(loaded.link_values.detach().abs().max()) < 0.2


def test_tune_with_an_adapter_that_encodes_trains_through_the_modules(tmp_path):
    llm = _engine(tiny_llama(0, VOCAB))
    options = _short_run(encodes=True)
    report = tune(llm, tmp_path / "adapter", options, say=lambda line: None)
    assert report.steps == 2
    loaded, meta = SeamLoRA.load(report.adapter_path)
    assert loaded.shape.encodes
    assert json.loads(meta["options"])["encodes"] is True
    # the evaluation's student with the adapter encodes the modules again: it moved
    assert report.evaluation.kl_after != report.evaluation.kl_before


def test_an_adapter_that_encodes_takes_no_link_tokens_and_saves_its_form(tmp_path):
    model = plain_copy(tiny_llama(0, VOCAB))
    with pytest.raises(AdapterFileError, match="no link tokens"):
        SeamLoRA(shape_of(model, rank=2, link_tokens=2, encodes=True))
    adapter = SeamLoRA(shape_of(model, rank=2, encodes=True))
    adapter.save(tmp_path / "a.safetensors", {})
    loaded, _ = SeamLoRA.load(tmp_path / "a.safetensors")
    assert loaded.shape.encodes
    plain = SeamLoRA(shape_of(model, rank=2))
    plain.save(tmp_path / "b.safetensors", {})
    assert not SeamLoRA.load(tmp_path / "b.safetensors")[0].shape.encodes


def test_a_quoted_sentence_is_asked_by_its_first_words():
    text = "Short one. The ferry leaves the north pier at seven each morning. Ok."
    request, sentence = corpus.quote(random.Random(0), text)
    assert sentence == "The ferry leaves the north pier at seven each morning."
    assert '"The ferry leaves the"' in request
    assert corpus.quote(random.Random(0), "Too short. Also short here.") is None


def test_the_teacher_reads_a_given_answer_as_it_wrote_its_own():
    from promptlang.runtime.tune.samples import _teacher, _teacher_reading

    model = plain_copy(tiny_llama(0, VOCAB))
    plain = torch.tensor([1, 5, 9, 14, 3, 22, 7, 11])
    rows, answer = _teacher(model, plain, 3, answer_tokens=4, end_ids=set())
    assert len(answer) == 4
    assert torch.allclose(_teacher_reading(model, plain, 3, answer), rows, atol=1e-5)


def _short_run(**changes) -> TuneOptions:
    """Two steps on a small corpus, with `changes`."""
    return TuneOptions(**{**dict(minutes=5, max_steps=2, written_docs=16, doc_tokens=12,
                                 schema_docs=4, docs_per_request=(2,), answer_tokens=3,
                                 held_out=2), **changes})


def test_tune_quoting_rounds_train_on_the_documents_own_sentences(tmp_path):
    llm = _engine(tiny_llama(0, VOCAB))
    options = _short_run(doc_tokens=40, answer_tokens=6, quote=1.0)
    report = tune(llm, tmp_path / "adapter", options, say=lambda line: None)
    assert report.steps == 2
    lines = [json.loads(line) for line in
             (tmp_path / "adapter" / "tune-log.jsonl").read_text().splitlines()
             if '"loss"' in line]
    assert len(lines) == 2 and all("quoted" in line for line in lines)


def test_the_corpus_shares_no_eight_words_with_the_benchmark_items():
    """Tuning data must be disjoint from every evaluation item: tune's word lists and
    phrasings against the bench's item templates (bench/qa.py, bench/qa_kinds.py)."""
    root = Path(__file__).resolve().parents[2] / "bench"
    bench_words = re.findall(r"[a-z]+", " ".join(
        (root / name).read_text().lower() for name in ("qa.py", "qa_kinds.py")))
    grams = {tuple(bench_words[i:i + 8]) for i in range(len(bench_words) - 7)}
    ours = " ".join(corpus.PLACES + corpus.THINGS + corpus.ASPECTS + corpus.SYSTEMS
                    + corpus.LABELS + corpus.QUESTION_FORMS + corpus.QUOTE_FORMS)
    ours += " " + " ".join(corpus.subjects(random.Random(0), 50))
    for field in corpus.RECORD_FIELDS:
        ours += " " + " ".join(field.phrasings) + " " + field.question
    ours += " " + " ".join(corpus.MANAGERS)
    words = re.findall(r"[a-z]+", ours.lower())
    assert not [words[i:i + 8] for i in range(len(words) - 7) if tuple(words[i:i + 8]) in grams]


def test_same_shaped_records_differ_only_in_their_names_and_facts():
    filler = ("The pier is long. Boats leave at six! Fish is sold in the hall.\n\n"
              "Prices change daily?")
    for seed in range(20):
        records = corpus.same_shape_group(random.Random(seed), filler, 5)
        assert len({r.text for r in records}) == 5
        shapes = set()
        for record in records:
            subject = re.match(r"About (the \w+ [\w ]+?)\. ", record.text).group(1)
            assert all(subject in q and q.endswith("?") for q in record.questions)
            assert 2 <= len(record.questions) <= 3
            shape = re.sub(re.escape(subject), "S", record.text, flags=re.IGNORECASE)
            shape = re.sub(r"\b(\d+|" + "|".join(corpus.MANAGERS + corpus.WEEKDAYS) + r")\b",
                           "V", shape)
            shapes.add(shape)
            assert all(s in record.text for s in ("The pier is long.", "Boats leave at six!",
                                                  "Fish is sold in the hall.",
                                                  "Prices change daily?"))
        assert len(shapes) == 1, shapes          # one template, only names and values differ


def test_tune_names_are_not_the_benchmark_s_names():
    from promptlang.bench import qa

    bench = {n.lower() for n in qa.FEMALE_NAMES + qa.MALE_NAMES + qa.SURNAMES + qa.CITIES}
    ours = {w.lower() for m in corpus.MANAGERS for w in m.split()}
    ours |= {(h + t).lower() for h in corpus.NAME_HEADS for t in corpus.NAME_TAILS}
    assert not ours & bench


def test_tune_on_same_shaped_records_measures_them_apart(tmp_path):
    llm = _engine(tiny_llama(0, VOCAB))
    options = _short_run(same_shape=1.0)
    report = tune(llm, tmp_path / "adapter", options, say=lambda line: None)
    assert report.steps == 2
    shaped = report.same_shape_evaluation
    assert shaped is not None and shaped.kl_before > 0
    assert shaped.kl_before != report.evaluation.kl_before
    lines = [json.loads(line) for line in
             (tmp_path / "adapter" / "tune-log.jsonl").read_text().splitlines()]
    assert [line["records"] for line in lines if "step" in line and "loss" in line] == [True,
                                                                                        True]
    assert lines[-1]["same_shape_evaluation"]["kl_before"] == shaped.kl_before
    _, meta = SeamLoRA.load(report.adapter_path)
    assert json.loads(meta["same_shape_evaluation"])["kl_after"] == shaped.kl_after


def _drawing():
    """An engine, a plain copy of its model, TEXTS as documents and options that draw two of
    them from a schema of all four."""
    base = tiny_llama(0, VOCAB)
    docs = [corpus.Document(text, "what is in the notes?", "user") for text in TEXTS]
    return (_engine(base), plain_copy(base), docs,
            _short_run(schema_docs=len(TEXTS), docs_per_request=(2,)))


def test_a_gapless_draw_is_the_same_request_at_positions_without_gaps():
    """The same seed draws the same documents, question and answer; without the left-out
    documents in the schema the request's positions run 0..N-1, where the drawn one has a
    gap; the teacher (the plain prompt's full prefill) is the same for both."""
    llm, model, docs, options = _drawing()
    for seed in range(4):
        drawn = _draw(llm, model, docs, random.Random(seed), options, set(), f"g{seed}")
        gapless = _draw(llm, model, docs, random.Random(seed), options, set(), f"h{seed}",
                        gapless=True)
        assert gapless.gapless and not drawn.gapless
        assert torch.equal(gapless.ids, drawn.ids)
        assert torch.equal(gapless.cached_ids, drawn.cached_ids)
        assert torch.allclose(gapless.teacher, drawn.teacher, atol=1e-5)
        every = torch.cat([gapless.cached_positions, gapless.positions])
        assert torch.equal(every, torch.arange(len(every)))
        gapped = torch.cat([drawn.cached_positions, drawn.positions])
        if not torch.equal(gapped, torch.arange(len(gapped))):
            break
    else:
        pytest.fail("no draw left a gap: the comparison tested nothing")


def test_a_round_with_gaps_trains_its_tail_after_them_unless_asked_as_served():
    """A draw that leaves a document out after its last imported one: served (the held-out
    sets, `--tail-as-served`) its tokens after the documents follow the last imported one;
    otherwise (training's default) they sit at the layout's positions, after the gap, as
    `none` serves them; the tokens, cached KV and teacher are the same."""
    llm, model, docs, options = _drawing()
    for seed in range(8):
        served = _draw(llm, model, docs, random.Random(seed), options, set(), f"s{seed}")
        far = _draw(llm, model, docs, random.Random(seed), options, set(), f"f{seed}",
                    served=False)
        assert torch.equal(served.ids, far.ids)
        assert torch.equal(served.cached_positions, far.cached_positions)
        assert torch.equal(served.teacher, far.teacher)
        last = int(served.cached_positions.max())
        assert int(served.positions[0]) == last + 1
        if int(far.positions[0]) > last + 1:
            shift = int(far.positions[0]) - last - 1
            assert torch.equal(far.positions, served.positions + shift)
            break
    else:
        pytest.fail("no draw left a document out after its last one: nothing tested")


def test_tune_trains_rounds_with_gaps_as_asked(tmp_path, monkeypatch):
    from promptlang.runtime.tune import train as train_mod
    seen = []
    make = train_mod.make_sample

    def recording(*args, close_tail=True, **kwargs):
        seen.append(close_tail)
        return make(*args, close_tail=close_tail, **kwargs)

    monkeypatch.setattr(train_mod, "make_sample", recording)
    llm = _engine(tiny_llama(0, VOCAB))
    for as_served in (False, True):
        seen.clear()
        options = _short_run(held_out=2, tail_as_served=as_served)
        tune(llm, tmp_path / f"adapter-{as_served}", options, say=lambda line: None)
        held_out = options.held_out
        assert seen[:held_out] == [True] * held_out         # the held-out sets: as served
        assert seen[held_out:] and set(seen[held_out:]) == {as_served}


def test_tune_without_gaps_measures_those_combinations_apart(tmp_path):
    llm = _engine(tiny_llama(0, VOCAB))
    report = tune(llm, tmp_path / "adapter", _short_run(gapless=1.0), say=lambda line: None)
    assert report.steps == 2
    gapless = report.gapless_evaluation
    assert gapless is not None and gapless.kl_before > 0
    assert report.same_shape_evaluation is None
    lines = [json.loads(line) for line in
             (tmp_path / "adapter" / "tune-log.jsonl").read_text().splitlines()]
    assert [line["gapless"] for line in lines if "loss" in line] == [True, True]
    assert lines[-1]["gapless_evaluation"]["kl_after"] == gapless.kl_after
    _, meta = SeamLoRA.load(report.adapter_path)
    assert json.loads(meta["gapless_evaluation"])["kl_before"] == gapless.kl_before


def test_tune_keeps_its_combinations_out_of_the_kv_cache(tmp_path, monkeypatch):
    """Every round's schema is new and thrown away: none of its KV reaches the home's disk
    tier (a 45-minute run would write tens of GB there)."""
    monkeypatch.setenv("PROMPTLANG_HOME", str(tmp_path / "home"))
    llm = LLM.from_model(tiny_llama(0, VOCAB), Words(VOCAB, bos=True),
                         store=ModuleStore(disk_budget_bytes=0), recompute="none",
                         exact_reuse=False)
    report = tune(llm, tmp_path / "adapter", _short_run(), say=lambda line: None)
    assert report.steps == 2
    kv = tmp_path / "home" / "kv"
    assert not kv.exists() or not any(kv.rglob("*.safetensors"))


def test_a_full_disk_ends_tune_with_one_line_and_keeps_the_checkpoint(tmp_path, monkeypatch,
                                                                      capsys):
    from promptlang.cli import main
    from promptlang.runtime import engine
    from promptlang.runtime.tune import train as train_mod

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device", str(tmp_path / "out" / "checkpoint.pt"))

    monkeypatch.setattr(engine, "load", lambda model=None: _engine(tiny_llama(0, VOCAB)))
    monkeypatch.setattr(train_mod, "tune", full)
    assert main(["tune", "--minutes", "1", "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "checkpoint.pt: No space left on device" in err
    assert "--resume" in err and "Traceback" not in err


def test_cache_ls_lists_the_adapters_tune_wrote(tmp_path, monkeypatch, capsys):
    from promptlang.cli import main

    monkeypatch.setenv("PROMPTLANG_HOME", str(tmp_path))
    model = plain_copy(tiny_llama(0, VOCAB))
    folder = tmp_path / "adapters" / "0123456789abcdef"
    folder.mkdir(parents=True)
    SeamLoRA(shape_of(model)).save(folder / "seam-lora.safetensors",
                                   {"model_fingerprint": "f" * 64, "steps": "7",
                                    "minutes": "1.5"})
    assert main(["cache", "ls"]) == 0
    out = capsys.readouterr().out
    assert "seam adapters:" in out
    assert "0123456789abcdef  model ffffffffffffffff  LoRA rank 8  7 steps, 1.5 min" in out
    linked = tmp_path / "adapters" / "fedcba9876543210"
    linked.mkdir(parents=True)
    SeamLoRA(shape_of(model, rank=4, link_tokens=16)).save(linked / "seam-lora.safetensors",
                                                           {"steps": "3"})
    assert main(["cache", "ls"]) == 0
    assert "fedcba9876543210  model ?  LoRA rank 4 + 16 link tokens  3 steps" in \
        capsys.readouterr().out
