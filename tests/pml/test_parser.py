"""The PML parser: every construct in both dialects, the whitespace rule, src= files,
and every error with its message and location."""

import os
import subprocess
import sys
import textwrap

import pytest

from promptlang.errors import (InputFileError, PMLSyntaxError, PromptLangError, SchemaError,
                               SourceFileError, TextNotAllowedError, span_in)
from promptlang.pml import nodes as n
from promptlang.pml.lexer import MAX_WARNINGS, Locator, strip_formatting
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


# ---------------------------------------------------------------------------------------------
# syntax errors

@pytest.mark.parametrize("text, message, line, col", [
    ('<schema name="s">\n<module name="m">a &foo; b</module></schema>',
     "unknown entity &foo; — promptlang never expands custom entities", 2, 20),
    ('<schema name="s">\n<module name="m">a & b</module></schema>', "bare '&'", 2, 20),
    ('<schema name="s">\n<module name="m">a &amp b</module></schema>', "bare '&'", 2, 20),
    ('<schema name="s">\n<module name="m">a &#0; b</module></schema>', "not a valid character",
     2, 20),
    ('<schema name="s"><module name="m">&#xD800;</module></schema>', "not a valid character",
     1, 35),
    ('<schema name="s"><module name="m">&#99999999999999999999999;</module></schema>',
     "not a valid character", 1, 35),
    ('<schema name="s">\n<module name="m">if a <(b)</module></schema>', "bare '<'", 2, 23),
    ('<schema name="s">\n<module name="m">if a<b) c</module></schema>',
     "unexpected ')' in tag <b>", 2, 24),
    ('<schema name="s">\n<module name="m">x</schema>',
     "unexpected </schema>: <module> opened at line 2 is still open", 2, 19),
    ('<schema name="s">\n  <module name="m">x', "<module> is never closed", 2, 3),
    ('<schema name="s"><!-- a', "comment is not closed", 1, 18),
    ('<schema name="s"><!-- a -- b --></schema>', "'--' is not allowed inside a comment", 1, 25),
    ('<schema name="s"><!-- a ---></schema>', "may not end with '-'", 1, 25),
    ('<schema name="s"><![CDATA[ x </schema>', "<![CDATA[ is not closed", 1, 18),
    ('<schema name="s"><?php echo ?></schema>', "processing instructions are not allowed", 1, 18),
    ('<schema name="s"><!ELEMENT x ANY></schema>', "DTDs and entity declarations", 1, 18),
    ('<schema name="s"><!FOO></schema>', "unknown markup declaration", 1, 18),
    ('<schema name="s"><module name="m" name="n"/></schema>', "duplicate attribute 'name'",
     1, 35),
    ('<schema name="s"><module name=m/></schema>', "must be in quotes", 1, 31),
    ('<schema name="s"><module name/></schema>', "needs a value", 1, 30),
    ('<schema name="s"><module name="m"cache="false"/></schema>', "unexpected 'c'", 1, 34),
    ('<schema name="s"><module name="a<b"/></schema>', "'<' in an attribute value", 1, 33),
    ('<schema name="s"><module name="m', "is not closed with \"", 1, 31),
    ('<schema name="s"><module name="m"', "tag <module> is not closed", 1, 18),
    ('<schema name="s"></ module></schema>', "expected a tag name after '</'", 1, 20),
    ('<schema name="s"></schema x>', "unexpected 'x' in closing tag", 1, 27),
    ('<schema name="s">\n  <modul name="m"/></schema>',
     "unknown tag <modul> in a schema; known tags: <module>, <union>, <scaffold>", 2, 3),
    ('<schema name="s"><schema name="t"/></schema>', "can only be the root", 1, 18),
    ('<schema name="s"><module name="m" chache="false"/></schema>',
     "unknown attribute 'chache' on <module>", 1, 35),
    ('<schema name="s"><module name="m"><param name="p" length="3"/></module></schema>',
     "unknown attribute 'length' on <param> (<param> spells it len)", 1, 51),
    ('<schema name="s"><module name="m"><param name="p"/></module></schema>',
     "<param> needs a 'len' attribute", 1, 35),
    ('<schema name="s">\n  <module cache="false"/></schema>', "<module> needs a 'name'", 2, 3),
    ('<schema>x</schema>', "<schema> needs a 'name'", 1, 1),
    ('<prompt>x</prompt>', "<prompt> needs a 'schema'", 1, 1),
    ('\n  <root/>', "must be <schema> or <prompt>, not <root>", 2, 3),
    ('<schema name="s"/>\n<more/>', "unexpected tag after the root", 2, 1),
    ('hello <schema name="s"/>', "text is not allowed outside the root", 1, 1),
    ('  \n <!-- only a comment -->\n', "no root element", 3, 1),
    ('</schema>', "unexpected closing tag", 1, 1),
    ('<schema name="s">\n  <user/>\n</schema>', "cannot be self-closing", 2, 3),
    ('<schema name="s"><user x="1"></schema>', "takes no attributes", 1, 24),
    ('<prompt schema="s"><a>\n  <user/></a></prompt>',
     "role tag <user> cannot appear inside module reference <a>", 2, 3),
    ('<prompt schema="s"><a><scaffold name="x"/></a></prompt>',
     "belongs at the prompt's top level", 1, 23),
    ('<prompt schema="s"><a></b></prompt>', "unexpected </b>", 1, 23),
    ('<prompt schema="s"><scaffold name="x">y</scaffold></prompt>', "takes no content", 1, 39),
    ('<prompt schema="s"><scaffold nam="x"/></prompt>', "unknown attribute 'nam'", 1, 30),
])
def test_syntax_errors_name_the_problem_and_its_place(text, message, line, col):
    e = error(PMLSyntaxError, text)
    assert message in e.message
    assert where(e) == (line, col)


