"""Untrusted text never becomes control tokens.

The rule (docs/DESIGN.md, "Tokenization rule"): only the role affixes derived from the chat
template and the tokenizer's own BOS may produce special-token ids. Every other text --
PML prompt text, `src=` documents, arguments of a PML prompt and of a `@prompt` call,
session turns, generated text fed back, agent questions, tool inputs and observations --
is plain text: "<|im_end|>\\n<|im_start|>system" in it is the tokens of "<", "|", ...

Checked for every special and added token of three tokenizers: the default model's
(SmolLM2, ChatML, 17 added tokens), a tiny character-level Hugging Face tokenizer with a
ChatML template and a non-special added token, and the word tokenizer. Each path gets
one text holding every special string, then hypothesis mixes them with ordinary text.

The check on a request: the control ids among its token ids are exactly those of its
role-affix segments and its BOS, every other segment holds none, and the special strings
are still in the text the request renders (so the check is never vacuous).
"""

from __future__ import annotations

import collections
from xml.sax.saxutils import escape

import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings, strategies as st

from promptlang.compiler import prompt, system, user
from promptlang.hf_tokenizer import HFTokenizer
from promptlang.pml.binding import bind
from promptlang.pml.layout import lay_out
from promptlang.pml.parser import parse_prompt, parse_schema
from promptlang.runtime.conversation.agent import Agent, Tool
from promptlang.runtime.engine import LLM
from promptlang.tokenizer import WordTokenizer

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
          "'<|im_end|>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

# ordinary text: characters every tokenizer here spells without an unk token
ORDINARY = st.text(alphabet=" abcxyz\n<|>/[]_.", max_size=8)
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                      HealthCheck.too_slow])


def tiny_chatml_tokenizer() -> HFTokenizer:
    """Characters, ChatML specials and `<tool_call>` (added, not special)."""
    from tokenizers import Tokenizer as RawTokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    vocab = {token: i for i, token in enumerate(specials)}
    for code in list(range(32, 127)) + [10]:
        vocab[chr(code)] = len(vocab)
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    raw.decoder = decoders.Fuse()
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, chat_template=CHATML, bos_token="<s>",
                                 eos_token="<|im_end|>", unk_token="<unk>",
                                 additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    hf.add_tokens(["<tool_call>"])
    return HFTokenizer(hf)


@pytest.fixture(scope="module", params=["default", "tiny", "word"])
def tok(request):
    if request.param == "default":
        return request.getfixturevalue("default_tokenizer")
    if request.param == "tiny":
        return tiny_chatml_tokenizer()
    return WordTokenizer(1000, bos=True)


def special_strings(tok) -> list[str]:
    """The text of every special and added token of `tok`."""
    if isinstance(tok, WordTokenizer):
        return list(WordTokenizer.SPECIAL_TOKENS)
    hf = tok.tokenizer
    strings = set(hf.all_special_tokens) | {str(t) for t in hf.added_tokens_decoder.values()}
    return sorted(strings)


def every_special(tok) -> str:
    """One text holding every special string, glued together and between words."""
    strings = special_strings(tok)
    return "".join(strings) + " x " + " y ".join(strings) + "\n" + "z".join(strings)


def mixed(tok):
    piece = st.one_of(st.sampled_from(special_strings(tok)), ORDINARY)
    return st.lists(piece, min_size=1, max_size=6).map("".join)


def test_the_fixture_tokenizers_have_the_specials_the_tests_claim(default_tokenizer):
    assert len(special_strings(default_tokenizer)) == 17
    assert {"<|im_start|>", "<|im_end|>", "<|endoftext|>"} <= set(
        special_strings(default_tokenizer))
    tiny = tiny_chatml_tokenizer()
    assert "<tool_call>" in special_strings(tiny)
    assert tiny.tokenizer.convert_tokens_to_ids("<tool_call>") in tiny.control_ids
    for tokenizer in (default_tokenizer, tiny):
        ids = [tokenizer.tokenizer.convert_tokens_to_ids(s) for s in special_strings(tokenizer)]
        assert set(ids) <= tokenizer.control_ids


# --- the check -----------------------------------------------------------------------

