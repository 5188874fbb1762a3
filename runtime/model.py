"""Model adapters: the only code that knows transformers' cache classes.

A forward pass is driven through public inputs only: explicit `position_ids`,
a 4-D float attention mask `[1, 1, Q, K]` of 0 / -inf (K = past + new tokens) where
visibility is not simply "all past, causal among the new",
and a `Cache` whose layers hold the past keys/values in a caller-owned buffer.
The position scheme decides what else is needed:

- rope (Llama family): position ids rotate queries and keys; nothing else. Their
  attention is `_attention` (registered with transformers' AttentionInterface): the
  common case -- every past key visible, the new tokens causal -- needs no mask at
  all, and grouped-query heads are never repeated.
- learned (GPT-2): position ids index the position embedding table.
- alibi (BLOOM): the model builds its biases from the cache index and takes no
  position ids, so a forward pre-hook on every attention module substitutes
  biases built from the real key positions (and our mask, since BLOOM builds its
  ALiBi from a 2-D mask and cannot take a 4-D one).

Keys and values are kept at `num_key_value_heads` (never after repeat_kv), as
`[L, H_kv, S, D]`.

On an x86-64 CPU with AVX2, this runtime's own passes run through runtime/kernels.c (see
native.py): for Llama-family models every decoder layer of an unmasked pass of a few new
tokens at once (runtime/fused.py, which also reads a 16-bit store's units in place); else
small linear layers (up to NATIVE_LINEAR_MAX_ROWS rows, any scheme) and the unmasked
attention of RoPE models inside transformers' layers. Calls from outside the runtime (a plain
`hf_model(ids)`, transformers' `generate()`, another thread while a pass runs) never do: the
linear layers take pl_linear only on the thread inside `ModelAdapter.forward`, and `_attention`
serves any call without the adapter's `promptlang_masks` argument by transformers' own SDPA.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import (AttentionMaskInterface, causal_mask_function,
                                         sdpa_mask)

from promptlang.errors import ModelError
from promptlang.runtime import native
from promptlang.runtime.fused import FusedDecoder, past_pieces, slot_runs

# model_type -> position scheme. Every entry is exercised by tests/runtime/test_oracle.py.
SCHEMES: dict[str, str] = {
    "llama": "rope", "mistral": "rope", "qwen2": "rope", "qwen3": "rope",
    "gemma": "rope", "olmo2": "rope", "granite": "rope",
    "gpt2": "learned",
    "bloom": "alibi",
}

_VOLATILE_CONFIG_KEYS = {"_name_or_path", "transformers_version", "_commit_hash", "architectures",
                         "torch_dtype", "dtype", "_attn_implementation_autoset"}


class SharedKV(NamedTuple):
    """Past slots [start, end) whose keys/values are read in place from another tensor (a
    stored unit's) instead of the buffer, whose own copy of those slots is left stale."""

    start: int
    end: int
    keys: torch.Tensor       # [L, H_kv, end - start, D_k]
    values: torch.Tensor     # [L, H_kv, end - start, D_v]


class Past(NamedTuple):
    """Keys/values a forward pass attends to besides its own tokens.

    The past occupies the first S = len(positions) slots of the buffers. When the
    buffers have room for the new tokens too (C >= S + Q), the pass writes their
    keys/values into slots S..S+Q in place: no copy of the past per call. Slots covered
    by `shared` are read from those tensors instead (adapters with `reads_shared` only).
    """

    keys: torch.Tensor       # [L, H_kv, C, D_k]
    values: torch.Tensor     # [L, H_kv, C, D_v]
    positions: torch.Tensor  # [S] int64: layout position of each past key
    shared: tuple[SharedKV, ...] = ()


class Step(NamedTuple):
    logits: torch.Tensor     # [R, V] for the requested rows (R may be 0)
    keys: torch.Tensor       # [L, H_kv, Q, D_k]  (views into the buffer when it had room)
    values: torch.Tensor     # [L, H_kv, Q, D_v]


class _BufferLayer(DynamicLayer):
    """One layer's cache in a caller-owned buffer: past at [:, :, :length], new keys
    written after it (in place when the buffer has room, else by concatenation)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int):
        # keys: [1, H_kv, C, D]
        super().__init__()
        self._kbuf, self._vbuf, self._length = keys, values, length
        self.device = keys.device
        self.keys = keys[:, :, :length]
        self.values = values[:, :, :length]
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        end = self._length + key_states.shape[-2]
        if end <= self._kbuf.shape[-2]:
            self._kbuf[:, :, self._length:end] = key_states
            self._vbuf[:, :, self._length:end] = value_states
            self.keys, self.values = self._kbuf[:, :, :end], self._vbuf[:, :, :end]
        else:
            self.keys = torch.cat([self.keys, key_states], dim=-2)
            self.values = torch.cat([self.values, value_states], dim=-2)
        self.new_keys = self.keys[:, :, self._length:end]
        self.new_values = self.values[:, :, self._length:end]
        self._length = end
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.keys.shape[-2]


@dataclass(frozen=True)
class KVShape:
    layers: int
    kv_heads: int
    key_dim: int
    value_dim: int


class ModelAdapter:
    """A causal LM driven at explicit positions with explicit masks.

    `forward` is the single entry point used by the encoder and the generator.
    """

    scheme: str = ""
    chunk_size: int = 512     # longer inputs run as chunks (see _forward_chunked)

    def __init__(self, hf_model: torch.nn.Module):
        self.model = hf_model.eval()
        self.config = hf_model.config
        self.model_type = self.config.model_type
        self.kv_shape = self._kv_shape()
        self.dtype = next(hf_model.parameters()).dtype
        self.device = next(hf_model.parameters()).device
        self.sliding_window = self._sliding_window()
        self.fingerprint = model_fingerprint(hf_model)
        self._model_state = _model_state(hf_model)
        self.lock = self._model_state.lock        # one forward at a time per model
        self.fused: FusedDecoder | None = None     # set by adapters whose models it serves
        _use_native_linear(hf_model, self._model_state)

    # --- what the rest of the runtime may ask -------------------------------------------

    @property
    def max_positions(self) -> int | None:
        return getattr(self.config, "max_position_embeddings", None)

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    def kv_bytes_per_token(self) -> int:
        s = self.kv_shape
        return s.layers * s.kv_heads * (s.key_dim + s.value_dim) * self.dtype.itemsize

    def unmasked_in_one_pass(self, past: int) -> bool:
        """Whether a causal pass after `past` keys runs without any Q x K mask (see
        `_attention`), so that a long one (a baseline prefill, a long unit) needs no chunks."""
        return False

    @property
    def reads_shared(self) -> bool:
        """Whether `forward` accepts a Past with `shared` slots (read in place)."""
        return False

    def shares_dtype(self, dtype: torch.dtype) -> bool:
        """Whether shared slots in `dtype` are worth handing to `forward` rather than copying
        into the buffer: the model's own dtype, and a 16-bit one where the fused layers read
        it in place. (`forward` takes any float dtype: whatever path cannot read it gets
        those slots copied into the buffer first.)"""
        return dtype == self.dtype or (
            dtype in (torch.bfloat16, torch.float16) and self.dtype == torch.float32
            and self.fused is not None and native.enabled() and native.available())

    def empty_kv(self, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.kv_shape
        shape = (s.layers, s.kv_heads, capacity)
        keys = torch.empty(*shape, s.key_dim, dtype=self.dtype, device=self.device)
        values = torch.empty(*shape, s.value_dim, dtype=self.dtype, device=self.device)
        return keys, values

    # --- the forward pass -----------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, past: Past | None,
                allowed: torch.Tensor | None, logits_rows: torch.Tensor | None = None) -> Step:
        """Run Q new tokens against `past`.

        input_ids, positions: [Q] int64.
        allowed: [Q, S + Q] bool, True where query i may attend key j (past keys first,
            then the new tokens in input order); None means causal in input order with
            every past key visible.
        logits_rows: [R] indices into the Q new tokens whose logits are wanted (None: none).
        """
        q = int(input_ids.shape[0])
        if past is None:
            past = Past(*self.empty_kv(q), positions.new_empty(0))
        if past.shared and not self.reads_shared:
            raise ValueError(f"{type(self).__name__} cannot read shared KV slots")
        s = int(past.positions.shape[0])
        unmasked = allowed is None and self.sliding_window is None and self.unmasked_in_one_pass(s)
        if q > self.chunk_size and s + q <= past.keys.shape[2] and not unmasked and \
                (allowed is None or not bool(allowed[:, s:].triu(1).any())):
            # chunks are never fused: 16-bit shared runs are widened once, not per chunk
            return self._forward_chunked(input_ids, positions, _widened(past), allowed,
                                         logits_rows)
        key_positions = torch.cat([past.positions, positions])        # [S + Q]
        if self.sliding_window is not None and allowed is None and q > 0:
            span = int(positions.max()) - int(key_positions.min())
            if span >= self.sliding_window:
                allowed = causal_allowed(s, q, device=positions.device)
        if self.sliding_window is not None and allowed is not None:
            allowed = allowed & (key_positions[None, :] > positions[:, None] - self.sliding_window)
        mask = None if allowed is None else float_mask(allowed, self.dtype)  # [1, 1, Q, S+Q]

        rows = logits_rows if logits_rows is not None else positions.new_empty(0)
        in_place = s + q <= past.keys.shape[2]
        with self.lock:
            state, before = self._model_state, self._model_state.native
            state.native = True          # this adapter's passes take the CPU kernels
            try:
                if mask is None and in_place and self.fused is not None:
                    logits = self.fused.forward(
                        input_ids, positions, past_pieces(past.keys, past.values, past.shared, s),
                        past.keys[:, :, s:s + q], past.values[:, :, s:s + q], rows)
                    if logits is not None:
                        return Step(logits, past.keys[:, :, s:s + q], past.values[:, :, s:s + q])
                past = _widened(past)
                layers = [_BufferLayer(past.keys[l].unsqueeze(0), past.values[l].unsqueeze(0), s)
                          for l in range(self.kv_shape.layers)]
                out = self._run(input_ids[None], positions, key_positions, mask,
                                Cache(layers=layers), rows, past.shared)
            finally:
                state.native = before
        if in_place:
            keys, values = past.keys[:, :, s:s + q], past.values[:, :, s:s + q]
        else:
            keys = torch.stack([layer.new_keys[0] for layer in layers])
            values = torch.stack([layer.new_values[0] for layer in layers])
        return Step(out.logits[0], keys, values)

    def _forward_chunked(self, input_ids, positions, past: Past, allowed, logits_rows) -> Step:
        """A long input as consecutive chunks, each attending to the past and the chunks
        before it (exact when no token attends to a later one): with a mask, attention
        then costs the causal half of Q x K instead of all of it, and masks stay small."""
        q, s, c = int(input_ids.shape[0]), int(past.positions.shape[0]), self.chunk_size
        rows = logits_rows if logits_rows is not None else positions.new_empty(0)
        key_positions = torch.cat([past.positions, positions])
        order = torch.argsort(rows)                 # rows are served in input order
        rows_sorted = rows[order]
        logits = []
        for start in range(0, q, c):
            end = min(q, start + c)
            mine = rows_sorted[(rows_sorted >= start) & (rows_sorted < end)] - start
            before = Past(past.keys, past.values, key_positions[:s + start], past.shared)
            step = self.forward(input_ids[start:end], positions[start:end], before,
                                None if allowed is None else allowed[start:end, :s + end], mine)
            logits.append(step.logits)
        logits = torch.cat(logits)[torch.argsort(order)]
        return Step(logits, past.keys[:, :, s:s + q], past.values[:, :, s:s + q])

    def _run(self, input_ids, positions, key_positions, mask, cache, rows, shared=()):
        # input_ids: [1, Q]; positions: [Q]; key_positions: [S+Q]; mask: [1,1,Q,S+Q] | None
        return self.model(input_ids=input_ids, position_ids=positions[None], attention_mask=mask,
                          cache=cache, use_cache=True, logits_to_keep=rows)

    # --- per-architecture facts -------------------------------------------------------------

    def _kv_shape(self) -> KVShape:
        c = self.config
        heads = c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        kv_heads = getattr(c, "num_key_value_heads", None) or heads
        return KVShape(c.num_hidden_layers, kv_heads, head_dim, head_dim)

    def _sliding_window(self) -> int | None:
        window = getattr(self.config, "sliding_window", None)
        layer_types = getattr(self.config, "layer_types", None)
        if layer_types and len(set(layer_types)) > 1:
            raise ModelError(f"unsupported architecture: {self.model_type} with mixed "
                             f"attention layer types {sorted(set(layer_types))}")
        if layer_types and layer_types[0] == "full_attention":
            return None
        if getattr(self.config, "use_sliding_window", True) is False:
            return None
        return int(window) if window else None


class RopeAdapter(ModelAdapter):
    scheme = "rope"

    def __init__(self, hf_model):
        super().__init__(hf_model)
        if self.config._attn_implementation in ("sdpa", ATTENTION):
            _register_attention()
            hf_model.set_attn_implementation(ATTENTION)
        self.fused = FusedDecoder.of(hf_model)

    def unmasked_in_one_pass(self, past: int) -> bool:
        return self.config._attn_implementation == ATTENTION and (past == 0 or self._splits)

    @property
    def reads_shared(self) -> bool:
        return self.config._attn_implementation == ATTENTION and self._splits

    @property
    def _splits(self) -> bool:        # pieces of keys attended apart, merged (CPU only)
        return self.device.type == "cpu" and _FLASH_WITH_LSE is not None

    def _run(self, input_ids, positions, key_positions, mask, cache, rows, shared=()):
        if self.config._attn_implementation != ATTENTION:
            return super()._run(input_ids, positions, key_positions, mask, cache, rows)
        extra = {"promptlang_shared": shared} if shared else {}
        return self.model(input_ids=input_ids, position_ids=positions[None], attention_mask=mask,
                          cache=cache, use_cache=True, logits_to_keep=rows, promptlang_masks={},
                          **extra)


class LearnedPositionAdapter(ModelAdapter):
    scheme = "learned"

    @property
    def max_positions(self) -> int | None:
        return getattr(self.config, "n_positions", None) or super().max_positions

    def _kv_shape(self) -> KVShape:
        c = self.config
        return KVShape(c.n_layer, c.n_head, c.n_embd // c.n_head, c.n_embd // c.n_head)


class AlibiAdapter(ModelAdapter):
    """BLOOM: biases from real key positions, substituted by a pre-hook on each attention."""

    scheme = "alibi"

    def __init__(self, hf_model):
        super().__init__(hf_model)
        self._slopes = _alibi_slopes(self.config.n_head).to(self.device)   # [H]
        self._state = _model_state(hf_model)
        if not self._state.hooked:       # once per model, however many adapters wrap it
            for block in hf_model.transformer.h:
                block.self_attention.register_forward_pre_hook(self._state.substitute,
                                                               with_kwargs=True)
            self._state.hooked = True

    @property
    def max_positions(self) -> int | None:
        return None     # ALiBi has no position table

    def _kv_shape(self) -> KVShape:
        c = self.config
        return KVShape(c.n_layer, c.n_head, c.hidden_size // c.n_head, c.hidden_size // c.n_head)

    def _run(self, input_ids, positions, key_positions, mask, cache, rows, shared=()):
        # softmax is shift-invariant per row, so slope * key_position equals -slope * distance
        bias = self._slopes[:, None, None] * key_positions.to(torch.float32)   # [H, 1, K]
        self._state.alibi, self._state.mask = bias.to(self.dtype), mask
        try:
            return self.model(input_ids=input_ids, attention_mask=None, cache=cache,
                              use_cache=True, logits_to_keep=rows)
        finally:
            self._state.alibi = self._state.mask = None


class _ModelState:
    """Per model (shared by every adapter of it): the lock around its forward passes and,
    for ALiBi, the biases and mask the attention pre-hooks substitute during a pass."""

    def __init__(self):
        self.lock = threading.RLock()
        self.hooked = False
        self._thread = threading.local()
        self.linears_wrapped = False
        self.alibi: torch.Tensor | None = None     # [H, 1, K]
        self.mask: torch.Tensor | None = None      # [1, 1, Q, K]

    @property
    def native(self) -> bool:
        """Whether this thread is inside an adapter's forward (small linears use pl_linear);
        per thread, so that a call from another thread meanwhile stays on nn.Linear."""
        return getattr(self._thread, "native", False)

    @native.setter
    def native(self, on: bool) -> None:
        self._thread.native = on

    def substitute(self, module, args, kwargs):
        if self.alibi is not None:
            kwargs["alibi"] = self.alibi
            if self.mask is not None:
                kwargs["attention_mask"] = self.mask
        return args, kwargs


def _model_state(hf_model: torch.nn.Module) -> _ModelState:
    with _STATE_LOCK:
        state = hf_model.__dict__.get("_promptlang_state")
        if state is None:
            state = _ModelState()
            hf_model.__dict__["_promptlang_state"] = state
        return state


_STATE_LOCK = threading.Lock()

# Up to this many rows a linear layer runs faster in pl_linear than in MKL's sgemm (measured
# on the default model's layer shapes: 0.75x the time at 19 rows, 0.93x at 64, 1.08x at 128).
NATIVE_LINEAR_MAX_ROWS = 64


def _use_native_linear(hf_model: torch.nn.Module, state: _ModelState) -> None:
    """Route the model's nn.Linear layers to pl_linear for small inputs during this runtime's
    own passes (state.native); outside them -- transformers' `generate()`, training, other
    callers -- every layer is exactly nn.Linear."""
    with _STATE_LOCK:
        if state.linears_wrapped or not native.enabled():
            return
        for module in hf_model.modules():
            if type(module) is torch.nn.Linear:
                module.forward = _NativeLinear(module, state)
        state.linears_wrapped = True


class _NativeLinear:
    __slots__ = ("module", "state", "checked")

    def __init__(self, module: torch.nn.Linear, state: _ModelState):
        self.module, self.state, self.checked = module, state, None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.module.weight, self.module.bias
        if self.state.native and native.enabled():
            if self.checked is None or self.checked[0] is not weight:   # once per weight
                self.checked = (weight, native.weight_fits(weight, bias) and native.available())
            if self.checked[1] and native.input_fits(x, weight.shape[1], NATIVE_LINEAR_MAX_ROWS):
                return native.linear(x, weight, bias)
        return F.linear(x, weight, bias)


# --- attention for RoPE models -------------------------------------------------------------------

ATTENTION = "promptlang_sdpa"
_PACK_MAX_QUERIES = 512


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
               is_causal=None, **kwargs):
    """SDPA for new tokens against a long cache, registered for RoPE models.

    A mask of None means: every past key visible, the new tokens causal among themselves
    (they are the last Q keys) -- the common cached prefill, every decode step and every
    plain causal pass -- and is served without any Q x K mask: up to
    NATIVE_ATTENTION_MAX_QUERIES new tokens on a CPU by pl_attend (runtime/kernels.c), in one
    pass over every piece of keys; else with no past by SDPA's causal kernel; else (CPU) the
    past keys and the new ones are attended apart and the two results merged by their
    log-sum-exp. A 4-D mask is applied as given.

    Grouped-query heads are folded into the query rows (query heads i*G..i*G+G-1 share
    KV head i) instead of transformers' `repeat_kv` copy of every cached key and value.
    Masks are built or packed once per forward pass, in the `promptlang_masks` dict the
    adapter passes down, and reused by every layer. A call without that dict comes from
    outside the runtime and is transformers' own SDPA, as if the model were not adapted.
    """
    # query: [B, H, Q, D]; key, value: [B, H_kv, K, D] (past first, new last); mask: [B|1, 1, Q, K]
    if kwargs.get("promptlang_masks") is None:
        return _outside_attention(module, query, key, value, attention_mask, dropout, scaling,
                                  is_causal, kwargs)
    shared = kwargs.get("promptlang_shared")
    if not shared and (kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None
                       or kwargs.get("output_attentions")):
        if attention_mask is None and query.shape[2] != key.shape[2]:
            attention_mask = _memo(kwargs, ("causal", 1, query.shape[2], key.shape[2]),
                                   lambda: _causal_mask(1, query.shape[2], key.shape[2],
                                                        query.dtype, query.device))
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=True, **kwargs)
    b, heads, q, d = query.shape
    kv_heads, k = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    out = None
    if (attention_mask is None and b == 1 and q <= NATIVE_ATTENTION_MAX_QUERIES and not dropout
            and query.device.type == "cpu" and native.enabled()):   # the common cached case
        out = _native_attention(getattr(module, "layer_idx", None), shared, query, key, value,
                                scaling)
    if out is not None:
        pass                                     # pl_attend served it
    elif shared:                                 # past slots read in place from stored units
        out = _with_shared(module.layer_idx, shared, query, key, value, attention_mask,
                           scaling, kwargs)
    elif attention_mask is None and q == k:      # no past: SDPA's own causal kernel
        out = F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, scale=scaling,
                                             is_causal=q > 1, enable_gqa=groups > 1)
    elif attention_mask is None and q > 1 and _splits_past(query, dropout):
        out = _past_and_new(query, key, value, scaling, kwargs)
    elif q > _PACK_MAX_QUERIES:                  # enough rows to keep every core busy unpacked
        mask = _memo(kwargs, ("mask", id(attention_mask), 1, q, k),
                     lambda: _additive(attention_mask, 1, q, k, query.dtype, query.device))
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout,
                                             scale=scaling, enable_gqa=groups > 1)
    else:
        mask = None
        if attention_mask is not None or q > 1:
            mask = _memo(kwargs, ("mask", id(attention_mask), groups, q, k),
                         lambda: _additive(attention_mask, groups, q, k, query.dtype,
                                           query.device))
        rows = query.reshape(b, kv_heads, groups * q, d)              # grouped heads packed
        out = F.scaled_dot_product_attention(rows, key, value, attn_mask=mask, dropout_p=dropout,
                                             scale=scaling)
    out = out.reshape(b, heads, q, value.shape[-1]).transpose(1, 2).contiguous()
    return out, None                                                   # [B, Q, H, D]


def _outside_attention(module, query, key, value, attention_mask, dropout, scaling, is_causal,
                       kwargs):
    """transformers' SDPA attention for a call from outside the runtime. `_attention_mask`
    answers None for every causal pass with the new tokens last; SDPA's own causal flag
    aligns to the first key, so a None mask over a past is written out here."""
    # query: [B, H, Q, D]; key, value: [B, H_kv, K, D]
    q, k = query.shape[2], key.shape[2]
    if attention_mask is None and 1 < q != k:
        attention_mask = _causal_mask(1, q, k, query.dtype, query.device)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                  scaling=scaling, is_causal=is_causal, **kwargs)


# New tokens up to which `_attention` takes pl_attend (it computes each causal block whole,
# so long causal passes stay on SDPA's causal kernel).
NATIVE_ATTENTION_MAX_QUERIES = 64


def _native_attention(layer: int | None, shared, query, key, value,
                      scaling) -> torch.Tensor | None:
    """pl_attend over every past key (from the buffer or read in place from stored units)
    and causally over the new ones; [1, H_kv, G*Q, D], or None where it does not apply."""
    # query: [1, H, Q, D]; key, value: [1, H_kv, K, D], new tokens last
    q, k = query.shape[2], key.shape[2]
    pieces = [(keys[0], values[0], False)
              for _, _, keys, values in _pieces(layer, shared, key, value, k - q)]
    pieces.append((key[0, :, k - q:], value[0, :, k - q:], True))
    rows = _rows(query, key.shape[1])[0]
    if not native.attend_fits(rows, pieces) or not native.available():
        return None
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out, _ = native.attend(rows, pieces, q, scale)
    return out[None]


# The CPU flash kernel behind F.scaled_dot_product_attention, called directly because it also
# returns each row's log-sum-exp; where a torch build lacks it, masks are used instead.
_FLASH_WITH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _splits_past(query: torch.Tensor, dropout: float) -> bool:
    return _FLASH_WITH_LSE is not None and query.device.type == "cpu" and not dropout


def _past_and_new(query, key, value, scaling, kwargs) -> torch.Tensor:
    """Attention of Q new tokens to every past key and causally to each other, as two
    unmasked (or tiny-masked) flash passes merged by log-sum-exp; [B, H_kv, G*Q, D]."""
    # query: [B, H, Q, D]; key, value: [B, H_kv, S + Q, D]
    past = key.shape[2] - query.shape[2]
    rows = _rows(query, key.shape[1])
    return _merge([_FLASH_WITH_LSE(rows, key[:, :, :past], value[:, :, :past], scale=scaling),
                   _new_block(query, key[:, :, past:], value[:, :, past:], scaling, kwargs)])


def _with_shared(layer: int, shared, query, key, value, mask, scaling, kwargs) -> torch.Tensor:
    """Attention when some past slots are read from stored units' tensors (SharedKV) rather
    than from `key`/`value`: each piece of keys attended apart, the results merged by
    log-sum-exp; [B, H_kv, G*Q, D]. `mask` None or [B|1, 1, Q, K] as in `_attention`."""
    # query: [B, H, Q, D]; key, value: [B, H_kv, K, D] over every slot, shared ones stale
    q, k = query.shape[2], key.shape[2]
    groups = query.shape[1] // key.shape[1]
    rows = _rows(query, key.shape[1])
    if mask is None:                             # every past key visible, the new ones causal
        parts = [_FLASH_WITH_LSE(rows, keys, values, scale=scaling)
                 for _, _, keys, values in _pieces(layer, shared, key, value, k - q)]
        parts.append(_new_block(query, key[:, :, k - q:], value[:, :, k - q:], scaling, kwargs))
        return _merge(parts)
    parts = []
    for start, end, keys, values in _pieces(layer, shared, key, value, k):
        piece_mask = _memo(kwargs, ("piece", id(mask), start, end, groups),
                           lambda: _additive(mask[..., start:end], groups, q, end - start,
                                             query.dtype, query.device))
        out, lse = _FLASH_WITH_LSE(rows, keys, values, attn_mask=piece_mask, scale=scaling)
        # the kernel reports a log-sum-exp of 0 for a row that sees no key of the piece
        seen = (piece_mask > float("-inf")).any(-1)                  # [B|1, 1, G*Q]
        parts.append((out, lse.masked_fill(~seen, float("-inf"))))
    return _merge(parts)


def _widened(past: Past) -> Past:
    """`past` with its shared runs in another dtype than the buffer's (a bfloat16 store's
    units) copied into the buffer's own slots, which are stale and unused there."""
    dtype = past.keys.dtype
    own = [seg.keys.dtype == dtype and seg.values.dtype == dtype for seg in past.shared]
    if all(own):
        return past
    for seg, ok in zip(past.shared, own):
        if not ok:
            past.keys[:, :, seg.start:seg.end] = seg.keys
            past.values[:, :, seg.start:seg.end] = seg.values
    return past._replace(shared=tuple(seg for seg, ok in zip(past.shared, own) if ok))


