"""One call of a @prompt function, traced: which modules it entered, with which arguments,
and the uncached text after them.

The instrumented function (`instrument.py`) reports each item it runs to its
`Hooks`, which forward to the `Trace` of the current call (a context variable, so
threads and nested calls each have their own). The trace keeps a stack of frames,
one per cached module entered; it switches to *tail* mode at the first item the
plan did not cache, after which every piece of text becomes uncached prompt text.

When a frame closes, the cached items it emitted must be exactly the module's own
items of the schema: the prompt must render to what the Python code emitted.

Each reported item id is looked up in the function's plan (`plan.py`): one
`PlannedItem` says whether it is cached, its text, its holes' parameters, the module
it opens.

Programs. The first `gen()` / `select()` that runs (`generation.py`) ends the static
part: every open frame is closed (the plan puts every cached item before it), and
the prompt so far becomes the call's `PromptDoc`. Without a program (a plain call,
`fn(...)`), the call stops there and returns that prompt. With one (`fn.run(llm,
...)`, `promptlang/programs.py`), the trace asks the program to `open` a live run on
that prompt, and from then on every text, role marker and generation goes to that
run as it happens. `Program` and `Live` below are all the compiler asks of them: the
public face implements them with a runtime session, which the compiler never imports.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Protocol

from promptlang.compiler.plan import FunctionPlan, merge_text, prompt_function_of
from promptlang.errors import InternalError, StateError, TraceError
from promptlang.pml import nodes

_CURRENT: ContextVar["Trace | None"] = ContextVar("promptlang_trace", default=None)


def current_trace() -> "Trace | None":
    """The trace of the @prompt call running in this context, if any."""
    return _CURRENT.get()


class Live(Protocol):
    """A program's live run: receives the text and role markers after the static part
    and runs each generation (a `generation.Gen` or `Select`), returning its text."""

    def text(self, text: str) -> None: ...

    def role(self, marker: nodes.RoleOpen | nodes.RoleClose) -> None: ...

    def generate(self, spec) -> str: ...


class Program(Protocol):
    """What runs a call's generations: opened with the static part at the first one."""

    def open(self, doc: nodes.PromptDoc) -> Live: ...


class _StaticPartDone(BaseException):
    """Raised at the first generation of a call that has no program to run it: the
    static part is complete. A BaseException, so that user code's `except Exception`
    does not swallow it (like GeneratorExit)."""


class Hooks:
    """`_promptlang_rt` inside the instrumented twin of one @prompt function."""

    def __init__(self, function):
        self.function = function

    def _trace(self) -> "Trace":
        trace = _CURRENT.get()
        if trace is None:
            raise StateError(f"the instrumented body of {self.function.__qualname__} ran "
                             "outside a call of a @prompt function")
        return trace

    def text(self, item: int) -> None:
        self._trace().text(self.function.plan(), item)

    def value(self, item: int, value) -> None:
        self._trace().value(self.function.plan(), item, value)

    def fstring(self, item: int, values: tuple[str, ...]) -> None:
        self._trace().fstring(self.function.plan(), item, values)

    def call(self, item: int, func, *args, **kwargs) -> None:
        self._trace().call(self.function.plan(), item, func, args, kwargs)

    def enter(self, item: int) -> None:
        self._trace().enter(self.function.plan(), item)

    def leave(self, item: int) -> None:
        self._trace().leave(self.function.plan(), item)

    def role(self, open_item: int, close_item: int):
        return self._trace().role(self.function.plan(), open_item, close_item)


@dataclass
class _Frame:
    plan: FunctionPlan
    key: int | None                      # None: the function's own module; else an arm id
    name: str
    args: list[nodes.Argument] = field(default_factory=list)
    children: list[nodes.ModuleRef] = field(default_factory=list)
    own: list[int] = field(default_factory=list)


