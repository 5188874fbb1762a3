"""The registry of supported model families: how positions enter each, which fast paths it takes.

A family is a transformers `model_type`. Adding one is one entry here, plus its tiny config
in tests/runtime/tiny.py (every entry is exercised by tests/runtime/test_oracle.py):

- scheme: how the model takes positions, and so which adapter drives it
  (runtime/model/schemes.py): "rope" (rotary, from position ids), "learned" (a position
  embedding table), "alibi" (biases from key positions).
- decoder: the class-name prefix of a model whose every decoder layer pl_decoder can run
  (runtime/fast/fused.py checks the modules against it), or None.

Every family takes pl_linear for small linear layers; RoPE families take pl_attend inside
their attention (runtime/fast/).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    scheme: str                  # "rope" | "learned" | "alibi"
    decoder: str | None = None   # e.g. "Llama": LlamaForCausalLM, LlamaDecoderLayer, ...

    @property
    def native_attention(self) -> bool:
        """pl_attend runs inside runtime/model/attention.py, the RoPE models' attention."""
        return self.scheme == "rope"


FAMILIES: dict[str, Family] = {
    "llama": Family("rope", decoder="Llama"),
    "mistral": Family("rope", decoder="Mistral"),
    "qwen2": Family("rope", decoder="Qwen2"),
    "qwen3": Family("rope"),       # q/k norms: not pl_decoder's layer
    "phi3": Family("rope"),        # fused q/k/v and gate/up projections
    "gemma": Family("rope"),       # GELU MLP, scaled embeddings
    "olmo2": Family("rope"),       # norms after attention and MLP
    "granite": Family("rope"),     # scaled residuals and logits
    "gpt2": Family("learned"),
    "bloom": Family("alibi"),
}

# model_type -> position scheme (read by tests and the benchmarks)
SCHEMES: dict[str, str] = {model_type: f.scheme for model_type, f in FAMILIES.items()}
