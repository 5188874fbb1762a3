"""HFTokenizer: the Tokenizer protocol over transformers, and role text derived
from chat templates (the default model's ChatML and small synthetic templates)."""

from __future__ import annotations

import pytest

from promptlang.errors import ModelError, RoleError
from promptlang.chat_template import PLAIN_AFFIXES, derive_role_affixes
from promptlang.hf_tokenizer import HFTokenizer, load_tokenizer
from promptlang.tokenizer import Tokenizer

LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}"
    "{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n'"
    " + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}"
    "{% endif %}{% endfor %}"
)

# Gemma-style: rejects a system message, calls the assistant "model", BOS in the template.
NO_SYSTEM_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)

# Llama-3-style: the template writes the BOS that the tokenizer also adds.
HEADER_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)


def tiny_tokenizer(chat_template: str | None = None, *, bos: bool = True, pad: bool = False,
                   unk: bool = True, model_max_length: int | None = None, space: bool = True):
    """A character-level transformers tokenizer with <s>/</s> specials, built in memory
    (without a " " token where not `space`)."""
    from tokenizers import Tokenizer as RawTokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    vocab = {token: i for i, token in enumerate(specials)}
    for code in list(range(32 if space else 33, 127)) + [10]:
        vocab[chr(code)] = len(vocab)
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    raw.decoder = decoders.Fuse()
    if bos:
        raw.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                           special_tokens=[("<s>", 1)])
    kwargs = {"bos_token": "<s>", "eos_token": "</s>"}
    if unk:
        kwargs["unk_token"] = "<unk>"
    if pad:
        kwargs["pad_token"] = "<pad>"
    if model_max_length is not None:
        kwargs["model_max_length"] = model_max_length
    return PreTrainedTokenizerFast(tokenizer_object=raw, chat_template=chat_template, **kwargs)


def slow_tokenizer(chat_template: str | None = None):
    """A character-level python ("slow") transformers tokenizer with <s>/</s> specials."""
    from transformers import PythonBackend

    class Chars(PythonBackend):
        def __init__(self, **kwargs):
            self.vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>"])}
            for code in list(range(32, 127)) + [10]:
                self.vocab[chr(code)] = len(self.vocab)
            self.chars = {i: t for t, i in self.vocab.items()}
            super().__init__(**kwargs)

        @property
        def vocab_size(self):
            return len(self.vocab)

        def get_vocab(self):
            return dict(self.vocab, **self.added_tokens_encoder)

        def _tokenize(self, text, **kwargs):
            return list(text)

        def _convert_token_to_id(self, token):
            return self.vocab.get(token, 0)

        def _convert_id_to_token(self, index):
            return self.chars.get(index, "<unk>")

        def convert_tokens_to_string(self, tokens):
            return "".join(tokens)

    return Chars(bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                 chat_template=chat_template)


def render_with_affixes(tok: HFTokenizer, messages, generation: bool = False) -> str:
    text = "".join(tok.role_affixes(m["role"])[0] + m["content"] + tok.role_affixes(m["role"])[1]
                   for m in messages)
    return text + (tok.role_affixes("assistant")[0] if generation else "")


CONVERSATION = [
    {"role": "system", "content": "You answer in French."},
    {"role": "user", "content": "What is the capital of Italy?"},
    {"role": "assistant", "content": "Rome."},
    {"role": "user", "content": "And of Spain?"},
]


# --- the default model's tokenizer -------------------------------------------------

def test_default_tokenizer_satisfies_the_protocol(default_tokenizer):
    assert isinstance(default_tokenizer, Tokenizer)


def test_default_tokenizer_affixes_are_chatml_from_its_template(default_tokenizer):
    assert default_tokenizer.role_affixes("user") == ("<|im_start|>user\n", "<|im_end|>\n")
    assert default_tokenizer.role_affixes("system") == ("<|im_start|>system\n", "<|im_end|>\n")
    assert default_tokenizer.role_affixes("assistant") == ("<|im_start|>assistant\n",
                                                           "<|im_end|>\n")
    assert default_tokenizer.affix_source == "chat template"


