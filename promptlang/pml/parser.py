"""The PML parser: tokens -> the syntax tree of `nodes.py` (a `Schema` or a `PromptDoc`).

    text --lexer.Lexer--> tokens --_Parser.parse_<element>--> nodes   (src= files: source.py)

The lexer (`lexer.py`) owns the characters: tags, attributes, entities, comments,
CDATA, the bare-`<` rule and the whitespace rule. This file owns the structure: the
root is `<schema name>` or `<prompt schema>`; what may appear where (docs/PML.md) is
enforced by one `parse_<element>` method per element, which checks the element's
attributes and builds its node. Every error is raised at the first problem found
through `fail(message, offset[, error])`, located at the most precise place known (an
attribute's value rather than its tag).

Numbers (`len`, `length`): ASCII digits only, at most MAX_NUMBER_DIGITS of them,
from 1 to nodes.MAX_POSITIONS; checked before anything is built from them.
A schema's `recompute` is kept as written (stripped, at most MAX_RECOMPUTE_CHARS
characters) with its span: the runtime reads the policy.
"""

from __future__ import annotations

import os
import re
from typing import Callable

from promptlang.errors import (PMLSyntaxError, PromptLangError, SchemaError, SourceFileError,
                               Span, TextNotAllowedError)
from promptlang.pml import nodes
from promptlang.pml.lexer import (MAX_WARNINGS, NAME, WS, Attr, Chars, CommentToken, End,
                                  Lexer, Locator, Tag, is_name, run_text, strip_formatting)
from promptlang.pml.source import SrcBudget, read_pml, read_src

__all__ = ["parse", "parse_schema", "parse_prompt", "parse_file", "read_pml",
           "strip_formatting", "is_name", "MAX_DEPTH", "MAX_NUMBER_DIGITS", "MAX_WARNINGS",
           "MAX_RECOMPUTE_CHARS"]

MAX_DEPTH = 100                     # elements nested deeper than this are refused (stack safety)
MAX_NUMBER_DIGITS = 9               # digits of a numeric attribute (int() of them stays cheap)
MAX_RECOMPUTE_CHARS = 64            # longer `recompute=` text is no policy at all

_POSITIVE_INT = re.compile(r"[0-9]+")
_SCHEMA_TAGS = ("module", "union", "scaffold", "param", "parameter") + nodes.ROLES
_RESERVED_MODULE_NAMES = nodes.ROLES + ("scaffold",)   # tags a prompt cannot use to import

_TagHandler = Callable[[Tag], "nodes.Node"]


