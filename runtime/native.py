"""promptlang's CPU kernels (runtime/kernels.c): built on first use, called through ctypes.

The kernels serve the shapes a cached request has on a CPU -- a handful of new query rows
against thousands of cached keys, and a handful of rows through each linear layer -- where
PyTorch's general kernels run at half the machine's matmul rate (docs/BENCHMARKS.md,
"Performance work"): `attend` (pl_attend), `linear` (pl_linear), and `decoder` (pl_decoder:
every layer of a Llama-family model, driven by runtime/fused.py). They need x86-64 with AVX2
and FMA (and F16C, which every AVX2 CPU has), a C compiler (`cc`, or `$CC`) and float32
tensors; anything else, or `PROMPTLANG_NATIVE=0`, leaves every caller on PyTorch.

The shared library is compiled once per source version into `<promptlang home>/native/`
(about 3 s) and reused by later processes.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch

from promptlang.home import promptlang_home

_SOURCE = Path(__file__).with_name("kernels.c")
_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-fPIC", "-shared"]
MAX_HEAD_DIM = 256     # kernels.c MAXD
MAX_SEGMENTS = 64      # pl_attend's segment count limit

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_P, _L = ctypes.c_void_p, ctypes.c_long


def off_by_env(environ=os.environ) -> bool:
    """Whether PROMPTLANG_NATIVE turns the kernels off (read once, when this module loads)."""
    return environ.get("PROMPTLANG_NATIVE", "1").strip().lower() in ("0", "false", "no", "off")


class Switch:
    """A process-wide switch, on unless inside one of its (nestable) `off()` blocks."""

    def __init__(self):
        self._lock = threading.Lock()
        self._depth = 0

    def __bool__(self) -> bool:
        return self._depth == 0

    @contextlib.contextmanager
    def off(self):
        with self._lock:
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1


_ENV_OFF = off_by_env()
_switch = Switch()

# Every pass inside `with disabled():` runs on PyTorch's kernels (for A/B measurements, tests).
disabled = _switch.off


def enabled() -> bool:
    """Whether the kernels may be used now (they may still fail to build)."""
    return bool(_switch) and not _ENV_OFF


def available() -> bool:
    """Whether the kernels are built and loaded (building them on the first call)."""
    return _load() is not None


def _load() -> ctypes.CDLL | None:
    global _lib, _tried
    if _tried or not enabled():
        return _lib if enabled() else None
    with _lock:
        if not _tried:
            _lib = _build_and_load()
            _tried = True
    return _lib


def _supported_cpu() -> bool:
    return (platform.machine().lower() in ("x86_64", "amd64")
            and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"))


def _build_and_load() -> ctypes.CDLL | None:
    if not _supported_cpu():
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        warnings.warn("promptlang: no C compiler found; using PyTorch kernels (slower)",
                      RuntimeWarning, stacklevel=3)
        return None
    source = _SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join(_FLAGS).encode()).hexdigest()[:16]
    target = promptlang_home() / "native" / f"kernels-{digest}.so"
    try:
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                built = Path(tmp) / target.name
                subprocess.run([compiler, *_FLAGS, "-o", str(built), str(_SOURCE), "-lm"],
                               check=True, capture_output=True, text=True, timeout=120)
                os.replace(built, target)        # atomic: concurrent builders agree
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        warnings.warn(f"promptlang: could not build the CPU kernels ({detail.strip()[:300]}); "
                      "using PyTorch kernels (slower)", RuntimeWarning, stacklevel=3)
        return None
    lib.pl_linear.argtypes = [_P, _L, _L, _P, _L, _P, _P, ctypes.c_int]
    lib.pl_linear.restype = None
    lib.pl_attend.argtypes = [_P, _L, _L, _L, ctypes.c_float, _L, _P, _P, _P, _P, _P, _P, _L,
                              _P, _P, ctypes.c_int]
    lib.pl_attend.restype = ctypes.c_int
    lib.pl_decoder.argtypes = [_P, _L, _P, ctypes.c_float, ctypes.c_float, _P, _P, _P, _L, _P, _P,
                               _P, _P, _P, _P, _P, _L, _P, _L, ctypes.c_int]
    lib.pl_decoder.restype = ctypes.c_int
    return lib


# --- linear ---------------------------------------------------------------------------------------

def weight_fits(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether pl_linear can read this nn.Linear weight (and bias) as they are."""
    return (weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.dim() == 2
            and weight.shape[1] % 8 == 0 and weight.is_contiguous()
            and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()
                                  and bias.device.type == "cpu")))


def input_fits(x: torch.Tensor, k: int, max_rows: int) -> bool:
    """Whether `linear` serves x (its last dimension k) against a weight that fits."""
    return (x.dtype == torch.float32 and x.device.type == "cpu" and x.shape[-1] == k
            and 0 < x.numel() <= max_rows * k and not torch.is_grad_enabled())  # no autograd


