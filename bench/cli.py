"""`promptlang bench`: the benchmarks, each printing its tables and writing raw numbers.

    promptlang bench latency  [--lengths 256,512,...] [--samples S] [--repeats R]
                              [--decode-tokens N] [--decode-samples D] [--goal-length L]
                              [--rag-docs N] [--rag-k K] [--rag-requests R]
    promptlang bench memory
    promptlang bench accuracy [--items N] [--kinds single,cross,...] [--docs-per-item D]
                              [--doc-words W] [--max-new-tokens N] [--seed S]
                              [--recompute SPEC,...] [--recompute-rules cached,isolate]
                              [--no-scaffold] [--no-bf16] [--workers N] [--cost-tokens N] [--cost-repeats R]
                              [--resamples B]
    promptlang bench all      (the three, one model load, one folder, one report.md)

Every command takes --quick (tiny sizes, for tests), --out DIR (default bench-out/),
--model PATH_OR_ID (default: the embedded SmolLM2-135M) and --no-progress. Tables go
to stdout, progress bars to stderr; the folder gets NAME.csv, NAME.json, NAME.md (and
latency.png, rag.csv, rag.json, accuracy.png, accuracy-items.json). Each PASS/FAIL goal
line is printed whether it passes or not; `latency` and `all` exit with 1 when the cached
and baseline first tokens disagree (a correctness check, not a speed goal).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable

DEFAULT_OUT = "bench-out"
_DEFAULT_RECOMPUTE = "first:4,first:16,first:32,deviation:0.15"   # accuracy.DEFAULT_RECOMPUTE


def register(subparsers: Any) -> None:
    bench = subparsers.add_parser(
        "bench", help="measure latency, KV memory and accuracy of cached prompts",
        description="Benchmarks that reproduce the Prompt Cache paper's claims on this "
                    "machine. Each prints its tables and writes CSV/JSON into --out.")
    bench.set_defaults(group_parser=bench)
    commands = bench.add_subparsers(title="commands", metavar="COMMAND")

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--quick", action="store_true",
                        help="tiny sizes (seconds, for tests); the numbers mean little")
    common.add_argument("--out", metavar="DIR", default=DEFAULT_OUT,
                        help=f"folder for the raw numbers and plots (default {DEFAULT_OUT}/)")
    common.add_argument("--model", metavar="PATH_OR_ID",
                        help="a local transformers model (default: the embedded SmolLM2-135M)")
    common.add_argument("--no-progress", action="store_true", help="no progress bars")
    common.add_argument("--threads", type=_positive, metavar="N",
                        help="torch threads (default: torch's choice, one per core)")

    latency = argparse.ArgumentParser(add_help=False)
    latency.add_argument("--lengths", type=_int_list, metavar="N,N,...",
                         help="document lengths in tokens (default "
                              "256,512,1024,2048,4096,6400,8000)")
    latency.add_argument("--samples", type=_positive, metavar="S",
                         help="interleaved rounds of (floor, cached request, baseline) per "
                              "length; the goals are judged on them (default 5)")
    latency.add_argument("--repeats", type=_positive, metavar="R",
                         help="timed requests per held, host and disk tier and length "
                              "(default 5)")
    latency.add_argument("--decode-tokens", type=_at_least_two, metavar="N",
                         help="tokens for the decode comparison (default 32)")
    latency.add_argument("--decode-samples", type=_positive, metavar="D",
                         help="interleaved decode runs on each side (default 5)")
    latency.add_argument("--goal-length", type=_positive, metavar="L",
                         help="the length the goals are checked at (default 6400)")
    latency.add_argument("--rag-docs", type=_positive, metavar="N",
                         help="documents of the RAG workload (default 8, ~700 tokens each)")
    latency.add_argument("--rag-k", type=_positive, metavar="K",
                         help="documents per RAG request (default 4)")
    latency.add_argument("--rag-requests", type=_non_negative, metavar="R",
                         help="timed RAG requests (default 12; 0 skips the RAG section)")

    accuracy = argparse.ArgumentParser(add_help=False)
    accuracy.add_argument("--items", type=_positive, metavar="N",
                          help="items per question kind (default 10)")
    accuracy.add_argument("--kinds", type=_kinds, metavar="K,K,...",
                          help="question kinds (default single,cross,dependent,needle,"
                               "same-shape)")
    accuracy.add_argument("--docs-per-item", type=_positive, metavar="D",
                          help="documents per item (default 4)")
    accuracy.add_argument("--doc-words", type=_positive, metavar="W",
                          help="words per document (default: 60, or 300 for needle)")
    accuracy.add_argument("--max-new-tokens", type=_positive, metavar="N",
                          help="answer length cap (default 32: room for a sentence)")
    accuracy.add_argument("--seed", type=int, metavar="S", help="item seed (default 0)")
    accuracy.add_argument("--recompute", type=_recompute_list, metavar="SPEC,SPEC,...",
                          help="recompute policies, each adding the settings cached+SPEC and "
                               "isolate+SPEC: first:K or deviation:F; 'none' for no such "
                               "settings (default " + _DEFAULT_RECOMPUTE + ")")
    accuracy.add_argument("--recompute-rules", type=_rules, metavar="RULE,...",
                          help="the cached rules the policies apply to: cached (guaranteed "
                               "context), isolate (default both)")
    accuracy.add_argument("--no-scaffold", dest="scaffold", action="store_false", default=None,
                          help="leave out the scaffold setting")
    accuracy.add_argument("--no-bf16", dest="store16", action="store_false", default=None,
                          help="leave out the cached-bf16 setting (cached, bfloat16 store)")
    accuracy.add_argument("--workers", type=_positive, metavar="N",
                          help="answer the items in N processes, each loading the model and "
                               "running --threads torch threads (default: this process's "
                               "threads / N); default 1")
    accuracy.add_argument("--cost-tokens", type=_non_negative, metavar="N",
                          help="prompt length of the recompute cost section "
                               "(default 6000; 0 skips it and the issue-8 goal)")
    accuracy.add_argument("--cost-repeats", type=_positive, metavar="R",
                          help="timed warm requests per setting in the cost section (default 3)")
    accuracy.add_argument("--resamples", type=_positive, metavar="B",
                          help="bootstrap resamples of the items for the paired intervals "
                               "(default 2000)")

    for name, parents, func, short, text in (
            ("latency", [common, latency], _one(_run_latency),
             "time to first token, baseline vs cached",
             "Time to first token, baseline against cached, over prompt length, with "
             "modules in the device, host and disk tiers; encode cost, break-even, the "
             "machine's floor, the decode comparison, the first-token agreement check, "
             "the latency goals, and a RAG workload (k of N documents per request) "
             "against a prefix-cache policy on the same engine."),
            ("memory", [common], _one(_run_memory), "KV bytes per token",
             "KV bytes per token: the model's, its store's in 32 and 16 bits, and a table "
             "of well-known models' shapes."),
            ("accuracy", [common, accuracy], _one(_run_accuracy),
             "exact match with and without caching",
             "Exact match and answer-in-output (a distractor's answer first counts as "
             "wrong) on synthetic multi-document QA: baseline, "
             "cached (guaranteed context), cached from a bfloat16 store, cached (isolate), "
             "scaffold, and both cached rules with each --recompute policy; agreement with "
             "the baseline; the gold answer's teacher-forced log-probability and the "
             "first-token KL from the baseline, each setting against the baseline with "
             "paired bootstrap intervals; the TTFT of "
             "every setting at ~6k tokens, accuracy.png and the issue-8 goal."),
            ("all", [common, latency, accuracy], _all, "all three into one folder",
             "memory, latency and accuracy in one run (about 20 minutes on 2 cores at the "
             "defaults), into one folder with a report.md of every table.")):
        command = commands.add_parser(name, parents=parents, help=short, description=text)
        command.set_defaults(func=func, bench=name)


# --- argument types ---------------------------------------------------------------------

def _at_least(minimum: int, name: str):
    """An argparse type: an integer >= minimum (argparse names `name` in its own errors)."""
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value
    parse.__name__ = name
    return parse


_non_negative = _at_least(0, "non-negative integer")
_positive = _at_least(1, "positive integer")
_at_least_two = _at_least(2, "integer >= 2")


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}")
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"need positive token counts, got {text!r}")
    return tuple(sorted(set(values)))


def _recompute_list(text: str) -> tuple[str, ...]:
    """Comma-separated recompute policies, canonical and without duplicates; "none"
    alone: no recompute settings."""
    from promptlang.pml.recompute import RecomputeSpecError
    from promptlang.bench.accuracy import normalize_specs

    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts:
        raise argparse.ArgumentTypeError("need at least one policy (or 'none')")
    try:
        specs = normalize_specs(parts)
    except RecomputeSpecError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if not specs and parts != ["none"]:
        raise argparse.ArgumentTypeError(f"{text!r} names no recompute policy: use 'none' "
                                         "alone for no recompute settings")
    return specs


def _rules(text: str) -> tuple[str, ...]:
    rules = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    unknown = [r for r in rules if r not in ("cached", "isolate")]
    if unknown or not rules:
        raise argparse.ArgumentTypeError(f"unknown rule(s) {unknown}: choose from cached, "
                                         "isolate")
    return rules


def _kinds(text: str) -> tuple[str, ...]:
    from promptlang.bench.qa import KINDS

    kinds = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise argparse.ArgumentTypeError(f"unknown kind(s) {unknown}: choose from "
                                         f"{', '.join(KINDS)}")
    return kinds


# --- running ----------------------------------------------------------------------------

class _Run:
    """One command's model, output folder, thread setting and machine measurement;
    a context manager that restores torch's thread count on exit."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self._threads = None
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.progress = not args.no_progress
        self._llm = None
        self._machine = None
        self.written: list[Path] = []

    def __enter__(self) -> "_Run":
        if self.args.threads is not None:
            import torch

            self._threads = torch.get_num_threads()
            torch.set_num_threads(self.args.threads)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._threads is not None:
            import torch

            torch.set_num_threads(self._threads)

    @property
    def llm(self):
        if self._llm is None:
            from promptlang.runtime import engine

            began = time.perf_counter()
            self._llm = engine.load(self.args.model)
            _say(f"loaded {self.model_name} in {time.perf_counter() - began:.1f} s")
        return self._llm

    @property
    def model_name(self) -> str:
        if self._llm is None:
            return self.args.model or "SmolLM2-135M-Instruct (default)"
        return getattr(self._llm.tokenizer, "name", "") or str(self.args.model)

    @property
    def machine(self):
        if self._machine is None:
            from promptlang.bench import floor

            self._machine = floor.measure_machine()
        return self._machine

    def machine_lines(self) -> list[str]:
        from promptlang.bench.floor import machine_facts

        m = machine_facts(self.machine)
        return [f"CPU: {m['cpu'] or 'unknown'}; {m['usable_cores']} usable cores "
                f"({m['logical_cores']} logical), torch threads {m['torch_threads']}",
                f"measured in this run: float32 matmul {m['matmul_gflops']} GFLOP/s (best "
                f"sustained sgemm: {m['matmul_sgemm']}), "
                f"memory copy {m['copy_gb_per_s']} GB/s (read + write)",
                f"python {m['python']}, torch {m['torch']}, transformers {m['transformers']}",
                f"CPU kernels: {m['kernels']}"]

    def write(self, name: str, writer: Callable[[Path], Any]) -> Path:
        path = self.out / name
        writer(path)
        self.written.append(path)
        return path


