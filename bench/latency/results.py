"""The latency benchmark's options and records: one point per length (every tier's TTFTs,
the floor per round, the first-token agreement), the decode comparison, the report.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

import torch

from promptlang.bench import floor
from promptlang.bench.report import Goal, Spread, ratios


DOC_MODULE = "doc"
DECODE_QUESTION = "Write a long and detailed story about the old harbour."
FIT_RANGE = (1000, 8192)      # cached tokens over which the TTFT exponent is fitted
TIERS = ("device", "held", "host", "disk")
AGREE_GOAL = "cached first token == baseline's at every length"


@dataclass(frozen=True)
class LatencyOptions:
    lengths: tuple[int, ...] = (256, 512, 1024, 2048, 4096, 6400, 8000)
    samples: int = 5             # rounds of (floor, device request, baseline) per length
    repeats: int = 5             # timed requests per other cached tier (held, host, disk)
    decode_tokens: int = 32      # tokens generated for the decode comparison
    decode_samples: int = 5      # interleaved decode runs on each side
    goal_length: int = 6400      # the point the goals are checked at
    seed: int = 0

    @classmethod
    def quick(cls) -> "LatencyOptions":
        return cls(lengths=(64, 128, 256), samples=2, repeats=2, decode_tokens=4,
                   decode_samples=2, goal_length=256)


@dataclass
class Agreement:
    """Cached against baseline greedy first token, over the rounds of one length."""

    samples: int = 0
    disagreements: int = 0
    max_logit_diff: float = 0.0
    baseline_token: int | None = None      # the last round's picks
    cached_token: int | None = None

    def add(self, baseline: torch.Tensor, cached: torch.Tensor) -> None:
        """One round: both sides' logits for the first generated token ([V] each)."""
        self.samples += 1
        self.baseline_token = int(baseline.argmax())
        self.cached_token = int(cached.argmax())
        self.disagreements += self.baseline_token != self.cached_token
        diff = float((baseline.float() - cached.float()).abs().max())
        self.max_logit_diff = max(self.max_logit_diff, diff)

    @property
    def agrees(self) -> bool:
        return self.samples > 0 and self.disagreements == 0


@dataclass
class Point:
    """Every measurement at one document length (seconds). `baseline`, `device`,
    `rates` and `bandwidths` are the rounds' samples, index i from round i."""

    target: int                  # document tokens asked for
    prompt_tokens: int           # the baseline's prefill
    cached_tokens: int
    uncached_tokens: int
    encode: float
    cold: float
    disk_write: float
    baseline: list[float] = field(default_factory=list)
    device: list[float] = field(default_factory=list)
    rates: list[float] = field(default_factory=list)        # matmul FLOP/s per round
    bandwidths: list[float] = field(default_factory=list)   # copy bytes/s per round
    held: list[float] = field(default_factory=list)
    device_torch: list[float] = field(default_factory=list)   # device tier, PyTorch's kernels
    host: list[float] = field(default_factory=list)
    disk: list[float] = field(default_factory=list)
    flops: float = 0.0           # of the cached request's uncached tokens
    read_bytes: float = 0.0      # weights plus the cached KV
    answer: str = ""             # the fact the question asks for
    agreement: Agreement = field(default_factory=Agreement)
    checks: dict[str, float] = field(default_factory=dict)   # per timed request, from the
    # engine's counters: tokens the assembler copied, store hits in the tier measured

    def floors(self) -> list[float]:
        """The floor of each round, from that round's rates."""
        return [max(self.flops / r, self.read_bytes / b)
                for r, b in zip(self.rates, self.bandwidths)]

    @property
    def floor(self) -> float:
        return statistics.median(self.floors())

    @property
    def floor_compute(self) -> float:
        return statistics.median(self.flops / r for r in self.rates)

    @property
    def floor_memory(self) -> float:
        return statistics.median(self.read_bytes / b for b in self.bandwidths)

    @property
    def x_floor(self) -> Spread:
        """Cached TTFT / floor, per round."""
        return Spread.of(ratios(self.device, self.floors()))

    @property
    def speedup(self) -> Spread:
        """Baseline TTFT / cached TTFT, per round."""
        return Spread.of(ratios(self.baseline, self.device))

    def median(self, tier: str) -> float:
        return statistics.median(getattr(self, tier))

    def best(self, tier: str) -> float:
        return min(getattr(self, tier))

    @property
    def break_even(self) -> int | None:
        """Requests from which encoding once pays off (see the module docstring)."""
        saving = self.median("baseline") - self.median("device")
        return max(1, math.ceil(self.encode / saving)) if saving > 0 else None

    def row(self) -> dict[str, Any]:
        """The CSV row: every number of this point."""
        row: dict[str, Any] = {"target_tokens": self.target, "prompt_tokens": self.prompt_tokens,
                               "cached_tokens": self.cached_tokens,
                               "uncached_tokens": self.uncached_tokens,
                               "samples": len(self.device),
                               "baseline_s": self.median("baseline"),
                               "baseline_min_s": self.best("baseline"),
                               "cold_s": self.cold, "encode_s": self.encode}
        for tier in TIERS:
            row[f"{tier}_s"] = self.median(tier)
            row[f"{tier}_min_s"] = self.best(tier)
        x = self.x_floor
        up = self.speedup
        row.update(disk_write_s=self.disk_write, speedup=up.median, speedup_min=up.low,
                   speedup_max=up.high, floor_s=self.floor, floor_compute_s=self.floor_compute,
                   floor_memory_s=self.floor_memory, device_x_floor=x.median,
                   device_x_floor_min=x.low, device_x_floor_max=x.high,
                   break_even_requests=self.break_even, flops_uncached=self.flops,
                   first_token_agrees=self.agreement.agrees,
                   max_logit_diff=self.agreement.max_logit_diff)
        if self.device_torch:
            row.update(device_torch_s=self.median("device_torch"),
                       device_torch_min_s=self.best("device_torch"))
        return row


@dataclass
class DecodeComparison:
    """Decode speed with the goal length's context: ours against transformers' generate,
    seconds per token, `ours[i]` and `hf[i]` from the same interleaved pair of runs."""

    context_tokens: int
    tokens: int                  # tokens each side generated, the first included
    ours: list[float]
    hf: list[float]
    hf_ttft: float               # transformers' generate(max_new_tokens=1) on the prompt
    hf_attention: str

    @property
    def ratio(self) -> Spread:
        return Spread.of(ratios(self.ours, self.hf))


@dataclass
class LatencyReport:
    options: LatencyOptions
    model: str
    machine: dict[str, Any]
    weight_bytes: int
    kv_bytes_per_token: int
    points: list[Point]
    skipped: list[int]           # lengths that do not fit the model's context
    decode: DecodeComparison | None
    goals: list[Goal]
    seconds: float
    sgemms: list[floor.Sgemm] = field(default_factory=list)   # the candidates, measured

    def rows(self) -> list[dict[str, Any]]:
        return [p.row() for p in self.points]

    @property
    def correct(self) -> bool:
        """False when cached and baseline picked different first tokens somewhere."""
        return all(p.agreement.agrees for p in self.points)
