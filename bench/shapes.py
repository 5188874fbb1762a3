"""Model shapes: the handful of config numbers that KV size and FLOP counts depend on.

`PUBLISHED` holds the numbers from each model's released `config.json`;
`shape_from_config` reads them from any transformers config object, whatever
the architecture calls them (GPT-2's n_layer/n_head, Falcon's multi-query flag...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from promptlang.errors import UnsupportedModelError


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
    # The rest are the models of the Prompt Cache paper's Table 2 we had no row for
    # (memory.PAPER_TABLE2). Where the numbers were checked is said per row. Their
    # tied_embeddings follows transformers' default (the configs leave
    # tie_word_embeddings unset), not checked against the checkpoints: it changes the
    # parameter count by one vocab x hidden matrix, never KV bytes.
    # bert-base-uncased: 12 layers, hidden 768, 12 heads, MLP 3072, vocab 30522 (its
    # config.json, as duplicated from google-bert/bert-base-uncased on the Hub). An
    # encoder: it caches nothing in practice, but the paper lists it.
    ModelShape("BERT-base", 12, 768, 12, 12, 64, 3072, 30522, gated_mlp=False,
               tied_embeddings=True),
    # tiiuae/falcon-rw-1b: 24 layers, hidden 2048, 32 heads, num_kv_heads 32,
    # multi_query false (multi-head), vocab 50304 (config.json of the converted
    # checkpoint); MLP 4 x hidden, Falcon's default (ffn_hidden_size unset).
    ModelShape("Falcon-RW-1B", 24, 2048, 32, 32, 64, 4 * 2048, 50304, gated_mlp=False,
               tied_embeddings=True),
    # mosaicml/mpt-30b: d_model 7168, 64 heads, 48 layers, expansion_ratio 4,
    # vocab 50432, attn_type multihead_attention. Checked in mosaicml/mpt-30b-chat's
    # config.json (fine-tuned from mpt-30b, same shapes); the base repo's file not seen.
    ModelShape("MPT-30B", 48, 7168, 64, 64, 112, 4 * 7168, 50432, gated_mlp=False,
               tied_embeddings=True),
    # tiiuae/falcon-40b: hidden 8192, 128 heads, new_decoder_architecture with
    # num_kv_heads (n_head_kv) 8, 60 layers, vocab 65024. Checked in falcon-40b-instruct's
    # config.json (same shapes) and in a GGML loader's log of falcon-40b (n_ff 32768).
    ModelShape("Falcon-40B", 60, 8192, 128, 8, 64, 4 * 8192, 65024, gated_mlp=False,
               tied_embeddings=True),
    # tiiuae/falcon-180B: 80 layers, hidden 14848, 232 heads, 8 KV heads (new decoder
    # architecture), vocab 65024. The repository is gated: checked in the config that
    # NVIDIA TensorRT-LLM's benchmarking guide gives for tiiuae/falcon-180B, not in
    # tiiuae's config.json itself. MLP 4 x hidden is Falcon's default, NOT verified
    # (it changes parameter counts, not KV bytes).
    ModelShape("Falcon-180B", 80, 14848, 232, 8, 64, 4 * 14848, 65024, gated_mlp=False,
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
        raise UnsupportedModelError(f"{type(config).__name__} does not say its layers, hidden size "
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
