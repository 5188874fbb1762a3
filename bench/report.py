"""Reporting helpers for the benchmarks: tables, raw numbers, plots, fits, goals, per-sample
ratios and their spread, progress."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence, TextIO

from tqdm import tqdm

from promptlang.errors import InvalidArgumentError


def _cell(value: Any, float_format: str) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return float_format.format(value)
    return str(value)


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None,
                 float_format: str = "{:.3g}") -> str:
    """A plain-text table: a header, a rule, one line per row. Numbers are right-aligned
    (ints with thousands separators), text left-aligned, None printed as "n/a".
    `columns` defaults to the first row's keys."""
    if not rows:
        return ""
    columns = list(columns or rows[0].keys())
    cells = [[_cell(row.get(c), float_format) for c in columns] for row in rows]
    numeric = [all(isinstance(row.get(c), (int, float)) or row.get(c) is None for row in rows)
               for c in columns]
    widths = [max(len(c), *(len(line[i]) for line in cells)) for i, c in enumerate(columns)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w)
                         for v, w, num in zip(values, widths, numeric)).rstrip()

    return "\n".join([line(columns), line(["-" * w for w in widths])] +
                     [line(values) for values in cells])


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None,
                   float_format: str = "{:.3g}") -> str:
    """The same cells as `format_table`, as a GitHub-flavoured Markdown table
    (numeric columns right-aligned)."""
    if not rows:
        return ""
    columns = list(columns or rows[0].keys())
    numeric = [all(isinstance(row.get(c), (int, float)) or row.get(c) is None for row in rows)
               for c in columns]

    def escape(text: str) -> str:
        return text.replace("|", "\\|")

    lines = ["| " + " | ".join(escape(c) for c in columns) + " |",
             "|" + "|".join("---:" if num else ":---" for num in numeric) + "|"]
    lines += ["| " + " | ".join(escape(_cell(row.get(c), float_format)) for c in columns) + " |"
              for row in rows]
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Goal:
    """A target the benchmarks check and print, met or not: `PASS  name: detail`."""

    name: str
    passed: bool | None      # None: could not be measured in this run (detail says why)
    detail: str

    @property
    def verdict(self) -> str:
        return {True: "PASS", False: "FAIL", None: "N/A"}[self.passed]

    def __str__(self) -> str:
        return f"{self.verdict}  {self.name}: {self.detail}"


def ratios(numerators: Sequence[float], denominators: Sequence[float]) -> list[float]:
    """Per-sample ratios numerators[i] / denominators[i] of samples taken side by side
    (the same round of an interleaved measurement), never a ratio of two summaries."""
    if len(numerators) != len(denominators):
        raise InvalidArgumentError(f"ratios need paired samples: {len(numerators)} against "
                                   f"{len(denominators)}")
    if any(d <= 0 for d in denominators):
        raise InvalidArgumentError("ratios need positive denominators")
    return [n / d for n, d in zip(numerators, denominators)]


@dataclasses.dataclass(frozen=True)
class Spread:
    """The median of some samples, with their spread: min-max, the quartiles (inclusive
    method: they lie between min and max), and how many samples there were."""

    median: float
    low: float
    high: float
    q1: float
    q3: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> "Spread":
        if not values:
            raise InvalidArgumentError("a spread needs at least one sample")
        ordered = sorted(values)
        if len(ordered) == 1:
            q1 = q3 = ordered[0]
        else:
            q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
        return cls(statistics.median(ordered), ordered[0], ordered[-1], q1, q3, len(ordered))

    def describe(self, number: str = "{:.2f}", unit: str = "") -> str:
        """'1.50x (min-max 1.20-1.90, IQR 1.40-1.60, n=5)' for number "{:.2f}", unit "x"."""
        def f(v) -> str:
            return number.format(v) + unit

        return (f"{f(self.median)} (min-max {f(self.low)}-{f(self.high)}, "
                f"IQR {f(self.q1)}-{f(self.q3)}, n={self.n})")


@dataclasses.dataclass(frozen=True)
class Section:
    """A titled part of a benchmark's report: a table and/or lines of text."""

    title: str
    rows: Sequence[Mapping[str, Any]] = ()
    lines: Sequence[str] = ()
    float_format: str = "{:.3g}"


