"""The physical floor of a cached request, measured on this machine in this run.

A cached request must at least read every weight once and every cached KV byte
once, and do the arithmetic of its uncached tokens:

    floor = max(FLOPs_uncached / matmul_rate, (weight_bytes + kv_bytes) / bandwidth)

The matmul rate is the machine's best *sustained* float32 matmul (sgemm): `best_sgemm`
times each candidate shape in a loop of a fixed length (not one call: a burst can beat
what the cores keep up) and keeps the fastest shape. The candidates are large squares
and the model's own projections at a prefill's row count (`workload_shapes`), so a weak
reference shape cannot make the floor look high. The bandwidth is a large tensor copy
(bytes read plus written), the best of a few. `FloorSampler` measures both again, with
the chosen shape, as often as a benchmark takes a sample, so each request's floor comes
from the same minutes as the request. Everything runs under torch's current thread
setting: measure under the same `torch.set_num_threads` as the benchmark.
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from promptlang.bench.shapes import ModelShape, shape_from_config

SQUARE_SHAPES = ((1024, 1024, 1024), (2048, 2048, 2048))   # (M, K, N)
PREFILL_ROWS = 2048        # rows of the workload shapes: a prefill chunk of the baseline


@dataclass(frozen=True)
class Sgemm:
    """One sgemm shape, C[M, N] = A[M, K] @ B[K, N], and its sustained rate."""

    m: int
    k: int
    n: int
    flops_per_s: float
    what: str = ""             # where the shape comes from ("square", "MLP up", ...)

    @property
    def name(self) -> str:
        return f"{self.m}x{self.k}x{self.n}"


@dataclass(frozen=True)
class Machine:
    matmul_flops_per_s: float  # the best sustained sgemm's
    copy_bytes_per_s: float    # bytes read plus bytes written
    threads: int
    sgemm: str = ""            # which shape gave the rate (MxKxN, and what it is)


def _best_seconds(run: Callable[[], None], repeats: int) -> float:
    run()   # warm up: first-touch page faults, thread pool start
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def workload_shapes(shape: ModelShape, rows: int = PREFILL_ROWS) -> list[tuple[int, int, int, str]]:
    """(M, K, N, what) of the matmuls a prefill of `rows` tokens runs in every layer of
    `shape`: the query projection and the MLP's up and down projections."""
    return [(rows, shape.hidden, shape.heads * shape.head_dim, "query projection"),
            (rows, shape.hidden, shape.intermediate, "MLP up"),
            (rows, shape.intermediate, shape.hidden, "MLP down")]


def sgemm_rate(m: int, k: int, n: int, seconds: float = 0.1) -> float:
    """FLOP/s of A[m, k] @ B[k, n] (2 m k n FLOPs) run back to back for at least
    `seconds` after one untimed call: a sustained rate, not the best single call."""
    a = torch.randn(m, k)
    b = torch.randn(k, n)
    out = torch.empty(m, n)
    torch.matmul(a, b, out=out)
    calls = 0
    began = time.perf_counter()
    while True:
        torch.matmul(a, b, out=out)
        calls += 1
        elapsed = time.perf_counter() - began
        if elapsed >= seconds:
            return 2 * m * k * n * calls / elapsed


def best_sgemm(shapes: Sequence[tuple[int, int, int, str]], seconds: float = 0.2
               ) -> tuple[Sgemm, list[Sgemm]]:
    """(the fastest, all of them) of `shapes`, each timed by `sgemm_rate`."""
    measured = [Sgemm(m, k, n, sgemm_rate(m, k, n, seconds), what) for m, k, n, what in shapes]
    return max(measured, key=lambda s: s.flops_per_s), measured


def candidate_shapes(shape: ModelShape | None = None) -> list[tuple[int, int, int, str]]:
    """The squares, and the model's prefill matmuls when a model shape is given."""
    squares = [(m, k, n, "square") for m, k, n in SQUARE_SHAPES]
    return squares + (workload_shapes(shape) if shape is not None else [])


def measure_bandwidth(nbytes: int = 64 << 20, repeats: int = 3) -> float:
    """Bytes/s of copying an `nbytes` float32 tensor, counting the read and the write.
    Keep `nbytes` well above the last-level cache, or this measures the cache."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    seconds = _best_seconds(lambda: dst.copy_(src), repeats)
    return 2 * src.numel() * 4 / seconds


def measure_machine(shapes: Sequence[tuple[int, int, int, str]] | None = None,
                    copy_bytes: int = 64 << 20, seconds: float = 0.2,
                    repeats: int = 3) -> Machine:
    """The best sustained sgemm over `shapes` (default: the squares) and the copy
    bandwidth; a few seconds on a 2-core machine at the defaults."""
    best, _ = best_sgemm(shapes or candidate_shapes(), seconds)
    return Machine(best.flops_per_s, measure_bandwidth(copy_bytes, repeats),
                   torch.get_num_threads(), f"{best.name} ({best.what})")


class FloorSampler:
    """One sgemm shape and one copy, measured again on every `sample()` call: the rates
    of the moment, for a floor interleaved with the requests it judges."""

    def __init__(self, sgemm: Sgemm, copy_bytes: int = 64 << 20, seconds: float = 0.05,
                 copies: int = 3):
        self.sgemm = sgemm
        self.seconds = seconds
        self.copies = copies
        self._src = torch.ones(copy_bytes // 4)
        self._dst = torch.empty_like(self._src)

    def sample(self) -> tuple[float, float]:
        """(matmul FLOP/s, copy bytes/s) measured now."""
        s = self.sgemm
        rate = sgemm_rate(s.m, s.k, s.n, self.seconds)
        seconds = _best_seconds(lambda: self._dst.copy_(self._src), self.copies)
        return rate, 2 * self._src.numel() * 4 / seconds


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
        "matmul_sgemm": machine.sgemm,
        "copy_gb_per_s": round(machine.copy_bytes_per_s / 1e9, 2),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "kernels": _kernels(),
    }


def _kernels() -> str:
    """Which kernels the runtime's CPU passes take in this process."""
    from promptlang.runtime.fast import native

    if not native.enabled():
        return "PyTorch's (PROMPTLANG_NATIVE=0)"
    if not native.available():
        return "PyTorch's (runtime/fast/kernels.c unavailable here)"
    tiles = "AVX2, 512-bit tiles" if native.wide() else "AVX2"
    long_passes = [name for dtype, name in ((torch.float32, "float32"),
                                            (torch.bfloat16, "bfloat16"))
                   if native.causal_serves(dtype)]
    causal = (f"; the attention of passes of 65+ new tokens in {' and '.join(long_passes)} "
              "(pl_causal)" if long_passes else "")
    return (f"runtime/fast/kernels.c ({tiles}): whole decoder layers for Llama-family models "
            "(runtime/fast/fused.py), else small linears and unmasked attention"
            f"{causal}; PyTorch's for the rest")