def linear_fits(x: torch.Tensor, weight: torch.Tensor, max_rows: int) -> bool:
    """Whether `linear` serves F.linear(x, weight): float32 CPU, at most `max_rows` rows."""
    return weight_fits(weight, None) and x.dim() >= 1 and input_fits(x, weight.shape[1], max_rows)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias) by pl_linear; check `linear_fits` (or `weight_fits` once and
    `input_fits` per call) first."""
    n, k = weight.shape
    rows = x.reshape(-1, k)
    if not rows.is_contiguous():
        rows = rows.contiguous()
    y = torch.empty(rows.shape[0], n)
    (_lib or _load()).pl_linear(rows.data_ptr(), rows.shape[0], k, weight.data_ptr(), n,
                                None if bias is None else bias.data_ptr(), y.data_ptr(),
                                torch.get_num_threads())
    return y.view(*x.shape[:-1], n)


# --- attention --------------------------------------------------------------------------------------

def attend_fits(rows: torch.Tensor, pieces) -> bool:
    """Whether `attend` serves these rows [H_kv, R, D] and pieces ((keys, values, causal), ...)
    with keys/values [H_kv, n, D] whose rows are contiguous."""
    d = rows.shape[-1]
    if (rows.dtype != torch.float32 or rows.device.type != "cpu" or d % 8 or d > MAX_HEAD_DIM
            or not 0 < len(pieces) <= MAX_SEGMENTS):
        return False
    for keys, values, _ in pieces:
        for t in (keys, values):
            if (t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != 3
                    or t.shape[0] != rows.shape[0] or t.shape[2] != d
                    or (t.shape[1] > 1 and t.stride(1) != d) or t.stride(2) != 1):
                return False
    return True


def attend(rows: torch.Tensor, pieces, new_tokens: int, scale: float,
           with_lse: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Softmax attention of packed query rows over the union of `pieces`.

    rows: [H_kv, R, D], row r of a KV head being new token r % new_tokens of one of its
    query heads. pieces: (keys, values, causal) with keys/values [H_kv, n, D]; a causal
    piece holds the `new_tokens` new keys, of which row r sees those up to its own token.
    Returns out [H_kv, R, D] and, when asked, the log-sum-exp of each row's scaled scores.
    Check `attend_fits` first.
    """
    lib = _load()
    heads, r, d = rows.shape
    rows = rows.contiguous()
    out = torch.empty_like(rows)
    lse = torch.empty(heads, r, dtype=torch.float32) if with_lse else None
    n = len(pieces)
    keys = (ctypes.c_void_p * n)(*[p[0].data_ptr() for p in pieces])
    values = (ctypes.c_void_p * n)(*[p[1].data_ptr() for p in pieces])
    kstride = (ctypes.c_long * n)(*[p[0].stride(0) for p in pieces])
    vstride = (ctypes.c_long * n)(*[p[1].stride(0) for p in pieces])
    lens = (ctypes.c_long * n)(*[p[0].shape[1] for p in pieces])
    causal = (ctypes.c_int * n)(*[int(bool(p[2])) for p in pieces])
    status = lib.pl_attend(rows.data_ptr(), heads, r, d, float(scale), n, keys, kstride, values,
                           vstride, lens, causal, new_tokens, out.data_ptr(),
                           None if lse is None else lse.data_ptr(), torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"pl_attend failed ({status})")
    return out, lse


# --- decoder layers -------------------------------------------------------------------------------

_HALF_KINDS = {torch.bfloat16: 1, torch.float16: 2}     # kernels.c's HALF_BF16, HALF_FP16


def decoder(x: torch.Tensor, shape, eps: float, scale: float, weights, cos: torch.Tensor,
            sin: torch.Tensor, pieces, new_keys: torch.Tensor, new_values: torch.Tensor) -> None:
    """Every decoder layer of a Llama-family model over x ([Q, hidden], replaced by the last
    layer's output) by pl_decoder; see runtime/fused.py, which checks what it passes.

    shape: ctypes longs (hidden, heads, kv_heads, head_dim, intermediate, layers); weights:
    ctypes pointers [layers][16] in kernels.c's order; cos, sin: [Q, D]; pieces: (keys,
    values) pairs of past slots, [L, H_kv, n, D] each, float32, bfloat16 or float16;
    new_keys/new_values: [L, H_kv, Q, D] float32, where the new tokens' keys/values go.
    """
    layers, nseg = shape[5], len(pieces)
    if nseg + 1 > MAX_SEGMENTS:
        raise ValueError(f"pl_decoder takes at most {MAX_SEGMENTS - 1} past pieces")

    def per_layer(tensors):                       # [layer][tensor] pointers
        return (ctypes.c_void_p * (layers * len(tensors)))(*[
            t.data_ptr() + l * t.stride(0) * t.element_size()
            for l in range(layers) for t in tensors])

    keys = per_layer([p[0] for p in pieces])
    values = per_layer([p[1] for p in pieces])
    kstride = (ctypes.c_long * max(nseg, 1))(*[p[0].stride(1) for p in pieces])
    vstride = (ctypes.c_long * max(nseg, 1))(*[p[1].stride(1) for p in pieces])
    lens = (ctypes.c_long * max(nseg, 1))(*[p[0].shape[2] for p in pieces])
    half = (ctypes.c_int * max(nseg, 1))(*[_HALF_KINDS.get(p[0].dtype, 0) for p in pieces])
    newk, newv = per_layer([new_keys]), per_layer([new_values])
    status = (_lib or _load()).pl_decoder(
        x.data_ptr(), x.shape[0], shape, eps, scale, weights, cos.data_ptr(), sin.data_ptr(),
        nseg, keys, kstride, values, vstride, lens, half, newk, new_keys.stride(1), newv,
        new_values.stride(1), torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"pl_decoder failed ({status})")
