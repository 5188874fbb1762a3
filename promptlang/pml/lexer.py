"""The PML lexer: characters -> tokens (text, comments, tags with attributes), with offsets.

The parser (`parser.py`) pulls one token at a time (`Lexer.next`); `Locator` turns an
offset into a `Span` and is the one way either phase fails (`fail(message, offset)`).
PML looks like XML but is read by this small hand-written grammar, so that role tags
may stay unbalanced across a schema and its prompts, every token has an exact offset,
and no entity machinery exists to be abused.

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
named with digits), and the lexer records a located warning for it; any other `<`
that starts no valid construct is an error. `<!DOCTYPE`, `<!ENTITY` (and the other
DTD declarations) are rejected the moment they are met, so entity bombs and
external-entity documents die at once, in flat memory. Processing instructions
other than the leading declaration are errors.

Whitespace rule (`run_text`, applied to each *text run*: the text and CDATA pieces
between two pieces of markup -- tags, role tags, comments):

- outside CDATA, a run that is whitespace only is formatting and is dropped
  (write `<![CDATA[ ]]>` or `&#32;` for a space between two tags);
- otherwise ONE leading newline plus the spaces/tabs after it, and ONE trailing
  newline plus the spaces/tabs before the next tag, are formatting and dropped;
  these cuts apply only to escaped (non-CDATA) pieces at the run's two ends, and
  only to literal characters (an entity such as `&#10;` is always content);
- everything else, and all CDATA content, is verbatim. A run that ends up empty
  gives no node; adjacent text and CDATA pieces give one `Text`; a comment ends a
  run. `\\r\\n` counts as one newline.

Cost: linear in the input. Each character is scanned a bounded number of times, and
spans come from a line-start index that shares one copy of each line's text.
"""

from __future__ import annotations

import bisect
import re
from typing import NoReturn

from promptlang.errors import PMLSyntaxError, PromptLangError, Span
from promptlang.pml import nodes

__all__ = ["Locator", "Lexer", "Chars", "CommentToken", "Attr", "Tag", "End", "Token",
           "run_text", "is_name", "strip_formatting", "WS", "NAME", "MAX_WARNINGS"]

MAX_WARNINGS = 100                  # warnings kept per document; the rest are counted

WS = " \t\r\n"
NAME = re.compile(r"[\w.-]+")       # \w on str: Unicode letters and digits, and '_'
_SPACE = re.compile(r"[ \t\r\n]*")
_ENTITY = re.compile(r"&(?:#([0-9]+)|#x([0-9a-fA-F]+)|([\w.-]+))?(;)?")
_NAMED_ENTITIES = {"lt": "<", "gt": ">", "amp": "&", "quot": '"', "apos": "'"}
_DECLARATION = re.compile(r"<!\s*(DOCTYPE|ENTITY|ELEMENT|ATTLIST|NOTATION)", re.IGNORECASE)
_LEADING_FORMAT = re.compile(r"\r?\n[ \t]*")
_TRAILING_FORMAT = re.compile(r"\r?\n[ \t]*\Z")
_DIGITS = "0123456789"


def is_name(text: str) -> bool:
    """Whether `text` can be a tag or attribute name: letters, digits, '-', '_', '.'."""
    return NAME.fullmatch(text) is not None


def strip_formatting(text: str) -> str:
    """What the whitespace rule leaves of `text` written as one escaped text run.

    The writer emits CDATA exactly when this changes its text."""
    if not text.strip(WS):
        return ""
    text = text[_leading_cut(text):]
    return text[:_trailing_cut(text)]


def _leading_cut(raw: str) -> int:
    m = _LEADING_FORMAT.match(raw)
    return m.end() if m else 0


def _trailing_cut(raw: str) -> int:
    m = _TRAILING_FORMAT.search(raw)
    return m.start() if m else len(raw)


class Locator:
    """A document's text under its file name: offsets -> spans, and the one way to fail."""

    def __init__(self, source: str, file: str):
        self.source = source
        self.file = file
        self._line_starts = [0] + [m.end() for m in re.finditer("\n", source)]
        self._line_texts: dict[int, str] = {}      # one copy of each line's text, shared by spans

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

    def line_of(self, offset: int) -> int:
        return bisect.bisect_right(self._line_starts, offset)

    def fail(self, message: str, offset: int,
             error: type[PromptLangError] = PMLSyntaxError) -> NoReturn:
        raise error(message, self.span(offset))