def _options(cls, args: argparse.Namespace, mapping: dict[str, str]):
    """Quick or default options, with every option given on the command line applied."""
    from dataclasses import replace

    base = cls.quick() if args.quick else cls()
    given = {field: getattr(args, arg) for arg, field in mapping.items()
             if getattr(args, arg, None) is not None}
    return replace(base, **given)


def _latency_options(args):
    from promptlang.bench.latency import LatencyOptions

    return _options(LatencyOptions, args, {
        "lengths": "lengths", "samples": "samples", "repeats": "repeats",
        "decode_tokens": "decode_tokens", "decode_samples": "decode_samples",
        "goal_length": "goal_length"})


def _rag_options(args):
    from promptlang.bench.rag import RagOptions

    return _options(RagOptions, args, {"rag_docs": "docs", "rag_k": "k",
                                       "rag_requests": "requests"})


def _accuracy_options(args):
    from promptlang.bench.accuracy import AccuracyOptions

    return _options(AccuracyOptions, args, {
        "items": "items_per_kind", "kinds": "kinds", "docs_per_item": "docs_per_item",
        "doc_words": "doc_words", "max_new_tokens": "max_new_tokens", "seed": "seed",
        "recompute": "recompute", "recompute_rules": "recompute_rules", "scaffold": "scaffold",
        "store16": "store16",
        "cost_tokens": "cost_tokens", "cost_repeats": "cost_repeats",
        "resamples": "resamples"})


