"""The engine end to end on a tiny model: persistence, invalidation, corruption, eviction,
threads, streaming and stop strings."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from promptlang.pml.parser import parse_prompt, parse_schema
from promptlang.runtime.engine import LLM
from promptlang.runtime.store import CacheWarning, ModuleStore
from promptlang.tokenizer import WordTokenizer
from .tiny import tiny_llama

VOCAB = 1000

SCHEMA = """\
<schema name="docs">
  <system>You answer questions about the documents.</system>
  <module name="intro">An introduction of several words here.</module>
  <module name="guide">The guide covers <param name="topic" len="3"/> in depth.
    <module name="chapter">A chapter nested inside the guide.</module>
  </module>
  <union>
    <module name="short">Short answer style.</module>
    <module name="long">Long and detailed answer style please.</module>
  </union>
  <module name="appendix">The appendix is the last module.</module>
  <user>
</schema>
"""

PROMPTS = [
    '<prompt schema="docs"><intro/>What is this?</user></prompt>',
    '<prompt schema="docs"><guide topic="parsing"><chapter/></guide><short/>'
    'Explain.</user></prompt>',
    '<prompt schema="docs"><long/><appendix/>Summarise the appendix.</user></prompt>',
    '<prompt schema="docs"><intro/><guide topic="caching KV"/>How?</user></prompt>',
    '<prompt schema="docs"><appendix/></prompt>',
]
UNITS = 7   # root, intro, guide, chapter, short, long, appendix


@pytest.fixture(scope="module")
def model():
    return tiny_llama(7, VOCAB)


def make_llm(model, disk_dir, **store_args) -> LLM:
    """Recompute "none": the counts below are those of units served as encoded (the
    default policy, exact, is test_recompute.py's)."""
    llm = LLM.from_model(model, WordTokenizer(VOCAB, bos=True),
                         store=ModuleStore(disk_dir=disk_dir, **store_args), recompute="none")
    llm.add_schema(SCHEMA)
    return llm


def answers(llm, prompts=PROMPTS, **kwargs):
    return [llm.generate(p, max_new_tokens=6, **kwargs).token_ids for p in prompts]


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory):
    """Single-thread answers with an unlimited store."""
    return answers(make_llm(model, tmp_path_factory.mktemp("ref")))


def test_a_fresh_store_on_the_same_disk_serves_without_re_encoding(model, tmp_path, reference):
    first = make_llm(model, tmp_path)
    assert first.encode(SCHEMA) == UNITS
    assert first.encode(SCHEMA) == 0
    second = make_llm(model, tmp_path)            # a new store instance: nothing in memory
    assert answers(second) == reference
    assert second.encoder_calls == 0
    assert second.store.stats.disk_hits > 0


def test_requests_encode_only_the_units_they_use(model, tmp_path):
    llm = make_llm(model, tmp_path)
    result = llm.generate(PROMPTS[0], max_new_tokens=2)
    assert llm.encoder_calls == 2                 # the root and intro, nothing else
    bound = llm.bind(PROMPTS[0])
    # "What is this?[/user]" and the generation prompt "[assistant]"
    assert result.prefill_tokens == bound.uncached_token_count == 5
    assert result.cached_tokens == bound.cached_token_count
    llm.generate(PROMPTS[0], max_new_tokens=2)
    assert llm.encoder_calls == 2


def test_editing_the_last_module_re_encodes_only_that_module(model, tmp_path):
    llm = make_llm(model, tmp_path)
    llm.encode(SCHEMA)
    edited = SCHEMA.replace("The appendix is the last module.", "The appendix is the final part.")
    assert llm.encode(edited) == 1
    assert set(list(llm.encoder.encoded)[-1:]) == {llm.encoder.key(llm.layout("docs"), "module:appendix")}


def test_a_longer_last_module_re_encodes_it_and_the_text_it_moves_only(model, tmp_path):
    llm = make_llm(model, tmp_path)
    llm.encode(SCHEMA)
    longer = SCHEMA.replace("The appendix is the last module.",
                            "The appendix grew much longer than it was.")
    assert llm.encode(longer) == 2           # the appendix, and the root whose <user> moved
    layout = llm.layout("docs")
    assert set(list(llm.encoder.encoded)[-2:]) == {llm.encoder.key(layout, "module:appendix"),
                                             llm.encoder.key(layout, "module:")}


def test_editing_a_parent_re_encodes_its_children_not_its_siblings(model, tmp_path):
    llm = make_llm(model, tmp_path)
    llm.encode(SCHEMA)
    assert llm.encode(SCHEMA.replace("The guide covers", "This guide covers")) == 2


def test_edited_schema_serves_the_new_text(model, tmp_path):
    llm = make_llm(model, tmp_path)
    before = llm.generate(PROMPTS[2], max_new_tokens=4)
    llm.add_schema(SCHEMA.replace("The appendix is the last module.", "Totally different."))
    after = llm.generate(PROMPTS[2], max_new_tokens=4)
    baseline = llm.generate(PROMPTS[2], max_new_tokens=4, baseline=True)
    assert llm.bind(PROMPTS[2]).render().count("Totally different.") == 1
    assert after.cached_tokens != before.cached_tokens
    assert baseline.prefill_tokens == after.cached_tokens + after.prefill_tokens


