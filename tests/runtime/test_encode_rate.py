"""runtime/model/encode_rate.py: the encode time model, measured once and kept privately."""

from __future__ import annotations

import os

import pytest

from promptlang.runtime.model import encode_rate
from promptlang.runtime.model.schemes import adapt
from tests.runtime.tiny import tiny_llama


def test_fit_recovers_a_quadratic():
    timings = {n: 0.01 + 2e-4 * n + 3e-8 * n * n for n in encode_rate.SIZES}
    c0, c1, c2 = encode_rate._fit(timings)
    assert c0 == pytest.approx(0.01, rel=1e-6)
    assert c1 == pytest.approx(2e-4, rel=1e-6)
    assert c2 == pytest.approx(3e-8, rel=1e-6)


def test_fit_never_goes_negative():
    timings = {16: 0.5, 48: 0.1, 128: 0.2, 384: 0.5, 1024: 1.2, 2048: 2.0}   # a noisy start
    coefficients = encode_rate._fit(timings)
    assert all(c >= 0 for c in coefficients)
    rate = encode_rate.EncodeRate(*coefficients, measured="", cached=False)
    assert all(rate.seconds(n) > 0 for n in timings)


def test_rate_is_measured_once_and_kept_private(tmp_path, monkeypatch):
    monkeypatch.setenv("PROMPTLANG_HOME", str(tmp_path))
    monkeypatch.setattr(encode_rate, "SIZES", (8, 16, 32))
    adapter = adapt(tiny_llama(0, 128, max_positions=256))
    said = []
    first = encode_rate.encode_rate(adapter, progress=said.append)
    assert not first.cached and said and first.seconds(100) > 0
    path = encode_rate.rate_file(adapter.fingerprint)
    assert path.exists() and (path.stat().st_mode & 0o777) == 0o600
    second = encode_rate.encode_rate(adapter, progress=said.append)
    assert second.cached and (second.c0, second.c1, second.c2) == (first.c0, first.c1, first.c2)
    assert len(said) == 1
    os.chmod(path, 0o666)                          # not the user's private file: ignored
    assert not encode_rate.encode_rate(adapter).cached
    path.write_text("not json")
    assert not encode_rate.encode_rate(adapter).cached
