"""Study (not a test): two versions of kernels.c side by side in ONE process, swapped per
request, on `bench peers`' document question (~6.4k cached tokens, a new question each
time), with the model's numbers and with the approximations (int8 linears, bf16 attention
and store).

    git show HEAD~1:runtime/fast/kernels.c > /tmp/old.c
    python tests/studies/kernel_ab.py --old /tmp/old.c --new runtime/fast/kernels.c --pairs 30

Both libraries are built (cached like the default one) and loaded; each pair of requests
runs the same question on both, in alternating order, so the machine's drift (this 2-core
machine moves by tens of percent over minutes) hits both alike. Prints the medians, the
per-pair old/new ratio with its quartiles, and whether the two gave the same next-token
logits bit for bit.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", type=Path, required=True, help="a kernels.c")
    parser.add_argument("--new", type=Path, required=True, help="another kernels.c")
    parser.add_argument("--pairs", type=int, default=30)
    parser.add_argument("--tokens", type=int, default=6400)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)

    from promptlang.runtime.fast import library, native

    library._SOURCE = args.old.resolve()          # before anything loads the library
    import promptlang
    from promptlang.bench.peers import DOC_SCHEMA, doc_prompt, doc_schema, document
    from promptlang.runtime.engine import LLM
    from promptlang.runtime.store import ModuleStore

    base = promptlang.load()
    libs = {"old": native._load()}
    if libs["old"] is None:
        print("the CPU kernels are not available here")
        return 1
    library._SOURCE = args.new.resolve()
    libs["new"] = library.bind(library.trusted_library())
    text, item = document(base.tokenizer, args.tokens, seed=20)
    device = base.adapter.device
    bf16 = dict(dtype=torch.bfloat16, compute_dtype=torch.bfloat16)
    engines = {
        "model's numbers": (LLM(base.adapter, base.tokenizer,
                                ModuleStore(device, disk_budget_bytes=0)),
                            contextlib.nullcontext),
        "approximations": (LLM(base.adapter, base.tokenizer,
                               ModuleStore(device, disk_budget_bytes=0, **bf16)),
                           base.adapter.fast.decoder.approximated)}
    for name, (llm, numerics) in engines.items():
        llm.add_schema(doc_schema(DOC_SCHEMA, text))
        times, logits = {"old": [], "new": []}, {}
        with numerics():
            llm.generate(doc_prompt(DOC_SCHEMA, item.question), max_new_tokens=1)   # stored
            for version, lib in libs.items():    # the second of two: a request's buffer as
                native._lib = lib                # the pool hands it out from then on (the
                for _ in range(2):               # first differs in the last bits by path)
                    logits[version] = llm.prefill(doc_prompt(DOC_SCHEMA, item.question)
                                                  ).logits[-1]
            for i in range(args.pairs):
                prompt = doc_prompt(DOC_SCHEMA, f"{item.question} Answer in one sentence, #{i}.")
                for version in (("old", "new") if i % 2 == 0 else ("new", "old")):
                    native._lib = libs[version]
                    result = llm.generate(prompt, max_new_tokens=1)
                    times[version].append(result.timings.first_token * 1e3)
        ratios = sorted(a / b for a, b in zip(times["old"], times["new"]))
        q = len(ratios) // 4
        print(f"{name}: TTFT old {statistics.median(times['old']):.1f} ms, new "
              f"{statistics.median(times['new']):.1f} ms (medians); old/new per pair "
              f"{statistics.median(ratios):.3f} (IQR {ratios[q]:.3f}-{ratios[-q - 1]:.3f}); "
              f"same logits: {torch.equal(logits['old'], logits['new'])}")
    native._lib = libs["old"]
    return 0


if __name__ == "__main__":
    sys.exit(main())
