"""Report helpers: tables, raw-number files, the TTFT plot, power-law fits, per-sample ratios
and their spread, progress."""

import csv
import io
import json
import math

import pytest

from promptlang.bench.report import (Progress, Spread, fit_exponent, format_table,
                                     plot_ttft, ratios, write_csv, write_json)
from tests.extras import needs_plots


def test_fit_exponent_recovers_power_laws():
    xs = [100, 400, 1600, 6400]
    for k, c in ((1.0, 2e-4), (2.0, 3e-9), (0.5, 7.0)):
        fitted_k, fitted_c = fit_exponent(xs, [c * x**k for x in xs])
        assert fitted_k == pytest.approx(k)
        assert fitted_c == pytest.approx(c)


def test_fit_exponent_of_noisy_quadratic_is_near_two():
    xs = [256, 512, 1024, 2048, 4096]
    noise = [1.05, 0.97, 1.02, 0.99, 1.01]
    k, _ = fit_exponent(xs, [x * x * e for x, e in zip(xs, noise)])
    assert abs(k - 2) < 0.05


@pytest.mark.parametrize("xs, ys", [([1], [1]), ([1, 2], [1]), ([1, 0], [1, 2]),
                                    ([1, 2], [-1, 2]), ([3, 3], [1, 2])])
def test_fit_exponent_rejects_data_it_cannot_fit(xs, ys):
    with pytest.raises(ValueError):
        fit_exponent(xs, ys)


def test_format_table_aligns_numbers_right_and_text_left():
    table = format_table([{"model": "tiny", "bytes": 46080, "ratio": 0.5, "paper": None},
                          {"model": "much-larger", "bytes": 7, "ratio": 12.25, "paper": None}])
    lines = table.splitlines()
    assert lines[0].split() == ["model", "bytes", "ratio", "paper"]
    assert set(lines[1].replace(" ", "")) == {"-"}
    assert lines[2].startswith("tiny ")
    assert "46,080" in lines[2] and "n/a" in lines[2]
    assert len({len(line) for line in lines}) == 1          # right-aligned last column
    bytes_end = lines[0].index("bytes") + len("bytes")
    assert lines[2][:bytes_end].endswith("46,080") and lines[3][:bytes_end].endswith("7")


def test_format_table_of_nothing_is_empty():
    assert format_table([]) == ""


def test_csv_and_json_hold_the_raw_numbers(tmp_path):
    rows = [{"length": 128, "ttft": 0.25}, {"length": 256, "ttft": 0.5, "note": "warm"}]
    with open(write_csv(tmp_path / "out" / "ttft.csv", rows), newline="") as f:
        back = list(csv.DictReader(f))
    assert back == [{"length": "128", "ttft": "0.25", "note": ""},
                    {"length": "256", "ttft": "0.5", "note": "warm"}]
    path = write_json(tmp_path / "ttft.json", {"rows": rows, "seconds": math.pi})
    assert json.loads(path.read_text()) == {"rows": rows, "seconds": math.pi}


@needs_plots
def test_plot_ttft_writes_a_png(tmp_path):
    path = plot_ttft(tmp_path / "plots" / "ttft.png",
                     {"baseline": ([512, 1024, 2048], [1.0, 2.5, 7.0]),
                      "cached": ([512, 1024, 2048], [0.05, 0.06, 0.08])})
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_progress_left_on_its_stream_shows_the_final_count():
    stream = io.StringIO()
    with Progress(range(3), desc="items", leave=True, file=stream) as bar:
        assert list(bar) == [0, 1, 2]
    assert "items" in stream.getvalue() and "3/3" in stream.getvalue()


def test_disabled_progress_writes_nothing_but_still_iterates():
    stream = io.StringIO()
    with Progress(range(2), desc="quiet", enabled=False, file=stream) as bar:
        assert list(bar) == [0, 1]
    assert stream.getvalue() == ""


def test_ratios_are_taken_per_sample_not_of_summaries():
    # the ratio of medians would be 2 / 2 = 1; the per-sample ratios are 4, 1 and 0.25
    assert ratios([4.0, 2.0, 1.0], [1.0, 2.0, 4.0]) == [4.0, 1.0, 0.25]


@pytest.mark.parametrize("numerators, denominators", [([1.0, 2.0], [1.0]), ([1.0], [0.0])])
def test_ratios_refuse_unpaired_or_zero_samples(numerators, denominators):
    with pytest.raises(ValueError):
        ratios(numerators, denominators)


def test_spread_gives_median_min_max_quartiles_and_count():
    s = Spread.of([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (s.median, s.low, s.high, s.q1, s.q3, s.n) == (3.0, 1.0, 5.0, 2.0, 4.0, 5)
    even = Spread.of([1.0, 2.0, 3.0, 10.0])
    assert even.median == 2.5 and even.low <= even.q1 <= even.median <= even.q3 <= even.high
    one = Spread.of([7.0])
    assert (one.median, one.low, one.high, one.q1, one.q3, one.n) == (7.0, 7.0, 7.0, 7.0, 7.0, 1)
    with pytest.raises(ValueError):
        Spread.of([])


def test_spread_describes_itself_with_its_spread_and_count():
    text = Spread.of([1.2, 1.5, 1.9]).describe(unit="x")
    assert text == "1.50x (min-max 1.20x-1.90x, IQR 1.35x-1.70x, n=3)"
