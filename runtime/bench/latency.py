"""`promptlang bench latency`: time to first token, baseline against cached, by length.

The prompt is a system turn, one document module of about L tokens (filler sentences
from qa.py with one fact in the middle) and a short uncached question about the fact.
For each L, in one process, with the same question tokens everywhere:

  baseline  the same tokens at positions 0..N-1, one full prefill, no reuse
  cold      the first cached request; it encodes the module first (`encode`: its cost)
  device    the module in the store's memory tier. An untimed request without the document
            runs before each timed one, so the pooled request buffer no longer holds the
            module and the timed request copies its KV out of the store (or reads it in place)
  held      the cached request repeated back to back: the request buffer still holds the
            module, nothing is copied (what a prefix cache gets on a hit)
  host      a store whose entries live in its host tier (`host_tier=True`, device budget 0).
            On CUDA that is pinned memory copied to the GPU per request; on a CPU it is the
            same RAM as the device tier, so only the tier's bookkeeping differs
  disk      a store on the same folder with its memory tiers emptied before each request:
            every unit is read from its file and its checksum verified. The kernel is first
            asked to drop the files' cached pages (posix_fadvise DONTNEED); it honours that
            for clean pages of ordinary file systems, not on tmpfs

The goals rest on `samples` rounds per length, declared before the run: each round
takes one floor measurement (the chosen sgemm's rate and the copy bandwidth), one
device-tier request and one baseline pass, in an order that rotates from round to round.
A ratio (cached / floor, baseline / cached) is computed per round, and a goal is judged
once, on the median of those ratios; their spread (min-max, IQR, n) is printed with it.
Each round also compares the two sides' greedy first tokens: for this prefix-shaped
prompt they must agree, and the largest logit difference per length is printed.

TTFT runs from the call to the first picked token (`LLM.open` to the argmax of its
logits for the rounds, `Result.timings.first_token` for held, host and disk, each the
median of `repeats` requests).

Break-even: with encode cost E, baseline TTFT b and cached (device) TTFT c, n requests
cost E + n*c with the cache and n*b without, so the cache pays for itself from
n = ceil(E / (b - c)) requests on, the request that pays E included; never if c >= b.

The floor is DESIGN.md's: max(FLOPs of the uncached tokens / matmul rate, (weights +
cached KV bytes) / copy bandwidth), per round (floor.py says how the rates are taken).
At the goal length the decode speed is compared with transformers' own `generate()` on a
stock copy of the model (its default attention), the two sides' runs interleaved.
"""

from __future__ import annotations

import gc
import math
import os
import random
import statistics
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from promptlang.pml import nodes
from promptlang.runtime.fast import native
from promptlang.runtime.bench import floor, qa
from promptlang.runtime.bench.report import (Goal, Progress, Section, Spread, fit_exponent,
                                             plot_ttft, ratios)
from promptlang.runtime.bench.shapes import shape_from_config
from promptlang.runtime.engine import LLM
from promptlang.runtime.store import ModuleStore

DOC_MODULE = "doc"
DECODE_QUESTION = "Write a long and detailed story about the old harbour."
FIT_RANGE = (1000, 8192)      # cached tokens over which the TTFT exponent is fitted
TIERS = ("device", "held", "host", "disk")
AGREE_GOAL = "cached first token == baseline's at every length"


@dataclass(frozen=True)
class LatencyOptions:
    lengths: tuple[int, ...] = (256, 512, 1024, 2048, 4096, 6400, 8000)
    samples: int = 5             # rounds of (floor, device request, baseline) per length
    repeats: int = 5             # timed requests per other cached tier (held, host, disk)
    decode_tokens: int = 32      # tokens generated for the decode comparison
    decode_samples: int = 5      # interleaved decode runs on each side
    goal_length: int = 6400      # the point the goals are checked at
    seed: int = 0

    @classmethod
    def quick(cls) -> "LatencyOptions":
        return cls(lengths=(64, 128, 256), samples=2, repeats=2, decode_tokens=4,
                   decode_samples=2, goal_length=256)


@dataclass
class Agreement:
    """Cached against baseline greedy first token, over the rounds of one length."""

    samples: int = 0
    disagreements: int = 0
    max_logit_diff: float = 0.0
    baseline_token: int | None = None      # the last round's picks
    cached_token: int | None = None

    def add(self, baseline: torch.Tensor, cached: torch.Tensor) -> None:
        """One round: both sides' logits for the first generated token ([V] each)."""
        self.samples += 1
        self.baseline_token, self.cached_token = int(baseline.argmax()), int(cached.argmax())
        self.disagreements += self.baseline_token != self.cached_token
        diff = float((baseline.float() - cached.float()).abs().max())
        self.max_logit_diff = max(self.max_logit_diff, diff)

    @property
    def agrees(self) -> bool:
        return self.samples > 0 and self.disagreements == 0


