"""promptlang.runtime: model adapters, encoder, module store, assembler, generator.

Data flow of one request (docs/ARCHITECTURE.md has the whole map):

    engine.py      bind the prompt, then drive the steps below
    recompute/     the request's recompute policy -> the cached tokens computed again
    passes/        encoder.py: unit -> KV at its layout positions (one forward pass);
                   prefill.py: the uncached tokens in one pass (and the visibility rule);
                   probe.py: query:K's probe pass
    store/         units' KV by content key, in device / host / disk tiers
    kv/            UnitKV (unit.py); the request's buffer of pieces (assembler.py);
                   the recompute plan (plan.py); prompt tails (tails.py)
    decoding/      the one decode loop (decode.py; sampling.py picks tokens), one open
                   decode (open_decode.py) and the types handed back (results.py)
    conversation/  multi-turn sessions (session.py) and the ReAct agent (agent.py)
    model/         the only code that knows transformers (and loading, quantize);
                   fast/ its CPU kernels

The public names are imported lazily, so `import promptlang.runtime` stays cheap.
"""

from __future__ import annotations

__all__ = ["load", "LLM", "Result", "Timings", "Session", "Agent", "Tool", "tool"]

_HOME = {"load": "engine", "LLM": "engine", "Result": "engine", "Timings": "engine",
         "Session": "conversation.session", "Agent": "conversation.agent",
         "Tool": "conversation.agent", "tool": "conversation.agent"}


def __getattr__(name: str):
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'promptlang.runtime' has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(f"promptlang.runtime.{home}"), name)