# ---------------------------------------------------------------------------------------------
# Tokens


class Chars:
    """A piece of character data: escaped text (`raw` as written, `text` with its
    references replaced) or CDATA (both the same)."""

    __slots__ = ("raw", "text", "offset", "cdata")

    def __init__(self, raw: str, text: str, offset: int, cdata: bool):
        self.raw = raw
        self.text = text
        self.offset = offset
        self.cdata = cdata


class CommentToken:
    __slots__ = ("text", "offset")

    def __init__(self, text: str, offset: int):
        self.text = text
        self.offset = offset


class Attr:
    """`name="value"`: `value` with its references replaced; `value_offset` is where
    the value starts (errors about the value point there)."""

    __slots__ = ("name", "value", "offset", "value_offset")

    def __init__(self, name: str, value: str, offset: int, value_offset: int):
        self.name = name
        self.value = value
        self.offset = offset
        self.value_offset = value_offset


class Tag:
    """A start tag, an end tag (`closing`) or an empty-element tag (`self_closing`)."""

    __slots__ = ("name", "attrs", "closing", "self_closing", "offset")

    def __init__(self, name: str, attrs: list[Attr], closing: bool, self_closing: bool,
                 offset: int):
        self.name = name
        self.attrs = attrs
        self.offset = offset
        self.closing = closing
        self.self_closing = self_closing

    def attr(self, name: str) -> Attr | None:
        return next((a for a in self.attrs if a.name == name), None)


class End:
    """The end of the input."""

    __slots__ = ("offset",)

    def __init__(self, offset: int):
        self.offset = offset


Token = Chars | CommentToken | Tag | End


# ---------------------------------------------------------------------------------------------
# The lexer