@dataclass
class Point:
    """Every measurement at one document length (seconds). `baseline`, `device`,
    `rates` and `bandwidths` are the rounds' samples, index i from round i."""

    target: int                  # document tokens asked for
    prompt_tokens: int           # the baseline's prefill
    cached_tokens: int
    uncached_tokens: int
    encode: float
    cold: float
    disk_write: float
    baseline: list[float] = field(default_factory=list)
    device: list[float] = field(default_factory=list)
    rates: list[float] = field(default_factory=list)        # matmul FLOP/s per round
    bandwidths: list[float] = field(default_factory=list)   # copy bytes/s per round
    held: list[float] = field(default_factory=list)
    device_torch: list[float] = field(default_factory=list)   # device tier, PyTorch's kernels
    host: list[float] = field(default_factory=list)
    disk: list[float] = field(default_factory=list)
    flops: float = 0.0           # of the cached request's uncached tokens
    read_bytes: float = 0.0      # weights plus the cached KV
    answer: str = ""             # the fact the question asks for
    agreement: Agreement = field(default_factory=Agreement)
    checks: dict[str, float] = field(default_factory=dict)   # per timed request, from the
    # engine's counters: tokens the assembler copied, store hits in the tier measured

    def floors(self) -> list[float]:
        """The floor of each round, from that round's rates."""
        return [max(self.flops / r, self.read_bytes / b)
                for r, b in zip(self.rates, self.bandwidths)]

    @property
    def floor(self) -> float:
        return statistics.median(self.floors())

    @property
    def floor_compute(self) -> float:
        return statistics.median(self.flops / r for r in self.rates)

    @property
    def floor_memory(self) -> float:
        return statistics.median(self.read_bytes / b for b in self.bandwidths)

    @property
    def x_floor(self) -> Spread:
        """Cached TTFT / floor, per round."""
        return Spread.of(ratios(self.device, self.floors()))

    @property
    def speedup(self) -> Spread:
        """Baseline TTFT / cached TTFT, per round."""
        return Spread.of(ratios(self.baseline, self.device))

    def median(self, tier: str) -> float:
        return statistics.median(getattr(self, tier))

    def best(self, tier: str) -> float:
        return min(getattr(self, tier))

    @property
    def break_even(self) -> int | None:
        """Requests from which encoding once pays off (see the module docstring)."""
        saving = self.median("baseline") - self.median("device")
        return max(1, math.ceil(self.encode / saving)) if saving > 0 else None

    def row(self) -> dict[str, Any]:
        """The CSV row: every number of this point."""
        row: dict[str, Any] = {"target_tokens": self.target, "prompt_tokens": self.prompt_tokens,
                               "cached_tokens": self.cached_tokens,
                               "uncached_tokens": self.uncached_tokens,
                               "samples": len(self.device),
                               "baseline_s": self.median("baseline"),
                               "baseline_min_s": self.best("baseline"),
                               "cold_s": self.cold, "encode_s": self.encode}
        for tier in TIERS:
            row[f"{tier}_s"] = self.median(tier)
            row[f"{tier}_min_s"] = self.best(tier)
        x, up = self.x_floor, self.speedup
        row.update(disk_write_s=self.disk_write, speedup=up.median, speedup_min=up.low,
                   speedup_max=up.high, floor_s=self.floor, floor_compute_s=self.floor_compute,
                   floor_memory_s=self.floor_memory, device_x_floor=x.median,
                   device_x_floor_min=x.low, device_x_floor_max=x.high,
                   break_even_requests=self.break_even, flops_uncached=self.flops,
                   first_token_agrees=self.agreement.agrees,
                   max_logit_diff=self.agreement.max_logit_diff)
        if self.device_torch:
            row.update(device_torch_s=self.median("device_torch"),
                       device_torch_min_s=self.best("device_torch"))
        return row


@dataclass
class DecodeComparison:
    """Decode speed with the goal length's context: ours against transformers' generate,
    seconds per token, `ours[i]` and `hf[i]` from the same interleaved pair of runs."""

    context_tokens: int
    tokens: int                  # tokens each side generated, the first included
    ours: list[float]
    hf: list[float]
    hf_ttft: float               # transformers' generate(max_new_tokens=1) on the prompt
    hf_attention: str

    @property
    def ratio(self) -> Spread:
        return Spread.of(ratios(self.ours, self.hf))


