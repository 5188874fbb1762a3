"""`promptlang bench structured`: what a JSON Schema constraint costs per decoded token.

The same prompt is decoded greedily with and without a JSON Schema constraint
(runtime/constrain.py: llguidance's mask before every pick), in interleaved rounds so that
drift of the machine falls on both sides alike. Per round and side: the time per token after
the first ((total - first token) / (tokens - 1)); the overhead is the median over rounds of
constrained / free - 1. Goal (issue 19): <= 10%. The mask's own time is measured apart too
(the matcher's mask and its unpacking into a [V] boolean row, per token).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

from promptlang.bench.report import Goal, Section

OVERHEAD_GOAL = 0.10
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "city": {"type": "string"},
                         "skills": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "city", "skills"]}
PROMPT = ('<prompt schema="structured-bench"><user>Invent a person and describe them as JSON '
          'with a name, an age, a city and a list of skills.</user><assistant></prompt>')


@dataclass(frozen=True)
class StructuredOptions:
    tokens: int = 64
    rounds: int = 5

    @classmethod
    def quick(cls) -> "StructuredOptions":
        return cls(tokens=8, rounds=2)


@dataclass
class StructuredReport:
    options: StructuredOptions
    model: str
    free: list[float] = field(default_factory=list)          # s/token per round
    constrained: list[float] = field(default_factory=list)
    tokens: list[tuple[int, int]] = field(default_factory=list)
    mask_seconds: float = 0.0                                # per mask, median
    goals: list[Goal] = field(default_factory=list)

    def overhead(self) -> float:
        return statistics.median(c / f - 1 for c, f in zip(self.constrained, self.free))


def run_structured(llm, options: StructuredOptions = StructuredOptions(), *,
                   model_name: str = "") -> StructuredReport:
    from promptlang.pml import nodes
    from promptlang.runtime.constrain import Constraint
    from promptlang.runtime.sampling import SamplingParams

    llm.add_schema(nodes.Schema("structured-bench", (
        nodes.RoleOpen("system"), nodes.Text("You reply with JSON only."),
        nodes.RoleClose("system"))))
    report = StructuredReport(options, model_name)
    for _ in range(1 + options.rounds):            # the first round warms both sides up
        free = llm.generate(PROMPT, max_new_tokens=options.tokens)
        constrained = llm.generate(PROMPT, max_new_tokens=options.tokens, json_schema=SCHEMA)
        report.free.append(_per_token(free))
        report.constrained.append(_per_token(constrained))
        report.tokens.append((len(free.token_ids), len(constrained.token_ids)))
    del report.free[0], report.constrained[0], report.tokens[0]
    constraint = Constraint.of(SamplingParams(json_schema=SCHEMA), llm.tokenizer)
    import torch
    logits = torch.zeros(llm.adapter.model.config.vocab_size)
    samples = []
    for _ in range(50):
        began = time.perf_counter()
        constraint([], logits)
        samples.append(time.perf_counter() - began)
    report.mask_seconds = statistics.median(samples)
    overhead = report.overhead()
    report.goals = [Goal(f"decode with a JSON Schema <= {OVERHEAD_GOAL:.0%} slower per token",
                         overhead <= OVERHEAD_GOAL,
                         f"{overhead:+.1%} (median over {options.rounds} interleaved rounds)")]
    return report


def _per_token(result) -> float:
    n = len(result.token_ids)
    t = result.timings
    return (t.total - t.first_token) / max(1, n - 1)


def sections(report: StructuredReport) -> list[Section]:
    rows = [{"round": i + 1, "free ms/token": round(f * 1e3, 2),
             "json_schema ms/token": round(c * 1e3, 2), "overhead": f"{c / f - 1:+.1%}",
             "tokens (free, constrained)": f"{a}, {b}"}
            for i, (f, c, (a, b)) in enumerate(zip(report.free, report.constrained,
                                                   report.tokens))]
    lines = [f"greedy, at most {report.options.tokens} new tokens per request, the same prompt; "
             "time per token after the first; rounds interleave the two sides",
             f"one mask (llguidance's, unpacked to a boolean row): "
             f"{report.mask_seconds * 1e6:.0f} us (median of 50, first state)"]
    return [Section(f"Structured generation cost ({report.model})", rows, lines),
            Section("Goals (issue 19)", (), [str(g) for g in report.goals])]
