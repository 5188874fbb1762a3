"""The cached pass of a Llama-family model as one call into kernels.c (pl_decoder).

transformers runs each decoder layer as some twenty PyTorch operations and Python calls, and
each kernel call opens its own parallel region; for the handful of new tokens of a cached
request on a CPU that is a large share of the pass (docs/BENCHMARKS.md, "Fused decoder
layers"). pl_decoder runs every layer -- RMSNorm, the q/k/v projections, the rotary
embedding, attention over every past piece and causally over the new tokens, the output
projection, the SiLU-gated MLP and both residuals -- in one OpenMP region, writing the new
keys and values straight into the request's buffer. The embedding, the rotary tables, the
final norm and the LM head stay the model's own.

It serves the families whose registry entry names a decoder class prefix
(runtime/model/families.py) when the model's structure is exactly that (checked module by
module when the adapter is built), float32 on a CPU with the kernels available, up to
MAX_TOKENS new tokens that see every past key (no mask), with no hooks on the model's
modules. Past pieces may be bfloat16 or float16 (a 16-bit store's units, read in place).
Anything else takes the transformers path; both are held to the same oracle
(tests/runtime/test_fused.py, tests/runtime/test_oracle.py).
"""

from __future__ import annotations

import contextlib
import ctypes
from typing import NamedTuple

import torch
from torch.nn.modules import module as nn_module

import promptlang.runtime.fast.native as native
from promptlang.errors import InvalidArgumentError
from promptlang.runtime.fast.pieces import Piece

