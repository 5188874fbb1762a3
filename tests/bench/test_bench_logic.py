"""The arithmetic behind the bench reports, on made-up measurements: break-even, the
goals' verdicts on per-round ratios, the first-token agreement check, exponents, score
tables, option merging and the latency document."""

import argparse
import math
from dataclasses import replace

import pytest
import torch

from promptlang.bench import accuracy, latency, qa
from promptlang.bench.report import Goal, Section, markdown_table, render_markdown


def point(cached, baseline, device, encode=1.0, floor=0.05, agree=True):
    """Three rounds (a number stands for three samples around it); every round's rates
    give the same floor (memory-bound)."""
    if isinstance(baseline, float):
        baseline = [baseline] * 3
    if isinstance(device, float):
        device = [device, device * 1.1, device * 0.9]
    p = latency.Point(target=cached, prompt_tokens=cached + 14, cached_tokens=cached,
                      uncached_tokens=14, encode=encode, cold=encode + device[0],
                      disk_write=0.0, baseline=baseline, device=device, rates=[1.0] * 3,
                      bandwidths=[1.0] * 3,
                      held=[1.0], host=[1.0], disk=[1.0], flops=floor / 2, read_bytes=floor)
    logits = torch.tensor([0.0, 1.0, 0.5])
    for _ in range(3):
        p.agreement.add(logits, logits if agree else torch.tensor([0.0, 1.0, 1.5]))
    return p


def report(points, decode=None, goal_length=6400):
    r = latency.LatencyReport(latency.LatencyOptions(goal_length=goal_length), "m", {}, 0, 0,
                              points, [], decode, [], 0.0)
    r.goals = latency.latency_goals(r)
    return {g.name: g for g in r.goals}


def test_break_even_counts_the_request_that_pays_for_the_encoding():
    # encode 10 s, each request saves 4 s: 3 requests cost 10 + 3*1 = 13 <= 3*5 = 15
    assert point(1000, baseline=5.0, device=1.0, encode=10.0).break_even == 3
    assert point(1000, baseline=5.0, device=1.0, encode=8.0).break_even == 2
    assert point(1000, baseline=5.0, device=1.0, encode=0.5).break_even == 1
    assert point(1000, baseline=1.0, device=2.0).break_even is None     # never pays


def test_medians_and_speedup_use_the_device_tier():
    p = point(2000, baseline=20.0, device=0.1)
    assert p.median("device") == pytest.approx(0.1)
    assert p.best("device") == pytest.approx(0.09)
    assert p.speedup.median == pytest.approx(200.0)
    assert p.speedup.n == 3 and p.speedup.low == pytest.approx(20.0 / 0.11)


def test_floor_and_its_ratio_are_per_round():
    p = point(1000, baseline=1.0, device=[0.2, 0.2, 0.2], floor=0.1)
    p.bandwidths = [1.0, 2.0, 0.5]            # round 2 copied twice as fast, round 3 half
    assert p.floors() == pytest.approx([0.1, 0.05, 0.2])
    assert p.floor == pytest.approx(0.1)
    assert [p.x_floor.low, p.x_floor.median, p.x_floor.high] == pytest.approx([1.0, 2.0, 4.0])


def test_a_goal_is_judged_on_the_median_of_per_round_ratios():
    # per round 150x, 150x, 30x: median 150x PASS (the ratio of the medians would be 75x)
    p = point(6400, baseline=[150.0, 300.0, 90.0], device=[1.0, 2.0, 3.0])
    goal = report([p])["cached >= 100x faster than baseline"]
    assert goal.passed is True and "150x (min-max 30x-150x" in goal.detail
    assert "n=3" in goal.detail


def test_agreement_counts_rounds_that_pick_different_first_tokens():
    a = latency.Agreement()
    a.add(torch.tensor([0.0, 2.0, 1.0]), torch.tensor([0.0, 2.0, 1.25]))
    assert a.agrees and a.max_logit_diff == pytest.approx(0.25)
    a.add(torch.tensor([0.0, 2.0, 1.0]), torch.tensor([0.0, 2.0, 3.0]))
    assert not a.agrees and a.disagreements == 1 and a.samples == 2
    assert (a.baseline_token, a.cached_token) == (1, 2)
    assert a.max_logit_diff == pytest.approx(2.0)
    assert not latency.Agreement().agrees              # no rounds: nothing shown to agree


