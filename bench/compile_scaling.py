"""How `promptlang compile` of a Python file grows with the file, beside CPython's own compile.

    python -m promptlang.bench.compile_scaling [--sizes 0.5,1,2,4,5,10,50] [--chains 100,400,3000]
                                               [--out FILE.json]

Each size writes a file of that many megabytes of @prompt functions (text, a `match` on a
parameter, a bounded f-string hole each), then times `promptlang compile FILE` and
`compile(FILE)` in CPython, each in a process of its own (elapsed seconds and peak resident
memory). A file over the cap for Python sources (`PROMPTLANG_MAX_PYTHON_BYTES`) ends in a
located PL006 before it is read: the row says so. Each chain is a file of N @prompt
functions each calling the next. The goals printed: compile time grows linearly over the
sizes compiled, and the largest size is compiled, or refused with a located error, within
10x CPython's time and 2x its memory.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, Sequence

OURS = ("import sys\nfrom promptlang.cli import main\n"
        "sys.exit(main(['compile', sys.argv[1]]))\n")
PYTHONS = "import sys\ncompile(open(sys.argv[1], 'rb').read(), sys.argv[1], 'exec')\n"
LINEAR_EXPONENT = 1.15      # the most the time's growth exponent may be, over sizes compiled
TIME_RATIO = 10.0           # the largest size against CPython's compile
MEMORY_RATIO = 2.0


def prompt_blocks(megabytes: float) -> Iterator[str]:
    """A module of @prompt functions, `megabytes` MB of source (1 MB = 10**6 bytes), a
    piece at a time: the measuring process stays small, and a child's peak memory counts
    its parent's at the fork."""
    head = "from promptlang import MaxTokens, prompt\n\n"
    yield head
    size = len(head)
    i = 0
    while size < megabytes * 1e6:
        block = (f"@prompt\n"
                 f"def f{i}(kind: str, q: MaxTokens(16)):\n"
                 f'    "Note {i}: the river runs past the mill; the bakery opens at dawn. "\n'
                 f"    match kind:\n"
                 f'        case "short":\n'
                 f'            "Answer in a word. "\n'
                 f'        case "long":\n'
                 f'            "Answer in a sentence. "\n'
                 f'    f"Question: {{q}}"\n\n')
        yield block
        size += len(block)
        i += 1


def chain_file(n: int) -> str:
    """N @prompt functions, each calling the next."""
    lines = ["from promptlang import prompt", ""]
    for i in range(n):
        lines += ["@prompt", f"def f{i}():", f'    "text {i}. "']
        if i + 1 < n:
            lines.append(f"    f{i + 1}()")
        lines.append("")
    return "\n".join(lines)


def measure(script: str, path: Path) -> dict:
    """Elapsed seconds, peak resident MB, exit status and the first line of stderr of
    `python -c script path`, run alone."""
    with tempfile.TemporaryFile() as stderr:      # a pipe could fill while nobody reads
        started = time.perf_counter()
        child = subprocess.Popen([sys.executable, "-c", script, str(path)],
                                 stdout=subprocess.DEVNULL, stderr=stderr)
        _, status, usage = os.wait4(child.pid, 0)
        seconds = time.perf_counter() - started
        child.returncode = os.waitstatus_to_exitcode(status)
        stderr.seek(0)
        head = stderr.read(64 * 1024).decode("utf-8", "replace")
    first = next((line for line in head.splitlines() if line.strip()), "")
    return {"seconds": round(seconds, 3), "peak_mb": round(usage.ru_maxrss / 1024, 1),
            "status": child.returncode, "first_line": first[:200]}


def rejected(row: dict) -> bool:
    return "[PL006]" in row["ours"]["first_line"]


def run(sizes: Sequence[float], chains: Sequence[int], folder: Path, say=print) -> dict:
    rows = []
    for megabytes in sizes:
        path = folder / f"prompts_{str(megabytes).replace('.', '_')}mb.py"
        with path.open("w") as out:
            for block in prompt_blocks(megabytes):
                out.write(block)
        size = path.stat().st_size
        say(f"compile_scaling: {megabytes:g} MB ({size:,} bytes)...")
        rows.append({"what": f"{megabytes:g} MB", "bytes": size,
                     "ours": measure(OURS, path), "python": measure(PYTHONS, path)})
        path.unlink()
    for n in chains:
        path = folder / f"chain{n}.py"
        path.write_text(chain_file(n))
        say(f"compile_scaling: a chain of {n} calls...")
        rows.append({"what": f"chain of {n}", "bytes": path.stat().st_size,
                     "ours": measure(OURS, path), "python": measure(PYTHONS, path)})
        path.unlink()
    return {"rows": rows, "sizes": list(sizes), "chains": list(chains),
            "cap_bytes": _cap(), "python": platform.python_version(),
            "machine": platform.processor() or platform.machine()}