# Past pieces pl_decoder reads in place: float32, and bfloat16 or float16 (a 16-bit store's
# units, widened in cache a block at a time instead of copied into the request buffer).
PIECE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Up to this many new tokens (as for fast/attention.py; beyond it MKL's GEMMs win).
MAX_TOKENS = 64


class BatchRequest(NamedTuple):
    """One request of `FusedDecoder.forward_batch`: as `forward`'s arguments."""

    input_ids: torch.Tensor               # [Q_i]
    positions: torch.Tensor               # [Q_i], its rotary positions
    pieces: list                          # its past pieces, [L, H_kv, n, D] each
    new_keys: torch.Tensor                # [L, H_kv, Q_i, D]: where its new keys go
    new_values: torch.Tensor
    rows: torch.Tensor                    # which of its Q_i tokens' logits are wanted
    key_positions: torch.Tensor | None = None   # its past keys' positions (None: all seen)
    contexts: tuple[list[bool], float, float] | None = None   # APE's, as `forward` takes

_WEIGHTS = ("input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
            "self_attn.v_proj.weight", "self_attn.o_proj.weight",
            "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
            "mlp.down_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.bias",
            "self_attn.v_proj.bias", "self_attn.o_proj.bias", "mlp.gate_proj.bias",
            "mlp.up_proj.bias", "mlp.down_proj.bias")     # kernels.c's W_LN1 .. B_DOWN


# the LM head reads its Q8_0 blocks for up to this many rows (the decoder layers' Q4_1 limit
# is kernels.c's Q4_MAX_ROWS / Q4_MAX_ROWS_WIDE): the default model's head, 2 threads,
# 512-bit tiles: 1 row 1.7 vs 4.1 ms, 16 rows 5.0 vs 7.4, 64 rows 15.3 vs 15.6 (float); with
# 256-bit tiles the blocks are faster than the float head for up to 3 rows only
Q_MAX_ROWS = 64
Q_MAX_ROWS_NARROW = 3

_switch = native.Switch()

# Inside `with disabled():` every pass takes the transformers path (for A/B and tests); the
# kernels of that path (native.py) stay on unless turned off too.
disabled = _switch.off


class _Serving(NamedTuple):
    """What `FusedDecoder.approximated` puts back: the weights served instead of their float
    copies, their kind, the float weights they were checked against, the kernel's table, and
    whether the attention's products are bfloat16."""

    blocks: dict
    kind: int
    kinds: ctypes.Array | None
    seen: tuple
    table: ctypes.Array | None
    bf16_attention: bool


def _equal_blocks(checks: dict[str, bool] | None, key: str, blocks: torch.Tensor,
                  weight: torch.Tensor, kind: int) -> bool:
    """Whether `blocks` (of `kind`) dequantize to `weight` bit for bit: `checks[key]` where an
    earlier load recorded it, else compared here, 4096 rows at a time, and recorded."""
    if checks is not None and isinstance(checks.get(key), bool):
        return checks[key]
    k = weight.shape[1]
    same = all(torch.equal(native.q_dequant(blocks[i:i + 4096], k, kind=kind), weight[i:i + 4096])
               for i in range(0, weight.shape[0], 4096))
    if checks is not None:
        checks[key] = same
    return same


class FusedDecoder:
    """pl_decoder for one model; build with `of`, which returns None for other structures."""

    def __init__(self, hf_model: torch.nn.Module, layers: list[torch.nn.Module]):
        base = hf_model.model
        attn = layers[0].self_attn
        self.embed = base.embed_tokens
        self.rotary = base.rotary_emb
        self.norm = base.norm
        self.lm_head = hf_model.lm_head
        self.layers = layers
        self.heads = int(hf_model.config.num_attention_heads)
        self.kv_heads = int(hf_model.config.num_key_value_heads or self.heads)
        self.head_dim = int(attn.head_dim)
        self.hidden = int(hf_model.config.hidden_size)
        self.inter = int(layers[0].mlp.gate_proj.out_features)
        self.eps = float(layers[0].input_layernorm.variance_epsilon)
        self.scale = float(attn.scaling)
        self._outer = [hf_model, base, self.embed, self.rotary, self.norm, self.lm_head]
        self._modules = [m for layer in layers for m in layer.modules()] + self._outer
        self._dropped = False        # linear weights served from blocks only (BlockLinear)
        self._table: tuple[tuple[int, ...], ctypes.Array] | None = None
        # weights served instead of their float copies (attach_blocks, attach_int8): slot ->
        # buffer, the buffers' kind (4: Q4_1 blocks, 8: Q8_0 blocks, 1: int8 rows), the float
        # weights' (pointer, version) they were checked against, and the kernel's table
        self._blocks: dict[int, torch.Tensor] = {}
        self._blocks_kind = 4
        self._kinds_table: ctypes.Array | None = None    # each slot's kind, where they differ
        self._blocks_seen: tuple = ()
        self._blocks_table: ctypes.Array | None = None
        # the attention's products in bfloat16 (kernels.c `bf`; native.products_available
        # says where): twice the arithmetic rate, an approximation -- off unless asked for
        self.bf16_attention = False
        self._q8_head: tuple[torch.Tensor, tuple] | None = None   # (Q8_0 blocks, checked)
        self._slots = [_slot(layer, name) for layer in layers for name in _WEIGHTS]
        self._shape = (ctypes.c_long * 6)(self.hidden, self.heads, self.kv_heads, self.head_dim,
                                          self.inter, len(layers))
        nq = self.heads * self.head_dim
        nkv = self.kv_heads * self.head_dim
        hidden = self.hidden
        inter = self.inter
        shapes = ((hidden,), (nq, hidden), (nkv, hidden), (nkv, hidden), (hidden, nq),
                  (hidden,), (inter, hidden), (inter, hidden), (hidden, inter),
                  (nq,), (nkv,), (nkv,), (hidden,), (inter,), (inter,), (hidden,))
        self._shapes = shapes * len(layers)        # what the kernel reads at each slot

    @classmethod
    def of(cls, hf_model: torch.nn.Module, family: str) -> FusedDecoder | None:
        """The decoder for `hf_model` if every module is the plain one of `family` (a class
        name prefix, "Llama": LlamaForCausalLM, LlamaDecoderLayer, ...), else None."""
        config = hf_model.config
        base = getattr(hf_model, "model", None)
        plain_model = (type(hf_model).__name__ == f"{family}ForCausalLM"
                       and base is not None and type(base).__name__ == f"{family}Model"
                       and type(getattr(hf_model, "lm_head", None)) is torch.nn.Linear
                       and type(getattr(base, "embed_tokens", None)) is torch.nn.Embedding
                       and type(getattr(base, "norm", None)).__name__ == f"{family}RMSNorm")
        plain_config = (getattr(config, "hidden_act", None) in ("silu", "swish")
                        and getattr(config, "pretraining_tp", 1) == 1)
        if not plain_model or not plain_config:
            return None
        layers = list(base.layers[:config.num_hidden_layers])
        if not layers or not all(_is_plain_layer(layer, family) for layer in layers):
            return None
        first = layers[0]
        same = {(float(l.input_layernorm.variance_epsilon),
                 float(l.post_attention_layernorm.variance_epsilon), float(l.self_attn.scaling),
                 int(l.self_attn.head_dim), l.mlp.gate_proj.out_features) for l in layers}
        heads = config.num_attention_heads
        d = int(first.self_attn.head_dim)
        kv_heads = config.num_key_value_heads or heads
        eps = first.input_layernorm.variance_epsilon
        alike = len(same) == 1 and eps == first.post_attention_layernorm.variance_epsilon
        heads_fit = first.self_attn.q_proj.out_features == heads * d and heads % kv_heads == 0
        widths_fit = (d % 8 == 0 and d <= native.MAX_HEAD_DIM and config.hidden_size % 8 == 0
                      and first.mlp.gate_proj.out_features % 8 == 0)
        if not alike or not heads_fit or not widths_fit:
            return None                   # what pl_decoder's vector loops cannot take
        return cls(hf_model, layers)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, pieces: list[Piece],
                new_keys: torch.Tensor, new_values: torch.Tensor, rows: torch.Tensor,
                key_positions: torch.Tensor | None = None,
                contexts: tuple[list[bool], float, float] | None = None,
                query_out: torch.Tensor | None = None) -> torch.Tensor | None:
        """Logits [R, V] of `rows` after running the Q new tokens (input_ids, positions: [Q])
        over the past `pieces` and causally over themselves; their keys/values are written to
        new_keys/new_values ([L, H_kv, Q, D] views into the buffer). key_positions ([S], the
        pieces' keys in order; positions then increasing): each token sees only the past keys
        at positions <= its own (recomputed tokens); None: every past key. contexts: APE's
        (whether each piece is a context, temperature, scale; runtime/model/adapter.py,
        ParallelContexts). query_out: [L, heads, D], receives the last token's rotated query
        of every layer. None (nothing written) where pl_decoder does not apply."""
        new_readable = all(_readable(t, self.kv_heads, self.head_dim, (torch.float32,))
                           for t in (new_keys, new_values))
        if len(pieces) >= native.MAX_PIECES or not new_readable:
            return None
        prepared = self._prepare(input_ids, positions, pieces)
        if prepared is None:
            return None
        table, x, cos, sin = prepared
        native.decoder(x, self._shape, self.eps, self.scale, table, cos, sin, pieces, new_keys,
                       new_values, key_positions, None if key_positions is None else positions,
                       contexts=contexts, quantized=self._quantized(),
                       quantized_kind=self._blocks_kind, quantized_kinds=self._kinds_table,
                       query_out=query_out,
                       bf16_products=self.bf16_attention)
        return self._head(self.norm(x[rows]))

    def forward_batch(self, requests: list[BatchRequest]) -> list[torch.Tensor] | None:
        """One pass over several requests' new tokens: the linear layers read each weight
        once for all of them, and each token attends to its own request's past pieces and
        new tokens only (pl_decoder's requests: tasks of its own per request, so pieces
        several requests share are read in place by each). Returns each request's logits
        [R_i, V] for its `rows`, its new keys/values written as `forward` writes them; None
        (nothing written) where pl_decoder does not apply -- then run `forward` per request.
        Requests with APE's contexts must share one temperature and scale (pl_decoder takes
        one pair; the others' pieces are no contexts)."""
        if not requests or any(len(r.pieces) >= native.MAX_PIECES for r in requests):
            return None
        tempered = {r.contexts[1:] for r in requests if r.contexts is not None}
        if len(tempered) > 1:
            return None
        contexts = None
        if tempered:
            flags = []
            for r in requests:
                flags += r.contexts[0] if r.contexts is not None else [False] * len(r.pieces)
            contexts = (flags, *tempered.pop())
        pieces = [p for r in requests for p in r.pieces]
        q = sum(int(r.input_ids.shape[0]) for r in requests)
        prepared = self._prepare(torch.cat([r.input_ids for r in requests]),
                                 torch.cat([r.positions for r in requests]), pieces)
        if prepared is None:
            return None
        table, x, cos, sin = prepared
        spans = [(int(r.input_ids.shape[0]), len(r.pieces)) for r in requests]
        kpos = qpos = None
        if any(r.key_positions is not None for r in requests):
            known = []
            for r in requests:
                past = sum(p.keys.shape[2] for p in r.pieces)
                if r.key_positions is None:     # sees every past key: position 0 each
                    known.append(torch.zeros(past, dtype=torch.int64))
                elif r.key_positions.shape[0] != past:
                    raise InvalidArgumentError("key_positions must give every past key of the "
                                               "request")
                else:
                    known.append(r.key_positions.to(torch.int64))
            kpos = torch.cat(known)
            qpos = torch.cat([r.positions.to(torch.int64) for r in requests])
        layers = len(self.layers)
        heads = self.kv_heads
        d = self.head_dim
        new_keys = torch.empty(layers, heads, q, d)
        new_values = torch.empty(layers, heads, q, d)
        native.decoder(x, self._shape, self.eps, self.scale, table, cos, sin, pieces, new_keys,
                       new_values, kpos, qpos, requests=spans, contexts=contexts,
                       quantized=self._quantized(), quantized_kind=self._blocks_kind,
                       quantized_kinds=self._kinds_table, bf16_products=self.bf16_attention)
        rows = []
        at = 0
        for r, (n, _) in zip(requests, spans):
            r.new_keys.copy_(new_keys[:, :, at:at + n])
            r.new_values.copy_(new_values[:, :, at:at + n])
            rows.append(r.rows.to(torch.int64) + at)
            at += n
        logits = self._head(self.norm(x[torch.cat(rows)]))     # one LM head for the batch
        return list(logits.split([int(r.shape[0]) for r in rows]))

    def _prepare(self, input_ids: torch.Tensor, positions: torch.Tensor, pieces: list[Piece]):
        """(weight table, embedded x [Q, hidden], cos, sin [Q, D]) for a pass of pl_decoder,
        or None where it does not apply (switched off, hooks, too many tokens,
        pieces it cannot read, weights or rotary tables not in its layout)."""
        q = int(input_ids.shape[0])
        in_range = 0 < q <= MAX_TOKENS
        if not _switch or not in_range or not self.available() or self._hooked():
            return None
        readable = (_readable(t, self.kv_heads, self.head_dim, PIECE_DTYPES)
                    and p.keys.dtype == p.values.dtype for p in pieces for t in p)
        if not all(readable):
            return None
        table = self._weights()
        if table is None:
            return None
        x = self.embed(input_ids).contiguous()                         # [Q, hidden]
        if x.dtype != torch.float32:
            return None
        cos, sin = self.rotary(x[None], positions[None])               # [1, Q, D]
        cos = cos[0].float().contiguous()
        sin = sin[0].float().contiguous()
        if cos.shape != (q, self.head_dim):
            return None                   # partial rotary: not this kernel's layout
        return table, x, cos, sin

    def _weights(self) -> ctypes.Array | None:
        """The kernel's weight table ([layers][16] pointers), rebuilt and checked whenever a
        parameter was replaced; None when one no longer fits (not float32 on the CPU, not
        contiguous, another shape)."""
        tensors = [params.get(name) for params, name in self._slots]     # ~0.2 ms in all
        if self._dropped and self._quantized() is None and any(
                t is None for t, name in zip(tensors, _WEIGHTS * len(self.layers))
                if name.endswith("weight")):
            return None               # a weight kept as blocks only, and the blocks off
        ptrs = tuple(0 if t is None else t.data_ptr() for t in tensors)
        if self._table is not None and self._table[0] == ptrs:
            return self._table[1]
        fitting = (t is None or (t.dtype == torch.float32 and t.device.type == "cpu"
                                 and t.is_contiguous() and tuple(t.shape) == shape)
                   for t, shape in zip(tensors, self._shapes))
        if not all(fitting):
            return None
        table = (ctypes.c_void_p * len(ptrs))(*[p or None for p in ptrs])
        self._table = (ptrs, table)
        return table

    def attach_blocks(self, blocks, kind: int | None = 4,
                      checks: dict[str, bool] | None = None) -> int:
        """Serve linear weights from quantized blocks of `kind` instead of their float32
        copies, as a GGUF stores them:

        - `blocks`: {(layer index, parameter name as in _WEIGHTS, e.g. "mlp.up_proj.weight"):
          [n, row bytes] uint8}
        - kind 4: Q4_1, [n, k / 32 * 20], ~6.4x fewer bytes per pass
        - kind 8: Q8_0, [n, k / 32 * 34], ~3.8x fewer bytes per pass
        - the other kinds of native.KINDS (Q5_0 and the K-quants) likewise
        - kind None: each value is a (kind, blocks) pair, a GGUF's mix of types

        Each is checked to dequantize to the float weight the layer holds now, bit for bit
        (native.q_dequant), and one that does not stays float. `checks`: the outcomes of an
        earlier load of the same files by the same kernels ({"layer:name:kind": equal}),
        taken as they are, and given this call's comparisons (a converted copy's load
        record: runtime/model/load_record.py). A float weight replaced or changed in place
        later turns every quantized weight off. Returns how many weights are served
        quantized."""
        self._drop_blocks()
        entries = blocks.items() if kind is None else (
            (where, (kind, q)) for where, q in blocks.items())
        entries = list(entries)
        unknown = sorted({k for _, (k, _) in entries} - set(native.KINDS))
        if unknown:
            known = ", ".join(f"{number} ({name})" for number, (name, _, _) in
                              native.KINDS.items())
            raise InvalidArgumentError(f"block kind {unknown[0]!r} is not one the kernels "
                                       f"read ({known})")
        k_ok = all(n % 32 == 0 and n <= native.Q4_MAX_K
                   for n in (self.hidden, self.inter, self.heads * self.head_dim))
        if not k_ok or not native.enabled() or not native.available():
            return 0
        index = {name: i for i, name in enumerate(_WEIGHTS)}
        kinds = {}
        for (layer, name), (block_kind, q) in entries:
            if name not in index or not 0 <= layer < len(self.layers):
                continue
            slot = layer * len(_WEIGHTS) + index[name]
            params, key = self._slots[slot]
            weight = params.get(key)
            if weight is None or weight.dim() != 2 or weight.dtype != torch.float32:
                continue
            _, per_block, width = native.KINDS[block_kind]
            expected = (weight.shape[0], weight.shape[1] // per_block * width)
            if q.dtype != torch.uint8 or weight.shape[1] % per_block or tuple(q.shape) != expected:
                continue
            q = q.contiguous()
            if _equal_blocks(checks, f"{layer}:{name}:{block_kind}", q, weight, block_kind):
                self._blocks[slot] = q
                kinds[slot] = block_kind
        distinct = set(kinds.values())
        self._blocks_kind = next(iter(distinct)) if len(distinct) == 1 else 0
        if len(distinct) > 1:
            self._kinds_table = (ctypes.c_int * len(self._slots))(*[
                kinds.get(i, 0) for i in range(len(self._slots))])
        return self._attached()

    def _attached(self) -> int:
        if self._blocks:
            self._blocks_seen = self._blocks_state()
            self._blocks_table = (ctypes.c_void_p * len(self._slots))(*[
                self._blocks[i].data_ptr() if i in self._blocks else None
                for i in range(len(self._slots))])
        return len(self._blocks)

    def attach_int8(self) -> int:
        """Serve every linear weight of the decoder layers as int8 rows (kernels.c I8_KIND:
        each output row quantized with its own scale, built here from the float weights the
        layers hold now), their inputs quantized to 12 bits per token in each pass: integer
        products (AVX512_VNNI's, 32 an instruction, where the CPU has them; else AVX2's), for
        every pass however many rows. An approximation (docs/BENCHMARKS.md measures it), off
        unless asked for; replaces attached blocks. Returns how many weights are served (0,
        and the blocks stay, where the kernels cannot run or a width is not a multiple of
        64)."""
        k_ok = all(n % 64 == 0 and n <= native.Q4_MAX_K
                   for n in (self.hidden, self.inter, self.heads * self.head_dim))
        if not k_ok or not self.available() or not native.products_available("int8"):
            return 0
        self.restore_float_copies()            # int8 rows are made from the float weights
        self._drop_blocks()
        self._blocks_kind = 1
        for slot, (params, key) in enumerate(self._slots):
            weight = params.get(key)
            if (key == "weight" and weight is not None and weight.dim() == 2
                    and weight.dtype == torch.float32):
                self._blocks[slot] = int8_rows(weight.detach())
        return self._attached()

    def attach_q8_head(self, blocks: torch.Tensor, checks: dict[str, bool] | None = None
                       ) -> bool:
        """Serve the LM head from Q8_0 blocks ([vocab, hidden / 32 * 34] uint8: a GGUF's
        output or tied embedding, as stored) for up to Q_MAX_ROWS rows: ~3.8x fewer
        bytes than its float32 copy, the largest single read of a step. Checked to
        dequantize to the head's weight bit for bit (the logits then differ from torch's
        head by summation order only); False (float stays) otherwise. `checks`: as
        attach_blocks's."""
        self._q8_head = None
        weight = self.lm_head.weight
        head_fits = (self.lm_head.bias is None and weight.dtype == torch.float32
                     and self.hidden % 32 == 0 and self.hidden <= native.Q4_MAX_K)
        if not head_fits:
            return False
        expected = (weight.shape[0], self.hidden // 32 * native.Q8_BYTES)
        if blocks.dtype != torch.uint8 or tuple(blocks.shape) != expected or not self.available():
            return False
        blocks = blocks.contiguous()
        same = _equal_blocks(checks, "head:8", blocks, weight, 8)
        if same:
            self._q8_head = (blocks, (weight.data_ptr(), weight._version))
        return same

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        """The LM head's logits of h [R, hidden]: from its Q8_0 blocks for up to Q_MAX_ROWS rows
        while the float weight is unchanged, else the model's own."""
        head = self._q8_head
        limit = Q_MAX_ROWS if native.wide() else Q_MAX_ROWS_NARROW
        if head is not None and 0 < h.shape[0] <= limit and native.enabled():
            if type(self.lm_head) is not torch.nn.Linear:     # its blocks are its only copy
                return native.linear_q8(h, head[0])
            weight = self.lm_head.weight
            if (weight.data_ptr(), weight._version) == head[1]:
                return native.linear_q8(h, head[0])
            self._q8_head = None
        return self.lm_head(h)

    def _blocks_state(self) -> tuple:
        return tuple(None if t is None else (t.data_ptr(), t._version) for t in
                     (self._slots[i][0].get(self._slots[i][1]) for i in sorted(self._blocks)))

    def drop_float_copies(self) -> int:
        """Keep the linear weights served from blocks as blocks only: each such `nn.Linear`
        becomes a BlockLinear (fast/blocks.py; its weight made from the blocks when a pass
        the kernel does not run reads it), and pl_decoder reads the blocks for every pass,
        however many rows. Returns the float32 bytes let go (0: none served from blocks, or
        int8 rows, which are an approximation of the float weights)."""
        if self._blocks_kind == 1 or self._quantized() is None:
            return 0
        freed = sum(self._to_blocks(slot, blocks) for slot, blocks in self._blocks.items())
        freed += self._drop_head()
        self._dropped = True
        self._own_parameters()
        self._reslot()
        return freed

    def _to_blocks(self, slot: int, blocks: torch.Tensor) -> int:
        """The linear layer of `slot` replaced by a BlockLinear over `blocks`: the bytes let
        go (0 where it is not a plain nn.Linear)."""
        from promptlang.runtime.fast.blocks import BlockLinear

        parent, attr = self._owner(slot)
        linear = getattr(parent, attr)
        if type(linear) is not torch.nn.Linear:
            return 0
        kind = self._kinds_table[slot] if self._kinds_table is not None else self._blocks_kind
        setattr(parent, attr, BlockLinear(linear, kind, blocks))
        # a NativeLinear forward refers to its layer: that cycle broken, the layer and its
        # float copy go now, not when the collector next runs (one tensor left keeps its
        # whole file mapped, and what was read of it resident)
        linear.__dict__.pop("forward", None)
        return linear.weight.numel() * linear.weight.element_size()

    def _drop_head(self) -> int:
        """The LM head kept as its Q8_0 blocks only (and the token embedding, where the head
        is tied to it): the bytes let go."""
        from promptlang.runtime.fast.blocks import BlockEmbedding, BlockLinear

        if self._q8_head is None or type(self.lm_head) is not torch.nn.Linear:
            return 0
        blocks = self._q8_head[0]
        weight = self.lm_head.weight
        if (weight.data_ptr(), weight._version) != self._q8_head[1]:
            return 0
        freed = weight.numel() * weight.element_size()
        model, base = self._outer[0], self._outer[1]
        tied = type(self.embed) is torch.nn.Embedding and self.embed.weight is weight
        head = self.lm_head
        model.lm_head = BlockLinear(head, 8, blocks)
        self.lm_head = model.lm_head
        head.__dict__.pop("forward", None)        # its NativeLinear's cycle (_to_blocks)
        if tied:
            base.embed_tokens = BlockEmbedding(self.embed, blocks)
            self.embed = base.embed_tokens
        self._outer = [model, base, self.embed, self.rotary, self.norm, self.lm_head]
        return freed

    def _restore_head(self) -> None:
        from promptlang.runtime.fast.blocks import BlockEmbedding, BlockLinear

        model, base = self._outer[0], self._outer[1]
        if isinstance(self.lm_head, BlockLinear):
            model.lm_head = self.lm_head.to_linear()
            self.lm_head = model.lm_head
            if isinstance(self.embed, BlockEmbedding):
                embedding = torch.nn.Embedding(self.embed.num_embeddings,
                                               self.embed.embedding_dim,
                                               padding_idx=self.embed.padding_idx, device="meta")
                embedding.weight = self.lm_head.weight            # tied again
                base.embed_tokens = embedding
                self.embed = embedding
            weight = self.lm_head.weight
            self._q8_head = (self._q8_head[0], (weight.data_ptr(), weight._version))
        self._outer = [model, base, self.embed, self.rotary, self.norm, self.lm_head]

    def _own_parameters(self) -> None:
        """Copy the parameters left into memory of their own: the float copies came mapped
        from one file, which every tensor viewing it keeps mapped, and resident, whole."""
        head = self.lm_head.weight if type(self.lm_head) is torch.nn.Linear else None
        matched = (head is not None and self._q8_head is not None
                   and (head.data_ptr(), head._version) == self._q8_head[1])
        with torch.no_grad():
            for param in self._outer[0].parameters():
                param.data = param.data.clone()
        if matched:
            self._q8_head = (self._q8_head[0], (head.data_ptr(), head._version))
        self._table = None

    def restore_float_copies(self) -> None:
        """drop_float_copies undone: every BlockLinear an `nn.Linear` with its float32 weight
        (the blocks' values) again."""
        from promptlang.runtime.fast.blocks import BlockLinear

        if not self._dropped:
            return
        for slot in range(len(self._slots)):
            if _WEIGHTS[slot % len(_WEIGHTS)].endswith("proj.weight"):
                parent, attr = self._owner(slot)
                module = getattr(parent, attr, None)
                if isinstance(module, BlockLinear):
                    setattr(parent, attr, module.to_linear())
        self._restore_head()
        self._dropped = False
        self._reslot()

    @property
    def float_copies(self) -> bool:
        """Whether the linear weights served from blocks keep their float32 copies."""
        return not self._dropped

    def _owner(self, slot: int) -> tuple[torch.nn.Module, str]:
        """(the module holding the linear layer of weight slot `slot`, its attribute name)."""
        path = _WEIGHTS[slot % len(_WEIGHTS)].rsplit(".", 1)[0]       # "mlp.up_proj"
        parent, attr = path.rsplit(".", 1)
        return self.layers[slot // len(_WEIGHTS)].get_submodule(parent), attr

    def _reslot(self) -> None:
        """The slots and modules read again after linear layers were replaced."""
        self._slots = [_slot(layer, name) for layer in self.layers for name in _WEIGHTS]
        self._modules = [m for layer in self.layers for m in layer.modules()] + self._outer
        self._table = None
        if self._blocks_table is not None:
            self._blocks_seen = self._blocks_state()

    def _quantized(self) -> ctypes.Array | None:
        """The blocks' table for this pass, or None (none attached, or a float weight changed
        since: torch counts in-place writes in `_version`)."""
        if self._blocks_table is None:
            return None
        if self._blocks_state() != self._blocks_seen:
            self._drop_blocks()
            return None
        return self._blocks_table

    def _drop_blocks(self) -> None:
        """Serve every linear weight of the decoder layers from its float copy again."""
        self._blocks = {}
        self._blocks_seen = ()
        self._blocks_table = None
        self._kinds_table = None

    def _serving(self) -> _Serving:
        return _Serving(blocks=self._blocks, kind=self._blocks_kind, kinds=self._kinds_table,
                        seen=self._blocks_seen, table=self._blocks_table,
                        bf16_attention=self.bf16_attention)

    def _serve(self, serving: _Serving) -> None:
        self._blocks = serving.blocks
        self._blocks_kind = serving.kind
        self._kinds_table = serving.kinds
        self._blocks_seen = serving.seen
        self._blocks_table = serving.table
        self.bf16_attention = serving.bf16_attention

    @contextlib.contextmanager
    def quantized_off(self):
        """Inside: every pass reads the float weights (A/B measurements, checks): dropped
        float copies are made again for the while (their memory with them)."""
        dropped = self._dropped
        self.restore_float_copies()
        table = self._blocks_table
        head = self._q8_head
        self._blocks_table = None
        self._q8_head = None
        try:
            yield
        finally:
            self._blocks_table = table
            self._q8_head = head
            if dropped:
                self.drop_float_copies()

    @contextlib.contextmanager
    def approximated(self, int8_linears: bool = True, bf16_attention: bool = True):
        """Inside: the opt-in approximations on (where the CPU has them), then the weights
        and switches as before (side-by-side measurements: bench peers). KV computed inside
        is not the model's: keep it out of every store that outlives the block."""
        dropped = self._dropped and int8_linears      # int8 rows are made from float weights
        if dropped:
            self.restore_float_copies()
        saved = self._serving()
        try:
            if int8_linears:
                self.attach_int8()
            self.bf16_attention = self.bf16_attention or bf16_attention
            yield self
        finally:
            self._serve(saved)
            if dropped:
                self.drop_float_copies()

    @property
    def numerics(self) -> tuple:
        """(int8 linears on, bfloat16 attention products on): the switches that change a
        pass's numbers (Q4_1/Q8_0 blocks give the float weights' values: not among them)."""
        return bool(self._blocks) and self._blocks_kind == 1, bool(self.bf16_attention)

    @property
    def quantized_weights(self) -> int:
        """How many linear weights are served from blocks (or int8 rows) now."""
        return len(self._blocks) if self._quantized() is not None else 0

    def available(self) -> bool:
        """Whether the kernels can run now (the switches on, the library loaded)."""
        return native.enabled() and native.available()

    def _hooked(self) -> bool:
        """Hooks on any of the model's modules would be skipped by the kernel."""
        # torch keeps hooks in private dicts (global and per module); no public query exists
        if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
            return True
        return any(m._forward_hooks or m._forward_pre_hooks for m in self._modules)


def int8_rows(weight: torch.Tensor) -> torch.Tensor:
    """kernels.c's I8_KIND buffer of a [n, k] float32 weight (k even): q (each row round(w / s)
    with s = max|w| / 127 of the row, int8) -- the first n - n % 16 rows in panels of 16 with
    their k-pairs interleaved ([panels, k / 2, 16, 2]), the rest as rows -- then s ([n]
    float32), as one flat uint8 tensor. `int8_values` reads q back as [n, k]."""
    scale = weight.abs().amax(dim=1) / 127
    q = torch.round(weight / torch.where(scale > 0, scale, 1)[:, None]).clamp(-127, 127)
    q = q.to(torch.int8).view(torch.uint8)
    n, k = q.shape
    n16 = n - n % 16
    panels = q[:n16].reshape(n16 // 16, 16, k // 2, 2).permute(0, 2, 1, 3)
    return torch.cat([panels.reshape(-1), q[n16:].reshape(-1), scale.float().view(torch.uint8)])


def int8_values(buffer: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [n, k] int8, s [n] float32) of an `int8_rows` buffer."""
    n16 = n - n % 16
    panels = buffer[:n16 * k].view(torch.int8).reshape(n16 // 16, k // 2, 16, 2)
    rows = panels.permute(0, 2, 1, 3).reshape(n16, k)
    q = torch.cat([rows, buffer[n16 * k:n * k].view(torch.int8).reshape(n - n16, k)])
    return q, buffer[n * k:].view(torch.float32)


def _is_plain_layer(layer: torch.nn.Module, family: str) -> bool:
    attn = getattr(layer, "self_attn", None)
    mlp = getattr(layer, "mlp", None)
    names = {"": layer, "self_attn": attn, "mlp": mlp,
             "input_layernorm": getattr(layer, "input_layernorm", None),
             "post_attention_layernorm": getattr(layer, "post_attention_layernorm", None)}
    kinds = {"": "DecoderLayer", "self_attn": "Attention", "mlp": "MLP",
             "input_layernorm": "RMSNorm", "post_attention_layernorm": "RMSNorm"}
    if any(type(m).__name__ != f"{family}{kinds[n]}" for n, m in names.items()):
        return False
    linears = [getattr(attn, p, None) for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    linears += [getattr(mlp, p, None) for p in ("gate_proj", "up_proj", "down_proj")]
    extra = {n for n, _ in attn.named_children()} - {"q_proj", "k_proj", "v_proj", "o_proj"}
    return all(type(m) is torch.nn.Linear for m in linears) and not extra   # no q/k norms


def _slot(layer: torch.nn.Module, dotted: str) -> tuple[dict, str]:
    """(the parameter dict of the module that owns `dotted`, the parameter's name): read
    per pass, so that a replaced parameter is seen, without nn.Module's slow attribute path
    (`_parameters` is nn.Module's own private dict)."""
    path, name = dotted.rsplit(".", 1)
    module = layer
    for part in path.split("."):
        module = getattr(module, part)
    return module._parameters, name


def _readable(t: torch.Tensor, kv_heads: int, d: int, dtypes) -> bool:
    """[L, H_kv, n, D] in one of `dtypes` on the CPU, its rows of D contiguous."""
    return (t.dtype in dtypes and t.device.type == "cpu" and t.dim() == 4
            and t.shape[1] == kv_heads and t.shape[3] == d and t.stride(3) == 1
            and (t.shape[2] <= 1 or t.stride(2) == d))
