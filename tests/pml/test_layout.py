"""Layout positions against hand-computed numbers (WordTokenizer: one token per word)."""

import pytest

from promptlang.errors import ContextLengthError, SchemaError
from promptlang.pml import nodes as n
from promptlang.pml.layout import lay_out
from promptlang.tokenizer import WordTokenizer


def T(text):
    return n.Text(text)


def M(name, *children, cache=True):
    return n.Module(name, tuple(children), cache=cache)


@pytest.fixture
def tok():
    return WordTokenizer()


def extent(layout, *path):
    module = layout.modules[tuple(path)]
    return module.start, module.end


def test_modules_start_where_previous_sibling_ended(tok):
    schema = n.Schema("s", (T("one two"), M("a", T("three four five")), M("b", T("six")),
                            T("seven")))
    layout = lay_out(schema, tok)
    assert extent(layout, "a") == (2, 5)
    assert extent(layout, "b") == (5, 6)
    root = layout.modules[()]
    assert [(s.start, len(s.token_ids)) for s in root.segments] == [(0, 2), (6, 1)]
    assert layout.end == 7


def test_nested_modules_are_laid_out_inside_their_parent(tok):
    schema = n.Schema("s", (M("outer", T("a b"), M("inner", T("c d e")), T("f")),))
    layout = lay_out(schema, tok)
    assert extent(layout, "outer") == (0, 6)
    assert extent(layout, "outer", "inner") == (2, 5)
    outer = layout.modules[("outer",)]
    assert [(s.start, s.end) for s in outer.segments] == [(0, 2), (5, 6)]
    assert outer.children == (("outer", "inner"),)
    assert list(layout.modules) == [(), ("outer",), ("outer", "inner")]  # document order


def test_union_members_share_a_start_and_union_reserves_longest(tok):
    schema = n.Schema("s", (T("x"), n.Union((M("short", T("a")), M("long", T("a b c d")),
                                            M("mid", T("a b")))), M("after", T("z"))))
    layout = lay_out(schema, tok)
    assert {extent(layout, m)[0] for m in ("short", "long", "mid")} == {1}
    assert extent(layout, "long") == (1, 5)
    assert extent(layout, "after") == (5, 6)
    (union,) = layout.unions
    assert (union.start, union.length) == (1, 4)
    assert union.members == (("short",), ("long",), ("mid",))
    assert layout.modules[("mid",)].union == 0


def test_parameter_reserves_its_length_with_placeholders(tok):
    schema = n.Schema("s", (M("trip", T("Plan a trip lasting"), n.Param("duration", 4),
                               T(". Go")),))
    layout = lay_out(schema, tok)
    trip = layout.modules[("trip",)]
    (slot,) = trip.params
    assert (slot.name, slot.start, slot.length) == ("duration", 4, 4)
    param = [s for s in trip.segments if s.kind == "param"][0]
    assert param.token_ids == (tok.placeholder_id,) * 4
    assert trip.end == 4 + 4 + 2


def test_parameter_scaffold_text_is_the_placeholder(tok):
    schema = n.Schema("s", (M("m", n.Param("p", 3, scaffold="two words")),))
    param = lay_out(schema, tok).modules[("m",)].segments[0]
    assert param.token_ids == tuple(tok.encode("two words")) + (tok.placeholder_id,)
    with pytest.raises(SchemaError, match="reserves 1"):
        lay_out(n.Schema("s", (M("m", n.Param("p", 1, scaffold="two words")),)), tok)


def test_scaffold_members_are_consecutive_and_form_one_unit(tok):
    schema = n.Schema("s", (T("sys"), n.Scaffold("docs", (M("a", T("a1 a2")),
                                                          M("b", T("b1 b2 b3"))))))
    layout = lay_out(schema, tok)
    assert extent(layout, "a") == (1, 3) and extent(layout, "b") == (3, 6)
    assert layout.scaffolds == {"docs": (("a",), ("b",))}
    unit = layout.units["scaffold:docs"]
    assert [s.start for s in unit.segments] == [1, 3]
    assert unit.context == ("module:",)


