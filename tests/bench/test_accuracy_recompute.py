"""The accuracy benchmark: recompute settings, the gap/recovery arithmetic and its
goal, the accuracy-against-TTFT plot, --recompute parsing, and the draft-verified greedy
decoding (same tokens as `llm.generate`), on made-up scores and a tiny random model."""

import argparse
import math

import pytest

from promptlang.cli import main
from promptlang.bench import accuracy, qa
from tests.extras import needs_plots

NAMES = ("baseline", "cached", "cached+first:4", "cached+deviation:0.15", "isolate",
         "isolate+first:4", "isolate+deviation:0.15", "scaffold")


def test_settings_pair_every_policy_with_both_rules_in_canonical_form():
    assert accuracy.settings(["first:4", "deviation:15%", "FIRST:4", "none"]) == NAMES
    assert accuracy.settings(()) == accuracy.BASE_SETTINGS
    assert accuracy.split_setting("isolate+deviation:0.15") == ("isolate", "deviation:0.15")
    assert accuracy.split_setting("cached") == ("cached", "none")
    assert accuracy.AccuracyOptions().settings[:2] == ("baseline", "cached")


def test_primed_alone_is_a_setting_though_it_recomputes_nothing():
    names = accuracy.settings(["primed", "none+primed", "Query:32 + primed", "none"],
                              rules=("cached",), scaffold=False, isolate=False)
    assert names == ("baseline", "cached", "cached+primed", "cached+query:32+primed")
    assert accuracy.split_setting("cached+query:32+primed") == ("cached", "query:32+primed")


# --- gap, recovery, goal ----------------------------------------------------------------

def fake_report(found, exact=None, n=100, speed=None, kinds=("dependent",)):
    """A report whose `dependent` cells have found[setting] hits out of n, on the first
    items (exact match: exact[setting], default the same; gold log-prob -1 where found,
    else -3), and a cost section where setting s is speed[s] times faster than a 20 s
    baseline."""
    exact = exact or found
    items = qa.generate(n, seed=2, kind="dependent")
    results = []
    for i, item in enumerate(items):
        answers = {s: accuracy.Answer("x", [1], i < exact[s], i < found[s], s == "baseline",
                                      0.1, 0.0, 4 if "+" in s else 0,
                                      gold_logprob=-1.0 if i < found[s] else -3.0,
                                      gold_tokens=2, kl=0.0 if s == "baseline" else 0.5)
                   for s in found}
        results.append(accuracy.ItemResult(item, 100, answers))
    options = accuracy.AccuracyOptions(kinds=kinds, recompute=("first:4", "deviation:0.15"))
    report = accuracy.AccuracyReport(options, "m", results, 1.0)
    report.scores = accuracy.score(results, kinds)
    report.comparisons = accuracy.compare(results, kinds)
    speed = speed or {s: 50.0 for s in found}
    points = [accuracy.CostPoint(s, [20.0 / speed[s]] * 3, 4) for s in found if s != "baseline"]
    report.cost = accuracy.CostReport(6012, 5990, 4, [20.0], points, 6000)
    report.goals = [accuracy.recovery_goal(report)]
    return report


SCORES = {"baseline": 80, "cached": 40, "cached+first:4": 70, "cached+deviation:0.15": 50,
          "isolate": 30, "isolate+first:4": 40, "isolate+deviation:0.15": 30, "scaffold": 80}
