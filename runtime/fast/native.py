"""promptlang's CPU kernels (kernels.c, beside this file): built on first use, called via ctypes.

The kernels serve the shapes a cached request has on a CPU -- a handful of new query rows
against thousands of cached keys, and a handful of rows through each linear layer -- where
PyTorch's general kernels fall well short of the machine's matmul rate: `attend` (pl_attend,
fast/attention.py), `linear` (pl_linear, fast/linear.py), `decoder` (pl_decoder, fast/fused.py),
on x86-64 with AVX2, FMA and F16C, a C compiler (`cc`, `$CC`) and float32 tensors (else PyTorch).

The shared library is compiled once per source version into `<promptlang home>/native/`,
checked before it is loaded, and its kernels' signatures declared: `fast/library.py`.

Kernels that cannot be had (no compiler, a failed build, a library that does not load or
lacks a kernel) leave the runtime on PyTorch with one warning -- or, with
`PROMPTLANG_REQUIRE_NATIVE=1` on an x86-64 CPU with AVX2, raise `NativeKernelsError` (CI
sets it). `PROMPTLANG_NATIVE=0` still turns the kernels off, even where they are required.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import threading
import time
import warnings

import torch

from promptlang.errors import InternalError, InvalidArgumentError, NativeKernelsError
from promptlang.runtime.fast import library

MAX_HEAD_DIM = 256     # kernels.c MAXD
MAX_PIECES = 64      # pl_attend's piece count limit (pl_decoder's per request)
REQUIRE_ENV = "PROMPTLANG_REQUIRE_NATIVE"
_TRUE = ("1", "true", "yes", "on")

_lock = threading.Lock()
_busy = {"checked": -1.0, "others": 0}   # runnable threads of other processes, when last read
BUSY_CHECK_S = 0.05                       # how often kernel_threads reads them
# torch's thread count as configured, and the count adapt_torch_threads set last (None: none)
_threads: dict[str, int | None] = {"configured": None, "set": None}
adapt_threads = True                      # False: always torch's thread count
_lib: ctypes.CDLL | None = None
_error: "NativeKernelsError | None" = None     # why required kernels are missing
_tried = False


def off_by_env(environ=os.environ) -> bool:
    """Whether PROMPTLANG_NATIVE turns the kernels off (read once, when this module loads)."""
    return environ.get("PROMPTLANG_NATIVE", "1").strip().lower() in ("0", "false", "no", "off")


def required(environ=os.environ) -> bool:
    """Whether PROMPTLANG_REQUIRE_NATIVE makes missing kernels an error (CPUs that run them)."""
    return environ.get(REQUIRE_ENV, "0").strip().lower() in _TRUE and _supported_cpu()


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
    """Whether the kernels are built and loaded (building them on the first call). Raises
    NativeKernelsError instead of answering False where they are required."""
    return _load() is not None


def _load() -> ctypes.CDLL | None:
    global _lib, _error, _tried
    if not enabled():
        return None
    if not _tried:
        with _lock:
            if not _tried:
                try:
                    _lib = _build_and_load()
                except NativeKernelsError as exc:
                    _error = exc
                _tried = True
    if _error is not None:
        raise _error
    return _lib


def _supported_cpu() -> bool:
    return (platform.machine().lower() in ("x86_64", "amd64")
            and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"))


def _build_and_load() -> ctypes.CDLL | None:
    """The kernel library, or None (with a warning; NativeKernelsError where required)."""
    if not _supported_cpu():
        return None
    try:
        return library.bind(library.trusted_library())
    except library.Unavailable as exc:
        if required():
            raise NativeKernelsError(f"the CPU kernels are required ({REQUIRE_ENV} is set) "
                                     f"but unavailable: {exc}") from None
        warnings.warn(f"promptlang: {exc}; using PyTorch kernels (slower)", RuntimeWarning,
                      stacklevel=4)
        return None


def wide(on: bool | None = None) -> bool:
    """Whether the linear layers' dot tiles run on 512-bit vectors (AVX-512F, where the CPU
    has it and PROMPTLANG_AVX512 is not "0"); `on` turns them on (where supported) or off
    for the whole process. Both give every row the same numbers however many rows a pass has;
    the two differ from each other by summation order only."""
    return _toggle("pl_wide", on)


def few(on: bool | None = None) -> bool:
    """Whether 1-3 query rows a KV head take kernels.c's few-rows attention (on: set it)."""
    return _toggle("pl_few", on)


