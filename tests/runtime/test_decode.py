"""The one decode loop: drafts never change the output, hooks do what they say, and the
sampling options travel in one object."""

from __future__ import annotations

import pytest
import torch

from promptlang.errors import PromptLangError
from promptlang.runtime.decoding.decode import Decoder, LookupDrafter
from promptlang.runtime.engine import LLM
from promptlang.runtime.passes.prefill import visibility
from promptlang.runtime.decoding.sampling import Decoding, SamplingParams
from .tiny import Words, count_passes, tiny_llama

VOCAB = 300

SCHEMA = """\
<schema name="copy">
  <system>Copy the list.</system>
  <module name="doc">alpha beta gamma delta alpha beta gamma delta epsilon zeta eta theta
    alpha beta gamma delta iota kappa lambda mu alpha beta gamma delta</module>
  <user>
</schema>
"""
PROMPTS = [
    '<prompt schema="copy"><doc/>Repeat: alpha beta</user></prompt>',
    '<prompt schema="copy"><doc/>gamma delta alpha beta gamma</user></prompt>',
    '<prompt schema="copy">nothing to copy here at all</user></prompt>',
]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(3, VOCAB)


@pytest.fixture
def llm(model) -> LLM:
    llm = LLM.from_model(model, Words(VOCAB, bos=True))
    llm.add_schema(SCHEMA)
    return llm


class Oracle:
    """A drafter that proposes a known continuation (or, `wrong`, tokens that differ)."""

    def __init__(self, answer, wrong: bool = False):
        self.answer, self.wrong = list(answer), wrong

    def propose(self, generated, count):
        follow = self.answer[len(generated):len(generated) + count]
        return [(t + 1) % VOCAB for t in follow] if self.wrong else follow


def decode_with(llm, prompt, drafter=None, draft=0, **options):
    """Greedy decode of `prompt` through a Decoder; (token ids, text, passes)."""
    params = SamplingParams(max_new_tokens=12, draft=draft, **options)
    opened = llm.open(prompt, add_generation_prompt=True, room=16)
    decoding = Decoding(params, llm.tokenizer)
    decoder = Decoder(llm.adapter, opened.buffer, decoding, opened.position, draft=draft,
                      drafter=drafter)
    try:
        for _ in decoder.steps(opened.logits):
            pass
    finally:
        llm.assembler.release(opened.buffer)
    text, ids, _ = decoding.result()
    return ids, text, decoder.passes


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_generate_is_identical_with_and_without_lookup_drafts(llm, prompt):
    plain = llm.generate(prompt, max_new_tokens=16)
    for k in (1, 4, 8):
        drafted = llm.generate(prompt, max_new_tokens=16, draft=k)
        assert drafted.token_ids == plain.token_ids
        assert drafted.text == plain.text and drafted.finish_reason == plain.finish_reason


