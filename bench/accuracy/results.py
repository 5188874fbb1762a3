"""The accuracy benchmark's options and records: an item's answers under every setting, the
scores per setting and kind, the paired comparisons, the recompute cost, the report.
A Wilson interval for a rate.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Sequence

from promptlang.bench import metrics, qa
from promptlang.bench.settings import (DEFAULT_RECOMPUTE, QUICK_RECOMPUTE, RECOMPUTE_RULES,
                                       settings)
from promptlang.bench.report import Goal


STORE_BUDGET = 512 << 20      # bytes of KV each setting's store keeps (LRU past that)
COST_STORE_BUDGET = 4 << 30   # the ~6k section's stores: every setting's units fit
GOAL_KIND = "dependent"
GOAL_METRIC = "found"         # the goal's metric: answer in output ("correct": exact match)
GOAL_RECOVERY = 0.5
GOAL_SPEEDUP = 10.0
GOAL_NAME = "recompute recovers >= half the cached-vs-baseline gap at >= 10x"
METRIC_NAMES = {"found": "answer in output", "correct": "exact match"}


@dataclass(frozen=True)
class AccuracyOptions:
    items_per_kind: int = 10         # small: `bench all` stays fast; the recompute runs: 200
    kinds: tuple[str, ...] = qa.KINDS
    seed: int = 0
    docs_per_item: int = 4
    doc_words: int | None = None     # None: qa.DEFAULT_DOC_WORDS per kind
    max_new_tokens: int = 32         # room for a sentence answer
    recompute: tuple[str, ...] = DEFAULT_RECOMPUTE   # policies; each adds RULE+SPEC settings
    recompute_rules: tuple[str, ...] = RECOMPUTE_RULES   # ... for these rules
    scaffold: bool = True            # the scaffold setting (the baseline's tokens, jointly)
    store16: bool = True             # the cached-bf16 setting (cached, bfloat16 store)
    isolate: bool = True             # the isolate settings (the paper's rule)
    cost_tokens: int = 6000          # the recompute cost section's prompt (0: skip it)
    cost_docs: int = 4
    cost_repeats: int = 3            # warm cached requests per setting (median)
    cost_baseline_repeats: int = 1
    resamples: int = metrics.RESAMPLES     # bootstrap resamples of the items
    bootstrap_seed: int = metrics.SEED

    @classmethod
    def quick(cls) -> "AccuracyOptions":
        return cls(items_per_kind=1, docs_per_item=2, doc_words=20, max_new_tokens=4,
                   recompute=QUICK_RECOMPUTE, cost_tokens=256, cost_docs=2, cost_repeats=1)

    @property
    def settings(self) -> tuple[str, ...]:
        return settings(self.recompute, self.recompute_rules, self.scaffold, self.store16,
                        self.isolate)


@dataclass
class Answer:
    text: str
    token_ids: list[int]
    correct: bool            # exact match
    found: bool              # the answer somewhere in the output
    same_as_baseline: bool
    ttft: float
    encode: float
    recomputed: int = 0      # cached tokens computed again for this request
    select: float = 0.0      # seconds choosing them (deviation)
    passes: int = 0          # decode passes after the first token (drafts verified)
    gold_logprob: float = math.nan   # teacher-forced log-probability of the gold answer
    gold_tokens: int = 0             # ... summed over this many tokens
    kl: float = math.nan     # KL(baseline || this) at the first generated position, nats
    distracted: bool = False         # a distractor's answer before (or without) the gold

    @property
    def gold_logprob_token(self) -> float:
        """The gold answer's mean log-probability per token."""
        return self.gold_logprob / self.gold_tokens if self.gold_tokens else math.nan


@dataclass
class ItemResult:
    item: qa.QAItem
    prompt_tokens: int
    answers: dict[str, Answer]

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.item.id, "kind": self.item.kind, "question": self.item.question,
                "answer": self.item.answer, "answer_docs": list(self.item.answer_docs),
                "distractor_answers": list(self.item.distractor_answers),
                "prompt_tokens": self.prompt_tokens,
                "settings": {name: {"text": a.text, "correct": a.correct, "found": a.found,
                                    "same_as_baseline": a.same_as_baseline,
                                    "ttft_s": a.ttft, "encode_s": a.encode,
                                    "recomputed_tokens": a.recomputed, "select_s": a.select,
                                    "decode_passes": a.passes, "distracted": a.distracted,
                                    "gold_logprob": _finite(a.gold_logprob),
                                    "gold_tokens": a.gold_tokens, "kl": _finite(a.kl),
                                    "token_ids": a.token_ids}
                             for name, a in self.answers.items()}}


