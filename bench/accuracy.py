"""`promptlang bench accuracy`: what modular encoding costs in answers, and what
selective recompute (issue 8) wins back at what TTFT.

Every item of the synthetic QA set (qa.py: single-document lookup, cross-document
bridge, a pronoun-dependent second document, a needle in long filler, same-shape
documents about people with a job and a town) is answered
greedily under every setting, each document a module of its own:

  baseline       the same tokens at positions 0..N-1, full causal attention, no reuse
  cached         the default rule, guaranteed context: a document attends to itself and
                 the schema text before it, never to the other documents
  cached+SPEC    the same cached documents, with the recompute policy SPEC applied per
                 request (runtime/recompute.py): "first:K" recomputes the first K cached
                 tokens of every non-root unit (EPIC), "deviation:F" the fraction F of the
                 candidate tokens whose layer-1 KV deviates most from a full pass (in the
                 spirit of CacheBlend)
  cached-bf16    cached, from a bfloat16 store (half the KV bytes; read in place by the fused
                 layers of Llama-family models, else widened to float32 when a request
                 assembles them): what the 16-bit store costs in answers
  isolate        the paper's rule: a document attends only to itself
  isolate+SPEC   isolated documents with SPEC applied
  scaffold       the item's documents in one scaffold, encoded jointly (full attention among
                 them): what the paper offers when modules must see each other

The specs come from `AccuracyOptions.recompute` (`--recompute`), the rules they apply to
from `recompute_rules` (`--recompute-rules`); `scaffold=False` (`--no-scaffold`) leaves the
scaffold setting out and `store16=False` (`--no-bf16`) the cached-bf16 one. Every setting of one rule reads the same module encodings (one store
per rule), so a recompute setting costs only its own per-request work. The explicit "none"
for cached/isolate/scaffold keeps them free of any default policy of the LLM or schema.
`run_accuracy(..., workers=N)` (`--workers`) shares the items among N processes.

Reported per setting and question kind: exact match (qa.exact_match: the answer's words
open the normalized output), answer in output (qa.answer_in_output: the answer occurs as
whole words in the generated text, up to `max_new_tokens` = 32 by default, room for a
sentence: small models answer in sentences, "The occupation of X is a nurse"; an output
where another person's value for the asked attribute, a distractor answer, comes first or
alone counts as wrong, and as "distracted"), agreement with the baseline (the same
generated token ids), the mean TTFT (encoding included where a setting encodes: each
item's prompt is used once) and the mean number of recomputed tokens.

Per item and setting two quantities need no decoding luck: the gold answer's
teacher-forced log-probability (its tokens, `llm.tokenizer.encode(answer)`, fed after the
setting's own prefill into the request's own KV buffer through the engine's prefill, the
call that verifies decoding drafts; summed, and per token) and KL(baseline || setting) of
the next-token distribution at the first generated position. Per setting and kind, every
metric is compared with the baseline item by item: the mean difference with a paired
bootstrap 95% interval (metrics.py: `resamples` resamples of the items, seed
`bootstrap_seed`), and the mean KL with its interval.

Each item has a schema of its own, so positions start at 0 for every item and the only
difference between the settings is what the document tokens attend to.

Decoding is greedy and exact, but cheap: a setting's answer usually repeats most of the
tokens another setting already produced ("The occupation of Cyprian Hargrove is a ..."),
and answers copy spans of the question and the documents, so the answers decoded before
it, or else the prompt's continuation of the last tokens (prompt lookup), serve as drafts.
The model checks a draft in one pass over its tokens and keeps the longest prefix that
greedy decoding itself would have picked (speculative decoding with the model as its own
verifier): the same tokens as one token at a time, up to float rounding on exact
near-ties, at a few passes per answer instead of one per token.

Recovery. For a recompute setting S and a metric m on a question kind, the gap is
m(baseline) - m(cached) and the recovery (m(S) - m(cached)) / gap; with no gap (<= 0) there
is nothing to recover and the goal says so instead of passing. Its interval is the paired
bootstrap one of the ratio (metrics.recovery_interval).

Recompute cost at ~6k tokens (`cost_tokens`): one dependent item scaled up to about that many
tokens in `cost_docs` document modules plus its question; the baseline full-prefill TTFT
(`cost_baseline_repeats` requests) and, per setting, the warm TTFT (the units already
encoded by an untimed request per setting before any timed request; median of
`cost_repeats` requests taken round robin over the settings), all with one new token
(`Result.timings.first_token`).

The goal (issue 8): a recompute setting (cached+SPEC or isolate+SPEC, each measured
against the cached gap) that is at least 10x faster than the baseline at ~6k tokens
recovers at least half of the cached-versus-baseline gap on the dependent items, judged by
answer-in-output (GOAL_METRIC; exact match and the gold log-prob are reported beside it:
the default model answers in sentences, so its exact match is near zero under every
setting). It is judged on intervals, not on point estimates: with k settings fast enough,
each recovery interval is taken at the Bonferroni level 1 - 0.05/k (picking the best of
k is part of the test), and the goal passes when the best one's low end is >= 50%.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

from promptlang.pml.recompute import Recompute
from promptlang.bench import metrics, qa
from promptlang.bench.settings import (BASE_SETTINGS, DEFAULT_RECOMPUTE, DESCRIPTIONS,  # noqa: F401
                                       QUICK_RECOMPUTE, RECOMPUTE_RULES, SETTINGS, STORE16,
                                       normalize_specs, settings, split_setting)
from promptlang.bench.report import Goal, Progress, Section

STORE_BUDGET = 512 << 20      # bytes of KV each setting's store keeps (LRU past that)
COST_STORE_BUDGET = 4 << 30   # the ~6k section's stores: every setting's units fit
GOAL_KIND = "dependent"
GOAL_METRIC = "found"         # the goal's metric: answer in output ("correct": exact match)
GOAL_RECOVERY = 0.5
GOAL_SPEEDUP = 10.0
GOAL_NAME = "recompute recovers >= half the cached-vs-baseline gap at >= 10x"
METRIC_NAMES = {"found": "answer in output", "correct": "exact match"}


@dataclass(frozen=True)
class AccuracyOptions:
    items_per_kind: int = 10         # small: `bench all` stays fast; the issue-8 run: 200
    kinds: tuple[str, ...] = qa.KINDS
    seed: int = 0
    docs_per_item: int = 4
    doc_words: int | None = None     # None: qa.DEFAULT_DOC_WORDS per kind
    max_new_tokens: int = 32         # room for a sentence answer
    recompute: tuple[str, ...] = DEFAULT_RECOMPUTE   # policies; each adds RULE+SPEC settings
    recompute_rules: tuple[str, ...] = RECOMPUTE_RULES   # ... for these rules
    scaffold: bool = True            # the scaffold setting (the baseline's tokens, jointly)
    store16: bool = True             # the cached-bf16 setting (cached, bfloat16 store)
    cost_tokens: int = 6000          # the recompute cost section's prompt (0: skip it)
    cost_docs: int = 4
    cost_repeats: int = 3            # warm cached requests per setting (median)
    cost_baseline_repeats: int = 1
    resamples: int = metrics.RESAMPLES     # bootstrap resamples of the items
    bootstrap_seed: int = metrics.SEED

    @classmethod
    def quick(cls) -> "AccuracyOptions":
        return cls(items_per_kind=1, docs_per_item=2, doc_words=20, max_new_tokens=4,
                   recompute=QUICK_RECOMPUTE, cost_tokens=256, cost_docs=2, cost_repeats=1)

    @property
    def settings(self) -> tuple[str, ...]:
        return settings(self.recompute, self.recompute_rules, self.scaffold, self.store16)


@dataclass
class Answer:
    text: str
    token_ids: list[int]
    correct: bool            # exact match
    found: bool              # the answer somewhere in the output
    same_as_baseline: bool
    ttft: float
    encode: float
    recomputed: int = 0      # cached tokens computed again for this request
    select: float = 0.0      # seconds choosing them (deviation)
    passes: int = 0          # decode passes after the first token (drafts verified)
    gold_logprob: float = math.nan   # teacher-forced log-probability of the gold answer
    gold_tokens: int = 0             # ... summed over this many tokens
    kl: float = math.nan     # KL(baseline || this) at the first generated position, nats
    distracted: bool = False         # a distractor's answer before (or without) the gold

    @property
    def gold_logprob_token(self) -> float:
        """The gold answer's mean log-probability per token."""
        return self.gold_logprob / self.gold_tokens if self.gold_tokens else math.nan


