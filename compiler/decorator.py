"""`@prompt`: turns a function into a `PromptFunction`.

    @prompt                                       # bare
    def greet(name: Annotated[str, MaxTokens(8)]): ...

    @prompt(name="shop.greet", params={"name": 8})   # with options
    def greet(name): ...

Decorating analyses the source (`analyze.py`) and raises `CompileError` for what
is wrong in the function alone. The first call (or `.schema`) lowers it
(`lower.py`: names resolved, bounds read, cached part chosen: a `plan.FunctionPlan`)
and builds its instrumented twin (`instrument.py`); errors that need other functions
surface then. Calling it runs the twin with the real arguments (`trace.py`) and
returns a `CompiledPrompt`.

A function that calls gen()/select() is also a program: `fn.run(llm, ...)` runs
it with a model. That is the public face's job (`promptlang/programs.py`, which joins
compiler and runtime), imported only when `run` or `runner` is called; `fn(...)`
still returns the Prompt of its static part (everything before the first generation).
"""

from __future__ import annotations

import functools
import inspect
import re
import threading
import types
from contextlib import contextmanager
from contextvars import ContextVar
from types import MappingProxyType
from typing import Any, Callable, Mapping

from promptlang.compiler.lower import plan_function, schema_of
from promptlang.compiler.analyze import analyze_function
from promptlang.compiler.diagnostics import Diagnostic, errors
from promptlang.compiler.instrument import instrument
from promptlang.compiler.plan import FunctionPlan, PlannedFunction
from promptlang.compiler.prompt import CompiledPrompt
from promptlang.compiler.source import caller_span, deepest_span, module_name_for_file
from promptlang.compiler.trace import Hooks, Trace
from promptlang.errors import CompileError, InvalidArgumentTypeError
from promptlang.pml import nodes
from promptlang.pml.writer import write

_COLLECTING: ContextVar[list | None] = ContextVar("promptlang_collecting", default=None)
_PLANNING = threading.RLock()      # plans read other functions' plans: one lock for all


def prompt(fn: Callable | None = None, *, name: str | None = None,
           params: Mapping[str, Any] | None = None):
    """Make `fn` a prompt program. `name`: the schema name (default: module-qualified
    function name). `params`: length bounds in tokens, by parameter, local variable or
    hole expression (`{"question": 32}`; a `MaxTokens` works too)."""
    def decorate(f: Callable) -> "PromptFunction":
        return PromptFunction(f, name=name, params=params)

    return decorate if fn is None else decorate(fn)


