"""`promptlang bench accuracy`: what modular encoding costs in answers.

Every item of the synthetic QA set (qa.py: single-document lookup, cross-document
bridge, a pronoun-dependent second document, a needle in long filler) is answered
greedily under four settings, each document a module of its own:

  baseline  the same tokens at positions 0..N-1, full causal attention, no reuse
  cached    the default rule, guaranteed context: a document attends to itself and the
            schema text before it, never to the other documents
  isolate   the paper's rule: a document attends only to itself
  scaffold  the item's documents in one scaffold, encoded jointly (full attention among
            them): what the paper offers when modules must see each other

Reported per setting and question kind: exact match (qa.exact_match: the answer's words
open the normalized output), answer in output (the answer occurs as whole words anywhere in
the generated text: small models answer in sentences, "The occupation of X is a nurse"),
and agreement with the baseline (the same generated token ids). Each item has a schema
of its own, so positions start at 0 for every item and the only difference between the
settings is what the document tokens attend to. Each setting encodes its documents the
first time it sees them: the cached TTFTs here include that encoding (these prompts are
used once).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from promptlang.runtime.bench import qa
from promptlang.runtime.bench.report import Progress, Section

SETTINGS = ("baseline", "cached", "isolate", "scaffold")
DESCRIPTIONS = {
    "baseline": "full prefill, no reuse",
    "cached": "modules, guaranteed context (default rule)",
    "isolate": "modules, isolated (the paper's rule)",
    "scaffold": "one scaffold per item (joint encoding)",
}
STORE_BUDGET = 512 << 20      # bytes of KV each setting's store keeps (LRU past that)


@dataclass(frozen=True)
class AccuracyOptions:
    items_per_kind: int = 20
    kinds: tuple[str, ...] = qa.KINDS
    seed: int = 0
    docs_per_item: int = 4
    doc_words: int | None = None     # None: qa.DEFAULT_DOC_WORDS per kind
    max_new_tokens: int = 16

    @classmethod
    def quick(cls) -> "AccuracyOptions":
        return cls(items_per_kind=1, docs_per_item=2, doc_words=20, max_new_tokens=4)


@dataclass
class Answer:
    text: str
    token_ids: list[int]
    correct: bool            # exact match
    found: bool              # the answer somewhere in the output
    same_as_baseline: bool
    ttft: float
    encode: float


@dataclass
class ItemResult:
    item: qa.QAItem
    prompt_tokens: int
    answers: dict[str, Answer]

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.item.id, "kind": self.item.kind, "question": self.item.question,
                "answer": self.item.answer, "answer_docs": list(self.item.answer_docs),
                "prompt_tokens": self.prompt_tokens,
                "settings": {name: {"text": a.text, "correct": a.correct, "found": a.found,
                                    "same_as_baseline": a.same_as_baseline,
                                    "ttft_s": a.ttft, "encode_s": a.encode,
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

    @property
    def accuracy(self) -> float:
        return self.correct / self.items if self.items else 0.0

    def row(self) -> dict[str, Any]:
        low, high = wilson_interval(self.correct, self.items)
        return {"setting": self.setting, "kind": self.kind, "items": self.items,
                "correct": self.correct, "accuracy": self.accuracy, "ci95_low": low,
                "ci95_high": high, "found": self.found,
                "found_rate": self.found / self.items if self.items else 0.0,
                "agree_with_baseline": self.agree,
                "agreement": self.agree / self.items if self.items else 0.0,
                "mean_ttft_s": self.ttft, "mean_encode_s": self.encode}


@dataclass
class AccuracyReport:
    options: AccuracyOptions
    model: str
    results: list[ItemResult]
    seconds: float
    scores: list[Score] = field(default_factory=list)

    def rows(self) -> list[dict[str, Any]]:
        return [s.row() for s in self.scores]


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


def run_accuracy(llm, options: AccuracyOptions = AccuracyOptions(), *, model_name: str = "",
                 progress: bool = True) -> AccuracyReport:
    """Answer every item under every setting with `llm`'s model (its store untouched)."""
    from promptlang.runtime.engine import LLM
    from promptlang.runtime.store import ModuleStore

    started = time.perf_counter()
    device = llm.adapter.device
    llms = {rule: LLM(llm.adapter, llm.tokenizer,
                      ModuleStore(device, STORE_BUDGET, disk_budget_bytes=0), isolate=isolate)
            for rule, isolate in (("context", False), ("isolate", True))}
    items = make_items(options)
    results = []
    with Progress(total=len(items) * len(SETTINGS), desc="accuracy", enabled=progress) as bar:
        for item in items:
            results.append(_answer(item, llms, options, bar))
    name = model_name or getattr(llm.tokenizer, "name", "") or ""
    report = AccuracyReport(options, name, results, time.perf_counter() - started)
    report.scores = score(results, options.kinds)
    return report


