"""The seam goals: cached answers as right as the full prefill, at cached speed.

For every setting served from the guaranteed-context rule's modules (`cached`, and each
`cached+SPEC`), one goal line: PASS when on every kind of the run

- answer in output is within SEAM_POINTS points of the baseline's (the paired mean
  difference, setting - baseline, >= -SEAM_POINTS points),
- the gold answer's mean teacher-forced log-probability is within SEAM_NATS nats of the
  baseline's (paired mean difference >= -SEAM_NATS),

and the setting's warm TTFT at ~6k tokens is at least SEAM_SPEEDUP x faster than the
baseline's (the cost section). The paired 95% intervals are printed beside the point
estimates, which decide. The line of `cached` is policy `none`'s; the default policy's
(`exact`) says so.
"""

from __future__ import annotations

from promptlang.bench.accuracy.results import AccuracyReport
from promptlang.bench.report import Goal
from promptlang.bench.accuracy.cost import seen_before
from promptlang.bench.settings import split_setting
from promptlang.runtime.recompute.policy import DEFAULT_POLICY

SEAM_POINTS = 2.0       # answer-in-output points below the baseline's, at most
SEAM_NATS = 0.15        # gold log-probability nats below the baseline's, at most
SEAM_SPEEDUP = 30.0     # x the baseline's TTFT at ~6k tokens, at least
SEAM_NAME = "as right as the full prefill at >= 30x"


def seam_goals(report: AccuracyReport) -> list[Goal]:
    """One goal per cached setting of the run (see the module docstring)."""
    names = [s for s in report.settings if split_setting(s)[0] == "cached"]
    if "baseline" not in report.settings or not names:
        return [Goal(SEAM_NAME, None, "needs the baseline and a cached setting")]
    return [_goal(report, setting) for setting in names]


def _goal(report: AccuracyReport, setting: str) -> Goal:
    kinds = list(report.options.kinds)
    failed = []
    parts = []
    for kind in kinds:
        c = report.comparison(setting, kind)
        if c is None or c.found.estimate is None:
            return Goal(f"{setting} {SEAM_NAME}", None, f"no comparison on {kind} items")
        points = 100 * c.found.estimate
        nats = c.gold_logprob.estimate
        ok = points >= -SEAM_POINTS and (nats is not None and nats >= -SEAM_NATS)
        if not ok:
            failed.append(kind)
        parts.append(f"{kind} {c.found.text(100, 1)} pts, {c.gold_logprob.text(1, 2)} nats")
    speed = None if report.cost is None else report.cost.speedup(setting)
    if speed is None:
        speed_text = "cost not measured"
        fast = None
    else:
        speed_text = f"{speed:.1f}x faster at ~{report.cost.prompt_tokens:,} tokens"
        fast = speed >= SEAM_SPEEDUP
        again = report.cost.speedup(seen_before(setting))
        if again is not None:
            speed_text += f" ({again:.1f}x for the same modules seen before)"
    default = " (the default policy)" if split_setting(setting)[1] == DEFAULT_POLICY else ""
    verdict = None if fast is None and not failed else (not failed and bool(fast))
    why = []
    if failed:
        why.append(f"outside {SEAM_POINTS:g} points / {SEAM_NATS:g} nats on "
                   f"{', '.join(failed)}")
    if fast is False:
        why.append(f"under {SEAM_SPEEDUP:g}x")
    detail = (f"setting - baseline per kind (95% paired intervals): {'; '.join(parts)}; "
              f"{speed_text}" + (f"; {', '.join(why)}" if why else ""))
    return Goal(f"{setting}{default} {SEAM_NAME}", verdict, detail)
