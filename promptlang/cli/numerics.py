"""How the model computes, for the commands that load one (`run`, `serve`): --dtype,
--quantize, --kv-dtype, --int8-linears, --bf16-attention (runtime/engine.py `load`; docs/BENCHMARKS.md
measures what each costs in answers and buys in time)."""

from __future__ import annotations

import argparse
from typing import Any


def add(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quantize", choices=("q4_1", "q8_0"), default=None,
                        help="weight-only quantization of a float --model (Llama family): "
                             "linear weights as Q4_1 or Q8_0 blocks, the LM head Q8_0")
    parser.add_argument("--kv-dtype", choices=KV_DTYPES, default="float32",
                        help="the precision cached KV is kept and read at (default float32; "
                             "float16, llama.cpp's KV type, halves its bytes and moves the "
                             "next-token distribution by a KL of ~1e-7: docs/BENCHMARKS.md)")
    add_approximations(parser)


KV_DTYPES = ("float32", "float16", "bfloat16")
COMPUTE_CHOICES = ("float32", "bfloat16", "auto")     # runtime/model/compute.py CHOICES


def add_approximations(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", choices=COMPUTE_CHOICES, default="float32",
                        help="the dtype of passes of many new tokens -- module encode, "
                             "recompute, prefill (default float32; bfloat16 needs AMX or "
                             "AVX512-BF16, auto takes it where the CPU has them; decode "
                             "steps and KV stay float32: docs/BENCHMARKS.md)")
    parser.add_argument("--int8-linears", action="store_true",
                        help="approximate: the fused layers multiply int8 weights by 12-bit "
                             "inputs (integer products: AVX512_VNNI, else AVX2; Llama family)")
    parser.add_argument("--bf16-attention", action="store_true",
                        help="approximate: passes of 8+ new tokens compute the attention's "
                             "products from bfloat16 inputs (CPUs with AVX512_BF16)")


def load_options(args: argparse.Namespace) -> dict[str, Any]:
    """`engine.load` keyword arguments for what `args` asks (nothing for the defaults)."""
    options: dict[str, Any] = {}
    if getattr(args, "quantize", None):
        options["quantize"] = args.quantize
    if getattr(args, "kv_dtype", "float32") != "float32":
        import torch
        options["store_dtype"] = getattr(torch, args.kv_dtype)
    for name in ("int8_linears", "bf16_attention"):
        if getattr(args, name, False):
            options[name] = True
    if getattr(args, "dtype", "float32") != "float32":
        options["compute"] = args.dtype
    return options
