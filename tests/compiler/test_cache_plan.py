"""compiler/cache_plan.py: a schema's cache plan from its layout, with no model."""

from __future__ import annotations

import pytest

from promptlang.compiler.cache_plan import format_plan, plan_schema
from promptlang.errors import ContextLengthError
from promptlang.pml.parser import parse_schema
from promptlang.tokenizer import WordTokenizer

SCHEMA = parse_schema("""
<schema name="s">
  <system>Be brief.</system>
  <module name="a">one two three <param name="x" len="6"/>
    <union>
      <module name="b">four five</module>
      <module name="c">six</module>
    </union>
  </module>
  <module name="d">seven eight nine ten</module>
  <module name="e" cache="false">eleven</module>
</schema>""")


def plan(tokenizer=WordTokenizer(), per_token=None, seconds=lambda n: 0.5 + n):
    return plan_schema(SCHEMA, tokenizer, per_token or {"float32": 10, "bfloat16": 6}, seconds)


def test_each_unit_has_its_tokens_bytes_and_encode_estimate():
    p = plan()
    rows = {r.unit: r for r in p.rows}
    assert set(rows) == {"module:", "module:a", "module:a/b", "module:a/c", "module:d",
                         "module:e"}
    # "one two three" then the slot: the space before the parameter and its 6 positions
    assert rows["module:a"].tokens == 3 + 7 and rows["module:a"].params == 7
    assert rows["module:a/b"].bytes == {"float32": 20, "bfloat16": 12}
    assert rows["module:d"].seconds == 4.5
    assert not rows["module:e"].cached
    assert p.total_tokens == sum(r.tokens for r in p.rows if r.unit != "module:e")
    assert p.total_bytes("float32") == 10 * p.total_tokens


def test_combinations_count_optional_modules_and_exclusive_union_members():
    # a in or out, and with it none, b or c; d in or out; e in or out
    assert plan().combinations == (1 + 3) * 2 * 2


def test_warnings_name_what_would_blow_up():
    p = plan(WordTokenizer(max_positions=22))
    assert [w for w in p.warnings if "parameter" in w] == [
        "parameter a/x reserves 7 positions, over 25% of the context: every prompt keeps "
        "them, used or not"]
    with pytest.raises(ContextLengthError, match="needs at least 21 positions"):
        plan(WordTokenizer(vocab_size=999, max_positions=20))   # (layouts are memoised)
    assert plan().warnings == ()
    huge = plan(per_token={"float32": 1 << 40})
    assert any("combinations of modules" in w for w in huge.warnings)


def test_format_lists_units_totals_and_the_rate():
    text = format_plan(plan(), ("float32", "bfloat16"), "rate: made up")
    lines = text.splitlines()
    assert lines[0] == "Cache plan of schema s"
    assert lines[1].split() == ["unit", "tokens", "params", "KV", "float32", "KV", "bfloat16",
                                "encode", "s"]
    assert any(line.startswith("module:e (cache=false)") for line in lines)
    assert any(line.startswith("total cached") for line in lines)
    assert "rate: made up" in lines
