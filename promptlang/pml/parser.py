"""The PML parser: text -> the syntax tree of `nodes.py`.

PML looks like XML but is parsed by this small hand-written grammar, so that role
tags may stay unbalanced across a schema and its prompts, every node and error
has an exact position, and no entity machinery exists to be abused.

Lexical grammar::

    document   := BOM? xml-decl? misc* element misc*
    xml-decl   := '<?xml' ... '?>'              (skipped; only at the very start)
    misc       := whitespace | comment          (comments outside the root are dropped)
    element    := start-tag content end-tag | empty-tag
    start-tag  := '<' NAME (WS+ attribute)* WS* '>'
    empty-tag  := '<' NAME (WS+ attribute)* WS* '/>'
    end-tag    := '</' NAME WS* '>'
    attribute  := NAME WS* '=' WS* ( '"' [^<"]* '"' | "'" [^<']* "'" )
    content    := ( chars | reference | cdata | comment | element )*
    comment    := '<!--' text without '--', not ending in '-' '-->'
    cdata      := '<![CDATA[' any text without ']]>' ']]>'      (verbatim)
    reference  := '&lt;' | '&gt;' | '&amp;' | '&quot;' | '&apos;'
                | '&#' DIGITS ';' | '&#x' HEXDIGITS ';'         (a valid code point)
    NAME       := ( letter | digit | '-' | '_' | '.' )+
    WS         := ' ' | '\\t' | '\\r' | '\\n'

Any other `&name;` is an error (no custom entities, ever), and so is a bare `&`.
A `<` that cannot start markup -- followed by whitespace, `=`, a digit, or the end
of the input, as in code such as `0 <= i < n` -- is text, as HTML parsers read it
(a digit still starts a tag when a tag follows: `<0/>`, `<1 a="x">` import modules
named with digits),
and the parse result carries a located warning for it (`warnings`); any other `<`
that starts no valid construct is an error. `<!DOCTYPE`, `<!ENTITY` (and the other DTD
declarations) are rejected the moment they are met, so entity bombs and
external-entity documents die at once, in flat memory. Processing instructions
other than the leading declaration are errors.

Whitespace rule (applied to each *text run*: the text and CDATA pieces between
two pieces of markup -- tags, role tags, comments):

- outside CDATA, a run that is whitespace only is formatting and is dropped
  (write `<![CDATA[ ]]>` or `&#32;` for a space between two tags);
- otherwise ONE leading newline plus the spaces/tabs after it, and ONE trailing
  newline plus the spaces/tabs before the next tag, are formatting and dropped;
  these cuts apply only to escaped (non-CDATA) pieces at the run's two ends, and
  only to literal characters (an entity such as `&#10;` is always content);
- everything else, and all CDATA content, is verbatim. A run that ends up empty
  gives no node; adjacent text and CDATA pieces give one `Text`; a comment ends a
  run. `\\r\\n` counts as one newline.

Numbers (`len`, `length`): ASCII digits only, at most MAX_NUMBER_DIGITS of them,
from 1 to nodes.MAX_POSITIONS; checked before anything is built from them.

Cost: the lexer and the parser are linear in the input (each character is scanned
a bounded number of times; spans come from a line-start index and share one copy
of each line's text).

Structure: the root is `<schema name>` or `<prompt schema>`; the rules for what
may appear where are in docs/PML.md and enforced below (`parse_<element>`
methods). Every error is raised at the first problem found, located at the most
precise place known (an attribute's value rather than its tag).
"""

from __future__ import annotations

import bisect
import os
import re
from typing import Callable, NoReturn

from promptlang.errors import (InputFileError, PMLSyntaxError, PromptLangError, SchemaError,
                               SourceFileError, Span, TextNotAllowedError, span_in)
from promptlang.inputs import read_text
from promptlang.pml import nodes
from promptlang.pml.recompute import Recompute, RecomputeSpecError

__all__ = ["parse", "parse_schema", "parse_prompt", "parse_file", "read_pml",
           "strip_formatting", "is_name", "MAX_DEPTH", "MAX_NUMBER_DIGITS", "MAX_WARNINGS"]

