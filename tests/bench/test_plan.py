"""`bench plan`: compile --plan's estimates against a real encode (bench/plan.py)."""

from __future__ import annotations

import pytest

from promptlang.bench import plan
from promptlang.runtime.engine import LLM
from tests.runtime.tiny import tiny_llama


@pytest.fixture
def engine(default_tokenizer):
    model = tiny_llama(0, 49152, max_positions=1024)      # the default tokenizer's vocabulary
    return LLM.from_model(model, default_tokenizer)


def test_each_length_is_planned_and_encoded_and_the_bytes_agree(engine, tmp_path, monkeypatch):
    monkeypatch.setenv("PROMPTLANG_HOME", str(tmp_path))     # the encode rate measured here
    report = plan.run_plan(engine, plan.PlanOptions.quick(), progress=False)
    assert list((tmp_path / "compute").iterdir())             # and kept
    assert report.rate["kept"] is False
    [row] = report.rows
    assert row["units"] == 4 and row["tokens"] > 0
    assert row["estimated_bytes"] == row["stored_bytes"]      # the plan counts what is kept
    assert row["encode_s"] > 0 and row["estimated_s"] > 0
    goals = report.goals()
    assert [g.passed for g in goals][0] is True and goals[1].passed in (True, False)
    assert plan.to_json(report)["goals"][0]["passed"] is True
    again = plan.run_plan(engine, plan.PlanOptions.quick(), progress=False)
    assert again.rate["kept"] is True
