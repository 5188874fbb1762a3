"""What the examples share: the model, fast mode and the time-to-first-token line.

Fast mode (`--fast` or PROMPTLANG_FAST=1) generates only a few tokens: it is what the
tests run (tests/examples/test_examples.py).
"""

from __future__ import annotations

import os
import sys


def fast_mode(fast: bool | None = None) -> bool:
    """`fast` when given, else whether `--fast` is on the command line or PROMPTLANG_FAST
    is set to anything but 0."""
    if fast is not None:
        return fast
    return "--fast" in sys.argv[1:] or os.environ.get("PROMPTLANG_FAST", "0") not in ("", "0")


def model(llm=None):
    """`llm`, or the default model (SmolLM2-135M-Instruct) loaded now; warmed up."""
    if llm is None:
        import promptlang

        llm = promptlang.load()
    warm_up(llm)
    return llm


def report_ttft(cached: float, baseline: float, what: str = "time to first token",
                opening=None, baseline_opening=None) -> None:
    """Print the cached and baseline time to first token (and, given the sessions'
    openings, how many prompt tokens each computed)."""
    if opening is not None and baseline_opening is not None:
        print(f"prompt: {opening.cached_tokens} tokens from cached modules + "
              f"{opening.prefill_tokens} computed | baseline computes "
              f"{baseline_opening.prefill_tokens}")
    print(f"{what}: cached {cached * 1000:.0f} ms | baseline (no reuse) "
          f"{baseline * 1000:.0f} ms | {baseline / cached:.1f}x")


def warm_up(llm) -> None:
    """One small forward pass before anything is measured, so that the first measured
    request does not pay for one-time setup (once per model)."""
    if getattr(llm, "_examples_warm", False):
        return
    import torch

    ids = torch.tensor(llm.tokenizer.encode("Hello, world. " * 4), dtype=torch.int64)
    llm.adapter.forward(ids, torch.arange(len(ids)), None, None)
    llm._examples_warm = True