MAX_DEPTH = 100                     # elements nested deeper than this are refused (stack safety)
MAX_NUMBER_DIGITS = 9               # digits of a numeric attribute (int() of them stays cheap)
MAX_WARNINGS = 100                  # warnings kept per document; the rest are counted

_WS = " \t\r\n"
_NAME = re.compile(r"[\w.-]+")      # \w on str: Unicode letters and digits, and '_'
_SPACE = re.compile(r"[ \t\r\n]*")
_ENTITY = re.compile(r"&(?:#([0-9]+)|#x([0-9a-fA-F]+)|([\w.-]+))?(;)?")
_NAMED_ENTITIES = {"lt": "<", "gt": ">", "amp": "&", "quot": '"', "apos": "'"}
_DECLARATION = re.compile(r"<!\s*(DOCTYPE|ENTITY|ELEMENT|ATTLIST|NOTATION)", re.IGNORECASE)
_LEADING_FORMAT = re.compile(r"\r?\n[ \t]*")
_TRAILING_FORMAT = re.compile(r"\r?\n[ \t]*\Z")
_POSITIVE_INT = re.compile(r"[0-9]+")

_SCHEMA_TAGS = ("module", "union", "scaffold", "param", "parameter") + nodes.ROLES
_RESERVED_MODULE_NAMES = nodes.ROLES + ("scaffold",)   # tags a prompt cannot use to import


def is_name(text: str) -> bool:
    """Whether `text` can be a tag or attribute name: letters, digits, '-', '_', '.'."""
    return _NAME.fullmatch(text) is not None


def strip_formatting(text: str) -> str:
    """What the whitespace rule leaves of `text` written as one escaped text run.

    The writer emits CDATA exactly when this changes its text."""
    if not text.strip(_WS):
        return ""
    text = text[_leading_cut(text):]
    return text[:_trailing_cut(text)]


def _leading_cut(raw: str) -> int:
    m = _LEADING_FORMAT.match(raw)
    return m.end() if m else 0


def _trailing_cut(raw: str) -> int:
    m = _TRAILING_FORMAT.search(raw)
    return m.start() if m else len(raw)


# ---------------------------------------------------------------------------------------------
# Lexer: source text -> tokens with offsets


class _Chars:
    """A piece of character data: escaped text (`raw` as written, `text` with its
    references replaced) or CDATA (both the same)."""

    __slots__ = ("raw", "text", "offset", "cdata")

    def __init__(self, raw: str, text: str, offset: int, cdata: bool):
        self.raw, self.text, self.offset, self.cdata = raw, text, offset, cdata


class _CommentToken:
    __slots__ = ("text", "offset")

    def __init__(self, text: str, offset: int):
        self.text, self.offset = text, offset


class _Attr:
    __slots__ = ("name", "value", "offset", "value_offset")

    def __init__(self, name: str, value: str, offset: int, value_offset: int):
        self.name, self.value, self.offset, self.value_offset = name, value, offset, value_offset


class _Tag:
    __slots__ = ("name", "attrs", "closing", "self_closing", "offset")

    def __init__(self, name: str, attrs: list[_Attr], closing: bool, self_closing: bool,
                 offset: int):
        self.name, self.attrs, self.offset = name, attrs, offset
        self.closing, self.self_closing = closing, self_closing

    def attr(self, name: str) -> _Attr | None:
        return next((a for a in self.attrs if a.name == name), None)


class _End:
    __slots__ = ("offset",)

    def __init__(self, offset: int):
        self.offset = offset


_Token = _Chars | _CommentToken | _Tag | _End
_Fail = Callable[..., None]
_Warn = Callable[[str, int], None]
_DIGITS = "0123456789"


def _unescape(raw: str, offset: int, fail: _Fail) -> str:
    """`raw` with its character references replaced; `offset` is where `raw` starts."""
    if "&" not in raw:
        return raw

    def replace(m: re.Match) -> str:        # _ENTITY matches at every '&'
        decimal, hexadecimal, name, semicolon = m.groups()
        if semicolon is None or (decimal, hexadecimal, name) == (None, None, None):
            fail("a bare '&' must be written &amp; (or the text put in <![CDATA[...]]>)",
                 offset + m.start())
        if name is not None:
            if name not in _NAMED_ENTITIES:
                fail(f"unknown entity &{name}; — promptlang never expands custom entities "
                     "(only &lt; &gt; &amp; &quot; &apos; and &#N; / &#xN;)", offset + m.start())
            return _NAMED_ENTITIES[name]
        digits = decimal if decimal is not None else hexadecimal
        code = int(digits, 10 if decimal is not None else 16) if len(digits) <= 8 else -1
        if not (0 < code <= 0x10FFFF) or 0xD800 <= code <= 0xDFFF:
            fail(f"{m.group()} is not a valid character", offset + m.start())
        return chr(code)

    return _ENTITY.sub(replace, raw)


