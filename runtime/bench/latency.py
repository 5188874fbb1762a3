"""`promptlang bench latency`: time to first token, baseline against cached, by length.

The prompt is a system turn, one document module of about L tokens (filler sentences
from qa.py with one fact in the middle) and a short uncached question about the fact.
For each L, in one process, with the same question tokens everywhere:

  baseline  `generate(..., baseline=True)`: the same tokens at positions 0..N-1, no reuse
  cold      the first cached request; it encodes the module first (`encode`: its cost)
  device    the module in the store's memory tier. An untimed request without the document
            runs before each timed one, so the pooled request buffer no longer holds the
            module and the timed request copies its KV out of the store
  held      the cached request repeated back to back: the request buffer still holds the
            module, nothing is copied (what a prefix cache gets on a hit)
  host      a store whose entries live in its host tier (`host_tier=True`, device budget 0).
            On CUDA that is pinned memory copied to the GPU per request; on a CPU it is the
            same RAM as the device tier, so only the tier's bookkeeping differs
  disk      a store on the same folder with its memory tiers emptied before each request:
            every unit is read from its file and its checksum verified. The kernel is first
            asked to drop the files' cached pages (posix_fadvise DONTNEED); it honours that
            for clean pages of ordinary file systems, not on tmpfs

TTFT is `Result.timings.first_token`, from the call to the first picked token. A cached
figure is the median (and min) of `repeats` requests; the baseline takes tens of seconds
at long lengths, so it runs `baseline_repeats` times.

Break-even: with encode cost E, baseline TTFT b and cached (device) TTFT c, n requests
cost E + n*c with the cache and n*b without, so the cache pays for itself from
n = ceil(E / (b - c)) requests on, the request that pays E included; never if c >= b.

The floor of each cached point is DESIGN.md's, from this machine's rates measured in the
same run: max(FLOPs of the uncached tokens / matmul rate, (weights + cached KV bytes) /
copy bandwidth). At the goal length (~6k tokens) the decode speed is compared with
transformers' own `generate()` on a stock copy of the model (its default attention).
"""

from __future__ import annotations

import contextlib
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
from promptlang.runtime import native
from promptlang.runtime.bench import floor, qa
from promptlang.runtime.bench.report import Goal, Progress, Section, fit_exponent, plot_ttft
from promptlang.runtime.bench.shapes import shape_from_config
from promptlang.runtime.engine import LLM
from promptlang.runtime.store import ModuleStore

DOC_MODULE = "doc"
DECODE_QUESTION = "Write a long and detailed story about the old harbour."
FIT_RANGE = (1000, 8192)      # cached tokens over which the TTFT exponent is fitted
TIERS = ("device", "held", "host", "disk")


@dataclass(frozen=True)
class LatencyOptions:
    lengths: tuple[int, ...] = (256, 512, 1024, 2048, 4096, 6400, 8000)
    repeats: int = 5             # timed requests per cached tier and length
    baseline_repeats: int = 1
    decode_tokens: int = 32      # tokens generated for the decode comparison
    decode_repeats: int = 2      # the best of these, on each side
    goal_length: int = 6400      # the point the goals are checked at
    seed: int = 0

    @classmethod
    def quick(cls) -> "LatencyOptions":
        return cls(lengths=(64, 128, 256), repeats=2, decode_tokens=4, decode_repeats=1,
                   goal_length=256)


