"""`run_latency`: the sweep over lengths, the decode comparison at the goal length, the goals.

run_latency -> sweep._Case.make and sweep._measure per length -> decode._compare_decode
-> goals.latency_goals -> LatencyReport (results.py); tables.py prints it.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from promptlang.runtime.fast import native
from promptlang.bench import floor
from promptlang.bench.report import Progress
from promptlang.bench.shapes import shape_from_config
from promptlang.runtime.engine import LLM
from promptlang.bench.latency.results import LatencyOptions, LatencyReport
from promptlang.bench.latency.sweep import _Case, _Stores, _measure, _warm_up
from promptlang.bench.latency.decode import _compare_decode
from promptlang.bench.latency.goals import _nearest, latency_goals


def run_latency(llm: LLM, options: LatencyOptions = LatencyOptions(), *,
                model_source: str | os.PathLike | None = None, model_name: str = "",
                workdir: str | os.PathLike | None = None,
                progress: bool = True) -> LatencyReport:
    """Measure every length of `options` on `llm`'s model (its own store is not touched).
    `model_source` is what `load()` was given (None: the default model): the decode
    comparison loads a stock copy from it. Disk-tier files go to a temporary folder
    under `workdir` (default: the system's), removed at the end."""
    started = time.perf_counter()
    adapter = llm.adapter
    tokenizer = llm.tokenizer
    shape = shape_from_config(adapter.config)
    weight_bytes = floor.module_weight_bytes(adapter.model)
    kv_per_token = adapter.kv_bytes_per_token()
    best, sgemms = floor.best_sgemm(floor.candidate_shapes(shape))
    sampler = floor.FloorSampler(best)

    goal = _nearest(options.lengths, options.goal_length) if options.lengths else None
    cases = []
    skipped = []
    for length in options.lengths:
        case = _Case.make(tokenizer, length, options.seed)
        room = (options.decode_tokens + 16) if length == goal else 1   # 16: question slack
        if llm.max_positions is None or case.end + room <= llm.max_positions:
            cases.append(case)
        else:
            skipped.append(length)
    goal = goal if goal in {c.length for c in cases} else None
    steps = len(cases) * (1 + options.samples + 3 * options.repeats) + \
        ((options.decode_samples + options.repeats * native.available())
         if goal is not None else 0)

    points = []
    decode_result = None
    with tempfile.TemporaryDirectory(prefix=".kv-latency-", dir=workdir) as folder, \
            Progress(total=steps, desc="latency", enabled=progress) as bar:
        if cases:
            _warm_up(llm, Path(folder), options.seed, sampler)
        for case in cases:
            stores = _Stores(llm, Path(folder))
            try:
                point = _measure(stores, case, options, sampler, bar, goal)
                point.flops = floor.prefill_flops(shape, point.uncached_tokens,
                                                  point.cached_tokens)
                point.read_bytes = weight_bytes + point.cached_tokens * kv_per_token
                points.append(point)
                bar.write(f"latency: {point.cached_tokens:,} cached tokens: baseline "
                          f"{point.median('baseline'):.3f} s, cached "
                          f"{point.median('device'):.4f} s")
                if case.length == goal:
                    decode_result = _compare_decode(stores, case, options, model_source, bar)
            finally:
                stores.close()

    machine = floor.Machine(statistics.median(r for p in points for r in p.rates)
                            if points else best.flops_per_s,
                            statistics.median(b for p in points for b in p.bandwidths)
                            if points else 0.0,
                            torch.get_num_threads(), f"{best.name} ({best.what})")
    name = model_name or getattr(tokenizer, "name", "") or shape.name
    report = LatencyReport(options, name, floor.machine_facts(machine), weight_bytes,
                           kv_per_token, points, skipped, decode_result, [],
                           time.perf_counter() - started, sgemms)
    report.goals = latency_goals(report)
    return report
