"""Study helper (not a test): the benchmark generator's documents as PML schemas.

    python tests/studies/bench_documents_pml.py OUT-FOLDER [--items N] [--seed S]

Writes N items of every question kind from `bench/qa.py` (seed S, 4 documents each, the
bench's default lengths), each document a cached module, one schema file per kind (a
schema's modules are laid out one after another, so all of them would not fit the
context), for `promptlang tune OUT-FOLDER`: a user who tunes the seam adapter on documents like the ones they serve. The
seed must not be the accuracy bench's (0): those items are the evaluation's.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from xml.sax.saxutils import escape

from promptlang.bench import qa

KINDS = ("single", "cross", "dependent", "needle", "same-shape", "argument")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--items", type=int, default=6)
    parser.add_argument("--seed", type=int, default=1000)
    args = parser.parse_args()
    if args.seed == 0:
        parser.error("seed 0 makes the accuracy bench's own items")
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    for kind in KINDS:
        modules = []
        for item in qa.generate(args.items, seed=args.seed, kind=kind, docs_per_item=4):
            for document in item.documents:
                modules.append(f'  <module name="d{len(modules)}">{escape(document.text)}'
                               '</module>')
        path = folder / f"{kind}.pml"
        path.write_text(f'<schema name="bench-like-{kind}">\n' + "\n".join(modules)
                        + "\n</schema>\n")
        print(f"{path}: {len(modules)} documents")


if __name__ == "__main__":
    main()
