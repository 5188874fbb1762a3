"""Running one `promptlang bench` command: the model, the output folder, the header, each
benchmark's tables and files, and the exit status.

promptlang/cli/bench.py parses the command line; `COMMANDS[name](args, command)` runs it
(`command`: the command as typed, for the header). Each benchmark prints its tables on
stdout, writes NAME.csv, NAME.json and NAME.md (and its plot, when matplotlib is installed)
into `args.out`; progress and the list of files written go to stderr.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable


class _Run:
    """One command's model, output folder, thread setting and machine measurement;
    a context manager that restores torch's thread count on exit."""

    def __init__(self, args: argparse.Namespace, command: str = ""):
        self.args = args
        self.command = command          # as typed, for the header
        self._plots_said = False
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
            approximations = {name: True for name in ("int8_linears", "bf16_attention")
                              if getattr(self.args, name, False)}
            compute = getattr(self.args, "dtype", "float32")
            self._llm = engine.load(self.args.model, compute=compute, **approximations)
            _say(f"loaded {self.model_name} in {time.perf_counter() - began:.1f} s"
                 + "".join(f", {name.replace('_', ' ')}" for name in approximations)
                 + ("" if compute == "float32" else f", compute {compute}"))
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
            from promptlang.runtime.passing import on_passing_thread

            # on a thread of its own that then ends (runtime/passing.py): torch's parallel
            # sgemm and copy leave an OpenMP thread pool with the thread that ran them, and
            # `bench serve`'s engine thread then decoded ~30% slower (measured)
            self._machine = on_passing_thread(floor.measure_machine, name="promptlang-measure")
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

    def plot(self, name: str, plotter: Callable[[Path], Any]) -> Path | None:
        """`write` for a plot; without matplotlib, one line (once per run) says how to get
        the plots, and the tables are all there is."""
        from promptlang.bench.report import PLOTS_HINT, can_plot

        if can_plot():
            return self.write(name, plotter)
        if not self._plots_said:
            _say(f"no plots: matplotlib is not installed; {PLOTS_HINT}")
            self._plots_said = True
        return None


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
                                       "rag_requests": "requests",
                                       "rag_recompute": "recompute"})


def _accuracy_options(args):
    from promptlang.bench.accuracy import AccuracyOptions

    return _options(AccuracyOptions, args, {
        "items": "items_per_kind", "kinds": "kinds", "docs_per_item": "docs_per_item",
        "doc_words": "doc_words", "max_new_tokens": "max_new_tokens", "seed": "seed",
        "recompute": "recompute", "recompute_rules": "recompute_rules", "scaffold": "scaffold",
        "store16": "store16", "isolate": "isolate",
        "cost_tokens": "cost_tokens", "cost_repeats": "cost_repeats",
        "resamples": "resamples"})


def _serve_options(args):
    from promptlang.bench.serve import ServeOptions

    return _options(ServeOptions, args, {"clients": "clients", "requests": "requests",
                                         "max_tokens": "max_tokens",
                                         "llama_server": "llama_server"})


def _run_serve(run: _Run):
    from promptlang.bench import serve
    from promptlang.bench.report import render_markdown, render_text, write_csv, write_json

    report = serve.run_serve(run.llm, _serve_options(run.args), model_name=run.model_name,
                             sgemm_flops_per_s=run.machine.matmul_flops_per_s)
    parts = serve.sections(report)
    print(render_text(parts))
    run.write("serve.csv", lambda p: write_csv(p, [level.row() for level in report.levels]))
    run.write("serve.json", lambda p: write_json(p, serve.to_json(report)))
    run.write("serve.md", lambda p: p.write_text(render_markdown(parts)))
    return report, parts


def _cluster_options(args):
    from promptlang.bench.cluster import ClusterOptions

    return _options(ClusterOptions, args, {
        "replicas": "replicas", "cluster_docs": "docs", "cluster_k": "k",
        "cluster_requests": "requests", "cluster_clients": "clients",
        "routers": "routers", "memory_share": "memory_share"})


def _run_cluster(run: _Run):
    from promptlang.bench import cluster
    from promptlang.bench.report import render_markdown, render_text, write_csv, write_json

    report = cluster.run_cluster(run.llm, _cluster_options(run.args),
                                 model_name=run.model_name)
    parts = cluster.sections(report)
    print(render_text(parts))
    run.write("cluster.csv", lambda p: write_csv(p, [r.row() for r in report.runs]))
    run.write("cluster.json", lambda p: write_json(p, cluster.to_json(report)))
    run.write("cluster.md", lambda p: p.write_text(render_markdown(parts)))
    return report, parts


