"""`bench contention`: decode and a cached question beside a busy neighbour (bench/contention.py)."""

from __future__ import annotations

from promptlang.bench import contention
from promptlang.runtime.engine import LLM
from promptlang.runtime.fast import native
from tests.runtime.tiny import tiny_llama


def test_both_settings_are_measured_alone_and_busy(default_tokenizer):
    engine = LLM.from_model(tiny_llama(0, 49152, max_positions=1024), default_tokenizer)
    before = native.adapt_threads
    report = contention.run_contention(engine, contention.ContentionOptions.quick(),
                                       progress=False)
    assert native.adapt_threads == before                # put back
    assert [r["adapt_threads"] for r in report.rows] == [True, False]
    for row in report.rows:
        assert min(row["decode_alone_ms"], row["decode_busy_ms"], row["question_alone_ms"],
                   row["question_busy_ms"]) > 0
    assert report.context_tokens > 0
    assert [g.passed is not None for g in report.goals()] == [True, True]
    assert contention.to_json(report)["rows"] == report.rows