def _toggle(kernel: str, on: bool | None) -> bool:
    lib = _lib or _load()
    return False if lib is None else bool(getattr(lib, kernel)(-1 if on is None else int(on)))


def products_available(kind: str = "bf16") -> bool:
    """Whether pl_decoder's bf16 attention (AVX512_BF16) or int8 linears ("int8": AVX512_VNNI's
    tiles, else AVX2's) run."""
    return _toggle("pl_products", {"bf16": 16, "int8": 8}[kind])


def vnni() -> bool:
    """Whether the int8 linears' sums take AVX512_VNNI's 512-bit tiles now (the CPU has it
    and the 512-bit tiles are on: `wide`); else AVX2's, with the same numbers."""
    lib = _lib or _load()
    return False if lib is None else bool(lib.pl_vnni())


def kernels_version() -> str:
    """The version of the kernels' numbers: a digest of kernels.c and its build flags."""
    return library.source_digest()


def group_shared(on: bool | None = None) -> bool:
    """Whether a batched pass computes the query rows of all its requests that read one
    stored unit in place as one attention task over that unit (one pass over its keys, full
    tiles) instead of one task per request; `on` turns it on or off for the whole process.
    Both give every row the same numbers."""
    return _toggle("pl_group", on)


def group_runs() -> int:
    """How many grouped attention tasks (`group_shared`) have run in this process."""
    lib = _lib or _load()
    return 0 if lib is None else int(lib.pl_group_runs())


# --- quantized weights (a GGUF's blocks, as stored) -----------------------------------------------

Q4_BYTES = 20            # kernels.c: Q4_1 bytes per block of 32 weights (float16 d and m, 16 bytes)
Q8_BYTES = 34            # kernels.c: Q8_0 bytes per block of 32 weights (float16 d, 32 int8)
Q4_MAX_K = 8192          # kernels.c: the longest row the kernels dequantize
# kernels.c's block kinds (4: Q4_1, 8: Q8_0; the others are ggml's type numbers): name,
# weights per block, bytes per block
KINDS = {4: ("Q4_1", 32, Q4_BYTES), 8: ("Q8_0", 32, Q8_BYTES), 6: ("Q5_0", 32, 22),
         12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210)}


