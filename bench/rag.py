"""The RAG workload of `promptlang bench latency`: k of N documents per request, the
case prefix caches miss.

N documents of about `doc_tokens` tokens each (latency.document: the bench's own
filler sentences with one fact, deterministic) are sibling modules of one schema, after
a system turn. Each request imports k of them, in an order of its own, and asks the
question of one of them. `plan_requests` draws the requests (deterministic for the
seed) and labels each by what an earlier request already had:

  new        a set of documents no earlier request used
  reordered  an earlier request's set in an order not seen before
  repeat     an earlier request's documents in the same order (a new question)

Every request is served three ways, on one engine (the same adapter, weights, kernels
and pooled request buffers), in an order that rotates from request to request:

  promptlang  the cached request: the documents' KV from the store's memory tier (each
              at its schema position, whatever the order asked), the question prefilled
              (its opening served from a recent request's prompt tail where one matches
              after the same documents: runtime/kv/tails.py, as the prefix policy does);
              recompute policy `none` (documents as encoded apart: the fast path, whose
              cost in answers docs/RECOMPUTE.md gives; the default `exact` computes a new
              combination's documents after the first again), or the one `--rag-recompute`
              names (`tuned`: the question and the first token on the seam adapter)
  prefix      a prefix cache, as vLLM's automatic prefix caching and llama.cpp's prompt
              cache give one: the documents in the request's order at positions 0..N-1;
              the KV of every request it served before is kept, and a new request reuses
              the longest common token prefix with any of them and computes the rest
              (`PrefixCache`, a bench-only policy on `generate.prefill`)
  full        the prefix policy's token sequence prefilled with no reuse

Before the timed requests, each document is served once alone (the system turn, that
document and its question) by promptlang and by the prefix policy, untimed: both have
seen every document once, and the prefix cache holds each as a possible prefix. TTFT
runs from the call to the first greedy token. Ratios are per request (full / promptlang,
prefix / promptlang), summarised per kind as the median with min-max, IQR and n.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import torch

from promptlang.errors import InvalidArgumentError, PromptLangError
from promptlang.pml import nodes
from promptlang.pml.layout import module_unit_id
from promptlang.bench import qa
from promptlang.bench.latency.sweep import document, rotated, timed_first_token
from promptlang.bench.report import Progress, Section, Spread, ratios
from promptlang.runtime.engine import LLM
from promptlang.runtime.passes.prefill import prefill
from promptlang.runtime.store import ModuleStore

KINDS = ("new", "reordered", "repeat")
PLAN = ("new", "reordered", "new", "repeat")     # what request j asks for, j mod 4
SCHEMA_NAME = "rag-bench"


@dataclass(frozen=True)
class RagOptions:
    docs: int = 8                # documents in the schema
    k: int = 4                   # documents per request
    requests: int = 12           # timed requests
    doc_tokens: int = 700        # about this many tokens per document
    seed: int = 0
    recompute: str = "none"      # promptlang's policy ("tuned": the model's seam adapter)

    @classmethod
    def quick(cls) -> "RagOptions":
        return cls(docs=3, k=2, requests=4, doc_tokens=48)

    def check(self) -> None:
        if not 1 <= self.k <= self.docs:
            raise InvalidArgumentError(f"the RAG workload picks k={self.k} of {self.docs} "
                                       "documents per request: k must be between 1 and the "
                                       "number of documents (--rag-k, --rag-docs)")


# --- the requests --------------------------------------------------------------------------

@dataclass(frozen=True)
class RagRequest:
    docs: tuple[int, ...]        # document indices, in the request's order
    question_of: int             # the document the question asks about
    kind: str                    # "new", "reordered" or "repeat"


def plan_requests(n_docs: int, k: int, count: int, seed: int = 0) -> list[RagRequest]:
    """`count` requests of `k` of `n_docs` documents following PLAN (the first is new);
    a repeated order asks another of its documents' questions while one is left. When
    the wanted kind is impossible (every set used; k=1 cannot be reordered) the next one
    down is drawn; the label always says what the request is."""
    if not 1 <= k <= n_docs:
        raise InvalidArgumentError(f"need 1 <= k <= n_docs, got k={k}, n_docs={n_docs}")
    rng = random.Random(f"promptlang.bench.rag:{seed}:{n_docs}:{k}")
    orders: list[tuple[int, ...]] = []
    out = []
    for j in range(count):
        want = PLAN[j % len(PLAN)] if orders else "new"
        order = _draw(rng, want, n_docs, k, orders)
        kind = ("repeat" if order in orders else
                "reordered" if any(set(o) == set(order) for o in orders) else "new")
        asked = {r.question_of for r in out if r.docs == order}
        out.append(RagRequest(order, rng.choice([i for i in order if i not in asked] or order),
                              kind))
        orders.append(order)
    return out


def _draw(rng: random.Random, want: str, n_docs: int, k: int,
          orders: list[tuple[int, ...]], tries: int = 200) -> tuple[int, ...]:
    sets = {frozenset(o) for o in orders}
    if want == "new":
        for _ in range(tries):
            order = tuple(rng.sample(range(n_docs), k))
            if frozenset(order) not in sets:
                return order
        want = "reordered"
    if want == "reordered":
        for _ in range(tries):
            order = tuple(rng.sample(rng.choice(orders), k))
            if order not in orders:
                return order
    return rng.choice(orders)


# --- the prompts ---------------------------------------------------------------------------

def doc_module(i: int) -> str:
    return f"doc-{i}"


def build_schema(texts: Sequence[str], name: str = SCHEMA_NAME) -> nodes.Schema:
    """The system turn, then every document as a module, in index order."""
    modules = tuple(nodes.Module(doc_module(i), (nodes.Text(text + "\n\n"),))
                    for i, text in enumerate(texts))
    return nodes.Schema(name, (
        nodes.RoleOpen("system"), nodes.Text(qa.SYSTEM_PROMPT), nodes.RoleClose("system"),
        nodes.RoleOpen("user"), nodes.Text("Documents:\n\n"), *modules))


def build_prompt(docs: Sequence[int], question: str,
                 name: str = SCHEMA_NAME) -> nodes.PromptDoc:
    return nodes.PromptDoc(name, tuple(
        [nodes.ModuleRef(doc_module(i)) for i in docs] +
        [nodes.Text(f"Question: {question}"), nodes.RoleClose("user"),
         nodes.RoleOpen("assistant")]))


def request_order_ids(bound, docs: Sequence[int]) -> list[int]:
    """The token ids a prefix cache is sent: the bound request's own tokens with the
    documents in the request's order, not the schema's (what precedes the first document
    stays first, what follows the last stays last)."""
    units = {module_unit_id((doc_module(i),)): i for i in docs}
    pieces = bound.segments()
    first = min(seg.start for seg, origin in pieces if origin in units)
    head = []
    tail = []
    by_doc = {i: [] for i in docs}
    for seg, origin in pieces:
        if origin in units:
            by_doc[units[origin]] += seg.token_ids
        else:
            (head if seg.start < first else tail).extend(seg.token_ids)
    return head + [t for i in docs for t in by_doc[i]] + tail


# --- the prefix-cache policy ---------------------------------------------------------------

def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def longest_prefix(kept: Sequence[Sequence[int]], ids: Sequence[int]) -> tuple[int | None, int]:
    """(index into `kept`, tokens shared) of the kept sequence sharing the longest prefix
    with `ids`; (None, 0) when none shares a token. Ties go to the earliest kept."""
    best = None
    length = 0
    for index, other in enumerate(kept):
        n = common_prefix(other, ids)
        if n > length:
            best = index
            length = n
    return best, length


@dataclass
class Served:
    seconds: float               # from the call to the first greedy token
    logits: torch.Tensor         # [V]
    reused: int                  # tokens taken from a kept request


class PrefixCache:
    """What a prefix cache gives, on `llm`'s engine: keep the KV of every request served
    (token ids at positions 0..n-1) and serve a new one by copying the longest common
    token prefix with any of them into a request buffer and prefilling the rest with
    `generate.prefill`. The last token is always computed (its logits are the answer's
    first token). `reuse=False` makes it a full prefill of the same sequence."""

    def __init__(self, llm: LLM):
        self.llm = llm
        self.kept: list[tuple[tuple[int, ...], torch.Tensor, torch.Tensor]] = []

    def serve(self, ids: Sequence[int], reuse: bool = True, keep: bool = True) -> Served:
        adapter = self.llm.adapter
        assembler = self.llm.assembler
        ids = list(ids)
        began = time.perf_counter()
        index, reused = longest_prefix([k[0] for k in self.kept], ids) if reuse else (None, 0)
        reused = min(reused, len(ids) - 1)
        buffer = assembler.acquire(len(ids) + 1)
        try:
            buffer.forget_from(0)              # whatever units it held are overwritten
            if index is not None and reused:
                _, keys, values = self.kept[index]     # keys: [L, H_kv, S, D]
                buffer.slot_keys[:, :, :reused] = keys[:, :, :reused]
                buffer.slot_values[:, :, :reused] = values[:, :, :reused]
                device = buffer.positions.device
                buffer.positions[:reused] = torch.arange(reused, device=device)
                buffer.token_ids[:reused] = torch.tensor(ids[:reused], device=device)
            buffer.length = reused
            logits = prefill(adapter, buffer, ids[reused:], range(reused, len(ids)))[-1]
            int(torch.argmax(logits))
            seconds = time.perf_counter() - began
            if keep:
                n = len(ids)
                self.kept.append((tuple(ids), buffer.keys[:, :, :n].clone(),
                                  buffer.values[:, :, :n].clone()))
        finally:
            assembler.release(buffer)
        return Served(seconds, logits, reused)


# --- measuring -----------------------------------------------------------------------------

@dataclass
class RagSample:
    request: RagRequest
    tokens: int                  # of the request (the same on every side)
    cached_tokens: int           # promptlang's, served from the store
    reused: int                  # the prefix policy's, taken from a kept request
    promptlang: float            # seconds to the first token
    prefix: float
    full: float
    prefix_agrees: bool          # prefix policy and full prefill: same first token
    prefix_max_diff: float       # and their largest logit difference
    promptlang_agrees: bool      # promptlang and the full prefill: same first token


@dataclass
class RagReport:
    options: RagOptions
    model: str
    doc_tokens: list[int]        # each document's tokens
    samples: list[RagSample] = field(default_factory=list)
    skipped: str = ""            # why nothing was measured, if so
    seconds: float = 0.0

    def rows(self) -> list[dict[str, Any]]:
        return [{"request": j, "kind": s.request.kind,
                 "docs": " ".join(map(str, s.request.docs)), "tokens": s.tokens,
                 "cached_tokens": s.cached_tokens, "prefix_reused_tokens": s.reused,
                 "promptlang_s": s.promptlang, "prefix_s": s.prefix, "full_s": s.full,
                 "full_over_promptlang": s.full / s.promptlang,
                 "prefix_over_promptlang": s.prefix / s.promptlang,
                 "prefix_agrees_with_full": s.prefix_agrees,
                 "promptlang_agrees_with_full": s.promptlang_agrees}
                for j, s in enumerate(self.samples)]

    def by_kind(self) -> dict[str, list[RagSample]]:
        """Samples per request kind (KINDS order, kinds with samples only), then "all"."""
        groups = {kind: [s for s in self.samples if s.request.kind == kind] for kind in KINDS}
        groups = {kind: samples for kind, samples in groups.items() if samples}
        if self.samples:
            groups["all"] = list(self.samples)
        return groups


def documents(tokenizer, count: int, doc_tokens: int, seed: int) -> tuple[list[str], list[str]]:
    """`count` documents of about `doc_tokens` tokens (latency.document, deterministic for
    the seed) and the question of each."""
    texts = []
    questions = []
    for i in range(count):
        text, item = document(tokenizer, doc_tokens, seed=seed * 1000 + i)
        texts.append(text)
        questions.append(item.question)
    return texts, questions


def run_rag(llm: LLM, options: RagOptions = RagOptions(), *, model_name: str = "",
            progress: bool = True) -> RagReport:
    """Serve `options.requests` planned requests three ways on `llm`'s model (its own
    store is not touched: promptlang's side gets a store of its own)."""
    options.check()
    started = time.perf_counter()
    tokenizer = llm.tokenizer
    texts, questions = documents(tokenizer, options.docs, options.doc_tokens, options.seed)
    report = RagReport(options, model_name or getattr(tokenizer, "name", ""),
                       [len(tokenizer.encode(t)) for t in texts])
    engine = LLM(llm.adapter, tokenizer, ModuleStore(llm.adapter.device, disk_budget_bytes=0),
                 recompute=options.recompute, exact_reuse=False)
    engine.seam = llm.seam                         # policy tuned: the model's seam adapter
    schema = engine.add_schema(build_schema(texts))
    try:
        engine.layout(schema)                      # fits the model's context?
    except PromptLangError as error:
        report.skipped = f"not measured: {error}"
        return report
    engine.encode(schema)
    prefix = PrefixCache(engine)
    plan = plan_requests(options.docs, options.k, options.requests, options.seed)
    with Progress(total=options.docs + len(plan), desc="rag", enabled=progress) as bar:
        for i in range(options.docs):              # untimed: every document seen once
            prompt = build_prompt([i], questions[i])
            timed_first_token(engine, prompt)
            prefix.serve(request_order_ids(engine.bind(prompt), [i]))
            bar.update()
        for j, request in enumerate(plan):
            report.samples.append(_serve(engine, prefix, request,
                                         questions[request.question_of], j))
            bar.note(kind=request.kind)
            bar.update()
    report.seconds = time.perf_counter() - started
    return report


