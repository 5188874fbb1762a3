"""Multi-row passes in bfloat16 on CPUs with matrix units (AMX, AVX512-BF16).

`load(compute="bfloat16")` (or "auto" on a CPU that has the units) gives the adapter a
`Bf16Compute`: a bfloat16 twin of the model (its own copy of the weights, 2 bytes each)
that runs every pass of at least `min_rows` new tokens through transformers' layers and
promptlang's attention, with oneDNN's bfloat16 matmuls (float32 sums inside each product)
and bfloat16 activations. Shorter passes -- decode steps, a short question -- stay on
the float32 paths (the fused layers, pl_linear), which are faster there. Keys and values
are written into the request's float32 buffers and stored as float32, so everything that
reads KV is unchanged. The adapter's fingerprint names the setting, so KV computed in
bfloat16 is stored apart from float32 KV.

`min_rows` is measured on this machine (`calibrate`): the fewest new tokens for which the
twin's pass is faster than the float32 one, cached per CPU model and model fingerprint
under the home's cache (`compute/`), so the measurement runs once per machine.

A request's answer must not depend on what the cache holds or on which requests share a
pass, so the engine decides per request, from the request alone (`for_request`: its
whole prompt, cached tokens included, has at least `min_rows` tokens), and runs every pass
of its prompt on that side (`ModelAdapter.passes_in`); a unit is encoded on the side its
own length chooses; decode steps stay float32. Only a pass no request decided (a
measurement, a probe) falls back to its own row count.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import platform
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from promptlang.errors import ConfigError
from promptlang.home import compute_dir, untrusted_reason, write_private
from promptlang.runtime.fast.native import kernels_version

CHOICES = ("float32", "bfloat16", "auto")
CALIBRATION_ROWS = (8, 16, 32, 64, 128, 256)
DEFAULT_MIN_ROWS = 64              # where no measurement is at hand
_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


def cpu_bf16_units() -> tuple[str, ...]:
    """The bfloat16 matrix units this CPU reports (a subset of amx_bf16, avx512_bf16)."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        text = ""
    flags = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[-1].split())
            break
    found = tuple(flag for flag in _CPU_FLAGS if flag in flags)
    if found or text:
        return found
    checks = (("amx_bf16", "_is_amx_tile_supported"), ("avx512_bf16", "_is_avx512_bf16_supported"))
    return tuple(flag for flag, name in checks if getattr(torch.cpu, name, lambda: False)())


def resolve(choice: str | torch.dtype | None) -> torch.dtype:
    """The dtype multi-row passes compute in, for `load(compute=...)`: "float32",
    "bfloat16" (ConfigError on a CPU without bfloat16 units) or "auto" (bfloat16 where the
    CPU has them, else float32)."""
    if choice is None or choice in ("float32", torch.float32):
        return torch.float32
    if choice not in ("bfloat16", torch.bfloat16, "auto"):
        raise ConfigError(f"compute must be one of {', '.join(CHOICES)}, got {choice!r}")
    if cpu_bf16_units():
        return torch.bfloat16
    if choice == "auto":
        return torch.float32
    raise ConfigError("compute='bfloat16' needs a CPU with AMX or AVX512-BF16 "
                      "(this one reports neither in /proc/cpuinfo); use 'auto' or 'float32'")


def bf16_twin(hf_model: torch.nn.Module) -> torch.nn.Module:
    """A bfloat16 copy of `hf_model` that shares nothing with it: plain transformers
    modules (promptlang's linear forwards, installed on the original as instance
    attributes, are dropped), tied weights tied again."""
    # promptlang's forwards are not copied (they hold the model's state and lock)
    memo = {id(module.__dict__["forward"]): None for module in hf_model.modules()
            if "forward" in module.__dict__}
    twin = copy.deepcopy(hf_model, memo)
    for module in twin.modules():
        module.__dict__.pop("forward", None)
    twin = twin.to(torch.bfloat16).eval()
    twin.requires_grad_(False)
    return twin


@dataclass
class Bf16Compute:
    """What an adapter runs its multi-row passes with (module docstring)."""

    model: torch.nn.Module
    min_rows: int
    disabled_depth: int = 0           # > 0 while a caller needs the float32 model (a seam)
    decided: threading.local = field(default_factory=threading.local)   # .bf16 per thread

    def serves(self, rows: int) -> bool:
        """Whether a pass of `rows` new tokens runs on the twin: as its request decided
        (`passes`), else by its row count."""
        if self.disabled_depth:
            return False
        decided = getattr(self.decided, "bf16", None)
        return rows >= self.min_rows if decided is None else decided

    def for_request(self, prompt_tokens: int) -> bool:
        """The side every prompt pass of a request with `prompt_tokens` tokens runs on."""
        return prompt_tokens >= self.min_rows

    @contextlib.contextmanager
    def passes(self, bf16: bool | None) -> Iterator[None]:
        """Within (this thread): every pass on the twin (True) or in float32 (False)."""
        before = getattr(self.decided, "bf16", None)
        self.decided.bf16 = bf16
        try:
            yield
        finally:
            self.decided.bf16 = before


