"""Every example runs end to end on the default model in fast mode (a few tokens).

The tests assert structure - which modules were served from the cache, that a tool was
called, that a turn computed only its new tokens - never the model's wording. The model
is loaded once; each example's `main(llm, fast=True)` is called in this process.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def llm():
    import promptlang

    return promptlang.load()


@pytest.fixture
def example(monkeypatch):
    """Import examples/NAME.py as a fresh module (its folder on sys.path for _shared)."""
    monkeypatch.syspath_prepend(str(EXAMPLES))

    def load(name: str):
        spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load


def n_tokens(llm, *pieces) -> int:
    """Tokens of pieces tokenized one by one, as a session does: text as plain text, role
    affixes as the template's ids (`affixes`)."""
    return sum(len(llm.tokenizer.encode(p)) if isinstance(p, str) else len(p) for p in pieces)


def affixes(llm, role: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return llm.tokenizer.role_affix_ids(role)


def assert_timed(out: dict) -> None:
    assert out["cached_ttft"] > 0 and out["baseline_ttft"] > 0


def test_code_generation_serves_every_source_file_from_the_cache(llm, example):
    out = example("code_generation").main(llm, fast=True)
    assert {"map_py", "unit_py", "player_py", "game_py"} <= set(out["modules"])
    assert isinstance(out["answer"], str) and out["generated_tokens"] <= 4
    # the files are cached; the baseline computes every token of the same prompt
    assert out["cached_tokens"] > 10 * max(1, out["prefill_tokens"])
    assert out["baseline_prefill_tokens"] == out["cached_tokens"] + out["prefill_tokens"]
    assert_timed(out)


def test_personalization_assembles_the_profile_from_one_member_per_union(llm, example):
    out = example("personalization").main(llm, fast=True)
    assert out["modules"] == ["tutor", "middle", "beginner", "visual", "quiz"]
    assert 1 <= out["generated_tokens"] <= 4
    assert out["baseline_prefill_tokens"] == out["cached_tokens"] + out["prefill_tokens"]
    assert_timed(out)


def test_trip_planning_fills_the_duration_and_selects_exactly(llm, example):
    module = example("trip_planning")
    out = module.main(llm, fast=True)
    assert out["modules"] == ["trip", "paris"]
    assert out["budget"] in ("yes", "no")
    choice = out["choice"]
    assert choice.options == ("yes", "no") and out["budget"] == choice.options[
        max(range(2), key=lambda i: choice.scores[i])]
    # the select computed only what came after the plan: nothing of the prompt again
    (_, plan_prefill), (_, select_prefill) = out["steps"]
    assert plan_prefill == 0
    question = "Can this trip be done on a small budget? Answer yes or no."
    assert select_prefill == n_tokens(llm, affixes(llm, "assistant")[1],
                                      affixes(llm, "user")[0], question,
                                      affixes(llm, "user")[1], affixes(llm, "assistant")[0])
    assert_timed(out)


def test_document_qa_retrieves_one_union_member_and_serves_it_cached(llm, example):
    out = example("document_qa").main(llm, fast=True)
    assert out["document"] == "tides" and out["modules"] == ["answer", "tides"]
    assert out["cached_tokens"] > 5 * out["prefill_tokens"]
    assert_timed(out)


def test_react_agent_calls_the_tool_and_never_recomputes_a_step(llm, example):
    module = example("react_agent")
    out = module.main(llm, fast=True, question="What is 37*48+12?",
                      first_action=("calculator", "37*48+12"))
    assert out["tool_calls"][0] == ("calculator", "37*48+12")
    assert out["steps"][0].observation == "1788" and not out["steps"][0].error
    assert out["finish"] in ("answer", "no_action", "max_steps")
    opening = out["opening"]
    assert opening.cached_tokens > 0 and out["baseline_cached_tokens"] == 0
    # every token in the session's KV was computed once: the opening, then each turn's new
    # text and its own generated tokens
    assert out["length"] == opening.cached_tokens + opening.prefill_tokens + sum(
        t.prefill_tokens + t.generated_tokens for t in out["turns"])
    assert_timed(out)
    assert module.calculate("2^10 - 3x4") == 1012
    with pytest.raises(ValueError):
        module.calculate("__import__('os')")
    assert module.search("eiffel tower height").startswith("Eiffel Tower:")


def test_chat_agent_turns_compute_only_their_new_tokens(llm, example):
    module = example("chat_agent")
    out = module.main(llm, fast=True)
    user_open, user_close = affixes(llm, "user")
    asst_open, asst_close = affixes(llm, "assistant")
    turns = out["turns"]
    assert len(turns) == len(module.MESSAGES)
    assert turns[0].prefill_tokens == n_tokens(llm, user_open, module.MESSAGES[0], user_close,
                                               asst_open)
    for turn, message in zip(turns[1:], module.MESSAGES[1:]):
        assert turn.prefill_tokens == n_tokens(llm, asst_close, user_open, message, user_close,
                                               asst_open)
        assert 1 <= turn.generated_tokens <= 4
    opening = out["opening"]
    assert opening.cached_tokens > 0
    assert out["length"] == opening.cached_tokens + opening.prefill_tokens + sum(
        t.prefill_tokens + t.generated_tokens for t in turns)
    # from scratch, the last turn would compute the persona and every earlier turn again
    assert out["scratch_tokens"] == out["length"] - turns[-1].generated_tokens
    assert_timed(out)


def test_an_example_runs_as_a_script_in_fast_mode():
    env = dict(os.environ, PROMPTLANG_FAST="1")
    done = subprocess.run([sys.executable, str(EXAMPLES / "code_generation.py")], env=env,
                          capture_output=True, text=True, cwd=EXAMPLES.parent)
    assert done.returncode == 0, done.stderr
    assert "main.py:" in done.stdout and "time to first token: cached" in done.stdout


def test_structured_extraction_fills_the_model_from_cached_profiles(llm, example):
    module = example("structured_extraction")
    out = module.main(llm, fast=True)
    assert set(out["records"]) == {"tidewater", "bramble", "northwind"}
    # 60 tokens hold these records: every one is complete and validates
    assert all(isinstance(r, module.Company) for r in out["records"].values())
    assert out["complete"] == [True]
    assert out["cached_tokens"] > 10 * max(1, out["prefill_tokens"])
    assert out["baseline_prefill_tokens"] == out["cached_tokens"] + out["prefill_tokens"]
    assert_timed(out)


def _jinja_messages(name: str, variables: dict) -> list[dict]:
    """The chat messages Jinja2 itself renders from examples/jinja/NAME.j2: each role block
    rendered by an environment of its own (an identity `maxlen`), after the top level ran."""
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(EXAMPLES / "jinja")))
    env.filters["maxlen"] = lambda value, tokens: value
    template = env.get_template(f"{name}.j2")
    context = template.new_context(dict(variables))
    "".join(template.root_render_func(context))
    return [{"role": role, "content": "".join(template.blocks[role](context))}
            for role in ("system", "user") if role in template.blocks]


