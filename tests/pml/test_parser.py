"""The PML parser: every construct in both dialects, the whitespace rule, src= files.
Its errors and warnings: test_parser_errors.py."""

import os
import subprocess
import sys
import textwrap

import pytest

from promptlang.errors import (InputFileError, PMLSyntaxError, PromptLangError, SchemaError,
                               SourceFileError, span_in)
from promptlang.pml import nodes as n
from promptlang.pml.lexer import Locator, strip_formatting
from promptlang.pml.parser import MAX_DEPTH, parse, parse_file, parse_prompt, parse_schema


def schema_body(body: str, **kw) -> tuple:
    """The children of a schema whose content is `body`."""
    return parse_schema(f'<schema name="s">{body}</schema>', **kw).children


def module_body(body: str) -> tuple:
    (module,) = schema_body(f'<module name="m">{body}</module>')
    return module.children


def prompt_body(body: str) -> tuple:
    return parse_prompt(f'<prompt schema="s">{body}</prompt>').children


def error(cls, text: str, parse_fn=parse, **kw) -> PromptLangError:
    with pytest.raises(cls) as info:
        parse_fn(text, file="t.pml", **kw)
    assert info.value.span.file == "t.pml"
    return info.value


def where(e: PromptLangError) -> tuple[int, int]:
    return where_span(e.span)


def where_span(span) -> tuple[int, int]:
    return span.line, span.col


# ---------------------------------------------------------------------------------------------
# constructs

TRAVEL = textwrap.dedent("""\
    <schema name="travel">
      <!-- anonymous text: always present -->
      <system>You are a travel agent.</system>
      <module name="trip-plan">Plan a trip lasting <param name="duration" len="4"/>.
        <union>
          <module name="tokyo">about Tokyo</module>
          <module name="paris" cache="false">about Paris</module>
        </union>
      </module>
      <scaffold name="both-docs">
        <module name="doc-a">A</module><module name="doc-b">B</module>
      </scaffold>
    </schema>
    """)


def test_paper_dialect_schema_parses_to_the_expected_tree():
    tree = parse_schema(TRAVEL, file="travel.pml")
    assert tree == n.Schema("travel", (
        n.Comment(" anonymous text: always present "),
        n.RoleOpen("system"), n.Text("You are a travel agent."), n.RoleClose("system"),
        n.Module("trip-plan", (
            n.Text("Plan a trip lasting "), n.Param("duration", 4), n.Text("."),
            n.Union((n.Module("tokyo", (n.Text("about Tokyo"),)),
                     n.Module("paris", (n.Text("about Paris"),), cache=False))),
        )),
        n.Scaffold("both-docs", (n.Module("doc-a", (n.Text("A"),)),
                                 n.Module("doc-b", (n.Text("B"),)))),
    ))


def test_reference_dialect_parameter_and_union_scaffold():
    (module,) = schema_body(
        '<module name="m"><parameter name="city" length="3" scaffold="Paris"/>'
        '<parameter name="days" length="2"/>'
        '<union scaffold="b"><module name="a">x</module><module name="b">y</module></union>'
        '</module>')
    param, bare, union = module.children
    assert param == n.Param("city", 3, "Paris")
    assert bare == n.Param("days", 2, None)      # same node as <param name="days" len="2"/>
    assert union.scaffold == "b" and [m.name for m in union.members] == ["a", "b"]


def test_prompt_parses_refs_arguments_scaffold_refs_text_and_roles():
    doc = parse_prompt(textwrap.dedent("""\
        <prompt schema="travel">
          <trip-plan duration="3 days"><!-- pick one --><paris/></trip-plan>
          <scaffold name="both-docs"/>
          <user>What should I see first?</user>
        </prompt>"""))
    assert doc == n.PromptDoc("travel", (
        n.ModuleRef("trip-plan", (n.Argument("duration", "3 days"),),
                    (n.Comment(" pick one "), n.ModuleRef("paris"))),
        n.ScaffoldRef("both-docs"),
        n.RoleOpen("user"), n.Text("What should I see first?"), n.RoleClose("user"),
    ))


def test_schema_may_open_a_role_that_the_prompt_closes():
    tree = parse_schema('<schema name="s"><module name="q"><user>Question: </module></schema>')
    assert tree.children[0].children == (n.RoleOpen("user"), n.Text("Question: "))
    doc = parse_prompt('<prompt schema="s"><q/>Why?</user><assistant></prompt>')
    assert doc.children == (n.ModuleRef("q"), n.Text("Why?"), n.RoleClose("user"),
                            n.RoleOpen("assistant"))


