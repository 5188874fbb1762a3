"""How PML parsing, layout and binding grow with pathological inputs.

    python -m promptlang.bench.parse_scaling [--size N] [--repeat R]

Each case builds an input of N units (attributes, union members, parameters...), then
of 2N and 4N, times the work on it (the best of R runs) and prints the growth exponent
`log2(t(4N) / t(N)) / 2`: about 1 for linear work, 2 for quadratic. No model and no
torch: the layout and the binder run with the word tokenizer of promptlang/tokenizer.py.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Callable, Sequence

from promptlang.pml.binding import bind
from promptlang.pml.layout import lay_out
from promptlang.pml.parser import MAX_DEPTH, parse, parse_prompt, parse_schema
from promptlang.tokenizer import WordTokenizer

FACTORS = (1, 2, 4)
_NEST = MAX_DEPTH - 2                   # modules per nested chain (the schema and one spare)


def _tokenizer() -> WordTokenizer:
    return WordTokenizer(max_positions=None)


def _many_attributes(n: int) -> Callable[[], object]:
    attrs = " ".join(f'a{i}="v{i}"' for i in range(n))
    text = f'<prompt schema="s"><m {attrs}/></prompt>'
    return lambda: parse(text)


def _union_members(n: int) -> Callable[[], object]:
    members = "".join(f'<module name="m{i}">member {i} <param name="p" len="8"/></module>'
                      for i in range(n))
    text = f'<schema name="s"><union>{members}</union></schema>'
    tok = _tokenizer()
    return lambda: lay_out(parse_schema(text), tok)


def _deep_nesting(n: int) -> Callable[[], object]:
    chains = max(1, n // _NEST)
    chain = "".join(f'<module name="d{i}">x' for i in range(_NEST)) + "</module>" * _NEST
    text = '<schema name="s">' + "".join(
        f'<module name="c{j}">{chain}</module>' for j in range(chains)) + "</schema>"
    tok = _tokenizer()
    return lambda: lay_out(parse_schema(text), tok)


def _long_text(n: int) -> Callable[[], object]:
    body = "word &amp; more &#65; text\n" * n
    text = f'<schema name="s"><module name="m">{body}</module></schema>'
    return lambda: parse(text)


def _many_params(n: int) -> Callable[[], object]:
    params = "".join(f'<param name="p{i}" len="2"/> and' for i in range(n))
    text = f'<schema name="s"><module name="m">{params}</module></schema>'
    tok = _tokenizer()
    return lambda: lay_out(parse_schema(text), tok)


def _comments_and_cdata(n: int) -> Callable[[], object]:
    body = "".join(f"<!-- note {i} --><![CDATA[if a < b && c]]>" for i in range(n))
    text = f'<schema name="s"><module name="m">{body}</module></schema>'
    return lambda: parse(text)


def _bare_less_than(n: int) -> Callable[[], object]:
    body = "if 0 <= i < n: pass\n" * n
    text = f'<schema name="s"><module name="m">{body}</module></schema>'
    return lambda: parse(text)


def _bind_arguments(n: int) -> Callable[[], object]:
    params = "".join(f'<param name="p{i}" len="4"/>' for i in range(n))
    tok = _tokenizer()
    layout = lay_out(parse_schema(f'<schema name="s"><module name="m">{params}</module>'
                                  '</schema>'), tok)
    args = " ".join(f'p{i}="value {i}"' for i in range(n))
    text = f'<prompt schema="s"><m {args}/>question</prompt>'
    return lambda: bind(parse_prompt(text), layout, tok)


def _bind_imports(n: int) -> Callable[[], object]:
    modules = "".join(f'<module name="m{i}">text {i}</module>' for i in range(n))
    tok = _tokenizer()
    layout = lay_out(parse_schema(f'<schema name="s">{modules}</schema>'), tok)
    text = '<prompt schema="s">' + "".join(f"<m{i}/>" for i in range(n)) + "</prompt>"
    return lambda: bind(parse_prompt(text), layout, tok)


# (name, what one unit is, build(units) -> the work to time)
CASES: tuple[tuple[str, str, Callable[[int], Callable[[], object]]], ...] = (
    ("many attributes", "attributes", _many_attributes),
    ("union members", "members", _union_members),
    ("deep nesting", "modules", _deep_nesting),
    ("long text", "lines", _long_text),
    ("many params", "params", _many_params),
    ("comments + CDATA", "pairs", _comments_and_cdata),
    ("bare '<' in code", "lines", _bare_less_than),
    ("bind arguments", "arguments", _bind_arguments),
    ("bind imports", "imports", _bind_imports),
)


def best_time(work: Callable[[], object], repeat: int) -> float:
    best = math.inf
    for _ in range(repeat):
        started = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - started)
    return best


def exponent(times: Sequence[float]) -> float:
    """The growth exponent from the 1x and 4x times: log2(t4 / t1) / 2."""
    first = max(times[0], 1e-9)
    last = max(times[-1], 1e-9)
    return math.log2(last / first) / math.log2(FACTORS[-1] / FACTORS[0])


def run(size: int, repeat: int) -> list[tuple[str, str, list[float], float]]:
    rows = []
    for name, unit, build in CASES:
        times = [best_time(build(size * factor), repeat) for factor in FACTORS]
        rows.append((name, f"{size} {unit}", times, exponent(times)))
    return rows


def format_rows(rows: list[tuple[str, str, list[float], float]], repeat: int) -> str:
    header = ("case", "1x size", *(f"{f}x (ms)" for f in FACTORS), "exponent")
    table = [header] + [(name, size, *(f"{t * 1e3:.2f}" for t in times), f"{e:.2f}")
                        for name, size, times, e in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = [f"PML parse/layout/bind scaling, best of {repeat}; exponent = log2(t4x/t1x)/2 "
             "(1: linear, 2: quadratic)"]
    for row in table:
        lines.append("  ".join(cell.ljust(widths[i]) if i < 2 else cell.rjust(widths[i])
                               for i, cell in enumerate(row)).rstrip())
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m promptlang.bench.parse_scaling",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=2000,
                        help="units per case at 1x (default 2000)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per size, best kept")
    args = parser.parse_args(argv)
    if args.size < 1 or args.repeat < 1:
        parser.error("--size and --repeat must be at least 1")
    print(format_rows(run(args.size, args.repeat), args.repeat))
    return 0


if __name__ == "__main__":
    sys.exit(main())