def _greedy_plain(model, bound, count: int) -> list[int]:
    """Greedy tokens of the unmodified transformers model over the bound prompt's tokens at
    contiguous positions (the plain prompt's prefill, which `exact` answers as), by full
    forward passes."""
    import torch

    ids = bound.token_ids()
    out = []
    with torch.no_grad():
        for _ in range(count):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            token = int(logits.argmax())
            out.append(token)
            ids.append(token)
    return out


def test_jinja_templates_answer_as_the_full_prefill_and_render_as_jinja2(llm, example):
    from promptlang.runtime.model.loading import load_hf_model

    out = example("jinja_templates").main(llm, fast=True)
    assert set(out) == {"rag", "chat", "tools"}
    hf = llm.tokenizer.tokenizer
    reference, _ = load_hf_model(None)
    for name, result in out.items():
        expected = hf.apply_chat_template(_jinja_messages(name, result["variables"]),
                                          tokenize=False, add_generation_prompt=True)
        assert result["rendered"] == expected, name
        # token for token: the whole rendered text's tokens, which the model answers from
        assert result["bound"].token_ids() == hf(expected, add_special_tokens=False).input_ids
        greedy = _greedy_plain(reference, result["bound"], len(result["answer_ids"]))
        assert result["answer_ids"] == greedy, name
        assert result["answer"] == result["baseline_answer"], name
        assert result["baseline_prefill_tokens"] == (result["cached_tokens"] +
                                                     result["prefill_tokens"])
    assert out["rag"]["modules"] == ["rag", "docs-0", "docs-2", "docs-5", "docs-6"]
    assert out["chat"]["modules"] == ["chat", "persona-teacher", "safe_mode"]
    assert out["tools"]["modules"] == ["tools", "search-tools", "search", "weather-tools",
                                       "weather", "rules-JSON"]
