"""A tiny randomly initialised Llama for runtime tests (the mechanism is weight-independent)."""

from __future__ import annotations

import torch
import transformers


def tiny_llama(seed: int, vocab: int, *, layers: int = 2, kv_heads: int = 2,
               max_positions: int = 512, sharp: bool = True) -> torch.nn.Module:
    """`sharp`: weights drawn with std 0.1 instead of the default init, so attention is
    peaked and a wrong mask entry or position moves the outputs far above tolerances."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=layers, num_attention_heads=4,
                                      num_key_value_heads=kv_heads,
                                      max_position_embeddings=max_positions)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    if sharp:
        with torch.no_grad():
            for param in model.parameters():
                if param.dim() >= 2:
                    param.normal_(0.0, 0.1)
    return model
