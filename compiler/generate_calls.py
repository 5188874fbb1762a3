"""`gen()` and `select()`: generation inside a @prompt function's body (Guidance style).

    @prompt
    def qa(question):
        with system():
            "Answer briefly."
        with user():
            question
        with assistant():
            answer = gen("answer", max_tokens=32, stop="\\n")
        if answer.endswith("?"):
            ...

The compiler recognises calls to these two functions (resolved like role helpers):
the first one that runs ends the cached part of the function, and everything after
it runs live against a session (`promptlang/programs.py`). At run time each call
forwards a frozen request (`Gen`, `Select`) to the trace of the current call
(`trace.py`), which returns the text the model produced or chose.

No torch here: these are plain functions and dataclasses.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Literal, Sequence

from promptlang.compiler.markers import bad_token_count, token_count_problem
from promptlang.compiler.trace import current_trace
from promptlang.errors import InvalidArgumentError, StateError

Normalise = Literal["sum", "mean", "grammar"]


@dataclass(frozen=True)
class Gen:
    """One `gen(...)` call: decode into the named slot."""

    name: str | None
    max_tokens: int
    stop: tuple[str, ...]
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    # structured output (runtime/decoding/constrain.py): at most one of regex, json_schema, grammar
    regex: str | None = None
    json_schema: Any = None            # a dict, JSON text, a file (Path) or a pydantic model
    grammar: str | None = None         # a Lark grammar


@dataclass(frozen=True)
class Select:
    """One `select(...)` call: append the option with the highest score."""

    name: str | None
    options: tuple[str, ...]
    normalise: Normalise


def gen(name: str | None = None, *, max_tokens: int = 256, stop: str | Sequence[str] | None = None,
        temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
        seed: int | None = None, regex: str | None = None, json_schema: Any = None,
        grammar: str | None = None) -> str:
    """Generate text at this point of a @prompt function and return it.

    The text (without the stop string) is also stored under `name` in the run's
    results (`run["answer"]`) and becomes part of the conversation. Decoding stops at
    the model's end-of-sequence token, at the first `stop` string, or after
    `max_tokens` tokens. temperature 0 is greedy; above 0 samples (with top_p/top_k);
    `seed` makes sampling reproducible (default: the run's seed). `regex`, `json_schema`
    (a dict, JSON text, a Path of a file or a pydantic model class) or `grammar` (Lark)
    constrains the text to that language; with `json_schema` the run holds the parsed
    value (`run["call"]` is a dict) once the output is complete, the text otherwise.
    """
    if name is not None and (not isinstance(name, str) or not name):
        raise InvalidArgumentError(f"gen() names its result with a non-empty string, not {name!r}")
    stops = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
    if any(not isinstance(s, str) or not s for s in stops):
        raise InvalidArgumentError(f"gen(stop=...) takes non-empty strings, not {stop!r}")
    if token_count_problem(max_tokens) is not None:
        raise bad_token_count("gen(max_tokens=...)", max_tokens)
    for label, value in (("temperature", temperature), ("top_p", top_p)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value):
            raise InvalidArgumentError(f"gen({label}=...) must be a number, not {value!r}")
    given = [n for n, v in (("regex", regex), ("json_schema", json_schema),
                            ("grammar", grammar)) if v is not None]
    if len(given) > 1:
        raise InvalidArgumentError(f"gen() takes at most one of regex, json_schema and grammar, "
                                   f"not {' and '.join(given)}")
    spec = Gen(name, max_tokens, stops, float(temperature), float(top_p),
               operator.index(top_k), seed, regex, json_schema, grammar)
    return _current_trace("gen").generation(spec)


def select(*args, name: str | None = None, options: Sequence[str] | None = None,
           normalise: Normalise = "sum") -> str:
    """Choose one of `options` at this point of a @prompt function and return it.

    Each option's score is the total log-probability of its tokens under the model,
    given everything before (`normalise="sum"`, the default: the option's actual
    probability, so the choice is the most likely of the given continuations), or the
    per-token average (`normalise="mean"`: does not favour short options). Exact, not
    sampled; ties go to the first option. `normalise="grammar"` instead decodes greedily
    under a grammar of the options (Guidance's select, through llguidance): its cost grows
    with the longest option, not with how many there are, so it suits long option lists.
    The chosen option becomes part of the conversation and is stored under `name`
    (`run["tool"]`; the scores are in `run.choices["tool"]`).

    `select("tool", ["a", "b"])` and Guidance's `select(["a", "b"], name="tool")` both
    work: a positional string is the name, a positional list the options.
    """
    for arg in args:
        if isinstance(arg, str) and name is None:
            name = arg
        elif not isinstance(arg, str) and options is None:
            options = arg
        else:
            raise InvalidArgumentError(f"select() takes one name and one list of options, "
                                       f"not {args!r}")
    if isinstance(options, str) or not isinstance(options, Sequence):
        raise InvalidArgumentError(f"select() takes a list of option strings, not {options!r}")
    options = tuple(options)
    if not options or any(not isinstance(o, str) or not o for o in options):
        raise InvalidArgumentError(f"select() needs at least one option, each a non-empty string: "
                                   f"{options!r}")
    if len(set(options)) != len(options):
        raise InvalidArgumentError(f"select() options must be distinct: {options!r}")
    if name is not None and (not isinstance(name, str) or not name):
        raise InvalidArgumentError(f"select() names its result with a non-empty string, "
                                   f"not {name!r}")
    if normalise not in ("sum", "mean", "grammar"):
        raise InvalidArgumentError(f"select(normalise=...) is 'sum', 'mean' or 'grammar', not "
                                   f"{normalise!r}")
    return _current_trace("select").generation(Select(name, options, normalise))


def _current_trace(what: str):
    trace = current_trace()
    if trace is None:
        raise StateError(f"{what}() only runs inside a @prompt function: call the function "
                         f"with an LLM (fn.run(llm, ...)) to generate")
    return trace


GENERATORS = (gen, select)


def is_generator(value) -> bool:
    """Whether `value` is promptlang's gen() or select()."""
    return any(value is g for g in GENERATORS)
