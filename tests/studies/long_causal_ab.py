"""Study (not a test): pl_causal against PyTorch's SDPA for the long passes of the default
model, in ONE process, side by side.

    python tests/studies/long_causal_ab.py [float32|bfloat16] [ROUNDS]

Loads the default model with `compute=` the given side. Each round, in alternating order,
once with the kernel and once inside `fast.attention.long_causal_off()`: a cold encode of a
~6.4k-token module (its text new each round: nothing cached) and a new combination of 4 of
8 ~700-token documents under `exact` (the documents encoded apart beforehand; each round
a set no earlier round used), timed to the first token. Prints the medians, the per-round
SDPA / kernel ratios and the largest |difference| between the two sides' first-token
logits.
"""

from __future__ import annotations

import contextlib
import random
import statistics
import sys
import time

import torch

from promptlang.bench.latency.sweep import document, timed_first_token
from promptlang.bench.rag import build_prompt, build_schema, documents
from promptlang.pml import nodes
from promptlang.runtime import engine
from promptlang.runtime.fast import attention
from promptlang.runtime.store import ModuleStore

SIDES = ("kernel", "sdpa")


def side(name: str):
    return attention.long_causal_off() if name == "sdpa" else contextlib.nullcontext()


def fresh(llm) -> engine.LLM:
    return engine.LLM(llm.adapter, llm.tokenizer,
                      ModuleStore(llm.adapter.device, disk_budget_bytes=0),
                      recompute="exact", exact_reuse=False, tail_budget_bytes=0)


def main(compute: str, rounds: int) -> None:
    llm = engine.load(None, compute=compute, exact_reuse=False, seam_adapter=False)
    print(f"compute {compute}, torch threads {torch.get_num_threads()}, rounds {rounds}")
    encode = {name: [] for name in SIDES}
    for j in range(rounds):
        text, _ = document(llm.tokenizer, 6400, seed=100 + j)
        for name in (SIDES if j % 2 == 0 else SIDES[::-1]):
            schema = nodes.Schema(f"long-{name}-{j}", (
                nodes.RoleOpen("user"), nodes.Module("doc", (nodes.Text(text + "\n\n"),))))
            engine_ = fresh(llm)
            with side(name):
                began = time.perf_counter()
                engine_.encode(schema)
                encode[name].append(time.perf_counter() - began)
    texts, questions = documents(llm.tokenizer, 8, 700, 0)
    engines = {name: fresh(llm) for name in SIDES}
    for name in SIDES:
        with side(name):
            engines[name].encode(build_schema(texts))
    rng = random.Random("promptlang.study.long_causal_ab")
    seen = set()
    rag = {name: [] for name in SIDES}
    differences = []
    for j in range(rounds):
        while True:
            docs = tuple(rng.sample(range(8), 4))
            if frozenset(docs) not in seen:
                break
        seen.add(frozenset(docs))
        prompt = build_prompt(docs, questions[docs[0]])
        logits = {}
        for name in (SIDES if j % 2 == 0 else SIDES[::-1]):
            with side(name):
                seconds, logits[name] = timed_first_token(engines[name], prompt)
            rag[name].append(seconds)
        differences.append(float((logits["kernel"].float() - logits["sdpa"].float()).abs().max()))
    for label, table in (("cold encode, ~6.4k tokens", encode),
                         ("new combination, exact (TTFT)", rag)):
        ratios = sorted(s / k for s, k in zip(table["sdpa"], table["kernel"]))
        print(f"{label}: kernel {statistics.median(table['kernel']):.3f} s, "
              f"sdpa {statistics.median(table['sdpa']):.3f} s; sdpa / kernel median "
              f"{statistics.median(ratios):.2f}x (min {ratios[0]:.2f}x, max {ratios[-1]:.2f}x)")
    print(f"first-token logits, largest |kernel - sdpa| per round: "
          + ", ".join(f"{d:.2e}" for d in differences))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "float32",
         int(sys.argv[2]) if len(sys.argv) > 2 else 3)
