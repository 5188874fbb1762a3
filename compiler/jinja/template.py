"""`from_template`: a Jinja2 template as a prompt function, and what a call of it returns.

    t = from_template("prompts/rag.j2", documents={"docs": corpus})
    p = t(docs=[corpus[2], corpus[5]], question="Where do bees live?")
    llm.generate(p)              # a Prompt, like a @prompt function's call

The template is compiled when `from_template` returns (`lower.py`); a call computes
only the values the schema's parameters take, the arms its ifs choose, the documents
its loop imports, and renders the uncached tail with Jinja2.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import jinja2
from jinja2.loaders import split_template_path

from promptlang.compiler.diagnostics import Diagnostic, errors
from promptlang.compiler.jinja.lower import Options, lower
from promptlang.compiler.jinja.plan import (Branch, Documents, Hole, Nested, Step,
                                            TemplatePlan)
from promptlang.errors import CompileError, InvalidArgumentError, SourceFileError
from promptlang.inputs import decode_utf8, read_bytes
from promptlang.pml import nodes
from promptlang.pml.prompt import Prompt
from promptlang.pml.writer import write

MAX_TEMPLATE_BYTES = 16 * 1024 * 1024        # a template's source, checked before reading
EXTENSIONS = (".j2", ".jinja", ".jinja2")


def maxlen(value: Any, tokens: int) -> Any:
    """The `maxlen(N)` filter: a length bound for promptlang; Jinja2 renders the value as is
    (the bound is checked in tokens when the prompt is bound to a tokenizer)."""
    return value


def template_environment(loader: jinja2.BaseLoader | str | os.PathLike | None = None,
                         **options: Any) -> jinja2.Environment:
    """A Jinja2 environment that knows `maxlen`: a folder (or a loader) and Jinja2's options."""
    if isinstance(loader, (str, os.PathLike)):
        loader = _BoundedLoader(Path(loader))
    environment = jinja2.Environment(loader=loader, **options)
    environment.filters["maxlen"] = maxlen
    return environment


class _BoundedLoader(jinja2.FileSystemLoader):
    """Jinja2's folder loader, reading only regular files of at most MAX_TEMPLATE_BYTES of
    UTF-8 (`promptlang.inputs`: sizes are checked before reading, FIFOs never opened)."""

    def get_source(self, environment, template):
        pieces = split_template_path(template)
        for folder in self.searchpath:
            path = Path(folder, *pieces)
            if not path.exists():
                continue
            data = read_bytes(path, max_bytes=MAX_TEMPLATE_BYTES, error=SourceFileError)
            text = decode_utf8(data, str(path), error=SourceFileError)
            mtime = path.stat().st_mtime
            return text, os.path.normpath(path), lambda: _unchanged(path, mtime)
        raise jinja2.TemplateNotFound(template)


def _unchanged(path: Path, mtime: float) -> bool:
    try:
        return path.stat().st_mtime == mtime
    except OSError:
        return False


class TemplatePrompt:
    """A compiled Jinja2 template: call it with the template's variables for a `Prompt`."""

    def __init__(self, plan: TemplatePlan, environment: jinja2.Environment,
                 diagnostics: Sequence[Diagnostic], generation: bool):
        self.plan = plan
        self.environment = environment
        self.diagnostics = tuple(diagnostics)
        self.generation = generation
        self.schema = plan.schema

    @property
    def schema_name(self) -> str:
        return self.schema.name

    def schema_pml(self) -> str:
        return write(self.schema)

    def __call__(self, variables: Mapping[str, Any] | None = None, /, **more: Any) -> Prompt:
        context = {**(variables or {}), **more}
        for name in self.plan.documents:
            context[name] = self._in_corpus_order(name, context.get(name))
        args, children = self._refs(self.plan.steps, context)
        parts: list = [nodes.ModuleRef(self.plan.root, args, children)]
        for piece in self.plan.tail:
            if piece.kind == "open":
                parts.append(nodes.RoleOpen(piece.role))
            elif piece.kind == "close":
                parts.append(nodes.RoleClose(piece.role))
            else:
                text = self._render(piece.template, context)
                if text:
                    parts.append(nodes.Text(text))
        if self.generation:
            parts.append(nodes.RoleOpen("assistant"))
        doc = nodes.PromptDoc(self.schema.name, tuple(parts))
        return Prompt(self.plan.name, self.schema, doc, context)

    def _render(self, template: jinja2.Template, scope: Mapping[str, Any]) -> str:
        try:
            return template.render(scope)
        except jinja2.TemplateError as e:
            raise InvalidArgumentError(f"{self.plan.name}: Jinja2 could not render it: "
                                       f"{e}") from None

    def _refs(self, steps: Sequence[Step], context: Mapping[str, Any]
              ) -> tuple[tuple[nodes.Argument, ...], tuple[nodes.ModuleRef, ...]]:
        args: list[nodes.Argument] = []
        children: list[nodes.ModuleRef] = []
        for step in steps:
            if isinstance(step, Hole):
                value = self._render(step.template, {**context, **step.scope})
                args.append(nodes.Argument(step.param, value))
            elif isinstance(step, Branch):
                for arm in step.arms:
                    taken = arm.test is None or self._render(
                        arm.test, {**context, **arm.scope}) == "1"
                    if taken:
                        if arm.module is not None:
                            children.append(nodes.ModuleRef(arm.module,
                                                            *self._refs(arm.steps, context)))
                        break
            elif isinstance(step, Nested):
                children.append(nodes.ModuleRef(step.module, *self._refs(step.steps, context)))
            elif isinstance(step, Documents):
                chosen = {id(d) for d in context[step.name]}
                for member in step.members:
                    if id(step.corpus[member.index]) in chosen:
                        children.append(nodes.ModuleRef(member.module,
                                                        *self._refs(member.steps, context)))
        return tuple(args), tuple(children)

    def _in_corpus_order(self, name: str, given: Any) -> list:
        """The call's documents, each matched to the compile-time documents, in their order
        (the order the cache lays them out)."""
        loop = self._documents(name)
        if given is None:
            return []
        if isinstance(given, (str, bytes, Mapping)) or not isinstance(given, Sequence):
            raise InvalidArgumentError(f"{name!r} must be a list of documents, not "
                                       f"{type(given).__name__}", loop.span)
        used: set[int] = set()
        for position, document in enumerate(given):
            index = next((i for i, known in enumerate(loop.corpus)
                          if i not in used and _same(known, document)), None)
            if index is None:
                raise InvalidArgumentError(
                    f"{name}[{position}] is not one of the {len(loop.corpus)} documents the "
                    f"template was compiled with (or is given twice)", loop.span)
            used.add(index)
        return [loop.corpus[i] for i in sorted(used)]

    def _documents(self, name: str) -> Documents:
        found = _find_documents(self.plan.steps, name)
        if found is None:
            raise InvalidArgumentError(f"no documents loop reads {name!r}")
        return found

    def render(self, variables: Mapping[str, Any] | None = None, /, **more: Any) -> str:
        """What Jinja2 itself renders for these variables (the documents in corpus order)."""
        context = {**(variables or {}), **more}
        for name in self.plan.documents:
            context[name] = self._in_corpus_order(name, context.get(name))
        return self.environment.get_template(self.plan.name).render(context)

    def __repr__(self) -> str:
        return f"<TemplatePrompt {self.plan.name}: schema {self.schema.name}>"


