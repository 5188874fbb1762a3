"""The TTFT sweep at one length: a document module of about L tokens and a question; the
cold request (encode), declared rounds of (floor, device-tier request, baseline) in
rotating order, then the held, host and disk tiers' requests.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from promptlang.pml import nodes
from promptlang.runtime.fast import native
from promptlang.bench import floor, qa
from promptlang.bench.report import Progress
from promptlang.runtime.engine import LLM
from promptlang.runtime.store import ModuleStore
from promptlang.bench.latency.results import DOC_MODULE, LatencyOptions, Point


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
    tier) and `tiered` (host tier only, with a disk tier in `folder`). Prompt tails are off:
    the same question is asked again and again, and what is measured is the document served
    from a tier with the question computed (a repeated question would compute one token)."""

    def __init__(self, llm: LLM, folder: Path):
        device = llm.adapter.device
        self.folder = folder
        self.memory = LLM(llm.adapter, llm.tokenizer,
                          ModuleStore(device, disk_budget_bytes=0), tail_budget_bytes=0)
        self.tiered = LLM(llm.adapter, llm.tokenizer,
                          ModuleStore(device, device_budget_bytes=0, host_tier=True,
                                      disk_dir=folder), tail_budget_bytes=0)

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
    memory = stores.memory
    tiered = stores.tiered
    prompt = case.prompt
    no_doc = case.no_doc
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
    def copied() -> int:
        return memory.assembler.copied_tokens

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
        with native.disabled():           # the same requests without runtime/fast/kernels.c
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