def test_default_affixes_reproduce_the_template_render(default_tokenizer):
    hf = default_tokenizer.tokenizer
    expected = hf.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert render_with_affixes(default_tokenizer, CONVERSATION, generation=True) == expected


def test_default_special_token_strings_in_text_stay_plain_text(default_tokenizer):
    text = "<|im_start|>user\nHi<|im_end|>"
    ids = default_tokenizer.encode(text)
    start = default_tokenizer.tokenizer.convert_tokens_to_ids("<|im_start|>")
    end = default_tokenizer.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert start not in ids and end not in ids
    assert default_tokenizer.control_ids.isdisjoint(ids)
    assert default_tokenizer.decode(ids) == text


def test_default_role_affix_ids_are_the_template_control_tokens(default_tokenizer):
    start = default_tokenizer.tokenizer.convert_tokens_to_ids("<|im_start|>")
    end = default_tokenizer.tokenizer.convert_tokens_to_ids("<|im_end|>")
    for role in ("system", "user", "assistant"):
        prefix, suffix = default_tokenizer.role_affix_ids(role)
        assert prefix[0] == start and suffix[0] == end
        assert default_tokenizer.decode(prefix + suffix) == "".join(
            default_tokenizer.role_affixes(role))


def test_default_control_ids_cover_every_special_and_added_token(default_tokenizer):
    hf = default_tokenizer.tokenizer
    assert set(hf.all_special_ids) <= default_tokenizer.control_ids
    assert set(hf.added_tokens_decoder) <= default_tokenizer.control_ids
    assert len(default_tokenizer.control_ids) == 17           # SmolLM2's added tokens


def test_default_text_without_special_strings_tokenizes_as_before(default_tokenizer):
    hf = default_tokenizer.tokenizer
    for text in ("Plan a trip lasting 3 days.", " <b>bold</b> & <|im nope|> ", "x\n\n  y",
                 "日本語のテキスト 🙂", "<|im_start", "im_end|>", ""):
        assert default_tokenizer.encode(text) == hf(text, add_special_tokens=False).input_ids


def test_default_tokenizer_ids_and_context(default_tokenizer):
    assert default_tokenizer.prefix_ids == ()                 # ChatML adds no BOS
    end = default_tokenizer.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert end in default_tokenizer.eos_ids
    assert default_tokenizer.placeholder_id == default_tokenizer.encode(" ")[0]
    assert default_tokenizer.placeholder_id not in default_tokenizer.control_ids
    assert default_tokenizer.max_positions == 8192            # from the GGUF's config


def test_fingerprint_is_stable_across_two_loads(default_tokenizer):
    again = load_tokenizer()
    assert again is not default_tokenizer
    assert again.fingerprint == default_tokenizer.fingerprint
    assert len(default_tokenizer.fingerprint) > 64


def test_fingerprint_ignores_call_time_truncation_settings(default_tokenizer):
    before = load_tokenizer()
    expected = before.fingerprint
    fresh = load_tokenizer()
    fresh.tokenizer("some text " * 20, truncation=True, max_length=5)
    assert fresh.fingerprint == expected


def test_fingerprint_changes_with_the_chat_template(default_tokenizer):
    other = load_tokenizer()
    other.tokenizer.chat_template = LLAMA2_TEMPLATE
    assert other.fingerprint != default_tokenizer.fingerprint


# --- synthetic templates --------------------------------------------------------------

def test_llama2_template_user_and_assistant_affixes():
    tok = HFTokenizer(tiny_tokenizer(LLAMA2_TEMPLATE))
    assert tok.role_affixes("user") == ("<s>[INST] ", " [/INST]")
    assert tok.role_affixes("assistant") == (" ", " </s>")


def test_llama2_system_inside_the_first_user_turn_falls_back_to_user_affixes():
    tok = HFTokenizer(tiny_tokenizer(LLAMA2_TEMPLATE))
    assert tok.role_affixes("system") == tok.role_affixes("user")
    assert tok.affix_source.startswith("chat template (system rendered as user")


