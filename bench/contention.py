"""`promptlang bench contention`: decode and a cached question beside a busy neighbour.

One long module (~6k tokens) is cached; decode (ms per token after the first, median of a
few generations) and a new question over it (time to the first token, a new question each
time) are timed alone, then with one other process spinning on a core beside this one --
with the kernels' thread count adapting to the cores others hold (the default,
`runtime/fast/native.py kernel_threads`) and with it fixed at torch's count, the sides
measured in the same run. Goals: with the adaptation, both no more than 2.5x their time
alone.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from promptlang.bench.report import Goal, Progress, Section
from promptlang.runtime.engine import LLM
from promptlang.runtime.fast import native

GOAL = 2.5
SENTENCE = "The harbour master keeps a log of every ship that enters the port, its cargo, "


@dataclass(frozen=True)
class ContentionOptions:
    repeats: int = 360           # sentences in the module (~17 tokens each)
    decode_tokens: int = 17
    decode_rounds: int = 3
    questions: int = 5

    @classmethod
    def quick(cls) -> "ContentionOptions":
        return cls(repeats=4, decode_tokens=3, decode_rounds=1, questions=1)


@dataclass
class ContentionReport:
    options: ContentionOptions
    model: str
    context_tokens: int = 0
    rows: list[dict] = field(default_factory=list)   # per setting: alone and busy timings
    seconds: float = 0.0

    def goals(self) -> list[Goal]:
        adapted = next((r for r in self.rows if r["adapt_threads"]), None)
        if adapted is None:
            return []
        return [Goal(f"decode beside a busy neighbour <= {GOAL:g}x alone",
                     adapted["decode_ratio"] <= GOAL,
                     f"{adapted['decode_busy_ms']:.1f} vs {adapted['decode_alone_ms']:.1f} ms "
                     f"per token = {adapted['decode_ratio']:.2f}x"),
                Goal(f"a cached question beside a busy neighbour <= {GOAL:g}x alone",
                     adapted["question_ratio"] <= GOAL,
                     f"{adapted['question_busy_ms']:.1f} vs {adapted['question_alone_ms']:.1f} "
                     f"ms = {adapted['question_ratio']:.2f}x")]


def run_contention(llm: LLM, options: ContentionOptions = ContentionOptions(), *,
                   model_name: str = "", progress: bool = True) -> ContentionReport:
    """Time decode and cached questions alone and beside a spinning process (docstring)."""
    started = time.perf_counter()
    report = ContentionReport(options, model_name)
    llm.add_schema(f'<schema name="contention"><module name="doc">'
                   f'{SENTENCE * options.repeats}</module></schema>')
    prompt = '<prompt schema="contention"><doc/>Summarise the log.</prompt>'
    report.context_tokens = len(llm.bind(prompt).token_ids())
    llm.generate(prompt, max_new_tokens=2)                  # encoded, warm
    asked = iter(range(10 ** 9))

    def decode_ms() -> float:
        out = llm.generate(prompt, max_new_tokens=options.decode_tokens)
        steps = max(1, len(out.token_ids) - 1)
        return (out.timings.total - out.timings.first_token) / steps * 1e3

    def question_ms() -> float:
        question = f"Question {next(asked)}: which ship came in last?"
        out = llm.generate(f'<prompt schema="contention"><doc/>{question}</prompt>',
                           max_new_tokens=1)
        return out.timings.first_token * 1e3

    def measure() -> tuple[float, float]:
        return (statistics.median(decode_ms() for _ in range(options.decode_rounds)),
                statistics.median(question_ms() for _ in range(options.questions)))

    saved = native.adapt_threads
    try:
        with Progress(total=4, desc="contention", enabled=progress) as bar:
            for adapt in (True, False):
                native.adapt_threads = adapt
                alone = measure()
                bar.update(1)
                busy = _beside_a_neighbour(measure)
                bar.update(1)
                report.rows.append({
                    "adapt_threads": adapt,
                    "decode_alone_ms": alone[0], "decode_busy_ms": busy[0],
                    "decode_ratio": busy[0] / alone[0],
                    "question_alone_ms": alone[1], "question_busy_ms": busy[1],
                    "question_ratio": busy[1] / alone[1]})
    finally:
        native.adapt_threads = saved
    report.seconds = time.perf_counter() - started
    return report


def _beside_a_neighbour(measure):
    """`measure()` while another process spins on a core (stopped after, whatever happens)."""
    neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)                                       # it is running
        return measure()
    finally:
        neighbour.kill()
        neighbour.wait(timeout=30)


def sections(report: ContentionReport) -> list[Section]:
    rows = [{"kernel threads": "adapt to free cores" if r["adapt_threads"] else "torch's count",
             "decode alone ms/token": r["decode_alone_ms"],
             "decode busy ms/token": r["decode_busy_ms"], "decode busy/alone": r["decode_ratio"],
             "question alone ms": r["question_alone_ms"],
             "question busy ms": r["question_busy_ms"],
             "question busy/alone": r["question_ratio"]} for r in report.rows]
    options = report.options
    lines = [f"a cached module of {report.context_tokens:,} prompt tokens",
             f"decode: median of {options.decode_rounds} generations of "
             f"{options.decode_tokens} tokens",
             f"question: median of {options.questions} new questions",
             "the neighbour: one `python -c \"while True: pass\"` process"]
    return [Section(f"Beside a busy neighbour ({report.model})", rows, lines),
            Section("Goals", (), [str(g) for g in report.goals()])]


def to_json(report: ContentionReport) -> dict[str, Any]:
    return {"options": asdict(report.options), "model": report.model,
            "context_tokens": report.context_tokens, "rows": report.rows,
            "seconds": report.seconds,
            "goals": [{"name": g.name, "passed": g.passed, "detail": g.detail}
                      for g in report.goals()]}
