"""bench serve's goals (bench/serve.py `goals`): the ratios take the better of the two
one-client runs as the baseline, so a slow first (or last) run cannot make a goal pass."""

from __future__ import annotations

import pytest

from promptlang.bench.serve import (Level, Sample, ServeOptions, ServeReport, goals,
                                    request_flops)
from promptlang.bench.shapes import ModelShape


def level(clients: int, wall: float, ttft: float, tokens: int = 10, n: int = 4,
          again: bool = False) -> Level:
    samples = [Sample(ttft, ttft + 0.5, tokens, "x") for _ in range(n)]
    return Level(clients, wall, samples, sent=n, identical=n, again=again)


def verdicts(levels) -> dict[str, tuple[bool | None, str]]:
    report = ServeReport(ServeOptions(), "m", levels)
    return {g.name: (g.passed, g.detail) for g in goals(report)}


def test_the_faster_one_client_run_is_the_baseline():
    many = level(16, 1.0, 0.15, n=64)                     # 640 tokens/s
    four = level(4, 1.0, 0.19)
    slow_first = level(1, 1.0, 0.10)                      # 40 tokens/s: 16x
    fast_again = level(1, 0.25, 0.09, again=True)         # 160 tokens/s: 4x
    got = verdicts([slow_first, four, many, fast_again])
    passed, detail = got["tokens/s at 16 clients >= 5x one client's"]
    assert passed is False and "640.0 vs 160.0" in detail
    passed, detail = got["TTFT p50 at 4 clients <= 2x one client's"]
    assert passed is False and "190.0 vs 90.0" in detail   # 2.11x against the faster run
    got = verdicts([level(1, 0.25, 0.10), four, many])
    assert got["tokens/s at 16 clients >= 5x one client's"][0] is False
    assert got["TTFT p50 at 4 clients <= 2x one client's"][0] is True


SHAPE = ModelShape("t", layers=2, hidden=4, heads=2, kv_heads=1, head_dim=2, intermediate=8,
                   vocab=10)


def flops_row_by_row(shape: ModelShape, prompt: int, cached: int, completion: int) -> int:
    """request_flops written out a row at a time: each row through the matmuls and over
    the keys at positions up to its own, one head row per generated token."""
    per_key = 4 * shape.layers * shape.heads * shape.head_dim
    matmuls = 2 * shape.layers * shape.linear_params_per_layer()
    total = 2 * shape.vocab * shape.hidden * completion
    for position in range(cached, prompt + completion - 1):   # the last token is not fed
        total += matmuls + per_key * (position + 1)
    return total


def test_request_flops_counts_each_row_its_matmuls_and_keys():
    assert SHAPE.linear_params_per_layer() == 144
    # prefill rows see 4 and 5 keys, decode rows 6 and 7: 22 keys; 4 rows; 3 head rows
    assert request_flops(SHAPE, 5, 3, 3) == 2 * 2 * 144 * 4 + 4 * 2 * 2 * 2 * 22 + 2 * 10 * 4 * 3
    for prompt, cached, completion in ((1, 0, 1), (40, 0, 7), (1300, 1280, 14), (50, 31, 1)):
        assert request_flops(SHAPE, prompt, cached, completion) == \
            flops_row_by_row(SHAPE, prompt, cached, completion)


def test_the_throughput_goal_prints_the_arithmetic_ceiling_when_measured():
    def counted(clients, wall, n):
        samples = [Sample(0.1, 0.5, 10, "x", prompt_tokens=50, cached_tokens=30)
                   for _ in range(n)]
        return Level(clients, wall, samples, sent=n, identical=n)

    levels = [counted(1, 1.0, 4), level(4, 1.0, 0.15), counted(16, 1.0, 64)]
    rate = 1e6
    report = ServeReport(ServeOptions(), "m", levels, shape=SHAPE, sgemm_flops_per_s=rate)
    ceiling = rate * 10 / request_flops(SHAPE, 50, 30, 10)
    assert levels[2].ceiling(SHAPE, rate) == pytest.approx(ceiling)
    detail = {g.name: g.detail for g in goals(report)}["tokens/s at 16 clients >= 5x one "
                                                        "client's"]
    assert f"at most {ceiling:.0f} tokens/s = {ceiling / 40:.2f}x" in detail
    assert "(0 GFLOP/s)" in detail        # 1e6 FLOP/s, printed in GFLOP/s
    # no usage reported (another server), or no rate measured: no ceiling
    assert level(16, 1.0, 0.1).ceiling(SHAPE, rate) is None
    bare = ServeReport(ServeOptions(), "m", levels)
    assert "at most" not in {g.name: g.detail for g in goals(bare)}[
        "tokens/s at 16 clients >= 5x one client's"]


def test_every_request_a_level_sends_is_new_and_its_plain_form_asks_the_same():
    """bench serve sends no request twice (each question numbered), so no level is served
    from prompt tails of whole requests seen before (runtime/kv/tails.py), yet the requests
    cycle over the same documents and questions."""
    from promptlang.bench.serve import _workload
    from promptlang.hf_tokenizer import load_tokenizer

    class Schemas:
        tokenizer = load_tokenizer()
        added: list = []

        def add_schema(self, schema):
            self.added.append(schema)

    llm = Schemas()
    options = ServeOptions.quick()
    levels = _workload(llm, options, [2, 4, 2])
    assert len(llm.added) == 1 and [len(b) for b, _ in levels] == [2, 4, 2]
    assert all(len(b) == len(p) for b, p in levels)
    texts = [repr(body) for bodies, _ in levels for body in bodies]
    assert len(set(texts)) == len(texts) == 8
    for n, text in enumerate(texts):
        assert f"Request {n + 1}: " in text
    plain = [repr(body) for _, bodies in levels for body in bodies]
    assert all(f"Request {n + 1}: " in text for n, text in enumerate(plain))
    # request n is distinct request n % distinct: the same documents, another number
    first, again = levels[0][0][0], levels[1][0][1]          # requests 1 and 4 (distinct 3)
    assert first["extra_body"]["promptlang"]["pml"].replace("Request 1:", "Request 4:") \
        == again["extra_body"]["promptlang"]["pml"]
