"""The PML writer: a syntax tree -> compact PML text, or indented PML for reading.

`write` adds no formatting whitespace, so `parse(write(tree)) == tree` for
every tree in normal form (no two adjacent `Text` nodes, no empty `Text`).
`write_pretty` puts each element, role tag, comment and text on a line of its own,
indented; the lexer's whitespace rule drops exactly that formatting again, so
`parse(write_pretty(tree)) == tree` too.
Text is escaped (`&`, `<`, `>`), attribute values too (`&`, `<`, `"`). Text
that the lexer's whitespace rule would change (`lexer.strip_formatting`: whitespace
only with a newline, a leading newline, a trailing newline plus indentation) is
written as CDATA, with any `]]>` split across two CDATA sections. A `src=` module
is written as an empty element: its text lives in its file. A schema's `recompute`
text is written back as the parser kept it.
"""

from __future__ import annotations

from typing import NoReturn

from promptlang.errors import InvalidArgumentError, InvalidArgumentTypeError, PMLWriteError
from promptlang.pml import nodes
from promptlang.pml.lexer import is_name, strip_formatting

__all__ = ["write", "write_pretty"]


def write(node: nodes.Node) -> str:
    """PML text for `node`: a Schema or PromptDoc, or any node inside one."""
    out: list[str] = []
    _write(node, out)
    return "".join(out)


def write_pretty(node: nodes.Node, indent: str = "  ") -> str:
    """Indented PML for `node`, one element or text per line, ending in a newline."""
    if indent.strip(" \t"):
        raise InvalidArgumentError("indent must be spaces or tabs")
    lines: list[str] = []
    _pretty(node, 0, indent, lines)
    return "\n".join(lines) + "\n"


def _pretty(node: nodes.Node, depth: int, indent: str, lines: list[str]) -> None:
    pad = indent * depth
    if isinstance(node, nodes.Text):
        lines.append(pad + _pretty_text(node.text, pad))
        return
    children = _PRETTY_CHILDREN.get(type(node), lambda n: ())(node)
    if not children:
        lines.append(pad + write(node))
        return
    compact = write(node)
    close = compact.rindex("</")
    lines.append(pad + compact[:_open_end(compact)])
    for child in children:
        _pretty(child, depth + 1, indent, lines)
    lines.append(pad + compact[close:])


def _open_end(compact: str) -> int:
    """Where the start tag of an element written compactly ends (after its `>`)."""
    quoted = False
    for at, char in enumerate(compact):
        if char == '"':
            quoted = not quoted
        elif char == ">" and not quoted:
            return at + 1
    return len(compact)


def _pretty_text(text: str, pad: str) -> str:
    """Text on a line of its own: escaped where the whitespace rule gives it back whole
    between a newline plus `pad` and a newline, else CDATA (always verbatim)."""
    if strip_formatting("\n" + pad + text + "\n" + pad) == text:
        return _escape_text(text)
    return "<![CDATA[" + text.replace("]]>", "]]]]><![CDATA[>") + "]]>"


_PRETTY_CHILDREN = {
    nodes.Schema: lambda n: n.children, nodes.PromptDoc: lambda n: n.children,
    nodes.Module: lambda n: () if n.src is not None else n.children,
    nodes.Union: lambda n: n.children, nodes.Scaffold: lambda n: n.children,
    nodes.ModuleRef: lambda n: n.children,
}


def _write(node: nodes.Node, out: list[str]) -> None:
    writer = _WRITERS.get(type(node))
    if writer is None:
        raise InvalidArgumentTypeError(f"write() takes a PML node, not {type(node).__name__}")
    writer(node, out)


def _children(children, out: list[str]) -> None:
    for child in children:
        _write(child, out)


def _element(tag: str, attrs: list[tuple[str, str]], children, out: list[str]) -> None:
    out.append("<" + tag + "".join(f' {name}="{_escape_attr(value)}"' for name, value in attrs))
    if not children:
        out.append("/>")
        return
    out.append(">")
    _children(children, out)
    out.append(f"</{tag}>")