def _cap() -> int:
    from promptlang.inputs import max_python_bytes

    return max_python_bytes()


def format_report(result: dict) -> str:
    lines = [f"promptlang compile of Python files beside CPython's compile (cap for Python "
             f"sources: {result['cap_bytes']:,} bytes)",
             f"{'input':<16}{'bytes':>12}{'ours s':>9}{'ours MB':>9}{'python s':>10}"
             f"{'python MB':>11}{'time x':>8}{'mem x':>7}  result"]
    for row in result["rows"]:
        lines.append(_row_line(row))
    lines.append("")
    lines.extend(goals(result))
    return "\n".join(lines)


def _row_line(row: dict) -> str:
    ours = row["ours"]
    python = row["python"]
    return (f"{row['what']:<16}{row['bytes']:>12,}{ours['seconds']:>9.2f}"
            f"{ours['peak_mb']:>9.0f}{python['seconds']:>10.2f}{python['peak_mb']:>11.0f}"
            f"{ours['seconds'] / python['seconds']:>8.1f}"
            f"{ours['peak_mb'] / python['peak_mb']:>7.1f}  {_outcome(row)}")


def _outcome(row: dict) -> str:
    """`refused: ...` for a PL006, else the exit status and the first diagnostic's code."""
    first = row["ours"]["first_line"]
    if rejected(row):
        return "refused: " + first.split(": error: ")[-1][:60]
    code = re.search(r"\[(PL\d+)\]", first)
    outcome = f"exit {row['ours']['status']}"
    return outcome + (f", first diagnostic {code.group(1)}" if code else "")


def goals(result: dict) -> list[str]:
    sized = [r for r in result["rows"] if r["what"].endswith(" MB")]
    compiled = [r for r in sized if r["ours"]["status"] == 0]
    out = []
    if len(compiled) >= 2:
        small, large = compiled[0], compiled[-1]
        growth = (math.log(large["ours"]["seconds"] / small["ours"]["seconds"])
                  / math.log(large["bytes"] / small["bytes"]))
        verdict = "PASS" if growth <= LINEAR_EXPONENT else "FAIL"
        out.append(f"{verdict}  compile time linear in the file: exponent {growth:.2f} from "
                   f"{small['what']} to {large['what']} (goal <= {LINEAR_EXPONENT})")
    if sized:
        largest = sized[-1]
        ours = largest["ours"]
        python = largest["python"]
        time_x = ours["seconds"] / python["seconds"]
        memory_x = ours["peak_mb"] / python["peak_mb"]
        done = ours["status"] == 0 or rejected(largest)
        verdict = "PASS" if done and time_x <= TIME_RATIO and memory_x <= MEMORY_RATIO else "FAIL"
        how = "refused with a located PL006" if rejected(largest) else f"exit {ours['status']}"
        out.append(f"{verdict}  {largest['what']} compiled or refused within {TIME_RATIO:g}x "
                   f"CPython's time and {MEMORY_RATIO:g}x its memory: {how}, "
                   f"{time_x:.2f}x the time, {memory_x:.2f}x the memory")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m promptlang.bench.compile_scaling",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="0.5,1,2,4,5,10,50",
                        help="file sizes in MB, comma-separated (default 0.5,1,2,4,5,10,50)")
    parser.add_argument("--chains", default="100,400,3000",
                        help="call-chain lengths, comma-separated (default 100,400,3000; "
                             "'' for none)")
    parser.add_argument("--out", metavar="FILE", help="write the raw result as JSON")
    args = parser.parse_args(argv)
    try:
        sizes = [float(s) for s in args.sizes.split(",") if s.strip()]
        chains = [int(s) for s in args.chains.split(",") if s.strip()]
    except ValueError:
        parser.error("--sizes takes numbers of MB and --chains whole numbers, comma-separated")
    if any(s <= 0 for s in sizes) or any(n < 1 for n in chains):
        parser.error("sizes must be above 0 and chains at least 1")
    with tempfile.TemporaryDirectory(prefix="promptlang-compile-scaling-") as folder:
        result = run(sizes, chains, Path(folder), say=lambda m: print(m, file=sys.stderr))
    print(format_report(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
