"""What an OpenAI-style request asks for, as a prompt the engine serves.

Four ways in, by what the request carries:

- the `promptlang` extension field (clients send it with the `openai` client's
  `extra_body`) with `pml`: a PML `<prompt>` against a registered schema, parsed here with
  the request as its file name, so its errors are located (`<request>:1:20: ...`);
- the extension field with `function` and `args`: a registered @prompt function called
  by name with keyword arguments (its schema is registered on first use);
- chat `messages` alone: the conversation as a schema of its own (`ChatSchemas`): the system
  text is the schema's anonymous text and every message but the last is a module, so a
  later turn of the same conversation reuses them (module KV, and exact reuse of the
  sequence: docs/RECOMPUTE.md); the last message and the assistant's opening are new text;
- completions `prompt` text alone: new text against an empty schema (nothing to reuse).

Message contents and arguments are data: they become `Text` nodes, never markup, and the
tokenizer splits control-token strings in them into plain text.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from promptlang.errors import RequestError
from promptlang.pml import nodes

ROLES = ("system", "user", "assistant")
REQUEST_FILE = "<request>"           # the file name of a request's PML in located errors
COMPLETION_SCHEMA = "promptlang-completions"


@dataclass(frozen=True)
class Message:
    role: str
    content: str


class ChatSchemas:
    """The schemas of plain chat requests: one per conversation prefix, at most `limit`
    registered (the least recently used is dropped from this table; its KV stays in the
    store, under keys of its own tokens, until the store evicts it)."""

    def __init__(self, llm, limit: int = 256):
        self.llm = llm
        self.limit = limit
        self._names: OrderedDict[str, None] = OrderedDict()

    def prompt(self, messages: Sequence[Message]) -> nodes.PromptDoc:
        """The prompt for `messages`: every message before the last imported as a module of
        the conversation's schema, the last one as new text, then the assistant's opening."""
        check_messages(messages)
        system = [m for m in messages if m.role == "system"]
        turns = [m for m in messages if m.role != "system"]
        earlier = turns[:-1]
        last = turns[-1]
        head: list[nodes.SchemaChild] = []
        if system:
            head = [nodes.RoleOpen("system"), nodes.Text(system[0].content),
                    nodes.RoleClose("system")]
        modules = [nodes.Module(f"m{i}", (nodes.RoleOpen(m.role), nodes.Text(m.content),
                                          nodes.RoleClose(m.role)))
                   for i, m in enumerate(earlier)]
        digest = hashlib.sha256(repr([(m.role, m.content) for m in messages[:-1]])
                                .encode()).hexdigest()[:24]
        name = f"chat-{digest}"
        self._register(nodes.Schema(name, tuple(head + modules)))
        body: list[nodes.PromptChild] = [nodes.ModuleRef(m.name) for m in modules]
        body += [nodes.RoleOpen(last.role), nodes.Text(last.content), nodes.RoleClose(last.role)]
        if last.role != "assistant":
            body.append(nodes.RoleOpen("assistant"))
        else:                        # continue the assistant's message: reopen no turn
            body.pop()
        return nodes.PromptDoc(name, tuple(body))

    def _register(self, schema: nodes.Schema) -> None:
        if schema.name in self._names:
            self._names.move_to_end(schema.name)
            return
        self.llm.add_schema(schema)
        self._names[schema.name] = None
        while len(self._names) > self.limit:
            old, _ = self._names.popitem(last=False)
            self.llm.remove_schema(old)


def check_messages(messages: Sequence[Message]) -> None:
    """RequestError unless `messages` make a conversation ChatSchemas can serve (no model
    needed: the server checks this before it queues the request)."""
    if not messages:
        raise RequestError("messages is empty: a chat request needs at least one message")
    system = [m for m in messages if m.role == "system"]
    if system and messages[0].role != "system" or len(system) > 1:
        raise RequestError("a system message may only come first, once")
    if len(system) == len(messages):
        raise RequestError("the messages hold no user or assistant turn")


def parse_messages(raw: Any) -> list[Message]:
    """OpenAI chat messages -> Messages (text content only)."""
    if not isinstance(raw, list):
        raise RequestError("messages must be a list of {role, content} objects")
    out = []
    for i, message in enumerate(raw):
        if not isinstance(message, Mapping):
            raise RequestError(f"messages[{i}] must be an object with role and content")
        role = message.get("role")
        content = message.get("content")
        if role == "developer":                  # the newer name of the system role
            role = "system"
        if role not in ROLES:
            raise RequestError(f"messages[{i}].role must be one of {', '.join(ROLES)}, "
                               f"not {role!r}")
        out.append(Message(role, _text_content(content, f"messages[{i}].content")))
    return out


def _text_content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):                # [{"type": "text", "text": ...}, ...]
        parts = []
        for j, part in enumerate(content):
            is_text = (isinstance(part, Mapping) and part.get("type") == "text"
                       and isinstance(part.get("text"), str))
            if not is_text:
                raise RequestError(f"{where}[{j}] must be a text part "
                                   "({'type': 'text', 'text': ...}); nothing else is served")
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(f"{where} must be a string or a list of text parts")


def completion_text(text: Any) -> str:
    """A completions request's `prompt` as one string; RequestError if it is none."""
    if isinstance(text, list) and len(text) == 1 and isinstance(text[0], str):
        text = text[0]
    if not isinstance(text, str):
        raise RequestError("prompt must be a string (one prompt per request: n=1)")
    if not text:
        raise RequestError("prompt is empty: nothing to complete")
    return text


