"""Sampling options and the sampler: SamplingParams' checks, greedy, seeds, temperature,
top-k and top-p. Stop conditions, streaming text and scoring: test_sampling.py."""

import math
from collections import Counter

import pytest
import torch

from promptlang.errors import PromptLangError
from promptlang.runtime.decoding.sampling import Sampler, SamplingParams, options_to_params

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


def test_a_temperature_below_float32s_range_samples_the_most_likely_token():
    """A temperature of 1e-300 once became 0 in float32 (0 / 0: NaN): a RuntimeError from
    torch.multinomial, a 500 in the server (found by tests/server/test_fuzz.py)."""
    logits = torch.tensor([0.1, 2.0, -1.0, 1.5])
    for temperature in (1e-300, 5e-324, 1e-46):
        for top_p in (1.0, 0.5):
            sampler = Sampler(SamplingParams(temperature=temperature, top_p=top_p, seed=3))
            assert sampler.pick(logits) == 1