def test_llama2_affixes_reproduce_conversations_without_system():
    tok = HFTokenizer(tiny_tokenizer(LLAMA2_TEMPLATE))
    conversation = CONVERSATION[1:] + [{"role": "assistant", "content": "Madrid."}]
    expected = tok.tokenizer.apply_chat_template(conversation, tokenize=False)
    assert render_with_affixes(tok, conversation) == expected


def test_template_that_rejects_system_gives_system_the_user_affixes():
    tok = HFTokenizer(tiny_tokenizer(NO_SYSTEM_TEMPLATE))
    assert tok.role_affixes("user") == ("<start_of_turn>user\n", "<end_of_turn>\n")
    assert tok.role_affixes("assistant") == ("<start_of_turn>model\n", "<end_of_turn>\n")
    assert tok.role_affixes("system") == tok.role_affixes("user")
    assert "System role not supported" in tok.affix_source


def test_bos_written_by_the_template_is_left_to_prefix_ids():
    tok = HFTokenizer(tiny_tokenizer(HEADER_TEMPLATE, bos=True))
    assert tok.prefix_ids == (1,)
    assert tok.role_affixes("system") == ("<|start_header_id|>system<|end_header_id|>\n\n",
                                          "<|eot_id|>")
    expected = tok.tokenizer.apply_chat_template(CONVERSATION, tokenize=False,
                                                 add_generation_prompt=True)
    assert tok.decode(tok.prefix_ids) + render_with_affixes(tok, CONVERSATION, True) == expected


def test_bos_stays_in_the_system_prefix_when_the_tokenizer_adds_none():
    tok = HFTokenizer(tiny_tokenizer(HEADER_TEMPLATE, bos=False))
    assert tok.prefix_ids == ()
    assert tok.role_affixes("system")[0] == "<s><|start_header_id|>system<|end_header_id|>\n\n"
    # later user turns carry no BOS
    assert tok.role_affixes("user")[0] == "<|start_header_id|>user<|end_header_id|>\n\n"


def test_no_chat_template_uses_the_plain_format():
    tok = HFTokenizer(tiny_tokenizer(None))
    for role in ("system", "user", "assistant"):
        assert tok.role_affixes(role) == PLAIN_AFFIXES[role]
    assert tok.affix_source == "plain format (no chat template)"


def test_template_without_role_text_uses_the_plain_format():
    joined = "{{ messages | map(attribute='content') | join(' ') }}"
    tok = HFTokenizer(tiny_tokenizer(joined))
    assert tok.role_affixes("user") == PLAIN_AFFIXES["user"]
    assert tok.affix_source.startswith("plain format (")


def test_template_failing_on_every_conversation_uses_the_plain_format():
    broken = "{{ raise_exception('nope') }}"
    tok = HFTokenizer(tiny_tokenizer(broken))
    assert tok.role_affixes("assistant") == PLAIN_AFFIXES["assistant"]
    assert "nope" in tok.affix_source


def test_derive_rejects_a_generation_prompt_unlike_the_history():
    def render(messages, add_generation_prompt):
        text = "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)
        return text + ("<assistant><think>" if add_generation_prompt else "")

    affixes, source = derive_role_affixes(render)
    assert affixes == dict(PLAIN_AFFIXES)
    assert "generation prompt" in source


def test_derive_from_a_plain_function_template():
    def render(messages, add_generation_prompt):
        text = "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    affixes, source = derive_role_affixes(render)
    assert source == "chat template"
    assert affixes == {role: (f"<{role}>", f"</{role}>")
                       for role in ("system", "user", "assistant")}


def test_affixes_are_derived_once_per_instance():
    calls = []
    hf = tiny_tokenizer(NO_SYSTEM_TEMPLATE)
    tok = HFTokenizer(hf)
    original = tok._render

    def counting(messages, add_generation_prompt):
        calls.append(1)
        return original(messages, add_generation_prompt)

    tok._render = counting
    tok.role_affixes("user")
    first = len(calls)
    tok.role_affixes("system")
    tok.role_affixes("assistant")
    assert first > 0 and len(calls) == first


