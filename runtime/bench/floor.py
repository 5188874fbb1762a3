"""The physical floor of a cached request, measured on this machine in this run.

A cached request must at least read every weight once and every cached KV byte
once, and do the arithmetic of its uncached tokens:

    floor = max(FLOPs_uncached / matmul_rate, (weight_bytes + kv_bytes) / bandwidth)

`measure_machine` gets the rate from a large float32 matmul and the bandwidth from
a large tensor copy, each the best of a few repeats (best, not mean: other load on
the machine only ever slows a run down). Both use torch's current thread setting,
so measure under the same `torch.set_num_threads` as the benchmark.
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from promptlang.runtime.bench.shapes import ModelShape, shape_from_config


@dataclass(frozen=True)
class Machine:
    matmul_flops_per_s: float
    copy_bytes_per_s: float     # bytes read plus bytes written
    threads: int


def _best_seconds(run: Callable[[], None], repeats: int) -> float:
    run()   # warm up: first-touch page faults, thread pool start
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def measure_matmul_rate(n: int = 1024, repeats: int = 3) -> float:
    """FLOP/s of an n x n by n x n float32 matmul (2 n^3 FLOPs)."""
    a = torch.randn(n, n)
    b = torch.randn(n, n)
    out = torch.empty(n, n)
    seconds = _best_seconds(lambda: torch.matmul(a, b, out=out), repeats)
    return 2 * n**3 / seconds


def measure_bandwidth(nbytes: int = 64 << 20, repeats: int = 3) -> float:
    """Bytes/s of copying an `nbytes` float32 tensor, counting the read and the write.
    Keep `nbytes` well above the last-level cache, or this measures the cache."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    seconds = _best_seconds(lambda: dst.copy_(src), repeats)
    return 2 * src.numel() * 4 / seconds


def measure_machine(matmul_n: int = 1024, copy_bytes: int = 64 << 20,
                    repeats: int = 3) -> Machine:
    """Both measurements; well under 2 s on a 2-core machine at the default sizes."""
    return Machine(measure_matmul_rate(matmul_n, repeats),
                   measure_bandwidth(copy_bytes, repeats), torch.get_num_threads())


def floor_seconds(flops_uncached: float, weight_bytes: float, kv_bytes: float,
                  rate: float, bandwidth: float) -> float:
    """max(compute time, time to read the weights and the cached KV once)."""
    return max(flops_uncached / rate, (weight_bytes + kv_bytes) / bandwidth)


def prefill_flops(config: ModelShape | Any, n_new: int, n_context: int,
                  logits_tokens: int = 1) -> float:
    """FLOPs to compute `n_new` tokens that attend to `n_context` cached tokens.

        2 * n_new * layers * linear_params_per_layer      Q/K/V/O and MLP matmuls
      + 2 * logits_tokens * hidden * vocab                LM head (TTFT needs 1 row)
      + 4 * layers * heads * head_dim * sum_{i=1..n_new} (n_context + i)
                                                          QK^T and AV: token i sees
                                                          n_context + i keys, 2*D each

    A multiply-add counts as 2 FLOPs. Norms, activations, RoPE and softmax are
    O(n_new * hidden) per layer and left out.
    """
    shape = config if isinstance(config, ModelShape) else shape_from_config(config)
    linear = 2 * n_new * shape.layers * shape.linear_params_per_layer()
    head = 2 * logits_tokens * shape.hidden * shape.vocab
    keys_seen = n_new * n_context + n_new * (n_new + 1) // 2
    attention = 4 * shape.layers * shape.heads * shape.head_dim * keys_seen
    return float(linear + head + attention)


def module_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of a model's parameters (shared tensors, e.g. tied embeddings, once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def cpu_name() -> str:
    """The CPU's model name as the OS reports it ("" when it does not)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def machine_facts(machine: Machine) -> dict[str, Any]:
    """What a reader needs to compare a run with their own: the hardware this process
    may use, the measured rates, and the software versions."""
    import sys

    import transformers

    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:           # not on Linux
        usable = os.cpu_count()
    return {
        "cpu": cpu_name(),
        "logical_cores": os.cpu_count(),
        "usable_cores": usable,
        "torch_threads": machine.threads,
        "matmul_gflops": round(machine.matmul_flops_per_s / 1e9, 1),
        "copy_gb_per_s": round(machine.copy_bytes_per_s / 1e9, 2),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "kernels": _kernels(),
    }


def _kernels() -> str:
    """Which kernels the runtime's CPU passes take in this process."""
    from promptlang.runtime import native

    if not native.enabled():
        return "PyTorch's (PROMPTLANG_NATIVE=0)"
    if not native.available():
        return "PyTorch's (runtime/kernels.c unavailable here)"
    return ("runtime/kernels.c (AVX2): whole decoder layers for Llama-family models "
            "(runtime/fused.py), else small linears and unmasked attention; PyTorch's for the "
            "rest")