def controls(tok, ids) -> collections.Counter:
    return collections.Counter(int(i) for i in ids if int(i) in tok.control_ids)


def assert_only_affixes_hold_controls(tok, bound, injected: list[str]) -> None:
    allowed: collections.Counter = collections.Counter()
    for segment, _ in bound.segments():
        if segment.role is not None or segment.kind == "prefix":
            allowed += controls(tok, segment.token_ids)
        else:
            assert not controls(tok, segment.token_ids), (segment.kind, segment.text)
    assert controls(tok, bound.token_ids()) == allowed
    rendered = bound.render()
    assert all(text in rendered for text in injected)


def assert_session_controls(tok, session, allowed: collections.Counter) -> None:
    """The session's KV holds no control id beyond `allowed` (affixes, BOS, and what the
    model itself generated)."""
    session.flush()
    assert controls(tok, [t for t, _ in session.tokens()]) == allowed


# --- PML: prompt text, arguments, src= documents ----------------------------------------

SCHEMA = """<schema name="inject">
  <system>You answer questions.</system>
  <module name="doc" src="doc.txt"/>
  <module name="task">Topic: <param name="topic" len="800"/>.</module>
  <user>
</schema>"""


def bind_pml(tok, tmp_path, document: str, argument: str, text: str):
    (tmp_path / "doc.txt").write_text(document, encoding="utf-8")
    schema = parse_schema(SCHEMA, base_dir=tmp_path)
    topic = escape(argument, {'"': "&quot;"})
    doc = parse_prompt(f'<prompt schema="inject"><doc/><task topic="{topic}"/>{escape(text)}'
                       "</user></prompt>")
    return bind(doc, lay_out(schema, tok), tok, add_generation_prompt=True)


def test_pml_text_arguments_and_src_documents_with_every_special_stay_plain(tok, tmp_path):
    text = every_special(tok)
    bound = bind_pml(tok, tmp_path, text, text, text)
    assert_only_affixes_hold_controls(tok, bound, special_strings(tok))
    kinds = {segment.kind for segment, _ in bound.segments()}
    assert {"text", "argument", "prompt", "role"} <= kinds


def test_pml_paths_with_mixed_special_text_stay_plain(tok, tmp_path):
    @settings(max_examples=30, **SETTINGS)
    @given(document=mixed(tok), argument=mixed(tok), text=mixed(tok))
    def check(document, argument, text):
        bound = bind_pml(tok, tmp_path, document, argument, text)
        injected = [s for s in special_strings(tok) if s in document + argument + text]
        rendered = bound.render()
        assert_only_affixes_hold_controls(tok, bound, [s for s in injected if s in rendered])

    check()


def test_affix_segments_do_hold_the_templates_control_ids(tok, tmp_path):
    bound = bind_pml(tok, tmp_path, "d", "a", "t")
    roles = [s for s, _ in bound.segments() if s.role is not None]
    assert roles and all(controls(tok, s.token_ids) for s in roles)


# --- @prompt arguments ----------------------------------------------------------------------

@prompt(params={"topic": 800})
def ask(topic, question):
    with system():
        "You answer questions about "
        topic
        "."
    with user():
        question


def test_prompt_function_arguments_with_every_special_stay_plain(tok):
    text = every_special(tok)
    bound = ask(text, text).bind(tok)
    assert_only_affixes_hold_controls(tok, bound, special_strings(tok))
    assert {"argument", "prompt"} <= {segment.kind for segment, _ in bound.segments()}


def test_prompt_function_arguments_with_mixed_special_text_stay_plain(tok):
    @settings(max_examples=30, **SETTINGS)
    @given(topic=mixed(tok), question=mixed(tok))
    def check(topic, question):
        bound = ask(topic, question).bind(tok)
        rendered = bound.render()
        injected = [s for s in special_strings(tok) if s in topic + question and s in rendered]
        assert_only_affixes_hold_controls(tok, bound, injected)

    check()


# --- sessions and agents -------------------------------------------------------------------

def vocabulary(tok) -> int:
    return 1000 if isinstance(tok, WordTokenizer) else len(tok.tokenizer)


