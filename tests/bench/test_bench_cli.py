"""`promptlang bench ...` end to end in --quick mode on the default model: each command
runs, prints its tables and goal lines, and writes the files it promises."""

import csv
import json
import re

import pytest

from promptlang.cli import main
from promptlang.bench.peers_report import PeersOptions
from promptlang.runtime.kv.assembler import SHARE_MIN_TOKENS
from tests.extras import needs_plots

GOAL_LINE = re.compile(r"^(PASS|FAIL|N/A)  (.+?): ", re.M)
LATENCY_GOALS = {"cached TTFT <= 2x floor", "cached >= 100x faster than baseline",
                 "cached TTFT exponent <= 1.2", "cached beats baseline at 512 cached tokens",
                 "decode per token <= 1.5x transformers generate",
                 "cached first token == baseline's at every length"}
MEMORY_GOAL = "a 16-bit store halves KV bytes per token"
ACCURACY_GOAL = "recompute recovers >= half the cached-vs-baseline gap at >= 10x"
QUICK_SETTINGS = ("baseline", "cached", "cached+exact", "cached+first:2", "cached+deviation:0.2",
                  "cached-bf16", "isolate", "isolate+exact", "isolate+first:2",
                  "isolate+deviation:0.2", "scaffold")
SEAM_GOALS = {"cached as right as the full prefill at >= 30x",
              "cached+exact (the default policy) as right as the full prefill at >= 30x",
              "cached+first:2 as right as the full prefill at >= 30x",
              "cached+deviation:0.2 as right as the full prefill at >= 30x"}


def bench(capsys, *argv):
    # one thread: these only check that everything runs, and the test machine is shared
    # (two threads fighting other processes for two cores run several times slower)
    code = main(["bench", *argv, "--quick", "--no-progress", "--threads", "1"])
    out = capsys.readouterr().out
    assert code == 0, out
    return out


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def goals(out):
    return {name: verdict for verdict, name in GOAL_LINE.findall(out)}


