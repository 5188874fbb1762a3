"""`bench compute`: bfloat16 compute against float32 on one adapter (bench/compute.py)."""

from __future__ import annotations

import pytest

from promptlang.bench import compute
from promptlang.runtime.engine import LLM
from promptlang.runtime.model.compute import cpu_bf16_units
from tests.runtime.tiny import tiny_llama


@pytest.fixture
def engine(default_tokenizer):
    model = tiny_llama(0, 49152, max_positions=1024)      # the default tokenizer's vocabulary
    return LLM.from_model(model, default_tokenizer)


@pytest.mark.skipif(not cpu_bf16_units(), reason="this CPU has no bfloat16 matrix units")
def test_every_workload_is_measured_on_both_sides(engine, tmp_path, monkeypatch):
    monkeypatch.setenv("PROMPTLANG_HOME", str(tmp_path))     # the switch point measured here
    report = compute.run_compute(engine, compute.ComputeOptions.quick(), progress=False)
    assert engine.adapter.compute is not None and report.min_rows >= 1
    assert list((tmp_path / "compute").iterdir())             # and kept
    options = report.options
    assert len(report.rag) == options.requests
    assert len({tuple(sorted(r["docs"])) for r in report.rag}) == options.requests   # all new
    for row in report.rag:
        assert min(row["float32"], row["bfloat16"], row["transformers"]) > 0
        assert row["tokens"] > 0 and row["abs_delta_logprob"] >= 0
    assert len(report.encode) == options.encode_rounds
    assert len(report.decode) == options.decode_rounds
    goals = report.goals()
    assert [g.passed is not None for g in goals] == [True] * 4
    text = "\n".join(compute.sections(report)[0].lines)
    assert "PASS" in text or "FAIL" in text
    data = compute.to_json(report)
    assert data["min_rows"] == report.min_rows and len(data["goals"]) == 4


def test_a_cpu_without_the_units_is_reported_not_measured(engine, monkeypatch):
    monkeypatch.setattr(compute, "cpu_bf16_units", lambda: ())
    report = compute.run_compute(engine, compute.ComputeOptions.quick(), progress=False)
    assert report.skipped and not report.rag
    assert [g.passed for g in report.goals()] == [None]
    assert engine.adapter.compute is None