@dataclass
class LatencyReport:
    options: LatencyOptions
    model: str
    machine: dict[str, Any]
    weight_bytes: int
    kv_bytes_per_token: int
    points: list[Point]
    skipped: list[int]           # lengths that do not fit the model's context
    decode: DecodeComparison | None
    goals: list[Goal]
    seconds: float
    sgemms: list[floor.Sgemm] = field(default_factory=list)   # the candidates, measured

    def rows(self) -> list[dict[str, Any]]:
        return [p.row() for p in self.points]

    @property
    def correct(self) -> bool:
        """False when cached and baseline picked different first tokens somewhere."""
        return all(p.agreement.agrees for p in self.points)


# --- the prompt ---------------------------------------------------------------------------

def document(tokenizer, n_tokens: int, seed: int = 0) -> tuple[str, qa.QAItem]:
    """About `n_tokens` tokens of filler with one fact in the middle, and the QA item
    whose question asks for that fact. Deterministic for (n_tokens, seed)."""
    needle = qa.generate(1, seed=seed, kind="needle", docs_per_item=1, doc_words=1)[0]
    fact = needle.documents[0].text            # doc_words=1: the fact sentence alone
    rng = random.Random(f"promptlang.bench.latency:{seed}:{n_tokens}")
    sentences: list[str] = []
    count = len(tokenizer.encode(fact))
    while count < n_tokens:
        sentence = qa.filler_sentence(rng)
        sentences.append(sentence)
        count += len(tokenizer.encode(" " + sentence))
    sentences.insert(len(sentences) // 2, fact)
    return " ".join(sentences), needle


def build_schema(name: str, text: str) -> nodes.Schema:
    return nodes.Schema(name, (
        nodes.RoleOpen("system"), nodes.Text(qa.SYSTEM_PROMPT), nodes.RoleClose("system"),
        nodes.RoleOpen("user"), nodes.Text("Document:\n\n"),
        nodes.Module(DOC_MODULE, (nodes.Text(text + "\n\n"),))))


def build_prompt(name: str, question: str, with_document: bool = True) -> nodes.PromptDoc:
    imports = [nodes.ModuleRef(DOC_MODULE)] if with_document else []
    return nodes.PromptDoc(name, tuple(imports + [
        nodes.Text(f"Question: {question}"), nodes.RoleClose("user"), nodes.RoleOpen("assistant")]))


# --- measuring ----------------------------------------------------------------------------

def run_latency(llm: LLM, options: LatencyOptions = LatencyOptions(), *,
                model_source: str | os.PathLike | None = None, model_name: str = "",
                workdir: str | os.PathLike | None = None,
                progress: bool = True) -> LatencyReport:
    """Measure every length of `options` on `llm`'s model (its own store is not touched).
    `model_source` is what `load()` was given (None: the default model): the decode
    comparison loads a stock copy from it. Disk-tier files go to a temporary folder
    under `workdir` (default: the system's), removed at the end."""
    started = time.perf_counter()
    adapter, tokenizer = llm.adapter, llm.tokenizer
    shape = shape_from_config(adapter.config)
    weight_bytes = floor.module_weight_bytes(adapter.model)
    kv_per_token = adapter.kv_bytes_per_token()
    best, sgemms = floor.best_sgemm(floor.candidate_shapes(shape))
    sampler = floor.FloorSampler(best)

    goal = _nearest(options.lengths, options.goal_length) if options.lengths else None
    cases, skipped = [], []
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

    points, decode_result = [], None
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


@dataclass
class _Case:
    """One length's schema and prompts."""

    length: int
    item: qa.QAItem
    schema: nodes.Schema
    prompt: nodes.PromptDoc          # the document and the question
    no_doc: nodes.PromptDoc          # the question alone
    end: int                         # positions the prompt needs

    @classmethod
    def make(cls, tokenizer, length: int, seed: int) -> "_Case":
        from promptlang.pml.binding import bind
        from promptlang.pml.layout import lay_out

        text, item = document(tokenizer, length, seed)
        name = f"latency-{length}"
        schema = build_schema(name, text)
        prompt = build_prompt(name, item.question)
        end = bind(prompt, lay_out(schema, tokenizer), tokenizer).end
        return cls(length, item, schema, prompt, build_prompt(name, item.question, False), end)


class _Stores:
    """The LLMs of one length, sharing `llm`'s model: `memory` (a store without a disk
    tier) and `tiered` (host tier only, with a disk tier in `folder`)."""

    def __init__(self, llm: LLM, folder: Path):
        device = llm.adapter.device
        self.folder = folder
        self.memory = LLM(llm.adapter, llm.tokenizer,
                          ModuleStore(device, disk_budget_bytes=0))
        self.tiered = LLM(llm.adapter, llm.tokenizer,
                          ModuleStore(device, device_budget_bytes=0, host_tier=True,
                                      disk_dir=folder))

    def close(self) -> None:
        self.memory.store.clear()
        self.tiered.store.clear()      # the disk files too


def _warm_up(llm: LLM, folder: Path, seed: int, sampler: floor.FloorSampler) -> None:
    """Every kind of request once on a short document, untimed: the first passes of a
    process pay for thread pools, allocations and lazy imports."""
    stores = _Stores(llm, folder)
    try:
        with Progress(total=0, enabled=False) as quiet:
            _measure(stores, _Case.make(llm.tokenizer, 64, seed),
                     LatencyOptions(samples=1, repeats=1), sampler, quiet)
    finally:
        stores.close()


def _ttft(llm: LLM, prompt, **options) -> float:
    return llm.generate(prompt, max_new_tokens=1, **options).timings.first_token


def timed_first_token(llm: LLM, prompt, baseline: bool = False) -> tuple[float, torch.Tensor]:
    """(seconds from the call to the first greedy token, the logits it was picked from
    [V]): `LLM.open` (bind, retrieve, assemble, prefill) and the argmax, as `generate`
    does up to its first token; the request's buffer goes back to the pool untimed."""
    began = time.perf_counter()
    opened = llm.open(prompt, baseline=baseline, room=1, add_generation_prompt=True)
    int(torch.argmax(opened.logits))
    seconds = time.perf_counter() - began
    llm.assembler.release(opened.buffer)
    return seconds, opened.logits


def rotated(parts: Sequence[str], round_index: int) -> list[str]:
    """`parts` starting at round_index mod len: each part takes each place in turn, so no
    part always runs right after another (e.g. always on a cache the other warmed)."""
    k = round_index % len(parts)
    return list(parts[k:]) + list(parts[:k])


def _measure(stores: _Stores, case: _Case, options: LatencyOptions,
             sampler: floor.FloorSampler, bar: Progress, goal: int | None = None) -> Point:
    memory, tiered = stores.memory, stores.tiered
    prompt, no_doc = case.prompt, case.no_doc
    for llm in (memory, tiered):
        llm.add_schema(case.schema)

    def step(phase: str) -> None:
        bar.note(tokens=case.length, phase=phase)
        bar.update()

    _ttft(memory, no_doc)                  # encodes the schema's anonymous text only
    cold = memory.generate(prompt, max_new_tokens=1)
    step("cold")
    point = Point(case.length, cold.cached_tokens + cold.prefill_tokens, cold.cached_tokens,
                  cold.prefill_tokens, cold.timings.encode, cold.timings.first_token, 0.0,
                  answer=case.item.answer)

    # what each tier's requests really did, from the engine's own counters
    copied = lambda: memory.assembler.copied_tokens  # noqa: E731
    mark = copied()
    for _ in range(options.repeats):      # the buffer still holds the document
        point.held.append(_ttft(memory, prompt))
        step("held")
    point.checks["held_copied_tokens"] = (copied() - mark) / options.repeats

    # the goals' samples: floor, device tier and baseline side by side in every round
    copies = 0
    for i in range(options.samples):
        logits = {}
        for part in rotated(("floor", "device", "baseline"), i):
            if part == "floor":
                rate, bandwidth = sampler.sample()
                point.rates.append(rate)
                point.bandwidths.append(bandwidth)
            elif part == "device":
                _ttft(memory, no_doc)     # the buffer no longer holds the document
                mark = copied()
                seconds, logits["cached"] = timed_first_token(memory, prompt)
                copies += copied() - mark
                point.device.append(seconds)
            else:
                seconds, logits["baseline"] = timed_first_token(memory, prompt, baseline=True)
                point.baseline.append(seconds)
        point.agreement.add(logits["baseline"], logits["cached"])
        step("rounds: floor, device, baseline")
    point.checks["device_copied_tokens"] = copies / options.samples
    if case.length == goal and native.available():
        with native.disabled():           # the same requests without runtime/kernels.c
            for _ in range(options.repeats):
                _ttft(memory, no_doc)
                point.device_torch.append(_ttft(memory, prompt))
                step("device, PyTorch kernels")

    began = time.perf_counter()           # write every unit to the tiered store's disk
    for entry in memory.store.entries():
        tiered.store.put(entry.key, memory.store.get(entry.key), entry.meta)
    point.disk_write = time.perf_counter() - began

    _ttft(tiered, prompt)                 # untimed: allocates this LLM's request buffer
    hits = 0
    for _ in range(options.repeats):      # put left the units in the host tier
        _ttft(tiered, no_doc)
        mark = tiered.store.stats.host_hits
        point.host.append(_ttft(tiered, prompt))
        hits += tiered.store.stats.host_hits - mark
        step("host")
    point.checks["host_hits"] = hits / options.repeats
    loads = 0
    for _ in range(options.repeats):
        tiered.store.clear(("device", "host"))
        _ttft(tiered, no_doc)             # so that the buffer does not hold the document
        tiered.store.clear(("device", "host"))
        _drop_page_cache(stores.folder)
        mark = tiered.store.stats.disk_hits
        point.disk.append(_ttft(tiered, prompt))
        loads += tiered.store.stats.disk_hits - mark
        step("disk")
    point.checks["disk_hits"] = loads / options.repeats
    return point


def _drop_page_cache(folder: Path) -> None:
    """Ask the kernel to forget the cached pages of the store's files (best effort)."""
    if not hasattr(os, "posix_fadvise"):
        return
    for path in folder.glob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# --- decode: ours against transformers' generate -----------------------------------------

def _compare_decode(stores: _Stores, case: _Case, options: LatencyOptions,
                    model_source, bar: Progress) -> DecodeComparison | None:
    """Per-token decode time with the document cached, against a stock transformers
    model's `generate()` on the same tokens (greedy, its own prefill subtracted): the
    two sides' runs interleaved, `decode_samples` on each, the order alternating."""
    llm, length = stores.memory, case.length
    prompt = build_prompt(case.schema.name, DECODE_QUESTION)
    n = options.decode_tokens
    generated = len(llm.generate(prompt, max_new_tokens=n).token_ids)   # untimed: warms
    if generated < 2:
        bar.write(f"latency: decode comparison skipped: the model stopped after "
                  f"{generated} token")
        bar.update(options.decode_samples)
        return None
    ids = llm.bind(prompt).token_ids()

    def ours() -> float:
        result = llm.generate(prompt, max_new_tokens=generated)
        return (result.timings.total - result.timings.first_token) / (generated - 1)

    with _StockModel(model_source, ids) as stock:
        hf_ttft = stock.ttft()
        mine, theirs = [], []
        for i in range(options.decode_samples):
            for side in rotated(("ours", "transformers"), i):
                if side == "ours":
                    mine.append(ours())
                else:
                    theirs.append(stock.per_token(generated))
            bar.note(tokens=length, phase="decode, interleaved")
            bar.update()
        return DecodeComparison(len(ids), generated, mine, theirs, hf_ttft, stock.attention)


class _StockModel:
    """A freshly loaded, unadapted copy of the model and its own `generate()` on `ids`
    (greedy); a context manager that drops the model on exit."""

    def __init__(self, model_source, ids: Sequence[int]):
        from promptlang.runtime.loading import load_hf_model

        self.model, tokenizer = load_hf_model(model_source)
        pad = tokenizer.eos_ids[0] if tokenizer.eos_ids else 0
        self._generate = _quiet_generate(self.model, pad)
        self.prompt = torch.tensor([list(ids)], device=self.model.device)
        self._generate(self.prompt[:, :16], None, 2)        # untimed: first-call costs
        self._cache = self._context = None
        self.attention = str(self.model.config._attn_implementation)

    def __enter__(self) -> "_StockModel":
        return self

    def __exit__(self, *exc: object) -> None:
        del self.model, self._generate, self._cache
        gc.collect()

    def ttft(self) -> float:
        """generate(max_new_tokens=1) on the prompt; keeps its KV for `per_token`."""
        began = time.perf_counter()
        out = self._generate(self.prompt, None, 1)
        seconds = time.perf_counter() - began
        self._cache, self._context = out.cache, out.sequences   # cache: the prompt's KV
        return seconds

    def _timed(self, count: int) -> float:
        extra = self._cache.get_seq_length() - self.prompt.shape[1]
        if extra:
            self._cache.crop(-extra)         # back to the prompt only
        began = time.perf_counter()
        self._generate(self._context, self._cache, count)
        return time.perf_counter() - began

    def per_token(self, tokens: int) -> float:
        """Seconds per decoded token: generating k tokens after the prompt's first is k
        one-token forward passes, so (time of `tokens` - time of 1) / (tokens - 1)."""
        one = self._timed(1)
        return (self._timed(tokens) - one) / (tokens - 1)


def _quiet_generate(model, pad_token_id: int) -> Callable:
    """`generate(input_ids, cache, n)`: exactly n greedy tokens, warnings silenced."""
    from transformers.utils import logging as hf_logging

    @torch.inference_mode()
    def generate(input_ids: torch.Tensor, cache, n: int):
        level = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                kwargs = {} if cache is None else {"cache": cache}
                return model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                      max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                      pad_token_id=pad_token_id, return_dict_in_generate=True,
                                      **kwargs)
        finally:
            hf_logging.set_verbosity(level)

    return generate