def test_modules_nest_to_any_depth_up_to_the_documented_bound():
    depth = MAX_DEPTH - 1        # the schema element is one level
    text = ('<schema name="s">' + "".join(f'<module name="m{i}">' for i in range(depth))
            + "core" + "</module>" * depth + "</schema>")
    node = parse_schema(text)
    for i in range(depth):
        (node,) = [c for c in node.children if isinstance(c, n.Module)]
        assert node.name == f"m{i}"
    assert node.children == (n.Text("core"),)


def test_nesting_past_the_bound_is_a_located_error_not_a_crash():
    depth = MAX_DEPTH
    text = '<prompt schema="s">\n' + "<a>" * depth + "</a>" * depth + "</prompt>"
    e = error(PMLSyntaxError, text)
    assert "more than 100 levels" in e.message
    assert where(e) == (2, 3 * (depth - 1) + 1)    # the 101st level: the last <a>


def test_empty_and_self_closing_forms():
    assert parse_schema('<schema name="s"/>') == n.Schema("s")
    assert parse_prompt("<prompt schema='s'/>") == n.PromptDoc("s")
    assert schema_body('<module name="a"/><module name="b"></module><union/>'
                       '<scaffold name="x"></scaffold>') == (
        n.Module("a"), n.Module("b"), n.Union(), n.Scaffold("x"))
    assert module_body('<param name="p" len="1"></param>') == (n.Param("p", 1),)
    assert prompt_body('<scaffold name="x"></scaffold><a></a>') == (
        n.ScaffoldRef("x"), n.ModuleRef("a"))


def test_attribute_quoting_and_spacing():
    (module,) = schema_body("<module  name = 'it'\n cache=\"false\" >x</module >")
    assert module == n.Module("it", (n.Text("x"),), cache=False)
    (ref,) = prompt_body("<a x = 'say \"hi\"' y=\"it's &amp; &lt;b&gt;\"\n/>")
    assert ref.args == (n.Argument("x", 'say "hi"'), n.Argument("y", "it's & <b>"))


def test_tag_names_may_use_letters_digits_dash_underscore_dot_and_unicode():
    (ref,) = prompt_body("<doc_1.v-2><größe/></doc_1.v-2>")
    assert ref == n.ModuleRef("doc_1.v-2", (), (n.ModuleRef("größe"),))


def test_entities_are_decoded_in_text_and_attributes():
    assert module_body("&lt;&gt;&amp;&quot;&apos;&#65;&#x1F600;&#x10FFFF;") == (
        n.Text("<>&\"'A\U0001F600\U0010FFFF"),)
    (ref,) = prompt_body('<a v="&#10;&quot;"/>')
    assert ref.args[0].value == '\n"'


CODE = 'if (a < b && c) { s = "<tag>"; }'


def test_code_survives_in_cdata_and_in_escaped_form():
    escaped = 'if (a &lt; b &amp;&amp; c) { s = "&lt;tag&gt;"; }'
    assert module_body(f"<![CDATA[{CODE}]]>") == (n.Text(CODE),)
    assert module_body(escaped) == (n.Text(CODE),)
    assert prompt_body(f"<![CDATA[{CODE}]]>") == (n.Text(CODE),)


def test_cdata_and_text_pieces_merge_and_comments_split_runs():
    assert module_body("a<![CDATA[<b>]]>c<![CDATA[]]>d") == (n.Text("a<b>cd"),)
    assert module_body("a<!--x-->b") == (n.Text("a"), n.Comment("x"), n.Text("b"))


def test_xml_declaration_bom_and_comments_outside_the_root_are_skipped():
    text = ('\ufeff<?xml version="1.0" encoding="utf-8"?>\n<!-- c -->\n<schema name="s"/>\n'
            '<!--e-->\n')
    assert parse(text) == n.Schema("s")


def test_parse_dispatches_on_the_root_tag():
    assert isinstance(parse('<schema name="s"/>'), n.Schema)
    assert isinstance(parse('<prompt schema="s"/>'), n.PromptDoc)