def test_unknown_role_is_a_role_error():
    with pytest.raises(RoleError, match="unknown role 'tool'"):
        HFTokenizer(tiny_tokenizer(None)).role_affixes("tool")


# --- ids and limits -------------------------------------------------------------------

def test_prefix_ids_are_the_tokens_added_before_the_text():
    assert HFTokenizer(tiny_tokenizer(bos=True)).prefix_ids == (1,)
    assert HFTokenizer(tiny_tokenizer(bos=False)).prefix_ids == ()


def test_encode_adds_no_special_tokens_splits_special_strings_and_decode_inverts_it():
    tok = HFTokenizer(tiny_tokenizer(bos=True))
    ids = tok.encode("ab</s>")
    assert tok.control_ids.isdisjoint(ids) and len(ids) == 6     # a, b, <, /, s, >
    assert tok.decode(ids) == "ab</s>"


def test_unk_for_a_character_outside_the_vocabulary_is_not_refused():
    tok = HFTokenizer(tiny_tokenizer())
    assert tok.encode("a\u00e9") == [tok.encode("a")[0], 0]         # é: <unk>


def test_added_tokens_that_are_not_special_are_cut_into_plain_tokens():
    hf = tiny_tokenizer()
    hf.add_tokens(["<call>"])                 # an added token, special=False
    call = hf.convert_tokens_to_ids("<call>")
    assert hf("x<call>y", add_special_tokens=False, split_special_tokens=True).input_ids[1] == call
    tok = HFTokenizer(hf)
    ids = tok.encode("x<call>y")
    assert call in tok.control_ids and call not in ids
    assert tok.decode(ids) == "x<call>y"
    assert tok.encode("plain") == hf("plain", add_special_tokens=False).input_ids


def test_plain_text_that_still_maps_to_a_control_id_is_refused():
    hf = tiny_tokenizer()
    hf.add_tokens(["q"])                      # one character: no cut can break it up
    with pytest.raises(ModelError, match="control token 'q'"):
        HFTokenizer(hf).encode("a q")


def test_slow_tokenizer_splits_special_strings_too():
    tok = HFTokenizer(slow_tokenizer(LLAMA2_TEMPLATE))
    ids = tok.encode("hi</s><s>")
    assert tok.control_ids.isdisjoint(ids) and tok.decode(ids) == "hi</s><s>"
    assert tok.role_affix_ids("user")[0][0] == 1                  # the template's <s>
    assert tok.encode("hi") == tok.tokenizer("hi", add_special_tokens=False).input_ids


def test_split_flag_left_on_the_backend_does_not_leak_into_affixes():
    tok = HFTokenizer(tiny_tokenizer(LLAMA2_TEMPLATE))
    assert tok.role_affixes("user")[0] == "<s>[INST] "
    tok.encode("</s>")                        # leaves the backend's split flag set
    assert tok.role_affix_ids("user")[0][0] == 1                  # <s>, not "<", "s", ">"


def test_placeholder_is_a_space_else_pad_then_unk_then_eos():
    tok = HFTokenizer(tiny_tokenizer(pad=True))
    assert tok.placeholder_id == tok.encode(" ")[0] == 4          # a plain token, not <pad>
    # without a one-token space (" " is <unk> here, a control token, or nothing at all)
    assert HFTokenizer(tiny_tokenizer(pad=True, space=False)).placeholder_id == 3
    assert HFTokenizer(tiny_tokenizer(pad=False, space=False)).placeholder_id == 0
    assert HFTokenizer(tiny_tokenizer(pad=False, unk=False, space=False)).placeholder_id == 2


def test_max_positions_from_argument_then_sane_model_max_length():
    assert HFTokenizer(tiny_tokenizer()).max_positions is None          # ~1e30 is "unknown"
    assert HFTokenizer(tiny_tokenizer(model_max_length=512)).max_positions == 512
    assert HFTokenizer(tiny_tokenizer(model_max_length=512), max_positions=64).max_positions == 64


