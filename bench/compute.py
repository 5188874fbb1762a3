"""`promptlang bench compute`: bfloat16 compute (runtime/model/compute.py) against float32,
on one adapter, in one run.

The model's adapter gets its bfloat16 twin (if the load did not give it one). The float32
side runs the same adapter with the twin turned off (`float32_passes`). Each side has an
engine and a store of its own (their KV differ), and every measurement alternates the
sides' order from round to round:

  rag      a new combination under `exact` (k of N ~700-token documents, a set no earlier
           request used, the store's documents encoded apart beforehand): time to the
           first token, float32 and bfloat16, and transformers' own float32 prefill of
           the same token ids (the model called as transformers runs it, no cache)
  encode   a cold encode of one long module (~6.4k tokens) into an empty store
  decode   greedy time per token at that module's context (decode steps are one row:
           both sides take the float32 paths: the check is that nothing got slower)

Numerics: for every RAG request, whether the two sides' first tokens agree, and
|delta log-prob| of the float32 side's first token, and for every decode whether the two
greedy continuations are the same tokens.
"""

from __future__ import annotations

import contextlib
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from promptlang.bench.latency.sweep import document, timed_first_token
from promptlang.bench.rag import build_prompt, build_schema, documents
from promptlang.bench.report import Goal, Progress, Section, Spread, ratios
from promptlang.pml import nodes
from promptlang.runtime.engine import LLM
from promptlang.runtime.model.compute import attach_bf16, cpu_bf16_units
from promptlang.runtime.store import ModuleStore

SIDES = ("float32", "bfloat16")
RAG_GOAL = 4.0            # bfloat16 exact over float32 exact
PEER_GOAL = 5.0           # bfloat16 exact over transformers' float32 prefill
ENCODE_GOAL = 4.0         # cold encode, bfloat16 over float32
DECODE_SLACK = 1.05       # bfloat16 decode may measure this much slower (noise), no more


@dataclass(frozen=True)
class ComputeOptions:
    docs: int = 8
    k: int = 4
    requests: int = 6
    doc_tokens: int = 700
    long_tokens: int = 6400
    encode_rounds: int = 3
    decode_tokens: int = 24
    decode_rounds: int = 3
    seed: int = 0

    @classmethod
    def quick(cls) -> "ComputeOptions":
        return cls(docs=3, k=2, requests=2, doc_tokens=40, long_tokens=120, encode_rounds=1,
                   decode_tokens=3, decode_rounds=1)


@dataclass
class ComputeReport:
    options: ComputeOptions
    model: str
    units: tuple[str, ...]
    min_rows: int | None = None
    skipped: str = ""
    rag: list[dict] = field(default_factory=list)       # per request: seconds per side, ...
    encode: list[dict] = field(default_factory=list)    # per round: seconds per side
    decode: list[dict] = field(default_factory=list)    # per round: s/token per side, same
    seconds: float = 0.0

    def goals(self) -> list[Goal]:
        if self.skipped:
            return [Goal("bfloat16 compute", None, self.skipped)]
        goals = []
        if self.rag:
            up = Spread.of(ratios([r["float32"] for r in self.rag],
                                  [r["bfloat16"] for r in self.rag]))
            peer = Spread.of(ratios([r["transformers"] for r in self.rag],
                                    [r["bfloat16"] for r in self.rag]))
            goals.append(Goal(f"new combination under exact >= {RAG_GOAL:g}x float32",
                              up.median >= RAG_GOAL,
                              f"{up.describe(unit='x')} over {len(self.rag)} requests"))
            goals.append(Goal(f"new combination under exact >= {PEER_GOAL:g}x transformers' "
                              "float32 prefill", peer.median >= PEER_GOAL,
                              f"{peer.describe(unit='x')}"))
        if self.encode:
            up = Spread.of(ratios([r["float32"] for r in self.encode],
                                  [r["bfloat16"] for r in self.encode]))
            goals.append(Goal(f"cold encode of the long module >= {ENCODE_GOAL:g}x float32",
                              up.median >= ENCODE_GOAL,
                              f"{up.describe(unit='x')} at {self.encode[0]['tokens']:,} tokens"))
        if self.decode:
            slower = Spread.of(ratios([r["bfloat16"] for r in self.decode],
                                      [r["float32"] for r in self.decode]))
            goals.append(Goal("decode at the long context no slower than float32",
                              slower.median <= DECODE_SLACK,
                              f"bfloat16 / float32 time per token {slower.describe(unit='x')} "
                              f"(at most {DECODE_SLACK:g}: noise)"))
        return goals