@dataclass
class ItemResult:
    item: qa.QAItem
    prompt_tokens: int
    answers: dict[str, Answer]

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.item.id, "kind": self.item.kind, "question": self.item.question,
                "answer": self.item.answer, "answer_docs": list(self.item.answer_docs),
                "distractor_answers": list(self.item.distractor_answers),
                "prompt_tokens": self.prompt_tokens,
                "settings": {name: {"text": a.text, "correct": a.correct, "found": a.found,
                                    "same_as_baseline": a.same_as_baseline,
                                    "ttft_s": a.ttft, "encode_s": a.encode,
                                    "recomputed_tokens": a.recomputed, "select_s": a.select,
                                    "decode_passes": a.passes, "distracted": a.distracted,
                                    "gold_logprob": _finite(a.gold_logprob),
                                    "gold_tokens": a.gold_tokens, "kl": _finite(a.kl),
                                    "token_ids": a.token_ids}
                             for name, a in self.answers.items()}}


@dataclass
class Score:
    """One (setting, kind) cell."""

    setting: str
    kind: str              # a qa kind, or "all"
    items: int
    correct: int           # exact matches
    found: int             # answers found in the output
    agree: int             # same tokens as the baseline
    ttft: float            # mean seconds, encoding included
    encode: float          # mean seconds spent encoding
    recomputed: float = 0.0   # mean recomputed tokens per request
    distracted: int = 0       # outputs with a distractor's answer before (or without) the gold
    gold_logprob: float = math.nan        # mean teacher-forced gold log-probability
    gold_logprob_token: float = math.nan  # ... per gold token
    kl: float = math.nan      # mean KL(baseline || setting) at the first generated position

    @property
    def accuracy(self) -> float:
        return self.correct / self.items if self.items else 0.0

    def rate(self, metric: str) -> float:
        """The share of items that count for `metric` ("correct", "found" or "agree")."""
        return getattr(self, metric) / self.items if self.items else 0.0

    def row(self) -> dict[str, Any]:
        low, high = wilson_interval(self.correct, self.items)
        return {"setting": self.setting, "kind": self.kind, "items": self.items,
                "correct": self.correct, "accuracy": self.accuracy, "ci95_low": low,
                "ci95_high": high, "found": self.found,
                "found_rate": self.found / self.items if self.items else 0.0,
                "agree_with_baseline": self.agree,
                "agreement": self.agree / self.items if self.items else 0.0,
                "mean_ttft_s": self.ttft, "mean_encode_s": self.encode,
                "mean_recomputed_tokens": self.recomputed, "distracted": self.distracted,
                "mean_gold_logprob": _finite(self.gold_logprob),
                "mean_gold_logprob_per_token": _finite(self.gold_logprob_token),
                "mean_kl": _finite(self.kl)}