def test_a_corrupted_store_file_is_detected_and_re_encoded(model, tmp_path, reference):
    make_llm(model, tmp_path).encode(SCHEMA)
    files = sorted(tmp_path.glob("*.safetensors"))
    assert len(files) == UNITS
    victim = files[3]
    data = bytearray(victim.read_bytes())
    data[-20] ^= 0xFF                               # one flipped byte in the tensor data
    victim.write_bytes(bytes(data))

    fresh = make_llm(model, tmp_path)
    with pytest.warns(CacheWarning):
        fresh.encode(SCHEMA)
    assert fresh.encoder_calls == 1
    assert fresh.store.stats.corrupt_files == 1
    assert answers(fresh) == reference


def test_eviction_under_a_small_device_budget_keeps_results_correct(model, tmp_path, reference):
    llm = make_llm(model, tmp_path, device_budget_bytes=8_000)    # room for a few units
    assert answers(llm) == reference
    assert answers(llm) == reference
    assert llm.store.stats.device_evictions > 0
    assert llm.store.stats.disk_hits > 0             # evicted units came back from disk


def test_eviction_without_a_disk_tier_re_encodes_and_stays_correct(model, tmp_path, reference):
    llm = make_llm(model, tmp_path, device_budget_bytes=8_000, disk_budget_bytes=0)
    assert answers(llm) == reference
    calls = llm.encoder_calls
    assert answers(llm) == reference
    assert llm.encoder_calls > calls                  # dropped units were encoded again


def test_threads_with_mixed_prompts_give_the_single_thread_answers(model, tmp_path):
    jobs = [(p, seed) for p in PROMPTS for seed in (None, 3)]

    def run(llm, prompt, seed):
        kwargs = {"temperature": 0.8, "seed": seed} if seed is not None else {}
        return llm.generate(prompt, max_new_tokens=5, **kwargs).token_ids

    single = make_llm(model, tmp_path / "single")
    expected = {job: run(single, *job) for job in jobs}
    shared = make_llm(model, tmp_path / "threads")
    got: dict[int, list] = {}
    errors = []

    def worker(index):
        order = jobs[index:] + jobs[:index]          # each thread starts somewhere else
        try:
            got[index] = [(job, run(shared, *job)) for job in order]
        except Exception as err:   # pragma: no cover - reported below
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(got) == 8
    for results in got.values():
        for job, tokens in results:
            assert tokens == expected[job]
    assert shared.encoder_calls == UNITS              # each unit encoded once, not once per thread


def test_streaming_deltas_concatenate_to_the_result_text(model, tmp_path):
    llm = make_llm(model, tmp_path)
    stream = llm.generate(PROMPTS[1], max_new_tokens=8, stream=True)
    deltas = list(stream)
    assert len(deltas) > 1
    assert "".join(deltas) == stream.result.text
    assert stream.result.token_ids == llm.generate(PROMPTS[1], max_new_tokens=8).token_ids


def test_stop_strings_end_generation_before_the_string(model, tmp_path):
    llm = make_llm(model, tmp_path)
    free = llm.generate(PROMPTS[3], max_new_tokens=10)
    assert free.finish_reason == "length"
    stop = llm.tokenizer.decode(free.token_ids[4:5])
    stopped = llm.generate(PROMPTS[3], max_new_tokens=10, stop=[stop])
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[:free.text.find(stop)]
    assert stop not in stopped.text


def test_prompt_may_be_text_a_document_or_a_compiled_prompt(model, tmp_path):
    llm = make_llm(model, tmp_path)
    expected = llm.generate(PROMPTS[1], max_new_tokens=4).token_ids
    doc = parse_prompt(PROMPTS[1])
    assert llm.generate(doc, max_new_tokens=4).token_ids == expected
    compiled = SimpleNamespace(schema=parse_schema(SCHEMA), doc=doc)
    other = LLM.from_model(model, WordTokenizer(VOCAB, bos=True),
                           store=ModuleStore(disk_dir=tmp_path / "other"), recompute="none")
    assert other.generate(compiled, max_new_tokens=4).token_ids == expected


def test_request_buffers_are_reused_not_reallocated(model, tmp_path):
    llm = make_llm(model, tmp_path)
    for _ in range(3):
        answers(llm)
    assert llm.assembler.allocations <= 2


def test_units_already_in_the_buffer_are_not_copied_again(model, tmp_path, reference):
    llm = make_llm(model, tmp_path)
    first = llm.generate(PROMPTS[3], max_new_tokens=6)
    copied = llm.assembler.copied_tokens
    assert copied == first.cached_tokens
    again = llm.generate(PROMPTS[3], max_new_tokens=6)
    assert llm.assembler.copied_tokens == copied            # root, intro, guide: all in place
    assert again.token_ids == first.token_ids == reference[3]
    other = llm.generate(PROMPTS[0], max_new_tokens=6)      # root, intro reused; guide dropped
    assert llm.assembler.copied_tokens == copied
    assert other.token_ids == reference[0]
    assert llm.generate(PROMPTS[4], max_new_tokens=6).token_ids == reference[4]   # take_last
    assert answers(llm) == reference