def run_compute(llm: LLM, options: ComputeOptions = ComputeOptions(), *, model_name: str = "",
                progress: bool = True) -> ComputeReport:
    """Measure bfloat16 compute against float32 on `llm`'s adapter (module docstring)."""
    started = time.perf_counter()
    adapter = llm.adapter
    report = ComputeReport(options, model_name, cpu_bf16_units())
    if not report.units:
        report.skipped = "not measured: this CPU has neither AMX nor AVX512-BF16"
        return report
    if adapter.compute is None:
        attach_bf16(adapter, progress=lambda text: print(f"promptlang bench: {text}"))
    report.min_rows = adapter.compute.min_rows
    engines = {side: LLM(adapter, llm.tokenizer, ModuleStore(adapter.device, disk_budget_bytes=0),
                         recompute="exact", exact_reuse=False, tail_budget_bytes=0)
               for side in SIDES}
    total = options.requests + options.encode_rounds + options.decode_rounds
    with Progress(total=total, desc="compute", enabled=progress) as bar:
        _rag(engines, options, report, bar)
        _long(engines, options, report, bar)
    report.seconds = time.perf_counter() - started
    return report


@contextlib.contextmanager
def _on(engine: LLM, side: str):
    """Passes of `engine` on `side`: the float32 side turns the twin off meanwhile."""
    adapter = engine.adapter
    if side == "bfloat16":
        yield
        return
    with adapter.lock, adapter.float32_passes():
        yield


def _rag(engines: dict[str, LLM], options: ComputeOptions, report: ComputeReport,
         bar: Progress) -> None:
    tokenizer = engines["float32"].tokenizer
    texts, questions = documents(tokenizer, options.docs, options.doc_tokens, options.seed)
    schema = build_schema(texts)
    for side, engine in engines.items():
        with _on(engine, side):
            engine.encode(schema)
    model = engines["float32"].adapter.model
    rng = random.Random(f"promptlang.bench.compute:{options.seed}")
    seen: set[frozenset[int]] = set()
    for j in range(options.requests):
        docs = _new_set(rng, options.docs, options.k, seen)
        prompt = build_prompt(docs, questions[docs[0]])
        ids = engines["float32"].bind(prompt).token_ids()
        got: dict[str, Any] = {}
        order = list(SIDES) + ["transformers"]
        order = order[j % 3:] + order[:j % 3]
        for side in order:
            if side == "transformers":
                got[side] = _transformers_prefill(model, ids)
                continue
            with _on(engines[side], side):
                got[side] = timed_first_token(engines[side], prompt)
        lp32 = got["float32"][1].float().log_softmax(-1)
        lp16 = got["bfloat16"][1].float().log_softmax(-1)
        token = int(lp32.argmax())
        report.rag.append({
            "docs": list(docs), "tokens": len(ids),
            "float32": got["float32"][0], "bfloat16": got["bfloat16"][0],
            "transformers": got["transformers"][0],
            "same_first_token": token == int(lp16.argmax()),
            "same_as_transformers": token == int(got["transformers"][1].argmax()),
            "abs_delta_logprob": abs(float(lp32[token] - lp16[token])),
            "kl": float((lp32.exp() * (lp32 - lp16)).sum())})
        bar.update()


def _new_set(rng: random.Random, n: int, k: int, seen: set) -> tuple[int, ...]:
    """k of n documents in a random order, a set not drawn before while one is left."""
    for _ in range(1000):
        docs = tuple(rng.sample(range(n), k))
        if frozenset(docs) not in seen:
            break
    seen.add(frozenset(docs))
    return docs


def _transformers_prefill(model, ids) -> tuple[float, torch.Tensor]:
    """(seconds, last logits) of transformers' own float32 forward over `ids`, no cache."""
    with torch.inference_mode():
        began = time.perf_counter()
        out = model(input_ids=torch.tensor([ids]), use_cache=False, logits_to_keep=1)
        logits = out.logits[0, -1]
        int(logits.argmax())
        return time.perf_counter() - began, logits


