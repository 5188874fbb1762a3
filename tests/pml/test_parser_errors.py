"""The PML parser's errors: syntax and structural errors with their messages and places,
and a bare `<` read as text with a located warning."""

import pytest

from promptlang.errors import PMLSyntaxError, SchemaError, TextNotAllowedError
from promptlang.pml import nodes as n
from promptlang.pml.lexer import MAX_WARNINGS
from promptlang.pml.parser import parse, parse_prompt, parse_schema

from tests.pml.test_parser import error, module_body, where

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