def test_nodes_carry_the_span_where_they_start():
    tree = parse_schema(TRAVEL, file="travel.pml")
    module = tree.children[4]
    assert (module.span.file, module.span.line, module.span.col) == ("travel.pml", 4, 3)
    text, param = module.children[:2]
    assert (text.span.line, text.span.col) == (4, 28)
    assert (param.span.line, param.span.col) == (4, 48)
    paris = module.children[3].members[1]
    assert (paris.span.line, paris.span.col) == (7, 7)
    doc = parse_prompt('<prompt schema="s">\n  <a  x="1"\n     y="2"/>\n  hi\n</prompt>')
    ref, text = doc.children
    assert [(a.span.line, a.span.col) for a in ref.args] == [(2, 7), (3, 6)]
    assert (text.span.line, text.span.col) == (4, 3)


def test_spans_match_span_in_at_every_offset():
    source = "ab\n\ncd é\n  <x>\n"
    where = Locator(source, "f")
    for offset in range(len(source) + 1):
        assert where.span(offset) == span_in(source, offset, "f")
        assert where.span(offset).line_text == span_in(source, offset, "f").line_text
        assert where.line_of(offset) == span_in(source, offset, "f").line


def test_names_other_code_imports_from_the_parser_still_import_from_there():
    from promptlang.pml import lexer, parser, source
    assert (parser.read_pml, parser.strip_formatting, parser.is_name, parser.MAX_WARNINGS) == (
        source.read_pml, lexer.strip_formatting, lexer.is_name, lexer.MAX_WARNINGS)


def test_schema_recompute_is_kept_as_written_with_the_span_of_its_value():
    schema = parse_schema('<schema name="s"\n  recompute="  First:03 "/>', file="t.pml")
    assert schema.recompute == "First:03"               # stripped, not normalised
    assert (schema.recompute_span.file, where_span(schema.recompute_span)) == ("t.pml", (2, 14))
    assert parse_schema('<schema name="s"/>').recompute is None


def test_a_malformed_recompute_policy_is_left_to_the_runtime_with_its_span():
    # the runtime parses the policy and locates its error at recompute_span
    schema = parse_schema('<schema name="s" recompute="first:two"></schema>', file="app.pml")
    assert schema.recompute == "first:two"
    assert str(schema.recompute_span) == "app.pml:1:29"


def test_recompute_text_and_span_do_not_change_what_compares_equal_but_the_text_does():
    a = parse_schema('<schema name="s" recompute="first:3"/>')
    b = parse_schema('<schema name="s"\n\n    recompute="first:3"/>')
    assert a == b and a.recompute_span != b.recompute_span
    assert a != parse_schema('<schema name="s" recompute="first:03"/>')