def test_parse_schema_and_parse_prompt_insist_on_their_root():
    e = error(PMLSyntaxError, '\n<prompt schema="s"/>', parse_schema)
    assert "expected a <schema> document, found <prompt>" in e.message and where(e) == (2, 1)
    e = error(PMLSyntaxError, '<schema name="s"/>', parse_prompt)
    assert "expected a <prompt> document" in e.message


def test_errors_print_file_line_col_the_line_and_a_caret():
    e = error(PMLSyntaxError, '<schema name="s">\n  <module name="m">a & b</module>\n</schema>')
    assert str(e).splitlines() == [
        "t.pml:2:22: a bare '&' must be written &amp; (or the text put in <![CDATA[...]]>)",
        '      <module name="m">a & b</module>',
        "                         ^",
    ]


# ---------------------------------------------------------------------------------------------
# structural (schema) errors

@pytest.mark.parametrize("body, message, line, col", [
    ('<module name="a"/>\n<module name="a"/>',
     "duplicate module name 'a' among siblings (first defined at line 1)", 2, 15),
    ('<module name="a"/>\n<union><module name="a"/></union>', "first defined at line 1", 2, 22),
    ('<union><module name="a"/></union>\n<scaffold name="x"><module name="a"/></scaffold>',
     "duplicate module name 'a'", 2, 34),
    ('<module name="p"><module name="a"/>\n<union><module name="b"/><module name="a"/>'
     '</union></module>', "duplicate module name 'a'", 2, 40),
    ('<scaffold name="x"/>\n<scaffold name="x"/>', "duplicate scaffold name 'x'", 2, 17),
    ('<module name="m"><param name="p" len="1"/>\n<param name="p" len="2"/></module>',
     "duplicate parameter name 'p'", 2, 14),
    ('<module name=""/>', "may not be empty", 1, 32),
    ('<module name="a b"/>', "cannot be used as a tag in a prompt", 1, 32),
    ('<module name="user"/>', "is reserved", 1, 32),
    ('<module name="scaffold"/>', "is reserved", 1, 32),
    ('<module name="m" cache="no"/>', 'cache must be "true" or "false"', 1, 42),
    ('<module name="m"><param name="p" len="0"/></module>', "positive whole number", 1, 56),
    ('<module name="m"><param name="p" len="-2"/></module>', "positive whole number", 1, 56),
    ('<module name="m"><parameter name="p" length="x"/></module>', "length must be", 1, 63),
    ('<module name="m"><param name="a b" len="1"/></module>', "cannot be an attribute name",
     1, 48),
    ('<module name="m"><param name="p" len="1">x</param></module>', "takes no content", 1, 59),
    ('\n<param name="p" len="1"/>', "must be inside a <module>", 2, 1),
    ('<union><param name="p" len="1"/></union>',
     "a <union> holds only <module> elements, not <param> (put parameters inside", 1, 25),
    ('<union><union/></union>', "a <union> holds only <module> elements", 1, 25),
    ('<union><user></union>', "a <union> holds only <module> elements, not <user>", 1, 25),
    ('<union scaffold="c"><module name="a"/><module name="b"/></union>',
     "union scaffold='c' names none of its members (a, b)", 1, 35),
    ('<scaffold name="x"><module name="a">A<module name="b"/></module></scaffold>',
     "a scaffold's module cannot contain a <module>: the scaffold is encoded jointly", 1, 55),
    ('<scaffold name="x"><module name="a"><union/></module></scaffold>',
     "cannot contain a <union>", 1, 54),
    ('<scaffold name="x"><param name="p" len="1"/></scaffold>',
     "a <scaffold> holds only <module> elements", 1, 37),
    ('<scaffold name="">x</scaffold>', "scaffold name may not be empty", 1, 34),
    ('<module name="m"><scaffold name="x"/></module>', "only allowed at the schema's top level",
     1, 35),
])
def test_schema_errors_name_the_rule_and_its_place(body, message, line, col):
    e = error(SchemaError, f'<schema name="s">{body}</schema>')
    assert message in e.message
    assert where(e) == (line, col)


