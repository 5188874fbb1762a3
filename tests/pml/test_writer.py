"""The PML writer: exact output for each construct, and parse(write(tree)) == tree for
random trees in normal form."""

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from promptlang.errors import PromptLangError
from promptlang.pml import nodes as n
from promptlang.pml.parser import parse, parse_schema
from promptlang.pml.writer import write, write_pretty

CODE = 'if (a < b && c) { s = "<tag>"; }'


def test_schema_is_written_compactly_in_the_paper_dialect():
    tree = n.Schema("travel", (
        n.RoleOpen("system"), n.Text("You are a travel agent."), n.RoleClose("system"),
        n.Comment(" c "),
        n.Module("trip", (n.Text("Plan "), n.Param("days", 4),
                          n.Union((n.Module("tokyo", (n.Text("T"),)), n.Module("paris")),
                                  scaffold="paris")), cache=False),
        n.Scaffold("docs", (n.Module("a", (n.Text("A"),)),)),
    ))
    assert write(tree) == (
        '<schema name="travel"><system>You are a travel agent.</system><!-- c -->'
        '<module name="trip" cache="false">Plan <param name="days" len="4"/>'
        '<union scaffold="paris"><module name="tokyo">T</module><module name="paris"/></union>'
        '</module><scaffold name="docs"><module name="a">A</module></scaffold></schema>')
    assert parse(write(tree)) == tree


def test_param_with_scaffold_text_uses_the_reference_dialect():
    assert write(n.Param("city", 3, "Paris & co")) == (
        '<parameter name="city" length="3" scaffold="Paris &amp; co"/>')
    assert write(n.Param("city", 3, "")) == '<parameter name="city" length="3" scaffold=""/>'
    assert write(n.Param("city", 3)) == '<param name="city" len="3"/>'


def test_prompt_is_written_with_refs_arguments_and_scaffold_refs():
    doc = n.PromptDoc("travel", (
        n.ModuleRef("trip", (n.Argument("days", 'say "3" <days> & more'),),
                    (n.Comment("x"), n.ModuleRef("paris"))),
        n.ScaffoldRef("docs"), n.Text("Why?"), n.RoleClose("user"), n.RoleOpen("assistant")))
    assert write(doc) == (
        '<prompt schema="travel"><trip days="say &quot;3&quot; &lt;days> &amp; more">'
        '<!--x--><paris/></trip><scaffold name="docs"/>Why?</user><assistant></prompt>')
    assert parse(write(doc)) == doc


def test_text_is_escaped_and_code_round_trips():
    assert write(n.Text(CODE)) == 'if (a &lt; b &amp;&amp; c) { s = "&lt;tag&gt;"; }'
    tree = n.Schema("s", (n.Module("code", (n.Text(CODE),)),))
    assert parse(write(tree)) == tree


@pytest.mark.parametrize("text", [
    "\n", " \n\t", "  ", " \r ", "\nHello", "Hello\n", "Hello\n   ", "\r\nHi", "\n\n",
])
def test_text_the_whitespace_rule_would_change_is_written_as_cdata(text):
    written = write(n.Text(text))
    assert written.startswith("<![CDATA[") and written.endswith("]]>")
    tree = n.Schema("s", (n.Module("m", (n.Text(text),)),))
    assert parse(write(tree)) == tree


@pytest.mark.parametrize("text", ["Hello  ", "a\nb", "Hello\n.", "\tx"])
def test_text_the_whitespace_rule_keeps_is_written_escaped(text):
    assert write(n.Text(text)) == text


def test_cdata_splits_its_terminator():
    text = "\nx]]>y]]>"
    assert write(n.Text(text)) == "<![CDATA[\nx]]]]><![CDATA[>y]]]]><![CDATA[>]]>"
    tree = n.Schema("s", (n.Text(text),))
    assert parse(write(tree)) == tree


def test_src_module_is_written_empty_and_reads_back_from_its_file(tmp_path):
    (tmp_path / "doc.txt").write_text("The document.\n", encoding="utf-8")
    tree = parse_schema('<schema name="s"><module name="d" src="doc.txt"></module></schema>',
                        base_dir=tmp_path)
    assert write(tree) == '<schema name="s"><module name="d" src="doc.txt"/></schema>'
    assert parse(write(tree), base_dir=tmp_path) == tree