def test_a_decode_that_outgrows_its_buffer_grows_it_and_keeps_going(model, tmp_path):
    llm = make_llm(model, tmp_path)
    expected = llm.generate(PROMPTS[1], max_new_tokens=12)
    small = make_llm(model, tmp_path)
    small.decode_room = 2
    grown = small.generate(PROMPTS[1], max_new_tokens=12)
    assert grown.token_ids == expected.token_ids and len(grown.token_ids) == 12
    buffer = small.assembler._free[0]
    assert buffer.capacity >= grown.cached_tokens + grown.prefill_tokens + 11


def test_timings_cover_every_phase(model, tmp_path):
    llm = make_llm(model, tmp_path)
    cold = llm.generate(PROMPTS[1], max_new_tokens=3)
    warm = llm.generate(PROMPTS[1], max_new_tokens=3)
    assert cold.timings.encode > 0 and warm.timings.encode == 0
    for t in (cold.timings, warm.timings):
        assert 0 < t.prefill <= t.first_token <= t.total
        assert t.bind > 0 and t.retrieve > 0 and t.assemble > 0
    assert "prefill" in str(warm.timings)


# --- the command line ----------------------------------------------------------------------------

@pytest.fixture
def cli_files(tmp_path):
    (tmp_path / "docs.pml").write_text(SCHEMA)
    (tmp_path / "ask.pml").write_text(PROMPTS[1] + "\n")
    (tmp_path / "bad.pml").write_text('<prompt schema="docs">\n  <nothing/>Hi</user>\n</prompt>\n')
    return tmp_path


def test_cli_run_prints_the_answer_and_the_timing_breakdown(model, cli_files, monkeypatch, capsys):
    from promptlang import cli
    from promptlang.runtime import engine
    llm = make_llm(model, cli_files / "kv")
    monkeypatch.setattr(engine, "load", lambda name, isolate=False, quantize=None: llm)
    expected = llm.generate(PROMPTS[1], max_new_tokens=5)
    for extra in ([], ["--stream"]):
        argv = ["run", str(cli_files / "docs.pml"), str(cli_files / "ask.pml"),
                "--max-new-tokens", "5", *extra]
        assert cli.main(argv) == 0
        out, err = capsys.readouterr()
        assert out == expected.text + "\n"
        assert "prefill" in err and "first_token" in err and "cached" in err


def test_cli_run_prints_parse_warnings_as_located_lines(model, cli_files, monkeypatch, capsys):
    from promptlang import cli
    from promptlang.runtime import engine
    llm = make_llm(model, cli_files / "kv")
    monkeypatch.setattr(engine, "load", lambda name, isolate=False, quantize=None: llm)
    careless = cli_files / "careless.pml"
    careless.write_text(PROMPTS[1].replace("</user>", " if 0 <= x < 3</user>") + "\n")
    assert cli.main(["run", str(cli_files / "docs.pml"), str(careless),
                     "--max-new-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert f"{careless}:1:" in err and ": warning: '<' followed by" in err


def test_cli_run_reports_a_bad_prompt_without_a_traceback(model, cli_files, monkeypatch, capsys):
    from promptlang import cli
    from promptlang.runtime import engine
    llm = make_llm(model, cli_files / "kv")
    monkeypatch.setattr(engine, "load", lambda name, isolate=False, quantize=None: llm)
    assert cli.main(["run", str(cli_files / "docs.pml"), str(cli_files / "bad.pml")]) == 1
    out, err = capsys.readouterr()
    assert err.startswith(f"{cli_files / 'bad.pml'}:2:3: schema 'docs' has no module 'nothing'")
    assert "Traceback" not in err and out == ""


def test_cli_cache_ls_and_clear(model, tmp_path, capsys):
    from promptlang import cli
    make_llm(model, tmp_path).encode(SCHEMA)
    assert cli.main(["cache", "ls", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"{UNITS} entries" in out and "docs:module:appendix" in out
    assert cli.main(["cache", "clear", "--dir", str(tmp_path)]) == 0
    assert f"removed {UNITS} entries" in capsys.readouterr().out
    assert not list(tmp_path.glob("*.safetensors"))


def test_cli_run_takes_a_recompute_policy_and_reports_a_bad_one(model, cli_files, monkeypatch,
                                                                capsys):
    from promptlang import cli
    from promptlang.runtime import engine
    llm = make_llm(model, cli_files / "kv")
    monkeypatch.setattr(engine, "load", lambda name, isolate=False, quantize=None: llm)
    files = [str(cli_files / "docs.pml"), str(cli_files / "ask.pml")]
    assert cli.main(["run", *files, "--max-new-tokens", "2", "--recompute", "first:2"]) == 0
    err = capsys.readouterr().err
    assert "recomputed)" in err and "(0 recomputed)" not in err
    assert cli.main(["run", *files, "--recompute", "first:two"]) == 1
    out, err = capsys.readouterr()
    assert "bad recompute policy 'first:two'" in err and "Traceback" not in err and out == ""