# --- goals --------------------------------------------------------------------------------

def _nearest(lengths: Sequence[int], target: int) -> int:
    return min(lengths, key=lambda n: (abs(n - target), n))


def exponents(points: Sequence[Point]) -> tuple[float | None, float | None, str]:
    """(cached exponent, baseline exponent, over what) of TTFT against cached tokens,
    fitted over FIT_RANGE, or over every point when fewer than two fall in it."""
    inside = [p for p in points if FIT_RANGE[0] <= p.cached_tokens <= FIT_RANGE[1]]
    span = f"{FIT_RANGE[0]:,}-{FIT_RANGE[1]:,} cached tokens"
    if len({p.cached_tokens for p in inside}) < 2:
        inside, span = list(points), f"all {len(points)} points (fewer than two in {span})"
    if len({p.cached_tokens for p in inside}) < 2:
        return None, None, "fewer than two lengths"
    xs = [p.cached_tokens for p in inside]
    cached = fit_exponent(xs, [p.median("device") for p in inside])[0]
    baseline = fit_exponent(xs, [p.median("baseline") for p in inside])[0]
    return cached, baseline, span


def _where(point: Point, target: int) -> str:
    """Which point a goal was checked at, flagged when it is far from the goal's length."""
    where = f"at {point.cached_tokens:,} cached tokens"
    if abs(point.cached_tokens - target) > 0.25 * target:
        where += f" (the measured point nearest {target:,})"
    return where