def test_accepted_drafts_save_passes_and_rejected_ones_change_nothing(llm):
    prompt = PROMPTS[0]
    ids, text, passes = decode_with(llm, prompt)
    assert passes == len(ids) - 1                      # one pass per fed token
    right = decode_with(llm, prompt, Oracle(ids), draft=4)
    wrong = decode_with(llm, prompt, Oracle(ids, wrong=True), draft=4)
    assert right[:2] == (ids, text) and wrong[:2] == (ids, text)
    assert right[2] <= -(-(len(ids) - 1) // 5)        # 5 tokens a pass when every draft holds
    assert wrong[2] == passes


def test_drafts_never_feed_more_than_can_be_picked(llm):
    fed = count_passes(llm)
    plain = llm.generate(PROMPTS[1], max_new_tokens=5)
    del fed[:]
    drafted = llm.generate(PROMPTS[1], max_new_tokens=5, draft=32)
    assert drafted.token_ids == plain.token_ids
    assert sum(fed[1:]) <= 4                            # 5 picks: at most 4 tokens fed


def test_seeded_sampling_is_identical_with_and_without_drafts(llm):
    options = dict(max_new_tokens=12, temperature=0.8, top_k=40, seed=1234)
    plain = llm.generate(PROMPTS[1], **options)
    assert llm.generate(PROMPTS[1], draft=6, **options).token_ids == plain.token_ids


def test_streaming_with_drafts_yields_the_same_deltas(llm):
    plain = list(llm.generate(PROMPTS[0], max_new_tokens=12, stream=True))
    stream = llm.generate(PROMPTS[0], max_new_tokens=12, stream=True, draft=4)
    assert list(stream) == plain
    assert "".join(plain) == stream.result.text


def test_session_turns_are_identical_with_and_without_drafts(llm):
    ids, _, _ = decode_with(llm, PROMPTS[1])
    stop = llm.tokenizer.decode(ids[5:6])
    turns, states = [], []
    for draft in (0, 4):
        with llm.session(PROMPTS[1], add_generation_prompt=True) as session:
            first = session.assistant_gen(10, stop=stop, draft=draft)
            session.user("and again")
            second = session.assistant_gen(6, draft=draft)
            turns.append([(t.text, t.token_ids, t.finish_reason, t.generated_tokens)
                          for t in (first, second)])
            states.append((session.tokens(), session.position, session.logits))
    assert turns[0] == turns[1]
    assert states[0][:2] == states[1][:2]
    torch.testing.assert_close(states[0][2], states[1][2], rtol=1e-4, atol=1e-4)


def test_constrain_hook_edits_every_row_before_the_pick(llm):
    ids, _, _ = decode_with(llm, PROMPTS[0])
    banned = ids[0]
    seen = []

    def ban(generated, logits):
        seen.append(len(generated))
        logits = logits.clone()
        logits[banned] = float("-inf")
        return logits

    opened = llm.open(PROMPTS[0], add_generation_prompt=True, room=16)
    decoding = Decoding(SamplingParams(max_new_tokens=6), llm.tokenizer)
    decoder = Decoder(llm.adapter, opened.buffer, decoding, opened.position, constrain=ban)
    try:
        picked = [t for t, _, _ in decoder.steps(opened.logits) if t is not None]
    finally:
        llm.assembler.release(opened.buffer)
    assert banned not in picked and seen == list(range(6))


def test_rollback_returns_kept_logits_and_truncates(llm):
    opened = llm.open(PROMPTS[0], add_generation_prompt=True, room=16)
    start = opened.buffer.length
    decoding = Decoding(SamplingParams(max_new_tokens=6), llm.tokenizer)
    decoder = Decoder(llm.adapter, opened.buffer, decoding, opened.position, keep=2)
    try:
        list(decoder.steps(opened.logits))
        assert decoder.fed == 5 and opened.buffer.length == start + 5
        assert decoder.rollback(4) is not None                    # among the last two kept
        assert decoder.rollback(2) is None                        # too far back
        assert decoder.rollback(0) is opened.logits
        assert opened.buffer.length == start and decoder.position == opened.position
    finally:
        llm.assembler.release(opened.buffer)


def test_lookup_drafter_proposes_what_followed_the_latest_longest_match():
    drafter = LookupDrafter([1, 2, 3, 4, 9, 2, 3, 5, 6, 7], ngram=3)
    assert drafter.propose([2, 3], 3) == [5, 6, 7]         # latest "2 3" is followed by 5 6 7
    assert drafter.propose([2, 3, 8], 3) == []              # "3 8", "8": never seen before
    other = LookupDrafter([1, 2, 3, 4, 9, 2, 3, 5, 6, 7])
    assert other.propose([1, 2, 3], 2) == [4, 9]            # the 3-gram beats the later "2 3"
    assert LookupDrafter([5]).propose([5], 2) == [5]        # follows the earlier 5: itself
    assert LookupDrafter([]).propose([4], 2) == []
    known = LookupDrafter([1, 2, 3, 4], candidates=[[7, 8, 9], [2, 5, 6, 8]])
    assert known.propose([2], 2) == [5, 6]                  # the agreeing candidate first
    assert known.propose([2, 3], 2) == [4, 2]               # none agrees: the lookup


def test_visibility_is_none_only_for_plain_causal_order():
    past = torch.tensor([0, 1, 2])
    assert visibility(past, torch.tensor([3, 4])) is None
    allowed = visibility(past, torch.tensor([4, 1]))         # out of order, before the past
    assert allowed.tolist() == [[True, True, True, True, True],
                                [True, True, False, False, True]]
    grouped = visibility(past, torch.tensor([3, 4, 3, 4]), torch.tensor([0, 0, 1, 1]))
    assert grouped[:, 3:].tolist() == [[True, False, False, False], [True, True, False, False],
                                       [False, False, True, False], [False, False, True, True]]


def test_sampling_options_travel_in_one_object(llm):
    params = SamplingParams(max_new_tokens=4, stop=("zzz",))
    by_object = llm.generate(PROMPTS[0], sampling=params)
    assert by_object.token_ids == llm.generate(PROMPTS[0], max_new_tokens=4).token_ids
    assert len(llm.generate(PROMPTS[0], sampling=params, max_new_tokens=2).token_ids) == 2
    with pytest.raises(TypeError):
        llm.generate(PROMPTS[0], max_new_token=4)
    with pytest.raises(PromptLangError, match="draft"):
        llm.generate(PROMPTS[0], draft=-1)
    with llm.session(PROMPTS[0], add_generation_prompt=True) as session:
        assert len(session.generate(sampling=params).token_ids) <= 4
