"""Study (not a test): seam adapters on `promptlang tune`'s own held-out combinations.

    python tests/studies/tune_held_out.py CORPUS.json OUT.json ADAPTER [ADAPTER ...]

Rebuilds the held-out sets a `promptlang tune --seed 0` run on CORPUS.json measures (the
same split of the documents and the same draws: 16 combinations of the held-out documents;
16 of same-shaped records built on them, as with `--same-shape`; the first set's draws with
schemas of only the imported documents, no position gaps, as with `--gapless`; in each
the question at the positions right after the last imported document's, as `tuned` serves
it) and measures each ADAPTER (a seam-lora.safetensors) on each: the mean next-token KL
from the full prefill and the teacher's answer log-probability gap, with the adapter and
without. On the default model, from the repository root.
"""

from __future__ import annotations

import json
import random
import sys
from dataclasses import asdict
from pathlib import Path

from promptlang.runtime import engine
from promptlang.runtime.model.lora import SeamLoRA
from promptlang.runtime.tune import corpus
from promptlang.runtime.tune.train import (TuneOptions, evaluate, held_out_sets, plain_copy,
                                           private_engine, split_corpus)


def main(corpus_path: str, out_path: str, adapters: list[str]) -> None:
    llm = engine.load(None, seam_adapter=False)
    options = TuneOptions(seed=0, same_shape=0.5, gapless=0.5)
    docs = corpus.load_corpus(Path(corpus_path))
    val_docs, _ = split_corpus(docs, random.Random(options.seed), options)
    model = plain_copy(llm.adapter.model)
    sets = held_out_sets(private_engine(llm), model, val_docs, options,
                         set(llm.tokenizer.eos_ids))
    results = {}
    for path in adapters:
        adapter, _ = SeamLoRA.load(Path(path))
        results[path] = {name: asdict(evaluate(model, samples, adapter))
                         for name, samples in sets.items()}
        print(path, json.dumps(results[path]))
    Path(out_path).write_text(json.dumps({"corpus": corpus_path, "seed": options.seed,
                                          "adapters": results}, indent=1))


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