def latency_goals(report: LatencyReport) -> list[Goal]:
    """Issue 7's latency goals, each judged once on the per-round ratios of the point
    nearest its length (the samples declared in the options), and the agreement check."""
    points, options = report.points, report.options
    if not points:
        return [Goal("latency goals", None, "no length fits the model's context")]
    at = min(points, key=lambda p: (abs(p.cached_tokens - options.goal_length), p.target))
    where = _where(at, options.goal_length)
    x, up = at.x_floor, at.speedup
    sgemm = report.machine.get("matmul_sgemm") or "the best sgemm"
    goals = [
        Goal("cached TTFT <= 2x floor", x.median <= 2,
             f"{where}: {x.describe(unit='x')} the floor, per interleaved round; cached "
             f"{at.median('device') * 1e3:.1f} ms, floor {at.floor * 1e3:.1f} ms (medians; "
             f"compute rate from a {sgemm} sgemm)"),
        Goal("cached >= 100x faster than baseline", up.median >= 100,
             f"{where}: {up.describe('{:.0f}', 'x')} per interleaved round (baseline "
             f"{at.median('baseline'):.2f} s, cached {at.median('device') * 1e3:.1f} ms)"),
    ]
    k_cached, k_baseline, span = exponents(points)
    if k_cached is None:
        goals.append(Goal("cached TTFT exponent <= 1.2", None, span))
    else:
        goals.append(Goal("cached TTFT exponent <= 1.2", k_cached <= 1.2,
                          f"{k_cached:.2f} (baseline {k_baseline:.2f}) over {span}, "
                          "fitted to the medians"))
    small = min(points, key=lambda p: (abs(p.cached_tokens - 512), p.target))
    goals.append(Goal("cached beats baseline at 512 cached tokens", small.speedup.median > 1,
                      f"{_where(small, 512)}: baseline / cached "
                      f"{small.speedup.describe(unit='x')} per round; cached "
                      f"{small.median('device') * 1e3:.1f} ms, baseline "
                      f"{small.median('baseline') * 1e3:.1f} ms"))
    d = report.decode
    if d is None:
        goals.append(Goal("decode per token <= 1.5x transformers generate", None,
                          "not measured (no goal-length point, or the model stopped at once)"))
    else:
        goals.append(Goal("decode per token <= 1.5x transformers generate",
                          d.ratio.median <= 1.5,
                          f"with {d.context_tokens:,} tokens of context: "
                          f"{d.ratio.describe(unit='x')} per interleaved pair of runs; "
                          f"{statistics.median(d.ours) * 1e3:.1f} ms against "
                          f"{statistics.median(d.hf) * 1e3:.1f} ms (medians; {d.tokens} "
                          f"tokens, transformers attention {d.hf_attention})"))
    goals.append(agreement_goal(points))
    return goals


