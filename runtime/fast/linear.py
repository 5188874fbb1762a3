"""Small linear layers by pl_linear, during the runtime's own passes only.

`install` replaces the forward of every plain nn.Linear of a model by a NativeLinear, once
per model. A NativeLinear takes pl_linear (fast/native.py) for inputs of up to MAX_ROWS
rows on a thread inside an adapter's pass (`state.in_runtime_pass`); any other call --
transformers' `generate()`, training, another thread meanwhile -- runs exactly nn.Linear's
F.linear.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

import promptlang.runtime.fast.native as native

# Up to this many rows pl_linear beats MKL's sgemm on the default model's layer shapes
# (docs/BENCHMARKS.md, "CPU kernels").
MAX_ROWS = 64

_lock = threading.Lock()


def install(hf_model: torch.nn.Module, state) -> None:
    """Route `hf_model`'s nn.Linear layers to pl_linear for small inputs while
    `state.in_runtime_pass` (per model: `state.linears_wrapped` records it is done)."""
    with _lock:
        if state.linears_wrapped or not native.enabled():
            return
        for module in hf_model.modules():
            if type(module) is torch.nn.Linear:
                module.forward = NativeLinear(module, state)
        state.linears_wrapped = True


class NativeLinear:
    """The forward of one nn.Linear: pl_linear inside the runtime's passes, else F.linear."""

    __slots__ = ("module", "state", "checked")

    def __init__(self, module: torch.nn.Linear, state):
        self.module = module
        self.state = state
        self.checked = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.module.weight
        bias = self.module.bias
        if self.state.in_runtime_pass and native.enabled():
            if self.checked is None or self.checked[0] is not weight:   # once per weight
                self.checked = (weight, native.weight_fits(weight, bias) and native.available())
            if self.checked[1] and native.input_fits(x, weight.shape[1], MAX_ROWS):
                return native.linear(x, weight, bias)
        return F.linear(x, weight, bias)
