"""Structured generation (runtime/decoding/constrain.py): regex, JSON Schema and Lark constraints on
`llm.generate` and `Session.generate`, on a tiny random Llama with the default model's
tokenizer. Random weights make the model's preferences arbitrary, which is the point: the
output must obey the constraint whatever the model would say, greedy or sampled."""

from __future__ import annotations

import json
import re

import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from promptlang.errors import PromptLangError                 # noqa: E402
from promptlang.pml import nodes                              # noqa: E402
from promptlang.errors import ConstraintError      # noqa: E402
from promptlang.runtime.conversation.session import SCORED_TOKENS               # noqa: E402

PROMPT = '<prompt schema="c"><user>Answer in the asked format.</user><assistant></prompt>'
SEEDS = range(6)

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "role": {"enum": ["pilot", "baker", "nurse"]},
                         "address": {"type": "object",
                                     "properties": {"city": {"type": "string",
                                                             "maxLength": 10}},
                                     "required": ["city"], "additionalProperties": False},
                         "tags": {"type": "array", "items": {"enum": ["x", "y"]},
                                  "maxItems": 3}},
          "required": ["name", "age", "role", "address", "tags"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from tests.conftest import tiny_model_dir as make_dir
    from promptlang.runtime import engine
    from promptlang.runtime.store import ModuleStore

    folder = make_dir.__wrapped__(tmp_path_factory.mktemp("constrain"))
    llm = engine.load(str(folder), store=ModuleStore(disk_budget_bytes=0))
    llm.add_schema(nodes.Schema("c", (nodes.RoleOpen("system"), nodes.Text("Be exact."),
                                      nodes.RoleClose("system"))))
    return llm


def outputs(llm, **constraint):
    """Greedy, then sampled with each seed (temperature 1.2: far from the greedy path)."""
    yield llm.generate(PROMPT, max_new_tokens=80, **constraint)
    for seed in SEEDS:
        yield llm.generate(PROMPT, max_new_tokens=80, temperature=1.2, seed=seed, **constraint)


@pytest.mark.parametrize("pattern", [r"[0-9]{3}-[0-9]{4}", r"(yes|no|maybe)",
                                     r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)",
                                     r"#[0-9a-f]{6}"])
def test_regex_outputs_match_greedy_and_sampled(llm, pattern):
    for result in outputs(llm, regex=pattern):
        assert result.complete is True and result.finish_reason == "eos", result.text
        assert re.fullmatch(pattern, result.text), result.text


def test_json_schema_outputs_validate_nested_objects_enums_arrays_and_patterns(llm):
    for result in outputs(llm, json_schema=PERSON):
        assert result.complete is True, result.text
        jsonschema.validate(json.loads(result.text), PERSON)


def test_a_json_schema_can_be_json_text_a_file_or_a_pydantic_model(llm, tmp_path):
    pydantic = pytest.importorskip("pydantic")

    class Point(pydantic.BaseModel):          # extra="forbid": additionalProperties false
        model_config = pydantic.ConfigDict(extra="forbid")
        x: int = pydantic.Field(ge=-999, le=999)
        y: int = pydantic.Field(ge=-999, le=999)

    path = tmp_path / "point.json"
    path.write_text(json.dumps(Point.model_json_schema()))
    for given in (Point, json.dumps(Point.model_json_schema()), path):
        result = llm.generate(PROMPT, json_schema=given, max_new_tokens=40)
        assert result.complete
        point = Point.model_validate_json(result.text)
        assert isinstance(point.x, int) and isinstance(point.y, int)
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "object",\n  "properties": }')
    with pytest.raises(PromptLangError, match=r"bad\.json:2:17: not valid JSON"):
        llm.generate(PROMPT, json_schema=bad)
    with pytest.raises(PromptLangError, match="no such file"):
        llm.generate(PROMPT, json_schema=tmp_path / "missing.json")


def test_a_lark_grammar_constrains_the_choice(llm):
    grammar = 'start: "The answer is " ANSWER "."\nANSWER: "red" | "green" | "blue"'
    for result in outputs(llm, grammar=grammar):
        assert re.fullmatch(r"The answer is (red|green|blue)\.", result.text), result.text


def test_greedy_constrained_output_is_deterministic(llm):
    first = llm.generate(PROMPT, json_schema=PERSON, max_new_tokens=80)
    assert llm.generate(PROMPT, json_schema=PERSON, max_new_tokens=80).token_ids == \
        first.token_ids


