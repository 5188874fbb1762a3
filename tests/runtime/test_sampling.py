"""Decoding policy: sampling, stop conditions, streaming text, sequence scoring."""

import math
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from promptlang.errors import PromptLangError
from promptlang.runtime.sampling import (Decoding, IncrementalDetokenizer, Sampler,
                                         SamplingParams, StopChecker, options_to_params,
                                         sequence_logprob)
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


# ---------------------------------------------------------------- SamplingParams


def test_params_defaults_are_greedy_and_unbounded_by_stops():
    params = SamplingParams()
    assert (params.max_new_tokens, params.temperature, params.top_p, params.top_k) == (256, 0.0, 1.0, 0)
    assert params.seed is None and params.stop == () and params.stop_token_ids == ()
    assert params.greedy and params.draft == 0


def test_params_normalise_lists_and_a_single_stop_string():
    params = SamplingParams(stop="\n", stop_token_ids=[5, 7])
    assert params.stop == ("\n",) and params.stop_token_ids == (5, 7)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    with pytest.raises(AttributeError):
        params.temperature = 1.0  # frozen


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=2.5), "max_new_tokens"),
    (dict(max_new_tokens=True), "max_new_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(temperature="hot"), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(top_k=1.0), "top_k"),
    (dict(seed=-3), "seed"),
    (dict(seed=2**64), "seed"),
    (dict(seed="42"), "seed"),
    (dict(stop=("ok", "")), "stop"),
    (dict(stop=("ok", 3)), "stop"),
    (dict(stop=42), "stop"),
    (dict(stop_token_ids=(-1,)), "stop_token_ids"),
    (dict(stop_token_ids=("x",)), "stop_token_ids"),
    (dict(stop_token_ids=7), "stop_token_ids"),
    (dict(draft=-1), "draft"),
    (dict(draft=2.0), "draft"),
])
def test_params_reject_bad_values_naming_the_field(kwargs, field):
    with pytest.raises(PromptLangError, match=field):
        SamplingParams(**kwargs)


def test_options_apply_on_top_of_a_params_object_and_unknown_names_are_type_errors():
    base = SamplingParams(max_new_tokens=8, stop="\n")
    assert options_to_params(base) is base
    assert options_to_params(base, temperature=0.5) == SamplingParams(8, 0.5, stop="\n")
    assert options_to_params(top_k=3) == SamplingParams(top_k=3)
    with pytest.raises(TypeError):
        options_to_params(base, temprature=0.5)
    with pytest.raises(PromptLangError, match="top_p"):
        options_to_params(base, top_p=0.0)             # validated again after the change


# ---------------------------------------------------------------- Sampler


def test_greedy_picks_argmax_and_the_lowest_id_on_ties():
    sampler = Sampler(SamplingParams())
    assert sampler.pick(torch.tensor([0.1, 2.0, -1.0, 1.9])) == 1
    assert sampler.pick(torch.tensor([0.0, 3.0, 1.0, 3.0, 3.0])) == 1
    assert sampler.pick(torch.tensor([1.0, 5.0, 5.0], dtype=torch.bfloat16)) == 1


def test_same_seed_replays_and_different_seeds_differ():
    logits = torch.zeros(50)
    draws = lambda seed: [s.pick(logits) for s in [Sampler(SamplingParams(temperature=1.0, seed=seed))]
                          for _ in range(200)]
    assert draws(7) == draws(7)
    assert draws(7) != draws(8)
    assert len(set(draws(7))) > 25  # really sampling, not stuck on one token


def test_unseeded_samplers_draw_fresh_seeds():
    a, b = Sampler(SamplingParams(temperature=1.0)), Sampler(SamplingParams(temperature=1.0))
    assert a.seed != b.seed
    logits = torch.zeros(50)
    assert [a.pick(logits) for _ in range(100)] != [b.pick(logits) for _ in range(100)]


def test_top_k_1_equals_greedy():
    gen = torch.Generator().manual_seed(0)
    greedy = Sampler(SamplingParams())
    for seed in range(20):
        logits = torch.randn(64, generator=gen)
        logits[seed + 3] = logits[seed + 10] = logits.max() + 1  # a tie at the top
        sampler = Sampler(SamplingParams(temperature=5.0, top_k=1, seed=seed))
        assert sampler.pick(logits) == greedy.pick(logits) == seed + 3


def test_tiny_top_p_equals_greedy():
    gen = torch.Generator().manual_seed(1)
    greedy = Sampler(SamplingParams())
    for seed in range(20):
        logits = torch.randn(64, generator=gen)
        sampler = Sampler(SamplingParams(temperature=3.0, top_p=1e-6, seed=seed))
        assert sampler.pick(logits) == greedy.pick(logits)


def test_temperature_sampling_matches_the_softmax_distribution():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    n = 6000
    for temperature in (1.0, 2.0, 0.5):
        sampler = Sampler(SamplingParams(temperature=temperature, seed=1234))
        counts = Counter(sampler.pick(probs.log()) for _ in range(n))
        expected = probs ** (1 / temperature)
        expected = expected / expected.sum()
        for token in range(4):
            assert abs(counts[token] / n - float(expected[token])) < 0.03, (temperature, counts)


def test_top_k_keeps_only_the_k_best_tokens():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.9, 2.8, -1.0])
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=3, seed=3))
    counts = Counter(sampler.pick(logits) for _ in range(2000))
    assert set(counts) == {1, 3, 4}


def test_top_p_keeps_the_smallest_set_reaching_the_mass_renormalised():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    sampler = Sampler(SamplingParams(temperature=1.0, top_p=0.75, seed=5))
    n = 4000
    counts = Counter(sampler.pick(probs.log()) for _ in range(n))
    assert set(counts) == {1, 3}  # 0.5 alone < 0.75; 0.5 + 0.3 >= 0.75
    assert abs(counts[1] / n - 0.5 / 0.8) < 0.04


def test_top_p_applies_after_top_k():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    # top_k=2 renormalises to [4/7, 3/7]; top_p=0.5 then keeps only token 0.
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=2, top_p=0.5, seed=0))
    assert {sampler.pick(probs.log()) for _ in range(300)} == {0}


def test_sampling_never_picks_masked_tokens_and_survives_tiny_temperatures():
    logits = torch.full((10,), -math.inf)
    logits[[2, 7]] = torch.tensor([1.0, 1.0])
    sampler = Sampler(SamplingParams(temperature=1.0, seed=0))
    assert {sampler.pick(logits) for _ in range(200)} == {2, 7}
    infinite = torch.tensor([0.0, math.inf, 1.0, math.inf])
    assert {sampler.pick(infinite) for _ in range(100)} == {1, 3}
    cold = Sampler(SamplingParams(temperature=1e-30, seed=0))
    assert cold.pick(torch.tensor([0.0, 1.0, 0.5])) == 1


@pytest.mark.parametrize("logits", [torch.zeros(2, 5), torch.zeros(0),
                                    torch.tensor([0.0, float("nan")]),
                                    torch.full((3,), -math.inf)])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sampler_rejects_unusable_logits(logits, temperature):
    with pytest.raises(PromptLangError):
        Sampler(SamplingParams(temperature=temperature)).pick(logits)


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