def _run_scaling(run: _Run):
    import json

    from promptlang.bench import scaling
    from promptlang.bench.report import render_markdown, render_text, write_csv, write_json
    from promptlang.errors import InputFileError

    source = Path(run.args.costs) if run.args.costs else run.out / "cluster.json"
    try:
        costs = json.loads(source.read_text())["costs"]
    except (OSError, ValueError, KeyError) as error:
        raise InputFileError(f"{source}: no measured costs to project from ({error}); run "
                             "`promptlang bench cluster` first, or pass --costs FILE") from None
    options = scaling.ScalingOptions.quick() if run.args.quick else scaling.ScalingOptions()
    result = scaling.run_scaling(costs, options, progress=lambda row: _say(
        f"{row['router']} x{row['replicas']}, {row['modules']:,} modules: "
        f"{row['memory hit %']}% memory hits"))
    result["costs_file"] = str(source)
    parts = scaling.sections(result)
    print(render_text(parts))
    run.write("scaling.csv", lambda p: write_csv(p, result["rows"]))
    run.write("scaling.json", lambda p: write_json(p, result))
    run.write("scaling.md", lambda p: p.write_text(render_markdown(parts)))
    return result, parts


def _run_structured(run: _Run):
    from promptlang.bench import structured
    from promptlang.bench.report import render_markdown, render_text, write_json

    options = structured.StructuredOptions.quick() if run.args.quick else \
        structured.StructuredOptions()
    report = structured.run_structured(run.llm, options, model_name=run.model_name)
    parts = structured.sections(report)
    print(render_text(parts))
    run.write("structured.json", lambda p: write_json(p, {
        "free_s_per_token": report.free, "constrained_s_per_token": report.constrained,
        "mask_s": report.mask_seconds, "overhead": report.overhead(),
        "goals": [{"name": g.name, "passed": g.passed, "detail": g.detail}
                  for g in report.goals]}))
    run.write("structured.md", lambda p: p.write_text(render_markdown(parts)))
    return report, parts


def peers_gguf(args) -> str | None:
    """The GGUF llama.cpp loads in `bench peers`: --gguf, else a --model GGUF (the file
    promptlang loads), else None (the default model's own, when the model is the default)."""
    if args.gguf:
        return args.gguf
    return args.model if str(args.model or "").endswith(".gguf") else None


def _run_peers(run: _Run):
    from dataclasses import replace

    from promptlang.bench import peers, peers_report
    from promptlang.bench.report import render_markdown, render_text, write_json

    options = peers_report.PeersOptions.quick() if run.args.quick else \
        peers_report.PeersOptions()
    gguf = peers_gguf(run.args)
    if gguf:
        options = replace(options, gguf=gguf)
    report = peers.run_peers(run.llm, options, model_name=run.model_name,
                             sgemm_flops_per_s=run.machine.matmul_flops_per_s,
                             model=run.args.model)
    parts = peers_report.sections(report)
    print(render_text(parts))
    run.write("peers.json", lambda p: write_json(p, peers_report.to_json(report)))
    run.write("peers.md", lambda p: p.write_text(render_markdown(parts)))
    return report, parts


def _run_compute(run: _Run):
    from promptlang.bench import compute
    from promptlang.bench.report import render_markdown, render_text, write_json

    options = compute.ComputeOptions.quick() if run.args.quick else compute.ComputeOptions()
    report = compute.run_compute(run.llm, options, model_name=run.model_name,
                                 progress=run.progress)
    parts = compute.sections(report)
    print(render_text(parts))
    run.write("compute.json", lambda p: write_json(p, compute.to_json(report)))
    run.write("compute.md", lambda p: p.write_text(render_markdown(parts)))
    return report, parts


def _run_contention(run: _Run):
    from promptlang.bench import contention
    from promptlang.bench.report import render_markdown, render_text, write_json

    options = (contention.ContentionOptions.quick() if run.args.quick
               else contention.ContentionOptions())
    report = contention.run_contention(run.llm, options, model_name=run.model_name,
                                       progress=run.progress)
    parts = contention.sections(report)
    print(render_text(parts))
    run.write("contention.json", lambda p: write_json(p, contention.to_json(report)))
    run.write("contention.md", lambda p: p.write_text(render_markdown(parts)))
    return report, parts


