"""Selective recompute (docs/RECOMPUTE.md): cached tokens a request computes again.

policy.py   the policy as text ("none", "seams", "first:K", "query:K", "deviation:F",
            "exact", "ape[:T[:S]]") ->
            `Recompute` (DEFAULT_POLICY: "exact"),
            and a schema's `recompute` attribute read with its location
choose.py   a policy -> the positions it recomputes for one request (`choose_positions`),
            and APE's contexts (`parallel_contexts`: which tokens the request's new ones
            attend to with APE's temperature and scale)
deviation.py  the deviation policy's measure: one pass stopped after layer 1
The query policy's measure is a probe pass (runtime/passes/probe.py: the last token's
attention to each cached token; the engine calls `probe_choice` instead of
choose_positions). The positions chosen become a `RecomputePlan` (runtime/kv/plan.py: the
request's extra uncached segments, and the stored copies the assembler leaves out).
exact.py    exact reuse: units a request made exact, stored under the request's
            tokens before them and served as they are to any request with the same ones
contiguous.py  `exact` at contiguous positions: a request with gaps in its layout
            positions numbered by rank from its first gap on, everything there computed
            again

Data flow (runtime/engine.py): exact.lookup (units seen before with the same tokens before
them, served exactly); request policy, else `schema_policy(schema)`, else the LLM's ->
choose_positions -> RecomputePlan.of(bound, positions) -> plan.uncached(bound) for the
prefill, the plan for the assembler; after the prefill, exact.remember of the units the
request made exact (exact.made_exact).
"""

from __future__ import annotations

__all__ = ["Recompute", "DEFAULT_POLICY", "schema_policy",
           "choose_positions", "first_tokens", "parallel_contexts", "candidates", "deviations",
           "layer_kv", "DEVIATION_LAYER", "RecomputePlan", "NO_RECOMPUTE", "exact"]

# imported on first use: the policy's text parsing (CLI arguments) needs no torch
_HOME = {"Recompute": "policy", "DEFAULT_POLICY": "policy",
         "schema_policy": "policy",
         "choose_positions": "choose", "first_tokens": "choose",
         "parallel_contexts": "choose", "candidates": "deviation",
         "deviations": "deviation", "layer_kv": "deviation", "DEVIATION_LAYER": "deviation",
         "RecomputePlan": "promptlang.runtime.kv.plan",
         "NO_RECOMPUTE": "promptlang.runtime.kv.plan"}


def __getattr__(name: str):
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'promptlang.runtime.recompute' has no attribute {name!r}")
    import importlib
    module = home if "." in home else f"promptlang.runtime.recompute.{home}"
    return getattr(importlib.import_module(module), name)