def test_a_first_token_disagreement_is_a_fail_line_and_marks_the_report_wrong():
    points = [point(512, 10.0, 0.1), point(6400, 30.0, 0.1, agree=False)]
    r = latency.LatencyReport(latency.LatencyOptions(), "m", {}, 0, 0, points, [], None, [],
                              0.0)
    r.goals = latency.latency_goals(r)
    goal = {g.name: g for g in r.goals}[latency.AGREE_GOAL]
    assert str(goal).startswith("FAIL  ") and "6,400 cached tokens (3 of 3 rounds" in goal.detail
    assert r.correct is False
    points[1] = point(6400, 30.0, 0.1)
    assert latency.agreement_goal(points).passed is True
    assert "max |logit diff| 0" in latency.agreement_goal(points).detail


def test_rounds_rotate_which_part_runs_first():
    parts = ("floor", "device", "baseline")
    orders = [latency.rotated(parts, i) for i in range(3)]
    assert [o[0] for o in orders] == list(parts)
    assert all(sorted(o) == sorted(parts) for o in orders)
    assert latency.rotated(parts, 3) == orders[0]


def test_goals_pass_when_every_target_is_met():
    points = [point(n, baseline=3e-6 * n**2, device=0.04 + 2e-6 * n, floor=0.03)
              for n in (512, 1024, 2048, 4096, 6400, 8000)]
    decode = latency.DecodeComparison(6414, 32, [0.030, 0.031], [0.025, 0.026], 20.0, "sdpa")
    goals = report(points, decode)
    assert {name: g.passed for name, g in goals.items()} == {name: True for name in goals}
    assert len(goals) == 6
    assert "6,400 cached tokens" in goals["cached TTFT <= 2x floor"].detail


def test_goals_fail_and_say_by_how_much():
    points = [point(n, baseline=1e-3 * n, device=1e-4 * n, floor=0.01)
              for n in (512, 2048, 6400)]
    decode = latency.DecodeComparison(6414, 32, [0.09, 0.12], [0.03, 0.03], 20.0, "sdpa")
    goals = report(points, decode)
    assert goals["cached TTFT <= 2x floor"].passed is False
    assert "64.00x (min-max 57.60x-70.40x" in goals["cached TTFT <= 2x floor"].detail
    assert "3.50x (min-max 3.00x-4.00x" in \
        goals["decode per token <= 1.5x transformers generate"].detail
    assert goals["cached >= 100x faster than baseline"].passed is False
    assert goals["cached TTFT exponent <= 1.2"].passed is True       # linear: exponent 1
    assert goals["decode per token <= 1.5x transformers generate"].passed is False
    assert str(goals["decode per token <= 1.5x transformers generate"]).startswith("FAIL  ")


def test_exponent_is_fitted_over_1k_to_8k_cached_tokens_only():
    points = [point(256, 1.0, 5.0)] + [point(n, 1e-5 * n**2, 1e-5 * n**1.5)
                                       for n in (1024, 2048, 4096, 8000)]
    k_cached, k_baseline, span = latency.exponents(points)
    assert k_cached == pytest.approx(1.5, abs=0.01)
    assert k_baseline == pytest.approx(2.0, abs=0.01)
    assert span.startswith("1,000-8,192")


def test_exponent_falls_back_to_every_point_and_says_so():
    k_cached, _, span = latency.exponents([point(n, 1.0, 1e-3 * n) for n in (64, 128, 256)])
    assert k_cached == pytest.approx(1.0)
    assert span.startswith("all 3 points")
    assert latency.exponents([point(64, 1.0, 0.1)])[0] is None


def test_undecodable_goal_is_reported_not_measured():
    goals = report([point(6400, 30.0, 0.1)])
    assert goals["decode per token <= 1.5x transformers generate"].passed is None
    assert str(goals["decode per token <= 1.5x transformers generate"]).startswith("N/A  ")


def test_latency_document_is_deterministic_and_about_the_asked_length(default_tokenizer):
    text, item = latency.document(default_tokenizer, 500, seed=3)
    again, same_item = latency.document(default_tokenizer, 500, seed=3)
    assert (text, item) == (again, same_item)
    assert 500 <= len(default_tokenizer.encode(text)) <= 540
    assert qa.mentions(text, item.answer) and not qa.mentions(item.question, item.answer)
    assert latency.document(default_tokenizer, 500, seed=4)[0] != text


