"""A tiny randomly initialised Llama for runtime tests (the mechanism is weight-independent)."""

from __future__ import annotations

import torch
import transformers

from promptlang.tokenizer import WordTokenizer


class Words(WordTokenizer):
    """The word tokenizer, decoding ids it has not encoded as ` w<id>` (a random model
    generates any id), so that every generated token has text of its own."""

    def decode(self, ids):
        return "".join(self._text_of.get(int(i), f" w{int(i)}") for i in ids)


def count_passes(llm) -> list[int]:
    """From now on, the token count of every forward pass of `llm`'s model, in order."""
    seen: list[int] = []
    forward = llm.adapter.forward

    def counting(input_ids, *args, **kwargs):
        seen.append(int(input_ids.shape[0]))
        return forward(input_ids, *args, **kwargs)

    llm.adapter.forward = counting
    return seen


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


def tiny_model(kind: str, vocab: int = 1000) -> torch.nn.Module:
    """A tiny randomly initialised model of a supported `model_type` (model/families.py), with
    sharp weights as in `tiny_llama`."""
    torch.manual_seed(1234)
    common = dict(vocab_size=vocab, hidden_size=64, num_attention_heads=4)
    rope = dict(common, intermediate_size=128, num_hidden_layers=2, num_key_value_heads=2,
                max_position_embeddings=512)
    configs = {
        "llama": lambda: transformers.LlamaConfig(**rope),
        "mistral": lambda: transformers.MistralConfig(**rope, sliding_window=None),
        "qwen2": lambda: transformers.Qwen2Config(**rope),
        "qwen3": lambda: transformers.Qwen3Config(**rope, head_dim=16),
        "gemma": lambda: transformers.GemmaConfig(**rope, head_dim=16),
        "phi3": lambda: transformers.Phi3Config(**rope, pad_token_id=0),
        "olmo2": lambda: transformers.Olmo2Config(**rope),
        "granite": lambda: transformers.GraniteConfig(**rope),
        "gpt2": lambda: transformers.GPT2Config(vocab_size=vocab, n_embd=64, n_layer=2, n_head=4,
                                                n_positions=512, bos_token_id=1, eos_token_id=2),
        "bloom": lambda: transformers.BloomConfig(vocab_size=vocab, hidden_size=64, n_layer=2,
                                                  n_head=4),
    }
    model = transformers.AutoModelForCausalLM.from_config(configs[kind]())
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.1)
    return model.eval()