def agreement_goal(points: Sequence[Point]) -> Goal:
    """PASS when cached and baseline picked the same greedy first token in every round
    at every length (the single-document prompt is prefix-shaped: they must agree)."""
    if not points:
        return Goal(AGREE_GOAL, None, "no length measured")
    wrong = [p for p in points if not p.agreement.agrees]
    largest = max(p.agreement.max_logit_diff for p in points)
    if wrong:
        return Goal(AGREE_GOAL, False, "disagree at " + ", ".join(
            f"{p.cached_tokens:,} cached tokens ({p.agreement.disagreements} of "
            f"{p.agreement.samples} rounds; max |logit diff| {p.agreement.max_logit_diff:.3g})"
            for p in wrong))
    return Goal(AGREE_GOAL, True, f"every round at {len(points)} lengths; max |logit diff| "
                                  f"{largest:.3g}")


# --- reporting ----------------------------------------------------------------------------

def sections(report: LatencyReport, tokenizer=None) -> list[Section]:
    """The report's tables and lines, for the terminal and for Markdown. `tokenizer`
    (optional) shows the agreement table's tokens as text."""
    o, points = report.options, report.points
    ttft = [{"prompt tokens": p.prompt_tokens, "cached": p.cached_tokens,
             "baseline": p.median("baseline"), "cold": p.cold, "device": p.median("device"),
             "held": p.median("held"), "host": p.median("host"), "disk": p.median("disk"),
             "speedup": round(p.speedup.median, 1),
             "speedup min-max": f"{p.speedup.low:.1f}-{p.speedup.high:.1f}",
             "floor": p.floor, "x floor": round(p.x_floor.median, 2),
             "x floor min-max": f"{p.x_floor.low:.2f}-{p.x_floor.high:.2f}"} for p in points]
    costs = [{"cached tokens": p.cached_tokens, "encode s": p.encode,
              "disk write s": p.disk_write, "baseline s": p.median("baseline"),
              "cached s": p.median("device"), "break-even requests": p.break_even,
              "MiB (fp32)": round(p.cached_tokens * report.kv_bytes_per_token / 2**20, 1)}
             for p in points]
    floors = [{"cached tokens": p.cached_tokens, "uncached tokens": p.uncached_tokens,
               "GFLOP": round(p.flops / 1e9, 2), "compute ms": p.floor_compute * 1e3,
               "memory ms": p.floor_memory * 1e3, "floor ms": p.floor * 1e3,
               "cached ms": p.median("device") * 1e3,
               "min ms": p.best("device") * 1e3,
               "cached / floor": round(p.x_floor.median, 2),
               "IQR": f"{p.x_floor.q1:.2f}-{p.x_floor.q3:.2f}",
               "n": p.x_floor.n} for p in points]
    m = report.machine
    floor_lines = [
        f"floor = max(FLOPs / matmul rate, (weights {report.weight_bytes / 2**20:,.0f} MiB + "
        f"cached KV) / copy bandwidth), per round: each of the {o.samples} rounds of a "
        f"length measures the rates once, beside its cached request and baseline pass; "
        f"medians shown (over the run: {m['matmul_gflops']} GFLOP/s, "
        f"{m['copy_gb_per_s']} GB/s)",
        f"matmul rate: a {m.get('matmul_sgemm', '')} sgemm, the fastest sustained one "
        "of: " + ", ".join(f"{s.name} {s.what} {s.flops_per_s / 1e9:.1f} GFLOP/s"
                           for s in report.sgemms)]
    for p in points:
        if p.device_torch:
            ours, torch_only = p.median("device"), p.median("device_torch")
            floor_lines.append(
                f"at {p.cached_tokens:,} cached tokens, the same device-tier requests on "
                f"PyTorch's kernels alone (runtime/kernels.c off): {torch_only * 1e3:.1f} ms "
                f"(min {p.best('device_torch') * 1e3:.1f}) = {torch_only / p.floor:.2f}x the "
                f"median floor; with the kernels {ours * 1e3:.1f} ms, "
                f"{torch_only / ours:.2f}x faster")
    k_cached, k_baseline, span = exponents(points)
    lines = [f"baseline, device and the floor: {o.samples} interleaved rounds per length "
             f"(medians, ratios per round); held, host, disk: {o.repeats} requests each "
             f"(median); seconds; model {report.model}",
             "cold: the first cached request, encoding included; device: the module in the "
             "store's memory (read in place from 256 tokens on, else copied into the request "
             "buffer); held: the request buffer still holds it; host: the store's host tier; "
             "disk: read and verified from its file"]
    if report.skipped:
        lines.append(f"skipped (longer than the model's context): "
                     f"{', '.join(map(str, report.skipped))}")
    text = (lambda t: repr(tokenizer.decode([t]))) if tokenizer is not None else str
    agree = [{"cached tokens": p.cached_tokens, "rounds": p.agreement.samples,
              "same first token": "yes" if p.agreement.agrees else
              f"NO ({p.agreement.disagreements} differ)",
              "max |logit diff|": p.agreement.max_logit_diff,
              "baseline token": text(p.agreement.baseline_token)
              if p.agreement.baseline_token is not None else None,
              "cached token": text(p.agreement.cached_token)
              if p.agreement.cached_token is not None else None} for p in points]
    fit = [f"cached TTFT ~ length^{k_cached:.2f}, baseline ~ length^{k_baseline:.2f} "
           f"(least squares in log-log over {span}, on the medians)"
           if k_cached is not None else span]
    out = [Section("Time to first token (s)", ttft, lines),
           Section("Cached against baseline: the first token", agree,
                   ["the greedy first token of the device-tier request and of the baseline "
                    "pass of the same round; the prompt is prefix-shaped, so they must agree "
                    "(the last round's tokens shown)"], float_format="{:.3g}"),
           Section("Encode cost and break-even", costs,
                   ["break-even requests: the smallest n with encode + n x cached <= "
                    "n x baseline, i.e. ceil(encode / (baseline - cached)); the request that "
                    "pays for the encoding counts as one of the n"]),
           Section("Cached TTFT against the floor", floors, floor_lines,
                   float_format="{:.4g}"),
           Section("Growth with length", (), fit)]
    d = report.decode
    if d is not None:
        out.append(Section("Decode with the long context cached", (), [
            f"{d.tokens} greedy tokens after {d.context_tokens:,} context tokens, "
            f"{len(d.ours)} runs on each side, interleaved: promptlang "
            f"{statistics.median(d.ours) * 1e3:.1f} ms/token, transformers generate() "
            f"{statistics.median(d.hf) * 1e3:.1f} ms/token ({d.hf_attention} attention, "
            f"stock model); ratio per pair {d.ratio.describe()}",
            f"transformers generate() time to first token on the same prompt: "
            f"{d.hf_ttft:.2f} s"]))
    out.append(Section("Goals (issue 7)", (), [str(g) for g in report.goals]))
    return out