def _check_blocks(what: str, blocks: torch.Tensor, k: int, kind: int) -> None:
    """InvalidArgumentError unless `blocks` are contiguous uint8 rows of k weights of `kind`."""
    if kind not in KINDS:
        known = ", ".join(f"{number} ({name})" for number, (name, _, _) in KINDS.items())
        raise InvalidArgumentError(f"{what}: no block kind {kind}; the kernels read {known}")
    name, per_block, nbytes = KINDS[kind]
    shape_fits = (blocks.dim() == 2 and k % per_block == 0 and 0 < k <= Q4_MAX_K
                  and blocks.shape[1] == k // per_block * nbytes)
    if not shape_fits or blocks.dtype != torch.uint8 or not blocks.is_contiguous():
        raise InvalidArgumentError(f"{what} takes contiguous [rows, k / {per_block} * {nbytes}] "
                                   f"uint8 {name} blocks, k a multiple of {per_block} up to "
                                   f"{Q4_MAX_K}")


def q_dequant(blocks: torch.Tensor, k: int, kind: int = 4) -> torch.Tensor:
    """The float32 weights [rows, k] of `blocks` ([rows, k / block * bytes] uint8, of a kind in
    KINDS) as the kernels compute them, gguf's dequantized values exactly: Q4_1 as d * q + m
    (multiply, then add), Q8_0 as d * q, the K-quants and Q5_0 as gguf-py's dequantizers."""
    _check_blocks("q_dequant", blocks, k, kind)
    out = torch.empty(blocks.shape[0], k)
    (_lib or _load()).pl_q_dequant(blocks.data_ptr(), blocks.shape[0], k, kind, out.data_ptr())
    return out


def linear_q(x: torch.Tensor, blocks: torch.Tensor, kind: int) -> torch.Tensor:
    """x [m, k] float32 . W^T for W given as `blocks` of a kind in KINDS ([n, k / block *
    bytes] uint8): the values of W's float copy, the same tiles as pl_linear, reading the
    blocks as stored."""
    m, k = x.shape
    if x.dtype != torch.float32:
        raise InvalidArgumentError("linear_q takes float32 rows")
    _check_blocks("linear_q", blocks, k, kind)
    x = x.contiguous()
    y = torch.empty(m, blocks.shape[0])
    (_lib or _load()).pl_linear_q(x.data_ptr(), m, k, blocks.data_ptr(), blocks.shape[0],
                                  y.data_ptr(), kind, kernel_threads())
    return y


def linear_q8(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """x [m, k] float32 . W^T for W given as Q8_0 `blocks` ([n, k / 32 * 34] uint8): the same
    values as W's float copy, the same tiles as pl_linear, ~3.8x fewer weight bytes."""
    m, k = x.shape
    rows_fit = x.dtype == torch.float32 and k % 32 == 0 and k <= Q4_MAX_K
    blocks_fit = (blocks.dtype == torch.uint8 and blocks.shape[1] == k // 32 * Q8_BYTES
                  and blocks.is_contiguous())
    if not rows_fit or not blocks_fit:
        raise InvalidArgumentError("linear_q8 takes float32 rows and contiguous Q8_0 blocks of "
                                   "their width")
    x = x.contiguous()
    y = torch.empty(m, blocks.shape[0])
    (_lib or _load()).pl_linear_q8(x.data_ptr(), m, k, blocks.data_ptr(), blocks.shape[0],
                                   y.data_ptr(), kernel_threads())
    return y


def linear_i8(x: torch.Tensor, rows: torch.Tensor, n: int) -> torch.Tensor:
    """x [m, k] . W^T, W as fused.py's int8 `rows` (n of them): the int8 linear layer alone."""
    m, k = x.shape
    x = x.contiguous().float()
    y = torch.empty(m, n)
    fits = rows.numel() == n * (k + 4)
    if not fits or (_lib or _load()).pl_linear_i8(x.data_ptr(), m, k, rows.data_ptr(), n,
                                                    y.data_ptr()) != 0:
        raise InvalidArgumentError("linear_i8 takes k % 64 == 0 rows of n weights")
    return y


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
                                kernel_threads())
    return y.view(*x.shape[:-1], n)


# --- attention ------------------------------------------------------------------------------------

def attend_fits(rows: torch.Tensor, pieces) -> bool:
    """Whether `attend` serves these rows [H_kv, R, D] and pieces ((keys, values, causal), ...)
    with keys/values [H_kv, n, D] whose rows are contiguous."""
    d = rows.shape[-1]
    rows_fit = (rows.dtype == torch.float32 and rows.device.type == "cpu" and d % 8 == 0
                and d <= MAX_HEAD_DIM)
    if not rows_fit or not 0 < len(pieces) <= MAX_PIECES:
        return False
    for keys, values, _ in pieces:
        for t in (keys, values):
            if t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != 3:
                return False
            strides_fit = (t.shape[1] <= 1 or t.stride(1) == d) and t.stride(2) == 1
            if t.shape[0] != rows.shape[0] or t.shape[2] != d or not strides_fit:
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
                           None if lse is None else lse.data_ptr(), kernel_threads(),
                           torch.get_num_threads())
    if status != 0:
        raise InternalError(f"pl_attend failed ({status})")
    return out, lse