class Lexer:
    """Splits a document into tokens; malformed markup fails through `where.fail`, and a
    bare '<' read as text is a warning (`collected_warnings`)."""

    def __init__(self, where: Locator):
        self.where = where
        self.source = where.source
        self.fail = where.fail
        self.warnings: list[nodes.ParseWarning] = []
        self._unreported = 0                        # warnings past MAX_WARNINGS
        source = self.source
        self.pos = 0
        if source.startswith("\ufeff"):
            self.pos = 1
        after = source[self.pos + 5:self.pos + 6]
        if source.startswith("<?xml", self.pos) and after in ("?", " ", "\t", "\r", "\n"):
            end = source.find("?>", self.pos)
            if end == -1:
                self.fail("the <?xml ...?> declaration is not closed with '?>'", self.pos)
            self.pos = end + 2

    def warn(self, message: str, offset: int) -> None:
        if len(self.warnings) < MAX_WARNINGS:
            self.warnings.append(nodes.ParseWarning(message, self.where.span(offset)))
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

    def next(self) -> Token:
        s = self.source
        pos = self.pos
        if pos >= len(s):
            return End(pos)
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
            return Chars(text, text, pos + 9, cdata=True)
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
        if after and after not in WS and after != "=" and after not in _DIGITS:
            return False
        if after and after in _DIGITS and self._digit_tag(at + 1):
            return False
        what = ("the end of the input" if not after else "whitespace" if after in WS
                else f"'{after}'")
        self.warn(f"'<' followed by {what} is read as text; write &lt; to say so "
                  "(or put the text in <![CDATA[...]]>)", at)
        return True

    def _digit_tag(self, at: int) -> bool:
        """Whether the name starting with a digit at `at` opens a tag (a module may be
        named `0`): it is followed by '>', '/>', or an attribute (`name=`)."""
        s = self.source
        end = NAME.match(s, at).end()
        if s.startswith((">", "/>"), end):
            return True
        after = _SPACE.match(s, end).end()
        if after == end:
            return False
        m = NAME.match(s, after)
        if m is None:
            return s.startswith((">", "/>"), after)
        return s.startswith("=", _SPACE.match(s, m.end()).end())

    def _text(self, start: int) -> Chars:
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
        return Chars(raw, self._unescape(raw, start), start, cdata=False)

    def _comment(self, start: int) -> CommentToken:
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
        return CommentToken(text, start)

    def _tag(self, start: int) -> Tag:
        s = self.source
        fail = self.fail
        closing = s.startswith("</", start)
        m = NAME.match(s, start + 2 if closing else start + 1)
        if m is None:
            if closing:
                fail("expected a tag name after '</'", start + 2)
            fail("a bare '<' must be written &lt; (or the text put in <![CDATA[...]]>)", start)
        name = m.group()
        pos = m.end()
        shown = f"</{name}>" if closing else f"<{name}>"
        attrs: list[Attr] = []
        seen: set[str] = set()             # attribute names so far: the duplicate check is O(1)
        while True:
            after = _SPACE.match(s, pos).end()
            if after >= len(s):
                fail(f"tag {shown} is not closed with '>'", start)
            c = s[after]
            if c == ">":
                self.pos = after + 1
                return Tag(name, attrs, closing, False, start)
            if c == "/" and s.startswith("/>", after) and not closing:
                self.pos = after + 2
                return Tag(name, attrs, closing, True, start)
            if closing:
                fail(f"unexpected {c!r} in closing tag {shown}", after)
            am = NAME.match(s, after) if after > pos else None
            if am is None:
                fail(f"unexpected {c!r} in tag {shown} (if this is text, write '<' as &lt; "
                     "or use <![CDATA[...]]>)", after)
            attrs.append(self._attribute(am, shown, seen))
            pos = self.pos

    def _attribute(self, m: re.Match, shown: str, seen: set[str]) -> Attr:
        s = self.source
        fail = self.fail
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
        value = self._unescape(raw, quote_at + 1)
        self.pos = end + 1
        return Attr(name, value, m.start(), quote_at + 1)

    def _unescape(self, raw: str, offset: int) -> str:
        """`raw` with its character references replaced; `offset` is where `raw` starts."""
        if "&" not in raw:
            return raw
        fail = self.fail

        def replace(m: re.Match) -> str:        # _ENTITY matches at every '&'
            decimal, hexadecimal, name, semicolon = m.groups()
            if semicolon is None or (decimal, hexadecimal, name) == (None, None, None):
                fail("a bare '&' must be written &amp; (or the text put in <![CDATA[...]]>)",
                     offset + m.start())
            if name is not None:
                if name not in _NAMED_ENTITIES:
                    fail(f"unknown entity &{name}; — promptlang never expands custom entities "
                         "(only &lt; &gt; &amp; &quot; &apos; and &#N; / &#xN;)",
                         offset + m.start())
                return _NAMED_ENTITIES[name]
            digits = decimal if decimal is not None else hexadecimal
            code = int(digits, 10 if decimal is not None else 16) if len(digits) <= 8 else -1
            if not (0 < code <= 0x10FFFF) or 0xD800 <= code <= 0xDFFF:
                fail(f"{m.group()} is not a valid character", offset + m.start())
            return chr(code)

        return _ENTITY.sub(replace, raw)


def run_text(run: list[Chars]) -> tuple[str, int] | None:
    """One text run after the whitespace rule (module docstring): its text and the
    offset of its first kept character, or None when nothing is left."""
    if len(run) == 1 and not run[0].cdata and not run[0].raw.strip(WS):
        return None
    # The cuts remove literal whitespace only, which stands unchanged at the same end
    # of the decoded text: cut the decoded text by the same number of characters.
    parts = [p.text for p in run]
    offsets = [p.offset for p in run]
    if not run[0].cdata:
        cut = _leading_cut(run[0].raw)
        parts[0] = parts[0][cut:]
        offsets[0] = offsets[0] + cut
    if not run[-1].cdata:
        cut = len(run[-1].raw) - _trailing_cut(run[-1].raw)
        parts[-1] = parts[-1][:len(parts[-1]) - cut]
    text = "".join(parts)
    if not text:
        return None
    return text, next(at for part, at in zip(parts, offsets) if part)