def _pieces(layer: int | None, shared, key, value, end: int):
    """Slots [0, end) as (first slot, end slot, keys, values) pieces in slot order: the
    SharedKV runs read from their units' tensors, the slots between them from `key`/`value`
    ([B, H_kv, K, D]); keys and values of every piece [B, H_kv, n, D]."""
    return [(a, b, key[:, :, a:b], value[:, :, a:b]) if run is None else
            (a, b, run.keys[layer][None], run.values[layer][None])
            for a, b, run in slot_runs(shared, end)]


def _rows(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, H, Q, D] -> [B, H_kv, G*Q, D]: the query heads sharing a KV head as its rows."""
    b, heads, q, d = query.shape
    return query.reshape(b, kv_heads, heads // kv_heads * q, d)


def _new_block(query, new_keys, new_values, scaling, kwargs):
    """(out, lse) of the Q new tokens attending causally to each other, in packed rows."""
    # query: [B, H, Q, D]; new_keys, new_values: [B, H_kv, Q, D]
    b, heads, q, d = query.shape
    kv_heads = new_keys.shape[1]
    groups = heads // kv_heads
    rows = _rows(query, kv_heads)
    if q == 1:
        return _FLASH_WITH_LSE(rows, new_keys, new_values, scale=scaling)
    if q <= _PACK_MAX_QUERIES:                   # packed rows need a [G*Q, Q] causal block
        block = _memo(kwargs, ("causal", groups, q, q),
                      lambda: _causal_mask(groups, q, q, query.dtype, query.device))
        return _FLASH_WITH_LSE(rows, new_keys, new_values, attn_mask=block, scale=scaling)
    out, lse = _FLASH_WITH_LSE(query, new_keys, new_values, is_causal=True, scale=scaling)
    return out.reshape(b, kv_heads, groups * q, d), lse.reshape(b, kv_heads, groups * q)


def _merge(parts) -> torch.Tensor:
    """Attention over the union of disjoint key sets, from each set's (out, log-sum-exp)."""
    # out: [B, H_kv, R, D]; lse: [B, H_kv, R] float32
    if len(parts) == 2:
        (out_a, lse_a), (out_b, lse_b) = parts
        share = torch.sigmoid(lse_a - lse_b).unsqueeze(-1)           # weight of the first set
        return torch.lerp(out_b, out_a, share.to(out_a.dtype))
    weights = torch.softmax(torch.stack([lse for _, lse in parts]), 0).unsqueeze(-1)
    out = parts[0][0] * weights[0].to(parts[0][0].dtype)
    for (part, _), weight in zip(parts[1:], weights[1:]):
        out.add_(part * weight.to(part.dtype))
    return out


