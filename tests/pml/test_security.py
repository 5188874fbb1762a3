"""Hostile documents: entity bombs, external entities, deep nesting and garbage die quickly,
in flat memory, with a located PromptLangError -- never another exception. Hostile input
files (devices, FIFOs, oversized, not UTF-8) are refused before they are read."""

import os
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from promptlang.errors import (InputFileError, PMLSyntaxError, PromptLangError, SchemaError,
                               SourceFileError)
from promptlang.pml import nodes as n
from promptlang.pml.parser import parse, parse_file, parse_schema

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
    # no wall-clock limit (shared machines); flat memory means nothing was expanded
    tracemalloc.start()
    try:
        with pytest.raises(PMLSyntaxError) as info:
            parse(text, file="evil.pml")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
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
    with pytest.raises(PMLSyntaxError, match="levels deep"):
        parse('<prompt schema="s">' + "<a>" * depth + "</a>" * depth + "</prompt>")


def test_many_references_decode_into_one_text_node():
    # growth with size is measured by `python -m promptlang.bench.parse_scaling`
    count = 100_000
    tree = parse_schema('<schema name="s"><module name="m">' + "&amp;&#65;" * count
                        + "</module></schema>")
    assert tree.children[0].children == (n.Text("&A" * count),)


_FRAGMENTS = ['<schema name="s">', "</schema>", '<prompt schema="s">', "</prompt>",
              '<module name="m">', '<module name="m"/>', "</module>", "<union>", "</union>",
              '<scaffold name="x">', '<scaffold name="x"/>', "</scaffold>",
              '<param name="p" len="2"/>', '<parameter name="p" length="0"/>', "<user>",
              "</user>", "<system/>", "<a>", "</a>", '<b c="d">', "<!--", "-->", "<![CDATA[",
              "]]>", "&", "&amp;", "&lt", "&#x41;", "&#0;", "&bad;", "<", ">", "<?", "?>",
              "<!DOCTYPE", "<!ENTITY", "'", '"', "=", "/", " ", "\n", "text", "é", "0", "<0",
              '<param name="p" len="', '99999999999', "< ", "<="]


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


# --- hostile input files: every read goes through promptlang.inputs.read_text --------------

def test_dev_zero_is_refused_before_anything_is_read():
    with pytest.raises(InputFileError, match="not a regular file"):
        parse_file("/dev/zero")


def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "schema.pml"
    os.mkfifo(fifo)
    with pytest.raises(InputFileError, match="not a regular file"):
        parse_file(fifo)


def test_a_file_over_the_input_cap_is_refused(tmp_path, monkeypatch):
    path = tmp_path / "big.pml"
    path.write_text('<schema name="s">' + "x" * 200 + "</schema>", encoding="utf-8")
    monkeypatch.setenv("PROMPTLANG_MAX_INPUT_BYTES", "100")
    with pytest.raises(InputFileError, match="over the input cap of 100 bytes"):
        parse_file(path)


def test_invalid_utf8_is_located_by_line_and_column(tmp_path):
    path = tmp_path / "bad.pml"
    path.write_bytes(b'<schema name="s">\n<module name="m">caf\xe9</module></schema>')
    with pytest.raises(InputFileError, match="invalid UTF-8") as info:
        parse_file(path)
    assert (info.value.span.file, info.value.span.line, info.value.span.col) == (
        str(path), 2, 21)


def test_crlf_files_read_as_newlines_and_a_bom_is_dropped(tmp_path):
    path = tmp_path / "crlf.pml"
    path.write_bytes(b'\xef\xbb\xbf<schema name="s">\r\n<module name="m">a\r\nb</module>'
                     b'</schema>\r\n')
    assert parse_file(path).children[0].children == (n.Text("a\nb"),)


@pytest.mark.parametrize("make, message", [
    (lambda p: os.mkfifo(p), "not a regular file"),
    (lambda p: p.write_bytes(b"ok\n\xff"), "invalid UTF-8"),
    (lambda p: p.write_bytes(b"x" * 200), "over the input cap"),
])
def test_src_files_are_read_like_inputs_and_keep_their_error_class(tmp_path, monkeypatch, make,
                                                                   message):
    make(tmp_path / "doc.txt")
    monkeypatch.setenv("PROMPTLANG_MAX_INPUT_BYTES", "100")
    with pytest.raises(SourceFileError, match=message) as info:
        parse_schema('<schema name="s">\n  <module name="m" src="doc.txt"/></schema>',
                     file="t.pml", base_dir=tmp_path)
    if message == "invalid UTF-8":
        assert (info.value.span.line, info.value.span.col) == (2, 1)   # inside doc.txt
        assert info.value.span.file.endswith("doc.txt")
    else:
        assert (info.value.span.file, info.value.span.line, info.value.span.col) == (
            "t.pml", 2, 25)


_NUMBERS = st.one_of(st.integers(min_value=-10, max_value=10**30).map(str),
                     st.text(alphabet="0123456789+-.e \u0663", max_size=40))


@settings(max_examples=200, deadline=None)
@given(_NUMBERS)
def test_any_len_value_gives_a_param_or_a_located_schema_error(value):
    text = f'<schema name="s"><module name="m"><param name="p" len="{value}"/></module></schema>'
    try:
        schema = parse_schema(text, file="n.pml")
    except SchemaError as e:
        assert e.span is not None and (e.span.line, e.span.col) == (1, 56)
    else:
        assert 1 <= schema.children[0].children[0].length <= n.MAX_POSITIONS
