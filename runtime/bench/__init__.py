"""Benchmarks behind `promptlang bench latency|memory|accuracy`.

qa.py      synthetic multi-document QA items (no downloads) and their PML schema/prompt
memory.py  KV bytes per token, from published configs or a transformers config
floor.py   this machine's matmul rate and memory bandwidth; the physical floor of a request
shapes.py  model shapes (layers, heads, ...) that memory.py and floor.py compute from
report.py  text tables, CSV/JSON, the TTFT-vs-length plot, power-law fits, progress bars

Only floor.py imports torch, and report.py imports matplotlib only to plot.
"""
