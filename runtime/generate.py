"""Compatibility: the prefill functions moved to prefill.py and the decode loop to decode.py.

Kept for code that imports `promptlang.runtime.generate.prefill` (the benchmarks).
"""

from promptlang.runtime.prefill import (baseline_prefill, prefill, take_last,  # noqa: F401
                                        uncached_tokens)