def completion_prompt(llm, text: Any) -> nodes.PromptDoc:
    """A completions request's `prompt`: new text against an empty schema."""
    text = completion_text(text)
    llm.add_schema(nodes.Schema(COMPLETION_SCHEMA, ()))
    return nodes.PromptDoc(COMPLETION_SCHEMA, (nodes.Text(text),))


def check_extension(ext: Any, functions: Mapping[str, Any]) -> None:
    """RequestError unless the `promptlang` field is well formed: its fields and their types,
    a known function that is not a program, a recompute policy that parses (no model needed:
    the server checks this before it queues the request; the PML itself is parsed then)."""
    if not isinstance(ext, Mapping):
        raise RequestError("the promptlang field must be an object with pml, or function "
                           "and args")
    unknown = set(ext) - {"pml", "function", "args", "recompute", "regex", "grammar"}
    if unknown:
        raise RequestError(f"unknown promptlang field(s) {sorted(unknown)}: expected pml, "
                           "or function and args, and optionally recompute, regex or grammar")
    if ("pml" in ext) == ("function" in ext):
        raise RequestError("the promptlang field needs exactly one of pml or function")
    for name in ("regex", "grammar"):
        if ext.get(name) is not None and (not isinstance(ext[name], str) or not ext[name]):
            raise RequestError(f"promptlang.{name} must be a non-empty string")
    recompute = ext.get("recompute")
    if recompute is not None:
        from promptlang.runtime.recompute.policy import Recompute

        if not isinstance(recompute, str):
            raise RequestError("promptlang.recompute must be a string naming a policy")
        Recompute.parse(recompute)               # RecomputeSpecError: a PromptLangError
    if "pml" in ext:
        if not isinstance(ext["pml"], str):
            raise RequestError("promptlang.pml must be a string holding a <prompt>")
        return
    name = ext["function"]
    fn = functions.get(name) if isinstance(name, str) else None
    if fn is None:
        known = ", ".join(sorted(functions)) or "none are registered (serve --schemas app.py)"
        raise RequestError(f"unknown @prompt function {name!r} (known: {known})")
    if not isinstance(ext.get("args") or {}, Mapping):
        raise RequestError("promptlang.args must be an object of keyword arguments")
    if fn.generates:
        raise RequestError(f"{name} calls gen() or select(): programs are run with fn.run() "
                           "in Python, not served yet")


def extension_prompt(ext: Any, functions: Mapping[str, Any]):
    """The prompt the `promptlang` extension field names: a PromptDoc (from `pml`) or a
    compiled Prompt (from `function` and `args`)."""
    from promptlang.pml.parser import parse_prompt

    check_extension(ext, functions)
    if "pml" in ext:
        return parse_prompt(ext["pml"], file=REQUEST_FILE)
    name = ext["function"]
    args = ext.get("args") or {}
    fn = functions[name]
    try:
        return fn(**args)
    except TypeError as error:                   # missing or unexpected arguments
        raise RequestError(f"{name}: {error}") from None
