"""A linear layer whose weight is kept only as a GGUF's quantized blocks.

Where the fused decoder serves a linear weight from its blocks (fast/fused.py
`attach_blocks`), its float32 copy is read only by the passes the fused decoder does not run
(more new tokens than it takes, hooks, the kernels switched off): `BlockLinear` stands in for
the `nn.Linear` there, and its `weight` is made from the blocks when a pass reads it (the same
float32 values, bit for bit: native.q_dequant), so the copy no longer stays in memory (~4 to
7x the blocks' bytes). `FusedDecoder.drop_float_copies` puts them in; `restore_float_copies`
takes them out again.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

import promptlang.runtime.fast.native as native
from promptlang.runtime.fast.linear import MAX_ROWS


class BlockLinear(torch.nn.Module):
    """y = x . W^T + b with W made from `blocks` (a kind of native.KINDS) at each call."""

    def __init__(self, linear: torch.nn.Linear, kind: int, blocks: torch.Tensor):
        super().__init__()
        # the adapter's state where the layer took pl_linear in its passes (fast/linear.py
        # NativeLinear): then those passes read the blocks by the same tiles (a weak
        # reference: a copy of the model, e.g. a bfloat16 twin, shares it)
        native_forward = linear.__dict__.get("forward")
        state = getattr(native_forward, "state", None)
        self._state = None if state is None else weakref.ref(state)
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.kind = kind
        self.register_buffer("blocks", blocks, persistent=False)
        self.bias = linear.bias                 # a Parameter, or None
        # no weight parameter, but its slot: code that swaps a layer's weight for a while
        # (the seam adapter's merged weights: runtime/model/seam.py) puts one there
        self._parameters["weight"] = None

    @property
    def weight(self) -> torch.Tensor:
        """W [out, in] float32: a weight swapped in, else made now from the blocks (not a
        parameter: nothing keeps it)."""
        swapped = self._parameters["weight"]
        if swapped is not None:
            return swapped
        return native.q_dequant(self.blocks, self.in_features, kind=self.kind)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        """The state dict an `nn.Linear` has: its weight made from the blocks (a copy of the
        model loads it as its own)."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """A weight swapped in (the seam adapter's merged weight): F.linear over it. Else,
        inside the runtime's passes, up to fast/linear.py's MAX_ROWS rows: pl_linear's tiles
        over the blocks (what NativeLinear gave over the float copy); else F.linear over the
        weight made from the blocks (what nn.Linear gave)."""
        bias = self.bias
        swapped = self._parameters["weight"]
        if swapped is not None:             # a weight swapped in for a while: the pass reads it
            return F.linear(x, swapped.to(x.dtype), None if bias is None else bias.to(x.dtype))
        state = self._state() if self._state is not None else None
        if (state is not None and state.in_runtime_pass and native.enabled()
                and native.available() and native.input_fits(x, self.in_features, MAX_ROWS)):
            y = native.linear_q(x.reshape(-1, self.in_features), self.blocks, self.kind)
            y = y.reshape(*x.shape[:-1], self.out_features)
            return y if bias is None else y + bias
        return F.linear(x, self.weight.to(x.dtype), None if bias is None else bias.to(x.dtype))

    def to_linear(self) -> torch.nn.Linear:
        """The plain `nn.Linear` again, its weight the float32 values of the blocks."""
        linear = torch.nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                                 device="meta")
        linear.weight = torch.nn.Parameter(self.weight, requires_grad=False)
        if self.bias is not None:
            linear.bias = self.bias
        return linear

    def extra_repr(self) -> str:
        name = native.KINDS[self.kind][0]
        return f"in_features={self.in_features}, out_features={self.out_features}, {name} blocks"


class BlockEmbedding(torch.nn.Module):
    """An embedding table kept as Q8_0 blocks (a GGUF's token embedding, which a tied LM head
    shares): each lookup makes the rows it reads (the same float32 values, bit for bit)."""

    def __init__(self, embedding: torch.nn.Embedding, blocks: torch.Tensor):
        super().__init__()
        self.num_embeddings = embedding.num_embeddings
        self.embedding_dim = embedding.embedding_dim
        self.padding_idx = embedding.padding_idx
        self.register_buffer("blocks", blocks, persistent=False)
        # follows `.to(dtype)` (a bfloat16 twin: runtime/model/compute.py): the rows' dtype
        self.register_buffer("dtype_of_rows", torch.zeros(()), persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        """The whole table [vocab, hidden] float32, made now from the blocks."""
        return native.q_dequant(self.blocks, self.embedding_dim, kind=8)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        """The state dict an `nn.Embedding` has: its table made from the blocks."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = self.weight.to(self.dtype_of_rows.dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        flat = input_ids.reshape(-1).to(torch.int64)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"token id out of range for an embedding of "
                             f"{self.num_embeddings} rows")
        rows = native.q_dequant(self.blocks.index_select(0, flat).contiguous(),
                                self.embedding_dim, kind=8)
        return rows.reshape(*input_ids.shape, self.embedding_dim).to(self.dtype_of_rows.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, Q8_0 blocks"