@dataclass
class Score:
    """One (setting, kind) cell."""

    setting: str
    kind: str              # a qa kind, or "all"
    items: int
    correct: int           # exact matches
    found: int             # answers found in the output
    agree: int             # same tokens as the baseline
    ttft: float            # mean seconds, encoding included
    encode: float          # mean seconds spent encoding
    recomputed: float = 0.0   # mean recomputed tokens per request
    distracted: int = 0       # outputs with a distractor's answer before (or without) the gold
    gold_logprob: float = math.nan        # mean teacher-forced gold log-probability
    gold_logprob_token: float = math.nan  # ... per gold token
    kl: float = math.nan      # mean KL(baseline || setting) at the first generated position

    @property
    def accuracy(self) -> float:
        return self.correct / self.items if self.items else 0.0

    def rate(self, metric: str) -> float:
        """The share of items that count for `metric` ("correct", "found" or "agree")."""
        return getattr(self, metric) / self.items if self.items else 0.0

    def row(self) -> dict[str, Any]:
        low, high = wilson_interval(self.correct, self.items)
        return {"setting": self.setting, "kind": self.kind, "items": self.items,
                "correct": self.correct, "accuracy": self.accuracy, "ci95_low": low,
                "ci95_high": high, "found": self.found,
                "found_rate": self.found / self.items if self.items else 0.0,
                "agree_with_baseline": self.agree,
                "agreement": self.agree / self.items if self.items else 0.0,
                "mean_ttft_s": self.ttft, "mean_encode_s": self.encode,
                "mean_recomputed_tokens": self.recomputed, "distracted": self.distracted,
                "mean_gold_logprob": _finite(self.gold_logprob),
                "mean_gold_logprob_per_token": _finite(self.gold_logprob_token),
                "mean_kl": _finite(self.kl)}


@dataclass(frozen=True)
class Comparison:
    """One (setting, kind) cell against the baseline, item by item: paired bootstrap
    intervals of the mean differences (setting - baseline) and of the mean KL."""

    setting: str
    kind: str
    found: metrics.Interval          # answer in output, difference of rates
    correct: metrics.Interval        # exact match, difference of rates
    gold_logprob: metrics.Interval   # gold log-probability (sum), difference in nats
    gold_logprob_token: metrics.Interval   # ... per token
    kl: metrics.Interval             # mean KL(baseline || setting), nats

    def row(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in ("found", "correct", "gold_logprob", "gold_logprob_token", "kl"):
            interval = getattr(self, name)
            key = name if name == "kl" else f"{name}_delta"
            out |= {f"{key}": interval.estimate if interval.n else None,
                    f"{key}_low": interval.low if interval.n else None,
                    f"{key}_high": interval.high if interval.n else None}
        return out


@dataclass
class CostPoint:
    """Warm TTFTs of one setting at ~6k tokens."""

    setting: str
    seconds: list[float]
    recomputed: int = 0
    select: float = 0.0      # median seconds choosing the tokens (deviation)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


@dataclass
class CostReport:
    prompt_tokens: int
    cached_tokens: int
    docs: int
    baseline: list[float]
    points: list[CostPoint]
    target: int = 0
    note: str = ""           # e.g. why the prompt is shorter than asked
    seconds: float = 0.0     # the section's wall time, encoding included

    @property
    def baseline_median(self) -> float:
        return statistics.median(self.baseline)

    def point(self, setting: str) -> CostPoint | None:
        return next((p for p in self.points if p.setting == setting), None)

    def ttft(self, setting: str) -> float | None:
        if setting == "baseline":
            return self.baseline_median
        point = self.point(setting)
        return None if point is None else point.median

    def speedup(self, setting: str) -> float | None:
        """Baseline TTFT over the setting's (median over median)."""
        ttft = self.ttft(setting)
        return None if ttft is None or ttft <= 0 else self.baseline_median / ttft


@dataclass
class AccuracyReport:
    options: AccuracyOptions
    model: str
    results: list[ItemResult]
    seconds: float
    scores: list[Score] = field(default_factory=list)
    cost: CostReport | None = None
    goals: list[Goal] = field(default_factory=list)
    workers: int = 1         # processes that answered the items
    store16_read: str = "widened on assembly"    # how requests read the bfloat16 units
    comparisons: list[Comparison] = field(default_factory=list)

    @property
    def settings(self) -> tuple[str, ...]:
        return _settings_of(self.results) or self.options.settings

    def rows(self) -> list[dict[str, Any]]:
        """Per cell: the Score's columns, then the Comparison's (intervals vs baseline)."""
        paired = {(c.setting, c.kind): c.row() for c in self.comparisons}
        return [s.row() | paired.get((s.setting, s.kind), {}) for s in self.scores]

    def comparison(self, setting: str, kind: str) -> Comparison | None:
        return next((c for c in self.comparisons if c.setting == setting and c.kind == kind),
                    None)

    def cell(self, setting: str, kind: str) -> Score | None:
        return next((s for s in self.scores if s.setting == setting and s.kind == kind), None)


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a proportion (0, 0 for no trials)."""
    if n == 0:
        return 0.0, 0.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def _finite(value: float) -> float | None:
    """JSON has no NaN: None for a value that was not measured."""
    return None if math.isnan(value) else value


def _settings_of(results: Sequence[ItemResult]) -> tuple[str, ...]:
    return tuple(results[0].answers) if results else ()
