"""Benchmarks behind `promptlang bench latency|memory|accuracy|all` (imported as
promptlang.bench; the `bench` extra adds matplotlib for the plots).

run.py        runs one command: model, output folder, header, tables, files, exit status
              (the command line itself is parsed in promptlang/cli/bench.py)
latency/      TTFT baseline vs cached by length and store tier; floor, decode, goals
rag.py        k of N documents per request: promptlang against a prefix-cache policy
memory.py     KV bytes per token, from published configs, a transformers config, the store
accuracy/     the QA items answered with and without modular encoding; scores, recovery
settings.py   the accuracy settings' names and defaults (DEFAULT_RECOMPUTE's one owner)
metrics.py    paired bootstrap intervals, recovery, KL
qa.py         synthetic multi-document QA items (no downloads) and their PML schema/prompt
qa_kinds.py   the invented people, their documents, and the builder of each item kind
floor.py      this machine's matmul rate and memory bandwidth; the physical floor of a request
shapes.py     model shapes (layers, heads, ...) that memory.py and floor.py compute from
report.py     text/Markdown tables, CSV/JSON, the TTFT plot, fits, goals, progress bars
parse_scaling.py  PML parse time against input size (`python -m promptlang.bench.parse_scaling`)

floor.py, latency/ and rag.py import torch; the others import it only inside the functions
that run a model, so `promptlang --help` and `pml check` stay light. Plots import matplotlib
only when drawn; without it (no `bench` extra) run.py writes the tables and says so once.
"""