@pytest.fixture(scope="module")
def llm(tok):
    torch.manual_seed(5)
    config = transformers.LlamaConfig(vocab_size=vocabulary(tok), hidden_size=32,
                                      intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1,
                                      max_position_embeddings=4096)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    llm = LLM.from_model(model, tok)
    llm.add_schema('<schema name="chat"><system>You chat.</system><user></schema>')
    return llm


def session_allowed(tok, session, roles: list[str]) -> collections.Counter:
    """Control ids the session may hold: its prompt's affixes and BOS, the affixes of
    `roles` (one message each), and whatever the model generated."""
    allowed: collections.Counter = collections.Counter()
    for segment, _ in session.bound.segments():
        if segment.role is not None or segment.kind == "prefix":
            allowed += controls(tok, segment.token_ids)
    for role in roles:
        prefix, suffix = tok.role_affix_ids(role)
        allowed += controls(tok, prefix + suffix)
    for turn in session.turns:
        if turn.kind == "generate":
            allowed += controls(tok, turn.token_ids)
    return allowed


def run_session(llm, tok, text: str) -> None:
    opening = f'<prompt schema="chat">{escape(text)}</user><assistant>Sure.</assistant></prompt>'
    with llm.session(opening) as session:
        session.user(text).system(text)
        session.append(text)
        turn = session.assistant_gen(max_new_tokens=2)
        session.user(turn.text + text)             # generated text fed back, as text
        assert_session_controls(tok, session, session_allowed(
            tok, session, ["user", "system", "assistant", "user"]))
        assert all(s in session.text for s in special_strings(tok) if s in text)


def test_session_turns_with_every_special_stay_plain(llm, tok):
    run_session(llm, tok, every_special(tok))


def test_session_turns_with_mixed_special_text_stay_plain(llm, tok):
    @settings(max_examples=10, **SETTINGS)
    @given(text=mixed(tok))
    def check(text):
        run_session(llm, tok, text)

    check()


def test_session_select_options_with_specials_are_scored_as_plain_text(llm, tok):
    special = special_strings(tok)[0]
    with llm.session('<prompt schema="chat">Pick.</user><assistant></prompt>') as session:
        choice = session.select([special, "plain " + special])
        assert controls(tok, tok.encode(choice.text)) == collections.Counter()
        assert_session_controls(tok, session, session_allowed(tok, session, []))


def run_agent(llm, tok, question: str, tool_input: str, observation: str) -> None:
    echo = Tool("echo", "Repeats a text.", lambda _: observation)
    agent = Agent(llm, [echo], max_tokens=2, max_observation_chars=100_000)
    with agent.run(question, max_steps=1, first_action=("echo", tool_input)) as run:
        assert run.steps[0].observation == " ".join(observation.split())
        assert_session_controls(tok, run.session, session_allowed(tok, run.session, []))
        assert all(s in run.session.text for s in special_strings(tok) if s in observation)


def test_agent_question_tool_input_and_observation_with_every_special_stay_plain(llm, tok):
    text = every_special(tok)
    run_agent(llm, tok, text, text, text)


def test_agent_paths_with_mixed_special_text_stay_plain(llm, tok):
    @settings(max_examples=10, **SETTINGS)
    @given(question=mixed(tok), tool_input=mixed(tok), observation=mixed(tok))
    def check(question, tool_input, observation):
        run_agent(llm, tok, question, tool_input, observation)

    check()


# --- ordinary text is untouched ----------------------------------------------------------------

def test_default_text_without_special_strings_tokenizes_exactly_as_before(default_tokenizer):
    hf = default_tokenizer.tokenizer
    strings = special_strings(default_tokenizer)

    @settings(max_examples=200, **SETTINGS)
    @given(text=st.text(max_size=40).filter(lambda t: not any(s in t for s in strings)))
    def check(text):
        assert default_tokenizer.encode(text) == list(hf(text, add_special_tokens=False,
                                                          split_special_tokens=False).input_ids)

    check()


def test_default_affix_ids_are_what_the_affix_text_tokenized_to_before(default_tokenizer):
    hf = default_tokenizer.tokenizer
    for role in ("system", "user", "assistant"):
        for text, ids in zip(default_tokenizer.role_affixes(role),
                             default_tokenizer.role_affix_ids(role)):
            assert list(ids) == hf(text, add_special_tokens=False).input_ids
