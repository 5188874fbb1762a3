"""Scores per setting and kind, paired comparisons with the baseline, the recovery of the
cached-vs-baseline gap by a recompute setting, and the recompute goal judged on intervals.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Sequence

from promptlang.bench import metrics
from promptlang.bench.report import Goal
from promptlang.bench.accuracy.results import (AccuracyReport, Comparison, GOAL_KIND,
                                               GOAL_METRIC, GOAL_NAME, GOAL_RECOVERY,
                                               GOAL_SPEEDUP, ItemResult, METRIC_NAMES, Score,
                                               _settings_of)


def score(results: Sequence[ItemResult], kinds: Sequence[str],
          names: Sequence[str] | None = None) -> list[Score]:
    """One Score per (setting, kind), then per setting over all kinds. `names`: the
    settings (default: those of the first result)."""

    def mean(values):
        return statistics.fmean(values) if values else 0.0

    def measured(values):
        if any(not math.isnan(v) for v in values):
            return statistics.fmean(v for v in values if not math.isnan(v))
        return math.nan

    scores = []
    for setting in names or _settings_of(results):
        for kind in [*kinds, "all"]:
            mine = [r for r in results if kind == "all" or r.item.kind == kind]
            answers = [r.answers[setting] for r in mine]
            scores.append(Score(setting, kind, len(answers), sum(a.correct for a in answers),
                                sum(a.found for a in answers),
                                sum(a.same_as_baseline for a in answers),
                                mean([a.ttft for a in answers]), mean([a.encode for a in answers]),
                                mean([a.recomputed for a in answers]),
                                sum(a.distracted for a in answers),
                                measured([a.gold_logprob for a in answers]),
                                measured([a.gold_logprob_token for a in answers]),
                                measured([a.kl for a in answers])))
    return scores


PER_ITEM = {   # metric -> its value for one answer (booleans as 0/1, NaN: not measured)
    "found": lambda a: float(a.found), "correct": lambda a: float(a.correct),
    "gold_logprob": lambda a: a.gold_logprob,
    "gold_logprob_token": lambda a: a.gold_logprob_token, "kl": lambda a: a.kl}


def item_values(results: Sequence[ItemResult], setting: str, kind: str,
                metric: str) -> list[float]:
    """`metric` of `setting`'s answer on every item of `kind` ("all": every item)."""
    value = PER_ITEM[metric]
    return [value(r.answers[setting]) for r in results
            if kind == "all" or r.item.kind == kind]


def compare(results: Sequence[ItemResult], kinds: Sequence[str],
            names: Sequence[str] | None = None, *, resamples: int = metrics.RESAMPLES,
            seed: int = metrics.SEED) -> list[Comparison]:
    """One Comparison per (setting, kind) and per setting over all kinds; empty when
    the baseline was not run."""
    names = list(names or _settings_of(results))
    if "baseline" not in names:
        return []
    out = []
    for setting in names:
        for kind in [*kinds, "all"]:
            def diff(metric: str) -> metrics.Interval:
                return metrics.paired_difference(
                    item_values(results, setting, kind, metric),
                    item_values(results, "baseline", kind, metric),
                    resamples=resamples, seed=seed)
            kl = metrics.mean_interval(item_values(results, setting, kind, "kl"),
                                       resamples=resamples, seed=seed)
            out.append(Comparison(setting, kind, diff("found"), diff("correct"),
                                  diff("gold_logprob"), diff("gold_logprob_token"), kl))
    return out


# --- recovery and the goal --------------------------------------------------------------

@dataclass(frozen=True)
class Recovery:
    """How much of the cached-vs-baseline gap a setting wins back on one kind and metric."""

    setting: str
    kind: str
    metric: str
    baseline: float          # means over the items (rates in [0, 1] for found/correct)
    cached: float
    value: float
    interval: metrics.Interval = metrics.NO_ITEMS   # the recovery's paired bootstrap one

    @property
    def gap(self) -> float:
        return self.baseline - self.cached

    @property
    def recovery(self) -> float | None:
        """(setting - cached) / gap; None when there is no gap (<= 0) to recover."""
        if self.gap <= 0:
            return None
        return (self.value - self.cached) / self.gap


def recovery(report: AccuracyReport, setting: str, kind: str, metric: str = GOAL_METRIC,
             level: float = metrics.LEVEL) -> Recovery | None:
    """The Recovery of `setting` on `kind` by `metric` ("found", "correct" or
    "gold_logprob"), with its interval at `level` (None if either was not measured)."""
    cells = [report.cell(s, kind) for s in ("baseline", "cached", setting)]
    if any(cell is None or not cell.items for cell in cells):
        return None
    columns = [item_values(report.results, s, kind, metric)
               for s in ("baseline", "cached", setting)]
    if not len(metrics.paired_columns(*columns)[0]):
        return None          # measured on no item (gold log-probs: no gold tokens)
    base, cached, value = (float(c.mean()) if len(c) else math.nan
                           for c in metrics.paired_columns(*columns))
    o = report.options
    interval = metrics.recovery_interval(*columns, resamples=o.resamples,
                                         seed=o.bootstrap_seed, level=level)
    return Recovery(setting, kind, metric, base, cached, value, interval)


