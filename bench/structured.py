"""`promptlang bench structured`: what a JSON Schema constraint costs per decoded token.

The same prompt is decoded greedily with and without a JSON Schema constraint
(runtime/decoding/constrain.py: llguidance's mask before every pick), in interleaved rounds so that
drift of the machine falls on both sides alike. Per round and side: the time per token after
the first ((total - first token) / (tokens - 1)); the overhead is the median over rounds of
constrained / free - 1. Goal: <= 10%. The mask's own time is measured apart too
(the matcher's mask and its unpacking into a [V] boolean row, per token).

When outlines-core is installed (`pip install outlines-core`; not a dependency), the same
schema is compiled by it too, and both engines walk the constrained output's tokens: the
time to be ready for the first token (llguidance: the matcher; outlines-core: the regex
and its token index), the median time of one mask, and a table of JSON Schema features
each one compiles (COVERAGE).
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


COVERAGE = {       # JSON Schema features, each a small schema
    "nested object": {"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"type": "integer"}}, "required": ["b"]}}, "required": ["a"]},
    "enum": {"enum": ["red", "green", "blue"]},
    "array, maxItems": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    "string pattern": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
    "integer bounds": {"type": "integer", "minimum": 5, "maximum": 500},
    "anyOf": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 4}]},
    "$ref / $defs": {"$defs": {"p": {"type": "object", "properties": {"x": {"type": "number"}},
                                     "required": ["x"]}},
                     "type": "array", "items": {"$ref": "#/$defs/p"}},
    "additionalProperties": {"type": "object", "additionalProperties": {"type": "integer"}},
    "string format date-time": {"type": "string", "format": "date-time"},
}


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
    engines: list[dict] = field(default_factory=list)        # llguidance vs outlines-core
    coverage: list[dict] = field(default_factory=list)
    compared: str = ""                                       # why no comparison, if none

    def overhead(self) -> float:
        return statistics.median(c / f - 1 for c, f in zip(self.constrained, self.free))


def run_structured(llm, options: StructuredOptions = StructuredOptions(), *,
                   model_name: str = "") -> StructuredReport:
    from promptlang.pml import nodes
    from promptlang.runtime.decoding.constrain import Constraint
    from promptlang.runtime.decoding.sampling import SamplingParams

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
    compare_engines(llm, report, constrained.token_ids)
    overhead = report.overhead()
    report.goals = [Goal(f"decode with a JSON Schema <= {OVERHEAD_GOAL:.0%} slower per token",
                         overhead <= OVERHEAD_GOAL,
                         f"{overhead:+.1%} (median over {options.rounds} interleaved rounds)")]
    return report


def compare_engines(llm, report: StructuredReport, token_ids) -> None:
    """llguidance against outlines-core (when installed) on SCHEMA along `token_ids` (a
    constrained output), and the COVERAGE table."""
    import json

    import llguidance
    import torch

    from promptlang.runtime.decoding.constrain import JSON_LAYOUT, ll_tokenizer

    try:
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema
    except ImportError:
        report.compared = "outlines-core is not installed (pip install outlines-core)"
        return
    hf = llm.tokenizer.tokenizer
    eos = hf.eos_token_id
    steps = [int(t) for t in token_ids if int(t) != eos]
    lltok = ll_tokenizer(llm.tokenizer)
    words = torch.zeros((lltok.vocab_size + 31) // 32, dtype=torch.int32)
    began = time.perf_counter()
    matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(SCHEMA), JSON_LAYOUT), log_level=0)
    ready = time.perf_counter() - began
    masks = []
    for token in steps:
        began = time.perf_counter()
        matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
        masks.append(time.perf_counter() - began)
        matcher.consume_token(token)
    report.engines.append({"engine": f"llguidance {getattr(llguidance, '__version__', '')}",
                           "ready ms": round(ready * 1e3, 2),
                           "mask us (median)": round(statistics.median(masks) * 1e6, 1),
                           "tokens walked": f"{len(masks)} of {len(steps)}"})
    mapping: dict[str, list[int]] = {}
    for text, i in hf.get_vocab().items():
        if i != eos and i not in hf.all_special_ids:
            spelled = hf.convert_tokens_to_string([text])
            if spelled:
                mapping.setdefault(spelled, []).append(i)
    vocabulary = outlines_core.Vocabulary(eos, mapping)
    began = time.perf_counter()
    guide = outlines_core.Guide(outlines_core.Index(
        build_regex_from_schema(json.dumps(SCHEMA)), vocabulary))
    ready = time.perf_counter() - began
    out = torch.zeros((len(hf) + 31) // 32, dtype=torch.int32)
    masks = []
    for token in steps:
        began = time.perf_counter()
        guide.write_mask_into(out.data_ptr(), out.numel(), 4)
        masks.append(time.perf_counter() - began)
        try:
            guide.advance(token)
        except Exception:               # a token its regex does not allow here: stop
            break
    report.engines.append({"engine": "outlines-core", "ready ms": round(ready * 1e3, 2),
                           "mask us (median)": round(statistics.median(masks) * 1e6, 1),
                           "tokens walked": f"{len(masks)} of {len(steps)}"})
    for feature, schema in COVERAGE.items():
        row = {"feature": feature}
        try:
            matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(schema), JSON_LAYOUT), log_level=0)
            row["llguidance"] = "no: " + matcher.get_error()[:60] if matcher.is_error() else "yes"
        except Exception as error:
            row["llguidance"] = f"no: {str(error)[:60]}"
        try:
            outlines_core.Index(build_regex_from_schema(json.dumps(schema)), vocabulary)
            row["outlines-core"] = "yes"
        except Exception as error:
            row["outlines-core"] = f"no: {str(error).splitlines()[0][:60]}"
        report.coverage.append(row)


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
    parts = [Section(f"Structured generation cost ({report.model})", rows, lines)]
    if report.engines:
        parts += [Section("llguidance against outlines-core on the same schema and output",
                          report.engines,
                          ["ready: from the schema to the first mask (llguidance: the matcher; "
                           "outlines-core: its regex and token index); mask: one token's mask "
                           "written to a bitmask, median along the constrained output's "
                           "tokens; tokens walked: how far each engine followed that output"]),
                  Section("JSON Schema features each engine compiles", report.coverage, ())]
    elif report.compared:
        parts.append(Section("llguidance against outlines-core", (), [report.compared]))
    return parts + [Section("Goals", (), [str(g) for g in report.goals])]
