"""The CPU kernels' fast paths, installed on a model adapter by one call: `accelerate`.

    library.py    builds kernels.c, checks a stored build, loads it, declares its kernels
    native.py     the kernels' switches and ctypes wrappers (loads library.py's build once)
    kernels.c     pl_linear, pl_attend, pl_decoder (AVX2/FMA, OpenMP; 512-bit tiles on AVX-512F)
    linear.py     nn.Linear -> pl_linear for small inputs, during the runtime's passes only
    attention.py  pl_attend inside the RoPE attention (runtime/model/attention.py)
    fused.py      pl_decoder: every decoder layer of a Llama-family model in one call
    pieces.py     a past's slots as pieces: buffer spans and units' KV read in place

Data flow: `ModelAdapter.__init__` calls `accelerate(adapter)` once; the FastPaths it gets
back ride along its passes (`decoder` is tried first for an unmasked pass, `attention` is
handed down to the RoPE attention). Which paths a family takes is written in its registry
entry (runtime/model/families.py). Every path answers None where it does not apply, and
the pass then runs on PyTorch; both are held to the oracle (tests/runtime/test_oracle.py,
test_fused.py, test_native.py, test_full_length.py).

Switches: `PROMPTLANG_NATIVE=0` (every kernel off), `PROMPTLANG_REQUIRE_NATIVE=1` (missing
kernels are an error), `PROMPTLANG_AVX512=0` (the 256-bit tiles even on an AVX-512 CPU;
`native.wide()` at run time), `native.disabled()` and `fused.disabled()` (context managers).
"""

from __future__ import annotations

from typing import NamedTuple

from promptlang.runtime.fast import linear
from promptlang.runtime.fast.attention import NativeAttention
from promptlang.runtime.fast.fused import FusedDecoder

__all__ = ["FastPaths", "accelerate"]


class FastPaths(NamedTuple):
    """What `accelerate` installed for one adapter (None: that path is not taken)."""

    decoder: FusedDecoder | None        # every layer by pl_decoder
    attention: NativeAttention | None   # pl_attend inside transformers' layers


def accelerate(adapter) -> FastPaths:
    """Install the fast paths `adapter.family` takes on `adapter.model`.

    Small linears go to pl_linear for every family (once per model, kept in
    `adapter.state`, and only during the runtime's own passes); RoPE families get pl_attend;
    families naming a decoder prefix get pl_decoder where the model's structure is exactly
    that family's."""
    linear.install(adapter.model, adapter.state)
    family = adapter.family
    decoder = None if family.decoder is None else FusedDecoder.of(adapter.model, family.decoder)
    attention = NativeAttention() if family.native_attention else None
    return FastPaths(decoder, attention)
