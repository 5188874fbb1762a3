"""Every use of transformers' (and torch's) internals by the runtime, in one place.

Why each is needed, so that a transformers upgrade is checked here first:
- a Cache whose layers write into our preallocated buffer (`DynamicLayer` subclassed, `Cache`
  built from layers): the public DynamicCache concatenates, a copy of the past per pass;
- our attention registered under a name (`AttentionInterface`, `AttentionMaskInterface`)
  and selected per model (`set_attn_implementation`, read back from
  `config._attn_implementation`), with transformers' own `sdpa_attention_forward` and
  `sdpa_mask` for what it does not serve;
- torch's private CPU flash kernel, called directly because it also returns each row's
  log-sum-exp (attention over key sets apart, merged): None where a torch build lacks it.
Checked with transformers 5.24.0 and torch 2.13.0 (CPU).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import (AttentionMaskInterface, causal_mask_function,
                                        sdpa_mask)

__all__ = ["BufferLayer", "FLASH_WITH_LSE", "attention_implementation", "buffer_cache",
           "causal_mask_function", "sdpa_attention_forward", "sdpa_mask", "use_attention"]

FLASH_WITH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


class BufferLayer(DynamicLayer):
    """One layer's cache in a caller-owned buffer: past at [:, :, :length], new keys
    written after it (in place when the buffer has room, else by concatenation). With
    `dtype` (a bfloat16 pass over a float32 buffer), `update` hands the layer its keys and
    values in that dtype; the buffer keeps its own."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int,
                 dtype: torch.dtype | None = None):
        # keys, values: [1, H_kv, C, D]
        super().__init__()
        self._dtype = dtype if dtype is not None else keys.dtype
        self._kbuf = keys
        self._vbuf = values
        self._length = length
        self.device = keys.device
        self.keys = keys[:, :, :length]
        self.values = values[:, :, :length]
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        end = self._length + key_states.shape[-2]
        if end <= self._kbuf.shape[-2]:
            self._kbuf[:, :, self._length:end] = key_states
            self._vbuf[:, :, self._length:end] = value_states
            self.keys = self._kbuf[:, :, :end]
            self.values = self._vbuf[:, :, :end]
        else:
            self.keys = torch.cat([self.keys, key_states], dim=-2)
            self.values = torch.cat([self.values, value_states], dim=-2)
        self.new_keys = self.keys[:, :, self._length:end]
        self.new_values = self.values[:, :, self._length:end]
        self._length = end
        if self.keys.dtype != self._dtype:
            return self.keys.to(self._dtype), self.values.to(self._dtype)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.keys.shape[-2]


def buffer_cache(layers: list[BufferLayer]) -> Cache:
    return Cache(layers=layers)


def attention_implementation(config) -> str:
    """The name of the attention a model runs ("sdpa", "eager", ours...)."""
    return config._attn_implementation


def use_attention(hf_model: torch.nn.Module, name: str, attention, mask_hook) -> None:
    """Register `attention` and its mask hook under `name` and make `hf_model` use them."""
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, mask_hook)
    hf_model.set_attn_implementation(name)