def causal_fits(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether `causal` serves query [H, Q, D] over key/value [H_kv, K, D]: all bfloat16 on a
    CPU with AVX512-BF16 or all float32 with the 512-bit tiles on (`wide`), D % 32 == 0, the
    Q new tokens last among the K keys, and each head's key and value rows contiguous."""
    heads, q, d = query.shape
    kv_heads, k = key.shape[0], key.shape[1]
    dtype = query.dtype
    tensors = (query, key, value)
    dtypes_fit = all(t.dtype == dtype and t.device.type == "cpu" for t in tensors)
    shapes_fit = (value.shape == key.shape and key.shape[2] == d and d % 32 == 0
                  and d <= MAX_HEAD_DIM and heads % kv_heads == 0 and 0 < q <= k)
    rows_fit = all(t.stride(2) == 1 and (t.shape[1] <= 1 or t.stride(1) == d)
                   for t in (key, value))
    return dtypes_fit and shapes_fit and rows_fit and causal_serves(dtype)


def causal_serves(dtype: torch.dtype) -> bool:
    """Whether this CPU runs `causal` in `dtype`: bfloat16 with AVX512-BF16, float32 with the
    512-bit tiles on (`wide`)."""
    if dtype == torch.bfloat16:
        return products_available("bf16")
    return dtype == torch.float32 and wide()


def causal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           scale: float) -> torch.Tensor:
    """Causal softmax attention of the Q new tokens (query [H, Q, D]) over key and value
    [H_kv, K, D] whose last Q rows are theirs: query head h reads KV head h // (H / H_kv);
    in bfloat16 (products bfloat16, sums and softmax float32) or float32 (pl_causal).
    Returns [H, Q, D] in the query's dtype. Check `causal_fits` first."""
    heads, q, d = query.shape
    kv_heads, k = key.shape[0], key.shape[1]
    query = query.contiguous()
    out = torch.empty_like(query)
    bf = int(query.dtype == torch.bfloat16)
    status = (_lib or _load()).pl_causal(query.data_ptr(), heads, q, d, key.data_ptr(),
                                         key.stride(0), value.data_ptr(), value.stride(0),
                                         kv_heads, k, float(scale), out.data_ptr(), bf,
                                         kernel_threads())
    if status == -2:
        raise MemoryError(f"pl_causal: no memory for {kv_heads} heads of {k} keys")
    if status != 0:
        raise InternalError(f"pl_causal failed ({status})")
    return out


# --- decoder layers -------------------------------------------------------------------------------

_HALF_KINDS = {torch.bfloat16: 1, torch.float16: 2}     # kernels.c's HALF_BF16, HALF_FP16