def _run_plan(run: _Run):
    from promptlang.bench import plan
    from promptlang.bench.report import render_markdown, render_text, write_json

    options = plan.PlanOptions.quick() if run.args.quick else plan.PlanOptions()
    report = plan.run_plan(run.llm, options, model_name=run.model_name, progress=run.progress)
    parts = plan.sections(report)
    print(render_text(parts))
    run.write("plan.json", lambda p: write_json(p, plan.to_json(report)))
    run.write("plan.md", lambda p: p.write_text(render_markdown(parts)))
    return report, parts


def _run_latency(run: _Run):
    from promptlang.bench import latency, rag
    from promptlang.bench.report import render_markdown, render_text, write_csv, write_json

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
        run.plot("latency.png", lambda p: latency.plot(report, p, note))
    run.write("latency.md", lambda p: p.write_text(render_markdown(parts)))
    return report, parts


def _run_memory(run: _Run):
    from promptlang.bench import memory
    from promptlang.bench.report import render_markdown, render_text, write_csv, write_json

    report = memory.run_memory(run.llm, run.model_name, workdir=run.out)
    parts = memory.sections(report)
    print(render_text(parts))
    run.write("memory.csv", lambda p: write_csv(p, report.rows))
    run.write("memory.json", lambda p: write_json(p, memory.to_json(report)))
    run.write("memory.md", lambda p: p.write_text(render_markdown(parts)))
    return report, parts


def _run_accuracy(run: _Run):
    from promptlang.bench import accuracy
    from promptlang.bench.report import render_markdown, render_text, write_csv, write_json

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
        run.plot("accuracy.png", lambda p: accuracy.plot(report, p, note))
    run.write("accuracy.md", lambda p: p.write_text(render_markdown(parts)))
    return report, parts


def _header(run: _Run) -> list[str]:
    from promptlang.bench.report import Section, render_text

    lines = [f"command: {run.command}", *run.machine_lines()]
    if run.args.quick:
        lines.append("QUICK RUN: tiny sizes for tests; these numbers are not the benchmark")
    print(render_text([Section("promptlang bench", (), lines)]))
    return lines


def _one(bench: Callable[[_Run], Any]) -> Callable[[argparse.Namespace, str], int]:
    """The command that runs one benchmark: header, the benchmark, the files written;
    1 when the report says its results are not correct (see `_status`)."""
    def command(args: argparse.Namespace, typed: str = "") -> int:
        with _Run(args, typed) as run:
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


def _all(args: argparse.Namespace, typed: str = "") -> int:
    with _Run(args, typed) as run:
        return _run_all(run)


def _run_all(run: _Run) -> int:
    from dataclasses import asdict

    from promptlang.bench.report import Section, render_markdown, render_text, write_json

    began = time.perf_counter()
    header = _header(run)
    timings = {}
    parts: dict[str, list] = {}
    goals = []
    reports = []
    for name, bench in (("memory", _run_memory), ("latency", _run_latency),
                        ("accuracy", _run_accuracy)):
        started = time.perf_counter()
        report, parts[name] = bench(run)
        reports.append(report)
        goals += getattr(report, "goals", [])
        timings[name] = round(time.perf_counter() - started, 1)
    total = time.perf_counter() - began
    summary = Section("Goals, all benchmarks", (), [str(g) for g in goals])
    print(render_text([summary]))
    write_json(run.out / "goals.json", [asdict(g) | {"verdict": g.verdict} for g in goals])
    run.written.append(run.out / "goals.json")
    timing_line = (f"wall time {total / 60:.1f} min (" +
                   ", ".join(f"{k} {v / 60:.1f} min" for k, v in timings.items()) +
                   ", the rest loading the model and measuring the machine)")
    document = [f"## Run of {time.strftime('%Y-%m-%d %H:%M')}", "",
                render_markdown([Section("Command and machine", (), header + [timing_line])]),
                "## Memory", "", render_markdown(parts["memory"]),
                "## Latency", "",
                *(["![TTFT against prompt length](latency.png)", ""]
                  if (run.out / "latency.png") in run.written else []),
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


COMMANDS = {"latency": _one(_run_latency), "memory": _one(_run_memory),
            "accuracy": _one(_run_accuracy), "serve": _one(_run_serve),
            "structured": _one(_run_structured), "peers": _one(_run_peers),
            "cluster": _one(_run_cluster), "scaling": _one(_run_scaling),
            "compute": _one(_run_compute), "plan": _one(_run_plan),
            "contention": _one(_run_contention),
            "all": _all}    # name -> runner(args, command)


def _say(message: str) -> None:
    print(f"promptlang bench: {message}", file=sys.stderr, flush=True)