def test_units_carry_guaranteed_context_chain(tok):
    schema = n.Schema("s", (M("a", T("x"), M("b", T("y"), M("c", T("z")))),))
    units = lay_out(schema, tok).units
    assert units["module:a/b/c"].context == ("module:", "module:a", "module:a/b")
    assert units["module:"].context == ()


def test_cache_false_is_inherited_by_children(tok):
    schema = n.Schema("s", (M("a", T("x"), M("b", T("y")), cache=False), M("c", T("z"))))
    layout = lay_out(schema, tok)
    assert not layout.modules[("a", "b")].cache
    assert layout.modules[("c",)].cache


def test_role_tags_take_the_tokenizer_affixes(tok):
    schema = n.Schema("s", (n.RoleOpen("system"), T("be nice"), n.RoleClose("system"),
                            n.RoleOpen("user")))
    root = lay_out(schema, tok).modules[()]
    assert [(s.kind, s.start, s.text) for s in root.segments] == [
        ("role", 0, "[system]"), ("text", 1, "be nice"), ("role", 3, "[/system]"),
        ("role", 4, "[user]")]


def test_text_runs_are_tokenized_separately_and_comments_do_not_split(tok):
    schema = n.Schema("s", (T("a"), n.Comment("c"), T(" b"), M("m", T("c")), T(" d")))
    root = lay_out(schema, tok).modules[()]
    assert [s.text for s in root.segments] == ["a b", " d"]


def test_bos_prefix_sits_at_position_zero():
    tok = WordTokenizer(bos=True)
    layout = lay_out(n.Schema("s", (T("a b"),)), tok)
    assert [(s.kind, s.start) for s in layout.modules[()].segments] == [("prefix", 0),
                                                                       ("text", 1)]


def test_layout_longer_than_context_is_an_error():
    tok = WordTokenizer(max_positions=3)
    with pytest.raises(ContextLengthError, match="needs 4 positions; the model has 3"):
        lay_out(n.Schema("s", (T("a b c d"),)), tok)


def test_layout_is_memoised_per_schema_and_tokenizer(tok):
    schema = n.Schema("s", (T("a"),))
    assert lay_out(schema, tok) is lay_out(n.Schema("s", (T("a"),)), tok)
    assert lay_out(schema, WordTokenizer(bos=True)) is not lay_out(schema, tok)


def test_travel_example_layout_with_the_default_models_tokenizer(default_tokenizer):
    """Numbers worked out once with SmolLM2's tokenizer (ChatML roles: '<|im_start|>system\\n'
    is 3 tokens, '<|im_end|>\\n' is 2), so a change in tokenization or layout shows up here."""
    from pathlib import Path

    from promptlang.pml.parser import parse_file

    schema = parse_file(Path(__file__).parents[2] / "examples" / "pml" / "travel.pml")
    layout = lay_out(schema, default_tokenizer)
    root = layout.modules[()]
    assert [(s.kind, s.start, len(s.token_ids)) for s in root.segments] == [
        ("role", 0, 3), ("text", 3, 14), ("role", 17, 2)]
    assert extent(layout, "trip-plan") == (19, 109)
    trip = layout.modules[("trip-plan",)]
    # "Plan a trip lasting" (the space before the parameter is the slot's first position)
    assert [(s.kind, s.start, len(s.token_ids)) for s in trip.segments] == [
        ("text", 19, 4), ("param", 23, 7), ("text", 30, 13)]
    assert trip.params[0].lead == " "
    assert extent(layout, "trip-plan", "tokyo") == (43, 109)      # the longer member
    assert extent(layout, "trip-plan", "paris") == (43, 98)
    assert extent(layout, "budget") == (109, 127)
    assert layout.end == 127