class Trace:
    def __init__(self, program: Program | None = None):
        self.tail = False
        self.forced = 0                   # callees running inside the tail, all uncached
        self.frames: list[_Frame] = []
        self.uncached: list = []          # Text / RoleOpen / RoleClose after the modules
        self.program = program            # opens a live run at the first generation
        self.live: Live | None = None     # that run, once open: receives text and roles
        self.doc: nodes.PromptDoc | None = None    # the static part, once complete
        self.schema_name = ""

    # -- running a call -------------------------------------------------------------------

    def run(self, function, args, kwargs) -> nodes.PromptDoc:
        """Run one call; returns its prompt (the static part, for a program)."""
        plan = function.plan()
        self.schema_name = function.schema_name
        token = _CURRENT.set(self)
        try:
            self.frames.append(_Frame(plan, None, plan.module_name))
            try:
                function.instrumented()(*args, **kwargs)
            except _StaticPartDone:
                return self.doc
            if self.doc is None:
                self.finish_static()
        finally:
            _CURRENT.reset(token)
        return self.doc

    def finish_static(self) -> None:
        """Close every open frame, innermost first: the prompt so far is the call's."""
        while len(self.frames) > 1:
            frame = self.frames.pop()
            self.frames[-1].children.append(self.close(frame))
        root = self.close(self.frames.pop())
        self.doc = nodes.PromptDoc(self.schema_name, (root, *merge_text(self.uncached)))

    def close(self, frame: _Frame) -> nodes.ModuleRef:
        expected = frame.plan.expected(frame.key)
        if tuple(frame.own) != expected:
            missing = next((i for k, i in enumerate(expected)
                            if k >= len(frame.own) or frame.own[k] != i), None)
            span = frame.plan.items[missing].span if missing is not None else None
            raise TraceError(
                f"{frame.plan.ir.qualname} left out cached text of module '{frame.name}' that "
                "its schema always includes (an early exit from a block, or a suppressed "
                "exception?): the prompt would not render what the function emitted", span)
        return nodes.ModuleRef(frame.name, tuple(frame.args), tuple(frame.children))

    def is_tail(self, plan: FunctionPlan, item: int) -> bool:
        cached = plan.items[item].cached
        if not self.tail and not cached:
            self.tail = True
        elif self.tail and not self.forced and cached:
            # the plan puts every item that can run after uncached text in the tail
            if self.doc is not None:
                raise TraceError(
                    f"cached text of {plan.ir.qualname} ran after a generation: gen() or "
                    "select() was called where the compiler did not see it (from a helper "
                    "function?); call them directly in the @prompt function's body",
                    plan.items[item].span)
            raise InternalError(f"internal error: cached item {item} of "
                                f"{plan.ir.qualname} ran after uncached text",
                                plan.items[item].span)
        return self.tail

    def generation(self, spec) -> str:
        """A gen()/select() ran: open the live run at the first one, then let it generate."""
        self.tail = True
        if self.doc is None:
            self.finish_static()
            if self.program is None:
                raise _StaticPartDone()
            self.live = self.program.open(self.doc)
        if self.live is None:
            raise StateError("gen()/select() ran after the @prompt call finished")
        return self.live.generate(spec)

    def run_uncached(self, function, args, kwargs) -> None:
        self.forced += 1
        try:
            function(*args, **kwargs)
        finally:
            self.forced -= 1

    # -- events ---------------------------------------------------------------------------

    def _emit(self, text: str) -> None:
        if not text:
            return
        if self.live is not None:
            self.live.text(text)
        else:
            self.uncached.append(nodes.Text(text))

    def _role(self, marker) -> None:
        if self.live is not None:
            self.live.role(marker)
        else:
            self.uncached.append(marker)

    def text(self, plan: FunctionPlan, item: int) -> None:
        text = plan.items[item].text
        if self.is_tail(plan, item):
            self._emit(text)
        else:
            self.frames[-1].own.append(item)

    def value(self, plan: FunctionPlan, item: int, value) -> None:
        text = "" if value is None else str(value)
        if self.is_tail(plan, item):
            self._emit(text)
            return
        frame = self.frames[-1]
        frame.own.append(item)
        frame.args.append(nodes.Argument(plan.items[item].params[0], text))

    def fstring(self, plan: FunctionPlan, item: int, values: tuple[str, ...]) -> None:
        planned = plan.items[item]
        parts = planned.parts
        holes = iter(values)
        text = "".join(next(holes) if p is None else p for p in parts)
        if self.is_tail(plan, item):
            self._emit(text)
            return
        frame = self.frames[-1]
        frame.own.append(item)
        frame.args.extend(nodes.Argument(name, value)
                          for name, value in zip(planned.params, values))

    def call(self, plan: FunctionPlan, item: int, func, args, kwargs) -> None:
        planned = plan.items[item]
        static = planned.callee
        target = prompt_function_of(func)
        span = planned.span
        if planned.kind == "generation":     # gen()/select(): the live run keeps the text
            func(*args, **kwargs)
            return
        if static is None:        # compiled as a plain call: its text is uncached
            if target is not None:
                self.is_tail(plan, item)
                if getattr(func, "__self__", None) is not None and func is not target:
                    args = (func.__self__, *args)
                self.run_uncached(target.instrumented(), args, kwargs)
                return
            result = func(*args, **kwargs)
            if result is not None:
                self.is_tail(plan, item)
                self._emit(str(result))
            return
        if target is not static:
            raise TraceError(
                f"this call was compiled as a call to {static.__qualname__} but reached "
                f"{getattr(target, '__qualname__', repr(func))} at run time", span)
        if getattr(func, "__self__", None) is not None and func is not target:
            args = (func.__self__, *args)
        run = static.instrumented()
        if self.is_tail(plan, item):
            self.run_uncached(run, args, kwargs)
            return
        if planned.module is None:          # a callee that caches nothing
            run(*args, **kwargs)
            return
        frame = _Frame(static.plan(), None, planned.module)
        self.frames.append(frame)
        run(*args, **kwargs)
        if self.doc is not None:         # it generated: finish_static closed the frame
            return
        self.close_to(frame)

    def close_to(self, frame: _Frame) -> None:
        """Close the open frames down to `frame`, innermost first: arms a `return` left."""
        while True:
            inner = self.frames.pop()
            self.frames[-1].children.append(self.close(inner))
            if inner is frame:
                return

    def enter(self, plan: FunctionPlan, item: int) -> None:
        """An arm that is a module starts running."""
        module = plan.items[item].module
        if not self.tail and module is not None:
            self.frames.append(_Frame(plan, item, module))

    def leave(self, plan: FunctionPlan, item: int) -> None:
        """An arm ran to its end; its module is closed unless `enter` opened none (the
        tail had started) or a generation closed it already."""
        frame = self.frames[-1] if self.frames else None
        if self.doc is None and frame is not None and frame.plan is plan and frame.key == item:
            self.close_to(frame)

    @contextmanager
    def role(self, plan: FunctionPlan, open_item: int, close_item: int):
        role = plan.items[open_item].role
        if self.is_tail(plan, open_item):
            self._role(nodes.RoleOpen(role))
        else:
            self.frames[-1].own.append(open_item)
        yield
        if self.is_tail(plan, close_item):
            self._role(nodes.RoleClose(role))
        else:
            self.frames[-1].own.append(close_item)