def _run_latency(run: _Run):
    from promptlang.bench import latency, rag
    from promptlang.bench.report import render_markdown, render_text, write_csv, \
        write_json

    report = latency.run_latency(run.llm, _latency_options(run.args),
                                 model_source=run.args.model, model_name=run.model_name,
                                 workdir=run.out, progress=run.progress)
    parts = latency.sections(report, run.llm.tokenizer)
    rag_options = _rag_options(run.args)
    if rag_options.requests:
        workload = rag.run_rag(run.llm, rag_options, model_name=run.model_name,
                               progress=run.progress)
        parts += rag.sections(workload)
        run.write("rag.csv", lambda p: write_csv(p, workload.rows()))
        run.write("rag.json", lambda p: write_json(p, rag.to_json(workload)))
    print(render_text(parts))
    run.write("latency.csv", lambda p: write_csv(p, report.rows()))
    run.write("latency.json", lambda p: write_json(p, latency.to_json(report)))
    if report.points:
        note = " (QUICK RUN)" if run.args.quick else ""
        run.write("latency.png", lambda p: latency.plot(report, p, note))
    run.write("latency.md", lambda p: p.write_text(render_markdown(parts)))
    return report, parts


def _run_memory(run: _Run):
    from promptlang.bench import memory
    from promptlang.bench.report import render_markdown, render_text, write_csv, \
        write_json

    report = memory.run_memory(run.llm, run.model_name, workdir=run.out)
    parts = memory.sections(report)
    print(render_text(parts))
    run.write("memory.csv", lambda p: write_csv(p, report.rows))
    run.write("memory.json", lambda p: write_json(p, memory.to_json(report)))
    run.write("memory.md", lambda p: p.write_text(render_markdown(parts)))
    return report, parts


