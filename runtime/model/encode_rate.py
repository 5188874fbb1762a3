"""How long encoding a unit of N tokens takes on this machine: measured once per CPU and
model, kept in the home's compute/ folder, and read by `promptlang compile --plan`.

An encode is one pass of N new tokens with no past (`ModelAdapter.forward`). Its time is
fitted as c0 + c1*N + c2*N^2 (fixed cost, the linear layers, attention) to the median of
a few passes at each of six lengths, by least squares on relative error (a module of 20
tokens is estimated as well as one of 2,000).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from promptlang.home import compute_dir, untrusted_reason, write_private
from promptlang.runtime.model.compute import cpu_name

SIZES = (16, 48, 128, 384, 1024, 2048)
REPEATS = 3


@dataclass(frozen=True)
class EncodeRate:
    c0: float
    c1: float
    c2: float
    measured: str                  # the date it was measured
    cached: bool                   # read from the home (else measured by this call)

    def seconds(self, tokens: int) -> float:
        return max(0.0, self.c0 + self.c1 * tokens + self.c2 * tokens * tokens)


def rate_file(fingerprint: str) -> Path:
    digest = hashlib.sha256(f"encode|{cpu_name()}|{fingerprint}|{torch.__version__}|"
                            f"{torch.get_num_threads()}".encode()).hexdigest()[:24]
    return compute_dir() / f"encode-{digest}.json"


def encode_rate(adapter, progress=None) -> EncodeRate:
    """The encode time model of `adapter` on this CPU: kept, or measured now (a few seconds;
    `progress(text)` is told first) and kept."""
    path = rate_file(adapter.fingerprint)
    kept = _read(path)
    if kept is not None:
        return kept
    if progress is not None:
        progress("measuring this machine's encode rate (once per CPU and model)")
    timings = {n: _median_pass(adapter, n) for n in SIZES}
    c0, c1, c2 = _fit(timings)
    record = {"c0": c0, "c1": c1, "c2": c2, "date": time.strftime("%Y-%m-%d"),
              "cpu": cpu_name(), "threads": torch.get_num_threads(),
              "timings_s": {str(n): t for n, t in timings.items()}}
    try:
        write_private(path, json.dumps(record, indent=1).encode())
    except OSError:
        pass                           # measured again next time
    return EncodeRate(c0, c1, c2, record["date"], cached=False)


def _read(path: Path) -> EncodeRate | None:
    if untrusted_reason(path) is not None:
        return None
    try:
        data = json.loads(path.read_text())
        values = [float(data[k]) for k in ("c0", "c1", "c2")]
        return EncodeRate(*values, measured=str(data.get("date", "")), cached=True)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _median_pass(adapter, tokens: int) -> float:
    generator = torch.Generator().manual_seed(tokens)
    ids = torch.randint(0, adapter.vocab_size, (tokens,), generator=generator)
    positions = torch.arange(tokens)
    samples = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        adapter.forward(ids, positions, None, None, torch.tensor([tokens - 1]))
        samples.append(time.perf_counter() - start)
    return sorted(samples)[len(samples) // 2]


def _fit(timings: dict[int, float]) -> tuple[float, float, float]:
    """Non-negative c0, c1, c2 of c0 + c1*N + c2*N^2, least squares on relative error."""
    n = torch.tensor(list(timings), dtype=torch.float64)
    t = torch.tensor(list(timings.values()), dtype=torch.float64)
    columns = torch.stack([torch.ones_like(n), n, n * n], dim=1)
    best = None
    for keep in ((0, 1, 2), (0, 1), (1, 2), (1,)):        # drop a term that fits negative
        system = columns[:, keep] / t[:, None]
        solution = torch.linalg.lstsq(system, torch.ones_like(t)).solution
        if bool((solution >= 0).all()):
            coefficients = [0.0, 0.0, 0.0]
            for index, value in zip(keep, solution.tolist()):
                coefficients[index] = value
            error = float(((columns @ torch.tensor(coefficients, dtype=torch.float64)) / t - 1)
                          .abs().max())
            if best is None or error < best[0]:
                best = (error, coefficients)
    return tuple(best[1]) if best is not None else (0.0, float((t / n).mean()), 0.0)