@dataclass(frozen=True)
class Comparison:
    """One (setting, kind) cell against the baseline, item by item: paired bootstrap
    intervals of the mean differences (setting - baseline) and of the mean KL."""

    setting: str
    kind: str
    found: metrics.Interval          # answer in output, difference of rates
    correct: metrics.Interval        # exact match, difference of rates
    gold_logprob: metrics.Interval   # gold log-probability (sum), difference in nats
    gold_logprob_token: metrics.Interval   # ... per token
    kl: metrics.Interval             # mean KL(baseline || setting), nats

    def row(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in ("found", "correct", "gold_logprob", "gold_logprob_token", "kl"):
            interval = getattr(self, name)
            key = name if name == "kl" else f"{name}_delta"
            out |= {f"{key}": interval.estimate if interval.n else None,
                    f"{key}_low": interval.low if interval.n else None,
                    f"{key}_high": interval.high if interval.n else None}
        return out


@dataclass
class CostPoint:
    """Warm TTFTs of one setting at ~6k tokens."""

    setting: str
    seconds: list[float]
    recomputed: int = 0
    select: float = 0.0      # median seconds choosing the tokens (deviation)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


@dataclass
class CostReport:
    prompt_tokens: int
    cached_tokens: int
    docs: int
    baseline: list[float]
    points: list[CostPoint]
    target: int = 0
    note: str = ""           # e.g. why the prompt is shorter than asked
    seconds: float = 0.0     # the section's wall time, encoding included

    @property
    def baseline_median(self) -> float:
        return statistics.median(self.baseline)

    def point(self, setting: str) -> CostPoint | None:
        return next((p for p in self.points if p.setting == setting), None)

    def ttft(self, setting: str) -> float | None:
        if setting == "baseline":
            return self.baseline_median
        point = self.point(setting)
        return None if point is None else point.median

    def speedup(self, setting: str) -> float | None:
        """Baseline TTFT over the setting's (median over median)."""
        ttft = self.ttft(setting)
        return None if ttft is None or ttft <= 0 else self.baseline_median / ttft


@dataclass
class AccuracyReport:
    options: AccuracyOptions
    model: str
    results: list[ItemResult]
    seconds: float
    scores: list[Score] = field(default_factory=list)
    cost: CostReport | None = None
    goals: list[Goal] = field(default_factory=list)
    workers: int = 1         # processes that answered the items
    store16_read: str = "widened on assembly"    # how requests read the bfloat16 units
    comparisons: list[Comparison] = field(default_factory=list)

    @property
    def settings(self) -> tuple[str, ...]:
        return _settings_of(self.results) or self.options.settings

    def rows(self) -> list[dict[str, Any]]:
        """Per cell: the Score's columns, then the Comparison's (intervals vs baseline)."""
        paired = {(c.setting, c.kind): c.row() for c in self.comparisons}
        return [s.row() | paired.get((s.setting, s.kind), {}) for s in self.scores]

    def comparison(self, setting: str, kind: str) -> Comparison | None:
        return next((c for c in self.comparisons if c.setting == setting and c.kind == kind),
                    None)

    def cell(self, setting: str, kind: str) -> Score | None:
        return next((s for s in self.scores if s.setting == setting and s.kind == kind), None)


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a proportion (0, 0 for no trials)."""
    if n == 0:
        return 0.0, 0.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def make_items(options: AccuracyOptions) -> list[qa.QAItem]:
    """The items, kinds interleaved (item 0 of each kind, then item 1, ...)."""
    by_kind = [qa.generate(options.items_per_kind, options.seed, kind, options.docs_per_item,
                           options.doc_words) for kind in options.kinds]
    return [items[i] for i in range(options.items_per_kind) for items in by_kind]


def _rule_llms(llm, budget: int) -> dict:
    import torch

    from promptlang.runtime.engine import LLM
    from promptlang.runtime.store import ModuleStore

    device = llm.adapter.device
    return {rule: LLM(llm.adapter, llm.tokenizer,
                      ModuleStore(device, budget, disk_budget_bytes=0, dtype=dtype,
                                  compute_dtype=dtype),       # as load(store_dtype=...) does
                      isolate=isolate)
            for rule, isolate, dtype in (("context", False, None), ("isolate", True, None),
                                         ("context16", False, torch.bfloat16))}


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
    report.goals = [recovery_goal(report)]
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


def _requests(item: qa.QAItem, llms: dict, names: Sequence[str]) -> dict[str, tuple]:
    """setting -> (llm, prompt, schema, baseline, recompute spec)."""
    schema, prompt = qa.to_pml(item, f"qa-{item.id}")
    joint_schema, joint_prompt = qa.to_pml(item, f"qa-{item.id}-joint", mode="scaffold")
    requests = {}
    for name in names:
        rule, spec = split_setting(name)
        if rule == "baseline":
            requests[name] = (llms["context"], prompt, schema, True, "none")
        elif rule == "scaffold":
            requests[name] = (llms["context"], joint_prompt, joint_schema, False, spec)
        elif rule == STORE16:
            requests[name] = (llms["context16"], prompt, schema, False, spec)
        elif rule in ("cached", "isolate"):
            requests[name] = (llms["context" if rule == "cached" else "isolate"], prompt,
                              schema, False, spec)
        else:
            raise ValueError(f"unknown setting {name!r}")
    return requests


def _family(setting: str) -> str:
    rule = split_setting(setting)[0]
    return {"baseline": "full", "scaffold": "full", STORE16: "cached"}.get(rule, rule)


def _finite(value: float) -> float | None:
    """JSON has no NaN: None for a value that was not measured."""
    return None if math.isnan(value) else value


def gold_ids(llm, item: qa.QAItem) -> list[int]:
    """The gold answer's tokens as the assistant's reply would start with them."""
    return list(llm.tokenizer.encode(item.answer))


def _answer(item: qa.QAItem, llms: dict, options: AccuracyOptions, names: Sequence[str],
            bar: Progress) -> ItemResult:
    requests = _requests(item, llms, names)
    answers: dict[str, Answer] = {}
    tokens, reference, reference_logprobs = 0, None, None
    gold = gold_ids(llms["context"], item)
    for setting in names:
        llm, prompt, schema, baseline, spec = requests[setting]
        # drafts: this rule's answers first, the most recent first, then the others
        earlier = list(answers.items())[::-1]
        drafts = [a.token_ids for s, a in earlier if _family(s) == _family(setting)] + \
                 [a.token_ids for s, a in earlier if _family(s) != _family(setting)]
        decoded = greedy_answer(llm, prompt, schema, baseline=baseline, recompute=spec,
                                max_new_tokens=options.max_new_tokens, drafts=drafts,
                                gold=gold)
        if baseline:
            reference, tokens = decoded.token_ids, decoded.prompt_tokens
            reference_logprobs = decoded.first_logprobs
        kl = math.nan if reference_logprobs is None else \
            metrics.kl_divergence(reference_logprobs, decoded.first_logprobs)
        text, others = decoded.text, item.distractor_answers
        answers[setting] = Answer(text, decoded.token_ids, qa.exact_match(text, item.answer),
                                  qa.answer_in_output(text, item.answer, others),
                                  decoded.token_ids == reference, decoded.ttft, decoded.encode,
                                  decoded.recomputed, decoded.select, decoded.passes,
                                  decoded.gold_logprob, len(gold), kl,
                                  qa.distracted(text, item.answer, others))
        bar.note(item=item.id, setting=setting)
        bar.update()
    return ItemResult(item, tokens, answers)


@dataclass
class Decoded:
    text: str
    token_ids: list[int]
    finish_reason: str
    ttft: float              # seconds from the call to the first picked token
    encode: float
    recomputed: int
    select: float
    prompt_tokens: int       # tokens in the request's buffer after its prefill
    passes: int              # model passes after the first token
    gold_logprob: float = math.nan    # sum of the gold tokens' log-probabilities
    first_logprobs: Any = None        # float64 numpy [V]: the first generated position's


def teacher_forced(llm, buffer, position: int, first_logits, gold: Sequence[int]) -> float:
    """The summed log-probability of the tokens `gold` right after the request in
    `buffer`: gold[0] from the prefill's `first_logits`, the rest from one pass that feeds
    gold[:-1] into the request's own buffer (the prefill call decoding verifies drafts
    with), which is then rolled back. NaN when the model has no positions left."""
    import torch

    from promptlang.runtime.generate import prefill

    if not gold:
        return math.nan
    limit = llm.max_positions
    if limit is not None and position + len(gold) - 1 > limit:
        return math.nan
    rows = [first_logits.reshape(1, -1)]
    feed = list(gold[:-1])
    if feed:
        if buffer.length + len(feed) > buffer.capacity:
            buffer.reserve(buffer.length + len(feed))
        start = buffer.length
        rows.append(prefill(llm.adapter, buffer, feed, range(position, position + len(feed)),
                            all_logits=True))
        buffer.length = start           # the gold tokens were never generated: drop them
    logprobs = torch.log_softmax(torch.cat(rows).double(), dim=-1)
    picked = logprobs[torch.arange(len(gold)), torch.tensor(list(gold))]
    return float(picked.sum())


LOOKUP_NGRAM = 3       # prompt lookup: match up to this many last tokens in the prompt
LOOKUP_TOKENS = 8      # and propose this many tokens that follow the match


def lookup_draft(context: Sequence[int], generated: Sequence[int], count: int) -> list[int]:
    """Prompt lookup: the `count` tokens that follow the latest occurrence in `context` of
    the longest suffix of `generated` (LOOKUP_NGRAM tokens at most); [] if none occurs.
    Answers copy names and values from the question and the documents."""
    for n in range(min(LOOKUP_NGRAM, len(generated)), 0, -1):
        tail = list(generated[-n:])
        for start in range(len(context) - n, -1, -1):
            if list(context[start:start + n]) == tail:
                follow = list(context[start + n:start + n + count])
                if follow:
                    return follow
    return []


def greedy_answer(llm, prompt, schema, *, baseline: bool = False, recompute: str = "none",
                  max_new_tokens: int = 16, drafts: Sequence[Sequence[int]] = (),
                  gold: Sequence[int] = ()) -> Decoded:
    """What `llm.generate(prompt, schema=schema, baseline=baseline, recompute=recompute,
    max_new_tokens=max_new_tokens)` answers greedily, decoded with drafts verified by the
    model. Each pass feeds the picked token and a draft of what follows: the rest of the
    first of `drafts` (earlier answers, preferred first) that agrees with the tokens so
    far, else a `lookup_draft` from the prompt; it keeps the draft's tokens up to the first
    one greedy decoding would not have picked, and the token it picks there.

    Also returns the first generated position's log-probabilities and, for the token
    ids `gold`, their teacher-forced log-probability on the same request (`teacher_forced`)."""
    import torch

    from promptlang.runtime.generate import prefill
    from promptlang.runtime.sampling import Decoding, SamplingParams

    started = time.perf_counter()
    opened = llm.open(prompt, schema=schema, baseline=baseline, room=max_new_tokens + 1,
                      add_generation_prompt=True, recompute=recompute)
    buffer, position = opened.buffer, opened.position
    limit = llm.max_positions
    decoding = Decoding(SamplingParams(max_new_tokens=max_new_tokens), llm.tokenizer)
    passes = 0
    try:
        prompt_tokens = buffer.length
        token, _, finished = decoding.step(opened.logits)
        ttft = time.perf_counter() - started
        first_logprobs = torch.log_softmax(opened.logits.double(), dim=-1).cpu().numpy()
        context = opened.bound.token_ids()
        buffer.materialize()          # every pass reads all of the KV: one piece
        gold_logprob = teacher_forced(llm, buffer, position, opened.logits, gold)
        while not finished:
            if limit is not None and position >= limit:
                decoding.finish("length")
                break
            out = decoding.token_ids
            room = max_new_tokens - len(out)        # tokens still to pick, `token` fed first
            if limit is not None:
                room = min(room, limit - position)
            draft = next((list(d[len(out):len(out) + room - 1]) for d in drafts
                          if len(d) > len(out) and list(d[:len(out)]) == out), None)
            if draft is None:
                draft = lookup_draft(context + out[:-1], out, min(LOOKUP_TOKENS, room - 1))
            feed = [token] + draft
            if buffer.length + len(feed) > buffer.capacity:
                buffer.reserve(buffer.length + len(feed) + max_new_tokens)
            start = buffer.length
            rows = prefill(llm.adapter, buffer, feed, range(position, position + len(feed)),
                           all_logits=len(feed) > 1)
            passes += 1
            for kept in range(len(feed)):        # rows[i]: the prediction after feed[i]
                token, _, finished = decoding.step(rows[kept])
                if finished or kept == len(draft) or token != draft[kept]:
                    break
            buffer.length = start + kept + 1     # feed[:kept + 1] were the right tokens
            position += kept + 1
    finally:
        llm.assembler.release(buffer)
    text, token_ids, reason = decoding.result()
    t = opened.timings
    return Decoded(text, token_ids, reason, ttft, t.encode, opened.recomputed_tokens,
                   getattr(t, "select", 0.0), prompt_tokens, passes, gold_logprob,
                   first_logprobs)


def _settings_of(results: Sequence[ItemResult]) -> tuple[str, ...]:
    return tuple(results[0].answers) if results else ()


def score(results: Sequence[ItemResult], kinds: Sequence[str],
          names: Sequence[str] | None = None) -> list[Score]:
    """One Score per (setting, kind), then per setting over all kinds. `names`: the
    settings (default: those of the first result)."""
    mean = lambda values: statistics.fmean(values) if values else 0.0  # noqa: E731
    measured = lambda values: statistics.fmean(v for v in values if not math.isnan(v)) \
        if any(not math.isnan(v) for v in values) else math.nan  # noqa: E731
    scores = []
    for setting in names or _settings_of(results):
        for kind in [*kinds, "all"]:
            mine = [r for r in results if kind == "all" or r.item.kind == kind]
            answers = [r.answers[setting] for r in mine]
            scores.append(Score(setting, kind, len(answers), sum(a.correct for a in answers),
                                sum(a.found for a in answers),
                                sum(a.same_as_baseline for a in answers),
                                mean([a.ttft for a in answers]), mean([a.encode for a in answers]),
                                mean([a.recomputed for a in answers]),
                                sum(a.distracted for a in answers),
                                measured([a.gold_logprob for a in answers]),
                                measured([a.gold_logprob_token for a in answers]),
                                measured([a.kl for a in answers])))
    return scores


PER_ITEM = {   # metric -> its value for one answer (booleans as 0/1, NaN: not measured)
    "found": lambda a: float(a.found), "correct": lambda a: float(a.correct),
    "gold_logprob": lambda a: a.gold_logprob,
    "gold_logprob_token": lambda a: a.gold_logprob_token, "kl": lambda a: a.kl}


def item_values(results: Sequence[ItemResult], setting: str, kind: str,
                metric: str) -> list[float]:
    """`metric` of `setting`'s answer on every item of `kind` ("all": every item)."""
    value = PER_ITEM[metric]
    return [value(r.answers[setting]) for r in results
            if kind == "all" or r.item.kind == kind]


