"""bench serve's goals (bench/serve.py `goals`): the ratios take the better of the two
one-client runs as the baseline, so a slow first (or last) run cannot make a goal pass."""

from __future__ import annotations

from promptlang.bench.serve import Level, Sample, ServeOptions, ServeReport, goals


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
