"""The model adapter: a causal LM driven at explicit positions with explicit masks.

`ModelAdapter.forward` is the one entry point of the encoder and the generator: Q new
tokens at their layout positions against a Past (keys/values in a caller-owned buffer,
some slot spans possibly read in place from stored units), with a visibility matrix or
None (every past key visible, the new tokens causal). It takes, the first that applies:

    chunked     a long input as consecutive chunks (smaller masks, half of Q x K)
    fused       the fast decoder (runtime/fast/fused.py) for an unmasked pass in place
    layers      transformers' own layers over a Cache of the buffer (`_run`; per scheme
                in runtime/model/schemes.py, attention in runtime/model/attention.py)

Keys and values are kept at `num_key_value_heads` (never after repeat_kv), as
`[L, H_kv, S, D]`. The fast paths are installed once, by `accelerate(self)`; they run
only on the thread inside `forward` (ModelState.in_runtime_pass), never for a call of the
model from outside the runtime.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, NamedTuple

import torch

from promptlang.errors import InternalError, ModelError, UnsupportedModelError
from promptlang.runtime.fast import FastPaths, accelerate
from promptlang.runtime.fast.fused import MAX_TOKENS, BatchRequest
from promptlang.runtime.fast.native import MAX_PIECES
from promptlang.runtime.fast.pieces import flagged_pieces, past_pieces
from promptlang.runtime.model.compute import Bf16Compute
from promptlang.runtime.model.families import FAMILIES, Family
from promptlang.runtime.model.fingerprint import model_fingerprint
from promptlang.runtime.model import heap
from promptlang.runtime.model.internals import BufferLayer, buffer_cache
from promptlang.runtime.model.state import model_state


# A pass under the positional rule of up to this many new tokens takes the fused layers (in
# runs of MAX_TOKENS); longer ones (deviation:F over thousands of tokens) take the masked GEMMs.
FUSED_BY_POSITION_MAX = 256


class SharedKV(NamedTuple):
    """Past slots [start, end) whose keys/values are read in place from another tensor (a
    stored unit's) instead of the buffer, whose own copy of those slots is left stale."""

    start: int
    end: int
    keys: torch.Tensor       # [L, H_kv, end - start, D_k]
    values: torch.Tensor     # [L, H_kv, end - start, D_v]


class ParallelContexts(NamedTuple):
    """APE's attention over contexts encoded apart (Adaptive Parallel Encoding, arXiv
    2502.05431; docs/RECOMPUTE.md, "ape"): the past slots in `context` are the contexts.
    A new token's attention is split in two: the context keys, their scores divided by
    `temperature`, and the others (every other past key and the new tokens it sees). Each
    part is a softmax of its own, and the two are mixed by softmax(scale * temperature *
    L_C, L_O), where L_C, L_O are the parts' log-sum-exps of the (tempered) scores. With
    temperature = scale = 1 this is plain attention."""

    context: torch.Tensor    # [S] bool: past slot is a context key
    temperature: float
    scale: float


class Past(NamedTuple):
    """Keys/values a forward pass attends to besides its own tokens.

    The past occupies the first S = len(positions) slots of the buffers. When the
    buffers have room for the new tokens too (C >= S + Q), the pass writes their
    keys/values into slots S..S+Q in place: no copy of the past per call. Slots covered
    by `shared` are read from those tensors instead (adapters with `reads_shared` only).
    With `contexts`, every new token attends as ParallelContexts says (adapters with
    `attends_in_parallel` only).
    """

    keys: torch.Tensor       # [L, H_kv, C, D_k]
    values: torch.Tensor     # [L, H_kv, C, D_v]
    positions: torch.Tensor  # [S] int64: layout position of each past key
    shared: tuple[SharedKV, ...] = ()
    contexts: ParallelContexts | None = None


class Step(NamedTuple):
    logits: torch.Tensor     # [R, V] for the requested rows (R may be 0)
    keys: torch.Tensor       # [L, H_kv, Q, D_k]  (views into the buffer when it had room)
    values: torch.Tensor     # [L, H_kv, Q, D_v]


@dataclass(frozen=True)
class KVShape:
    layers: int
    kv_heads: int
    key_dim: int
    value_dim: int


class ModelAdapter:
    """A causal LM driven at explicit positions with explicit masks (one per scheme:
    runtime/model/schemes.py; `adapt` picks it from the family registry).

    `forward` is the single entry point used by the encoder and the generator.
    """

    scheme: str = ""
    chunk_size: int = 512     # longer inputs run as chunks (see _forward_chunked)
    max_batch_tokens: int = MAX_TOKENS    # the most tokens `forward_batch` fuses in one pass

    def __init__(self, hf_model: torch.nn.Module, fingerprint: str | None = None):
        """`fingerprint`: model_fingerprint(hf_model) where the caller knows it already (a
        converted copy's load record), else computed here."""
        self.model = hf_model.eval()
        self.config = hf_model.config
        self.model_type = self.config.model_type
        self.kv_shape = self._kv_shape()
        self.dtype = next(hf_model.parameters()).dtype
        self.device = next(hf_model.parameters()).device
        self.sliding_window = self._sliding_window()
        self.fingerprint = fingerprint or model_fingerprint(hf_model)   # the store's key
        self.weights_fingerprint = self.fingerprint      # the weights alone (seam adapters)
        self.family: Family = FAMILIES.get(self.model_type) or Family(self.scheme)
        self.state = model_state(hf_model)         # shared by every adapter of this model
        self.lock = self.state.lock                # one forward at a time per model
        self.fast: FastPaths = accelerate(self)
        self.compute: Bf16Compute | None = None    # multi-row passes in bfloat16 (compute.py)

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
        model/attention.py), so that a long one (a baseline prefill, a long unit) needs no
        chunks."""
        return False

    @property
    def reads_shared(self) -> bool:
        """Whether `forward` accepts a Past with `shared` slots (read in place)."""
        return False

    @property
    def attends_in_parallel(self) -> bool:
        """Whether `forward` accepts a Past with `contexts` (APE's attention)."""
        return False

    def shares_dtype(self, dtype: torch.dtype) -> bool:
        """Whether shared slots in `dtype` are worth handing to `forward` rather than copying
        into the buffer: the model's own dtype, and a 16-bit one where the fused layers read
        it in place. (`forward` takes any float dtype: whatever path cannot read it gets
        those slots copied into the buffer first.)"""
        return dtype == self.dtype or (
            dtype in (torch.bfloat16, torch.float16) and self.dtype == torch.float32
            and self.fast.decoder is not None and self.fast.decoder.available())

    @property
    def numerics(self) -> tuple:
        """The switches besides the weights that decide a pass's numbers (the fused layers'
        opt-in approximations, bfloat16 compute): KV computed under one setting is not
        another's."""
        decoder = self.fast.decoder
        fused = () if decoder is None else decoder.numerics
        return fused if self.compute is None else (*fused, ("compute", "bfloat16"))

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype passes of many new tokens compute in (runtime/model/compute.py)."""
        return self.dtype if self.compute is None else torch.bfloat16

    @contextlib.contextmanager
    def float32_passes(self) -> Iterator[None]:
        """Within (the caller holds the lock): every pass on the model's own weights, none on
        the bfloat16 twin -- for a caller that changes those weights (a seam adapter)."""
        compute = self.compute
        if compute is None:
            yield
            return
        compute.disabled_depth += 1
        try:
            yield
        finally:
            compute.disabled_depth -= 1

    def bf16_request(self, prompt_tokens: int) -> bool:
        """Whether a request with `prompt_tokens` prompt tokens runs its prompt's passes on
        the bfloat16 twin (False without one)."""
        return self.compute is not None and self.compute.for_request(prompt_tokens)

    @contextlib.contextmanager
    def passes_in(self, bf16: bool) -> Iterator[None]:
        """Within (this thread): every pass on the bfloat16 twin or in float32, whatever its
        row count (nothing changes without a twin)."""
        if self.compute is None:
            yield
            return
        with self.compute.passes(bf16):
            yield

    def empty_kv(self, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.kv_shape
        shape = (s.layers, s.kv_heads, capacity)
        keys = torch.empty(*shape, s.key_dim, dtype=self.dtype, device=self.device)
        values = torch.empty(*shape, s.value_dim, dtype=self.dtype, device=self.device)
        return keys, values

    # --- the forward pass -----------------------------------------------------------------

    @torch.inference_mode()
    def forward_batch(self, items: list[tuple[torch.Tensor, torch.Tensor, Past, bool]]
                      ) -> list[Step] | None:
        """Several requests' new tokens in ONE pass, each (input_ids [Q_i], positions [Q_i],
        past, by_position) seeing its own past and its own new tokens only, causally in
        input order: every past key, or with by_position (positions increase) the past keys
        at positions <= the token's own (a prefill with recomputed tokens), as APE's
        contexts where its past has some; the logits of each request's last token. None
        (nothing written) where the fused layers cannot take the batch (more than
        `max_batch_tokens` tokens, ...): the caller then runs `forward` per request."""
        decoder = self.fast.decoder
        if decoder is None or self.sliding_window is not None:
            return None
        if self.compute is not None and getattr(self.compute.decided, "bf16", None):
            return None                       # the fused batch is float32 only
        requests = []
        slots = []
        for input_ids, positions, past, by_position in items:
            s = int(past.positions.shape[0])
            q = int(input_ids.shape[0])
            room = s + q <= past.keys.shape[2]
            readable = ((not past.shared or self.reads_shared)
                        and (past.contexts is None or self.attends_in_parallel))
            if not room or not readable:
                return None
            pieces, contexts = _pieces(past, s)
            requests.append(BatchRequest(
                input_ids, positions, pieces, past.keys[:, :, s:s + q],
                past.values[:, :, s:s + q], torch.tensor([q - 1], device=positions.device),
                past.positions if by_position else None, contexts))
            slots.append((past, s, q))
        heap.note_pass(sum(q for _, _, q in slots))
        with self.lock:
            state = self.state
            before = state.in_runtime_pass
            state.in_runtime_pass = True
            try:
                out = decoder.forward_batch(requests)
            finally:
                state.in_runtime_pass = before
        if out is None:
            return None
        return [Step(logits, past.keys[:, :, s:s + q], past.values[:, :, s:s + q])
                for logits, (past, s, q) in zip(out, slots)]

    @contextlib.contextmanager
    def capture_query(self) -> Iterator[torch.Tensor]:
        """Within: every pass of this thread writes its last new token's rotated query of
        every layer (before the softmax scale) into the yielded [L, heads, D] float32
        tensor -- the recompute policy query:K ranks cached tokens by it. RoPE models with
        promptlang's attention only (`attends_in_parallel`)."""
        if not self.attends_in_parallel:
            raise ModelError(f"{self.model_type}: capturing queries needs a RoPE model with "
                             f"promptlang's attention")
        heads = self.config.num_attention_heads
        sink = torch.zeros(self.kv_shape.layers, heads, self.kv_shape.key_dim,
                           dtype=torch.float32, device=self.device)
        state = self.state
        before = state.query_sink
        state.query_sink = sink
        try:
            yield sink
        finally:
            state.query_sink = before

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, past: Past | None,
                allowed: torch.Tensor | None, logits_rows: torch.Tensor | None = None, *,
                by_position: bool = False) -> Step:
        """Run Q new tokens against `past`.

        input_ids, positions: [Q] int64.
        allowed: [Q, S + Q] bool, True where query i may attend key j (past keys first,
            then the new tokens in input order); None means causal in input order with
            every past key visible.
        logits_rows: [R] indices into the Q new tokens whose logits are wanted (None: none).
        by_position: the caller promises that `allowed` is the positional rule -- positions
            increase, and a token sees the past keys at positions <= its own and the new
            tokens before it -- so the fused layers may serve it without a mask.
        """
        q = int(input_ids.shape[0])
        heap.note_pass(q)
        if past is None:
            past = Past(*self.empty_kv(q), positions.new_empty(0))
        if past.shared and not self.reads_shared:
            raise UnsupportedModelError(f"{type(self).__name__} cannot read shared KV slots")
        if past.contexts is not None and not self.attends_in_parallel:
            raise UnsupportedModelError(f"{type(self).__name__} cannot attend to parallel contexts")
        s = int(past.positions.shape[0])
        unmasked = allowed is None and self.sliding_window is None and self.unmasked_in_one_pass(s)
        chunkable = q > self.chunk_size and s + q <= past.keys.shape[2] and not unmasked
        if chunkable and (allowed is None or not bool(allowed[:, s:].triu(1).any())):
            # chunks are never fused: 16-bit shared spans are widened once, not per chunk
            return self._forward_chunked(input_ids, positions, _widened(past), allowed,
                                         logits_rows)
        key_positions = torch.cat([past.positions, positions])        # [S + Q]
        if self.sliding_window is not None and allowed is None and q > 0:
            span = int(positions.max()) - int(key_positions.min())
            if span >= self.sliding_window:
                allowed = causal_allowed(s, q, device=positions.device)
        if self.sliding_window is not None and allowed is not None:
            allowed = allowed & (key_positions[None, :] > positions[:, None] - self.sliding_window)
        rows = logits_rows if logits_rows is not None else positions.new_empty(0)
        in_place = s + q <= past.keys.shape[2]
        with self.lock:
            twin = self.compute.model if self.compute and self.compute.serves(q) else None
            dtype = self.dtype if twin is None else torch.bfloat16
            mask = None if allowed is None else float_mask(allowed, dtype)  # [1, 1, Q, S+Q]
            state = self.state
            before = state.in_runtime_pass
            state.in_runtime_pass = True   # kernels: this thread
            try:
                decoder = self.fast.decoder if twin is None else None
                if mask is None and in_place and decoder is not None:
                    pieces, contexts = _pieces(past, s)
                    logits = decoder.forward(
                        input_ids, positions, pieces, past.keys[:, :, s:s + q],
                        past.values[:, :, s:s + q], rows, contexts=contexts,
                        query_out=state.query_sink)
                    if logits is not None:
                        return Step(logits, past.keys[:, :, s:s + q], past.values[:, :, s:s + q])
                fits_by_position = (by_position and self.sliding_window is None
                                    and q <= FUSED_BY_POSITION_MAX)
                if fits_by_position and in_place and decoder is not None:
                    logits = _fused_by_position(decoder, input_ids, positions, past, rows,
                                                state.query_sink)
                    if logits is not None:
                        return Step(logits, past.keys[:, :, s:s + q], past.values[:, :, s:s + q])
                past = _widened(past)
                layers = [BufferLayer(past.keys[l].unsqueeze(0), past.values[l].unsqueeze(0), s,
                                      dtype)
                          for l in range(self.kv_shape.layers)]
                out = self._run(input_ids[None], positions, key_positions, mask,
                                buffer_cache(layers), rows, past.shared, past.contexts,
                                model=twin)
            finally:
                state.in_runtime_pass = before
        if in_place:
            keys = past.keys[:, :, s:s + q]
            values = past.values[:, :, s:s + q]
        else:
            keys = torch.stack([layer.new_keys[0] for layer in layers])
            values = torch.stack([layer.new_values[0] for layer in layers])
        return Step(out.logits[0].to(self.dtype), keys, values)

    def _forward_chunked(self, input_ids, positions, past: Past, allowed, logits_rows) -> Step:
        """A long input as consecutive chunks, each attending to the past and the chunks
        before it (exact when no token attends to a later one): with a mask, attention
        then costs the causal half of Q x K instead of all of it, and masks stay small."""
        q = int(input_ids.shape[0])
        s = int(past.positions.shape[0])
        c = self.chunk_size
        rows = logits_rows if logits_rows is not None else positions.new_empty(0)
        key_positions = torch.cat([past.positions, positions])
        order = torch.argsort(rows)                 # rows are served in input order
        rows_sorted = rows[order]
        logits = []
        for start in range(0, q, c):
            end = min(q, start + c)
            mine = rows_sorted[(rows_sorted >= start) & (rows_sorted < end)] - start
            before = past._replace(positions=key_positions[:s + start])
            step = self.forward(input_ids[start:end], positions[start:end], before,
                                None if allowed is None else allowed[start:end, :s + end], mine)
            logits.append(step.logits)
        logits = torch.cat(logits)[torch.argsort(order)]
        return Step(logits, past.keys[:, :, s:s + q], past.values[:, :, s:s + q])

    def _run(self, input_ids, positions, key_positions, mask, cache, rows, shared=(),
             contexts=None, model=None):
        # input_ids: [1, Q]; positions: [Q]; key_positions: [S+Q]; mask: [1,1,Q,S+Q] | None
        # model: the bfloat16 twin (compute.py) or None (self.model)
        return (self.model if model is None else model)(input_ids=input_ids, position_ids=positions[None], attention_mask=mask,
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


def _fused_by_position(decoder, input_ids, positions, past: Past, rows,
                       query_out: torch.Tensor | None = None) -> torch.Tensor | None:
    """Logits of `rows` for Q new tokens under the positional rule (a recompute pass), by the
    fused layers in runs of at most their MAX_TOKENS, each run attending to the past and the
    runs before it (exact: positions increase). None, with nothing written, where the fused
    layers do not serve the first run."""
    # input_ids, positions: [Q]; past.keys: [L, H_kv, C, D] with room for the Q new tokens
    q = int(input_ids.shape[0])
    s = int(past.positions.shape[0])
    size = MAX_TOKENS
    first = _pieces(past, s)
    if len(first[0]) + 2 >= MAX_PIECES:          # a later run may add one piece
        return None
    order = torch.argsort(rows)                    # rows are served in input order
    rows_sorted = rows[order]
    logits = []
    for start in range(0, q, size):
        end = min(q, start + size)
        at = s + start
        mine = rows_sorted[(rows_sorted >= start) & (rows_sorted < end)] - start
        pieces, contexts = first if start == 0 else _pieces(past, at)
        out = decoder.forward(input_ids[start:end], positions[start:end], pieces,
                              past.keys[:, :, at:s + end], past.values[:, :, at:s + end], mine,
                              key_positions=torch.cat([past.positions, positions[:start]]),
                              contexts=contexts, query_out=query_out)
        if out is None:
            if start == 0:
                return None
            raise InternalError("the fused layers stopped serving a recompute pass half-way")
        logits.append(out)
    return torch.cat(logits)[torch.argsort(order)]


def _pieces(past: Past, end: int):
    """The fused layers' past pieces of slots [0, end), and APE's contexts for them (each
    piece a context or not, temperature, scale; None without `past.contexts`)."""
    if past.contexts is None:
        return past_pieces(past.keys, past.values, past.shared, end), None
    pieces, flags = flagged_pieces(past.keys, past.values, past.shared, end,
                                   past.contexts.context)
    return pieces, (flags, past.contexts.temperature, past.contexts.scale)


def _widened(past: Past) -> Past:
    """`past` with its shared spans in another dtype than the buffer's (a bfloat16 store's
    units) copied into the buffer's own slots, which are stale and unused there."""
    dtype = past.keys.dtype
    own = [kv.keys.dtype == dtype and kv.values.dtype == dtype for kv in past.shared]
    if all(own):
        return past
    for kv, ok in zip(past.shared, own):
        if not ok:
            past.keys[:, :, kv.start:kv.end] = kv.keys
            past.values[:, :, kv.start:kv.end] = kv.values
    return past._replace(shared=tuple(kv for kv, ok in zip(past.shared, own) if ok))


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