def compare(results: Sequence[ItemResult], kinds: Sequence[str],
            names: Sequence[str] | None = None, *, resamples: int = metrics.RESAMPLES,
            seed: int = metrics.SEED) -> list[Comparison]:
    """One Comparison per (setting, kind) and per setting over all kinds; empty when
    the baseline was not run."""
    names = list(names or _settings_of(results))
    if "baseline" not in names:
        return []
    out = []
    for setting in names:
        for kind in [*kinds, "all"]:
            def diff(metric: str) -> metrics.Interval:
                return metrics.paired_difference(
                    item_values(results, setting, kind, metric),
                    item_values(results, "baseline", kind, metric),
                    resamples=resamples, seed=seed)
            kl = metrics.mean_interval(item_values(results, setting, kind, "kl"),
                                       resamples=resamples, seed=seed)
            out.append(Comparison(setting, kind, diff("found"), diff("correct"),
                                  diff("gold_logprob"), diff("gold_logprob_token"), kl))
    return out


# --- recovery and the goal --------------------------------------------------------------

@dataclass(frozen=True)
class Recovery:
    """How much of the cached-vs-baseline gap a setting wins back on one kind and metric."""

    setting: str
    kind: str
    metric: str
    baseline: float          # means over the items (rates in [0, 1] for found/correct)
    cached: float
    value: float
    interval: metrics.Interval = metrics.NO_ITEMS   # the recovery's paired bootstrap one

    @property
    def gap(self) -> float:
        return self.baseline - self.cached

    @property
    def recovery(self) -> float | None:
        """(setting - cached) / gap; None when there is no gap (<= 0) to recover."""
        if self.gap <= 0:
            return None
        return (self.value - self.cached) / self.gap


