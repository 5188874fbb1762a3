"""promptlang's per-model state, kept beside the model (a weak map), never inside it.

One ModelState per transformers model, shared by every adapter of it: the lock around its
forward passes, whether this thread is inside one of the runtime's own passes (the only
time the kernels may run), what was installed on the model once (linear forwards, ALiBi
pre-hooks), and, for ALiBi, the biases and mask the pre-hooks substitute during a pass.
"""

from __future__ import annotations

import threading
import weakref

import torch


class ModelState:
    def __init__(self):
        self.lock = threading.RLock()
        self.hooked = False                        # ALiBi pre-hooks registered
        self.linears_wrapped = False               # fast/linear.py installed
        self._thread = threading.local()
        self.alibi: torch.Tensor | None = None     # [H, 1, K]
        self.mask: torch.Tensor | None = None      # [1, 1, Q, K]

    @property
    def query_sink(self) -> torch.Tensor | None:
        """Where this thread's passes write their last token's rotated query of every layer
        ([L, heads, D] float32; ModelAdapter.capture_query), or None."""
        return getattr(self._thread, "query_sink", None)

    @query_sink.setter
    def query_sink(self, sink: torch.Tensor | None) -> None:
        self._thread.query_sink = sink

    @property
    def in_runtime_pass(self) -> bool:
        """Whether this thread is inside an adapter's forward (the kernels may run); per
        thread, so that a call from another thread meanwhile stays on transformers' layers."""
        return getattr(self._thread, "inside", False)

    @in_runtime_pass.setter
    def in_runtime_pass(self, on: bool) -> None:
        self._thread.inside = on

    def substitute(self, module, args, kwargs):
        """ALiBi pre-hook: the biases (and mask) of the pass in progress, if any."""
        if self.alibi is not None:
            kwargs["alibi"] = self.alibi
            if self.mask is not None:
                kwargs["attention_mask"] = self.mask
        return args, kwargs


_STATES: weakref.WeakKeyDictionary[torch.nn.Module, ModelState] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def model_state(hf_model: torch.nn.Module) -> ModelState:
    """The state of `hf_model`, made on first use; it lives as long as the model."""
    with _LOCK:
        state = _STATES.get(hf_model)
        if state is None:
            state = _STATES[hf_model] = ModelState()
        return state


def adapted(hf_model: torch.nn.Module) -> bool:
    """Whether promptlang keeps state for `hf_model` (an adapter was built on it)."""
    return hf_model in _STATES