def _same(known: Any, given: Any) -> bool:
    try:
        return known is given or bool(known == given)
    except Exception:       # an item whose == raises is simply not that document
        return False


def _find_documents(steps: Sequence[Step], name: str) -> Documents | None:
    for step in steps:
        if isinstance(step, Documents) and step.name == name:
            return step
        for inner in step.inner():
            found = _find_documents(inner, name)
            if found is not None:
                return found
    return None


def from_template(template: str | os.PathLike, *,
                  environment: jinja2.Environment | None = None,
                  documents: Mapping[str, Sequence[Any]] | None = None,
                  params: Mapping[str, int] | None = None,
                  role: str | None = "user", generation: bool = True,
                  lenient: bool = False) -> TemplatePrompt:
    """Compile a Jinja2 template to a prompt function.

    template: a file (`prompts/rag.j2`; its folder is the loader's, for includes), or,
        with `environment`, a name its loader knows.
    documents: for each loop variable that lists documents, every document it may take
        (strings or mappings); each is cached as a module of its own.
    params: length bounds in tokens by variable (`{"question": 64}`), beside `| maxlen(N)`.
    role: the chat role around a template with no `{% block system|user|assistant %}`;
        None for plain text.
    generation: end the prompt with the assistant's turn.
    lenient: constructs that cannot be cached start the uncached tail instead of being errors.
    Raises CompileError with every diagnostic, located `file:line:col`.
    """
    if environment is None:
        path = Path(template)
        if not path.is_file():
            raise SourceFileError(f"{path}: no such template file")
        environment = template_environment(path.parent)
        name = path.name
    else:
        environment = environment.overlay()
        environment.filters = {**environment.filters, "maxlen": maxlen}
        name = os.fspath(template)
    try:
        source, filename, _ = environment.loader.get_source(environment, name) \
            if environment.loader is not None else (None, None, None)
    except jinja2.TemplateNotFound:
        source = None
    except UnicodeDecodeError as e:      # a loader of the application's own
        raise SourceFileError(f"{name}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if source is None:
        raise SourceFileError(f"{name}: the environment's loader finds no such template")
    if role is not None and role not in nodes.ROLES:
        raise InvalidArgumentError(f"role must be one of {', '.join(nodes.ROLES)} or None, "
                                   f"not {role!r}")
    options = Options(documents=dict(documents or {}), params=dict(params or {}), role=role,
                      lenient=lenient)
    plan, diagnostics = lower(environment, name, filename or name, source, options)
    if plan is None or errors(diagnostics):
        raise CompileError(diagnostics)
    return TemplatePrompt(plan, environment, diagnostics,
                          generation and (role is not None or _has_roles(plan)))


def _has_roles(plan: TemplatePlan) -> bool:
    return any(isinstance(c, (nodes.RoleOpen, nodes.RoleClose))
               for module in plan.schema.children if isinstance(module, nodes.Module)
               for c in module.children) or any(p.kind != "text" for p in plan.tail)