SMALL = {s: v // 10 for s, v in SCORES.items()}     # the same rates on 10 items


def test_seam_goal_passes_within_two_points_and_a_tenth_and_a_half_nat_at_30x():
    """The seam goal: on every kind, answer in output >= baseline - 2 points and gold log-prob
    >= baseline - 0.15 nats (here -2 nats per miss: misses cost 0.02 nats each on 100
    items), and 30x the baseline's speed."""
    def goal(found: int, speed: float = 50.0):
        report = fake_report(SCORES | {"cached+first:4": found},
                             speed={s: (speed if s == "cached+first:4" else 50.0)
                                    for s in SCORES})
        goals = {g.name.split()[0]: g for g in accuracy.seam_goals(report)}
        assert set(goals) == {"cached", "cached+first:4", "cached+deviation:0.15"}
        assert not any("(the default policy)" in g.name for g in goals.values())   # exact
        return goals["cached+first:4"], goals["cached"]

    same, cached = goal(80)
    assert same.passed is True and cached.passed is False
    assert "outside 2 points / 0.15 nats on dependent" in cached.detail
    assert "dependent -40.0 [" in cached.detail and "nats" in cached.detail   # intervals shown
    assert goal(79)[0].passed is True          # -1 point, -0.02 nats
    assert goal(77)[0].passed is False         # -3 points
    slow = goal(80, speed=20.0)[0]
    assert slow.passed is False and "under 30x" in slow.detail
    assert fake_report(SCORES, kinds=("dependent",)).cost is not None
    no_cost = fake_report(SCORES | {"cached+first:4": 80})
    no_cost.cost = None
    assert {g.name.split()[0]: g.passed for g in accuracy.seam_goals(no_cost)}[
        "cached+first:4"] is None


def test_the_default_policys_goal_line_says_so_with_its_speed_seen_before():
    """The exact setting is the default policy's (seams is not); its line also gives the
    speed of the same modules seen before (the cost section's "cached+exact, seen before")."""
    report = fake_report(SCORES | {"cached+exact": 80, "cached+seams": 80})
    report.cost.points.append(accuracy.CostPoint(accuracy.seen_before("cached+exact"),
                                                 [0.1] * 3, 0))
    goals = {g.name.split()[0]: g for g in accuracy.seam_goals(report)}
    assert "(the default policy)" in goals["cached+exact"].name
    assert "(the default policy)" not in goals["cached+seams"].name
    assert goals["cached+exact"].passed is True
    assert "(200.0x for the same modules seen before)" in goals["cached+exact"].detail


def test_recovery_is_the_share_of_the_gap_won_back_with_its_interval():
    report = fake_report(SCORES)
    r = accuracy.recovery(report, "cached+first:4", "dependent")
    assert (r.baseline, r.cached, r.value) == (0.8, 0.4, 0.7)
    assert r.gap == pytest.approx(0.4)
    assert r.recovery == pytest.approx(0.75)
    assert r.interval.low < 0.75 < r.interval.high and r.interval.low > 0.5
    assert accuracy.recovery(report, "cached+deviation:0.15", "dependent").recovery == \
        pytest.approx(0.25)
    assert accuracy.recovery(report, "isolate", "dependent").recovery == pytest.approx(-0.25)
    assert accuracy.recovery(report, "cached+first:4", "needle") is None     # not measured
    by_logprob = accuracy.recovery(report, "cached+first:4", "dependent", "gold_logprob")
    assert by_logprob.recovery == pytest.approx(0.75)      # -1/-3 mirror found here


def test_goal_passes_when_the_best_fast_settings_interval_clears_half():
    goal = fake_report(SCORES).goals[0]
    assert goal.name == accuracy.GOAL_NAME and goal.passed is True
    assert "best at >= 10x: cached+first:4 70.0% recovers 75% [+" in goal.detail
    assert "of the 40.0-point gap" in goal.detail
    assert "answer in output" in goal.detail and "exact match" in goal.detail
    assert "gold log-prob recovers 75% [" in goal.detail
    assert "50.0x faster than the baseline at ~6,012 tokens" in goal.detail
    assert "intervals at 98.75% (Bonferroni over 4 settings)" in goal.detail


def test_goal_fails_when_half_is_inside_the_interval_though_the_estimate_clears_it():
    report = fake_report(SMALL, n=10)                 # 8 / 4 / 7 of 10: 75% recovered
    r = accuracy.recovery(report, "cached+first:4", "dependent")
    assert r.recovery == pytest.approx(0.75) and r.interval.low < 0.5
    assert report.goals[0].passed is False


def test_goal_interval_level_accounts_for_the_number_of_fast_settings():
    speed = {s: 5.0 for s in SCORES} | {"cached+first:4": 50.0}
    goal = fake_report(SCORES, speed=speed).goals[0]
    assert "intervals at 95% (Bonferroni over 1 settings)" in goal.detail
    wide = accuracy.recovery(fake_report(SCORES), "cached+first:4", "dependent",
                             level=accuracy.metrics.bonferroni(0.95, 4))
    narrow = accuracy.recovery(fake_report(SCORES), "cached+first:4", "dependent")
    assert wide.interval.low <= narrow.interval.low and wide.interval.high >= narrow.interval.high


def test_goal_ignores_settings_slower_than_10x_and_fails_below_half():
    speed = {s: 50.0 for s in SCORES} | {"cached+first:4": 8.0}
    goal = fake_report(SCORES, speed=speed).goals[0]
    assert goal.passed is False
    assert "best at >= 10x: cached+deviation:0.15" in goal.detail
    assert "best regardless of speed: cached+first:4" in goal.detail
    slow = fake_report(SCORES, speed={s: 5.0 for s in SCORES}).goals[0]
    assert slow.passed is False and "no recompute setting is 10x faster" in slow.detail


def test_goal_is_not_passed_when_there_is_no_gap():
    for cached in (80, 90):                      # equal to, or better than, the baseline
        goal = fake_report(SCORES | {"cached": cached}).goals[0]
        assert goal.passed is None and str(goal).startswith("N/A  ")
        assert "no gap to recover" in goal.detail
        r = accuracy.recovery(fake_report(SCORES | {"cached": cached}), "cached+first:4",
                              "dependent")
        assert r.recovery is None


def test_goal_uses_answer_in_output_and_reports_exact_match_beside_it():
    exact = {s: 0 for s in SCORES} | {"baseline": 20}
    goal = fake_report(SCORES, exact=exact).goals[0]
    assert goal.passed is True
    assert "exact match 0.0%, recovers 0% [" in goal.detail
    no_exact_gap = fake_report(SCORES, exact={s: 0 for s in SCORES}).goals[0]
    assert "exact match 0.0%, no gap" in no_exact_gap.detail


def test_goal_without_dependent_items_or_cost_is_not_measured():
    assert fake_report(SCORES, kinds=("single",)).goals[0].passed is None
    report = fake_report(SCORES)
    report.cost = None
    assert "--cost-tokens 0" in accuracy.recovery_goal(report).detail


def test_tables_show_recovery_with_intervals_and_cost_verdicts():
    speed = {s: 50.0 for s in SCORES} | {"cached+deviation:0.15": 4.0}
    report = fake_report(SCORES, speed=speed)
    rows = {r["setting"]: r for r in accuracy.recovery_table(report)}
    assert set(rows) == {s for s in SCORES if "+" in s}
    cell = rows["cached+first:4"]["dependent"]
    assert cell.startswith("70.0% +75% [+") and cell.endswith("] (+75%)")
    cost = {r["setting"]: r for r in accuracy.cost_table(report.cost)}
    assert cost["cached+first:4"][">= 10x"] == "PASS"
    assert cost["cached+deviation:0.15"][">= 10x"] == "FAIL"
    assert cost["cached+deviation:0.15"]["baseline / setting"] == 4.0
    titles = [s.title for s in accuracy.sections(report)]
    assert "Recompute cost at ~6,012 tokens" in titles and "Goals" in titles
    assert "Against the baseline, item by item" in titles
    table = accuracy.accuracy_table(report)
    assert [r["setting"] for r in table] == list(SCORES)
    assert table[2]["recomputed"] == 4


def test_the_exact_match_table_is_left_out_where_it_reads_zero_everywhere():
    zero = fake_report(SCORES, exact={s: 0 for s in SCORES})
    first = accuracy.sections(zero)[0]
    assert first.title == "Settings" and "exact match: 0 items" in first.lines[0]
    assert set(first.rows[0]) == {"setting", "mean TTFT s", "recomputed"}
    assert accuracy.sections(fake_report(SCORES))[0].title == "Exact match by question kind"


def test_the_nats_gap_won_back_per_kind_with_its_interval():
    """Gold log-prob -1 where found, -3 elsewhere: cached+first:4 finds 70 of 100 against the
    baseline's 80 and cached's 40, so it wins back 30 of the 40 items' 2 nats: 75%."""
    report = fake_report(SCORES)
    rows = {r["setting"]: r for r in accuracy.nats_recovery_table(report)}
    cell = rows["cached+first:4"]["dependent"]
    assert cell.startswith("+75% [+") and cell.endswith("]")
    titles = [s.title for s in accuracy.sections(report)]
    assert "Recompute: the gold answer's log-probability gap won back" in titles


def test_paired_table_gives_deltas_and_kl_with_intervals_per_kind_and_setting():
    report = fake_report(SCORES)
    rows = {(r["kind"], r["setting"]): r for r in accuracy.paired_table(report)}
    assert ("dependent", "baseline") not in rows
    assert set(rows) == {(k, s) for k in ("dependent", "all") for s in SCORES if s != "baseline"}
    row = rows[("dependent", "cached")]
    assert row["answer in output"] == "40/100 (40%)"
    assert row["delta pts [95% CI]"].startswith("-40.0 [-")
    assert row["gold log-prob delta"].startswith("-0.80 [-")      # 40 of 100 lose 2 nats
    assert row["per token"].startswith("-0.400 [-")
    assert row["KL nats [95% CI]"] == "0.5000 [0.5000, 0.5000]"   # constant: zero width
    csv_row = next(r for r in report.rows() if r["setting"] == "cached"
                   and r["kind"] == "dependent")
    assert csv_row["found_delta"] == pytest.approx(-0.4)
    assert csv_row["found_delta_low"] < -0.4 < csv_row["found_delta_high"]
    assert csv_row["mean_kl"] == 0.5 and csv_row["kl_low"] == csv_row["kl_high"] == 0.5


@needs_plots
def test_plot_writes_a_png(tmp_path):
    path = accuracy.plot(fake_report(SCORES), tmp_path / "accuracy.png", " (test)")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = fake_report(SCORES)
    report.cost = None
    with pytest.raises(ValueError):
        accuracy.plot(report, tmp_path / "none.png")


# --- option parsing -----------------------------------------------------------------------

def test_recompute_option_parses_lists_and_none(capsys):
    from promptlang.bench import run
    from promptlang.cli import bench as cli

    assert cli._recompute_list("first:4, deviation:15%,first:4") == ("first:4", "deviation:0.15")
    assert cli._recompute_list("none") == ()
    assert main(["bench", "accuracy", "--help"]) == 0      # the default, from its one owner
    assert ",".join(accuracy.DEFAULT_RECOMPUTE) in "".join(capsys.readouterr().out.split())
    for bad in ("first:x", "deviation:2", "sometimes:3", ",", "none,first:0"):
        with pytest.raises(argparse.ArgumentTypeError):
            cli._recompute_list(bad)
    args = argparse.Namespace(quick=True, recompute=("first:8",), cost_tokens=0)
    options = run._accuracy_options(args)
    assert options.recompute == ("first:8",) and options.cost_tokens == 0
    assert options.items_per_kind == accuracy.AccuracyOptions.quick().items_per_kind


@pytest.mark.parametrize("spec, message", [("first:x", "K must be a whole number"),
                                           ("deviation:1.5", "between 0 and 1"),
                                           ("rerun:3", "expected none, seams, first:K")])
def test_bad_recompute_spec_is_a_usage_error(spec, message, capsys):
    assert main(["bench", "accuracy", "--recompute", spec]) == 2
    err = capsys.readouterr().err
    assert "--recompute" in err and message in err


def test_command_line_keeps_zero_none_and_negated_options():
    from promptlang.cli import bench as cli

    args = argparse.Namespace(bench="accuracy", quick=False, out="bench-out", cost_tokens=0,
                              recompute=("first:4", "deviation:0.15"), func=print,
                              scaffold=None, recompute_rules=("cached",))
    assert cli.command_line(args) == ("promptlang bench accuracy --cost-tokens 0 --recompute "
                                      "first:4,deviation:0.15 --recompute-rules cached")
    args.scaffold, args.recompute = False, ()
    assert cli.command_line(args) == ("promptlang bench accuracy --cost-tokens 0 --recompute "
                                      "none --recompute-rules cached --no-scaffold")


def test_rules_and_scaffold_options_choose_the_settings():
    from promptlang.cli import build_parser

    args = build_parser().parse_args(["bench", "accuracy", "--recompute", "first:16",
                                      "--recompute-rules", "cached", "--no-scaffold"])
    from promptlang.bench import run
    from promptlang.cli import bench as cli

    options = run._accuracy_options(args)
    assert options.settings == ("baseline", "cached", "cached+first:16", "cached-bf16",
                                "isolate")
    args = build_parser().parse_args(["bench", "accuracy", "--recompute", "none", "--no-bf16"])
    assert run._accuracy_options(args).settings == accuracy.BASE_SETTINGS
    assert cli.command_line(args) == "promptlang bench accuracy --recompute none --no-bf16"
    assert accuracy.AccuracyOptions(recompute=()).settings == \
        ("baseline", "cached", "cached-bf16", "isolate", "scaffold")
    args = build_parser().parse_args(["bench", "accuracy", "--recompute", "seams,first:16",
                                      "--no-isolate", "--no-scaffold", "--no-bf16"])
    assert run._accuracy_options(args).settings == ("baseline", "cached", "cached+seams",
                                                    "cached+first:16")
    assert cli.command_line(args) == ("promptlang bench accuracy --no-isolate --recompute "
                                      "seams,first:16 --no-scaffold --no-bf16")
    with pytest.raises(ValueError):
        accuracy.settings(["first:4"], ["joint"])


# --- on a model: draft-verified greedy decoding, a quick run ------------------------------

@pytest.fixture(scope="module")
def tiny_llm():
    """A randomly initialised 2-layer Llama with the default model's tokenizer."""
    import torch
    import transformers

    from promptlang.hf_tokenizer import load_tokenizer
    from promptlang.runtime.engine import LLM

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=1024)
    return LLM.from_model(transformers.LlamaForCausalLM(config).eval(), load_tokenizer())


