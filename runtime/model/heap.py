"""The C heap's free pages given back to the system after a request that ran large passes.

A pass of many new tokens (a long prefill, a module's encode, an exact recompute) allocates
activations of tens to hundreds of megabytes. torch frees them, but glibc's malloc keeps most
freed heap memory for later allocations: after one long request a process stays that much
larger for its whole life. `ModelAdapter.forward` notes each pass's new tokens
(`note_pass`); where a request ends (`LLM.generate`, `LLM.prefill`; the server's engine
thread when it has nothing to run) `release_if_grown` asks glibc to return its free pages
(`malloc_trim`) if a pass of at least `LARGE_PASS_ROWS` tokens ran since it last did.

A request with only short passes never trims: decode steps and short questions keep their
heap warm. The pages given back are faulted in again by the next large pass, a small cost
beside that pass. Where the C library is not glibc, nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

LARGE_PASS_ROWS = 512

_lock = threading.Lock()
_grown = False
_trim = None            # glibc's malloc_trim, once looked up; False where there is none


def note_pass(rows: int) -> None:
    """A pass of `rows` new tokens ran (ModelAdapter.forward)."""
    global _grown
    if rows >= LARGE_PASS_ROWS:
        _grown = True


def release_if_grown() -> bool:
    """Give the heap's free pages back if a large pass ran since the last call that did;
    whether it did."""
    global _grown
    with _lock:
        if not _grown:
            return False
        _grown = False
        trim = _malloc_trim()
        if trim is None:
            return False
        trim(0)
        return True


def _malloc_trim():
    global _trim
    if _trim is None:
        _trim = False
        name = ctypes.util.find_library("c")
        try:
            library = ctypes.CDLL(name) if name else None
        except OSError:
            library = None
        function = getattr(library, "malloc_trim", None) if library is not None else None
        if function is not None:
            function.argtypes = [ctypes.c_size_t]
            function.restype = ctypes.c_int
            _trim = function
    return _trim or None
