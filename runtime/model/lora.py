"""The seam adapter: a low-rank change to the attention projections of the tokens after
the last cached module, and optionally learned link tokens those tokens attend to.

Each decoder layer's q, k, v and o projections get `W x + (alpha / rank) * B (A x)`, with
A: [rank, in] and B: [out, rank]; B starts at zero, so an untrained adapter changes nothing.
The adapter is active only while `attached(model, adapter)` holds, and only on the tokens
that pass computes: a cached module's KV (encoded apart, by the base model) is never
touched, so the store stays shared and every exact path stays the base model's.

An adapter that encodes (`encodes`, Block-Attention's form) is also active while each
module is encoded apart: the modules' KV is then the adapter's, stored apart from the base
model's (its store keys name the adapter), and the tokens after them read that KV.

Link tokens (`link_tokens` T > 0): T learned keys and values per layer and KV head, placed
after the last cached module. They are constants, not tokens the model computes (prefix
tuning's form): each request's tokens after its last cached module, and its decode steps,
attend to them beside the modules. Their keys are learned before the rotary embedding and
rotated to the position just before the request's first such token (`link_kv`), so what
they add depends on the distance from there, not on how long the modules before were. The
keys start small and random and the values at zero: an untrained adapter with link tokens
only dilutes each attention row by T near-zero scores (it is not `none` exactly).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from promptlang.errors import AdapterFileError

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
FORMAT = "promptlang-seam-lora-1"
LINK_KEY_INIT = 0.02       # the link tokens' keys start as N(0, this^2): apart, near zero


@dataclass(frozen=True, kw_only=True)
class LoRAShape:
    """What an adapter was made for: the layers' projection sizes, rank and scale."""

    layers: int
    sizes: dict[str, tuple[int, int]]    # projection name -> (in_features, out_features)
    rank: int = 8
    alpha: float = 16.0
    link_tokens: int = 0                 # learned link tokens (0: none)
    kv_heads: int = 0                    # their shape: the model's KV heads and head size
    head_dim: int = 0
    encodes: bool = False                # also active while the modules are encoded

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def shape_of(model: torch.nn.Module, rank: int = 8, alpha: float = 16.0,
             link_tokens: int = 0, encodes: bool = False) -> LoRAShape:
    """The LoRA shape for a transformers causal LM with Llama-style attention projections."""
    layers = attention_layers(model)
    sizes = {}
    for name in TARGETS:
        linear = getattr(layers[0], name)
        sizes[name] = (linear.in_features, linear.out_features)
    config = model.config
    kv_heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    head_dim = sizes["k_proj"][1] // kv_heads
    return LoRAShape(layers=len(layers), sizes=sizes, rank=rank, alpha=alpha,
                     link_tokens=link_tokens, kv_heads=kv_heads, head_dim=head_dim,
                     encodes=encodes)


