"""Benchmarks behind `promptlang bench latency|memory|accuracy`.

cli.py       the `promptlang bench` commands: options, output folder, printing, files
latency.py   TTFT baseline vs cached by length and store tier; floor, decode, goals
rag.py       k of N documents per request: promptlang against a prefix-cache policy
memory.py    KV bytes per token, from published configs, a transformers config, the store
accuracy.py  the QA items answered with and without modular encoding; scores
qa.py        synthetic multi-document QA items (no downloads) and their PML schema/prompt
floor.py     this machine's matmul rate and memory bandwidth; the physical floor of a request
shapes.py    model shapes (layers, heads, ...) that memory.py and floor.py compute from
report.py    text/Markdown tables, CSV/JSON, the TTFT plot, fits, goals, progress bars

floor.py, latency.py and rag.py import torch; the others import it only inside the
functions that run a model, so `promptlang --help` and `pml check` stay light. report.py imports
matplotlib only to plot.
"""