class _Parser:
    """One document's parse: pulls tokens from its `Lexer`, builds nodes, fails located."""

    def __init__(self, source: str, file: str, base_dir: str | os.PathLike | None):
        self.source = source
        self.base_dir = os.path.abspath(base_dir) if base_dir is not None else None
        where = Locator(source, file)
        self.span = where.span
        self.line_of = where.line_of
        self.fail = where.fail
        self.lexer = Lexer(where)
        self.depth = 0
        self.src_budget: SrcBudget | None = None    # made at the first src= (reads the cap)

    # -- document ----------------------------------------------------------------------------

    def parse_document(self, expect: str | None) -> nodes.Schema | nodes.PromptDoc:
        root = self.misc_until_element()
        if root is None:
            self.fail("the document has no root element; expected <schema> or <prompt>",
                      len(self.source))
        if root.closing:
            self.fail(f"unexpected closing tag </{root.name}> before the root element",
                      root.offset)
        if root.name not in ("schema", "prompt"):
            self.fail(f"the root element must be <schema> or <prompt>, not <{root.name}>",
                      root.offset)
        if expect is not None and root.name != expect:
            self.fail(f"expected a <{expect}> document, found <{root.name}>", root.offset)
        doc = self.parse_schema(root) if root.name == "schema" else self.parse_prompt(root)
        extra = self.misc_until_element()
        if extra is not None:
            self.fail(f"unexpected tag after the root element </{root.name}>", extra.offset)
        return doc

    def misc_until_element(self) -> Tag | None:
        """Skip whitespace and comments outside the root; the next tag, or None at the end."""
        while True:
            tok = self.lexer.next()
            if isinstance(tok, End):
                return None
            if isinstance(tok, Tag):
                return tok
            if isinstance(tok, Chars) and (tok.cdata or tok.raw.strip(WS)):
                at = tok.offset + (len(tok.raw) - len(tok.raw.lstrip(WS)))
                self.fail("text is not allowed outside the root element", at)

    def parse_schema(self, tag: Tag) -> nodes.Schema:
        attrs = self.attributes(tag, required=("name",), optional=("recompute",))
        name = attrs["name"]
        if not name.value:
            self.fail("the schema name may not be empty", name.value_offset, SchemaError)
        recompute = None
        recompute_span = None
        if "recompute" in attrs:
            recompute, recompute_span = self.recompute_text(attrs["recompute"])
        modules: dict[str, int] = {}
        scaffolds: dict[str, int] = {}

        def child(t: Tag) -> nodes.Node:
            if t.name == "module":
                return self.parse_module(t, modules)
            if t.name == "union":
                return self.parse_union(t, modules)
            if t.name == "scaffold":
                return self.parse_scaffold(t, modules, scaffolds)
            if t.name in ("param", "parameter"):
                self.fail(f"<{t.name}> must be inside a <module>: parameters belong to the "
                          "module whose prompt supplies them", t.offset, SchemaError)
            self.unknown_schema_tag(t)

        children = () if tag.self_closing else self.content(tag, child, roles=True)
        return nodes.Schema(name.value, tuple(children), self.span(tag.offset),
                            base_dir=self.base_dir, recompute=recompute,
                            warnings=self.lexer.collected_warnings(),
                            recompute_span=recompute_span)

    def parse_prompt(self, tag: Tag) -> nodes.PromptDoc:
        attrs = self.attributes(tag, required=("schema",))
        schema = attrs["schema"]
        if not schema.value:
            self.fail("the prompt's schema name may not be empty", schema.value_offset)

        def child(t: Tag) -> nodes.Node:
            if t.name == "scaffold":
                return self.parse_scaffold_ref(t)
            return self.parse_module_ref(t)

        children = () if tag.self_closing else self.content(tag, child, roles=True)
        return nodes.PromptDoc(schema.value, tuple(children), self.span(tag.offset),
                               warnings=self.lexer.collected_warnings())

    # -- schema elements ---------------------------------------------------------------------

    def parse_module(self, tag: Tag, siblings: dict[str, int],
                     in_scaffold: bool = False) -> nodes.Module:
        attrs = self.attributes(tag, required=("name",), optional=("cache", "src"))
        name = self.module_name(attrs["name"], siblings)
        cache = True
        if "cache" in attrs:
            value = attrs["cache"]
            if value.value not in ("true", "false"):
                self.fail(f"cache must be \"true\" or \"false\", not {value.value!r}",
                          value.value_offset, SchemaError)
            cache = value.value == "true"
        span = self.span(tag.offset)
        if "src" in attrs:
            src = attrs["src"]
            if self.src_budget is None:
                self.src_budget = SrcBudget()
            text, text_span = read_src(
                src.value, self.base_dir,
                lambda message: self.fail(message, src.value_offset, SourceFileError),
                self.span(src.value_offset), self.src_budget)
            if not tag.self_closing:
                self.expect_empty(tag, f"module '{name}' takes its text from src={src.value!r} "
                                       "and can have no content of its own", SchemaError)
            children = (nodes.Text(text, text_span),) if text else ()
            return nodes.Module(name, children, cache, src.value, span)
        if tag.self_closing:
            return nodes.Module(name, (), cache, None, span)
        modules: dict[str, int] = {}
        params: dict[str, int] = {}

        def child(t: Tag) -> nodes.Node:
            if t.name in ("module", "union") and in_scaffold:
                self.fail(f"a scaffold's module cannot contain a <{t.name}>: the scaffold is "
                          "encoded jointly from its members' own text, so there is nothing "
                          "optional inside them", t.offset, SchemaError)
            if t.name == "module":
                return self.parse_module(t, modules)
            if t.name == "union":
                return self.parse_union(t, modules)
            if t.name in ("param", "parameter"):
                return self.parse_param(t, params)
            if t.name == "scaffold":
                self.fail("<scaffold> is only allowed at the schema's top level, not inside "
                          "a <module>", t.offset, SchemaError)
            self.unknown_schema_tag(t)

        children = self.content(tag, child, roles=True)
        return nodes.Module(name, tuple(children), cache, None, span)

    def parse_union(self, tag: Tag, siblings: dict[str, int]) -> nodes.Union:
        attrs = self.attributes(tag, optional=("scaffold",))

        def child(t: Tag) -> nodes.Node:
            if t.name == "module":
                return self.parse_module(t, siblings)   # members are siblings of the union's
            self.fail(f"a <union> holds only <module> elements, not <{t.name}>"
                      + (" (put parameters inside a member module)"
                         if t.name in ("param", "parameter") else ""), t.offset, SchemaError)

        children = () if tag.self_closing else tuple(self.content(
            tag, child, roles=False, text_error="text is not allowed inside a <union>: it "
                                                "holds only modules"))
        scaffold = attrs.get("scaffold")
        if scaffold is not None:
            members = [m.name for m in children if isinstance(m, nodes.Module)]
            if scaffold.value not in members:
                self.fail(f"union scaffold={scaffold.value!r} names none of its members "
                          f"({', '.join(members) or 'it has none'})", scaffold.value_offset,
                          SchemaError)
        return nodes.Union(children, scaffold.value if scaffold is not None else None,
                           self.span(tag.offset))

    def parse_scaffold(self, tag: Tag, siblings: dict[str, int],
                       scaffolds: dict[str, int]) -> nodes.Scaffold:
        attrs = self.attributes(tag, required=("name",))
        name = attrs["name"]
        if not name.value:
            self.fail("a scaffold name may not be empty", name.value_offset, SchemaError)
        if name.value in scaffolds:
            self.fail(f"duplicate scaffold name {name.value!r} (first defined at line "
                      f"{scaffolds[name.value]})", name.value_offset, SchemaError)
        scaffolds[name.value] = self.line_of(tag.offset)

        def child(t: Tag) -> nodes.Node:
            if t.name == "module":
                return self.parse_module(t, siblings, in_scaffold=True)
            self.fail(f"a <scaffold> holds only <module> elements, not <{t.name}>", t.offset,
                      SchemaError)

        children = () if tag.self_closing else tuple(self.content(
            tag, child, roles=False, text_error="text is not allowed inside a <scaffold>: it "
                                                "holds only modules"))
        return nodes.Scaffold(name.value, children, self.span(tag.offset))

    def parse_param(self, tag: Tag, params: dict[str, int]) -> nodes.Param:
        if tag.name == "param":
            attrs = self.attributes(tag, required=("name", "len"))
            length = attrs["len"]
        else:
            attrs = self.attributes(tag, required=("name", "length"), optional=("scaffold",))
            length = attrs["length"]
        name = attrs["name"]
        if not NAME.fullmatch(name.value):
            self.fail(f"parameter name {name.value!r} cannot be an attribute name in a prompt "
                      "(use letters, digits, '-', '_', '.')", name.value_offset, SchemaError)
        if name.value in params:
            self.fail(f"duplicate parameter name {name.value!r} in this module (first defined "
                      f"at line {params[name.value]})", name.value_offset, SchemaError)
        params[name.value] = self.line_of(tag.offset)
        tokens = self.number(length, "tokens", nodes.MAX_POSITIONS)
        if not tag.self_closing:
            self.expect_empty(tag, f"<{tag.name}> takes no content", SchemaError)
        scaffold = attrs["scaffold"].value if "scaffold" in attrs else None
        return nodes.Param(name.value, tokens, scaffold, self.span(tag.offset))

    def number(self, attr: Attr, unit: str, maximum: int) -> int:
        """The value of a numeric attribute: ASCII digits, at most MAX_NUMBER_DIGITS of
        them, from 1 to `maximum` -- checked before anything is built from it."""
        text = attr.value
        digits = text.lstrip("0")
        if not _POSITIVE_INT.fullmatch(text) or not digits:
            self.fail(f"{attr.name} must be a positive whole number of {unit} (digits "
                      f"only), not {text[:40]!r}{'...' if len(text) > 40 else ''}",
                      attr.value_offset, SchemaError)
        if len(digits) > MAX_NUMBER_DIGITS or int(digits or "0") > maximum:
            shown = (f"{attr.name}={digits}" if len(digits) <= 20
                     else f"{attr.name} ({len(digits)} digits)")
            self.fail(f"{shown} is too large: at most {maximum} {unit}",
                      attr.value_offset, SchemaError)
        return int(digits)

    def module_name(self, attr: Attr, siblings: dict[str, int]) -> str:
        name = attr.value
        if not name:
            self.fail("a module name may not be empty", attr.value_offset, SchemaError)
        if not NAME.fullmatch(name):
            self.fail(f"module name {name!r} cannot be used as a tag in a prompt (use letters, "
                      "digits, '-', '_', '.')", attr.value_offset, SchemaError)
        if name in _RESERVED_MODULE_NAMES:
            self.fail(f"module name {name!r} is reserved: <{name}> in a prompt means something "
                      "else", attr.value_offset, SchemaError)
        if name in siblings:
            self.fail(f"duplicate module name {name!r} among siblings (first defined at line "
                      f"{siblings[name]})", attr.value_offset, SchemaError)
        siblings[name] = self.line_of(attr.offset)
        return name

    def recompute_text(self, attr: Attr) -> tuple[str, Span]:
        """The schema's recompute policy as written (stripped) and where its value starts.
        Only a length no policy has is refused here; the runtime reads the policy."""
        text = attr.value.strip()
        if len(text) > MAX_RECOMPUTE_CHARS:
            self.fail(f"bad recompute policy ({len(text)} characters): a policy is at most "
                      f"{MAX_RECOMPUTE_CHARS}", attr.value_offset, SchemaError)
        return text, self.span(attr.value_offset)

    def unknown_schema_tag(self, tag: Tag):
        if tag.name in ("schema", "prompt"):
            self.fail(f"<{tag.name}> can only be the root element", tag.offset)
        self.fail(f"unknown tag <{tag.name}> in a schema; known tags: "
                  + ", ".join(f"<{t}>" for t in _SCHEMA_TAGS), tag.offset)

    # -- prompt elements ---------------------------------------------------------------------

    def parse_scaffold_ref(self, tag: Tag) -> nodes.ScaffoldRef:
        attrs = self.attributes(tag, required=("name",))
        if not attrs["name"].value:
            self.fail("a scaffold name may not be empty", attrs["name"].value_offset)
        if not tag.self_closing:
            self.expect_empty(tag, "<scaffold name=\"...\"/> in a prompt takes no content",
                              PMLSyntaxError)
        return nodes.ScaffoldRef(attrs["name"].value, self.span(tag.offset))

    def parse_module_ref(self, tag: Tag) -> nodes.ModuleRef:
        args = tuple(nodes.Argument(a.name, a.value, self.span(a.offset)) for a in tag.attrs)

        def child(t: Tag) -> nodes.Node:
            if t.name in nodes.ROLES:
                self.fail(f"role tag <{t.name}> cannot appear inside module reference "
                          f"<{tag.name}>: a reference only imports modules", t.offset)
            if t.name == "scaffold":
                self.fail("<scaffold/> belongs at the prompt's top level, not inside module "
                          f"reference <{tag.name}>", t.offset)
            return self.parse_module_ref(t)

        children = () if tag.self_closing else tuple(self.content(
            tag, child, roles=False,
            text_error=f"text is not allowed inside module reference <{tag.name}>: a reference "
                       "only imports modules (put prompt text outside it)"))
        return nodes.ModuleRef(tag.name, args, children, self.span(tag.offset))

    # -- shared machinery --------------------------------------------------------------------

    def attributes(self, tag: Tag, required: tuple[str, ...] = (),
                   optional: tuple[str, ...] = ()) -> dict[str, Attr]:
        allowed = required + optional
        for a in tag.attrs:
            if a.name not in allowed:
                hint = {("param", "length"): " (<param> spells it len)",
                        ("parameter", "len"): " (<parameter> spells it length)",
                        ("param", "scaffold"): " (only <parameter> takes scaffold=)"}.get(
                    (tag.name, a.name), "")
                known = ", ".join(allowed) if allowed else "none"
                self.fail(f"unknown attribute '{a.name}' on <{tag.name}>{hint}; allowed: "
                          f"{known}", a.offset)
        for name in required:
            if tag.attr(name) is None:
                self.fail(f"<{tag.name}> needs a '{name}' attribute", tag.offset)
        return {a.name: a for a in tag.attrs}

    def content(self, parent: Tag, on_tag: _TagHandler, *, roles: bool,
                text_error: str | None = None) -> list[nodes.Node]:
        """The children of `parent` up to its end tag. `roles`: whether role tags are
        markers here; `text_error`: where text is not allowed (only whitespace is), the
        message for non-whitespace text."""
        self.depth += 1
        if self.depth > MAX_DEPTH:
            self.fail(f"elements nest more than {MAX_DEPTH} levels deep", parent.offset)
        children: list[nodes.Node] = []
        run: list[Chars] = []
        while True:
            tok = self.lexer.next()
            if isinstance(tok, Chars):
                if text_error is None:
                    run.append(tok)
                else:
                    self.only_whitespace(tok, text_error)
                continue
            if run:
                node = self.text_node(run)
                if node is not None:
                    children.append(node)
                run = []
            if isinstance(tok, CommentToken):
                children.append(nodes.Comment(tok.text, self.span(tok.offset)))
            elif isinstance(tok, End):
                self.fail(f"<{parent.name}> is never closed (expected </{parent.name}>)",
                          parent.offset)
            elif roles and tok.name in nodes.ROLES:
                children.append(self.role_marker(tok))
            elif tok.closing:
                if tok.name != parent.name:
                    self.fail(f"unexpected </{tok.name}>: <{parent.name}> opened at line "
                              f"{self.line_of(parent.offset)} is still open", tok.offset)
                self.depth -= 1
                return children
            else:
                children.append(on_tag(tok))

    def role_marker(self, tag: Tag) -> nodes.RoleOpen | nodes.RoleClose:
        if tag.attrs:
            self.fail(f"role tag <{tag.name}> takes no attributes (found '{tag.attrs[0].name}')",
                      tag.attrs[0].offset)
        if tag.self_closing:
            self.fail(f"role tag <{tag.name}/> cannot be self-closing: write <{tag.name}> to "
                      f"open the role and </{tag.name}> to close it", tag.offset)
        if tag.closing:
            return nodes.RoleClose(tag.name, self.span(tag.offset))
        return nodes.RoleOpen(tag.name, self.span(tag.offset))

    def only_whitespace(self, tok: Chars, message: str):
        """Fail at the first non-whitespace character of `tok` (where text is not allowed)."""
        if tok.text.strip(WS):
            at = tok.offset + len(tok.raw) - len(tok.raw.lstrip(WS))
            self.fail(message, at, TextNotAllowedError)

    def expect_empty(self, tag: Tag, message: str, error: type[PromptLangError]):
        """Consume up to `tag`'s end tag, allowing only whitespace before it."""
        while True:
            tok = self.lexer.next()
            if isinstance(tok, Chars) and not tok.cdata and not tok.raw.strip(WS):
                continue
            if isinstance(tok, Tag) and tok.closing and tok.name == tag.name:
                return
            if isinstance(tok, End):
                self.fail(f"<{tag.name}> is never closed (expected </{tag.name}>)", tag.offset)
            at = tok.offset
            if isinstance(tok, Chars):
                at += len(tok.raw) - len(tok.raw.lstrip(WS))
            self.fail(message, at, error)


    def text_node(self, run: list[Chars]) -> nodes.Text | None:
        """One text run -> a Text node, after the whitespace rule (lexer.run_text)."""
        kept = run_text(run)
        return None if kept is None else nodes.Text(kept[0], self.span(kept[1]))


