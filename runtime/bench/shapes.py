"""Model shapes: the handful of config numbers that KV size and FLOP counts depend on.

`PUBLISHED` holds the numbers from each model's released `config.json`;
`shape_from_config` reads them from any transformers config object, whatever
the architecture calls them (GPT-2's n_layer/n_head, Falcon's multi-query flag...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int          # heads of K and V as stored (GQA/MQA: fewer than `heads`)
    head_dim: int
    intermediate: int      # MLP inner width
    vocab: int
    gated_mlp: bool = True         # SwiGLU (gate, up, down) vs. a two-matrix MLP
    tied_embeddings: bool = False  # LM head shares the input embedding matrix

    def linear_params_per_layer(self) -> int:
        """Weights of one block's matmuls: Q, K, V, O projections and the MLP."""
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = (3 if self.gated_mlp else 2) * self.hidden * self.intermediate
        return attention + mlp

    def parameter_count(self) -> int:
        """Matmul weights plus embeddings; norms and biases (well under 1%) are left out."""
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.layers * self.linear_params_per_layer() + embeddings


# Numbers from each model's config.json on its Hugging Face model card.
PUBLISHED: dict[str, ModelShape] = {s.name: s for s in (
    ModelShape("SmolLM2-135M", 30, 576, 9, 3, 64, 1536, 49152, tied_embeddings=True),
    ModelShape("Qwen2.5-0.5B", 24, 896, 14, 2, 64, 4864, 151936, tied_embeddings=True),
    ModelShape("Llama-2-7B", 32, 4096, 32, 32, 128, 11008, 32000),
    ModelShape("Llama-2-13B", 40, 5120, 40, 40, 128, 13824, 32000),
    ModelShape("Llama-2-70B", 80, 8192, 64, 8, 128, 28672, 32000),
    ModelShape("Llama-3-8B", 32, 4096, 32, 8, 128, 14336, 128256),
    ModelShape("Mistral-7B", 32, 4096, 32, 8, 128, 14336, 32000),
    ModelShape("Falcon-7B", 32, 4544, 71, 1, 64, 4 * 4544, 65024, gated_mlp=False,
               tied_embeddings=True),
)}


_UNGATED_MLP = frozenset({"gpt2", "bloom", "falcon", "gpt_neox", "mpt", "opt", "phi", "gptj",
                          "gpt_bigcode", "starcoder2"})


def _first(config: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def shape_from_config(config: Any, name: str | None = None) -> ModelShape:
    """The shape of a transformers `PretrainedConfig` (or anything with its attributes).

    kv_heads: `num_key_value_heads`, else Falcon's rules (`num_kv_heads` with the new
    decoder architecture or without multi-query, 1 with multi-query), else one per
    attention head. head_dim: `head_dim`, else hidden / heads."""
    layers = _first(config, "num_hidden_layers", "n_layer", "n_layers", "num_layers")
    hidden = _first(config, "hidden_size", "n_embd", "d_model")
    heads = _first(config, "num_attention_heads", "n_head", "n_heads")
    if None in (layers, hidden, heads):
        raise ValueError(f"{type(config).__name__} does not say its layers, hidden size "
                         "and attention heads")
    kv_heads = getattr(config, "num_key_value_heads", None)
    if kv_heads is None and hasattr(config, "multi_query"):   # Falcon
        if getattr(config, "new_decoder_architecture", False) or not config.multi_query:
            kv_heads = _first(config, "num_kv_heads", default=heads)
        else:
            kv_heads = 1
    if kv_heads is None:
        kv_heads = heads
    head_dim = _first(config, "head_dim", default=hidden // heads)
    intermediate = _first(config, "intermediate_size", "n_inner", "ffn_hidden_size",
                          "ffn_dim", default=4 * hidden)
    # Llama-style configs (intermediate_size) gate their MLP, except these families
    gated = (hasattr(config, "intermediate_size")
             and getattr(config, "model_type", "") not in _UNGATED_MLP)
    return ModelShape(name or getattr(config, "name_or_path", "") or type(config).__name__,
                      int(layers), int(hidden), int(heads), int(kv_heads), int(head_dim),
                      int(intermediate), int(_first(config, "vocab_size", default=0)),
                      gated_mlp=gated,
                      tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)))
