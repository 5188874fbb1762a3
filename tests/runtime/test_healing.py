"""Token healing (runtime/decoding/healing.py): a prompt that ends mid-word gives its last token back
to the generation, which must spell it first; the answer is what follows it. On a tiny
random Llama with the default model's tokenizer."""

from __future__ import annotations

import pytest

from promptlang.pml import nodes
from promptlang.runtime.decoding.healing import heal_point, token_texts

SCHEMA = nodes.Schema("h", (nodes.Text("Links and words.\n"),
                            nodes.Module("m", (nodes.Text("A module ends here"),))))
MID_WORD = '<prompt schema="h">The secure address is http</prompt>'
ROLE_END = '<prompt schema="h"><user>Give me the address.</user><assistant></prompt>'


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from tests.conftest import tiny_model_dir as make_dir
    from promptlang.runtime import engine
    from promptlang.runtime.store import ModuleStore

    folder = make_dir.__wrapped__(tmp_path_factory.mktemp("healing"))
    llm = engine.load(str(folder), store=ModuleStore(disk_budget_bytes=0))
    llm.add_schema(SCHEMA)
    return llm


def test_a_prompt_ending_mid_word_gives_its_last_token_back(llm):
    bound = llm.bind(MID_WORD)
    point = heal_point(bound, llm.tokenizer)
    assert point is not None
    assert point.text == llm.tokenizer.decode([bound.token_ids()[-1]])
    assert point.bound.end == bound.end - 1
    assert point.bound.token_ids() == bound.token_ids()[:-1]
    texts, _ = token_texts(llm.tokenizer)
    assert any(t.startswith(point.text) and t != point.text for t in texts)


def test_the_generation_spells_the_removed_text_then_answers_after_it(llm):
    tok = llm.tokenizer
    healed = heal_point(llm.bind(MID_WORD), tok).text
    for seed in (None, 1, 2, 3):
        options = {"temperature": 1.0, "seed": seed} if seed is not None else {}
        result = llm.generate(MID_WORD, max_new_tokens=6, **options)
        spelled = tok.decode(result.token_ids)
        assert spelled.startswith(healed), (spelled, healed)
        assert spelled == healed + result.text or result.finish_reason != "length" \
            and spelled.startswith(healed + result.text)
        plain = llm.generate(MID_WORD, max_new_tokens=6, token_healing=False, **options)
        # one more uncached token (computed, or served from the previous request's tail)
        assert plain.prefill_tokens + plain.tail_tokens == \
            result.prefill_tokens + result.tail_tokens + 1


def test_streamed_deltas_leave_out_the_removed_text_too(llm):
    stream = llm.generate(MID_WORD, max_new_tokens=6, stream=True)
    assert "".join(stream) == stream.result.text
    healed = heal_point(llm.bind(MID_WORD), llm.tokenizer).text
    one = llm.generate(MID_WORD, max_new_tokens=1)          # one token: the spelling itself
    spelled = llm.tokenizer.decode(one.token_ids)
    assert one.text == ("" if healed.startswith(spelled) else spelled[len(healed):])


def test_nothing_is_healed_after_a_role_marker_a_cached_token_or_under_a_constraint(llm):
    assert heal_point(llm.bind(ROLE_END), llm.tokenizer) is None
    assert heal_point(llm.bind('<prompt schema="h"><m/></prompt>'), llm.tokenizer) is None
    pytest.importorskip("llguidance")
    constrained = llm.generate(MID_WORD, max_new_tokens=4, regex="s://[a-z]{1,3}")
    unhealed = llm.generate(MID_WORD, max_new_tokens=4, token_healing=False)
    # not healed: the same prompt tokens (the second request may find them in the tail cache)
    assert (constrained.prefill_tokens + constrained.tail_tokens
            == unhealed.prefill_tokens + unhealed.tail_tokens)
    assert constrained.text.startswith("s://")


APPENDED = "The secure address is http"


def test_a_session_heals_the_text_appended_before_a_generation(llm):
    """Sessions (and through them programs' gen()) heal the last token of the text queued
    since the last computed token; the turn's text is what follows the removed text, and
    the conversation holds the appended text in full either way."""
    tok = llm.tokenizer
    healed = heal_point(llm.bind(MID_WORD), tok).text
    for seed in (None, 1, 2, 3, 4, 5):
        options = {"temperature": 1.0, "seed": seed} if seed is not None else {}
        with llm.session('<prompt schema="h"><m/></prompt>') as session:
            session.append(APPENDED)
            before = session.text
            turn = session.generate(max_new_tokens=5, **options)
            assert turn.healed == healed and tok.decode(list(turn.token_ids)).startswith(healed)
            assert session.text == before + turn.text          # the removed text is not lost
            assert [t for t, _ in session.tokens()][-len(turn.token_ids):] == list(turn.token_ids)
            replayed = session.replay()
            replayed.flush()
            assert replayed.text == session.text
            assert replayed.tokens() == session.tokens()        # the very same tokens
            replayed.close()
        with llm.session('<prompt schema="h"><m/></prompt>') as plain:
            plain.append(APPENDED)
            unhealed = plain.generate(max_new_tokens=5, token_healing=False, **options)
            assert unhealed.prefill_tokens == turn.prefill_tokens + 1


def test_a_session_cut_short_while_spelling_keeps_the_appended_text(llm):
    tok = llm.tokenizer
    for seed in range(6):
        with llm.session('<prompt schema="h"><m/></prompt>') as session:
            session.append(APPENDED)
            turn = session.generate(max_new_tokens=1, temperature=1.0, seed=seed)
            assert session.text.endswith(APPENDED + turn.text)
            held = tok.decode([t for t, _ in session.tokens()])
            assert held.endswith(APPENDED + turn.text)


def test_sessions_heal_nothing_after_a_role_marker_or_under_a_constraint(llm):
    with llm.session('<prompt schema="h"><m/></prompt>') as session:
        session.user(APPENDED)                       # ends with the role's closing marker
        assert session._heal() == ""
        session.append(" and then")
        session.open_role("assistant")
        assert session._heal() == ""
    pytest.importorskip("llguidance")
    with llm.session('<prompt schema="h"><m/></prompt>') as session:
        session.append(APPENDED)
        turn = session.generate(max_new_tokens=4, regex="s://[a-z]{1,3}")
        assert turn.text.startswith("s://")
