"""bench peers' side-by-side machinery: llama.cpp's line protocol, the engines' turns, and
the document goal's arithmetic line."""

from __future__ import annotations

from promptlang.bench.peers import _LlamaLines, _turns
from promptlang.bench.peers_report import PeersOptions, PeersReport, goals


def test_a_session_that_cannot_start_says_why(tmp_path):
    """No llama-cpp-python (CI), or no such GGUF (where it is installed): the child's reason,
    not a session."""
    out = _LlamaLines.start(str(tmp_path / "missing.gguf"), 1, 64)
    assert isinstance(out, str)
    assert "llama-cpp-python is not installed" in out or "missing.gguf" in out


def test_every_engine_goes_first_once_every_len_rounds():
    names = ["a", "b", "c"]
    orders = [_turns(names, r) for r in range(3)]
    assert [o[0] for o in orders] == names
    assert all(sorted(o) == names for o in orders)


def test_the_document_goal_says_what_the_arithmetic_alone_allows():
    """18 GFLOP at 180 GFLOP/s is 100 ms: 0.91x llama.cpp's 110 ms prefix hit."""
    report = PeersReport(PeersOptions(), "m", doc={"promptlang": [0.14], "llama.cpp": [0.11]},
                         question_flops={"doc": 18e9}, sgemm_flops_per_s=180e9)
    first = goals(report)[0]
    assert first.name == "document ~6.4k, promptlang cached TTFT <= 0.8x llama.cpp's prefix hit"
    assert first.passed is False
    assert first.detail == ("medians: 1.27x (140.0 vs 110.0 ms); the question's arithmetic alone "
                            "(18.0 GFLOP) at this run's float32 sgemm (180 GFLOP/s): 100 ms = 0.91x")
    report.sgemm_flops_per_s = None                  # not measured: no arithmetic line
    assert goals(report)[0].detail == "medians: 1.27x (140.0 vs 110.0 ms)"


def test_a_question_with_a_new_opening_has_goals_and_arithmetic_of_its_own():
    report = PeersReport(PeersOptions(), "m", doc={"promptlang": [0.14], "llama.cpp": [0.11]},
                         doc_new={"promptlang": [0.15], "llama.cpp": [0.25]},
                         question_flops={"doc": 18e9, "doc_new": 27e9},
                         sgemm_flops_per_s=180e9)
    new = [g for g in goals(report) if "new opening" in g.name]
    assert [g.passed for g in new] == [True, None]        # the approximations: not measured
    assert new[0].detail == ("medians: 0.60x (150.0 vs 250.0 ms); the question's arithmetic "
                             "alone (27.0 GFLOP) at this run's float32 sgemm (180 GFLOP/s): "
                             "150 ms = 0.60x")
    assert new[1].detail == "not measured"


def test_peers_runs_llama_cpp_on_the_gguf_promptlang_loads():
    from argparse import Namespace

    from promptlang.bench.run import peers_gguf

    assert peers_gguf(Namespace(gguf=None, model="/m/qwen-q4_k_m.gguf")) == "/m/qwen-q4_k_m.gguf"
    assert peers_gguf(Namespace(gguf="/other.gguf", model="/m/a.gguf")) == "/other.gguf"
    assert peers_gguf(Namespace(gguf=None, model="/models/hf-folder")) is None
    assert peers_gguf(Namespace(gguf=None, model=None)) is None


def test_the_memory_goal_allows_the_file_and_the_kv():
    """1.5x a 400 MB file plus 150 MB of KV is 750 MB: 700 MB passes, 800 MB fails."""
    def verdicts(rss: int) -> dict:
        report = PeersReport(PeersOptions(), "m", load_s=2.5, rss_bytes=rss, kv_bytes=150_000_000,
                             file_bytes=400_000_000, llama_load_s=0.4,
                             llama_rss_bytes=900_000_000)
        return {g.name: g for g in goals(report)}

    memory = "resident memory <= 1.5x the GGUF's size + the KV"
    assert verdicts(700_000_000)[memory].passed is True
    fails = verdicts(800_000_000)[memory]
    assert fails.passed is False
    assert fails.detail == ("800 MB after a request over the document (2.0x the 400 MB file, "
                            "its KV 150 MB, limit 750 MB); llama.cpp 900 MB")
    load = verdicts(1)["load in a new process <= 2 s"]
    assert load.passed is False and load.detail.endswith("; llama.cpp 0.40 s")
    # the libraries' share, where measured, is said (the goal is the whole process's)
    report = PeersReport(PeersOptions(), "m", load_s=0.9, rss_bytes=1_000_000_000,
                         kv_bytes=150_000_000, file_bytes=400_000_000,
                         libraries_bytes=380_000_000)
    memory_goal = {g.name: g for g in goals(report)}[memory]
    assert memory_goal.passed is False
    assert memory_goal.detail == ("1,000 MB after a request over the document (2.5x the 400 MB "
                                  "file, its KV 150 MB, limit 750 MB; 380 MB of it resident "
                                  "before the load, the libraries imported; the rest 620 MB = "
                                  "1.55x the file)")


def test_the_approximate_row_says_what_this_cpu_could_not_run():
    from promptlang.bench.peers import missing_approximations
    from promptlang.bench.peers_report import APPROXIMATE, sections
    from promptlang.runtime.fast import native

    lacking = missing_approximations()
    assert ("int8 linears" in lacking) == (not native.products_available("int8"))
    assert ("bf16 attention" in lacking) == (not native.products_available("bf16"))
    report = PeersReport(PeersOptions(), "m", approximations_missing=["bf16 attention"])
    lines = sections(report)[0].lines
    assert lines[-1] == (f"{APPROXIMATE}: this CPU cannot run its bf16 attention (bf16 "
                         "attention needs AVX512_BF16): those passes computed as the model's")
    report.approximations_missing = []
    assert not any("cannot run" in line for line in sections(report)[0].lines)
