"""The recompute cost at ~6k tokens: one dependent item scaled up to `cost_tokens`, the
baseline's TTFT and every setting's warm TTFT, taken round robin over the settings.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from typing import Sequence

from promptlang.bench import qa
from promptlang.bench.report import Progress
from promptlang.bench.accuracy.results import (AccuracyOptions, COST_STORE_BUDGET, CostPoint,
                                               CostReport)
from promptlang.bench.accuracy.answer import _requests, _rule_llms


EXACT_SETTINGS = ("cached+seams", "cached+exact")     # policies that leave units exact
SEEN_BEFORE = ", seen before"    # "cached+exact, seen before": the same request again


def seen_before(setting: str) -> str:
    """The cost row of `setting`'s request repeated with exact reuse on."""
    return setting + SEEN_BEFORE


def _exact_reuse(llm, setting: str, request, repeats: int) -> CostPoint:
    """`setting`'s request once more on an LLM with exact reuse (the settings' own have it
    off): the first request stores its exact units, the timed repeats are served them."""
    from promptlang.runtime.engine import LLM

    this, prompt, schema, _, spec = request
    # the settings' store: every timed request of the section has run by now; no prompt
    # tails, as the settings' own LLMs (the question is computed on every repeat)
    reuse = LLM(this.adapter, this.tokenizer, this.store, isolate=this.isolate,
                tail_budget_bytes=0)
    results = [reuse.generate(prompt, schema=schema, max_new_tokens=1, recompute=spec)
               for _ in range(1 + repeats)][1:]
    if any(r.exact_units == 0 for r in results):
        raise AssertionError("a repeated exact request was not served its exact units")
    return CostPoint(seen_before(setting), [r.timings.first_token for r in results],
                     results[-1].recomputed_tokens)


def cost_item(llm, options: AccuracyOptions, target: int):
    """(item, schema, prompt, tokens): one dependent item whose prompt has about
    `target` tokens in `options.cost_docs` documents (two tries at the word count)."""
    docs = max(2, options.cost_docs)
    words = max(1, round(target / docs / 1.3))
    overhead = None
    for attempt in range(3):
        item = qa.generate(1, options.seed, "dependent", docs, words)[0]
        schema, prompt = qa.to_pml(item, f"qa-cost-{target}-{words}")
        tokens = len(llm.bind(prompt, schema=schema).token_ids())
        if overhead is None:     # schema text and question: measured with one-word docs
            tiny = qa.generate(1, options.seed, "dependent", docs, 1)[0]
            ts, tp = qa.to_pml(tiny, f"qa-cost-{target}-tiny")
            overhead = len(llm.bind(tp, schema=ts).token_ids())
        if attempt == 2 or abs(tokens - target) <= 0.03 * target or tokens <= overhead:
            return item, schema, prompt, tokens
        words = max(1, round(words * (target - overhead) / max(1, tokens - overhead)))
    raise AssertionError("unreachable")


def measure_cost(llm, options: AccuracyOptions, names: Sequence[str] | None = None, *,
                 progress: bool = True) -> CostReport:
    """Baseline and warm per-setting TTFT (one new token) on ~cost_tokens tokens."""
    started = time.perf_counter()
    names = list(names or options.settings)
    target = options.cost_tokens
    note = ""
    limit = llm.max_positions
    if limit is not None and target + options.max_new_tokens + 8 > limit:
        target = max(64, limit - options.max_new_tokens - 64)
        note = f"asked for {options.cost_tokens:,} tokens; the model holds {limit:,}"
    llms = _rule_llms(llm, COST_STORE_BUDGET)
    item, _, _, tokens = cost_item(llms["context"], options, target)
    item = replace(item, id=f"cost-{tokens}")     # schema names apart from the QA items'
    requests = _requests(item, llms, ["baseline", *names])
    cached_requests = [n for n in names if n != "baseline"]
    total = options.cost_baseline_repeats + len(cached_requests) * (1 + options.cost_repeats)
    baseline = []
    points = []
    with Progress(total=total, desc="recompute cost", enabled=progress) as bar:
        for setting in cached_requests:     # untimed: encodes the units (and warms up)
            this, this_prompt, this_schema, _, spec = requests[setting]
            this.generate(this_prompt, schema=this_schema, max_new_tokens=1, recompute=spec)
            bar.note(setting=setting)
            bar.update()
        for _ in range(options.cost_baseline_repeats):
            this, this_prompt, this_schema = requests["baseline"][:3]
            result = this.generate(this_prompt, schema=this_schema, baseline=True,
                                   max_new_tokens=1)
            baseline.append(result.timings.first_token)
            bar.note(setting="baseline")
            bar.update()
        timed: dict[str, list] = {s: [] for s in cached_requests}
        for _ in range(options.cost_repeats):   # round robin: no setting twice in a row
            for setting in cached_requests:
                this, this_prompt, this_schema, _, spec = requests[setting]
                result = this.generate(this_prompt, schema=this_schema, max_new_tokens=1,
                                       recompute=spec)
                timed[setting].append(result)
                bar.note(setting=setting)
                bar.update()
        for setting, results in timed.items():
            points.append(CostPoint(setting, [r.timings.first_token for r in results],
                                    results[-1].recomputed_tokens,
                                    statistics.median(getattr(r.timings, "select", 0.0)
                                                      for r in results)))
        for setting in EXACT_SETTINGS:
            if setting in timed:
                points.append(_exact_reuse(llm, setting, requests[setting],
                                           options.cost_repeats))
        cached_tokens = timed["cached"][-1].cached_tokens if "cached" in timed else 0
    return CostReport(tokens, cached_tokens, max(2, options.cost_docs), baseline, points,
                      options.cost_tokens, note, time.perf_counter() - started)
