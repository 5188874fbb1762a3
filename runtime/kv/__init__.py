"""A unit's KV (`UnitKV`), a request's buffer of pieces (the assembler), the recompute
plan that says which of its positions are computed again, and the prompt-tail cache."""