def _escape_text(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _escape_attr(value: str) -> str:
    return value.replace("&", "&amp;").replace("<", "&lt;").replace('"', "&quot;")


def _fail(message: str, node) -> NoReturn:
    raise PMLWriteError(message, getattr(node, "span", None))


def _write_text(node: nodes.Text, out: list[str]) -> None:
    if strip_formatting(node.text) == node.text:
        out.append(_escape_text(node.text))
    else:   # the whitespace rule would eat part of it: CDATA is always verbatim
        out.append("<![CDATA[" + node.text.replace("]]>", "]]]]><![CDATA[>") + "]]>")


def _write_comment(node: nodes.Comment, out: list[str]) -> None:
    if "--" in node.text or node.text.endswith("-"):
        _fail(f"comment {node.text!r} cannot be written: it contains '--' or ends with '-'",
              node)
    out.append(f"<!--{node.text}-->")


def _write_role_open(node: nodes.RoleOpen, out: list[str]) -> None:
    _check_role(node)
    out.append(f"<{node.role}>")


def _write_role_close(node: nodes.RoleClose, out: list[str]) -> None:
    _check_role(node)
    out.append(f"</{node.role}>")


def _check_role(node) -> None:
    if node.role not in nodes.ROLES:
        _fail(f"unknown role {node.role!r} (roles: {', '.join(nodes.ROLES)})", node)


def _write_param(node: nodes.Param, out: list[str]) -> None:
    if node.length < 1:
        _fail(f"parameter {node.name!r} must reserve at least one token, not {node.length}",
              node)
    if node.scaffold is None:
        _element("param", [("name", node.name), ("len", str(node.length))], (), out)
    else:
        _element("parameter", [("name", node.name), ("length", str(node.length)),
                               ("scaffold", node.scaffold)], (), out)


def _write_module(node: nodes.Module, out: list[str]) -> None:
    attrs = [("name", node.name)]
    if not node.cache:
        attrs.append(("cache", "false"))
    if node.src is not None:
        attrs.append(("src", node.src))
    _element("module", attrs, () if node.src is not None else node.children, out)


def _write_union(node: nodes.Union, out: list[str]) -> None:
    attrs = [("scaffold", node.scaffold)] if node.scaffold is not None else []
    _element("union", attrs, node.children, out)


def _write_scaffold(node: nodes.Scaffold, out: list[str]) -> None:
    _element("scaffold", [("name", node.name)], node.children, out)


def _write_schema(node: nodes.Schema, out: list[str]) -> None:
    attrs = [("name", node.name)]
    if node.recompute is not None:      # as written: the runtime reads the policy
        attrs.append(("recompute", node.recompute))
    _element("schema", attrs, node.children, out)


def _write_argument(node: nodes.Argument, out: list[str]) -> None:
    _check_name(node.name, "argument", node)
    out.append(f'{node.name}="{_escape_attr(node.value)}"')


def _write_module_ref(node: nodes.ModuleRef, out: list[str]) -> None:
    _check_name(node.name, "module reference", node)
    if node.name in nodes.ROLES or node.name == "scaffold":
        _fail(f"a module reference cannot be named {node.name!r}: <{node.name}> means "
              "something else in a prompt", node)
    for arg in node.args:
        _check_name(arg.name, "argument", arg)
    _element(node.name, [(a.name, a.value) for a in node.args], node.children, out)


def _write_scaffold_ref(node: nodes.ScaffoldRef, out: list[str]) -> None:
    _element("scaffold", [("name", node.name)], (), out)


def _write_prompt(node: nodes.PromptDoc, out: list[str]) -> None:
    _element("prompt", [("schema", node.schema)], node.children, out)


def _check_name(name: str, what: str, node) -> None:
    if not is_name(name):
        _fail(f"{what} name {name!r} is not a valid PML name (letters, digits, '-', '_', '.')",
              node)


_WRITERS = {
    nodes.Text: _write_text, nodes.Comment: _write_comment,
    nodes.RoleOpen: _write_role_open, nodes.RoleClose: _write_role_close,
    nodes.Param: _write_param, nodes.Module: _write_module, nodes.Union: _write_union,
    nodes.Scaffold: _write_scaffold, nodes.Schema: _write_schema,
    nodes.Argument: _write_argument, nodes.ModuleRef: _write_module_ref,
    nodes.ScaffoldRef: _write_scaffold_ref, nodes.PromptDoc: _write_prompt,
}
