"""The model: a transformers causal LM driven at explicit positions with explicit masks.

The only code that knows transformers' cache classes and attention plumbing. Layout:

    families.py     the registry: model_type -> position scheme and fast paths taken
    adapter.py      ModelAdapter.forward (Past, SharedKV, Step): the one entry point
    schemes.py      one adapter per position scheme (RoPE, learned, ALiBi), and `adapt`
    attention.py    the RoPE models' attention: new tokens against a long cache, no masks
    internals.py    every use of transformers' (and torch's) internals, with why
    state.py        promptlang's per-model state (lock, in-pass flag), beside the model
    fingerprint.py  what determines the KV, as a stable id (the store's key)
    lora.py         the seam adapter: a LoRA on the attention projections, optional link
                    tokens (`promptlang tune`)
    seam.py         serving it: SeamModel, the model with the adapter in its weights (policy
                    tuned), and where an adapter is found (the home's, else a shipped one)

Data flow: `adapt(hf_model)` looks the model's family up, builds its scheme's adapter,
which fingerprints the weights and calls `runtime.fast.accelerate` once to install the CPU
kernels' paths. The encoder and the generator then call `adapter.forward(ids, positions,
past, allowed)` -> Step(logits, new keys, new values), the new keys and values written into
the caller's buffer.
"""

from __future__ import annotations

from promptlang.runtime.model.adapter import (KVShape, ModelAdapter, ParallelContexts, Past,
                                              SharedKV, Step, causal_allowed, float_mask)
from promptlang.runtime.model.attention import ATTENTION
from promptlang.runtime.model.families import FAMILIES, SCHEMES, Family
from promptlang.runtime.model.fingerprint import model_fingerprint
from promptlang.runtime.model.schemes import (AlibiAdapter, LearnedPositionAdapter, RopeAdapter,
                                              adapt)

__all__ = ["ATTENTION", "AlibiAdapter", "FAMILIES", "Family", "KVShape", "LearnedPositionAdapter",
           "ModelAdapter", "ParallelContexts", "Past", "RopeAdapter", "SCHEMES", "SharedKV", "Step",
           "adapt", "causal_allowed", "float_mask", "model_fingerprint"]