def decoder(x: torch.Tensor, shape, eps: float, scale: float, weights, cos: torch.Tensor,
            sin: torch.Tensor, pieces, new_keys: torch.Tensor, new_values: torch.Tensor,
            key_positions: torch.Tensor | None = None,
            query_positions: torch.Tensor | None = None,
            requests: list[tuple[int, int]] | None = None,
            contexts: tuple[list[bool], float, float] | None = None,
            quantized: ctypes.Array | None = None, quantized_kind: int = 4,
            quantized_kinds: ctypes.Array | None = None,
            query_out: torch.Tensor | None = None, bf16_products: bool = False) -> None:
    """Every decoder layer of a Llama-family model over x ([Q, hidden], replaced by the last
    layer's output) by pl_decoder; see fast/fused.py, which checks what it passes.

    shape: ctypes longs (hidden, heads, kv_heads, head_dim, intermediate, layers); weights:
    ctypes pointers [layers][16] in kernels.c's order; cos, sin: [Q, D]; pieces: (keys,
    values) pairs of past slots, [L, H_kv, n, D] each, float32, bfloat16 or float16;
    new_keys/new_values: [L, H_kv, Q, D] float32, where the new tokens' keys/values go.
    key_positions ([S] int64, the pieces' keys in order) and query_positions ([Q] int64,
    increasing): token t then sees a past key only at a position <= its own; None: every
    past key is visible to every token.
    requests: batched requests (fused.py, `forward_batch`), (new tokens, past pieces) each,
    in order, summing to Q and len(pieces): each request's tokens see its own pieces and
    new tokens only, and query_positions increase within a request only. None: one request.
    contexts: APE (runtime/model/adapter.py, ParallelContexts) -- (each piece a context or
    not, temperature, scale); None: plain attention.
    quantized: pointers like `weights` to the linear weights' blocks (NULL where none), all of
    `quantized_kind` (4: Q4_1, 8: Q8_0: the same values; 1: fused.py's int8 rows, inputs
    quantized per token: approximate), or each of the kind `quantized_kinds` gives it (ctypes
    ints like `weights`, kinds of KINDS: a GGUF's mix); None: float weights only.
    query_out: [L, heads, D] float32, contiguous: receives the last token's rotated query
    of every layer (before the softmax scale); None: not wanted.
    bf16_products: the attention's Q.K and P.V from bf16 inputs, float32 sums (kernels.c `bf`).
    """
    layers = shape[5]
    nseg = len(pieces)
    spans = requests if requests is not None else [(int(x.shape[0]), nseg)]
    spans_fit = all(n >= 1 and p >= 0 and p + 1 <= MAX_PIECES for n, p in spans)
    covered = sum(n for n, _ in spans) == x.shape[0] and sum(p for _, p in spans) == nseg
    if not spans_fit or not covered:
        raise InvalidArgumentError(f"pl_decoder takes requests of 1+ tokens and at most "
                                   f"{MAX_PIECES - 1} past pieces each, covering every "
                                   "token and piece")

    def per_layer(tensors):                       # [layer][tensor] pointers
        at = [(t.data_ptr(), t.stride(0) * t.element_size()) for t in tensors]
        return (ctypes.c_void_p * (layers * len(tensors)))(*[
            base + l * step for l in range(layers) for base, step in at])

    keys = per_layer([p[0] for p in pieces])
    values = per_layer([p[1] for p in pieces])
    kstride = (ctypes.c_long * max(nseg, 1))(*[p[0].stride(1) for p in pieces])
    vstride = (ctypes.c_long * max(nseg, 1))(*[p[1].stride(1) for p in pieces])
    lens = (ctypes.c_long * max(nseg, 1))(*[p[0].shape[2] for p in pieces])
    half = (ctypes.c_int * max(nseg, 1))(*[_HALF_KINDS.get(p[0].dtype, 0) for p in pieces])
    newk = per_layer([new_keys])
    newv = per_layer([new_values])
    kpos = qpos = None
    if key_positions is not None:
        past = sum(p[0].shape[2] for p in pieces)
        keys_fit = key_positions.dtype == torch.int64 and key_positions.shape[0] == past
        queries_fit = (query_positions is not None and query_positions.dtype == torch.int64
                       and query_positions.shape[0] == x.shape[0])
        if not keys_fit or not queries_fit:
            raise InvalidArgumentError("pl_decoder needs int64 positions of every past key "
                                       "and new token")
        key_positions = key_positions.contiguous()
        query_positions = query_positions.contiguous()
        kpos = key_positions.data_ptr()
        qpos = query_positions.data_ptr()
    tok = [0]
    seg = [0]
    for n, p in spans:
        tok.append(tok[-1] + n)
        seg.append(seg[-1] + p)
    nreq = len(spans)
    ctx = None
    invt = 1.0
    mixc = 1.0
    if contexts is not None:
        flags, temperature, mix = contexts        # (`scale` is the softmax's)
        if len(flags) != nseg or not temperature > 0:
            raise InvalidArgumentError("pl_decoder's contexts need a flag per piece and a "
                                       "temperature > 0")
        ctx = (ctypes.c_int * max(nseg, 1))(*[int(bool(f)) for f in flags])
        invt = 1.0 / temperature
        mixc = mix * temperature
    qout = None
    if query_out is not None:
        expected = (layers, shape[1], shape[3])
        fits = query_out.dtype == torch.float32 and tuple(query_out.shape) == expected
        if not fits or not query_out.is_contiguous():
            raise InvalidArgumentError("pl_decoder's query_out must be [layers, heads, "
                                       "head_dim] float32, contiguous")
        qout = query_out.data_ptr()
    status = (_lib or _load()).pl_decoder(
        x.data_ptr(), x.shape[0], shape, eps, scale, weights, cos.data_ptr(), sin.data_ptr(),
        nseg, keys, kstride, values, vstride, lens, half, newk, new_keys.stride(1), newv,
        new_values.stride(1), kpos, qpos, nreq, (ctypes.c_long * (nreq + 1))(*tok),
        (ctypes.c_long * (nreq + 1))(*seg), ctx, invt, mixc, quantized, quantized_kind,
        quantized_kinds, qout, int(bool(bf16_products)), kernel_threads(),
        torch.get_num_threads())
    if status != 0:
        raise InternalError(f"pl_decoder failed ({status})")