def calibration_file(fingerprint: str) -> Path:
    """Where the switch point for this CPU and model is kept (the home's compute/); a new
    version of the CPU kernels (whose bfloat16 attention the twin's passes take) measures
    it anew."""
    cpu = cpu_name()
    digest = hashlib.sha256(f"{cpu}|{fingerprint}|{torch.__version__}|"
                            f"{torch.get_num_threads()}|{kernels_version()}"
                            .encode()).hexdigest()[:24]
    return compute_dir() / f"{digest}.json"


def read_min_rows(path: Path) -> int | None:
    """The switch point kept in `path`, or None where there is none (or it is unreadable,
    or not the user's own private file)."""
    if untrusted_reason(path) is not None:
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    rows = data.get("min_rows") if isinstance(data, dict) else None
    return rows if isinstance(rows, int) and rows > 0 else None


def write_min_rows(path: Path, rows: int, timings: dict) -> None:
    """Keep the switch point (and the timings that chose it) in `path`, privately."""
    record = {"min_rows": rows, "cpu": cpu_name(), "torch": torch.__version__,
              "threads": torch.get_num_threads(), "timings_ms": timings,
              "date": time.strftime("%Y-%m-%d")}
    write_private(path, json.dumps(record, indent=1).encode())


def measure_min_rows(time_pass, rows=CALIBRATION_ROWS, repeats: int = 3) -> tuple[int, dict]:
    """The fewest rows from which the bfloat16 pass stays faster than the float32 one,
    from `time_pass(rows, bf16) -> seconds` (the median of `repeats` runs each), and the
    timings in milliseconds."""
    timings = {}
    faster = []
    for count in rows:
        pair = []
        for bf16 in (False, True):
            samples = sorted(time_pass(count, bf16) for _ in range(repeats))
            pair.append(samples[len(samples) // 2])
        timings[str(count)] = {"float32": round(pair[0] * 1e3, 3),
                               "bfloat16": round(pair[1] * 1e3, 3)}
        faster.append(pair[1] < pair[0])
    chosen = None
    for count, wins in zip(reversed(rows), reversed(faster)):
        if not wins:
            break
        chosen = count
    if chosen is None:
        chosen = 2 * rows[-1]          # never faster in the range measured
    return chosen, timings


def cpu_name() -> str:
    """The CPU's model name, which keys what is measured on it."""
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def attach_bf16(adapter, *, min_rows: int | None = None, progress=None) -> Bf16Compute:
    """Give `adapter` (a RoPE model's, promptlang's attention) a bfloat16 twin for its
    multi-row passes, at the switch point `min_rows`, else the one measured for this CPU and
    model (measured now, once, where none is kept: `progress(text)` is told first). The
    adapter's fingerprint then names the setting (its KV is stored apart)."""
    if not adapter.attends_in_parallel:
        raise ConfigError(f"{adapter.model_type}: bfloat16 compute serves RoPE models with "
                          f"promptlang's attention")
    compute = Bf16Compute(bf16_twin(adapter.model), min_rows or DEFAULT_MIN_ROWS)
    adapter.compute = compute
    if min_rows is None:
        path = calibration_file(adapter.weights_fingerprint)
        kept = read_min_rows(path)
        if kept is None:
            if progress is not None:
                progress("measuring where bfloat16 passes pay on this CPU (once per CPU and model)")
            kept, timings = measure_min_rows(lambda rows, bf16: _time_pass(adapter, rows, bf16))
            try:
                write_min_rows(path, kept, timings)
            except OSError:
                pass                   # measured again next time
        compute.min_rows = kept
    named = f"{adapter.fingerprint}+bf16-compute".encode()
    adapter.fingerprint = hashlib.sha256(named).hexdigest()[:32]
    return compute


def _time_pass(adapter, rows: int, bf16: bool) -> float:
    """Seconds of one pass of `rows` new tokens with no past, on the twin or in float32."""
    generator = torch.Generator().manual_seed(rows)
    ids = torch.randint(0, adapter.vocab_size, (rows,), generator=generator)
    positions = torch.arange(rows)
    compute = adapter.compute
    saved = compute.min_rows
    compute.min_rows = 1 if bf16 else 1 << 30
    try:
        start = time.perf_counter()
        adapter.forward(ids, positions, None, None, torch.tensor([rows - 1]))
        return time.perf_counter() - start
    finally:
        compute.min_rows = saved