@pytest.mark.parametrize("setting", ["baseline", "cached", "cached+first:3", "cached-bf16",
                                     "isolate+deviation:0.3", "scaffold"])
def test_greedy_answer_matches_generate_with_any_drafts(tiny_llm, setting):
    item = qa.generate(1, seed=5, kind="dependent", docs_per_item=3, doc_words=15)[0]
    llms = accuracy._rule_llms(tiny_llm, 64 << 20)
    llm, prompt, schema, baseline, spec = accuracy._requests(item, llms, [setting])[setting]
    want = llm.generate(prompt, schema=schema, baseline=baseline, recompute=spec,
                        max_new_tokens=12)
    ids = want.token_ids
    drafts = [[], [ids[0], ids[1] + 1, *ids[2:]], ids[:5] + [7, 8, 9], ids, ids + [1, 2]]
    for tried in ([], drafts, drafts[::-1]):
        got = accuracy.greedy_answer(llm, prompt, schema, baseline=baseline, recompute=spec,
                                     max_new_tokens=12, drafts=tried)
        assert (got.text, got.token_ids, got.finish_reason) == \
            (want.text, want.token_ids, want.finish_reason)
        assert got.recomputed == want.recomputed_tokens
    assert got.passes <= 2        # the right draft first: one pass (plus one at a mismatch)