@dataclass
class Point:
    """Every measurement at one document length (seconds)."""

    target: int                  # document tokens asked for
    prompt_tokens: int           # the baseline's prefill
    cached_tokens: int
    uncached_tokens: int
    encode: float
    cold: float
    disk_write: float
    baseline: list[float] = field(default_factory=list)
    device: list[float] = field(default_factory=list)
    held: list[float] = field(default_factory=list)
    device_torch: list[float] = field(default_factory=list)   # device tier, PyTorch's kernels
    host: list[float] = field(default_factory=list)
    disk: list[float] = field(default_factory=list)
    flops: float = 0.0           # of the cached request's uncached tokens
    floor_compute: float = 0.0
    floor_memory: float = 0.0
    answer: str = ""             # the fact the question asks for
    baseline_token: str = ""     # each side's first token, for the eye
    cached_token: str = ""
    checks: dict[str, float] = field(default_factory=dict)   # per timed request, from the
    # engine's counters: tokens the assembler copied, store hits in the tier measured

    @property
    def floor(self) -> float:
        return max(self.floor_compute, self.floor_memory)

    def median(self, tier: str) -> float:
        return statistics.median(getattr(self, tier))

    def best(self, tier: str) -> float:
        return min(getattr(self, tier))

    @property
    def speedup(self) -> float:
        return self.median("baseline") / self.median("device")

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
                               "baseline_s": self.median("baseline"),
                               "baseline_min_s": self.best("baseline"),
                               "cold_s": self.cold, "encode_s": self.encode}
        for tier in TIERS:
            row[f"{tier}_s"] = self.median(tier)
            row[f"{tier}_min_s"] = self.best(tier)
        row.update(disk_write_s=self.disk_write, speedup=self.speedup, floor_s=self.floor,
                   floor_compute_s=self.floor_compute, floor_memory_s=self.floor_memory,
                   device_x_floor=self.median("device") / self.floor,
                   break_even_requests=self.break_even, flops_uncached=self.flops)
        if self.device_torch:
            row.update(device_torch_s=self.median("device_torch"),
                       device_torch_min_s=self.best("device_torch"))
        return row


@dataclass
class DecodeComparison:
    """Decode speed with the goal length's context: ours against transformers' generate."""

    context_tokens: int
    tokens: int                  # tokens each side generated, the first included
    ours_per_token: float
    hf_per_token: float
    hf_ttft: float               # transformers' generate(max_new_tokens=1) on the prompt
    hf_attention: str

    @property
    def ratio(self) -> float:
        return self.ours_per_token / self.hf_per_token


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

    def rows(self) -> list[dict[str, Any]]:
        return [p.row() for p in self.points]


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
                machine: floor.Machine | None = None, workdir: str | os.PathLike | None = None,
                progress: bool = True) -> LatencyReport:
    """Measure every length of `options` on `llm`'s model (its own store is not touched).
    `model_source` is what `load()` was given (None: the default model): the decode
    comparison loads a stock copy from it. Disk-tier files go to a temporary folder
    under `workdir` (default: the system's), removed at the end."""
    started = time.perf_counter()
    adapter, tokenizer = llm.adapter, llm.tokenizer
    machine = machine or floor.measure_machine()
    shape = shape_from_config(adapter.config)
    weight_bytes = floor.module_weight_bytes(adapter.model)
    kv_per_token = adapter.kv_bytes_per_token()

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
    steps = len(cases) * (options.baseline_repeats + 1 + 4 * options.repeats) + \
        ((2 * options.decode_repeats + 2 + options.repeats * (1 + native.available()))
         if goal is not None else 0)

    points, decode_result, at_goal = [], None, None
    with tempfile.TemporaryDirectory(prefix=".kv-latency-", dir=workdir) as folder, \
            Progress(total=steps, desc="latency", enabled=progress) as bar, \
            contextlib.ExitStack() as kept:       # the goal length's stores, until the end
        if cases:
            _warm_up(llm, Path(folder), options.seed)
        for case in cases:
            with contextlib.ExitStack() as this:
                stores = _Stores(llm, Path(folder))
                this.callback(stores.close)
                point = _measure(stores, case, options, bar, goal)
                points.append(point)
                bar.write(f"latency: {point.cached_tokens:,} cached tokens: baseline "
                          f"{point.median('baseline'):.3f} s, cached "
                          f"{point.median('device'):.4f} s")
                if case.length == goal:
                    decode_result = _compare_decode(stores, case, options, model_source, bar)
                    at_goal = (stores, case, point)
                    kept.push(this.pop_all())     # closed with the run, not now
        if at_goal is not None:
            _device_again(*at_goal, options, bar)

    # the rates again, now that the machine is warm; other load only ever slows a
    # measurement down, so the floor takes the better of the two
    again = floor.measure_machine()
    machine = floor.Machine(max(machine.matmul_flops_per_s, again.matmul_flops_per_s),
                            max(machine.copy_bytes_per_s, again.copy_bytes_per_s),
                            machine.threads)
    for point in points:
        point.flops = floor.prefill_flops(shape, point.uncached_tokens, point.cached_tokens)
        point.floor_compute = point.flops / machine.matmul_flops_per_s
        point.floor_memory = (weight_bytes + point.cached_tokens * kv_per_token) / \
            machine.copy_bytes_per_s

    name = model_name or getattr(tokenizer, "name", "") or shape.name
    report = LatencyReport(options, name, floor.machine_facts(machine), weight_bytes,
                           kv_per_token, points, skipped, decode_result, [],
                           time.perf_counter() - started)
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