# ---------------------------------------------------------------------------------------------
# Public API


def parse(text: str, file: str = "<string>",
          base_dir: str | os.PathLike | None = None) -> nodes.Schema | nodes.PromptDoc:
    """Parse a schema or a prompt, whichever the root tag says. `base_dir` is where a
    schema's `src=` files are read from (default: the current directory)."""
    return _Parser(text, file, base_dir).parse_document(None)


def parse_schema(text: str, file: str = "<string>",
                 base_dir: str | os.PathLike | None = None) -> nodes.Schema:
    """Parse a `<schema>` document (an error if the root is anything else)."""
    return _Parser(text, file, base_dir).parse_document("schema")


def parse_prompt(text: str, file: str = "<string>") -> nodes.PromptDoc:
    """Parse a `<prompt>` document (an error if the root is anything else)."""
    return _Parser(text, file, None).parse_document("prompt")


def parse_file(path: str | os.PathLike) -> nodes.Schema | nodes.PromptDoc:
    """Parse a PML file: spans name `path`; `src=` files are read from its folder.
    Line endings are normalised to '\\n' and a UTF-8 BOM is dropped (`source.read_pml`)."""
    path = os.fspath(path)
    return parse(read_pml(path), file=path, base_dir=os.path.dirname(os.path.abspath(path)))