def recovery(report: AccuracyReport, setting: str, kind: str, metric: str = GOAL_METRIC,
             level: float = metrics.LEVEL) -> Recovery | None:
    """The Recovery of `setting` on `kind` by `metric` ("found", "correct" or
    "gold_logprob"), with its interval at `level` (None if either was not measured)."""
    if any(report.cell(s, kind) is None or not report.cell(s, kind).items
           for s in ("baseline", "cached", setting)):
        return None
    columns = [item_values(report.results, s, kind, metric)
               for s in ("baseline", "cached", setting)]
    if not len(metrics.paired_columns(*columns)[0]):
        return None          # measured on no item (gold log-probs: no gold tokens)
    base, cached, value = (float(c.mean()) if len(c) else math.nan
                           for c in metrics.paired_columns(*columns))
    o = report.options
    interval = metrics.recovery_interval(*columns, resamples=o.resamples,
                                         seed=o.bootstrap_seed, level=level)
    return Recovery(setting, kind, metric, base, cached, value, interval)


def recompute_settings(report: AccuracyReport) -> list[str]:
    return [s for s in report.settings if "+" in s]


def _pct(rate: float) -> str:
    return f"{100 * rate:.1f}%"


def _share(value: float) -> str:
    if math.isinf(value):
        return "-inf" if value < 0 else "+inf"
    return f"{100 * value:+.0f}%"