def plot(report: LatencyReport, path, note: str = "") -> Path:
    """TTFT against prompt length, log-log, every tier and the floor; `note` is
    appended to the title (e.g. that the run was a quick one)."""
    xs = [p.prompt_tokens for p in report.points]
    series = {"baseline": (xs, [p.median("baseline") for p in report.points])}
    for tier in TIERS:
        series[f"cached: {tier}"] = (xs, [p.median(tier) for p in report.points])
    series["floor"] = (xs, [p.floor for p in report.points])
    return plot_ttft(path, series, title=f"Time to first token, {report.model}{note}",
                     dashed=("floor",))


def to_json(report: LatencyReport) -> dict[str, Any]:
    """Everything, raw samples included."""
    from dataclasses import asdict

    return {"model": report.model, "machine": report.machine, "options": asdict(report.options),
            "weight_bytes": report.weight_bytes,
            "kv_bytes_per_token": report.kv_bytes_per_token, "seconds": report.seconds,
            "skipped": report.skipped,
            "sgemm_candidates": [asdict(s) | {"name": s.name} for s in report.sgemms],
            "points": [{**asdict(p), **p.row(), "floors": p.floors(),
                        "x_floor": asdict(p.x_floor), "speedup_spread": asdict(p.speedup)}
                       for p in report.points],
            "decode": None if report.decode is None else
            {**asdict(report.decode), "ratio": asdict(report.decode.ratio)},
            "goals": [asdict(g) | {"verdict": g.verdict} for g in report.goals]}
