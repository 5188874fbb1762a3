"""Study (not a test): the server's decode loop without the server -- N requests of `bench
serve`'s RAG shape (k of 8 ~300-token documents and a question) opened together and stepped
by one BatchStepper to the end, with kernels.c's switches in turns.

    python tests/studies/batch_steps.py --requests 16 --rounds 3

Every request is served alone first (its modules and their combination stored, its answer
kept); each round then opens all N at once, their prefills joining the steps as in the
server (`defer`, `prefill_first_below`), and times the steps from the first to the last
token, once per setting, in turns (the machine drifts over minutes). Prints tokens/s and
whether every answer equals the request served alone.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

SETTINGS = {                      # name -> (few-rows decode path, grouped shared units)
    "few-grouped": (True, True),
    "tiles-grouped": (False, True),
    "few-ungrouped": (True, False),
}


def run_batch(llm, prompts, max_new: int, defer: int, first_below: int):
    """(seconds, tokens, texts) of the prompts opened at once and stepped to the end."""
    from promptlang.runtime.decoding.decode import BatchStepper

    began = time.perf_counter()
    stepper, gens, texts = None, {}, {}
    for i, prompt in enumerate(prompts):
        g = llm.start(prompt, max_new_tokens=max_new, temperature=0, defer=defer)
        stepper = stepper or BatchStepper(g.decoder.adapter, prefill_first_below=first_below)
        gens[i], texts[i] = g, ""
        if g.opened.pending is not None:
            stepper.join(i, g.decoder, g.opened.pending)
        else:
            _, delta, _ = stepper.add(i, g.decoder, g.opened.logits)
            texts[i] += g.delta(delta)
    tokens = 0
    while len(stepper):
        for i, token, delta, _ in stepper.step():
            tokens += token is not None
            texts[i] += gens[i].delta(delta)
    seconds = time.perf_counter() - began
    for g in gens.values():
        g.release()
    return seconds, tokens, [texts[i] for i in range(len(prompts))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--settings", default=",".join(SETTINGS),
                        help="which of them, comma-separated (default: all)")
    args = parser.parse_args(argv)
    chosen = {name: SETTINGS[name] for name in args.settings.split(",")}
    torch.set_num_threads(args.threads)

    import promptlang
    from promptlang.bench.latency.sweep import document
    from promptlang.bench.rag import build_prompt, build_schema, plan_requests
    from promptlang.runtime.fast import native

    llm = promptlang.load()
    if not native.few(True):
        print("the few-rows path needs the CPU kernels with 512-bit tiles (AVX-512F)")
        return 1
    texts, questions = [], []
    for i in range(8):
        text, item = document(llm.tokenizer, 300, seed=9000 + i)
        texts.append(text)
        questions.append(item.question)
    llm.add_schema(build_schema(texts, "steps"))
    prompts = [build_prompt(r.docs, questions[r.question_of], "steps")
               for r in plan_requests(8, 4, args.requests, seed=1)]
    alone = [llm.generate(p, max_new_tokens=args.max_new_tokens, temperature=0).text
             for p in prompts]
    print("served alone; stepping together", flush=True)
    rates = {name: [] for name in chosen}
    same = {name: True for name in chosen}
    for r in range(args.rounds):
        order = list(chosen) if r % 2 == 0 else list(reversed(chosen))
        for name in order:
            few, grouped = chosen[name]
            native.few(few)
            native.group_shared(grouped)
            seconds, tokens, got = run_batch(llm, prompts, args.max_new_tokens, 48, 8)
            rates[name].append(tokens / seconds)
            same[name] &= got == alone
    native.few(True)
    native.group_shared(True)
    print(f"{args.requests} requests stepped together, {args.max_new_tokens} new tokens at "
          f"most, tokens/s (median of {args.rounds} rounds):")
    for name in chosen:
        print(f"  {name:16s} {statistics.median(rates[name]):7.1f}  "
              f"(all: {', '.join(f'{x:.1f}' for x in rates[name])}); every answer as alone: "
              f"{same[name]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