def _recovery_text(r: Recovery | None) -> str:
    """"recovers 75% [+20%, +130%]" (the interval at r.interval.level)."""
    if r is None:
        return "not measured"
    if r.recovery is None:
        return "no gap"
    i = r.interval
    return f"recovers {100 * r.recovery:.0f}% [{_share(i.low)}, {_share(i.high)}]"


def recovery_goal(report: AccuracyReport) -> Goal:
    """The issue-8 goal on GOAL_KIND items, by GOAL_METRIC, judged on intervals: among
    the recompute settings at least GOAL_SPEEDUP x faster than the baseline (k of them),
    it passes when one's recovery interval at the Bonferroni level 1 - 0.05/k (so that
    picking the best of k is accounted for) lies at or above GOAL_RECOVERY."""
    names = recompute_settings(report)
    if GOAL_KIND not in report.options.kinds:
        return Goal(GOAL_NAME, None, f"no {GOAL_KIND} items in this run (--kinds)")
    if not names:
        return Goal(GOAL_NAME, None, "no recompute setting in this run (--recompute)")
    if report.cost is None:
        return Goal(GOAL_NAME, None, "the ~6k-token cost was not measured (--cost-tokens 0)")
    metric = METRIC_NAMES[GOAL_METRIC]
    fast = [s for s in names if (report.cost.speedup(s) or 0) >= GOAL_SPEEDUP]
    level = metrics.bonferroni(metrics.LEVEL, len(fast) or len(names))
    found = {s: recovery(report, s, GOAL_KIND, level=level) for s in names}
    exact = {s: recovery(report, s, GOAL_KIND, "correct", level=level) for s in names}
    logprob = {s: recovery(report, s, GOAL_KIND, "gold_logprob", level=level) for s in names}
    first = next(iter(found.values()))
    n = report.cell("baseline", GOAL_KIND).items
    gap = report.comparison("cached", GOAL_KIND)
    gap_text = "" if gap is None else \
        f", cached - baseline {gap.found.text(100, 1)} points (95%)"
    head = (f"{GOAL_KIND}, {metric} (exact match beside it), {n} items: baseline "
            f"{_pct(first.baseline)} ({_pct(exact[names[0]].baseline)}), cached "
            f"{_pct(first.cached)} ({_pct(exact[names[0]].cached)}){gap_text}")
    at = f"~{report.cost.prompt_tokens:,} tokens"
    if first.gap <= 0:
        return Goal(GOAL_NAME, None, f"{head}: no gap to recover (cached is not worse than "
                                     f"the baseline by {metric})")

    def describe(s: str) -> str:
        speed = report.cost.speedup(s)
        text = (f"{s} {_pct(found[s].value)} {_recovery_text(found[s])} of the "
                f"{100 * first.gap:.1f}-point gap (exact match {_pct(exact[s].value)}, "
                f"{_recovery_text(exact[s])}; gold log-prob {_recovery_text(logprob[s])})")
        return text + (f", {speed:.1f}x faster than the baseline at {at}"
                       if speed is not None else ", cost not measured")

    def rank(s: str) -> tuple:
        return (found[s].interval.low, found[s].recovery, report.cost.speedup(s) or 0)

    best_any = max(names, key=rank)
    intervals = (f"intervals at {100 * level:.4g}% (Bonferroni over {len(fast) or len(names)} "
                 f"settings); PASS needs the low end >= {100 * GOAL_RECOVERY:.0f}%")
    if not fast:
        return Goal(GOAL_NAME, False, f"{head}; no recompute setting is {GOAL_SPEEDUP:g}x "
                                      f"faster than the baseline at {at}; best by recovery: "
                                      f"{describe(best_any)}; {intervals}")
    best = max(fast, key=rank)
    detail = f"{head}; best at >= {GOAL_SPEEDUP:g}x: {describe(best)}"
    if best_any != best:
        detail += f"; best regardless of speed: {describe(best_any)}"
    return Goal(GOAL_NAME, found[best].interval.low >= GOAL_RECOVERY,
                f"{detail}; {intervals}")


# --- the recompute cost at ~6k tokens ---------------------------------------------------

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
    target, note = options.cost_tokens, ""
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
    baseline, points = [], []
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
        cached_tokens = timed["cached"][-1].cached_tokens if "cached" in timed else 0
    return CostReport(tokens, cached_tokens, max(2, options.cost_docs), baseline, points,
                      options.cost_tokens, note, time.perf_counter() - started)


# --- tables and sections ----------------------------------------------------------------