def test_accuracy_on_a_tiny_model_runs_every_setting_and_the_cost(tiny_llm):
    options = accuracy.AccuracyOptions.quick()
    report = accuracy.run_accuracy(tiny_llm, options, progress=False)
    names = options.settings
    assert "cached+first:2" in names and "isolate+deviation:0.2" in names
    assert "cached-bf16" in names
    assert {(s.setting, s.kind) for s in report.scores} == \
        {(n, k) for n in names for k in (*options.kinds, "all")}
    assert "same-shape" in options.kinds
    for result in report.results:
        assert list(result.answers) == list(names)
        assert all(math.isfinite(a.gold_logprob) and a.gold_logprob < 0 and a.kl >= -1e-12
                   for a in result.answers.values())
        assert result.answers["cached+first:2"].recomputed > 0
        assert result.answers["cached"].recomputed == 0
        assert result.answers["scaffold"].same_as_baseline in (True, False)
    cost = report.cost
    assert [p.setting for p in cost.points] == list(names[1:]) + ["cached+exact, seen before"]
    assert cost.point("cached+first:2").recomputed > 0
    assert all(len(p.seconds) == options.cost_repeats for p in cost.points)
    assert abs(cost.prompt_tokens - options.cost_tokens) <= 0.2 * options.cost_tokens
    effect = accuracy.store16_effect(report)          # the 16-bit store's effect, reported
    assert effect[0].startswith(f"cached-bf16 gives the same greedy tokens as cached (float32 "
                                f"store) on ") and f"/{len(report.results)} items" in effect[0]
    assert any(line.startswith("TTFT at ~") for line in effect)
    assert any(s.title == "A bfloat16 store against a float32 one"
               for s in accuracy.sections(report))
    assert report.goals[0].name == accuracy.GOAL_NAME
    assert [g.name.split()[0] for g in report.goals[1:]] == \
        [n for n in names if accuracy.split_setting(n)[0] == "cached"]     # the seam goal, each
    assert {(c.setting, c.kind) for c in report.comparisons} == \
        {(n, k) for n in names for k in (*options.kinds, "all")}
    assert all(c.kl.n == len(report.results) for c in report.comparisons if c.kind == "all")
    assert {"found_delta_low", "gold_logprob_delta", "kl_high"} <= set(report.rows()[0])


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, tiny_llm):
    """tiny_llm's model saved as a local transformers folder (what --model PATH takes)."""
    import shutil

    from promptlang import default_model

    folder = tmp_path_factory.mktemp("tiny")
    tiny_llm.adapter.model.save_pretrained(folder)
    for path in default_model.default_tokenizer_dir().iterdir():
        if path.is_file() and path.name != "config.json":     # keep the tiny config
            shutil.copy(path, folder / path.name)
    return folder