def test_from_pretrained_reads_config_and_generation_config(tmp_path):
    from transformers import GenerationConfig, GPT2Config

    tiny_tokenizer(LLAMA2_TEMPLATE).save_pretrained(tmp_path)
    GPT2Config(n_positions=96, n_layer=1, n_head=1, n_embd=8).save_pretrained(tmp_path)
    GenerationConfig(eos_token_id=[2, 5]).save_pretrained(tmp_path)
    tok = HFTokenizer.from_pretrained(tmp_path)
    assert tok.max_positions == 96
    assert tok.eos_ids == (2, 5)
    assert tok.role_affixes("user") == ("<s>[INST] ", " [/INST]")
    assert load_tokenizer(tmp_path).fingerprint == tok.fingerprint


def test_from_pretrained_of_a_missing_model_says_not_found_locally(tmp_path):
    with pytest.raises(ModelError, match="not found locally"):
        HFTokenizer.from_pretrained(tmp_path / "no-such-model")
    with pytest.raises(ModelError, match="not found locally"):
        load_tokenizer("nobody/no-such-model-anywhere")


def test_a_twin_tokenizes_alike_and_takes_prepared_ids(default_tokenizer):
    from promptlang.tokenizer import PreparedIds

    twin = default_tokenizer.twin()
    assert twin.tokenizer is not default_tokenizer.tokenizer        # a backend of its own
    assert twin.fingerprint == default_tokenizer.fingerprint
    text = "Tides <|im_start|> rise and fall. " * 200                # 6,800 characters
    assert twin.encode(text) == default_tokenizer.encode(text)
    twin.prepared = PreparedIds()
    twin.prepared.put(text, [5, 6, 7])                              # not its real ids:
    assert twin.encode(text) == [5, 6, 7]                           # taken, not tokenized
    assert twin.encode(text) == [5, 6, 7]                           # until discarded
    twin.prepared.discard([text])
    assert twin.encode(text) == default_tokenizer.encode(text)
    short = "short text"
    twin.prepared.put(short, [1])                                   # below MIN_CHARS: not kept
    assert twin.encode(short) == default_tokenizer.encode(short)


def test_prepared_ids_keep_the_newest_long_texts():
    from promptlang.tokenizer import PreparedIds

    prepared = PreparedIds()
    texts = [f"{i:05d}" + "x" * PreparedIds.MIN_CHARS for i in range(PreparedIds.LIMIT + 2)]
    for i, text in enumerate(texts):
        prepared.put(text, [i, i + 1])
    assert len(prepared) == PreparedIds.LIMIT
    assert prepared.get(texts[0]) is None and prepared.get(texts[1]) is None
    assert prepared.get(texts[-1]) == [len(texts) - 1, len(texts)]


@pytest.mark.parametrize("kind", ["Qwen2Tokenizer", "GPT2Tokenizer"])
def test_a_bpe_tokenizer_keeps_no_python_copy_of_its_vocabulary(tmp_path, kind):
    """transformers' Qwen2/GPT-2 tokenizer classes keep the vocabulary and merges they built
    their backend from (tens of MB for a large vocabulary): let go, the tokenizer encodes,
    decodes and fingerprints as the class loaded plainly does."""
    import json

    import transformers

    from promptlang import default_model

    definition = json.loads((default_model.default_tokenizer_dir() / "tokenizer.json")
                            .read_text(encoding="utf-8"))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
              for m in definition["model"]["merges"]]
    built = getattr(transformers, kind)(vocab=definition["model"]["vocab"], merges=merges)
    built.save_pretrained(tmp_path)
    plain = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert type(plain).__name__ == kind and len(plain._vocab) == 49152 and plain._merges
    ours = HFTokenizer.from_pretrained(tmp_path)
    assert type(ours.tokenizer).__name__ == kind
    assert "_vocab" not in vars(ours.tokenizer) and "_merges" not in vars(ours.tokenizer)
    text = "Tokenizers split text: naïve café, 12345, and   spaces.\nA new line."
    ids = plain(text, add_special_tokens=False).input_ids
    assert ours.encode(text) == ids
    assert ours.decode(ids) == plain.decode(ids)
    assert ours.fingerprint == HFTokenizer(plain).fingerprint