class _Lexer:
    """Splits PML source into tokens; reports malformed markup through `fail`."""

    def __init__(self, source: str, fail: _Fail, warn: _Warn):
        self.source, self.fail, self.warn = source, fail, warn
        self.pos = 0
        if source.startswith("\ufeff"):
            self.pos = 1
        if source.startswith("<?xml", self.pos) and source[self.pos + 5:self.pos + 6] in (
                "?", " ", "\t", "\r", "\n"):
            end = source.find("?>", self.pos)
            if end == -1:
                fail("the <?xml ...?> declaration is not closed with '?>'", self.pos)
            self.pos = end + 2

    def next(self) -> _Token:
        s, pos = self.source, self.pos
        if pos >= len(s):
            return _End(pos)
        if s[pos] != "<" or self._bare_lt(pos):
            return self._text(pos)
        if s.startswith("<!--", pos):
            return self._comment(pos)
        if s.startswith("<![CDATA[", pos):
            end = s.find("]]>", pos + 9)
            if end == -1:
                self.fail("<![CDATA[ is not closed with ']]>'", pos)
            self.pos = end + 3
            text = s[pos + 9:end]
            return _Chars(text, text, pos + 9, cdata=True)
        if s.startswith("<!", pos):
            if _DECLARATION.match(s, pos):
                self.fail("DTDs and entity declarations (<!DOCTYPE>, <!ENTITY>) are not "
                          "allowed: promptlang never expands or fetches entities", pos)
            self.fail("unknown markup declaration '<!' (only <!-- comments --> and "
                      "<![CDATA[...]]> are allowed)", pos)
        if s.startswith("<?", pos):
            self.fail("processing instructions are not allowed (only a leading "
                      "<?xml ...?> declaration)", pos)
        return self._tag(pos)

    def _bare_lt(self, at: int) -> bool:
        """Whether the '<' at `at` cannot start markup, and so is text (the HTML rule);
        warns when it is."""
        s = self.source
        after = s[at + 1:at + 2]
        if after and after not in _WS and after != "=" and after not in _DIGITS:
            return False
        if after and after in _DIGITS and self._digit_tag(at + 1):
            return False
        what = ("the end of the input" if not after else "whitespace" if after in _WS
                else f"'{after}'")
        self.warn(f"'<' followed by {what} is read as text; write &lt; to say so "
                  "(or put the text in <![CDATA[...]]>)", at)
        return True

    def _digit_tag(self, at: int) -> bool:
        """Whether the name starting with a digit at `at` opens a tag (a module may be
        named `0`): it is followed by '>', '/>', or an attribute (`name=`)."""
        s = self.source
        end = _NAME.match(s, at).end()
        if s.startswith((">", "/>"), end):
            return True
        after = _SPACE.match(s, end).end()
        if after == end:
            return False
        m = _NAME.match(s, after)
        if m is None:
            return s.startswith((">", "/>"), after)
        return s.startswith("=", _SPACE.match(s, m.end()).end())

    def _text(self, start: int) -> _Chars:
        """Escaped text from `start` up to the next '<' that can start markup."""
        s = self.source
        end = start + 1 if s[start] == "<" else start      # a bare '<' checked by next()
        while True:
            end = s.find("<", end)
            if end == -1:
                end = len(s)
                break
            if not self._bare_lt(end):
                break
            end += 1
        raw = s[start:end]
        self.pos = end
        return _Chars(raw, _unescape(raw, start, self.fail), start, cdata=False)

    def _comment(self, start: int) -> _CommentToken:
        s = self.source
        end = s.find("-->", start + 4)
        if end == -1:
            self.fail("comment is not closed with '-->'", start)
        text = s[start + 4:end]
        dashes = text.find("--")
        if dashes != -1:
            self.fail("'--' is not allowed inside a comment", start + 4 + dashes)
        if text.endswith("-"):
            self.fail("a comment may not end with '-' (write '- -->')", end - 1)
        self.pos = end + 3
        return _CommentToken(text, start)

    def _tag(self, start: int) -> _Tag:
        s, fail = self.source, self.fail
        closing = s.startswith("</", start)
        m = _NAME.match(s, start + 2 if closing else start + 1)
        if m is None:
            if closing:
                fail("expected a tag name after '</'", start + 2)
            fail("a bare '<' must be written &lt; (or the text put in <![CDATA[...]]>)", start)
        name, pos = m.group(), m.end()
        shown = f"</{name}>" if closing else f"<{name}>"
        attrs: list[_Attr] = []
        seen: set[str] = set()             # attribute names so far: the duplicate check is O(1)
        while True:
            after = _SPACE.match(s, pos).end()
            if after >= len(s):
                fail(f"tag {shown} is not closed with '>'", start)
            c = s[after]
            if c == ">":
                self.pos = after + 1
                return _Tag(name, attrs, closing, False, start)
            if c == "/" and s.startswith("/>", after) and not closing:
                self.pos = after + 2
                return _Tag(name, attrs, closing, True, start)
            if closing:
                fail(f"unexpected {c!r} in closing tag {shown}", after)
            am = _NAME.match(s, after) if after > pos else None
            if am is None:
                fail(f"unexpected {c!r} in tag {shown} (if this is text, write '<' as &lt; "
                     "or use <![CDATA[...]]>)", after)
            attrs.append(self._attribute(am, shown, seen))
            pos = self.pos

    def _attribute(self, m: re.Match, shown: str, seen: set[str]) -> _Attr:
        s, fail = self.source, self.fail
        name = m.group()
        if name in seen:
            fail(f"duplicate attribute '{name}' in {shown}", m.start())
        seen.add(name)
        eq = _SPACE.match(s, m.end()).end()
        if not s.startswith("=", eq):
            fail(f"attribute '{name}' in {shown} needs a value: {name}=\"...\"", eq)
        quote_at = _SPACE.match(s, eq + 1).end()
        quote = s[quote_at:quote_at + 1]
        if quote not in ('"', "'"):
            fail(f"the value of attribute '{name}' must be in quotes", quote_at)
        end = s.find(quote, quote_at + 1)
        if end == -1:
            fail(f"the value of attribute '{name}' is not closed with {quote}", quote_at)
        raw = s[quote_at + 1:end]
        lt = raw.find("<")
        if lt != -1:
            fail("'<' in an attribute value must be written &lt;", quote_at + 1 + lt)
        value = _unescape(raw, quote_at + 1, fail)
        self.pos = end + 1
        return _Attr(name, value, m.start(), quote_at + 1)


