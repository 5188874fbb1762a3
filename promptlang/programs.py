"""Programs: a @prompt function that generates, run with a model (`fn.run(llm, ...)`).

    run = qa.run(llm, "What is KV caching?")          # or qa.runner(llm, baseline=True)(...)
    run["answer"], run.ttft, run.text

This is the public face's join of the compiler and the runtime; neither knows the
other. `Program.__call__` traces the call (`compiler/trace.py`) with a `_Call` as the
trace's program (the `trace.Program` protocol the compiler owns). At the first
gen()/select() the trace hands over the prompt so far (cached modules, and any
uncached text before the generation); `_Call.open` opens a runtime `Session` on it
(`runtime/conversation/session.py`: the modules' KV assembled, the uncached tokens prefilled) and
returns a `_Live` (the `trace.Live` protocol): from then on the trace sends the
function's text and role markers to it, which queues them on the session, and each
generation runs on the session and returns its text to the function: control flow
after it is ordinary Python with the results.

`PromptFunction.run` / `.runner` import this module when called; the runtime (torch)
is imported when a program opens its session.
"""

from __future__ import annotations

import json

import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from promptlang.compiler.generate_calls import Gen, Select
from promptlang.compiler.prompt import CompiledPrompt
from promptlang.compiler.trace import Trace
from promptlang.errors import InvalidArgumentTypeError
from promptlang.pml import nodes
from promptlang.pml.prompt import Prompt


@dataclass
class ProgramRun:
    """One run of a program. `run["answer"]` is the text of the last gen/select named
    "answer"; `steps` lists every generation in order (session `Turn`s)."""

    prompt: Prompt                   # the static part: what was bound and served cached
    session: Any                     # the live Session (close it, or use `with`)
    variables: dict[str, str] = field(default_factory=dict)
    choices: dict[str, Any] = field(default_factory=dict)   # select name -> Choice (scores)
    steps: list = field(default_factory=list)               # Turn per gen/select
    ttft: float | None = None        # seconds from the call to the first generated token
    total: float = 0.0               # seconds for the whole run

    def __getitem__(self, name: str) -> str:
        try:
            return self.variables[name]
        except KeyError:
            known = ", ".join(sorted(self.variables)) or "none"
            raise KeyError(f"no gen/select named {name!r} ran (named: {known})") from None

    def __contains__(self, name: str) -> bool:
        return name in self.variables

    def get(self, name: str, default=None):
        return self.variables.get(name, default)

    @property
    def text(self) -> str:
        """The whole conversation: the prompt, the live text and every generation."""
        return self.session.text

    @property
    def opening(self):
        """What serving the static part cost (cached and computed tokens, timings)."""
        return self.session.opening

    def close(self) -> None:
        self.session.close()

    def __enter__(self) -> "ProgramRun":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Program:
    """A @prompt function bound to a model: call it like the function to run it.

    baseline: serve the static part with no reuse (every token computed, positions
    0..N-1), for comparisons. seed: the sampling seed of gen() calls that set none
    (each gen gets seed + its index); None draws fresh seeds."""

    def __init__(self, function, llm, *, baseline: bool = False, seed: int | None = None):
        self.function = function
        self.llm = llm
        self.baseline = baseline
        self.seed = seed

    def __call__(self, *args, **kwargs) -> ProgramRun:
        started = time.perf_counter()
        bound = self.function._signature.bind(*args, **kwargs)
        bound.apply_defaults()
        call = _Call(self, MappingProxyType(dict(bound.arguments)), started)
        try:
            doc = Trace(program=call).run(self.function, args, kwargs)
            live = call.live or call.open(doc)      # no generation ran: open it anyway
        except BaseException:
            if call.live is not None:
                call.live.session.close()
            raise
        live.run.total = time.perf_counter() - started
        return live.run

    def __repr__(self) -> str:
        return f"<Program {self.function.__qualname__} on {self.llm!r}>"


class _Call:
    """One call of a program: the trace's `program`, opened at the first generation."""

    def __init__(self, program: Program, arguments, started: float):
        self.program = program
        self.arguments = arguments
        self.started = started
        self.live: _Live | None = None

    def open(self, doc: nodes.PromptDoc) -> "_Live":
        """Serve the static part (`doc`) and return what receives the rest."""
        from promptlang.runtime.conversation.session import Session

        function = self.program.function
        prompt = CompiledPrompt(function.__qualname__, function.schema, doc, self.arguments)
        session = Session(self.program.llm, prompt, baseline=self.program.baseline)
        self.live = _Live(ProgramRun(prompt, session), self.started, self.program.seed)
        return self.live


class _Live:
    """What the trace talks to once a program is live: text, role markers, generations."""

    def __init__(self, run: ProgramRun, started: float, seed: int | None):
        self.run = run
        self.session = run.session
        self.started = started
        self.seed = seed

    def text(self, text: str) -> None:
        self.session.append(text)

    def role(self, marker) -> None:
        if isinstance(marker, nodes.RoleOpen):
            self.session.open_role(marker.role)
        else:
            self.session.close_role(marker.role)

    def generate(self, spec) -> str:
        if isinstance(spec, Gen):
            seed = spec.seed
            if seed is None and self.seed is not None:
                seed = self.seed + len(self.run.steps)
            turn = self.session.generate(spec.max_tokens, stop=spec.stop,
                                         temperature=spec.temperature, top_p=spec.top_p,
                                         top_k=spec.top_k, seed=seed, name=spec.name,
                                         regex=spec.regex, json_schema=spec.json_schema,
                                         grammar=spec.grammar)
        elif isinstance(spec, Select):
            self.session.select(spec.options, name=spec.name, normalise=spec.normalise)
            turn = self.session.turns[-1]
            if spec.name is not None:
                self.run.choices[spec.name] = turn.choice
        else:
            raise InvalidArgumentTypeError(f"not a generation: {spec!r}")
        if self.run.ttft is None:
            self.run.ttft = turn.started_at - self.started + turn.timings.first_token
        self.run.steps.append(turn)
        if spec.name is not None:
            self.run.variables[spec.name] = turn.text
            if isinstance(spec, Gen) and spec.json_schema is not None and turn.complete:
                self.run.variables[spec.name] = json.loads(turn.text)   # run["call"]: a dict
        return turn.text
