"""The accuracy report as tables and sections (text and Markdown), the accuracy-against-TTFT
plot (matplotlib, the `bench` extra) and the JSON of every number.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from promptlang.bench import metrics
from promptlang.bench.settings import DESCRIPTIONS, STORE16, split_setting
from promptlang.bench.report import Section
from promptlang.bench.accuracy.results import (AccuracyReport, CostReport, GOAL_KIND,
                                               GOAL_SPEEDUP, wilson_interval)
from promptlang.errors import InvalidArgumentError
from promptlang.bench.accuracy.scores import (Recovery, _pct, _share, recompute_settings,
                                              recovery)


def accuracy_table(report: AccuracyReport, count: str = "correct") -> list[dict[str, Any]]:
    """Rows of setting x kind cells "hits/items (pct)", counting Score.`count`
    ("correct", "found" or "agree"; "agree" leaves out the baseline itself)."""
    kinds = [*report.options.kinds, "all"]
    cells = {(s.setting, s.kind): s for s in report.scores}
    rows = []
    for setting in report.settings:
        if count == "agree" and setting == "baseline":
            continue
        row: dict[str, Any] = {"setting": setting}
        for kind in kinds:
            s = cells[(setting, kind)]
            hits = getattr(s, count)
            row[kind] = f"{hits}/{s.items} ({100 * hits / s.items:.0f}%)" if s.items else "n/a"
        if count != "agree":
            s = cells[(setting, "all")]
            low, high = wilson_interval(getattr(s, count), s.items)
            row["95% CI (all)"] = f"{100 * low:.0f}-{100 * high:.0f}%"
        if count == "correct":
            row["mean TTFT s"] = round(s.ttft, 3)
            row["recomputed"] = round(s.recomputed, 1)
        rows.append(row)
    return rows


def settings_table(report: AccuracyReport) -> list[dict[str, Any]]:
    """Per setting: its mean TTFT and recomputed tokens over all items (what the exact-match
    table shows beside its counts, for runs where those counts are all zero)."""
    cells = {s.setting: s for s in report.scores if s.kind == "all"}
    return [{"setting": setting, "mean TTFT s": round(cells[setting].ttft, 3),
             "recomputed": round(cells[setting].recomputed, 1)}
            for setting in report.settings]


def _recovered(r: Recovery, interval: bool = False) -> str:
    if r.recovery is None:
        return "no gap"
    text = f"{100 * r.recovery:+.0f}%"
    if interval:
        text += f" [{_share(r.interval.low)}, {_share(r.interval.high)}]"
    return text


def recovery_table(report: AccuracyReport) -> list[dict[str, Any]]:
    """Per recompute setting and kind: its answer-in-output rate and the share of the
    cached-vs-baseline gap it recovers with its 95% paired bootstrap interval (exact
    match's share in brackets)."""
    rows = []
    for setting in recompute_settings(report):
        row: dict[str, Any] = {"setting": setting}
        for kind in [*report.options.kinds, "all"]:
            found, exact = (recovery(report, setting, kind, m) for m in ("found", "correct"))
            if found is None:
                row[kind] = "n/a"
                continue
            row[kind] = (f"{_pct(found.value)} {_recovered(found, interval=True)} "
                         f"({_recovered(exact)})")
        if report.cost is not None:
            speed = report.cost.speedup(setting)
            row["x faster at ~6k"] = None if speed is None else round(speed, 1)
        rows.append(row)
    return rows


def nats_recovery_table(report: AccuracyReport) -> list[dict[str, Any]]:
    """Per recompute setting and kind: the share of the gold answer's log-probability gap
    (baseline - cached, in nats) it recovers, with its 95% paired bootstrap interval."""
    rows = []
    for setting in recompute_settings(report):
        row: dict[str, Any] = {"setting": setting}
        for kind in [*report.options.kinds, "all"]:
            r = recovery(report, setting, kind, "gold_logprob")
            row[kind] = "n/a" if r is None else _recovered(r, interval=True)
        rows.append(row)
    return rows


def paired_table(report: AccuracyReport) -> list[dict[str, Any]]:
    """Per kind and setting (the baseline left out): answer in output, its difference
    from the baseline in points, the gold answer's log-probability difference (sum and
    per token, nats) and the mean KL(baseline || setting), each with its 95% paired
    bootstrap interval."""
    rows = []
    for kind in [*report.options.kinds, "all"]:
        for setting in report.settings:
            cell = report.cell(setting, kind)
            paired = report.comparison(setting, kind)
            if setting == "baseline" or cell is None or paired is None or not cell.items:
                continue
            rows.append({"kind": kind, "setting": setting,
                         "answer in output": f"{cell.found}/{cell.items} "
                                             f"({100 * cell.rate('found'):.0f}%)",
                         "distracted": cell.distracted,
                         "delta pts [95% CI]": paired.found.text(100, 1),
                         "gold log-prob delta": paired.gold_logprob.text(1, 2),
                         "per token": paired.gold_logprob_token.text(1, 3),
                         "KL nats [95% CI]": paired.kl.text(1, 4, signed=False)})
    return rows


def cost_table(cost: CostReport) -> list[dict[str, Any]]:
    rows = [{"setting": "baseline", "TTFT s": round(cost.baseline_median, 3),
             "min s": round(min(cost.baseline), 3), "recomputed": 0, "select s": 0.0,
             "baseline / setting": 1.0, ">= 10x": ""}]
    for p in cost.points:
        speed = cost.speedup(p.setting)
        rows.append({"setting": p.setting, "TTFT s": round(p.median, 4),
                     "min s": round(min(p.seconds), 4), "recomputed": p.recomputed,
                     "select s": round(p.select, 4),
                     "baseline / setting": None if speed is None else round(speed, 1),
                     ">= 10x": "PASS" if speed is not None and speed >= GOAL_SPEEDUP
                     else "FAIL"})
    return rows


def store16_effect(report: AccuracyReport) -> list[str]:
    """cached-bf16 against cached: the same answers how often, and the rates side by side."""
    both = [r for r in report.results if STORE16 in r.answers and "cached" in r.answers]
    if not both:
        return []
    same = sum(r.answers[STORE16].token_ids == r.answers["cached"].token_ids for r in both)
    lines = [f"{STORE16} gives the same greedy tokens as cached (float32 store) on {same}/"
             f"{len(both)} items ({100 * same / len(both):.0f}%), at half the KV bytes per token"]
    for kind in [*report.options.kinds, "all"]:
        a = report.cell("cached", kind)
        b = report.cell(STORE16, kind)
        if a is not None and b is not None and a.items:
            lines.append(f"{kind}: answer in output {_pct(a.rate('found'))} (float32) vs "
                         f"{_pct(b.rate('found'))} (bfloat16); exact match "
                         f"{_pct(a.rate('correct'))} vs {_pct(b.rate('correct'))}")
    if report.cost is not None and report.cost.ttft(STORE16) and report.cost.ttft("cached"):
        lines.append(f"TTFT at ~{report.cost.prompt_tokens:,} tokens: "
                     f"{report.cost.ttft('cached') * 1e3:.1f} ms (float32) vs "
                     f"{report.cost.ttft(STORE16) * 1e3:.1f} ms (bfloat16, "
                     f"{report.store16_read})")
    return lines


def sections(report: AccuracyReport) -> list[Section]:
    o = report.options
    words = "default lengths" if o.doc_words is None else f"{o.doc_words} words each"
    specs = ", ".join(o.recompute) or "none"
    notes = [
        f"items per kind: {o.items_per_kind}; documents per item: {o.docs_per_item} "
        f"({words}), seed {o.seed}, greedy, at most {o.max_new_tokens} new tokens; "
        f"model {report.model}; recompute policies: {specs}",
        *(f"{name}: {text}" for name, text in DESCRIPTIONS.items()),
        "mean TTFT includes encoding the item's documents where a setting encodes them "
        "(each prompt is used once); recomputed: mean cached tokens computed again",
        f"wall time {report.seconds / 60:.1f} min" + (
            f"; items answered by {report.workers} worker processes (their TTFTs include "
            "each other's contention)" if report.workers > 1 else "")]
    if any(score.correct for score in report.scores):
        first = Section("Exact match by question kind", accuracy_table(report), notes)
    else:
        first = Section("Settings", settings_table(report), [
            "exact match: 0 items for every setting and kind (the answers are sentences; "
            "the counts are in the JSON)", *notes])
    parts = [
        first,
        Section("Answer in the output, before any distractor's",
                accuracy_table(report, "found"),
                ["the answer as whole words in the generated text, with no distractor answer "
                 "(another person's value for the asked attribute, qa.answer_in_output) "
                 "before its first occurrence"]),
        Section("Same greedy output as the baseline", accuracy_table(report, "agree"),
                ["identical generated token ids"]),
    ]
    if report.comparisons:
        parts.append(Section("Against the baseline, item by item", paired_table(report), [
            "delta: mean of (setting - baseline) over the items, in points of answer in "
            "output; gold log-prob: the gold answer's tokens teacher-forced after the "
            "setting's own prefill, summed (and per token), in nats; KL: KL(baseline || "
            "setting) of the first generated token's distribution, in nats",
            f"[low, high]: 95% paired bootstrap intervals ({o.resamples:,} resamples of the "
            f"items, seed {o.bootstrap_seed}); distracted: outputs with a distractor's answer "
            "before, or instead of, the gold one"]))
    effect = store16_effect(report)
    if effect:
        parts.append(Section("A bfloat16 store against a float32 one", (), effect))
    if recompute_settings(report):
        parts.append(Section("Recompute: the cached-vs-baseline gap won back",
                             recovery_table(report), [
            "per kind: answer-in-output rate, then the share of the gap (baseline - "
            "cached) the setting recovers: (setting - cached) / gap, with its 95% paired "
            "bootstrap interval (-inf: resamples without a gap); exact match's recovery in "
            "brackets; 'no gap' where cached is not worse than the baseline",
            "isolate+SPEC is measured against the same cached (guaranteed context) gap"]))
        parts.append(Section("Recompute: the gold answer's log-probability gap won back",
                             nats_recovery_table(report), [
            "per kind: the share of the gap in the gold answer's teacher-forced "
            "log-probability (baseline - cached, nats, summed over its tokens) the setting "
            "recovers, with its 95% paired bootstrap interval; 'no gap' where cached is not "
            "below the baseline"]))
    if report.cost is not None:
        c = report.cost
        parts.append(Section(f"Recompute cost at ~{c.prompt_tokens:,} tokens", cost_table(c), [
            f"one {GOAL_KIND} item scaled to {c.prompt_tokens:,} prompt tokens "
            f"({c.cached_tokens:,} cached) in {c.docs} document modules plus its question"
            + (f" ({c.note})" if c.note else ""),
            f"baseline: full prefill, median of {len(c.baseline)}; each setting warm (its "
            f"units encoded by an untimed request), median of {o.cost_repeats}; one new "
            "token; recomputed: tokens computed again per request; select: seconds choosing "
            "them (deviation's layer-1 pass)",
            "cached+exact recomputes every token that missed something each time (a new "
            "combination of modules), cached+seams every one that missed a module or text; "
            "'SETTING, seen before' is the same request again with exact reuse on: served "
            "the units the first one made exact",
            f"this section took {c.seconds / 60:.1f} min, encoding included"]))
    parts.append(Section("Goals", (), [str(g) for g in report.goals]))
    return parts


def plot(report: AccuracyReport, path, note: str = "") -> Path:
    """Answer-in-output rate (dependent items, and all kinds) against the warm TTFT at
    ~6k tokens, one labelled point per setting, the baseline included, and a dashed line
    where a setting is 10x faster than the baseline; written as PNG. Needs the cost
    section (report.cost)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if report.cost is None:
        raise InvalidArgumentError("no recompute cost measured: nothing to plot against")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    kinds = [k for k in (GOAL_KIND, "all") if k == "all" or k in report.options.kinds]
    fig, axes = plt.subplots(1, len(kinds), figsize=(6 * len(kinds), 4.8), squeeze=False)
    try:
        for ax, kind in zip(axes[0], kinds):
            shown = 0
            for setting in report.settings:
                ttft = report.cost.ttft(setting)
                cell = report.cell(setting, kind)
                if ttft is None or cell is None or not cell.items:
                    continue
                rule = split_setting(setting)[0]
                marker = {"baseline": "s", "cached": "o", "isolate": "^"}.get(rule, "D")
                y = 100 * cell.rate("found")
                ax.scatter([ttft], [y], marker=marker)
                ax.annotate(setting, (ttft, y), fontsize=7, textcoords="offset points",
                            xytext=(5, (5, -10, 14)[shown % 3]))     # staggered: no overlap
                shown += 1
            ax.axvline(report.cost.baseline_median / GOAL_SPEEDUP, color="grey",
                       linestyle="--", label=f"{GOAL_SPEEDUP:g}x faster than the baseline")
            ax.set_xscale("log")
            ax.set_ylim(bottom=0)
            ax.set_xlabel(f"warm TTFT at ~{report.cost.prompt_tokens:,} tokens (s)")
            ax.set_ylabel("answer in output (%)")
            ax.set_title(f"{kind} items")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(loc="lower right", fontsize=7)
        fig.suptitle(f"Accuracy against TTFT, {report.model}{note}")
        fig.tight_layout()
        fig.savefig(path, format="png", dpi=120)
    finally:
        plt.close(fig)
    return path


def to_json(report: AccuracyReport) -> dict[str, Any]:
    from dataclasses import asdict

    cost = None
    if report.cost is not None:
        cost = asdict(report.cost) | {"baseline_median_s": report.cost.baseline_median,
                                      "speedup": {p.setting: report.cost.speedup(p.setting)
                                                  for p in report.cost.points}}
    return {"model": report.model, "options": asdict(report.options),
            "settings": list(report.settings), "seconds": report.seconds,
            "scores": report.rows(), "cost": cost,
            "bootstrap": {"resamples": report.options.resamples,
                          "seed": report.options.bootstrap_seed, "level": metrics.LEVEL},
            "goals": [asdict(g) | {"verdict": g.verdict} for g in report.goals]}