@pytest.mark.parametrize("text", ["a--b", "ends with -", "-"])
def test_comment_that_cannot_be_written_is_an_error(text):
    with pytest.raises(PromptLangError, match="cannot be written"):
        write(n.Comment(text))


@pytest.mark.parametrize("node, message", [
    (n.ModuleRef("a b"), "not a valid PML name"),
    (n.ModuleRef("user"), "cannot be named 'user'"),
    (n.ModuleRef("scaffold"), "cannot be named 'scaffold'"),
    (n.ModuleRef("a", (n.Argument("x=y", "1"),)), "argument name 'x=y'"),
    (n.Param("p", 0), "at least one token"),
    (n.RoleOpen("tool"), "unknown role 'tool'"),
])
def test_trees_that_cannot_be_written_are_errors(node, message):
    with pytest.raises(PromptLangError, match=message):
        write(node)


@pytest.mark.parametrize("policy", ["Deviation:15%", "first:03", "", "not a policy & <no>"])
def test_schema_recompute_is_written_back_as_written(policy):
    tree = n.Schema("s", recompute=policy)
    written = write(tree)
    assert written == f'<schema name="s" recompute="{_attr(policy)}"/>'
    assert parse_schema(written) == tree and parse_schema(written).recompute == policy


def _attr(value: str) -> str:
    return value.replace("&", "&amp;").replace("<", "&lt;").replace('"', "&quot;")


def test_write_rejects_what_is_not_a_node():
    with pytest.raises(TypeError):
        write("text")


# ---------------------------------------------------------------------------------------------
# property: parse(write(tree)) == tree for random trees in normal form

# Characters that meet every escaping and whitespace case ("]]>", "\r\n", "&amp;", "--" ...
# arise from them), some unicode, and ends the whitespace rule would cut.
_TRICKY = "<&>];#[!CDATA-\n\r\t  xyé日\U0001F600\u00a0\u2028\x00\"'/="
texts = st.builds(lambda head, body, tail: head + body + tail,
                  st.sampled_from(["", "", "\n", "\r\n", "\n  ", " \n"]),
                  st.text(_TRICKY, max_size=12),
                  st.sampled_from(["", "", "\n", "\n\t", " ", "]]"])).filter(bool)
comments = texts.map(lambda t: t.replace("-", "=")).map(n.Comment)
name_stems = st.text(st.sampled_from("abcxyz019-_.éß"), min_size=1, max_size=5)


def normal(children: list) -> tuple:
    """Merge adjacent Text nodes (normal form)."""
    out = []
    for child in children:
        if isinstance(child, n.Text) and out and isinstance(out[-1], n.Text):
            out[-1] = n.Text(out[-1].text + child.text)
        else:
            out.append(child)
    return tuple(out)


class Names:
    """Unique suffixes, so siblings never clash and names stay varied."""

    def __init__(self):
        self.counter = itertools.count()

    def __call__(self, stem: str) -> str:
        return f"{stem}{next(self.counter)}"


@st.composite
def modules(draw, names: Names, depth: int, flat: bool = False):
    kinds = ["text", "comment", "role"] + ([] if flat else ["param"])
    if depth > 0 and not flat:
        kinds += ["module", "union"]
    children = []
    params = Names()
    for kind in draw(st.lists(st.sampled_from(kinds), max_size=5)):
        if kind == "text":
            children.append(n.Text(draw(texts)))
        elif kind == "comment":
            children.append(draw(comments))
        elif kind == "role":
            cls = draw(st.sampled_from([n.RoleOpen, n.RoleClose]))
            children.append(cls(draw(st.sampled_from(n.ROLES))))
        elif kind == "param":
            scaffold = draw(st.none() | texts)
            children.append(n.Param(params(draw(name_stems)), draw(st.integers(1, 9999)),
                                    scaffold))
        elif kind == "module":
            children.append(draw(modules(names, depth - 1)))
        else:
            children.append(draw(unions(names, depth - 1)))
    return n.Module(names(draw(name_stems)), normal(children), cache=draw(st.booleans()))


@st.composite
def unions(draw, names: Names, depth: int):
    children = draw(st.lists(modules(names, depth) | comments, max_size=3))
    members = [c.name for c in children if isinstance(c, n.Module)]
    scaffold = draw(st.sampled_from(members)) if members and draw(st.booleans()) else None
    return n.Union(tuple(children), scaffold)


