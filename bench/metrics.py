"""Paired statistics for `bench accuracy`: bootstrap intervals over items, the share of
a gap a setting recovers, and the KL divergence between two next-token distributions.

Every item is answered under every setting, so settings are compared item by item.
A paired difference is d_i = m_setting(i) - m_baseline(i); its mean's interval comes
from the bootstrap: each of `resamples` resamples draws n item indices with replacement
(numpy's PCG64 seeded with `seed`; the same draws for every setting and metric of the
same n, so one run's intervals are reproducible and comparable), and the interval is
the (alpha/2, 1 - alpha/2) order statistics of the resampled means ("lower" and
"higher" quantiles: never narrower than interpolation would give). A constant
difference gives a zero-width interval.

Recovery: for per-item values of the baseline b, the cached rule c and a setting s, the
recovery is mean(s - c) / mean(b - c), the share of the gap the setting wins back. Its
interval takes the ratio in every resample; a resample with no gap (mean(b - c) <= 0)
has nothing to recover and counts as minus infinity, so a gap that is not itself clear
of zero leaves the interval's low end at minus infinity.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import numpy as np

from promptlang.errors import InvalidArgumentError

RESAMPLES = 2000
SEED = 0
LEVEL = 0.95


@dataclass(frozen=True)
class Interval:
    """A statistic and its bootstrap interval over `n` items."""

    estimate: float | None     # None: undefined on the data (a recovery with no gap)
    low: float
    high: float
    n: int
    level: float = LEVEL
    undefined: float = 0.0     # share of resamples where the statistic is undefined

    def excludes(self, value: float) -> bool:
        """Whether `value` lies outside [low, high]."""
        return not (self.low <= value <= self.high)

    def text(self, scale: float = 1.0, digits: int = 2, signed: bool = True) -> str:
        """"+1.25 [-0.50, +3.00]" (values times `scale`; `signed`: with their signs),
        "n/a" with no items."""
        if self.n == 0:
            return "n/a"

        def number(x: float | None) -> str:
            if x is None:
                return "none"
            if math.isinf(x):
                return "-inf" if x < 0 else "+inf"
            return f"{x * scale:{'+' if signed else ''}.{digits}f}"
        return f"{number(self.estimate)} [{number(self.low)}, {number(self.high)}]"


NO_ITEMS = Interval(None, math.nan, math.nan, 0)


def bonferroni(level: float, count: int) -> float:
    """The per-test level that keeps `count` tests jointly at `level`."""
    return 1 - (1 - level) / max(1, count)


@lru_cache(maxsize=16)
def resample_indices(n: int, resamples: int = RESAMPLES, seed: int = SEED) -> np.ndarray:
    """[resamples, n] item indices drawn with replacement (read-only, cached)."""
    indices = np.random.Generator(np.random.PCG64(seed)).integers(0, n, size=(resamples, n))
    indices.setflags(write=False)
    return indices


def _bounds(samples: np.ndarray, level: float) -> tuple[float, float]:
    alpha = 1 - level
    return (float(np.quantile(samples, alpha / 2, method="lower")),
            float(np.quantile(samples, 1 - alpha / 2, method="higher")))


def paired_columns(*columns: Sequence[float]) -> list[np.ndarray]:
    """The columns as float arrays, items where any column is NaN left out."""
    arrays = [np.asarray(c, dtype=np.float64) for c in columns]
    if len({a.shape for a in arrays}) > 1:
        raise InvalidArgumentError("paired values need one value per item in every column")
    keep = ~np.any([np.isnan(a) for a in arrays], axis=0)
    return [a[keep] for a in arrays]


def mean_interval(values: Sequence[float], *, resamples: int = RESAMPLES, seed: int = SEED,
                  level: float = LEVEL) -> Interval:
    """The mean of `values` (NaNs left out) with its bootstrap interval."""
    (values,) = paired_columns(values)
    n = len(values)
    if n == 0:
        return NO_ITEMS
    means = values[resample_indices(n, resamples, seed)].mean(axis=1)
    return Interval(float(values.mean()), *_bounds(means, level), n, level)


def paired_difference(setting: Sequence[float], baseline: Sequence[float], *,
                      resamples: int = RESAMPLES, seed: int = SEED,
                      level: float = LEVEL) -> Interval:
    """mean(setting - baseline) over the items, with its paired bootstrap interval
    (items where either value is NaN left out)."""
    setting, baseline = paired_columns(setting, baseline)
    return mean_interval(setting - baseline, resamples=resamples, seed=seed, level=level)


def recovery_interval(baseline: Sequence[float], cached: Sequence[float],
                      setting: Sequence[float], *, resamples: int = RESAMPLES,
                      seed: int = SEED, level: float = LEVEL) -> Interval:
    """mean(setting - cached) / mean(baseline - cached) with its paired bootstrap interval
    (see the module docstring); the estimate is None when the data show no gap."""
    baseline, cached, setting = paired_columns(baseline, cached, setting)
    n = len(baseline)
    if n == 0:
        return NO_ITEMS
    gap = baseline - cached
    won = setting - cached
    estimate = float(won.mean() / gap.mean()) if gap.mean() > 0 else None
    indices = resample_indices(n, resamples, seed)
    gaps = gap[indices].mean(axis=1)
    wins = won[indices].mean(axis=1)
    has_gap = gaps > 0
    ratios = np.full(len(gaps), -np.inf)
    ratios[has_gap] = wins[has_gap] / gaps[has_gap]
    return Interval(estimate, *_bounds(ratios, level), n, level,
                    float(1 - has_gap.mean()))


def kl_divergence(p_logprobs: Sequence[float], q_logprobs: Sequence[float]) -> float:
    """KL(p || q) in nats, from two log-probability vectors over one vocabulary."""
    p = np.asarray(p_logprobs, dtype=np.float64)
    q = np.asarray(q_logprobs, dtype=np.float64)
    weights = np.exp(p)
    mask = weights > 0          # 0 * log 0 = 0, even where q is -inf
    return float(np.sum(weights[mask] * (p[mask] - q[mask])))