def recompute_settings(report: AccuracyReport) -> list[str]:
    return [s for s in report.settings if "+" in s]


def _pct(rate: float) -> str:
    return f"{100 * rate:.1f}%"


def _share(value: float) -> str:
    if math.isinf(value):
        return "-inf" if value < 0 else "+inf"
    return f"{100 * value:+.0f}%"


def _recovery_text(r: Recovery | None) -> str:
    """"recovers 75% [+20%, +130%]" (the interval at r.interval.level)."""
    if r is None:
        return "not measured"
    if r.recovery is None:
        return "no gap"
    i = r.interval
    return f"recovers {100 * r.recovery:.0f}% [{_share(i.low)}, {_share(i.high)}]"


def recovery_goal(report: AccuracyReport) -> Goal:
    """The recompute goal on GOAL_KIND items, by GOAL_METRIC, judged on intervals: among
    the recompute settings at least GOAL_SPEEDUP x faster than the baseline (k of them),
    it passes when one's recovery interval at the Bonferroni level 1 - 0.05/k (so that
    picking the best of k is accounted for) lies at or above GOAL_RECOVERY."""
    names = recompute_settings(report)
    if GOAL_KIND not in report.options.kinds:
        return Goal(GOAL_NAME, None, f"no {GOAL_KIND} items in this run (--kinds)")
    if not names:
        return Goal(GOAL_NAME, None, "no recompute setting in this run (--recompute)")
    if report.cost is None:
        return Goal(GOAL_NAME, None, "the ~6k-token cost was not measured (--cost-tokens 0)")
    metric = METRIC_NAMES[GOAL_METRIC]
    fast = [s for s in names if (report.cost.speedup(s) or 0) >= GOAL_SPEEDUP]
    level = metrics.bonferroni(metrics.LEVEL, len(fast) or len(names))
    found = {s: recovery(report, s, GOAL_KIND, level=level) for s in names}
    exact = {s: recovery(report, s, GOAL_KIND, "correct", level=level) for s in names}
    logprob = {s: recovery(report, s, GOAL_KIND, "gold_logprob", level=level) for s in names}
    first = next(iter(found.values()))
    n = report.cell("baseline", GOAL_KIND).items
    gap = report.comparison("cached", GOAL_KIND)
    gap_text = "" if gap is None else \
        f", cached - baseline {gap.found.text(100, 1)} points (95%)"
    head = (f"{GOAL_KIND}, {metric} (exact match beside it), {n} items: baseline "
            f"{_pct(first.baseline)} ({_pct(exact[names[0]].baseline)}), cached "
            f"{_pct(first.cached)} ({_pct(exact[names[0]].cached)}){gap_text}")
    at = f"~{report.cost.prompt_tokens:,} tokens"
    if first.gap <= 0:
        return Goal(GOAL_NAME, None, f"{head}: no gap to recover (cached is not worse than "
                                     f"the baseline by {metric})")

    def describe(s: str) -> str:
        speed = report.cost.speedup(s)
        text = (f"{s} {_pct(found[s].value)} {_recovery_text(found[s])} of the "
                f"{100 * first.gap:.1f}-point gap (exact match {_pct(exact[s].value)}, "
                f"{_recovery_text(exact[s])}; gold log-prob {_recovery_text(logprob[s])})")
        return text + (f", {speed:.1f}x faster than the baseline at {at}"
                       if speed is not None else ", cost not measured")

    def rank(s: str) -> tuple:
        return (found[s].interval.low, found[s].recovery, report.cost.speedup(s) or 0)

    best_any = max(names, key=rank)
    intervals = (f"intervals at {100 * level:.4g}% (Bonferroni over {len(fast) or len(names)} "
                 f"settings); PASS needs the low end >= {100 * GOAL_RECOVERY:.0f}%")
    if not fast:
        return Goal(GOAL_NAME, False, f"{head}; no recompute setting is {GOAL_SPEEDUP:g}x "
                                      f"faster than the baseline at {at}; best by recovery: "
                                      f"{describe(best_any)}; {intervals}")
    best = max(fast, key=rank)
    detail = f"{head}; best at >= {GOAL_SPEEDUP:g}x: {describe(best)}"
    if best_any != best:
        detail += f"; best regardless of speed: {describe(best_any)}"
    return Goal(GOAL_NAME, found[best].interval.low >= GOAL_RECOVERY,
                f"{detail}; {intervals}")
