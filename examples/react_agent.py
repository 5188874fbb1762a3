"""A ReAct agent with two local tools: a calculator and a small in-memory search.

    python examples/react_agent.py [--fast] ["your question"]

The agent (promptlang.runtime.conversation.agent) keeps its instructions and each tool's description
in cached modules; the question is the only uncached text of the request. The loop runs
on one session: Thought, Action, Observation, ... until a Final Answer or the step
limit, each step computing only the text it adds. Each action is a JSON object
constrained to the offered tools (`json_actions=True`: structured generation through
llguidance), so even the small default model always writes a call that parses.
"""

from __future__ import annotations

import ast
import operator
import re
import sys

from _shared import fast_mode, model, report_ttft

from promptlang.runtime.conversation.agent import Agent, Tool

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
              ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
              ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos}

ENCYCLOPEDIA = {
    "Golden Gate Bridge": "A suspension bridge in San Francisco, opened in 1937; its towers "
                          "are 227 metres tall and its main span is 1280 metres long.",
    "Mount Fuji": "The highest mountain in Japan, a stratovolcano 3776 metres high; it last "
                  "erupted in 1707.",
    "Honey bee": "A social insect; a colony has one queen and up to 60000 workers, which "
                 "make honey from nectar.",
    "Eiffel Tower": "A wrought-iron tower in Paris, completed in 1889 and 330 metres tall.",
    "Amazon River": "The largest river by discharge, about 6400 kilometres long, flowing "
                    "through Peru, Colombia and Brazil.",
}


def calculate(expression: str) -> float | int:
    """Evaluates arithmetic: numbers, + - * / // % ** and parentheses (no names, no calls);
    `x` and `^` are read as `*` and `**`, as people (and small models) write them."""
    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return _OPERATORS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {ast.unparse(node)}")

    result = value(ast.parse(expression.replace("^", "**").replace("x", "*"), mode="eval").body)
    return int(result) if isinstance(result, float) and result.is_integer() else result


def search(query: str) -> str:
    """Looks a topic up in a small encyclopedia: the entry sharing the most words."""
    def words(text: str) -> set[str]:
        return set(re.findall(r"[a-z0-9]+", text.lower()))

    asked = words(query)
    best = max(ENCYCLOPEDIA, key=lambda title: (len(asked & words(title)) * 2
                                                + len(asked & words(ENCYCLOPEDIA[title]))))
    if not asked & words(best + " " + ENCYCLOPEDIA[best]):
        return "No entry found."
    return f"{best}: {ENCYCLOPEDIA[best]}"


TOOLS = [Tool("calculator", "Evaluates an arithmetic expression, for example 3*(4+5).",
              calculate),
         Tool("search", "Looks up a topic (a place, a building, an animal) in an encyclopedia.",
              search)]


def main(llm=None, fast: bool | None = None, question: str | None = None,
         first_action: tuple[str, str] | None = None) -> dict:
    """`first_action=(tool, input)` scripts the first step's action (the tests use it)."""
    fast = fast_mode(fast)
    llm = model(llm)
    if question is None:
        args = [a for a in sys.argv[1:] if a != "--fast"] if __name__ == "__main__" else []
        question = args[0] if args else "How tall is the Eiffel Tower in centimetres?"
    agent = Agent(llm, TOOLS, json_actions=True, max_tokens=4 if fast else 40)
    llm.encode(agent.schema)
    max_steps = 2 if fast else 5
    with agent.run(question, max_steps=max_steps, first_action=first_action) as run:
        with agent.run(question, max_steps=1, first_action=first_action,
                       baseline=True) as baseline:
            print(f"Q: {question}")
            for step in run.steps:
                print(f"  Thought: {step.thought}\n  Action: {step.tool}({step.input!r})\n"
                      f"  Observation: {step.observation}")
            print(f"A: {run.answer}  ({run.finish} after {len(run.steps)} tool calls)")
            report_ttft(run.ttft, baseline.ttft, opening=run.session.opening,
                        baseline_opening=baseline.session.opening)
            return {"answer": run.answer, "finish": run.finish, "steps": run.steps,
                    "tool_calls": run.tool_calls, "turns": run.turns,
                    "cached_ttft": run.ttft, "baseline_ttft": baseline.ttft,
                    "opening": run.session.opening, "length": run.session.length,
                    "baseline_cached_tokens": baseline.session.opening.cached_tokens}


if __name__ == "__main__":
    main()