def _memo(kwargs, key, build):
    """`build()`, kept for the rest of this forward pass when the adapter passed a memo."""
    memo = kwargs.get("promptlang_masks")
    if memo is None:
        return build()
    hit = memo.get(key)
    if hit is None:
        hit = memo[key] = build()
    return hit


def _additive(mask, groups: int, q: int, k: int, dtype, device) -> torch.Tensor:
    """[B|1, 1, groups*Q, K] additive mask for query rows packed `groups` at a time; a mask
    of None is the causal block over the last Q keys with every earlier key visible."""
    if mask is None:
        return _causal_mask(groups, q, k, dtype, device)
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(~mask,
                                                                                float("-inf"))
    return mask if groups == 1 else mask.repeat(1, 1, groups, 1)


def _causal_mask(groups: int, q: int, k: int, dtype, device) -> torch.Tensor:
    mask = torch.zeros(groups, q, k, dtype=dtype, device=device)
    later = torch.ones(q, q, dtype=torch.bool, device=device).triu(1)
    mask[:, :, k - q:].masked_fill_(later, float("-inf"))
    return mask.view(1, 1, groups * q, k)


def _attention_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0,
                    mask_function=causal_mask_function, attention_mask=None, local_size=None,
                    allow_is_causal_skip=True, **kwargs):
    """transformers' mask hook for `_attention`: None where `_attention` reads None right
    (plain causal, the new tokens last, no padding), else SDPA's boolean mask."""
    if (allow_is_causal_skip and mask_function is causal_mask_function and local_size is None
            and kv_offset == 0 and int(q_offset) == kv_length - q_length
            and (attention_mask is None or bool(attention_mask.all()))):
        return None
    return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function,
                     attention_mask, local_size=local_size, allow_is_causal_skip=False, **kwargs)


