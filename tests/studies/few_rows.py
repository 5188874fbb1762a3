"""Study (not a test): a decode step at a long cached context with kernels.c's few-rows
attention on and off (`native.few`), from a float32, bfloat16 and float16 store.

    python tests/studies/few_rows.py --tokens 6400 --rounds 4

The `bench peers` document (~6.4k tokens) is stored as a module in each store; every round
times greedy decoding after its question (ms per token, 24 new tokens) in every store with
the path on and off, in turns (the machine drifts over minutes), and checks that the two
give the same text. docs/BENCHMARKS.md has a run.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=6400)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    import promptlang
    from promptlang.bench.peers import DOC_SCHEMA, _per_token, doc_prompt, doc_schema, document
    from promptlang.runtime.engine import LLM
    from promptlang.runtime.fast import native
    from promptlang.runtime.store import ModuleStore

    base = promptlang.load()
    if not native.few(True):
        print("the few-rows path needs the CPU kernels with 512-bit tiles (AVX-512F)")
        return 1
    text, item = document(base.tokenizer, args.tokens, seed=20)
    prompt = doc_prompt(DOC_SCHEMA, item.question)
    engines = {}
    for name, dtype in (("float32", None), ("bfloat16", torch.bfloat16),
                        ("float16", torch.float16)):
        kw = {} if dtype is None else dict(dtype=dtype, compute_dtype=dtype)
        llm = LLM(base.adapter, base.tokenizer,
                  ModuleStore(base.adapter.device, disk_budget_bytes=0, **kw))
        llm.add_schema(doc_schema(DOC_SCHEMA, text))
        llm.generate(prompt, max_new_tokens=1)
        engines[name] = llm
    times = {(name, on): [] for name in engines for on in (True, False)}
    same = {}
    for r in range(args.rounds):
        for name, llm in engines.items():
            for on in ((True, False) if r % 2 == 0 else (False, True)):
                native.few(on)
                times[name, on].append(_per_token(llm, prompt, 24) * 1000)
                if r == 0:
                    same[name, on] = llm.generate(prompt, max_new_tokens=24).text
    native.few(True)
    print(f"decode after a {args.tokens}-token cached document, ms per token (median of "
          f"{args.rounds}):")
    for name in engines:
        on, off = (statistics.median(times[name, x]) for x in (True, False))
        print(f"  {name:9s} store: few-rows path {on:6.2f}, tiles {off:6.2f} ({off / on:.2f}x); "
              f"same text: {same[name, True] == same[name, False]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