def _warm_up(llm: LLM, folder: Path, seed: int) -> None:
    """Every kind of request once on a short document, untimed: the first passes of a
    process pay for thread pools, allocations and lazy imports."""
    stores = _Stores(llm, folder)
    try:
        with Progress(total=0, enabled=False) as quiet:
            _measure(stores, _Case.make(llm.tokenizer, 64, seed),
                     LatencyOptions(repeats=1, baseline_repeats=1), quiet)
    finally:
        stores.close()


def _ttft(llm: LLM, prompt, **options) -> float:
    return llm.generate(prompt, max_new_tokens=1, **options).timings.first_token


def _measure(stores: _Stores, case: _Case, options: LatencyOptions, bar: Progress,
             goal: int | None = None) -> Point:
    memory, tiered = stores.memory, stores.tiered
    tokenizer = memory.tokenizer
    prompt, no_doc = case.prompt, case.no_doc
    for llm in (memory, tiered):
        llm.add_schema(case.schema)

    def step(phase: str) -> None:
        bar.note(tokens=case.length, phase=phase)
        bar.update()

    _ttft(memory, no_doc)                  # encodes the schema's anonymous text only
    baseline = []
    for _ in range(options.baseline_repeats):
        result = memory.generate(prompt, max_new_tokens=1, baseline=True)
        baseline.append(result.timings.first_token)
        step("baseline")
    baseline_token = tokenizer.decode(result.token_ids)

    cold = memory.generate(prompt, max_new_tokens=1)
    step("cold")
    point = Point(case.length, cold.cached_tokens + cold.prefill_tokens, cold.cached_tokens,
                  cold.prefill_tokens, cold.timings.encode, cold.timings.first_token, 0.0,
                  baseline=baseline, answer=case.item.answer, baseline_token=baseline_token,
                  cached_token=tokenizer.decode(cold.token_ids))

    # what each tier's requests really did, from the engine's own counters
    copied = lambda: memory.assembler.copied_tokens  # noqa: E731
    mark = copied()
    for _ in range(options.repeats):      # the buffer still holds the document
        point.held.append(_ttft(memory, prompt))
        step("held")
    point.checks["held_copied_tokens"] = (copied() - mark) / options.repeats
    copies = 0
    for _ in range(options.repeats):
        _ttft(memory, no_doc)
        mark = copied()
        point.device.append(_ttft(memory, prompt))
        copies += copied() - mark
        step("device")
    point.checks["device_copied_tokens"] = copies / options.repeats
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