def accuracy_table(report: AccuracyReport, count: str = "correct") -> list[dict[str, Any]]:
    """Rows of setting x kind cells "hits/items (pct)", counting Score.`count`
    ("correct", "found" or "agree"; "agree" leaves out the baseline itself)."""
    kinds = [*report.options.kinds, "all"]
    cells = {(s.setting, s.kind): s for s in report.scores}
    rows = []
    for setting in report.settings:
        if count == "agree" and setting == "baseline":
            continue
        row: dict[str, Any] = {"setting": setting}
        for kind in kinds:
            s = cells[(setting, kind)]
            hits = getattr(s, count)
            row[kind] = f"{hits}/{s.items} ({100 * hits / s.items:.0f}%)" if s.items else "n/a"
        if count != "agree":
            s = cells[(setting, "all")]
            low, high = wilson_interval(getattr(s, count), s.items)
            row["95% CI (all)"] = f"{100 * low:.0f}-{100 * high:.0f}%"
        if count == "correct":
            row["mean TTFT s"] = round(s.ttft, 3)
            row["recomputed"] = round(s.recomputed, 1)
        rows.append(row)
    return rows


def _recovered(r: Recovery, interval: bool = False) -> str:
    if r.recovery is None:
        return "no gap"
    text = f"{100 * r.recovery:+.0f}%"
    if interval:
        text += f" [{_share(r.interval.low)}, {_share(r.interval.high)}]"
    return text


def recovery_table(report: AccuracyReport) -> list[dict[str, Any]]:
    """Per recompute setting and kind: its answer-in-output rate and the share of the
    cached-vs-baseline gap it recovers with its 95% paired bootstrap interval (exact
    match's share in brackets)."""
    rows = []
    for setting in recompute_settings(report):
        row: dict[str, Any] = {"setting": setting}
        for kind in [*report.options.kinds, "all"]:
            found, exact = (recovery(report, setting, kind, m) for m in ("found", "correct"))
            if found is None:
                row[kind] = "n/a"
                continue
            row[kind] = (f"{_pct(found.value)} {_recovered(found, interval=True)} "
                         f"({_recovered(exact)})")
        if report.cost is not None:
            speed = report.cost.speedup(setting)
            row["x faster at ~6k"] = None if speed is None else round(speed, 1)
        rows.append(row)
    return rows


def paired_table(report: AccuracyReport) -> list[dict[str, Any]]:
    """Per kind and setting (the baseline left out): answer in output, its difference
    from the baseline in points, the gold answer's log-probability difference (sum and
    per token, nats) and the mean KL(baseline || setting), each with its 95% paired
    bootstrap interval."""
    rows = []
    for kind in [*report.options.kinds, "all"]:
        for setting in report.settings:
            cell, paired = report.cell(setting, kind), report.comparison(setting, kind)
            if setting == "baseline" or cell is None or paired is None or not cell.items:
                continue
            rows.append({"kind": kind, "setting": setting,
                         "answer in output": f"{cell.found}/{cell.items} "
                                             f"({100 * cell.rate('found'):.0f}%)",
                         "distracted": cell.distracted,
                         "delta pts [95% CI]": paired.found.text(100, 1),
                         "gold log-prob delta": paired.gold_logprob.text(1, 2),
                         "per token": paired.gold_logprob_token.text(1, 3),
                         "KL nats [95% CI]": paired.kl.text(1, 4, signed=False)})
    return rows


def cost_table(cost: CostReport) -> list[dict[str, Any]]:
    rows = [{"setting": "baseline", "TTFT s": round(cost.baseline_median, 3),
             "min s": round(min(cost.baseline), 3), "recomputed": 0, "select s": 0.0,
             "baseline / setting": 1.0, ">= 10x": ""}]
    for p in cost.points:
        speed = cost.speedup(p.setting)
        rows.append({"setting": p.setting, "TTFT s": round(p.median, 4),
                     "min s": round(min(p.seconds), 4), "recomputed": p.recomputed,
                     "select s": round(p.select, 4),
                     "baseline / setting": None if speed is None else round(speed, 1),
                     ">= 10x": "PASS" if speed is not None and speed >= GOAL_SPEEDUP
                     else "FAIL"})
    return rows


def store16_effect(report: AccuracyReport) -> list[str]:
    """cached-bf16 against cached: the same answers how often, and the rates side by side."""
    both = [r for r in report.results if STORE16 in r.answers and "cached" in r.answers]
    if not both:
        return []
    same = sum(r.answers[STORE16].token_ids == r.answers["cached"].token_ids for r in both)
    lines = [f"{STORE16} gives the same greedy tokens as cached (float32 store) on {same}/"
             f"{len(both)} items ({100 * same / len(both):.0f}%), at half the KV bytes per token"]
    for kind in [*report.options.kinds, "all"]:
        a, b = report.cell("cached", kind), report.cell(STORE16, kind)
        if a is not None and b is not None and a.items:
            lines.append(f"{kind}: answer in output {_pct(a.rate('found'))} (float32) vs "
                         f"{_pct(b.rate('found'))} (bfloat16); exact match "
                         f"{_pct(a.rate('correct'))} vs {_pct(b.rate('correct'))}")
    if report.cost is not None and report.cost.ttft(STORE16) and report.cost.ttft("cached"):
        lines.append(f"TTFT at ~{report.cost.prompt_tokens:,} tokens: "
                     f"{report.cost.ttft('cached') * 1e3:.1f} ms (float32) vs "
                     f"{report.cost.ttft(STORE16) * 1e3:.1f} ms (bfloat16, "
                     f"{report.store16_read})")
    return lines