@st.composite
def schemas(draw):
    names, scaffold_names = Names(), Names()
    children = []
    for kind in draw(st.lists(st.sampled_from(
            ["text", "comment", "role", "module", "union", "scaffold"]), max_size=6)):
        if kind == "text":
            children.append(n.Text(draw(texts)))
        elif kind == "comment":
            children.append(draw(comments))
        elif kind == "role":
            cls = draw(st.sampled_from([n.RoleOpen, n.RoleClose]))
            children.append(cls(draw(st.sampled_from(n.ROLES))))
        elif kind == "module":
            children.append(draw(modules(names, 2)))
        elif kind == "union":
            children.append(draw(unions(names, 1)))
        else:
            members = draw(st.lists(modules(names, 0, flat=True) | comments, max_size=3))
            children.append(n.Scaffold(scaffold_names(draw(texts)), tuple(members)))
    recompute = draw(st.none() | st.text(_TRICKY, max_size=20).map(str.strip))
    return n.Schema(draw(texts), normal(children), recompute=recompute)


@st.composite
def refs(draw, depth: int):
    args = Names()
    arguments = tuple(n.Argument(args(draw(name_stems)), draw(st.text() | texts))
                      for _ in range(draw(st.integers(0, 3))))
    children = draw(st.lists(refs(depth - 1) | comments, max_size=3)) if depth else []
    return n.ModuleRef(draw(name_stems), arguments, tuple(children))


@st.composite
def prompts(draw):
    children = []
    for kind in draw(st.lists(st.sampled_from(["text", "comment", "role", "ref", "scaffold"]),
                              max_size=6)):
        if kind == "text":
            children.append(n.Text(draw(texts)))
        elif kind == "comment":
            children.append(draw(comments))
        elif kind == "role":
            cls = draw(st.sampled_from([n.RoleOpen, n.RoleClose]))
            children.append(cls(draw(st.sampled_from(n.ROLES))))
        elif kind == "ref":
            children.append(draw(refs(2)))
        else:
            children.append(n.ScaffoldRef(draw(texts)))
    return n.PromptDoc(draw(texts), normal(children))


_SETTINGS = settings(max_examples=200, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])


@_SETTINGS
@given(schemas())
def test_random_schemas_round_trip(tree):
    written = write(tree)
    assert parse(written) == tree
    assert write(parse(written)) == written


@_SETTINGS
@given(prompts())
def test_random_prompts_round_trip(doc):
    written = write(doc)
    assert parse(written) == doc
    assert write(parse(written)) == written


@_SETTINGS
@given(schemas())
def test_random_schemas_round_trip_written_pretty(tree):
    written = write_pretty(tree)
    assert parse(written) == tree
    assert write_pretty(parse(written)) == written


@_SETTINGS
@given(prompts())
def test_random_prompts_round_trip_written_pretty(doc):
    assert parse(write_pretty(doc, indent="\t")) == doc


def test_pretty_output_puts_each_element_on_a_line_of_its_own():
    tree = n.Schema("s", (n.RoleOpen("system"), n.Text("Be brief."), n.RoleClose("system"),
                          n.Module("trip", (n.Text("Plan a trip lasting "),
                                            n.Param("days", 4), n.Text(".\n"))),
                          n.Module("pad", (n.Text("  indented"),))))
    assert write_pretty(tree) == (
        '<schema name="s">\n'
        '  <system>\n'
        '  Be brief.\n'
        '  </system>\n'
        '  <module name="trip">\n'
        '    Plan a trip lasting \n'
        '    <param name="days" len="4"/>\n'
        '    .\n'
        '\n'
        '  </module>\n'
        '  <module name="pad">\n'
        '    <![CDATA[  indented]]>\n'
        '  </module>\n'
        '</schema>\n')
    assert parse(write_pretty(tree)) == tree


def test_pretty_indent_must_be_whitespace():
    with pytest.raises(PromptLangError):
        write_pretty(n.Schema("s"), indent="--")


def test_bare_less_than_read_as_text_is_escaped_on_write_and_round_trips():
    source = ('<schema name="s"><module name="code">for i in range(n):\n'
              '    if 0 <= i < n: print(i)</module></schema>')
    tree = parse(source)
    written = write(tree)
    assert "0 &lt;= i &lt; n" in written
    again = parse(written)
    assert again == tree and again.warnings == ()
