"""`promptlang compile --plan`: what each schema will cost to cache, before it is encoded.

Loads the model (`--model`, else the default) for its tokenizer and KV geometry, reads
the encode rate kept for this CPU (or measures it once, a few seconds), and prints a
table per schema (compiler/cache_plan.py). Nothing is encoded or stored.
"""

from __future__ import annotations

import sys
from typing import Sequence

DTYPES = ("float32", "bfloat16")


def print_plans(schemas: Sequence, model: str | None, out=None) -> int:
    import torch

    from promptlang.compiler.cache_plan import format_plan, plan_schema
    from promptlang.runtime import engine
    from promptlang.runtime.kv.unit import bytes_per_token
    from promptlang.runtime.model.encode_rate import encode_rate

    out = sys.stdout if out is None else out
    llm = engine.load(model)
    shape = llm.adapter.kv_shape
    per_token = {d: bytes_per_token(shape.layers, shape.kv_heads, shape.key_dim,
                                    shape.value_dim, getattr(torch, d)) for d in DTYPES}
    rate = encode_rate(llm.adapter, progress=lambda text: print(text, file=sys.stderr))
    source = "kept from " + rate.measured if rate.cached else "measured now"
    note = (f"encode time: c0 + c1*N + c2*N^2 = {rate.c0 * 1e3:.1f} ms + "
            f"{rate.c1 * 1e6:.1f} us*N + {rate.c2 * 1e9:.2f} ns*N^2 on this CPU "
            f"({source}); KV as the store keeps it: float32 by default, bfloat16 "
            f"with load(store_dtype=torch.bfloat16)")
    for index, schema in enumerate(schemas):
        plan = plan_schema(schema, llm.tokenizer, per_token, rate.seconds)
        if index:
            print(file=out)
        print(format_plan(plan, DTYPES, note), file=out)
    return 0
