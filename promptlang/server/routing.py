"""Which modules a request needs, read from its body without the model: a cluster's routing.

A multi-replica deployment (cluster.py) routes each request to the replica that already
holds its modules' KV. The ingress has no model and no tokenizer, so it names each module
the request imports by a *routing key*: a digest of what determines the module's KV for a
given model -- the schema's name and the module's path, or for a plain chat request the
conversation up to and including that message (chat modules are messages: prompts.py). A
key's weight is the length of the module's own text in characters, a stand-in for its KV
bytes (both grow with its tokens). Arguments and per-request text are computed per
request and need no routing.

`RequestRoute.modules` maps each module path ("a/b"; "" for the schema's own text) to its
(key, weight): the replica that serves the request maps those paths to the store keys of
the units it assembled (cluster.py), so that it can report which keys it still holds.
`RequestRoute.prompt` is the request's text in reading order, for routers that match
prompt prefixes (Ray Serve LLM's prefix-cache router reads `.prompt`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Mapping

from promptlang.pml import nodes
from promptlang.server.prompts import (COMPLETION_SCHEMA, extension_prompt,
                                       parse_messages)


@dataclass
class RequestRoute:
    """What the router needs of one request."""

    modules: dict[str, tuple[str, int]] = field(default_factory=dict)  # path -> (key, weight)
    prompt: str = ""

    @property
    def keys(self) -> dict[str, int]:
        """Routing key -> weight."""
        return {key: weight for key, weight in self.modules.values()}


class SchemaBook:
    """The schemas (by name) and @prompt functions the servers serve, as read by
    load.read_sources; no model."""

    def __init__(self, schemas=(), functions: Mapping[str, Any] | None = None):
        self.schemas = {schema.name: schema for schema in schemas}
        self.functions = dict(functions or {})


def route(body: Any, chat: bool, book: SchemaBook) -> RequestRoute:
    """The request's route; an empty one for a body the replica will refuse (its error is
    the replica's to give, located as ever)."""
    if not isinstance(body, Mapping):
        return RequestRoute()
    try:
        if "promptlang" in body:
            return _extension_route(body["promptlang"], book)
        if chat:
            return _chat_route(body.get("messages"))
        prompt = body.get("prompt")
        return RequestRoute(prompt=prompt if isinstance(prompt, str) else "")
    except Exception:        # noqa: BLE001 - user input: the replica reports it properly
        return RequestRoute()


def routing_key(*parts: str) -> str:
    digest = hashlib.sha256("\0".join(parts).encode("utf-8", "surrogatepass"))
    return digest.hexdigest()[:32]


def _chat_route(raw: Any) -> RequestRoute:
    """A chat's modules are its messages before the last (prompts.ChatSchemas): message i is
    module `m{i}` (system excluded), its KV fixed by the conversation up to it; the system
    text is the schema's own."""
    messages = parse_messages(raw)
    route = RequestRoute(prompt="".join(m.content for m in messages))
    earlier = [(m.role, m.content) for m in messages if m.role == "system"]
    if earlier:
        route.modules[""] = (routing_key("chat", repr(earlier)), len(earlier[0][1]) or 1)
    turns = [m for m in messages if m.role != "system"]
    for i, message in enumerate(turns[:-1]):
        earlier.append((message.role, message.content))
        route.modules[f"m{i}"] = (routing_key("chat", repr(earlier)), len(message.content) or 1)
    return route


def _extension_route(ext: Any, book: SchemaBook) -> RequestRoute:
    prompt = extension_prompt(ext, book.functions)
    if isinstance(prompt, nodes.PromptDoc):           # PML: its schema is named
        doc = prompt
        schema = book.schemas.get(prompt.schema)
    else:                                             # a @prompt function's call
        doc = prompt.doc
        schema = prompt.schema
    if schema is None or doc.schema == COMPLETION_SCHEMA:
        return RequestRoute()
    modules = _module_table(schema)
    route = RequestRoute()
    text = [_own_text(schema.children)]
    route.modules[""] = (routing_key("pml", schema.name, ""), len(text[0]) or 1)

    def visit(children, parent: tuple[str, ...]) -> None:
        for child in children:
            if isinstance(child, nodes.Text):
                text.append(child.text)
            elif isinstance(child, nodes.ModuleRef):
                path = parent + (child.name,)
                module = modules.get(path)
                if module is None:
                    continue
                own = _own_text(module.children)
                name = "/".join(path)
                route.modules[name] = (routing_key("pml", schema.name, name), len(own) or 1)
                text.append(own)
                text.extend(arg.value for arg in child.args)
                visit(child.children, path)
            elif isinstance(child, nodes.ScaffoldRef):
                for path, module in modules.items():
                    if module.scaffold_name == child.name:
                        name = "/".join(path)
                        own = _own_text(module.children)
                        route.modules[name] = (routing_key("pml", schema.name, name),
                                               len(own) or 1)
                        text.append(own)

    visit(doc.children, ())
    route.prompt = "".join(text)
    return route


@dataclass(frozen=True)
class _Found:
    children: tuple
    scaffold_name: str | None


def _module_table(schema: nodes.Schema) -> dict[tuple[str, ...], _Found]:
    """Every module of `schema` by path (union members and scaffold modules included)."""
    table: dict[tuple[str, ...], _Found] = {}

    def walk(children, parent: tuple[str, ...]) -> None:
        for child in children:
            if isinstance(child, nodes.Module):
                table[parent + (child.name,)] = _Found(child.children, None)
                walk(child.children, parent + (child.name,))
            elif isinstance(child, nodes.Union):
                walk(child.children, parent)
            elif isinstance(child, nodes.Scaffold):
                for member in child.members:
                    table[parent + (member.name,)] = _Found(member.children, child.name)
                    walk(member.children, parent + (member.name,))

    walk(schema.children, ())
    return table


def _own_text(children) -> str:
    """The text of a module's own nodes (its child modules are units of their own)."""
    return "".join(child.text for child in children if isinstance(child, nodes.Text))


__all__ = ["RequestRoute", "SchemaBook", "route", "routing_key"]
