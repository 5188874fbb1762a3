"""Decoding policy: stop conditions, streaming text, sequence scoring (the sampler:
test_sampler.py)."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from promptlang.errors import PromptLangError
from promptlang.runtime.decoding.sampling import (Decoding, IncrementalDetokenizer,
                                                  SamplingParams, StopChecker, sequence_logprob)
from promptlang.tokenizer import Tokenizer, WordTokenizer

tokenizers = pytest.importorskip("tokenizers")

EOS_TEXT = "<|endoftext|>"
CORPUS = ["café au lait 😀 END of story", "the end. café! naïve résumé 😀😀 STOP here",
          "Ünïcödé façade — déjà vu 🎉 and plain ascii words", "stop STOP Stop END end"]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which byte-level BPE vocabularies use."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


class ByteBPE:
    """A byte-level BPE trained in-process (no hub), behind the Tokenizer protocol."""

    def __init__(self):
        from tokenizers import decoders, models, pre_tokenizers, trainers
        tok = tokenizers.Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=[EOS_TEXT],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False)
        tok.train_from_iterator(CORPUS * 4, trainer)
        tok.encode_special_tokens = True          # plain text: "<|endoftext|>" is split
        self._tok = tok
        self.vocab_size = tok.get_vocab_size()
        self._eos = tok.token_to_id(EOS_TEXT)
        byte_char = _bytes_to_unicode()
        self.byte_ids = [tok.token_to_id(byte_char[b]) for b in range(256)]
        # byte-level vocabulary: one character per byte, so an entry's length bounds
        # the characters of text it covers
        self.max_token_chars = max(len(entry) for entry in tok.get_vocab())

    fingerprint = "test-byte-bpe"
    max_positions = None
    placeholder_id = 0
    prefix_ids = ()

    @property
    def eos_ids(self):
        return (self._eos,)

    def encode(self, text):
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_bytes(self, text):
        """One token per UTF-8 byte: multi-byte characters split across tokens."""
        return [self.byte_ids[b] for b in text.encode()]

    def decode(self, ids):
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def role_affixes(self, role):
        return f"[{role}]", f"[/{role}]"

    @property
    def control_ids(self):
        return frozenset((self._eos,))

    def role_affix_ids(self, role):
        return tuple(tuple(self.encode(text)) for text in self.role_affixes(role))


@pytest.fixture(scope="module")
def bpe() -> ByteBPE:
    return ByteBPE()


_BPE = None


def _bpe() -> ByteBPE:  # hypothesis tests cannot take function-scoped fixtures
    global _BPE
    if _BPE is None:
        _BPE = ByteBPE()
    return _BPE


def forced(token: int, vocab: int) -> torch.Tensor:
    """Logits under which greedy decoding picks `token`."""
    logits = torch.zeros(vocab)
    logits[token] = 5.0
    return logits


def run_script(params: SamplingParams, tokenizer, ids: list[int], vocab: int):
    """Greedy-decode `ids` through a Decoding; returns (deltas, emitted-so-far per step, result)."""
    decoding = Decoding(params, tokenizer)
    deltas, emitted = [], []
    for token in ids:
        picked, delta, finished = decoding.step(forced(token, vocab))
        assert picked == token
        deltas.append(delta)
        emitted.append("".join(deltas))
        if finished:
            break
    else:  # the script ran out first: end the way a full context would
        deltas.append(decoding.finish("length"))
        emitted.append("".join(deltas))
    return deltas, emitted, decoding.result()


# ---------------------------------------------------------------- StopChecker


def test_stop_checker_reasons_and_cuts():
    checker = StopChecker(stop_strings=("END",), eos_ids=(2,), stop_token_ids=(9,))
    assert checker.update(5, "abc E") is None
    stop = checker.update(6, "abc EN")
    assert stop is None
    stop = checker.update(7, "abc ENDING")
    assert (stop.reason, stop.end, stop.trigger) == ("stop", 4, "END")

    eos = StopChecker(eos_ids=(2,))
    assert eos.update(5, "hello") is None
    stop = eos.update(2, "hello<eos>")
    assert (stop.reason, stop.end) == ("eos", 5)

    token = StopChecker(stop_token_ids=(9,), max_new_tokens=2)
    assert token.update(5, "x") is None
    stop = token.update(9, "x;")
    assert (stop.reason, stop.end, stop.trigger) == ("stop", 1, 9)  # stop token beats length

    length = StopChecker(stop_strings=("zz",), max_new_tokens=2)
    assert length.update(5, "a") is None
    assert length.update(6, "abz") == type(stop)("length", 3)


def test_stop_checker_reports_the_earliest_of_several_stop_strings():
    checker = StopChecker(stop_strings=("world", "lo w"))
    stop = checker.update(1, "hello world")
    assert (stop.end, stop.trigger) == (3, "lo w")


def test_stop_checker_holdback_is_the_longest_suffix_starting_a_stop_string():
    checker = StopChecker(stop_strings=("</answer>", "\n\n"))
    assert checker.holdback("text </ans") == 5
    assert checker.holdback("text\n") == 1
    assert checker.holdback("text <") == 1
    assert checker.holdback("text") == 0
    assert StopChecker().holdback("anything") == 0


# ---------------------------------------------------------------- IncrementalDetokenizer


def test_detokenizer_never_emits_half_a_character(bpe):
    ids = bpe.encode("café ") + bpe.encode_bytes("😀é") + bpe.encode(" ok")
    detok = IncrementalDetokenizer(bpe)
    deltas = [detok.push(t) for t in ids]
    deltas.append(detok.finish())
    assert "".join(deltas) == bpe.decode(ids) == "café 😀é ok"
    assert all("\ufffd" not in d for d in deltas)
    emoji_bytes = deltas[len(bpe.encode("café ")):][:4]
    assert emoji_bytes == ["", "", "", "😀"]


def test_detokenizer_finish_flushes_a_trailing_partial_character(bpe):
    ids = bpe.encode("ab") + bpe.encode_bytes("é")[:1]
    detok = IncrementalDetokenizer(bpe)
    streamed = "".join(detok.push(t) for t in ids)
    assert streamed == "ab"
    assert streamed + detok.finish() == bpe.decode(ids) == "ab\ufffd"


# ---------------------------------------------------------------- Decoding


def test_word_tokenizer_stop_string_across_tokens_is_cut_and_never_streamed():
    tok = WordTokenizer()
    ids = tok.encode("The quick brown fox jumps over the lazy dog today")
    deltas, emitted, (text, token_ids, reason) = run_script(
        SamplingParams(stop=("lazy dog",)), tok, ids, tok.vocab_size)
    assert (text, reason) == ("The quick brown fox jumps over the ", "stop")
    assert token_ids == ids[:9]  # the token completing the stop string is reported
    assert "".join(deltas) == text
    assert "lazy" not in "".join(deltas)


def test_word_tokenizer_held_back_prefix_is_released_when_no_stop_follows():
    tok = WordTokenizer()
    ids = tok.encode("over the lazy cat")
    deltas, emitted, result = run_script(SamplingParams(stop=("lazy dog",)), tok, ids,
                                         tok.vocab_size)
    assert deltas[2] == " " and deltas[3] == "lazy cat"  # "lazy" waited for the next token
    assert result == ("over the lazy cat", ids, "length")


def test_eos_ends_without_its_text_and_stop_token_likewise():
    tok = WordTokenizer()
    ids = tok.encode("one two") + [2] + tok.encode(" three")
    deltas, _, result = run_script(SamplingParams(), tok, ids, tok.vocab_size)
    assert result == ("one two", ids[:3], "eos")
    assert "".join(deltas) == "one two"

    stop_id = tok.encode(" two")[0]
    _, _, result = run_script(SamplingParams(stop_token_ids=(stop_id,)), tok, ids, tok.vocab_size)
    assert result == ("one", ids[:2], "stop")


def test_max_new_tokens_ends_with_length_keeping_a_held_back_prefix():
    tok = WordTokenizer()
    ids = tok.encode("a b c d e")
    deltas, emitted, result = run_script(SamplingParams(max_new_tokens=3, stop=(" c d",)), tok,
                                         ids, tok.vocab_size)
    assert result == ("a b c", ids[:3], "length")
    assert emitted == ["a", "a b", "a b c"]


def test_decoding_lifecycle_errors_and_early_finish():
    tok = WordTokenizer()
    ids = tok.encode("x y")
    decoding = Decoding(SamplingParams(stop=(" y z",)), tok)
    with pytest.raises(PromptLangError):
        decoding.result()
    decoding.step(forced(ids[0], tok.vocab_size))
    assert decoding.step(forced(ids[1], tok.vocab_size))[1] == ""  # " y" may start " y z"
    assert decoding.finish("length") == " y"
    assert decoding.result() == ("x y", ids, "length")
    with pytest.raises(PromptLangError):
        decoding.step(forced(ids[0], tok.vocab_size))
    with pytest.raises(PromptLangError):
        decoding.finish()


def test_bpe_stop_string_split_inside_a_multibyte_character(bpe):
    # The emoji's 4 bytes arrive as 4 tokens; the stop string is "é 😀".
    ids = bpe.encode("café") + bpe.encode(" ") + bpe.encode_bytes("😀") + bpe.encode(" END")
    deltas, emitted, (text, token_ids, reason) = run_script(
        SamplingParams(stop=("é 😀",)), bpe, ids, bpe.vocab_size)
    assert (text, reason) == ("caf", "stop")
    assert token_ids == ids[:len(ids) - len(bpe.encode(" END"))]
    assert "".join(deltas) == "caf"
    assert all("\ufffd" not in d for d in deltas)


def test_bpe_eos_text_is_left_out(bpe):
    ids = bpe.encode("naïve") + [bpe.eos_ids[0]]
    deltas, _, result = run_script(SamplingParams(), bpe, ids, bpe.vocab_size)
    assert result == ("naïve", ids, "eos")
    assert EOS_TEXT not in "".join(deltas)


def test_decoding_with_temperature_is_reproducible_per_seed(bpe):
    logits = torch.zeros(bpe.vocab_size)

    def generate(seed):
        decoding = Decoding(SamplingParams(temperature=1.0, seed=seed, max_new_tokens=30), bpe)
        deltas = []
        while not decoding.finished:
            deltas.append(decoding.step(logits)[1])
        text, ids, _ = decoding.result()
        assert "".join(deltas) == text
        return ids

    assert generate(11) == generate(11)
    assert generate(11) != generate(12)


# Pieces of a scripted generation: normal text, text split into byte tokens, eos, any id.
_FRAGMENTS = ["café", " au", " lait", " 😀", "😀", " END", "END", "é", " STOP", "\n", "\n\n",
              " déjà", " vu", "🎉", " end", ".", "!", "—"]
_STOPS = ["END", "😀", "é!", " vu\n", "\n\n", "STOP", "é", "🎉 e", "lait 😀"]
_piece = st.one_of(
    st.tuples(st.just("text"), st.sampled_from(_FRAGMENTS)),
    st.tuples(st.just("bytes"), st.sampled_from(_FRAGMENTS)),
    st.tuples(st.just("id"), st.integers(0, 319)),
)


@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(pieces=st.lists(_piece, min_size=1, max_size=12),
       stops=st.lists(st.sampled_from(_STOPS), max_size=3, unique=True),
       max_new_tokens=st.integers(1, 40))
def test_streaming_matches_an_independent_oracle(pieces, stops, max_new_tokens):
    bpe = _bpe()
    ids = []
    for kind, value in pieces:
        if kind == "text":
            ids += bpe.encode(value)
        elif kind == "bytes":
            ids += bpe.encode_bytes(value)
        else:
            ids.append(value % bpe.vocab_size)

    # Oracle: decode every prefix from scratch and apply the rules directly.
    expected = None
    for k in range(1, len(ids) + 1):
        if ids[k - 1] in bpe.eos_ids:
            expected = (bpe.decode(ids[:k - 1]), ids[:k], "eos")
            break
        full = bpe.decode(ids[:k])
        hits = [full.find(s) for s in stops if s in full]
        if hits:
            expected = (full[:min(hits)], ids[:k], "stop")
            break
        if k == max_new_tokens:
            expected = (full, ids[:k], "length")
            break

    params = SamplingParams(max_new_tokens=max_new_tokens, stop=tuple(stops))
    deltas, emitted, result = run_script(params, bpe, ids, bpe.vocab_size)
    if expected is None:  # the script ran out first; run_script then finished it
        expected = (bpe.decode(ids), ids, "length")
    assert tuple(result) == expected
    final = result.text
    assert "".join(deltas) == final
    for shown in emitted:
        assert final.startswith(shown)  # nothing streamed is ever taken back or cut
        assert not any(s in shown for s in stops)
    for k, shown in enumerate(emitted[:-1], start=1):
        # No partial character while streaming: the decode's trailing U+FFFD run waits.
        assert len(shown) <= len(bpe.decode(ids[:k]).rstrip("\ufffd"))


# ---------------------------------------------------------------- sequence_logprob


def test_sequence_logprob_sums_log_softmax_at_the_targets():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 11, generator=gen, dtype=torch.float64)
    targets = [3, 0, 10, 3, 7]
    expected = sum(math.log(float(torch.softmax(logits[t], -1)[y])) for t, y in enumerate(targets))
    assert sequence_logprob(logits, targets) == pytest.approx(expected, abs=1e-5)
    assert sequence_logprob(logits.half(), torch.tensor(targets)) == pytest.approx(expected, abs=0.05)
    assert sequence_logprob(logits[:0], []) == 0.0


@pytest.mark.parametrize("logits, targets", [
    (torch.zeros(3, 5), [1, 2]),
    (torch.zeros(5), [1]),
    (torch.zeros(2, 5), [1, 5]),
    (torch.zeros(2, 5), [-1, 0]),
])
def test_sequence_logprob_rejects_mismatched_inputs(logits, targets):
    with pytest.raises(PromptLangError):
        sequence_logprob(logits, targets)


def test_test_tokenizers_satisfy_the_protocol(bpe):
    assert isinstance(bpe, Tokenizer) and isinstance(WordTokenizer(), Tokenizer)