def _serve(engine: LLM, prefix: PrefixCache, request: RagRequest, question: str,
           j: int) -> RagSample:
    """One request, the three ways in an order that rotates with `j`."""
    prompt = build_prompt(request.docs, question)
    bound = engine.bind(prompt)
    ids = request_order_ids(bound, request.docs)
    got: dict[str, Any] = {}
    for side in rotated(("promptlang", "prefix", "full"), j):
        if side == "promptlang":
            got[side] = timed_first_token(engine, prompt)
        elif side == "prefix":
            got[side] = prefix.serve(ids)
        else:
            got[side] = prefix.serve(ids, reuse=False, keep=False)
    ours_seconds, ours_logits = got["promptlang"]
    served = got["prefix"]
    full = got["full"]
    full_token = int(full.logits.argmax())
    return RagSample(request, len(ids), bound.cached_token_count, served.reused, ours_seconds,
                     served.seconds, full.seconds, int(served.logits.argmax()) == full_token,
                     float((served.logits - full.logits).abs().max()),
                     int(ours_logits.argmax()) == full_token)


# --- reporting -----------------------------------------------------------------------------

def sections(report: RagReport) -> list[Section]:
    o = report.options
    title = (f"RAG: {o.k} of {o.docs} documents per request (where prefix caches miss), "
             f"promptlang's policy {o.recompute}")
    if report.skipped or not report.samples:
        return [Section(title, (), [report.skipped or "no requests measured"])]
    rows = []
    for kind, samples in report.by_kind().items():
        full = Spread.of(ratios([s.full for s in samples], [s.promptlang for s in samples]))
        pre = Spread.of(ratios([s.prefix for s in samples], [s.promptlang for s in samples]))
        rows.append({
            "kind": kind, "n": len(samples),
            "tokens": round(statistics.median(s.tokens for s in samples)),
            "prefix reused": round(statistics.median(s.reused for s in samples)),
            "promptlang ms": statistics.median(s.promptlang for s in samples) * 1e3,
            "prefix ms": statistics.median(s.prefix for s in samples) * 1e3,
            "full ms": statistics.median(s.full for s in samples) * 1e3,
            "prefix / promptlang": round(pre.median, 2),
            "prefix min-max": f"{pre.low:.2f}-{pre.high:.2f}",
            "full / promptlang": round(full.median, 2),
            "full min-max": f"{full.low:.2f}-{full.high:.2f}"})
    every = report.samples
    lines = [
        f"{len(every)} requests, each served three ways on one engine in a rotating order: "
        "promptlang (documents from the store at their schema positions), a prefix cache "
        "(longest common token prefix with any request it served before, the rest "
        "prefilled) and a full prefill of the prefix cache's sequence; times are medians, "
        "ratios are per request (median, min-max)",
        f"documents: {o.docs} of {statistics.median(report.doc_tokens):.0f} tokens (median); "
        "kinds: new = a set of documents not used before, reordered = a used set in a new "
        "order, repeat = a used order with a new question; before the timed requests each "
        "document was served alone once, untimed, on both caches",
        f"the prefix cache's first token equals the full prefill's in "
        f"{sum(s.prefix_agrees for s in every)} of {len(every)} requests (max |logit diff| "
        f"{max(s.prefix_max_diff for s in every):.3g}); promptlang's equals it in "
        f"{sum(s.promptlang_agrees for s in every)} (modular encoding, documents at schema "
        "positions: not expected to always agree)"]
    return [Section(title, rows, lines, float_format="{:.4g}")]


def to_json(report: RagReport) -> dict[str, Any]:
    return {"model": report.model, "options": asdict(report.options),
            "doc_tokens": report.doc_tokens, "seconds": report.seconds,
            "skipped": report.skipped, "samples": [asdict(s) for s in report.samples]}
