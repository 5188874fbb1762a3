"""The latency goals, each judged once on the median of per-round ratios: cached
TTFT against the machine's floor, the speedup over the baseline, the TTFT exponent, the
break-even length, decode speed, and first-token agreement.
"""

from __future__ import annotations

import statistics
from typing import Sequence

from promptlang.bench.report import Goal, fit_exponent
from promptlang.bench.latency.results import AGREE_GOAL, FIT_RANGE, LatencyReport, Point


def _nearest(lengths: Sequence[int], target: int) -> int:
    return min(lengths, key=lambda n: (abs(n - target), n))


def exponents(points: Sequence[Point]) -> tuple[float | None, float | None, str]:
    """(cached exponent, baseline exponent, over what) of TTFT against cached tokens,
    fitted over FIT_RANGE, or over every point when fewer than two fall in it."""
    inside = [p for p in points if FIT_RANGE[0] <= p.cached_tokens <= FIT_RANGE[1]]
    span = f"{FIT_RANGE[0]:,}-{FIT_RANGE[1]:,} cached tokens"
    if len({p.cached_tokens for p in inside}) < 2:
        inside = list(points)
        span = f"all {len(points)} points (fewer than two in {span})"
    if len({p.cached_tokens for p in inside}) < 2:
        return None, None, "fewer than two lengths"
    xs = [p.cached_tokens for p in inside]
    cached = fit_exponent(xs, [p.median("device") for p in inside])[0]
    baseline = fit_exponent(xs, [p.median("baseline") for p in inside])[0]
    return cached, baseline, span


def _where(point: Point, target: int) -> str:
    """Which point a goal was checked at, flagged when it is far from the goal's length."""
    where = f"at {point.cached_tokens:,} cached tokens"
    if abs(point.cached_tokens - target) > 0.25 * target:
        where += f" (the measured point nearest {target:,})"
    return where


def latency_goals(report: LatencyReport) -> list[Goal]:
    """The latency goals, each judged once on the per-round ratios of the point
    nearest its length (the samples declared in the options), and the agreement check."""
    points = report.points
    options = report.options
    if not points:
        return [Goal("latency goals", None, "no length fits the model's context")]
    at = min(points, key=lambda p: (abs(p.cached_tokens - options.goal_length), p.target))
    where = _where(at, options.goal_length)
    x = at.x_floor
    up = at.speedup
    sgemm = report.machine.get("matmul_sgemm") or "the best sgemm"
    goals = [
        Goal("cached TTFT <= 2x floor", x.median <= 2,
             f"{where}: {x.describe(unit='x')} the floor, per interleaved round; cached "
             f"{at.median('device') * 1e3:.1f} ms, floor {at.floor * 1e3:.1f} ms (medians; "
             f"compute rate from a {sgemm} sgemm)"),
        Goal("cached >= 100x faster than baseline", up.median >= 100,
             f"{where}: {up.describe('{:.0f}', 'x')} per interleaved round (baseline "
             f"{at.median('baseline'):.2f} s, cached {at.median('device') * 1e3:.1f} ms)"),
    ]
    k_cached, k_baseline, span = exponents(points)
    if k_cached is None:
        goals.append(Goal("cached TTFT exponent <= 1.2", None, span))
    else:
        goals.append(Goal("cached TTFT exponent <= 1.2", k_cached <= 1.2,
                          f"{k_cached:.2f} (baseline {k_baseline:.2f}) over {span}, "
                          "fitted to the medians"))
    small = min(points, key=lambda p: (abs(p.cached_tokens - 512), p.target))
    goals.append(Goal("cached beats baseline at 512 cached tokens", small.speedup.median > 1,
                      f"{_where(small, 512)}: baseline / cached "
                      f"{small.speedup.describe(unit='x')} per round; cached "
                      f"{small.median('device') * 1e3:.1f} ms, baseline "
                      f"{small.median('baseline') * 1e3:.1f} ms"))
    d = report.decode
    if d is None:
        goals.append(Goal("decode per token <= 1.5x transformers generate", None,
                          "not measured (no goal-length point, or the model stopped at once)"))
    else:
        goals.append(Goal("decode per token <= 1.5x transformers generate",
                          d.ratio.median <= 1.5,
                          f"with {d.context_tokens:,} tokens of context: "
                          f"{d.ratio.describe(unit='x')} per interleaved pair of runs; "
                          f"{statistics.median(d.ours) * 1e3:.1f} ms against "
                          f"{statistics.median(d.hf) * 1e3:.1f} ms (medians; {d.tokens} "
                          f"tokens, transformers attention {d.hf_attention})"))
    goals.append(agreement_goal(points))
    return goals


def agreement_goal(points: Sequence[Point]) -> Goal:
    """PASS when cached and baseline picked the same greedy first token in every round
    at every length (the single-document prompt is prefix-shaped: they must agree)."""
    if not points:
        return Goal(AGREE_GOAL, None, "no length measured")
    wrong = [p for p in points if not p.agreement.agrees]
    largest = max(p.agreement.max_logit_diff for p in points)
    if wrong:
        return Goal(AGREE_GOAL, False, "disagree at " + ", ".join(
            f"{p.cached_tokens:,} cached tokens ({p.agreement.disagreements} of "
            f"{p.agreement.samples} rounds; max |logit diff| {p.agreement.max_logit_diff:.3g})"
            for p in wrong))
    return Goal(AGREE_GOAL, True, f"every round at {len(points)} lengths; max |logit diff| "
                                  f"{largest:.3g}")