@pytest.mark.slow
@needs_plots
def test_latency_quick_writes_every_tier_and_prints_the_goals(tmp_path, capsys):
    out = bench(capsys, "latency", "--out", str(tmp_path))
    rows = read_csv(tmp_path / "latency.csv")
    assert [int(r["target_tokens"]) for r in rows] == [64, 128, 256]
    for row in rows:
        for column in ("baseline_s", "cold_s", "encode_s", "device_s", "held_s", "host_s",
                       "disk_s", "floor_s", "device_x_floor", "speedup"):
            assert float(row[column]) > 0, column
        assert int(row["cached_tokens"]) >= int(row["target_tokens"])
        assert int(row["prompt_tokens"]) == int(row["cached_tokens"]) + int(row["uncached_tokens"])
        assert row["break_even_requests"] == "" or int(row["break_even_requests"]) >= 1
        assert int(row["samples"]) == 2                     # the quick run's declared rounds
        assert float(row["device_x_floor_min"]) <= float(row["device_x_floor"]) <= \
            float(row["device_x_floor_max"])
    assert (tmp_path / "latency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(goals(out)) == LATENCY_GOALS
    # the default model's cached and baseline first tokens agree at every length
    assert goals(out)["cached first token == baseline's at every length"] == "PASS"
    assert "Cached against baseline: the first token" in out and "max |logit diff|" in out
    data = json.loads((tmp_path / "latency.json").read_text())
    assert data["machine"]["matmul_gflops"] > 0 and data["machine"]["copy_gb_per_s"] > 0
    for point in data["points"]:
        checks = point["checks"]
        # each tier measured what its name says, by the engine's own counters
        assert checks["held_copied_tokens"] == 0
        if point["target_tokens"] < SHARE_MIN_TOKENS:   # short units are copied in
            assert checks["device_copied_tokens"] >= point["target_tokens"]
        else:                                          # long ones are read in place
            assert checks["device_copied_tokens"] < point["target_tokens"]
        assert checks["host_hits"] >= 1 and checks["disk_hits"] >= 2
        assert len(point["disk"]) == 2
        # every goal sample has its baseline and floor from the same round, declared count
        assert len(point["device"]) == len(point["baseline"]) == len(point["floors"]) == 2
        assert point["x_floor"]["n"] == 2 and point["agreement"]["samples"] == 2
    decode = data["decode"]
    assert decode["tokens"] >= 2 and len(decode["ours"]) == len(decode["hf"]) == 2
    assert data["machine"]["matmul_sgemm"] in {s["name"] + f" ({s['what']})"
                                               for s in data["sgemm_candidates"]}
    assert not list(tmp_path.glob(".kv-*"))          # the disk tier's files are gone
    rag_rows = read_csv(tmp_path / "rag.csv")        # the RAG section, quick-sized
    assert len(rag_rows) == 4 and {r["kind"] for r in rag_rows} == {"new", "reordered",
                                                                     "repeat"}
    assert all(r["prefix_agrees_with_full"] == "True" for r in rag_rows)
    assert "RAG: 2 of 3 documents per request" in out


def test_memory_quick_measures_both_stores_and_the_table(tmp_path, capsys):
    import torch

    threads = torch.get_num_threads()
    out = bench(capsys, "memory", "--out", str(tmp_path))
    assert torch.get_num_threads() == threads          # --threads 1 was undone
    rows = read_csv(tmp_path / "memory.csv")
    assert {"model", "bytes/token fp16", "bytes/token fp32", "paper Table 2"} <= set(rows[0])
    assert {r["model"] for r in rows} >= {"SmolLM2-135M", "Llama-2-7B", "Llama-3-8B",
                                          "Qwen2.5-0.5B", "Falcon-7B"}
    data = json.loads((tmp_path / "memory.json").read_text())
    assert data["bytes_per_token"] == {"fp16": 23_040, "fp32": 46_080}
    assert [s["kv"] for s in data["stores"]] == [46_080, 23_040]
    assert goals(out) == {MEMORY_GOAL: "PASS"}


@pytest.mark.slow
@needs_plots
def test_accuracy_quick_scores_every_setting_and_kind(tmp_path, capsys):
    out = bench(capsys, "accuracy", "--out", str(tmp_path))
    rows = read_csv(tmp_path / "accuracy.csv")
    assert {(r["setting"], r["kind"]) for r in rows} == {
        (s, k) for s in QUICK_SETTINGS
        for k in ("single", "cross", "dependent", "needle", "same-shape", "argument", "all")}
    assert {"accuracy", "found_rate", "agreement", "ci95_low", "mean_ttft_s",
            "mean_recomputed_tokens"} <= set(rows[0])
    baseline_all = next(r for r in rows if r["setting"] == "baseline" and r["kind"] == "all")
    assert baseline_all["items"] == "6" and baseline_all["agreement"] == "1.0"
    assert baseline_all["found_delta"] == "0.0" and float(baseline_all["mean_gold_logprob"]) < 0
    assert all(float(r["mean_recomputed_tokens"]) > 0 for r in rows
               if r["setting"].endswith("first:2"))
    items = json.loads((tmp_path / "accuracy-items.json").read_text())
    assert [item["kind"] for item in items] == ["single", "cross", "dependent", "needle",
                                                "same-shape", "argument"]
    for item in items:
        assert tuple(item["settings"]) == QUICK_SETTINGS
        assert item["prompt_tokens"] > 0
    exact_table = "Exact match by question kind" in out
    assert exact_table != ("exact match: 0 items for every setting and kind" in out)
    assert "Same greedy output" in out
    assert "Recompute cost at ~" in out and "the cached-vs-baseline gap won back" in out
    assert "Against the baseline, item by item" in out
    assert (tmp_path / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(goals(out)) == {ACCURACY_GOAL} | SEAM_GOALS
    data = json.loads((tmp_path / "accuracy.json").read_text())
    assert [p["setting"] for p in data["cost"]["points"]] == list(QUICK_SETTINGS[1:]) + [
        "cached+exact, seen before"]
    assert data["goals"][0]["name"] == ACCURACY_GOAL


@pytest.mark.slow
@needs_plots
def test_all_quick_writes_one_folder_with_a_report_and_every_goal(tmp_path, capsys):
    out = bench(capsys, "all", "--out", str(tmp_path / "run"), "--kinds", "single",
                "--lengths", "64,128")
    folder = tmp_path / "run"
    for name in ("memory.csv", "latency.csv", "latency.png", "accuracy.csv", "accuracy.png",
                 "accuracy-items.json", "goals.json", "report.md"):
        assert (folder / name).is_file(), name
    report = (folder / "report.md").read_text()
    for heading in ("## Memory", "## Latency", "## Accuracy", "## All goals"):
        assert heading in report
    assert "promptlang bench all --kinds single --lengths 64,128 --no-progress --out" in report
    assert "torch threads 1" in report
    verdicts = {g["name"]: g["verdict"] for g in json.loads((folder / "goals.json").read_text())}
    assert set(verdicts) == LATENCY_GOALS | {MEMORY_GOAL, ACCURACY_GOAL} | SEAM_GOALS
    assert set(goals(out)) == LATENCY_GOALS | {MEMORY_GOAL, ACCURACY_GOAL} | SEAM_GOALS


def test_latency_exits_1_when_cached_and_baseline_first_tokens_disagree(tmp_path, capsys,
                                                                         monkeypatch):
    from promptlang.bench import latency
    from tests.bench.test_bench_logic import point

    def fake_run(llm, options, **kwargs):     # a run whose 6.4k point picked another token
        points = [point(512, 10.0, 0.1), point(6400, 30.0, 0.1, agree=False)]
        report = latency.LatencyReport(options, "fake", {"matmul_gflops": 1.0,
                                                         "copy_gb_per_s": 1.0}, 0, 0, points,
                                       [], None, [], 0.0)
        report.goals = latency.latency_goals(report)
        return report

    monkeypatch.setattr(latency, "run_latency", fake_run)
    code = main(["bench", "latency", "--quick", "--no-progress", "--rag-requests", "0",
                 "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert code == 1
    assert goals(captured.out)["cached first token == baseline's at every length"] == "FAIL"
    assert "first tokens disagree" in captured.err


def test_without_matplotlib_the_tables_are_written_and_one_line_says_how_to_plot(
        tmp_path, capsys, monkeypatch):
    import sys

    from promptlang.bench import latency
    from tests.bench.test_bench_logic import point

    def fake_run(llm, options, **kwargs):
        report = latency.LatencyReport(options, "fake", {"matmul_gflops": 1.0,
                                                         "copy_gb_per_s": 1.0}, 0, 0,
                                       [point(512, 10.0, 0.1), point(6400, 30.0, 0.1)],
                                       [], None, [], 0.0)
        report.goals = latency.latency_goals(report)
        return report

    monkeypatch.setattr(latency, "run_latency", fake_run)
    monkeypatch.setitem(sys.modules, "matplotlib", None)     # import matplotlib fails
    code = main(["bench", "latency", "--quick", "--no-progress", "--rag-requests", "0",
                 "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert (tmp_path / "latency.csv").exists() and (tmp_path / "latency.md").exists()
    assert not (tmp_path / "latency.png").exists()
    hints = [line for line in captured.err.splitlines() if "promptlang[bench]" in line]
    assert hints == ["promptlang bench: no plots: matplotlib is not installed; "
                     "pip install 'promptlang[bench]' gives the plots"]


@pytest.mark.parametrize("argv, message", [
    (["latency", "--lengths", "0,64"], "positive token counts"),
    (["latency", "--rag-k", "0"], "at least 1"),
    (["accuracy", "--kinds", "trivia"], "unknown kind"),
    (["accuracy", "--recompute", "first:4,deviation:7"], "between 0 and 1"),
    (["latency", "--decode-tokens", "1"], "at least 2"),
])
def test_bad_options_are_usage_errors(argv, message, capsys):
    # rejected while parsing: nothing is loaded or measured
    assert main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


def test_all_quick_runs_on_another_local_model(tmp_path, capsys, tiny_model_dir):
    out = bench(capsys, "all", "--out", str(tmp_path / "run"), "--model", str(tiny_model_dir))
    data = json.loads((tmp_path / "run" / "memory.json").read_text())
    # 2 layers x 2 (K, V) x 2 KV heads x head dim 8 x 4 bytes
    assert data["bytes_per_token"]["fp32"] == 2 * 2 * 2 * 8 * 4
    assert [s["kv"] for s in data["stores"]] == [256, 128]
    assert any(row["model"].endswith("(this run)") for row in data["table"])
    assert len(read_csv(tmp_path / "run" / "latency.csv")) == 3
    assert set(goals(out)) == LATENCY_GOALS | {MEMORY_GOAL, ACCURACY_GOAL} | SEAM_GOALS


SERVE_GOALS = {"tokens/s at 16 clients >= 5x one client's",
               "TTFT p50 at 4 clients <= 2x one client's", "no request lost",
               "every answer equals the request served alone (greedy)"}


def test_serve_quick_loads_a_real_server_and_loses_nothing(tmp_path, capsys, tiny_model_dir):
    out = bench(capsys, "serve", "--out", str(tmp_path), "--model", str(tiny_model_dir),
                "--clients", "1,2")
    rows = read_csv(tmp_path / "serve.csv")
    assert [r["clients"] for r in rows] == ["1", "2", "1 (again)"]   # the baseline twice
    for row in rows:
        assert row["lost"] == "0" and row["answered"] == row["sent"] == row["identical"]
        assert float(row["tokens/s"]) > 0 and float(row["ttft p50 ms"]) > 0
        assert int(row["engine steps"]) > 0 and 0 < float(row["engine busy %"]) <= 100
    verdicts = goals(out)
    assert set(verdicts) == SERVE_GOALS
    assert verdicts["no request lost"] == "PASS"
    assert verdicts["every answer equals the request served alone (greedy)"] == "PASS"
    assert verdicts["tokens/s at 16 clients >= 5x one client's"] == "N/A"    # no 16 here
    data = json.loads((tmp_path / "serve.json").read_text())
    assert [level["clients"] for level in data["levels"]] == [1, 2, "1 (again)"]
    assert data["sgemm_flops_per_s"] > 0          # measured in the run: the ceiling line
    assert "the arithmetic alone" in out and "1 client " in out and "2 clients " in out


def test_structured_quick_measures_both_sides_and_prints_the_goal(tmp_path, capsys,
                                                                 tiny_model_dir):
    pytest.importorskip("llguidance")
    out = bench(capsys, "structured", "--out", str(tmp_path), "--model", str(tiny_model_dir))
    data = json.loads((tmp_path / "structured.json").read_text())
    assert len(data["free_s_per_token"]) == len(data["constrained_s_per_token"]) == 2
    assert all(s > 0 for s in data["free_s_per_token"] + data["constrained_s_per_token"])
    assert data["mask_s"] > 0
    assert set(goals(out)) == {"decode with a JSON Schema <= 10% slower per token"}


PEERS_GOALS = {"document ~6.4k, promptlang cached TTFT <= 0.8x llama.cpp's prefix hit",
               "document ~6.4k, promptlang cached TTFT <= 0.8x llama.cpp's prefix hit "
               "(int8 linears, bf16 attention and store)",
               "document ~6.4k, new question with a new opening, promptlang cached TTFT <= "
               "0.8x llama.cpp's prefix hit",
               "document ~6.4k, new question with a new opening, promptlang cached TTFT <= "
               "0.8x llama.cpp's prefix hit (int8 linears, bf16 attention and store)",
               "RAG 2 of 3, promptlang (none) >= 100x faster than llama.cpp",
               "RAG 2 of 3, promptlang (none) >= 50x faster than transformers' full prefill",
               "RAG 2 of 3, promptlang (exact) >= 100x faster than llama.cpp",
               "RAG 2 of 3, promptlang (exact) >= 50x faster than transformers' full prefill",
               "decode at the document's cached context >= llama.cpp's tokens/s",
               "decode at the document's cached context >= llama.cpp's tokens/s (f16 store)",
               "decode at the document's cached context >= llama.cpp's tokens/s "
               "(int8 linears, bf16 attention and store)",
               "the quantized path's logits equal the dequantized path's",
               "load in a new process <= 2 s",
               "resident memory <= 1.5x the GGUF's size + the KV"}


def test_peers_quick_measures_promptlang_and_transformers_and_says_why_not_llama(
        tmp_path, capsys, tiny_model_dir):
    """A model with no GGUF: llama.cpp's column and its goals are N/A, with the reason."""
    out = bench(capsys, "peers", "--out", str(tmp_path), "--model", str(tiny_model_dir))
    verdicts = goals(out)
    assert set(verdicts) == PEERS_GOALS
    assert verdicts["document ~6.4k, promptlang cached TTFT <= 0.8x llama.cpp's prefix hit"] \
        == "N/A"
    assert verdicts["RAG 2 of 3, promptlang (none) >= 50x faster than transformers' full "
                    "prefill"] in ("PASS", "FAIL")                  # measured without llama
    data = json.loads((tmp_path / "peers.json").read_text())
    assert data["llama_missing"] and data["llama_version"] is None
    # a full run pauses before each engine's turn; the quick one does not, and says so
    assert data["options"]["settle_s"] == 0 and "each turn after 0 s idle" in out
    assert PeersOptions().settle_s == 1.0
    assert len(data["rag"]["promptlang (none)"]) == len(data["rag"]["transformers"]) == 2
    assert len(data["doc"]["promptlang"]) == 1 and data["decode"]["promptlang"] > 0
    assert len(data["doc_new"]["promptlang"]) == 1 and data["sgemm_flops_per_s"] > 0
    assert data["question_flops"]["doc"] > 0 and data["question_flops"]["doc_new"] > 0
    # the new opening computes more of the question than the repeated one
    assert data["computed"]["doc_new"]["promptlang"][0] > data["computed"]["doc"]["promptlang"][0]
    assert len(data["doc"]["promptlang (f16 store)"]) == 1
    assert data["decode"]["promptlang (f16 store)"] > 0
    approximate = "promptlang (int8 linears, bf16 attention and store)"
    assert len(data["doc"][approximate]) == 1 and data["decode"][approximate] > 0
    # a transformers folder, no GGUF: nothing is read quantized, and the goal says so
    assert data["quantized_weights"] == 0
    assert verdicts["the quantized path's logits equal the dequantized path's"] == "N/A"
    # loaded again in a new process: its load time and memory measured; no GGUF to compare
    assert data["load_s"] > 0 and data["rss_bytes"] > 0 and data["kv_bytes"] > 0
    assert data["file_bytes"] is None
    assert verdicts["load in a new process <= 2 s"] in ("PASS", "FAIL")
    assert verdicts["resident memory <= 1.5x the GGUF's size + the KV"] == "N/A"


def test_serve_quick_can_load_llama_cpp_python_s_server_too(tmp_path, capsys, tiny_model_dir):
    """--llama-server: the same requests as plain chat on llama-cpp-python's server when it
    is installed (then its rows are there, nothing lost), else a line that says why not."""
    out = bench(capsys, "serve", "--out", str(tmp_path), "--model", str(tiny_model_dir),
                "--clients", "1", "--llama-server")
    assert "The same load on llama-cpp-python's server" in out
    data = json.loads((tmp_path / "serve.json").read_text())
    if data["llama_missing"]:
        assert "not run: " in out and data["llama_levels"] == []
    else:
        (level,) = data["llama_levels"]
        assert level["lost"] == 0 and level["answered"] == level["sent"] > 0