def _device_again(stores: _Stores, case: _Case, point: Point, options: LatencyOptions,
                  bar: Progress) -> None:
    """The goal length's device-tier requests once more, at the end of the run: its
    PASS/FAIL then rests on samples minutes apart, not on one stretch of a few seconds in
    which other load on a shared machine may slow every request down."""
    memory = stores.memory
    for _ in range(options.repeats):
        _ttft(memory, case.no_doc)
        point.device.append(_ttft(memory, case.prompt))
        bar.note(tokens=case.length, phase="device, again")
        bar.update()
    point.checks["device_late_samples"] = options.repeats


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
    model's `generate()` on the same tokens (greedy, its own prefill subtracted)."""
    llm, length = stores.memory, case.length
    prompt = build_prompt(case.schema.name, DECODE_QUESTION)
    n = options.decode_tokens
    ours, generated = math.inf, 0
    for _ in range(options.decode_repeats):
        result = llm.generate(prompt, max_new_tokens=n)
        generated = len(result.token_ids)       # every picked token, eos included
        if generated >= 2:
            ours = min(ours, (result.timings.total - result.timings.first_token) /
                       (generated - 1))
        bar.note(tokens=length, phase="decode (ours)")
        bar.update()
    if generated < 2:
        bar.write(f"latency: decode comparison skipped: the model stopped after "
                  f"{generated} token")
        bar.update(options.decode_repeats + 2)
        return None
    ids = llm.bind(prompt).token_ids()
    hf_per_token, hf_ttft, attention = _transformers_decode(
        model_source, ids, generated, options.decode_repeats, bar, length)
    return DecodeComparison(len(ids), generated, ours, hf_per_token, hf_ttft, attention)


def _transformers_decode(model_source, ids: Sequence[int], tokens: int, repeats: int,
                         bar: Progress, length: int) -> tuple[float, float, str]:
    """(seconds per decoded token, generate()'s TTFT, attention implementation) of a
    freshly loaded, unadapted copy of the model generating `tokens` greedy tokens."""
    from promptlang.runtime.loading import load_hf_model

    model, tokenizer = load_hf_model(model_source)
    try:
        pad = tokenizer.eos_ids[0] if tokenizer.eos_ids else 0
        generate = _quiet_generate(model, pad)
        prompt = torch.tensor([list(ids)], device=model.device)
        generate(prompt[:, :16], None, 2)          # untimed: first-call costs
        began = time.perf_counter()
        out = generate(prompt, None, 1)
        ttft = time.perf_counter() - began
        bar.note(tokens=length, phase="decode (transformers)")
        bar.update()
        cache, context = out.cache, out.sequences     # cache: the prompt's KV
        kept = prompt.shape[1]

        def timed(count: int) -> float:
            extra = cache.get_seq_length() - kept
            if extra:
                cache.crop(-extra)         # back to the prompt only
            began = time.perf_counter()
            generate(context, cache, count)
            return time.perf_counter() - began

        # generating k tokens after the prompt's first: k forward passes of one token each
        one, many = math.inf, math.inf
        for _ in range(repeats):
            one = min(one, timed(1))
            many = min(many, timed(tokens))
            bar.update()
        bar.update()
        per_token = (many - one) / (tokens - 1)
        return per_token, ttft, str(model.config._attn_implementation)
    finally:
        del model
        gc.collect()


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
    """Issue 7's latency goals, checked at the point nearest the goal length."""
    points, options = report.points, report.options
    if not points:
        return [Goal("latency goals", None, "no length fits the model's context")]
    at = min(points, key=lambda p: (abs(p.cached_tokens - options.goal_length), p.target))
    where = _where(at, options.goal_length)
    cached = at.median("device")
    goals = [
        Goal("cached TTFT <= 2x floor", cached <= 2 * at.floor,
             f"{where}: {cached * 1e3:.1f} ms = {cached / at.floor:.2f}x the floor "
             f"({at.floor * 1e3:.1f} ms; min {at.best('device') * 1e3:.1f} ms)"),
        Goal("cached >= 100x faster than baseline", at.speedup >= 100,
             f"{where}: {at.speedup:.0f}x (baseline {at.median('baseline'):.2f} s, "
             f"cached {cached * 1e3:.1f} ms)"),
    ]
    k_cached, k_baseline, span = exponents(points)
    if k_cached is None:
        goals.append(Goal("cached TTFT exponent <= 1.2", None, span))
    else:
        goals.append(Goal("cached TTFT exponent <= 1.2", k_cached <= 1.2,
                          f"{k_cached:.2f} (baseline {k_baseline:.2f}) over {span}"))
    small = min(points, key=lambda p: (abs(p.cached_tokens - 512), p.target))
    goals.append(Goal("cached beats baseline at 512 cached tokens",
                      small.median("device") < small.median("baseline"),
                      f"{_where(small, 512)}: cached "
                      f"{small.median('device') * 1e3:.1f} ms, baseline "
                      f"{small.median('baseline') * 1e3:.1f} ms"))
    d = report.decode
    if d is None:
        goals.append(Goal("decode per token <= 1.5x transformers generate", None,
                          "not measured (no goal-length point, or the model stopped at once)"))
    else:
        goals.append(Goal("decode per token <= 1.5x transformers generate", d.ratio <= 1.5,
                          f"with {d.context_tokens:,} tokens of context: "
                          f"{d.ours_per_token * 1e3:.1f} ms against "
                          f"{d.hf_per_token * 1e3:.1f} ms ({d.ratio:.2f}x; {d.tokens} tokens, "
                          f"transformers attention {d.hf_attention})"))
    return goals