class PromptFunction(PlannedFunction):
    """A @prompt function. Calling it returns a `Prompt`; on a class it binds like a method."""

    def __init__(self, fn: Callable, *, name: str | None = None,
                 params: Mapping[str, Any] | None = None):
        where = caller_span()
        if isinstance(fn, PromptFunction):
            raise CompileError([Diagnostic(
                "PL111", f"@prompt is applied twice to {fn.__qualname__}", where)])
        if isinstance(fn, (staticmethod, classmethod)):
            raise InvalidArgumentTypeError(f"put @prompt below @{type(fn).__name__}, "
                                           "directly on the def")
        if not inspect.isfunction(fn):
            raise InvalidArgumentTypeError(f"@prompt decorates a function, not {type(fn).__name__}")
        if name is not None and (not isinstance(name, str) or not name.strip()):
            raise InvalidArgumentTypeError(f"@prompt(name=...) must be a non-empty string, "
                                           f"not {name!r}")
        functools.update_wrapper(self, fn)
        self.options = {"name": name, "params": dict(params or {})}
        self.schema_name = name or default_schema_name(fn)
        self.defined_at = where          # where it was decorated (an exec call, for exec'd code)
        self.analysis = analyze_function(fn, where)
        self._plan: FunctionPlan | None = None
        self._instrumented: types.FunctionType | None = None
        self._schema: nodes.Schema | None = None
        self._signature = inspect.signature(fn)
        collected = _COLLECTING.get()
        if collected is not None:
            collected.append(self)
        elif errors(self.analysis.diagnostics):
            raise CompileError(self.analysis.diagnostics)

    # -- compiling ------------------------------------------------------------------------

    def plan(self, stack: tuple = ()) -> FunctionPlan:
        """What this function caches (computed once; raises CompileError)."""
        if self._plan is None:
            with _PLANNING:
                if self._plan is None:
                    try:
                        plan = plan_function(self, stack)
                        instrumented = instrument(self.__wrapped__, self.analysis, plan,
                                                  Hooks(self))
                    except RecursionError:
                        raise self._too_deep(None) from None
                    except SyntaxError as e:     # CPython's limits on the rewritten body
                        raise self._too_deep(e) from None
                    self._instrumented = instrumented
                    self._plan = plan
        return self._plan

    def _too_deep(self, error: SyntaxError | None) -> CompileError:
        source = self.analysis.source
        if error is not None and error.lineno:
            text = source.file_span(error.lineno, 0).line_text
            span = source.file_span(error.lineno, len(text) - len(text.lstrip()))
            why = f"CPython refuses the compiled body: {error.msg}"
        else:
            span = deepest_span(source.padded_text(), source.file)
            why = "a very long expression or deeply nested blocks"
        return CompileError([Diagnostic(
            "PL004", f"{self.__qualname__} nests too deeply for the compiler ({why})", span)])

    def instrumented(self) -> types.FunctionType:
        self.plan()
        return self._instrumented

    @property
    def schema(self) -> nodes.Schema:
        """The PML schema of this function (and the @prompt functions it calls)."""
        if self._schema is None:
            self._schema = schema_of(self)
        return self._schema

    def schema_pml(self) -> str:
        return write(self.schema)

    @property
    def diagnostics(self) -> tuple[Diagnostic, ...]:
        """Warnings and errors found so far (the analysis, and the plan once made)."""
        found = list(self.analysis.diagnostics)
        if self._plan is not None:
            found += [d for d in self._plan.diagnostics if d not in found]
        return tuple(found)

    # -- calling --------------------------------------------------------------------------

    def __call__(self, *args, **kwargs) -> CompiledPrompt:
        self.plan()
        bound = self._signature.bind(*args, **kwargs)
        bound.apply_defaults()
        doc = Trace().run(self, args, kwargs)
        return CompiledPrompt(self.__qualname__, self.schema, doc,
                              MappingProxyType(dict(bound.arguments)))

    @property
    def generates(self) -> bool:
        """Whether a call may run gen()/select(): the function is a program."""
        return self.plan().generates

    def run(self, llm, /, *args, **kwargs):
        """Run the function with `llm`: the static part is served from cached modules,
        the body after the first gen()/select() runs live on a session. Returns a
        `ProgramRun` (`run["answer"]`, `run.ttft`, `run.text`, `run.session`)."""
        return self.runner(llm)(*args, **kwargs)

    def runner(self, llm, *, baseline: bool = False, seed: int | None = None):
        """A callable that runs this function with `llm` and these options:
        `fn.runner(llm, baseline=True)(*args)` serves the static part with no reuse."""
        from promptlang.programs import Program   # the public face: compiler + runtime

        self.plan()
        return Program(self, llm, baseline=baseline, seed=seed)

    def __get__(self, instance, owner=None):
        return self if instance is None else types.MethodType(self, instance)

    def __repr__(self) -> str:
        return f"<@prompt function {self.__module__}.{self.__qualname__}>"


def default_schema_name(fn: Callable) -> str:
    """`module.qualname` (no `<locals>`): the same in every process and on every machine."""
    module = fn.__module__
    if not module or module == "__main__":
        module = module_name_for_file(fn.__code__.co_filename)
    qualname = ".".join(p for p in fn.__qualname__.split(".") if p != "<locals>")
    return re.sub(r"[^\w.-]+", "-", f"{module}.{qualname}")


@contextmanager
def collecting():
    """Within this block, @prompt records the functions it makes (in a list it yields)
    instead of raising their analysis errors: `promptlang check` reports them all."""
    found: list[PromptFunction] = []
    token = _COLLECTING.set(found)
    try:
        yield found
    finally:
        _COLLECTING.reset(token)
