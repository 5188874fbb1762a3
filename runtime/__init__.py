"""promptlang.runtime: model adapters, encoder, module store, assembler, generator.

Data flow of one request (docs/ARCHITECTURE.md has the whole map):

    engine.py     bind the prompt, then drive the steps below; timings (results.py)
    recompute/    the request's recompute policy -> the cached tokens computed again
    encoder.py    unit -> KV at its layout positions (one forward pass), via the store
    store/        KV by content key, in device / host / disk tiers
    assembler.py  the request's units' KV into a pooled, preallocated buffer
    prefill.py    the uncached tokens in one pass (and the visibility rule)
    decode.py     the one decode loop (sampling.py picks tokens)
    model/        the only code that knows transformers; fast/ its CPU kernels

The public names are imported lazily, so `import promptlang.runtime` stays cheap.
"""

from __future__ import annotations

__all__ = ["load", "LLM", "Result", "Timings", "Session", "Agent", "Tool", "tool"]

_HOME = {"load": "engine", "LLM": "engine", "Result": "engine", "Timings": "engine",
         "Session": "session", "Agent": "agent", "Tool": "agent", "tool": "agent"}


def __getattr__(name: str):
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'promptlang.runtime' has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(f"promptlang.runtime.{home}"), name)