def test_workers_give_the_same_answers_as_one_process(tiny_model_dir):
    from promptlang.runtime import engine

    llm = engine.load(str(tiny_model_dir))
    options = accuracy.AccuracyOptions(items_per_kind=2, kinds=("dependent",), docs_per_item=2,
                                       doc_words=10, max_new_tokens=5, recompute=("first:2",),
                                       cost_tokens=0)
    one = accuracy.run_accuracy(llm, options, progress=False)
    two = accuracy.run_accuracy(llm, options, progress=False, workers=2,
                                model_source=str(tiny_model_dir), worker_threads=1)
    assert two.workers == 2 and one.workers == 1
    assert [r.item.id for r in two.results] == [r.item.id for r in one.results]
    for a, b in zip(one.results, two.results):
        assert {s: x.token_ids for s, x in a.answers.items()} == \
            {s: x.token_ids for s, x in b.answers.items()}
    assert "worker processes" in accuracy.sections(two)[0].lines[-1]


# --- gold log-probabilities and KL on a tiny model ---------------------------------------

def test_teacher_forced_gold_logprob_equals_one_plain_forward_for_the_baseline(tiny_llm):
    import torch

    item = qa.generate(1, seed=3, kind="same-shape", docs_per_item=2, doc_words=12)[0]
    llms = accuracy._rule_llms(tiny_llm, 64 << 20)
    llm, prompt, schema, baseline, spec = accuracy._requests(item, llms, ["baseline"])["baseline"]
    gold = accuracy.gold_ids(llm, item) + [17, 4242]        # at least three tokens
    got = accuracy.greedy_answer(llm, prompt, schema, baseline=True, max_new_tokens=4,
                                 gold=gold)
    ids = llm.bind(prompt, schema=schema).token_ids() + gold
    with torch.inference_mode():
        logits = tiny_llm.adapter.model(torch.tensor([ids])).logits[0].double()
    logprobs = torch.log_softmax(logits, dim=-1)
    n = len(ids) - len(gold)
    want = sum(float(logprobs[n - 1 + k, token]) for k, token in enumerate(gold))
    assert got.gold_logprob == pytest.approx(want, abs=1e-4)
    assert got.first_logprobs == pytest.approx(logprobs[n - 1].numpy(), abs=1e-4)
    # the teacher-forced tokens were rolled back: the answer is generate's
    want_answer = llm.generate(prompt, schema=schema, baseline=True, max_new_tokens=4)
    assert got.token_ids == want_answer.token_ids