class SeamLoRA(torch.nn.Module):
    """The adapter's parameters: `a[layer][name]` [rank, in], `b[layer][name]` [out, rank]."""

    def __init__(self, shape: LoRAShape, *, seed: int = 0):
        super().__init__()
        if shape.encodes and shape.link_tokens:
            raise AdapterFileError("a seam adapter that encodes the modules takes no link "
                                   "tokens")
        self.shape = shape
        generator = torch.Generator().manual_seed(seed)
        self.a = torch.nn.ModuleList()
        self.b = torch.nn.ModuleList()
        for _ in range(shape.layers):
            a_layer = torch.nn.ParameterDict()
            b_layer = torch.nn.ParameterDict()
            for name in TARGETS:
                fan_in, fan_out = shape.sizes[name]
                bound = 1.0 / fan_in ** 0.5
                a = (torch.rand(shape.rank, fan_in, generator=generator) * 2 - 1) * bound
                a_layer[name] = torch.nn.Parameter(a)
                b_layer[name] = torch.nn.Parameter(torch.zeros(fan_out, shape.rank))
            self.a.append(a_layer)
            self.b.append(b_layer)
        self.link_keys: torch.nn.Parameter | None = None
        self.link_values: torch.nn.Parameter | None = None
        if shape.link_tokens:
            size = (shape.layers, shape.kv_heads, shape.link_tokens, shape.head_dim)
            keys = torch.randn(*size, generator=generator) * LINK_KEY_INIT
            self.link_keys = torch.nn.Parameter(keys)
            self.link_values = torch.nn.Parameter(torch.zeros(*size))

    def link_kv(self, model: torch.nn.Module, position: int, dtype: torch.dtype | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The link tokens' keys and values [L, H_kv, T, D] as the cache holds them: the keys
        rotated by `model`'s rotary embedding to `position` (the one just before the first
        token that attends to them). Gradients flow to the parameters."""
        if self.link_keys is None:
            raise AdapterFileError("this seam adapter has no link tokens")
        cos, sin = link_rotation(model, position, self.shape)
        keys = self.link_keys * cos + _rotate_half(self.link_keys) * sin
        values = self.link_values
        if dtype is not None:
            keys = keys.to(dtype)
            values = values.to(dtype)
        return keys, values

    def delta(self, layer: int, name: str, x: torch.Tensor) -> torch.Tensor:
        """The adapter's addition to projection `name` of `layer` for inputs x [..., in]."""
        a = self.a[layer][name]
        b = self.b[layer][name]
        return (x @ a.t().to(x.dtype)) @ b.t().to(x.dtype) * self.shape.scale

    def merged_weight(self, layer: int, name: str, weight: torch.Tensor) -> torch.Tensor:
        """W + scale * B A: the projection's weight with the adapter folded in."""
        a = self.a[layer][name].detach()
        b = self.b[layer][name].detach()
        return weight + (b @ a).to(weight.dtype) * self.shape.scale

    def save(self, path: Path, meta: dict[str, str]) -> None:
        """The adapter as one safetensors file; `meta` (str -> str) is stored beside."""
        from safetensors.torch import save

        from promptlang.home import write_private

        tensors = {}
        for layer in range(self.shape.layers):
            for name in TARGETS:
                tensors[f"{layer}.{name}.a"] = self.a[layer][name].detach().contiguous()
                tensors[f"{layer}.{name}.b"] = self.b[layer][name].detach().contiguous()
        if self.link_keys is not None:
            tensors["link.keys"] = self.link_keys.detach().contiguous()
            tensors["link.values"] = self.link_values.detach().contiguous()
        header = {"format": FORMAT, "shape": json.dumps(_shape_json(self.shape)), **meta}
        write_private(path, save(tensors, metadata=header))

    @classmethod
    def load(cls, path: Path) -> tuple["SeamLoRA", dict[str, str]]:
        """An adapter saved by `save`, and its metadata; AdapterFileError if it is not one."""
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                meta = dict(f.metadata() or {})
                if meta.get("format") != FORMAT:
                    raise AdapterFileError(f"{path}: not a promptlang seam adapter "
                                           f"(format {meta.get('format')!r})")
                shape = _shape_from_json(json.loads(meta["shape"]))
                adapter = cls(shape)
                with torch.no_grad():
                    for layer in range(shape.layers):
                        for name in TARGETS:
                            adapter.a[layer][name].copy_(f.get_tensor(f"{layer}.{name}.a"))
                            adapter.b[layer][name].copy_(f.get_tensor(f"{layer}.{name}.b"))
                    if adapter.link_keys is not None:
                        adapter.link_keys.copy_(f.get_tensor("link.keys"))
                        adapter.link_values.copy_(f.get_tensor("link.values"))
        except (OSError, KeyError, ValueError, RuntimeError, SafetensorError) as e:
            if isinstance(e, AdapterFileError):
                raise
            raise AdapterFileError(f"{path}: cannot read the seam adapter: {e}") from None
        return adapter, meta