def sections(report: AccuracyReport) -> list[Section]:
    o = report.options
    words = "default lengths" if o.doc_words is None else f"{o.doc_words} words each"
    specs = ", ".join(o.recompute) or "none"
    parts = [
        Section("Exact match by question kind", accuracy_table(report), [
            f"items per kind: {o.items_per_kind}; documents per item: {o.docs_per_item} "
            f"({words}), seed {o.seed}, greedy, at most {o.max_new_tokens} new tokens; "
            f"model {report.model}; recompute policies: {specs}",
            *(f"{name}: {text}" for name, text in DESCRIPTIONS.items()),
            "mean TTFT includes encoding the item's documents where a setting encodes them "
            "(each prompt is used once); recomputed: mean cached tokens computed again",
            f"wall time {report.seconds / 60:.1f} min" + (
                f"; items answered by {report.workers} worker processes (their TTFTs include "
                "each other's contention)" if report.workers > 1 else "")]),
        Section("Answer in the output, before any distractor's",
                accuracy_table(report, "found"),
                ["the answer as whole words in the generated text, with no distractor answer "
                 "(another person's value for the asked attribute, qa.answer_in_output) "
                 "before its first occurrence"]),
        Section("Same greedy output as the baseline", accuracy_table(report, "agree"),
                ["identical generated token ids"]),
    ]
    if report.comparisons:
        parts.append(Section("Against the baseline, item by item", paired_table(report), [
            "delta: mean of (setting - baseline) over the items, in points of answer in "
            "output; gold log-prob: the gold answer's tokens teacher-forced after the "
            "setting's own prefill, summed (and per token), in nats; KL: KL(baseline || "
            "setting) of the first generated token's distribution, in nats",
            f"[low, high]: 95% paired bootstrap intervals ({o.resamples:,} resamples of the "
            f"items, seed {o.bootstrap_seed}); distracted: outputs with a distractor's answer "
            "before, or instead of, the gold one"]))
    effect = store16_effect(report)
    if effect:
        parts.append(Section("A bfloat16 store against a float32 one", (), effect))
    if recompute_settings(report):
        parts.append(Section("Recompute: the cached-vs-baseline gap won back",
                             recovery_table(report), [
            "per kind: answer-in-output rate, then the share of the gap (baseline - "
            "cached) the setting recovers: (setting - cached) / gap, with its 95% paired "
            "bootstrap interval (-inf: resamples without a gap); exact match's recovery in "
            "brackets; 'no gap' where cached is not worse than the baseline",
            "isolate+SPEC is measured against the same cached (guaranteed context) gap"]))
    if report.cost is not None:
        c = report.cost
        parts.append(Section(f"Recompute cost at ~{c.prompt_tokens:,} tokens", cost_table(c), [
            f"one {GOAL_KIND} item scaled to {c.prompt_tokens:,} prompt tokens "
            f"({c.cached_tokens:,} cached) in {c.docs} document modules plus its question"
            + (f" ({c.note})" if c.note else ""),
            f"baseline: full prefill, median of {len(c.baseline)}; each setting warm (its "
            f"units encoded by an untimed request), median of {o.cost_repeats}; one new "
            "token; recomputed: tokens computed again per request; select: seconds choosing "
            "them (deviation's layer-1 pass)",
            f"this section took {c.seconds / 60:.1f} min, encoding included"]))
    parts.append(Section("Goal (issue 8)", (), [str(g) for g in report.goals]))
    return parts


def plot(report: AccuracyReport, path, note: str = "") -> Path:
    """Answer-in-output rate (dependent items, and all kinds) against the warm TTFT at
    ~6k tokens, one labelled point per setting, the baseline included, and a dashed line
    where a setting is 10x faster than the baseline; written as PNG. Needs the cost
    section (report.cost)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if report.cost is None:
        raise ValueError("no recompute cost measured: nothing to plot against")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    kinds = [k for k in (GOAL_KIND, "all") if k == "all" or k in report.options.kinds]
    fig, axes = plt.subplots(1, len(kinds), figsize=(6 * len(kinds), 4.8), squeeze=False)
    try:
        for ax, kind in zip(axes[0], kinds):
            shown = 0
            for setting in report.settings:
                ttft, cell = report.cost.ttft(setting), report.cell(setting, kind)
                if ttft is None or cell is None or not cell.items:
                    continue
                rule = split_setting(setting)[0]
                marker = {"baseline": "s", "cached": "o", "isolate": "^"}.get(rule, "D")
                y = 100 * cell.rate("found")
                ax.scatter([ttft], [y], marker=marker)
                ax.annotate(setting, (ttft, y), fontsize=7, textcoords="offset points",
                            xytext=(5, (5, -10, 14)[shown % 3]))     # staggered: no overlap
                shown += 1
            ax.axvline(report.cost.baseline_median / GOAL_SPEEDUP, color="grey",
                       linestyle="--", label=f"{GOAL_SPEEDUP:g}x faster than the baseline")
            ax.set_xscale("log")
            ax.set_ylim(bottom=0)
            ax.set_xlabel(f"warm TTFT at ~{report.cost.prompt_tokens:,} tokens (s)")
            ax.set_ylabel("answer in output (%)")
            ax.set_title(f"{kind} items")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(loc="lower right", fontsize=7)
        fig.suptitle(f"Accuracy against TTFT, {report.model}{note}")
        fig.tight_layout()
        fig.savefig(path, format="png", dpi=120)
    finally:
        plt.close(fig)
    return path


def to_json(report: AccuracyReport) -> dict[str, Any]:
    from dataclasses import asdict

    cost = None
    if report.cost is not None:
        cost = asdict(report.cost) | {"baseline_median_s": report.cost.baseline_median,
                                      "speedup": {p.setting: report.cost.speedup(p.setting)
                                                  for p in report.cost.points}}
    return {"model": report.model, "options": asdict(report.options),
            "settings": list(report.settings), "seconds": report.seconds,
            "scores": report.rows(), "cost": cost,
            "bootstrap": {"resamples": report.options.resamples,
                          "seed": report.options.bootstrap_seed, "level": metrics.LEVEL},
            "goals": [asdict(g) | {"verdict": g.verdict} for g in report.goals]}