def test_kl_is_about_zero_where_a_setting_computes_what_the_baseline_does(tiny_llm):
    item = qa.generate(1, seed=4, kind="dependent", docs_per_item=2, doc_words=12)[0]
    llms = accuracy._rule_llms(tiny_llm, 64 << 20)
    options = accuracy.AccuracyOptions(max_new_tokens=3)
    result = accuracy._answer(item, llms, options, ["baseline", "scaffold", "isolate"],
                              accuracy._Quiet())
    answers = result.answers
    assert answers["baseline"].kl == 0.0
    # one scaffold of every document computes the baseline's tokens exactly (up to float
    # rounding); isolated documents do not (a random tiny model: small but far larger)
    assert abs(answers["scaffold"].kl) < 1e-9
    assert answers["isolate"].kl > 1e-7
    assert answers["scaffold"].gold_logprob == pytest.approx(answers["baseline"].gold_logprob,
                                                             abs=1e-4)
    assert answers["baseline"].gold_tokens == len(accuracy.gold_ids(tiny_llm, item))


def test_exact_is_the_baseline_per_item_and_its_repeat_is_served_exactly(tiny_llm):
    """cached+exact answers each item as the baseline does (the settings share a store with
    exact reuse off, so no setting sees another's exact units); the cost section adds the
    same exact request once more with exact reuse on: nothing recomputed."""
    from dataclasses import replace

    options = replace(accuracy.AccuracyOptions.quick(), recompute=("exact",), kinds=("dependent",),
                      items_per_kind=2, store16=False, scaffold=False)
    report = accuracy.run_accuracy(tiny_llm, options, progress=False)
    assert "cached+exact" in options.settings
    for result in report.results:
        assert result.answers["cached+exact"].same_as_baseline
        assert result.answers["cached+exact"].recomputed > 0
    exact_point = report.cost.point("cached+exact")
    reuse = report.cost.point(accuracy.seen_before("cached+exact"))
    assert exact_point.recomputed > 0 and reuse.recomputed == 0
    assert len(reuse.seconds) == options.cost_repeats


def test_the_settings_compute_a_repeated_question_every_time(tiny_llm):
    """The cost section times the same question again and again: no setting may serve it
    from an earlier request's prompt tail (runtime/kv/tails.py), or its TTFT is a repeat's."""
    item = qa.generate(1, seed=5, kind="dependent", docs_per_item=2, doc_words=12)[0]
    llms = accuracy._rule_llms(tiny_llm, 64 << 20)
    llm, prompt, schema, _, spec = accuracy._requests(item, llms, ["cached"])["cached"]
    first, again = (llm.generate(prompt, schema=schema, max_new_tokens=1, recompute=spec)
                    for _ in range(2))
    assert again.tail_tokens == 0 and again.prefill_tokens == first.prefill_tokens > 1