def test_an_output_cut_by_max_tokens_says_it_is_incomplete(llm):
    result = llm.generate(PROMPT, json_schema=PERSON, max_new_tokens=3)
    assert result.complete is False and result.finish_reason == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(result.text)
    assert llm.generate(PROMPT, max_new_tokens=3).complete is None     # no constraint


def test_bad_constraints_are_promptlang_errors_before_anything_runs(llm):
    with pytest.raises(ConstraintError, match="regex"):
        llm.generate(PROMPT, regex="(", max_new_tokens=2)
    with pytest.raises(PromptLangError, match="at most one of regex, json_schema and grammar"):
        llm.generate(PROMPT, regex="a", grammar='start: "a"', max_new_tokens=2)
    with pytest.raises(PromptLangError, match="json_schema"):
        llm.generate(PROMPT, json_schema="{not json", max_new_tokens=2)
    with pytest.raises(ConstraintError):
        llm.generate(PROMPT, grammar="start: undefined_rule", max_new_tokens=2)


def test_a_session_turn_takes_the_same_constraints(llm):
    session = llm.session(PROMPT)
    turn = session.generate(40, json_schema={"type": "object", "properties": {
        "ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False})
    assert json.loads(turn.text)["ok"] in (True, False)
    session.close()


def test_drafts_under_a_constraint_keep_the_output(llm):
    plain = llm.generate(PROMPT, json_schema=PERSON, max_new_tokens=80)
    drafted = llm.generate(PROMPT, json_schema=PERSON, max_new_tokens=80, draft=4)
    assert drafted.token_ids == plain.token_ids


def test_a_tokenizer_llguidance_cannot_read_is_a_clear_error():
    from promptlang.runtime.decoding.constrain import ll_tokenizer
    from promptlang.tokenizer import WordTokenizer

    with pytest.raises(ConstraintError, match="fast Hugging Face tokenizer"):
        ll_tokenizer(WordTokenizer())


def test_gen_in_a_program_takes_a_json_schema_and_the_run_holds_the_dict(llm):
    from promptlang import assistant, gen, prompt, user

    call_schema = {"type": "object", "properties": {
        "tool": {"enum": ["search", "calculator"]},
        "query": {"type": "string", "maxLength": 20}},
        "required": ["tool", "query"], "additionalProperties": False}

    @prompt
    def agent(question: str):
        """Emits a tool call."""
        with user():
            question
        with assistant():
            gen("call", json_schema=call_schema, max_tokens=60)
            gen("code", regex="[0-9]{4}", max_tokens=8)

    with agent.run(llm, "What is 2 + 2?") as run:
        assert isinstance(run["call"], dict)
        jsonschema.validate(run["call"], call_schema)
        assert re.fullmatch("[0-9]{4}", run["code"])
        assert [turn.complete for turn in run.steps] == [True, True]
    with pytest.raises(PromptLangError, match="at most one"):
        gen("x", regex="a", grammar='start: "a"')


def test_promptlang_run_takes_regex_json_schema_and_grammar_files(llm, tmp_path, monkeypatch,
                                                                  capsys):
    from promptlang import cli
    from promptlang.pml.writer import write
    from promptlang.runtime import engine

    monkeypatch.setattr(engine, "load", lambda name, isolate=False, quantize=None: llm)
    (tmp_path / "c.pml").write_text(write(llm.layout("c").schema))
    (tmp_path / "ask.pml").write_text(PROMPT)
    (tmp_path / "person.json").write_text(json.dumps(PERSON))
    (tmp_path / "yes.lark").write_text('start: "yes" | "no"')
    files = [str(tmp_path / "c.pml"), str(tmp_path / "ask.pml"), "--max-new-tokens", "80"]
    assert cli.main(["run", *files, "--json-schema", str(tmp_path / "person.json")]) == 0
    out, err = capsys.readouterr()
    jsonschema.validate(json.loads(out), PERSON)
    assert "a whole output of the constraint" in err
    assert cli.main(["run", *files, "--grammar", str(tmp_path / "yes.lark")]) == 0
    assert capsys.readouterr().out.strip() in ("yes", "no")
    assert cli.main(["run", *files, "--regex", "[0-9]{2}"]) == 0
    assert re.fullmatch("[0-9]{2}", capsys.readouterr().out.strip())
    assert cli.main(["run", *files, "--regex", "("]) == 1
    assert "bad regex" in capsys.readouterr().err


def test_a_json_action_agent_always_emits_a_parseable_call_of_an_offered_tool(llm):
    from promptlang.runtime.conversation.agent import Agent, Tool

    calls = []

    def calculator(text):
        calls.append(text)
        return "42"

    tools = [Tool("calculator", "Evaluates arithmetic.", calculator),
             Tool("search", "Looks things up.", lambda text: "nothing found")]
    agent = Agent(llm, tools, json_actions=True, max_tokens=8)
    for seed_question in ("What is 6 times 7?", "Who wrote it?", "Find the year."):
        run = agent.run(seed_question, max_steps=3, tools=["calculator"])
        assert run.finish in ("answer", "max_steps"), run.finish
        assert all(step.tool == "calculator" for step in run.steps)
        assert run.finish != "answer" or isinstance(run.answer, str)
        assert '"tool": ' in run.session.text or run.finish == "answer"
        run.close()
    scripted = agent.run("2+2?", max_steps=1, first_action=("calculator", "2+2"))
    assert scripted.steps[0].observation == "42" and calls[-1] == "2+2"
    assert 'Action: {"tool": "calculator", "input": "2+2"}' in scripted.session.text
    scripted.close()
    with pytest.raises(PromptLangError, match="final_answer"):
        Agent(llm, [Tool("final_answer", "x", str)], json_actions=True)


def test_forced_tokens_are_fed_as_drafts_and_change_nothing(llm, monkeypatch):
    """A JSON object's keys are forced by the grammar: the constraint drafts them, so the
    decode takes fewer passes than tokens, and the output is the one without drafts."""
    from promptlang.runtime.decoding import decode, open_decode

    decoders = []
    real = decode.Decoder.__init__

    def kept(self, *args, **kwargs):
        real(self, *args, **kwargs)
        decoders.append(self)
    monkeypatch.setattr(decode.Decoder, "__init__", kept)
    drafted = llm.generate(PROMPT, json_schema=PERSON, max_new_tokens=80)
    tokens = len(drafted.token_ids)
    assert decoders[-1].passes < tokens - 5                # runs of forced tokens, one pass each
    monkeypatch.setattr(open_decode, "forced_drafts", lambda params, c: {"draft": 0})
    plain = llm.generate(PROMPT, json_schema=PERSON, max_new_tokens=80)
    assert decoders[-1].passes >= len(plain.token_ids) - 1        # one pass per token
    assert drafted.token_ids == plain.token_ids


def test_select_by_grammar_picks_one_of_many_options_sharing_prefixes(llm):
    options = [f"option {i:03d}" for i in range(300)] + ['say "yes"', "say no\\nnow"]
    session = llm.session(PROMPT)
    choice = session.select(options, normalise="grammar")
    assert choice.text in options and choice.normalise == "grammar" and choice.scores == ()
    turn = session.turns[-1]
    assert turn.kind == "select" and turn.choice is choice
    assert session.text.endswith(choice.text)            # the option, and nothing after it
    with pytest.raises(PromptLangError, match="'sum', 'mean' or 'grammar'"):
        session.select(["a", "b"], normalise="best")
    session.close()
    # a list too long to score in one pass goes through the grammar without being asked
    with llm.session(PROMPT) as session:
        assert sum(len(llm.tokenizer.encode(o)) for o in options) > SCORED_TOKENS
        choice = session.select(options)
        assert choice.normalise == "grammar" and choice.text in options
        short = session.select(options[:3])
        assert short.normalise == "sum" and len(short.scores) == 3
    # in a program
    from promptlang import assistant, prompt, select, user

    @prompt
    def pick(question: str):
        """Picks a colour."""
        with user():
            question
        with assistant():
            select("colour", ["red", "green", "blue", "reddish"], normalise="grammar")

    with pick.run(llm, "Which colour?") as run:
        assert run["colour"] in ("red", "green", "blue", "reddish")


def test_properties_come_out_in_the_schemas_order(llm):
    schema = {"type": "object", "properties": {"zeta": {"type": "integer"},
                                               "alpha": {"type": "boolean"}},
              "required": ["zeta", "alpha"], "additionalProperties": False}
    text = llm.generate(PROMPT, json_schema=schema, max_new_tokens=30).text
    assert list(json.loads(text)) == ["zeta", "alpha"]