def render_text(sections: Iterable[Section]) -> str:
    """Sections for a terminal: the title, its table, its lines."""
    parts = []
    for section in sections:
        body = [section.title, "=" * len(section.title)]
        if section.rows:
            body.append(format_table(section.rows, float_format=section.float_format))
        body += list(section.lines)
        parts.append("\n".join(body))
    return "\n\n".join(parts) + "\n"


def render_markdown(sections: Iterable[Section], level: int = 3) -> str:
    """Sections as Markdown: a heading, the table, the lines as a list."""
    parts = []
    for section in sections:
        body = ["#" * level + " " + section.title, ""]
        if section.rows:
            body += [markdown_table(section.rows, float_format=section.float_format), ""]
        body += [f"- {line}" for line in section.lines]
        parts.append("\n".join(body).rstrip())
    return "\n\n".join(parts) + "\n"


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot write {type(value).__name__} as JSON")


def write_json(path: str | Path, data: Any) -> Path:
    """Raw numbers as indented JSON (dataclasses become objects)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=_plain) + "\n")
    return path


def write_csv(path: str | Path, rows: Sequence[Mapping[str, Any]],
              columns: Sequence[str] | None = None) -> Path:
    """Rows as CSV; the columns default to every key in first-seen order."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if columns is None:
        columns = list(dict.fromkeys(key for row in rows for key in row))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns))
        writer.writeheader()
        writer.writerows(rows)
    return path


def fit_exponent(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """(k, c) of the least-squares line through (log x, log y): y ~= c * x**k.
    TTFT growing with k ~ 1 is linear in length, k ~ 2 quadratic."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise InvalidArgumentError("fit_exponent needs two or more (x, y) pairs")
    if any(v <= 0 for v in (*xs, *ys)):
        raise InvalidArgumentError("fit_exponent needs positive values (it fits in log-log space)")
    lx = [math.log(x) for x in xs]
    ly = [math.log(y) for y in ys]
    mx = sum(lx) / len(lx)
    my = sum(ly) / len(ly)
    sxx = sum((x - mx) ** 2 for x in lx)
    if sxx == 0:
        raise InvalidArgumentError("fit_exponent needs at least two distinct x values")
    k = sum((x - mx) * (y - my) for x, y in zip(lx, ly)) / sxx
    return k, math.exp(my - k * mx)


PLOTS_HINT = "pip install 'promptlang[bench]' gives the plots"


def can_plot() -> bool:
    """Whether matplotlib (the `bench` extra) is installed: without it, no plots."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot_ttft(path: str | Path, series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
              title: str = "Time to first token", xlabel: str = "prompt length (tokens)",
              ylabel: str = "TTFT (s)", dashed: Sequence[str] = ()) -> Path:
    """A log-log plot of TTFT against prompt length, one line per series (like Fig. 5 of
    the Prompt Cache paper), each labelled with its fitted exponent; written as PNG.
    Series named in `dashed` (e.g. a floor) are drawn as dashed lines without markers."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4.5))
    try:
        for name, (lengths, seconds) in series.items():
            label = name
            if len(set(lengths)) >= 2:
                label += f" (slope {fit_exponent(lengths, seconds)[0]:.2f})"
            if name in dashed:
                ax.plot(lengths, seconds, linestyle="--", color="grey", label=label)
            else:
                ax.plot(lengths, seconds, marker="o", label=label)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, format="png", dpi=120)
    finally:
        plt.close(fig)
    return path


class Progress:
    """A tqdm bar on stderr (or `file`), erased when done unless `leave`; iterate over it,
    or call `update`. `note(key=value)` shows live numbers, `write` prints a line
    without breaking the bar."""

    def __init__(self, iterable: Iterable[Any] | None = None, *, total: int | None = None,
                 desc: str | None = None, enabled: bool = True, leave: bool = False,
                 file: TextIO | None = None):
        self._file = file if file is not None else sys.stderr
        self._bar = tqdm(iterable, total=total, desc=desc, file=self._file,
                         disable=not enabled, leave=leave, dynamic_ncols=True)

    def __iter__(self):
        return iter(self._bar)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def update(self, n: int = 1) -> None:
        self._bar.update(n)

    def note(self, **values: Any) -> None:
        self._bar.set_postfix(values, refresh=True)

    def write(self, message: str) -> None:
        self._bar.write(message, file=self._file)

    def close(self) -> None:
        self._bar.close()
