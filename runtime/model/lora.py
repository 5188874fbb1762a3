"""The seam adapter: a low-rank change to the attention projections of the tokens after
the last cached module.

Each decoder layer's q, k, v and o projections get `W x + (alpha / rank) * B (A x)`, with
A: [rank, in] and B: [out, rank]; B starts at zero, so an untrained adapter changes nothing.
The adapter is active only while `attached(model, adapter)` holds, and only on the tokens
that pass computes: a cached module's KV (encoded apart, by the base model) is never
touched, so the store stays shared and every exact path stays the base model's.
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


@dataclass(frozen=True, kw_only=True)
class LoRAShape:
    """What an adapter was made for: the layers' projection sizes, rank and scale."""

    layers: int
    sizes: dict[str, tuple[int, int]]    # projection name -> (in_features, out_features)
    rank: int = 8
    alpha: float = 16.0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def shape_of(model: torch.nn.Module, rank: int = 8, alpha: float = 16.0) -> LoRAShape:
    """The LoRA shape for a transformers causal LM with Llama-style attention projections."""
    layers = attention_layers(model)
    sizes = {}
    for name in TARGETS:
        linear = getattr(layers[0], name)
        sizes[name] = (linear.in_features, linear.out_features)
    return LoRAShape(layers=len(layers), sizes=sizes, rank=rank, alpha=alpha)


class SeamLoRA(torch.nn.Module):
    """The adapter's parameters: `a[layer][name]` [rank, in], `b[layer][name]` [out, rank]."""

    def __init__(self, shape: LoRAShape, *, seed: int = 0):
        super().__init__()
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


def _shape_json(shape: LoRAShape) -> dict:
    return {"layers": shape.layers, "rank": shape.rank, "alpha": shape.alpha,
            "sizes": {name: list(size) for name, size in shape.sizes.items()}}


def _shape_from_json(data: dict) -> LoRAShape:
    return LoRAShape(layers=int(data["layers"]), rank=int(data["rank"]),
                     alpha=float(data["alpha"]),
                     sizes={name: (int(s[0]), int(s[1])) for name, s in data["sizes"].items()})
