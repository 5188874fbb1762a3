"""Reading a schema or a prompt that the engine is handed as PML text or a file."""

from __future__ import annotations

import os

from promptlang.errors import DocumentKindError
from promptlang.pml import nodes


def read_schema(source) -> nodes.Schema:
    from promptlang.pml.parser import parse_schema
    return _read(source, parse_schema, nodes.Schema, "schema", "prompt")


def read_prompt(source) -> nodes.PromptDoc:
    from promptlang.pml.parser import parse_prompt
    return _read(source, parse_prompt, nodes.PromptDoc, "prompt", "schema")


def _read(source, parse_text, kind: type, name: str, other: str):
    """PML text (it starts with "<") parsed as `name`, or a file that must hold one."""
    from promptlang.pml.parser import parse_file
    if isinstance(source, str) and source.lstrip().startswith("<"):
        return parse_text(source, file=f"<{name}>")
    parsed = parse_file(source)
    if not isinstance(parsed, kind):
        raise DocumentKindError(f"{os.fspath(source)} holds a {other}, not a {name}", parsed.span)
    return parsed