@contextlib.contextmanager
def attached(model: torch.nn.Module, adapter: SeamLoRA) -> Iterator[None]:
    """While held, every forward of `model` adds the adapter to its attention projections
    (forward hooks on q/k/v/o: transformers' own layers, no forked model code)."""
    handles = []
    try:
        for index, name, linear in fitted_projections(model, adapter):
            handles.append(linear.register_forward_hook(_hook(adapter, index, name)))
        yield
    finally:
        for handle in handles:
            handle.remove()


def fitted_projections(model: torch.nn.Module, adapter: SeamLoRA, source: str = "the adapter"
                       ) -> list[tuple[int, str, torch.nn.Linear]]:
    """(layer, projection name, nn.Linear) of every projection the adapter changes;
    AdapterFileError (naming `source`) where the adapter was made for other shapes."""
    layers = attention_layers(model)
    if len(layers) != adapter.shape.layers:
        raise AdapterFileError(f"{source} has {adapter.shape.layers} layers; the model "
                               f"has {len(layers)}")
    found = []
    for index, attention in enumerate(layers):
        for name in TARGETS:
            linear = getattr(attention, name)
            size = (linear.in_features, linear.out_features)
            if size != adapter.shape.sizes[name]:
                raise AdapterFileError(f"{source}'s {name} is {adapter.shape.sizes[name]}; "
                                       f"the model's is {size}")
            found.append((index, name, linear))
    return found


def _hook(adapter: SeamLoRA, layer: int, name: str):
    def add_delta(module, inputs, output):
        return output + adapter.delta(layer, name, inputs[0])
    return add_delta


def attention_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Each decoder layer's attention module (Llama-style: q/k/v/o projections)."""
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None or not all(hasattr(getattr(layer, "self_attn", None), "q_proj")
                                 for layer in layers):
        raise AdapterFileError(f"{type(model).__name__}: the seam adapter needs Llama-style "
                               "attention (model.layers[i].self_attn.q_proj/k_proj/v_proj/"
                               "o_proj)")
    return [layer.self_attn for layer in layers]


def link_rotation(model: torch.nn.Module, position: int, shape: LoRAShape
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [T, D] of `model`'s rotary embedding at `position`, for the link tokens'
    keys; AdapterFileError where the model has no rotary embedding over whole heads."""
    inner = getattr(model, "model", model)
    rotary = getattr(inner, "rotary_emb", None)
    if rotary is None:
        raise AdapterFileError(f"{type(model).__name__}: link tokens need a model with a "
                               f"rotary position embedding (model.rotary_emb)")
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    ids = torch.full((1, shape.link_tokens), int(position), dtype=torch.int64, device=device)
    cos, sin = rotary(torch.zeros(1, dtype=dtype, device=device), ids)
    if cos.shape[-1] != shape.head_dim:
        raise AdapterFileError(f"{type(model).__name__}: its rotary embedding covers "
                               f"{cos.shape[-1]} of a head's {shape.head_dim} dimensions; "
                               f"link tokens need it over whole heads")
    return cos[0].float(), sin[0].float()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """The rotary embedding's pairing of dimensions (i, i + D/2), as transformers' Llama."""
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _shape_json(shape: LoRAShape) -> dict:
    return {"layers": shape.layers, "rank": shape.rank, "alpha": shape.alpha,
            "sizes": {name: list(size) for name, size in shape.sizes.items()},
            "link_tokens": shape.link_tokens, "kv_heads": shape.kv_heads,
            "head_dim": shape.head_dim, "encodes": shape.encodes}


def _shape_from_json(data: dict) -> LoRAShape:
    return LoRAShape(layers=int(data["layers"]), rank=int(data["rank"]),
                     alpha=float(data["alpha"]),
                     sizes={name: (int(s[0]), int(s[1])) for name, s in data["sizes"].items()},
                     link_tokens=int(data.get("link_tokens", 0)),
                     kv_heads=int(data.get("kv_heads", 0)),
                     head_dim=int(data.get("head_dim", 0)),
                     encodes=bool(data.get("encodes", False)))
