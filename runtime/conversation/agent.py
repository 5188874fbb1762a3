"""Tools and a ReAct agent loop on a session.

    calculator = Tool("calculator", "Evaluates arithmetic such as 2*(3+4).", calculate)
    agent = Agent(llm, [calculator, search])
    run = agent.run("What is 17 times 23?", max_steps=4)
    run.answer, run.steps, run.finish

The prompt. The agent's schema is one system message: the instructions, one module
per tool holding its description (`tool-<name>`), and the format below. A request
imports the modules of the tools it offers, so every subset of tools is served from
cached modules; the question comes after them, uncached, as a user message. The
whole loop then runs in one assistant message on one `Session`: each step computes
only the text it adds (the KV of earlier steps is kept).

The format (ReAct, Yao et al. 2022). The model writes the Thought and the Action; the
loop writes the Observation:

    Thought: I need to multiply.
    Action: calculator[17*23]
    Observation: 391
    Thought: I know the answer.
    Final Answer: 391

Two ways to run a step:
- guided (default): the loop writes "Thought:" and generates one line; then `select`
  decides between "Action:" and "Final Answer:" (exact log-probabilities, so even a
  tiny model keeps the format), a `select` over the tool names picks the tool, and the
  input is generated up to "]". A final answer is generated up to the end of the line.
- json (`json_actions=True`): the loop writes "Thought:" and generates one line, then
  "Action: " and a JSON object constrained (runtime/decoding/constrain.py) to
  {"tool": one of the offered tools or "final_answer", "input": a string}: every action
  parses, whatever the model; `final_answer`'s input is the answer.
- free: the model writes the whole step up to "Observation:"; `parse_step` reads it.
  An "Action: name[input]" runs the tool; "Final Answer: ..." ends the run; text with
  neither is taken as the final answer (finish "no_action"), so a model that ignores
  the format still ends with an answer.

A tool that raises (or an unknown tool) becomes an observation "Error: ..." and the
loop goes on; the run stops at a final answer or after `max_steps` steps (finish
"max_steps", answer None).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Literal, Sequence

from promptlang.pml.prompt import Prompt
from promptlang.errors import DuplicateNameError, InvalidArgumentError, InvalidArgumentTypeError
from promptlang.pml import nodes
from promptlang.runtime.decoding.engine_view import EngineView

_TOOL_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")
_ACTION = re.compile(r"Action:\s*([A-Za-z][A-Za-z0-9_-]*)\s*\[(.*?)\]", re.DOTALL)
_FINAL = re.compile(r"Final Answer:\s*(.*)", re.DOTALL)
_THOUGHT = re.compile(r"Thought:\s*(.*?)(?=\n\s*(?:Action:|Final Answer:)|$)", re.DOTALL)

INSTRUCTIONS = ("You are a helpful assistant. Answer the user's question step by step, "
                "using tools when they help.\n\nTools:\n")
FORMAT = ("\nUse exactly this format:\n"
          "Thought: what to do next\n"
          "Action: tool_name[input]\n"
          "Observation: the tool's result\n"
          "(Thought, Action and Observation may repeat)\n"
          "Thought: I know the answer\n"
          "Final Answer: the answer to the question\n")
JSON_FORMAT = ("\nUse exactly this format:\n"
               "Thought: what to do next\n"
               'Action: {"tool": "tool_name", "input": "the tool\'s input"}\n'
               "Observation: the tool's result\n"
               "(Thought, Action and Observation may repeat)\n"
               "Thought: I know the answer\n"
               'Action: {"tool": "final_answer", "input": "the answer to the question"}\n')
FINAL_TOOL = "final_answer"          # the JSON action that ends the run
MAX_INPUT_CHARS = 200                # a JSON action's input, at most


@dataclass(frozen=True)
class Tool:
    """A Python callable the agent may call with one string: `fn(input) -> result`
    (the result becomes the observation, as `str`). `description` is what the model
    reads about it (one line)."""

    name: str
    description: str
    fn: Callable[[str], Any]

    def __post_init__(self):
        if not isinstance(self.name, str) or not _TOOL_NAME.fullmatch(self.name):
            raise InvalidArgumentError(f"a tool name is a letter then letters, digits, '_' or '-' "
                                  f"(it is written as `Action: name[input]`), not {self.name!r}")
        if not isinstance(self.description, str) or not self.description.strip():
            raise InvalidArgumentError(f"tool {self.name!r} needs a description")
        if not callable(self.fn):
            raise InvalidArgumentTypeError(f"tool {self.name!r}: fn must be callable")

    def __call__(self, text: str) -> Any:
        return self.fn(text)


def tool(fn: Callable | None = None, *, name: str | None = None,
         description: str | None = None):
    """Make a function a `Tool`: `@tool` (name and description from the function's name
    and the first line of its docstring) or `@tool(name=..., description=...)`."""
    def make(f: Callable) -> Tool:
        doc = (f.__doc__ or "").strip().split("\n")[0].strip()
        return Tool(name or f.__name__, description or doc, f)

    return make if fn is None else make(fn)


@dataclass(frozen=True)
class ParsedStep:
    """What `parse_step` found in a step the model wrote."""

    thought: str
    tool: str | None = None
    input: str | None = None
    final: str | None = None


def parse_step(text: str) -> ParsedStep:
    """Read one ReAct step: a final answer wins over an action written after it; an action
    wins over a final answer written after it; neither: the text is the answer."""
    thought_match = _THOUGHT.search(text)
    thought = thought_match.group(1).strip() if thought_match else ""
    action = _ACTION.search(text)
    final = _FINAL.search(text)
    if action is not None and (final is None or action.start() < final.start()):
        return ParsedStep(thought, action.group(1), action.group(2).strip())
    if final is not None:
        return ParsedStep(thought, final=final.group(1).strip().split("\n")[0].strip())
    return ParsedStep(thought, final=None)


@dataclass(frozen=True)
class AgentStep:
    """One step of a run: what the model thought and did, and what it observed."""

    thought: str
    tool: str | None = None
    input: str | None = None
    observation: str | None = None
    error: bool = False              # the tool raised, or there is no such tool


@dataclass
class AgentRun:
    question: str
    answer: str | None
    finish: Literal["answer", "no_action", "max_steps"]
    steps: list[AgentStep]
    session: Any                     # the Session the loop ran on
    ttft: float | None = None        # seconds from run() to the first generated token
    total: float = 0.0

    @property
    def tool_calls(self) -> list[tuple[str, str]]:
        return [(s.tool, s.input) for s in self.steps if s.tool is not None]

    @property
    def turns(self) -> list:
        """The session's turns: prefill and generated tokens of every gen and select."""
        return self.session.turns

    def close(self) -> None:
        self.session.close()

    def __enter__(self) -> "AgentRun":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Agent:
    """A ReAct agent: `llm`, its tools, and the loop described in the module doc."""

    def __init__(self, llm: EngineView, tools: Iterable[Tool], *, name: str = "agent",
                 instructions: str = INSTRUCTIONS, format: str | None = None,
                 guided: bool = True, json_actions: bool = False, max_tokens: int = 48,
                 max_observation_chars: int = 400):
        self.llm = llm
        self.tools: dict[str, Tool] = {}
        for t in tools:
            if not isinstance(t, Tool):
                raise InvalidArgumentTypeError(f"an agent's tools are Tool objects, not {t!r}")
            if t.name in self.tools:
                raise DuplicateNameError(f"two tools are named {t.name!r}")
            self.tools[t.name] = t
        if not self.tools:
            raise InvalidArgumentError("an agent needs at least one tool")
        if FINAL_TOOL in self.tools and json_actions:
            raise InvalidArgumentError(f"{FINAL_TOOL!r} ends a JSON-action run: name the tool "
                                  "otherwise")
        self.guided = guided
        self.json_actions = json_actions
        if format is None:
            format = JSON_FORMAT if json_actions else FORMAT
        self.max_tokens = max_tokens
        self.max_observation_chars = max_observation_chars
        modules = tuple(nodes.Module(f"tool-{t.name}", (nodes.Text(
            f"- {t.name}: {' '.join(t.description.split())}\n"),)) for t in self.tools.values())
        body = (nodes.RoleOpen("system"), nodes.Text(instructions), *modules,
                nodes.Text(format), nodes.RoleClose("system"))
        self.schema = nodes.Schema(f"agent.{name}", (nodes.Module("agent", body),))

    # --- the prompt ----------------------------------------------------------------------------

    def prompt(self, question: str, tools: Sequence[str] | None = None) -> Prompt:
        """The request: the agent's module with the offered tools' modules (all by default),
        then the question as a user message and the assistant's turn opened."""
        offered = list(self.tools) if tools is None else list(tools)
        unknown = [t for t in offered if t not in self.tools]
        if unknown:
            known = ", ".join(self.tools)
            raise InvalidArgumentError(f"unknown tool {unknown[0]!r} (tools: {known})")
        refs = tuple(nodes.ModuleRef(f"tool-{t}") for t in self.tools if t in offered)
        doc = nodes.PromptDoc(self.schema.name, (
            nodes.ModuleRef("agent", children=refs), nodes.RoleOpen("user"),
            nodes.Text(question), nodes.RoleClose("user"), nodes.RoleOpen("assistant")))
        return Prompt("Agent", self.schema, doc, {"question": question, "tools": offered})

    # --- the loop --------------------------------------------------------------------------------

    def run(self, question: str, *, max_steps: int = 5, tools: Sequence[str] | None = None,
            first_action: tuple[str, str] | None = None, baseline: bool = False) -> AgentRun:
        """Answer `question`. `first_action=(tool, input)` scripts the first step's action
        (its thought is still generated): a way to make sure a tool runs. `baseline`
        serves the prompt with no reuse (for comparisons)."""
        from promptlang.runtime.conversation.session import Session

        if max_steps < 1:
            raise InvalidArgumentError(f"max_steps must be at least 1, not {max_steps}")
        started = time.perf_counter()
        prompt = self.prompt(question, tools)
        offered = [t for t in self.tools if t in prompt.arguments["tools"]]
        session = Session(self.llm, prompt, baseline=baseline)
        run = AgentRun(question, None, "max_steps", [], session)
        try:
            for index in range(max_steps):
                scripted = first_action if index == 0 else None
                outcome = self._step(session, offered, scripted)
                if run.ttft is None and session.turns:
                    first = session.turns[0]
                    run.ttft = first.started_at - started + first.timings.first_token
                if isinstance(outcome, AgentStep):
                    run.steps.append(outcome)
                else:
                    run.finish, run.answer = outcome
                    break
        except BaseException:
            session.close()
            raise
        run.total = time.perf_counter() - started
        return run

    def _step(self, session, offered: list[str], scripted) -> AgentStep | tuple[str, str]:
        """One step: the AgentStep of an action, or (finish, answer) at the end."""
        gen = dict(max_new_tokens=self.max_tokens)
        if self.json_actions:
            return self._json_step(session, offered, scripted)
        if scripted is not None or self.guided:
            session.append("Thought:")
            thought = session.generate(stop="\n", **gen).text.strip()
            session.append("\n")
            if scripted is not None:
                name, text = scripted
                session.append(f"Action: {name}[{text}]\n")
                return self._act(session, thought, name, text)
            if session.select(["Action:", "Final Answer:"]).text == "Final Answer:":
                return "answer", session.generate(stop="\n", **gen).text.strip()
            name = session.select([" " + t for t in offered]).text.strip()
            session.append("[")
            text = session.generate(stop=["]", "\n"], **gen).text.strip()
            session.append("]\n")
            return self._act(session, thought, name, text)
        written = session.generate(stop=["Observation:"], **gen).text
        parsed = parse_step(written)
        if parsed.tool is None:
            if parsed.final is not None:
                return "answer", parsed.final
            return "no_action", written.strip()
        if not written.endswith("\n"):
            session.append("\n")
        return self._act(session, parsed.thought, parsed.tool, parsed.input or "")

    def _json_step(self, session, offered: list[str], scripted) -> AgentStep | tuple[str, str]:
        """A step whose action is a JSON object constrained to the offered tools."""
        session.append("Thought:")
        thought = session.generate(stop="\n", max_new_tokens=self.max_tokens).text.strip()
        session.append("\nAction: ")
        if scripted is not None:
            name, text = scripted
            session.append(json.dumps({"tool": name, "input": text}) + "\n")
            return self._act(session, thought, name, text)
        schema = {"type": "object", "properties": {
            "tool": {"enum": [*offered, FINAL_TOOL]},
            "input": {"type": "string", "maxLength": MAX_INPUT_CHARS}},
            "required": ["tool", "input"], "additionalProperties": False}
        turn = session.generate(self.max_tokens + MAX_INPUT_CHARS, json_schema=schema)
        if not turn.complete:                     # cut by the token budget: no action
            return "no_action", turn.text.strip()
        call = json.loads(turn.text)
        session.append("\n")
        if call["tool"] == FINAL_TOOL:
            return "answer", call["input"].strip()
        return self._act(session, thought, call["tool"], call["input"])

    def _act(self, session, thought: str, name: str, text: str) -> AgentStep:
        """Run the tool and append its observation; a failure is an observation too."""
        observation, error = self.call_tool(name, text)
        session.append(f"Observation: {observation}\n")
        return AgentStep(thought, name, text, observation, error)

    def call_tool(self, name: str, text: str) -> tuple[str, bool]:
        """(observation, error): the tool's result as one line, or the error it raised."""
        found = self.tools.get(name)
        if found is None:
            return f"Error: there is no tool {name!r} (tools: {', '.join(self.tools)})", True
        try:
            observation = str(found(text))
            error = False
        except Exception as e:      # noqa: BLE001 - a failing tool is an observation
            observation = f"Error: {type(e).__name__}: {e}"
            error = True
        observation = " ".join(observation.split())
        if len(observation) > self.max_observation_chars:
            observation = observation[:self.max_observation_chars] + " ..."
        return observation, error