def _register_attention() -> None:
    AttentionInterface.register(ATTENTION, _attention)
    AttentionMaskInterface.register(ATTENTION, _attention_mask)


_ADAPTERS = {"rope": RopeAdapter, "learned": LearnedPositionAdapter, "alibi": AlibiAdapter}


def adapt(hf_model: torch.nn.Module) -> ModelAdapter:
    """The adapter for `hf_model`'s position scheme; ModelError if it has none."""
    model_type = getattr(getattr(hf_model, "config", None), "model_type", None)
    scheme = SCHEMES.get(model_type)
    if scheme is None:
        raise ModelError(f"unsupported architecture: {model_type} "
                         f"(supported: {', '.join(SCHEMES)})")
    return _ADAPTERS[scheme](hf_model)


# --- helpers -------------------------------------------------------------------------------

def float_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[Q, K] bool -> [1, 1, Q, K] additive mask of 0 / -inf."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    mask.masked_fill_(~allowed, float("-inf"))
    return mask[None, None]


def causal_allowed(past: int, new: int, device=None) -> torch.Tensor:
    """[new, past + new]: every past key, and new keys up to the query in input order."""
    allowed = torch.ones(new, past + new, dtype=torch.bool, device=device)
    allowed[:, past:] = torch.ones(new, new, dtype=torch.bool, device=device).tril()
    return allowed