def _run_accuracy(run: _Run):
    from promptlang.bench import accuracy
    from promptlang.bench.report import render_markdown, render_text, write_csv, \
        write_json

    report = accuracy.run_accuracy(run.llm, _accuracy_options(run.args),
                                   model_name=run.model_name, progress=run.progress,
                                   workers=getattr(run.args, "workers", None) or 1,
                                   model_source=run.args.model, worker_threads=run.args.threads)
    parts = accuracy.sections(report)
    print(render_text(parts))
    run.write("accuracy.csv", lambda p: write_csv(p, report.rows()))
    run.write("accuracy.json", lambda p: write_json(p, accuracy.to_json(report)))
    run.write("accuracy-items.json",
              lambda p: write_json(p, [r.to_dict() for r in report.results]))
    if report.cost is not None:
        note = " (QUICK RUN)" if run.args.quick else ""
        run.write("accuracy.png", lambda p: accuracy.plot(report, p, note))
    run.write("accuracy.md", lambda p: p.write_text(render_markdown(parts)))
    return report, parts


def _header(run: _Run) -> list[str]:
    from promptlang.bench.report import Section, render_text

    lines = [f"command: {command_line(run.args)}", *run.machine_lines()]
    if run.args.quick:
        lines.append("QUICK RUN: tiny sizes for tests; these numbers are not the benchmark")
    print(render_text([Section("promptlang bench", (), lines)]))
    return lines