def _answer(item: qa.QAItem, llms: dict, options: AccuracyOptions, bar: Progress) -> ItemResult:
    schema, prompt = qa.to_pml(item, f"qa-{item.id}")
    joint_schema, joint_prompt = qa.to_pml(item, f"qa-{item.id}-joint", mode="scaffold")
    requests = {
        "baseline": (llms["context"], prompt, schema, True),
        "cached": (llms["context"], prompt, schema, False),
        "isolate": (llms["isolate"], prompt, schema, False),
        "scaffold": (llms["context"], joint_prompt, joint_schema, False),
    }
    answers, tokens, reference = {}, 0, None
    for setting in SETTINGS:
        llm, this_prompt, this_schema, baseline = requests[setting]
        result = llm.generate(this_prompt, schema=this_schema, baseline=baseline,
                              max_new_tokens=options.max_new_tokens)
        if baseline:
            reference, tokens = result.token_ids, result.prefill_tokens
        answers[setting] = Answer(result.text, result.token_ids,
                                  qa.exact_match(result.text, item.answer),
                                  qa.mentions(result.text, item.answer),
                                  result.token_ids == reference, result.timings.first_token,
                                  result.timings.encode)
        bar.note(item=item.id, setting=setting)
        bar.update()
    return ItemResult(item, tokens, answers)


def score(results: Sequence[ItemResult], kinds: Sequence[str]) -> list[Score]:
    """One Score per (setting, kind), then per setting over all kinds."""
    scores = []
    for setting in SETTINGS:
        for kind in [*kinds, "all"]:
            mine = [r for r in results if kind == "all" or r.item.kind == kind]
            answers = [r.answers[setting] for r in mine]
            mean = lambda values: statistics.fmean(values) if values else 0.0  # noqa: E731
            scores.append(Score(setting, kind, len(answers), sum(a.correct for a in answers),
                                sum(a.found for a in answers),
                                sum(a.same_as_baseline for a in answers),
                                mean([a.ttft for a in answers]), mean([a.encode for a in answers])))
    return scores


def accuracy_table(report: AccuracyReport, count: str = "correct") -> list[dict[str, Any]]:
    """Rows of setting x kind cells "hits/items (pct)", counting Score.`count`
    ("correct", "found" or "agree"; "agree" leaves out the baseline itself)."""
    kinds = [*report.options.kinds, "all"]
    cells = {(s.setting, s.kind): s for s in report.scores}
    rows = []
    for setting in SETTINGS:
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
        rows.append(row)
    return rows


def sections(report: AccuracyReport) -> list[Section]:
    o = report.options
    words = "default lengths" if o.doc_words is None else f"{o.doc_words} words each"
    return [
        Section("Exact match by question kind", accuracy_table(report), [
            f"items per kind: {o.items_per_kind}; documents per item: {o.docs_per_item} "
            f"({words}), seed {o.seed}, greedy, at most {o.max_new_tokens} new tokens; "
            f"model {report.model}",
            *(f"{name}: {text}" for name, text in DESCRIPTIONS.items()),
            "mean TTFT includes encoding the item's documents (each prompt is used once)"]),
        Section("Answer anywhere in the output", accuracy_table(report, "found"),
                ["the answer as whole words anywhere in the generated text"]),
        Section("Same greedy output as the baseline", accuracy_table(report, "agree"),
                ["identical generated token ids"]),
    ]


def to_json(report: AccuracyReport) -> dict[str, Any]:
    from dataclasses import asdict

    return {"model": report.model, "options": asdict(report.options),
            "seconds": report.seconds, "scores": report.rows()}