def _alibi_slopes(heads: int) -> torch.Tensor:
    """ALiBi's geometric slopes (a head count that is no power of two adds a second series)."""
    closest = 2 ** math.floor(math.log2(heads))
    base = 2 ** (-(2 ** -(math.log2(closest) - 3)))
    slopes = [base ** (i + 1) for i in range(closest)]
    if closest != heads:
        extra = 2 ** (-(2 ** -(math.log2(2 * closest) - 3)))
        slopes += [extra ** (2 * i + 1) for i in range(min(closest, heads - closest))]
    return torch.tensor(slopes, dtype=torch.float32)


def model_fingerprint(hf_model: torch.nn.Module) -> str:
    """Identifies what determines the KV: the config, and the name, shape, dtype and every
    byte of every weight. Each tensor's raw bytes are hashed in place (one device->CPU copy
    for tensors elsewhere), on a few threads (hashlib releases the GIL): one pass over the
    weights per load."""
    from concurrent.futures import ThreadPoolExecutor
    from os import cpu_count

    def tensor_digest(p: torch.Tensor) -> bytes:
        flat = p.detach().to("cpu").contiguous().reshape(-1)
        if not flat.numel():
            return hashlib.sha256().digest()
        return hashlib.sha256(memoryview(flat.view(torch.uint8).numpy())).digest()  # any dtype

    h = hashlib.sha256(b"promptlang-model-fingerprint-v2\0")
    config = {k: v for k, v in hf_model.config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    h.update(json.dumps(config, sort_keys=True, default=str).encode())
    params = sorted(hf_model.named_parameters(), key=lambda kv: kv[0])
    with torch.no_grad(), ThreadPoolExecutor(max(1, min(8, cpu_count() or 1))) as pool:
        digests = pool.map(tensor_digest, [p for _, p in params])
        for (name, p), digest in zip(params, digests):
            h.update(f"\0{name}:{tuple(p.shape)}:{p.dtype}\0".encode() + digest)
    return h.hexdigest()[:32]