def test_wilson_interval_matches_known_values():
    low, high = accuracy.wilson_interval(14, 40)
    assert (round(low, 3), round(high, 3)) == (0.221, 0.505)
    assert accuracy.wilson_interval(0, 0) == (0.0, 0.0)
    assert accuracy.wilson_interval(5, 5)[1] == pytest.approx(1.0)


def fake_result(item, correct):
    answers = {s: accuracy.Answer("x", [1], ok, ok, s == "baseline" or ok, 0.1, 0.0)
               for s, ok in zip(accuracy.SETTINGS, correct)}
    return accuracy.ItemResult(item, 100, answers)


def test_scores_and_tables_count_per_kind_and_overall():
    items = qa.generate(2, seed=1, kind="single") + qa.generate(1, seed=1, kind="needle")
    results = [fake_result(items[0], (True, True, False, True)),
               fake_result(items[1], (True, False, False, True)),
               fake_result(items[2], (False, False, True, False))]
    scores = {(s.setting, s.kind): s for s in accuracy.score(results, ("single", "needle"))}
    assert (scores[("baseline", "single")].correct, scores[("baseline", "all")].correct) == (2, 2)
    assert scores[("isolate", "needle")].correct == 1
    assert scores[("cached", "all")].agree == 1
    r = accuracy.AccuracyReport(accuracy.AccuracyOptions(kinds=("single", "needle")), "m",
                                results, 0.0, list(scores.values()))
    table = accuracy.accuracy_table(r)
    assert table[0]["setting"] == "baseline" and table[0]["single"] == "2/2 (100%)"
    assert table[0]["all"] == "2/3 (67%)"
    agreement = accuracy.accuracy_table(r, "agree")
    assert [row["setting"] for row in agreement] == ["cached", "isolate", "scaffold"]


def test_make_items_interleaves_kinds_deterministically():
    options = accuracy.AccuracyOptions(items_per_kind=2, kinds=("single", "cross"))
    items = accuracy.make_items(options)
    assert [i.kind for i in items] == ["single", "cross", "single", "cross"]
    assert items == accuracy.make_items(options)


def test_quick_options_take_command_line_overrides():
    from promptlang.bench import run as cli

    args = argparse.Namespace(quick=True, lengths=(32, 64), samples=None, repeats=None,
                              decode_tokens=None, decode_samples=3, goal_length=None,
                              rag_docs=None, rag_k=3, rag_requests=None)
    options = cli._latency_options(args)
    assert options.lengths == (32, 64) and options.decode_samples == 3
    assert options.samples == latency.LatencyOptions.quick().samples
    args.quick = False
    assert cli._latency_options(args).samples == latency.LatencyOptions().samples
    from promptlang.bench.rag import RagOptions

    assert cli._rag_options(args) == RagOptions(k=3)
    args.quick = True
    assert cli._rag_options(args) == replace(RagOptions.quick(), k=3)


def test_command_line_is_rebuilt_from_the_given_options():
    from promptlang.cli import bench as cli

    args = argparse.Namespace(bench="latency", quick=True, out="bench-out", model=None,
                              no_progress=False, lengths=(64, 128), repeats=3, func=print)
    assert cli.command_line(args) == "promptlang bench latency --lengths 64,128 --quick --repeats 3"


def test_markdown_rendering_of_sections_and_goals():
    table = markdown_table([{"setting": "a|b", "n": 1234, "x": None}])
    assert table.splitlines() == ["| setting | n | x |", "|:---|---:|---:|",
                                  "| a\\|b | 1,234 | n/a |"]
    text = render_markdown([Section("Goals", (), [str(Goal("g", True, "fine")),
                                                  str(Goal("h", None, "why"))])])
    assert text == "### Goals\n\n- PASS  g: fine\n- N/A  h: why\n"
    assert math.isfinite(accuracy.wilson_interval(1, 2)[0])


def test_a_goal_checked_far_from_its_length_says_so():
    goals = report([point(2048, 10.0, 0.2), point(6400, 30.0, 0.3)])
    assert "(the measured point nearest 512)" in \
        goals["cached beats baseline at 512 cached tokens"].detail
    assert "nearest" not in goals["cached TTFT <= 2x floor"].detail