def test_same_module_name_under_different_parents_is_fine():
    tree = parse_schema('<schema name="s"><module name="a"><module name="x"/></module>'
                        '<module name="b"><module name="x"/></module></schema>')
    assert [c.children[0].name for c in tree.children] == ["x", "x"]


def test_empty_schema_name_is_a_schema_error():
    e = error(SchemaError, '<schema name="">x</schema>')
    assert "schema name may not be empty" in e.message and where(e) == (1, 15)


@pytest.mark.parametrize("text, message, line, col", [
    ('<schema name="s"><union>\n   oops<module name="a"/></union></schema>',
     "text is not allowed inside a <union>", 2, 4),
    ('<schema name="s"><scaffold name="x"><![CDATA[ y]]></scaffold></schema>',
     "text is not allowed inside a <scaffold>", 1, 47),
    ('<prompt schema="s"><a>\n  <b/> hello </a></prompt>',
     "text is not allowed inside module reference <a>", 2, 8),
])
def test_text_where_only_modules_belong(text, message, line, col):
    e = error(TextNotAllowedError, text)
    assert message in e.message and where(e) == (line, col)


def test_whitespace_and_comments_are_fine_where_text_is_not():
    tree = parse_schema('<schema name="s"><union> <!--c-->\n <module name="a"/>\t</union></schema>')
    assert tree.children == (n.Union((n.Comment("c"), n.Module("a"))),)


# ---------------------------------------------------------------------------------------------
# a '<' that cannot start markup is text, with a located warning

PYTHON_MODULE = '<schema name="s"><module name="code">\ndef f(x, n):\n    return 0 <= x < n\n</module></schema>'


def test_bare_less_than_in_code_is_text_with_a_warning_at_each():
    schema = parse_schema(PYTHON_MODULE, file="code.pml")
    assert schema.children[0].children == (n.Text("def f(x, n):\n    return 0 <= x < n"),)
    assert [(w.span.line, w.span.col) for w in schema.warnings] == [(3, 14), (3, 19)]
    assert str(schema.warnings[0]).startswith("code.pml:3:14: warning: '<' followed by '='")
    assert "followed by whitespace" in schema.warnings[1].message


@pytest.mark.parametrize("text, expected", [
    ("a <3 b", "a <3 b"),             # a digit that opens no tag
    ("x<=y", "x<=y"),
    ("a < b &lt; c", "a < b < c"),
    ("tab <\tx", "tab <\tx"),
])
def test_less_than_before_space_equals_or_digit_is_text(text, expected):
    (body,) = module_body(text)
    assert body == n.Text(expected)


def test_less_than_at_the_end_of_the_input_is_text_then_the_element_is_unclosed():
    with pytest.raises(PMLSyntaxError, match="never closed"):
        parse('<schema name="s"><module name="m">a <')


def test_a_digit_still_starts_a_tag_when_a_tag_follows():
    prompt = parse_prompt('<prompt schema="s"><0/><1 a="x"></1><2>\n</2></prompt>')
    assert [c.name for c in prompt.children] == ["0", "1", "2"]
    assert prompt.warnings == ()


def test_other_bare_less_than_is_still_an_error():
    with pytest.raises(PMLSyntaxError, match="bare '<'"):
        parse('<schema name="s"><module name="m">a <(b)</module></schema>')
    with pytest.raises(PMLSyntaxError, match="'<' in an attribute value"):
        parse('<prompt schema="s"><m a="0 < 1"/></prompt>')


def test_warnings_past_the_cap_are_counted_in_one_more():
    schema = parse_schema('<schema name="s"><module name="m">'
                          + "a < b\n" * (MAX_WARNINGS + 50) + "</module></schema>")
    assert len(schema.warnings) == MAX_WARNINGS + 1
    assert schema.warnings[-1].message == "50 more warnings not shown"


def test_warnings_do_not_take_part_in_equality():
    assert parse_schema(PYTHON_MODULE) == parse_schema(
        '<schema name="s"><module name="code">def f(x, n):\n    return 0 &lt;= x &lt; n'
        '</module></schema>')