def _long(engines: dict[str, LLM], options: ComputeOptions, report: ComputeReport,
          bar: Progress) -> None:
    tokenizer = engines["float32"].tokenizer
    text, item = document(tokenizer, options.long_tokens, seed=options.seed + 7)
    schema = nodes.Schema("compute-long", (
        nodes.RoleOpen("user"), nodes.Module("doc", (nodes.Text(text + "\n\n"),))))
    tokens = len(tokenizer.encode(text))
    for j in range(options.encode_rounds):
        row: dict[str, Any] = {"tokens": tokens}
        for side in (SIDES if j % 2 == 0 else SIDES[::-1]):
            engine = engines[side]
            fresh = LLM(engine.adapter, engine.tokenizer,
                        ModuleStore(engine.adapter.device, disk_budget_bytes=0),
                        recompute="exact", exact_reuse=False, tail_budget_bytes=0)
            with _on(fresh, side):
                began = time.perf_counter()
                fresh.encode(schema)
                row[side] = time.perf_counter() - began
            engines[side] = fresh
        report.encode.append(row)
        bar.update()
    prompt = nodes.PromptDoc("compute-long", (
        nodes.ModuleRef("doc"), nodes.Text(f"Question: {item.question}"),
        nodes.RoleClose("user"), nodes.RoleOpen("assistant")))
    for j in range(options.decode_rounds):
        row = {}
        tokens_out = {}
        for side in (SIDES if j % 2 == 0 else SIDES[::-1]):
            engine = engines[side]
            with _on(engine, side):
                result = engine.generate(prompt, max_new_tokens=options.decode_tokens)
            generated = len(result.token_ids)
            tokens_out[side] = list(result.token_ids)
            row[side] = ((result.timings.total - result.timings.first_token)
                         / max(1, generated - 1))
        row["same_tokens"] = tokens_out["float32"] == tokens_out["bfloat16"]
        report.decode.append(row)
        bar.update()


def sections(report: ComputeReport) -> list[Section]:
    title = "bfloat16 compute against float32 (one adapter, one run)"
    if report.skipped:
        return [Section(title, (), [report.skipped, *map(str, report.goals())])]
    rows = []
    for name, samples, columns in (("rag: new combination, exact (TTFT)", report.rag,
                                    ("float32", "bfloat16", "transformers")),
                                   ("encode of the long module", report.encode,
                                    ("float32", "bfloat16")),
                                   ("decode at the long context (per token)", report.decode,
                                    ("float32", "bfloat16"))):
        if not samples:
            continue
        row = {"workload": name, "n": len(samples)}
        for column in columns:
            row[f"{column} ms"] = statistics.median(s[column] for s in samples) * 1e3
        rows.append(row)
    lines = [f"CPU units: {', '.join(report.units)}; the twin serves passes of "
             f"{report.min_rows}+ new tokens (measured on this CPU)"]
    if report.rag:
        same = sum(r["same_first_token"] for r in report.rag)
        peer = sum(r["same_as_transformers"] for r in report.rag)
        lines.append(
            f"rag first tokens: bfloat16 equals float32 in {same} of {len(report.rag)} "
            f"requests; float32 exact equals transformers' prefill in {peer}; mean |delta "
            f"log-prob| of the float32 token "
            f"{statistics.mean(r['abs_delta_logprob'] for r in report.rag):.4f} nats, mean "
            f"KL {statistics.mean(r['kl'] for r in report.rag):.2e}")
    if report.decode:
        same = sum(r["same_tokens"] for r in report.decode)
        lines.append(f"decode: the greedy continuations are the same tokens in {same} of "
                     f"{len(report.decode)} rounds")
    lines += [str(goal) for goal in report.goals()]
    return [Section(title, rows, lines, float_format="{:.4g}")]


def to_json(report: ComputeReport) -> dict[str, Any]:
    return {"model": report.model, "options": asdict(report.options),
            "units": list(report.units), "min_rows": report.min_rows,
            "skipped": report.skipped, "rag": report.rag, "encode": report.encode,
            "decode": report.decode, "seconds": report.seconds,
            "goals": [{"name": g.name, "passed": g.passed, "detail": g.detail}
                      for g in report.goals()]}
