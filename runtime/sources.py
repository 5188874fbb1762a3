"""Reading a schema or a prompt that the engine is handed as PML text or a file."""

from __future__ import annotations

import os

from promptlang.errors import PromptLangError
from promptlang.pml import nodes


def read_schema(source) -> nodes.Schema:
    from promptlang.pml.parser import parse_file, parse_schema
    if isinstance(source, str) and source.lstrip().startswith("<"):
        return parse_schema(source, file="<schema>")
    parsed = parse_file(source)
    if not isinstance(parsed, nodes.Schema):
        raise PromptLangError(f"{os.fspath(source)} holds a prompt, not a schema", parsed.span)
    return parsed


def read_prompt(source) -> nodes.PromptDoc:
    from promptlang.pml.parser import parse_file, parse_prompt
    if isinstance(source, str) and source.lstrip().startswith("<"):
        return parse_prompt(source, file="<prompt>")
    parsed = parse_file(source)
    if not isinstance(parsed, nodes.PromptDoc):
        raise PromptLangError(f"{os.fspath(source)} holds a schema, not a prompt", parsed.span)
    return parsed