def test_the_language_does_not_load_the_recompute_policy():
    code = ("import sys, promptlang.pml.parser, promptlang.pml.writer; "
            "print(sorted(m for m in sys.modules if 'recompute' in m))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


# ---------------------------------------------------------------------------------------------
# the whitespace rule

@pytest.mark.parametrize("body, expected", [
    ("\n  ", ()),                                        # whitespace with a newline: formatting
    ("  \n\t \n ", ()),
    ("  ", ()),                                          # whitespace only: formatting
    ("&#32;", (n.Text(" "),)),                           # a reference is content
    ("\n  Hello\n", (n.Text("Hello"),)),                 # one leading and one trailing cut
    ("\n\n  Hello\n\n  ", (n.Text("\n  Hello\n"),)),     # only ONE newline at each end
    ("Hello  \n    ", (n.Text("Hello  "),)),              # trailing newline + indent
    ("Hello\n  world", (n.Text("Hello\n  world"),)),     # inner newlines are verbatim
    ("  Hello", (n.Text("  Hello"),)),                   # leading spaces without newline kept
    ("\r\n\tHello\r\n", (n.Text("Hello"),)),              # CRLF is one newline
    ("&#10;Hello&#10;", (n.Text("\nHello\n"),)),         # references are never formatting
    ("<![CDATA[\n  ]]>", (n.Text("\n  "),)),              # CDATA is verbatim
    ("\n  <![CDATA[\n x \n]]>\n  ", (n.Text("\n x \n"),)),  # cuts only on escaped end pieces
    ("\n a<![CDATA[b]]> \nc\n", (n.Text("a" + "b" + " \nc"),)),
    ("\n<![CDATA[]]>\n", ()),                            # a run that ends up empty: no node
])
def test_whitespace_rule(body, expected):
    assert module_body(body) == expected


def test_whitespace_rule_around_markup():
    body = "\n  <user>\n    Hi <param name=\"p\" len=\"2\"/> there.\n  </user>\n  <!-- c -->\n"
    assert module_body(body) == (
        n.RoleOpen("user"), n.Text("Hi "), n.Param("p", 2), n.Text(" there."),
        n.RoleClose("user"), n.Comment(" c "))
    assert prompt_body("\n  <a/> <b/>\n") == (n.ModuleRef("a"), n.ModuleRef("b"))
    assert prompt_body("<a/>&#32;<b/>") == (n.ModuleRef("a"), n.Text(" "), n.ModuleRef("b"))
    assert module_body("x</user>   <!-- c -->\n") == (n.Text("x"), n.RoleClose("user"),
                                                      n.Comment(" c "))


def test_strip_formatting_is_the_rule_for_one_escaped_run():
    assert strip_formatting("\n  x\n  ") == "x"
    assert strip_formatting(" \n ") == ""
    assert strip_formatting(" x ") == " x "


# ---------------------------------------------------------------------------------------------
# src= files

def test_src_reads_the_file_verbatim_relative_to_base_dir(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("line <one> & two\n", encoding="utf-8")
    (tmp_path / "empty.txt").write_text("", encoding="utf-8")
    tree = parse_schema('<schema name="s"><module name="a" src="docs/a.txt"/>'
                        '<module name="e" src="empty.txt"></module>'
                        '<module name="b" src="docs/../docs/a.txt">\n</module></schema>',
                        base_dir=tmp_path)
    a, e, b = tree.children
    assert a == n.Module("a", (n.Text("line <one> & two\n"),), src="docs/a.txt")
    assert a.children[0].span.file == os.path.join(str(tmp_path), "docs/a.txt")
    assert e == n.Module("e", (), src="empty.txt")
    assert b.children == a.children
    assert tree.base_dir == str(tmp_path)


def test_parse_file_names_the_file_in_spans_and_reads_src_from_its_folder(tmp_path):
    (tmp_path / "doc.txt").write_text("Document.", encoding="utf-8")
    path = tmp_path / "s.pml"
    path.write_text('<schema name="s">\n<module name="d" src="doc.txt"/></schema>',
                    encoding="utf-8")
    tree = parse_file(path)
    assert tree.children[0].children == (n.Text("Document."),)
    assert tree.children[0].span.file == str(path) and tree.children[0].span.line == 2
    assert tree.base_dir == str(tmp_path)


def test_src_defaults_to_the_current_directory(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_text("A", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    assert schema_body('<module name="a" src="a.txt"/>')[0].children == (n.Text("A"),)


@pytest.mark.parametrize("src, message", [
    ("../outside.txt", "resolves outside the schema's folder"),
    ("sub/../../outside.txt", "resolves outside the schema's folder"),
    ("/etc/passwd", "must be a path relative"),
    ("missing.txt", "does not exist"),
    ("sub", "only regular files are read"),
    ("", "src may not be empty"),
])
def test_src_errors_are_located_at_the_attribute(tmp_path, src, message):
    base = tmp_path / "base"
    (base / "sub").mkdir(parents=True)
    (tmp_path / "outside.txt").write_text("secret", encoding="utf-8")
    e = error(SourceFileError, f'<schema name="s">\n  <module name="a" src="{src}"/></schema>',
              base_dir=base)
    assert message in e.message
    assert where(e) == (2, 25)


def test_src_symlink_escaping_the_folder_is_refused(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    (tmp_path / "secret.txt").write_text("secret", encoding="utf-8")
    os.symlink(tmp_path / "secret.txt", base / "link.txt")
    os.symlink(tmp_path, base / "up")
    for src in ("link.txt", "up/secret.txt"):
        e = error(SourceFileError, f'<schema name="s"><module name="a" src="{src}"/></schema>',
                  base_dir=base)
        assert "resolves outside" in e.message and where(e) == (1, 40)


def test_src_symlink_inside_the_folder_is_fine(tmp_path):
    (tmp_path / "real.txt").write_text("R", encoding="utf-8")
    os.symlink(tmp_path / "real.txt", tmp_path / "link.txt")
    assert schema_body('<module name="a" src="link.txt"/>', base_dir=tmp_path)[0].children == (
        n.Text("R"),)


def test_src_module_with_content_is_a_schema_error(tmp_path):
    (tmp_path / "a.txt").write_text("A", encoding="utf-8")
    e = error(SchemaError, '<schema name="s"><module name="a" src="a.txt">\n  extra</module>'
                           '</schema>', base_dir=tmp_path)
    assert "can have no content" in e.message and where(e) == (2, 3)


def test_parse_file_reports_an_unreadable_file(tmp_path):
    with pytest.raises(InputFileError, match="no such file"):
        parse_file(tmp_path / "nope.pml")