def kernel_threads() -> int:
    """Threads for a kernel call: torch's count (as configured: `adapt_torch_threads` may
    have lowered it), less one for each core that threads of other processes are running on
    now (read from /proc at most every BUSY_CHECK_S).
    The kernels split each layer into equal static slices with barriers between them, so a
    thread whose core another process holds makes every barrier wait for the scheduler;
    with fewer threads than free cores none waits (a busy neighbour once made a decode step
    37x slower)."""
    wanted = _configured_threads()
    if wanted <= 1 or not adapt_threads:
        return wanted
    now = time.monotonic()
    if now - _busy["checked"] > BUSY_CHECK_S:
        _busy["checked"] = now
        _busy["others"] = _runnable_elsewhere()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else wanted
    machine = os.cpu_count() or cores
    # /proc/stat counts the whole machine's runnable threads: where this process may use
    # only some of its CPUs (a container's cpuset), count the share that falls on ours
    others = round(_busy["others"] * cores / machine) if machine > cores else _busy["others"]
    return max(1, min(wanted, cores - others))


def adapt_torch_threads() -> None:
    """Give torch's own operations on this thread (the engine's) `kernel_threads()` threads
    for the pass about to run, and its configured count back once the cores are free (or
    `adapt_threads` is off). torch's OpenMP threads wait at barriers too: beside a process
    that had just started spinning, a cached question took ~35 ms longer at two threads
    than at one, for its first several requests."""
    wanted = kernel_threads() if adapt_threads else _configured_threads()
    if torch.get_num_threads() != wanted:
        torch.set_num_threads(wanted)
    _threads["set"] = wanted


def _configured_threads() -> int:
    """torch's thread count as the user (or torch) configured it: the current count, unless
    it is the one `adapt_torch_threads` set last."""
    current = torch.get_num_threads()
    if current != _threads["set"] or _threads["configured"] is None:
        _threads["configured"] = current
    return _threads["configured"]


def _runnable_elsewhere() -> int:
    """Runnable threads on the machine that are not this process's (0 where /proc says
    nothing): /proc/stat's procs_running less this process's threads in state R."""
    try:
        with open("/proc/stat", "rb") as f:
            running = next((int(line.split()[1]) for line in f
                            if line.startswith(b"procs_running")), None)
        if running is None:
            return 0
        ours = 0
        for task in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{task}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue                      # the thread ended meanwhile
            state = stat[stat.rindex(b")") + 2:stat.rindex(b")") + 3]
            ours += state == b"R"
    except (OSError, ValueError):
        return 0
    return max(0, running - ours)