# --- reporting ----------------------------------------------------------------------------

def sections(report: LatencyReport) -> list[Section]:
    """The report's tables and lines, for the terminal and for Markdown."""
    o, points = report.options, report.points
    ttft = [{"prompt tokens": p.prompt_tokens, "cached": p.cached_tokens,
             "baseline": p.median("baseline"), "cold": p.cold, "device": p.median("device"),
             "held": p.median("held"), "host": p.median("host"), "disk": p.median("disk"),
             "speedup": round(p.speedup, 1), "floor": p.floor,
             "x floor": round(p.median("device") / p.floor, 2)} for p in points]
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
               "cached / floor": round(p.median("device") / p.floor, 2)} for p in points]
    m = report.machine
    floor_lines = [f"floor = max(FLOPs / {m['matmul_gflops']} GFLOP/s, (weights "
                   f"{report.weight_bytes / 2**20:,.0f} MiB + cached KV) / "
                   f"{m['copy_gb_per_s']} GB/s), the better of two measurements in this run "
                   f"(before and after the requests)"]
    for p in points:
        if p.device_torch:
            ours, torch_only = p.median("device"), p.median("device_torch")
            floor_lines.append(
                f"at {p.cached_tokens:,} cached tokens, the same device-tier requests on "
                f"PyTorch's kernels alone (runtime/kernels.c off): {torch_only * 1e3:.1f} ms "
                f"(min {p.best('device_torch') * 1e3:.1f}) = {torch_only / p.floor:.2f}x the "
                f"floor; with the kernels {ours * 1e3:.1f} ms, {torch_only / ours:.2f}x faster")
    k_cached, k_baseline, span = exponents(points)
    lines = [f"{o.repeats} timed requests per cached tier (median shown), "
             f"{o.baseline_repeats} per baseline; seconds; model {report.model}"
             + "".join(f"; at {p.cached_tokens:,} cached tokens (the goals' length) the "
                       f"device tier has {len(p.device)}, {p.checks['device_late_samples']:g} "
                       "of them at the end of the run" for p in report.points
                       if p.checks.get("device_late_samples")),
             "cold: the first cached request, encoding included; device: the module in the "
             "store's memory (read in place from 256 tokens on, else copied into the request "
             "buffer); held: the request buffer still holds it; host: the store's host tier; "
             "disk: read and verified from its file",
             ]
    if report.skipped:
        lines.append(f"skipped (longer than the model's context): "
                     f"{', '.join(map(str, report.skipped))}")
    fit = [f"cached TTFT ~ length^{k_cached:.2f}, baseline ~ length^{k_baseline:.2f} "
           f"(least squares in log-log over {span})" if k_cached is not None else span]
    out = [Section("Time to first token (s)", ttft, lines),
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
            f"{d.tokens} greedy tokens after {d.context_tokens:,} context tokens: promptlang "
            f"{d.ours_per_token * 1e3:.1f} ms/token, transformers generate() "
            f"{d.hf_per_token * 1e3:.1f} ms/token ({d.hf_attention} attention, stock model), "
            f"ratio {d.ratio:.2f}",
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
            "points": [{**asdict(p), **p.row()} for p in report.points],
            "decode": None if report.decode is None else
            {**asdict(report.decode), "ratio": report.decode.ratio},
            "goals": [asdict(g) | {"verdict": g.verdict} for g in report.goals]}
