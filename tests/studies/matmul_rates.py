"""Study (not a test): torch's float32 and bfloat16 matmul rates on this CPU.

    python tests/studies/matmul_rates.py OUT.json

(M x 576) @ (576 x 1536), the default model's hidden size by its MLP width, for several row
counts M: GFLOP/s in float32 and in bfloat16 (float32 sums inside, oneDNN), each the median
of 5 samples of at least 1 s, torch's own thread count. What the CPU's units offer the
bfloat16 passes (runtime/model/compute.py), before any model code.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

ROWS = (1, 16, 64, 256, 1024, 4096)
K, N = 576, 1536


def rate(rows: int, dtype: torch.dtype, samples: int = 5, seconds: float = 1.0) -> float:
    """Median GFLOP/s of `samples` runs of at least `seconds` each."""
    generator = torch.Generator().manual_seed(rows)
    a = torch.randn(rows, K, generator=generator).to(dtype)
    b = torch.randn(K, N, generator=generator).to(dtype)
    torch.matmul(a, b)
    rates = []
    for _ in range(samples):
        count = 0
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            torch.matmul(a, b)
            count += 1
        rates.append(2 * rows * K * N * count / (time.perf_counter() - start) / 1e9)
    return statistics.median(rates)


def main(out_path: str) -> None:
    from promptlang.runtime.model.compute import cpu_bf16_units, cpu_name

    rows = []
    for m in ROWS:
        f32 = rate(m, torch.float32)
        bf16 = rate(m, torch.bfloat16)
        rows.append({"rows": m, "float32_gflops": round(f32, 1), "bfloat16_gflops": round(bf16, 1),
                     "ratio": round(bf16 / f32, 2)})
        print(f"M={m:5d}  float32 {f32:8.1f} GFLOP/s  bfloat16 {bf16:8.1f} GFLOP/s  "
              f"{bf16 / f32:.2f}x", flush=True)
    record = {"cpu": cpu_name(), "units": list(cpu_bf16_units()), "torch": torch.__version__,
              "threads": torch.get_num_threads(), "shape": f"M x {K} @ {K} x {N}",
              "rows": rows}
    with open(out_path, "w") as out:
        json.dump(record, out, indent=1)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