# ---------------------------------------------------------------------------------------------
# Parser: tokens -> nodes

_TagHandler = Callable[[_Tag], "nodes.Node"]


class _Parser:
    def __init__(self, source: str, file: str, base_dir: str | os.PathLike | None):
        self.source, self.file = source, file
        self.base_dir = os.path.abspath(base_dir) if base_dir is not None else None
        self._line_starts = [0] + [m.end() for m in re.finditer("\n", source)]
        self._line_texts: dict[int, str] = {}      # one copy of each line's text, shared by spans
        self.warnings: list[nodes.ParseWarning] = []
        self._unreported = 0                        # warnings past MAX_WARNINGS
        self.lexer = _Lexer(source, self.fail, self.warn)
        self.depth = 0

    # -- locations and failure ---------------------------------------------------------------

    def span(self, offset: int) -> Span:
        """`span_in(source, offset, file)`, in O(log lines) instead of O(offset)."""
        index = bisect.bisect_right(self._line_starts, offset) - 1
        start = self._line_starts[index]
        text = self._line_texts.get(index)
        if text is None:            # sliced once per line: a one-line file stays linear
            end = (self._line_starts[index + 1] - 1 if index + 1 < len(self._line_starts)
                   else len(self.source))
            text = self._line_texts[index] = self.source[start:end]
        return Span(self.file, index + 1, offset - start + 1, text)

    def warn(self, message: str, offset: int) -> None:
        if len(self.warnings) < MAX_WARNINGS:
            self.warnings.append(nodes.ParseWarning(message, self.span(offset)))
        else:
            self._unreported += 1

    def collected_warnings(self) -> tuple[nodes.ParseWarning, ...]:
        """The warnings so far; past MAX_WARNINGS, one more that counts the rest."""
        if not self._unreported:
            return tuple(self.warnings)
        last = self.warnings[-1]
        more = nodes.ParseWarning(f"{self._unreported} more warning"
                                  f"{'s' if self._unreported > 1 else ''} not shown", last.span)
        return (*self.warnings, more)

    def fail(self, message: str, offset: int,
             error: type[PromptLangError] = PMLSyntaxError) -> NoReturn:
        raise error(message, self.span(offset))

    def line_of(self, offset: int) -> int:
        return bisect.bisect_right(self._line_starts, offset)

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

    def misc_until_element(self) -> _Tag | None:
        """Skip whitespace and comments outside the root; the next tag, or None at the end."""
        while True:
            tok = self.lexer.next()
            if isinstance(tok, _End):
                return None
            if isinstance(tok, _Tag):
                return tok
            if isinstance(tok, _Chars) and (tok.cdata or tok.raw.strip(_WS)):
                at = tok.offset + (len(tok.raw) - len(tok.raw.lstrip(_WS)))
                self.fail("text is not allowed outside the root element", at)

    def parse_schema(self, tag: _Tag) -> nodes.Schema:
        attrs = self.attributes(tag, required=("name",), optional=("recompute",))
        name = attrs["name"]
        if not name.value:
            self.fail("the schema name may not be empty", name.value_offset, SchemaError)
        recompute = None
        if "recompute" in attrs:
            try:
                recompute = str(Recompute.parse(attrs["recompute"].value))
            except RecomputeSpecError as error:
                self.fail(str(error), attrs["recompute"].value_offset, SchemaError)
        modules: dict[str, int] = {}
        scaffolds: dict[str, int] = {}

        def child(t: _Tag) -> nodes.Node:
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
                            warnings=self.collected_warnings())

    def parse_prompt(self, tag: _Tag) -> nodes.PromptDoc:
        attrs = self.attributes(tag, required=("schema",))
        schema = attrs["schema"]
        if not schema.value:
            self.fail("the prompt's schema name may not be empty", schema.value_offset)

        def child(t: _Tag) -> nodes.Node:
            if t.name == "scaffold":
                return self.parse_scaffold_ref(t)
            return self.parse_module_ref(t)

        children = () if tag.self_closing else self.content(tag, child, roles=True)
        return nodes.PromptDoc(schema.value, tuple(children), self.span(tag.offset),
                               warnings=self.collected_warnings())

    # -- schema elements ---------------------------------------------------------------------

    def parse_module(self, tag: _Tag, siblings: dict[str, int],
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
            text, text_span = self.read_src(src)
            if not tag.self_closing:
                self.expect_empty(tag, f"module '{name}' takes its text from src={src.value!r} "
                                       "and can have no content of its own", SchemaError)
            children = (nodes.Text(text, text_span),) if text else ()
            return nodes.Module(name, children, cache, src.value, span)
        if tag.self_closing:
            return nodes.Module(name, (), cache, None, span)
        modules: dict[str, int] = {}
        params: dict[str, int] = {}

        def child(t: _Tag) -> nodes.Node:
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

    def parse_union(self, tag: _Tag, siblings: dict[str, int]) -> nodes.Union:
        attrs = self.attributes(tag, optional=("scaffold",))

        def child(t: _Tag) -> nodes.Node:
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

    def parse_scaffold(self, tag: _Tag, siblings: dict[str, int],
                       scaffolds: dict[str, int]) -> nodes.Scaffold:
        attrs = self.attributes(tag, required=("name",))
        name = attrs["name"]
        if not name.value:
            self.fail("a scaffold name may not be empty", name.value_offset, SchemaError)
        if name.value in scaffolds:
            self.fail(f"duplicate scaffold name {name.value!r} (first defined at line "
                      f"{scaffolds[name.value]})", name.value_offset, SchemaError)
        scaffolds[name.value] = self.line_of(tag.offset)

        def child(t: _Tag) -> nodes.Node:
            if t.name == "module":
                return self.parse_module(t, siblings, in_scaffold=True)
            self.fail(f"a <scaffold> holds only <module> elements, not <{t.name}>", t.offset,
                      SchemaError)

        children = () if tag.self_closing else tuple(self.content(
            tag, child, roles=False, text_error="text is not allowed inside a <scaffold>: it "
                                                "holds only modules"))
        return nodes.Scaffold(name.value, children, self.span(tag.offset))

    def parse_param(self, tag: _Tag, params: dict[str, int]) -> nodes.Param:
        if tag.name == "param":
            attrs = self.attributes(tag, required=("name", "len"))
            length = attrs["len"]
        else:
            attrs = self.attributes(tag, required=("name", "length"), optional=("scaffold",))
            length = attrs["length"]
        name = attrs["name"]
        if not _NAME.fullmatch(name.value):
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

    def number(self, attr: _Attr, unit: str, maximum: int) -> int:
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

    def module_name(self, attr: _Attr, siblings: dict[str, int]) -> str:
        name = attr.value
        if not name:
            self.fail("a module name may not be empty", attr.value_offset, SchemaError)
        if not _NAME.fullmatch(name):
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

    def read_src(self, attr: _Attr) -> tuple[str, Span]:
        """The text of a `src=` file, which must resolve inside the base folder."""
        src, at = attr.value, attr.value_offset
        base = self.base_dir if self.base_dir is not None else os.getcwd()
        if not src:
            self.fail("src may not be empty", at, SourceFileError)
        if os.path.isabs(src) or src.startswith(("/", "\\")) or os.path.splitdrive(src)[0]:
            self.fail(f"src {src!r} must be a path relative to the schema's folder", at,
                      SourceFileError)
        try:
            real_base = os.path.realpath(base)
            target = os.path.realpath(os.path.join(real_base, src))
            inside = os.path.commonpath([real_base, target]) == real_base
        except ValueError as e:                 # a NUL byte, or another drive
            self.fail(f"src {src!r} is not a usable path: {e}", at, SourceFileError)
        if not inside:
            self.fail(f"src {src!r} resolves outside the schema's folder {real_base} "
                      f"(to {target})", at, SourceFileError)
        if not os.path.exists(target):
            self.fail(f"src file {src!r} does not exist (looked in {real_base})", at,
                      SourceFileError)
        shown = os.path.join(self.base_dir, src) if self.base_dir is not None else src
        text = read_pml(target, error=SourceFileError, span=self.span(at), file=shown)
        return text, span_in(text, 0, shown)

    def unknown_schema_tag(self, tag: _Tag):
        if tag.name in ("schema", "prompt"):
            self.fail(f"<{tag.name}> can only be the root element", tag.offset)
        self.fail(f"unknown tag <{tag.name}> in a schema; known tags: "
                  + ", ".join(f"<{t}>" for t in _SCHEMA_TAGS), tag.offset)

    # -- prompt elements ---------------------------------------------------------------------

    def parse_scaffold_ref(self, tag: _Tag) -> nodes.ScaffoldRef:
        attrs = self.attributes(tag, required=("name",))
        if not attrs["name"].value:
            self.fail("a scaffold name may not be empty", attrs["name"].value_offset)
        if not tag.self_closing:
            self.expect_empty(tag, "<scaffold name=\"...\"/> in a prompt takes no content",
                              PMLSyntaxError)
        return nodes.ScaffoldRef(attrs["name"].value, self.span(tag.offset))

    def parse_module_ref(self, tag: _Tag) -> nodes.ModuleRef:
        args = tuple(nodes.Argument(a.name, a.value, self.span(a.offset)) for a in tag.attrs)

        def child(t: _Tag) -> nodes.Node:
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

    def attributes(self, tag: _Tag, required: tuple[str, ...] = (),
                   optional: tuple[str, ...] = ()) -> dict[str, _Attr]:
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

    def content(self, parent: _Tag, on_tag: _TagHandler, *, roles: bool,
                text_error: str | None = None) -> list[nodes.Node]:
        """The children of `parent` up to its end tag. `roles`: whether role tags are
        markers here; `text_error`: where text is not allowed (only whitespace is), the
        message for non-whitespace text."""
        self.depth += 1
        if self.depth > MAX_DEPTH:
            self.fail(f"elements nest more than {MAX_DEPTH} levels deep", parent.offset)
        children: list[nodes.Node] = []
        run: list[_Chars] = []
        while True:
            tok = self.lexer.next()
            if isinstance(tok, _Chars):
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
            if isinstance(tok, _CommentToken):
                children.append(nodes.Comment(tok.text, self.span(tok.offset)))
            elif isinstance(tok, _End):
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

    def role_marker(self, tag: _Tag) -> nodes.RoleOpen | nodes.RoleClose:
        if tag.attrs:
            self.fail(f"role tag <{tag.name}> takes no attributes (found '{tag.attrs[0].name}')",
                      tag.attrs[0].offset)
        if tag.self_closing:
            self.fail(f"role tag <{tag.name}/> cannot be self-closing: write <{tag.name}> to "
                      f"open the role and </{tag.name}> to close it", tag.offset)
        if tag.closing:
            return nodes.RoleClose(tag.name, self.span(tag.offset))
        return nodes.RoleOpen(tag.name, self.span(tag.offset))

    def only_whitespace(self, tok: _Chars, message: str):
        """Fail at the first non-whitespace character of `tok` (where text is not allowed)."""
        if tok.text.strip(_WS):
            at = tok.offset + len(tok.raw) - len(tok.raw.lstrip(_WS))
            self.fail(message, at, TextNotAllowedError)

    def expect_empty(self, tag: _Tag, message: str, error: type[PromptLangError]):
        """Consume up to `tag`'s end tag, allowing only whitespace before it."""
        while True:
            tok = self.lexer.next()
            if isinstance(tok, _Chars) and not tok.cdata and not tok.raw.strip(_WS):
                continue
            if isinstance(tok, _Tag) and tok.closing and tok.name == tag.name:
                return
            if isinstance(tok, _End):
                self.fail(f"<{tag.name}> is never closed (expected </{tag.name}>)", tag.offset)
            at = tok.offset
            if isinstance(tok, _Chars):
                at += len(tok.raw) - len(tok.raw.lstrip(_WS))
            self.fail(message, at, error)

    def text_node(self, run: list[_Chars]) -> nodes.Text | None:
        """One text run -> a Text node, after the whitespace rule (module docstring)."""
        if len(run) == 1 and not run[0].cdata:
            raw = run[0].raw
            if not raw.strip(_WS):
                return None
        # The cuts remove literal whitespace only, which stands unchanged at the same end
        # of the decoded text: cut the decoded text by the same number of characters.
        parts = [p.text for p in run]
        offsets = [p.offset for p in run]
        if not run[0].cdata:
            cut = _leading_cut(run[0].raw)
            parts[0], offsets[0] = parts[0][cut:], offsets[0] + cut
        if not run[-1].cdata:
            cut = len(run[-1].raw) - _trailing_cut(run[-1].raw)
            parts[-1] = parts[-1][:len(parts[-1]) - cut]
        text = "".join(parts)
        if not text:
            return None
        offset = next(at for part, at in zip(parts, offsets) if part)
        return nodes.Text(text, self.span(offset))


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


def read_pml(path: str | os.PathLike, *, error: type[PromptLangError] = InputFileError,
             span: Span | None = None, file: str | None = None) -> str:
    """The text of a PML or `src=` file through `promptlang.inputs.read_text` (a regular
    file, under the input cap, UTF-8 with located errors, a BOM dropped), its line
    endings normalised to '\\n'."""
    text = read_text(path, error=error, span=span, file=file)
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    return text


def parse_file(path: str | os.PathLike) -> nodes.Schema | nodes.PromptDoc:
    """Parse a PML file: spans name `path`; `src=` files are read from its folder.
    Line endings are normalised to '\\n' and a UTF-8 BOM is dropped (`read_pml`)."""
    path = os.fspath(path)
    return parse(read_pml(path), file=path, base_dir=os.path.dirname(os.path.abspath(path)))
