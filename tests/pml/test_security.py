"""Hostile documents: entity bombs, external entities, deep nesting and garbage die quickly,
in flat memory, with a located PromptLangError -- never another exception."""

import time
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from promptlang.errors import PMLSyntaxError, PromptLangError, SourceFileError
from promptlang.pml import nodes as n
from promptlang.pml.parser import parse, parse_schema

BILLION_LAUGHS = """<?xml version="1.0"?>
<!DOCTYPE lolz [
 <!ENTITY lol "lol">
 <!ENTITY lol2 "&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;">
 <!ENTITY lol3 "&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;">
 <!ENTITY lol4 "&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;">
 <!ENTITY lol5 "&lol4;&lol4;&lol4;&lol4;&lol4;&lol4;&lol4;&lol4;&lol4;&lol4;">
 <!ENTITY lol6 "&lol5;&lol5;&lol5;&lol5;&lol5;&lol5;&lol5;&lol5;&lol5;&lol5;">
 <!ENTITY lol7 "&lol6;&lol6;&lol6;&lol6;&lol6;&lol6;&lol6;&lol6;&lol6;&lol6;">
 <!ENTITY lol8 "&lol7;&lol7;&lol7;&lol7;&lol7;&lol7;&lol7;&lol7;&lol7;&lol7;">
 <!ENTITY lol9 "&lol8;&lol8;&lol8;&lol8;&lol8;&lol8;&lol8;&lol8;&lol8;&lol8;">
]>
<schema name="lolz"><module name="m">&lol9;</module></schema>
"""

EXTERNAL_ENTITY = """<?xml version="1.0" encoding="UTF-8"?>
<!DOCTYPE schema [ <!ENTITY xxe SYSTEM "file:///etc/passwd"> ]>
<schema name="s"><module name="m">&xxe;</module></schema>
"""


def rejected_quickly_in_flat_memory(text: str) -> PMLSyntaxError:
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(PMLSyntaxError) as info:
            parse(text, file="evil.pml")
        elapsed = time.perf_counter() - started
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert elapsed < 0.5, f"took {elapsed:.2f}s"
    assert peak < 1_000_000, f"peak {peak} bytes"
    return info.value


def test_billion_laughs_is_rejected_at_its_doctype():
    e = rejected_quickly_in_flat_memory(BILLION_LAUGHS)
    assert "DTDs and entity declarations" in e.message
    assert (e.span.file, e.span.line, e.span.col) == ("evil.pml", 2, 1)


def test_external_entity_is_rejected_and_nothing_is_read():
    e = rejected_quickly_in_flat_memory(EXTERNAL_ENTITY)
    assert "DTDs and entity declarations" in e.message
    assert (e.span.line, e.span.col) == (2, 1)
    assert "root:" not in str(e)


@pytest.mark.parametrize("text, line, col", [
    ('<schema name="s">\n<!ENTITY x "y"></schema>', 2, 1),
    ('<schema name="s"><module name="m">a<!doctype x></module></schema>', 1, 36),
    ('<!DOCTYPE schema SYSTEM "http://example.com/evil.dtd"><schema name="s"/>', 1, 1),
    ('<schema name="s"><!ENTITY % p SYSTEM "file:///etc/passwd"></schema>', 1, 18),
])
def test_any_declaration_anywhere_is_rejected(text, line, col):
    e = rejected_quickly_in_flat_memory(text)
    assert "DTDs and entity declarations" in e.message
    assert (e.span.line, e.span.col) == (line, col)


@pytest.mark.parametrize("text, col", [
    ('<schema name="s"><module name="m">&xxe;</module></schema>', 35),
    ('<prompt schema="s"><a arg="&lol9;"/></prompt>', 28),
])
def test_undeclared_entity_references_are_errors_not_expansions(text, col):
    e = rejected_quickly_in_flat_memory(text)
    assert "never expands custom entities" in e.message and e.span.col == col


def test_huge_doctype_is_rejected_without_reading_past_it():
    text = "<!DOCTYPE x [" + '<!ENTITY a "' + "a" * 2_000_000 + '">]><schema name="s"/>'
    e = rejected_quickly_in_flat_memory(text)
    assert (e.span.line, e.span.col) == (1, 1)


def test_src_cannot_fetch_urls(tmp_path):
    with pytest.raises(SourceFileError, match="does not exist"):
        parse_schema('<schema name="s"><module name="m" src="file:///etc/passwd"/></schema>',
                     base_dir=tmp_path)


def test_very_deep_nesting_is_a_syntax_error_not_a_recursion_error():
    depth = 100_000
    started = time.perf_counter()
    with pytest.raises(PMLSyntaxError, match="levels deep"):
        parse('<prompt schema="s">' + "<a>" * depth + "</a>" * depth + "</prompt>")
    assert time.perf_counter() - started < 0.5


def test_many_references_parse_in_linear_time():
    count = 100_000
    started = time.perf_counter()
    tree = parse_schema('<schema name="s"><module name="m">' + "&amp;&#65;" * count
                        + "</module></schema>")
    assert tree.children[0].children == (n.Text("&A" * count),)
    assert time.perf_counter() - started < 2.0


_FRAGMENTS = ['<schema name="s">', "</schema>", '<prompt schema="s">', "</prompt>",
              '<module name="m">', '<module name="m"/>', "</module>", "<union>", "</union>",
              '<scaffold name="x">', '<scaffold name="x"/>', "</scaffold>",
              '<param name="p" len="2"/>', '<parameter name="p" length="0"/>', "<user>",
              "</user>", "<system/>", "<a>", "</a>", '<b c="d">', "<!--", "-->", "<![CDATA[",
              "]]>", "&", "&amp;", "&lt", "&#x41;", "&#0;", "&bad;", "<", ">", "<?", "?>",
              "<!DOCTYPE", "<!ENTITY", "'", '"', "=", "/", " ", "\n", "text", "é"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_FRAGMENTS), max_size=25).map("".join))
def test_garbage_gives_a_tree_or_a_located_promptlang_error(text):
    try:
        tree = parse(text, file="fuzz.pml")
    except PromptLangError as e:
        assert e.span is not None and e.span.file == "fuzz.pml"
        assert 1 <= e.span.line <= text.count("\n") + 1
    else:
        assert isinstance(tree, (n.Schema, n.PromptDoc))
