"""`run_accuracy`: the items (kinds interleaved), answered in this process or shared among
worker processes, then the cost section, scores, paired comparisons and the goal.

run_accuracy -> cost.measure_cost; make_items -> answer._answer per item ->
scores.score / compare / recovery_goal -> AccuracyReport.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

from promptlang.bench import qa
from promptlang.bench.report import Progress
from promptlang.bench.accuracy.results import (AccuracyOptions, AccuracyReport, ItemResult,
                                               STORE_BUDGET)
from promptlang.bench.accuracy.answer import _answer, _rule_llms
from promptlang.bench.accuracy.scores import compare, recovery_goal, score
from promptlang.bench.accuracy.seams import seam_goals
from promptlang.bench.accuracy.cost import measure_cost


def make_items(options: AccuracyOptions) -> list[qa.QAItem]:
    """The items, kinds interleaved (item 0 of each kind, then item 1, ...)."""
    by_kind = [qa.generate(options.items_per_kind, options.seed, kind, options.docs_per_item,
                           options.doc_words) for kind in options.kinds]
    return [items[i] for i in range(options.items_per_kind) for items in by_kind]


def run_accuracy(llm, options: AccuracyOptions = AccuracyOptions(), *, model_name: str = "",
                 progress: bool = True, workers: int = 1, model_source: str | None = None,
                 worker_threads: int | None = None) -> AccuracyReport:
    """Answer every item under every setting with `llm`'s model (its store untouched),
    measure the recompute cost at ~`options.cost_tokens` tokens, and check the goal.

    workers > 1: the items are shared among that many processes, each loading
    `engine.load(model_source)` (the same model as `llm`: the caller's to ensure) and
    running `worker_threads` torch threads (default: this process's threads / workers).
    Answers are the same; the items' TTFTs then include the workers' contention, so they
    compare settings within the run only. The cost section always runs in this process,
    alone, before the workers start."""
    import torch

    started = time.perf_counter()
    names = options.settings
    cost = None
    if options.cost_tokens:
        cost = measure_cost(llm, options, names, progress=progress)
    items = make_items(options)
    with Progress(total=len(items) * len(names), desc="accuracy", enabled=progress) as bar:
        if workers > 1 and len(items) > 1:
            results = _answer_in_workers(items, options, workers, model_source,
                                         worker_threads, bar)
        else:
            llms = _rule_llms(llm, STORE_BUDGET)
            results = [_answer(item, llms, options, names, bar) for item in items]
    name = model_name or getattr(llm.tokenizer, "name", "") or ""
    report = AccuracyReport(options, name, results, time.perf_counter() - started, cost=cost)
    if llm.adapter.shares_dtype(torch.bfloat16):
        report.store16_read = "read in place by the fused layers"
    report.scores = score(results, options.kinds, names)
    report.comparisons = compare(results, options.kinds, names, resamples=options.resamples,
                                 seed=options.bootstrap_seed)
    report.goals = [recovery_goal(report), *seam_goals(report)]
    report.workers = max(1, min(workers, len(items)))
    return report


class _Quiet:
    """A stand-in for the progress bar inside worker processes."""

    def note(self, **values: Any) -> None:
        pass

    def update(self, n: int = 1) -> None:
        pass


_WORKER: dict[str, Any] = {}


def _worker_start(model_source: str | None, threads: int, options: AccuracyOptions) -> None:
    import torch

    from promptlang.runtime import engine

    torch.set_num_threads(threads)
    _WORKER.update(llms=_rule_llms(engine.load(model_source), STORE_BUDGET), options=options)


def _worker_answer(item: qa.QAItem) -> ItemResult:
    options = _WORKER["options"]
    return _answer(item, _WORKER["llms"], options, options.settings, _Quiet())


def _answer_in_workers(items: Sequence[qa.QAItem], options: AccuracyOptions, workers: int,
                       model_source: str | None, threads: int | None,
                       bar: Progress) -> list[ItemResult]:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    import torch

    workers = min(workers, len(items))
    threads = threads or max(1, torch.get_num_threads() // workers)
    context = multiprocessing.get_context("spawn")     # fork would copy torch's thread pools
    results: dict[int, ItemResult] = {}
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_worker_start,
                             initargs=(model_source, threads, options)) as pool:
        futures = {pool.submit(_worker_answer, item): i for i, item in enumerate(items)}
        for future in as_completed(futures):
            results[futures[future]] = future.result()
            bar.note(item=items[futures[future]].id)
            bar.update(len(options.settings))
    return [results[i] for i in range(len(items))]