def _one(bench: Callable[[_Run], Any]) -> Callable[[argparse.Namespace], int]:
    """The command that runs one benchmark: header, the benchmark, the files written;
    1 when the report says its results are not correct (see `_status`)."""
    def command(args: argparse.Namespace) -> int:
        with _Run(args) as run:
            _header(run)
            report, _ = bench(run)
            _done(run)
        return _status([report])
    return command


def _status(reports) -> int:
    """1 when a report's `correct` is False (latency: cached and baseline picked different
    first tokens), else 0. Speed goals that FAIL do not change it: they are measurements."""
    wrong = [r for r in reports if getattr(r, "correct", True) is False]
    if wrong:
        _say("FAIL: cached and baseline first tokens disagree (see the goal lines)")
    return 1 if wrong else 0


def _all(args: argparse.Namespace) -> int:
    with _Run(args) as run:
        return _run_all(run)


def _run_all(run: _Run) -> int:
    from dataclasses import asdict

    from promptlang.bench.report import Section, render_markdown, render_text, \
        write_json

    began = time.perf_counter()
    header = _header(run)
    timings = {}
    parts: dict[str, list] = {}
    goals, reports = [], []
    for name, bench in (("memory", _run_memory), ("latency", _run_latency),
                        ("accuracy", _run_accuracy)):
        started = time.perf_counter()
        report, parts[name] = bench(run)
        reports.append(report)
        goals += getattr(report, "goals", [])
        timings[name] = round(time.perf_counter() - started, 1)
    total = time.perf_counter() - began
    summary = Section("Goals (issues 7 and 8), all benchmarks", (), [str(g) for g in goals])
    print(render_text([summary]))
    write_json(run.out / "goals.json", [asdict(g) | {"verdict": g.verdict} for g in goals])
    run.written.append(run.out / "goals.json")
    timing_line = (f"wall time {total / 60:.1f} min (" +
                   ", ".join(f"{k} {v / 60:.1f} min" for k, v in timings.items()) +
                   ", the rest loading the model and measuring the machine)")
    document = [f"## Run of {time.strftime('%Y-%m-%d %H:%M')}", "",
                render_markdown([Section("Command and machine", (), header + [timing_line])]),
                "## Memory", "", render_markdown(parts["memory"]),
                "## Latency", "", "![TTFT against prompt length](latency.png)", "",
                render_markdown(parts["latency"]),
                "## Accuracy", "",
                *(["![Accuracy against TTFT at ~6k tokens](accuracy.png)", ""]
                  if (run.out / "accuracy.png") in run.written else []),
                render_markdown(parts["accuracy"]),
                "## All goals", "", render_markdown([summary])]
    run.write("report.md", lambda p: p.write_text("\n".join(document)))
    _say(timing_line)
    _done(run)
    return _status(reports)


def _done(run: _Run) -> None:
    _say("wrote " + ", ".join(str(p) for p in run.written))


_NEGATED = {"scaffold": "--no-scaffold", "store16": "--no-bf16"}     # store_false options: dest -> flag


def command_line(args: argparse.Namespace) -> str:
    """The command as typed, rebuilt from the parsed options that were given."""
    words = ["promptlang", "bench", args.bench]
    for dest, value in sorted(vars(args).items()):
        if dest in _NEGATED and value is False:
            words.append(_NEGATED[dest])
            continue
        if dest in ("func", "bench", "group_parser") or value is None or value is False:
            continue
        if dest == "out" and value == DEFAULT_OUT:
            continue
        flag = "--" + dest.replace("_", "-")
        if value is True:
            words.append(flag)
        elif isinstance(value, tuple):
            words += [flag, ",".join(map(str, value)) or "none"]
        else:
            words += [flag, str(value)]
    return " ".join(words)


def _say(message: str) -> None:
    print(f"promptlang bench: {message}", file=sys.stderr, flush=True)
