"""The position schemes: one adapter per way a model takes positions, and `adapt`.

- rope (Llama family): position ids rotate queries and keys; nothing else. Their
  attention is model/attention.py (registered with transformers under ATTENTION): the
  common case -- every past key visible, the new tokens causal -- needs no mask at all,
  and grouped-query heads are never repeated.
- learned (GPT-2): position ids index the position embedding table.
- alibi (BLOOM): the model builds its biases from the cache index and takes no position
  ids, so a forward pre-hook on every attention module substitutes biases built from the
  real key positions (and our mask, since BLOOM builds its ALiBi from a 2-D mask and
  cannot take a 4-D one).

Which scheme a model_type has is the family registry's (model/families.py).
"""

from __future__ import annotations

import math

import torch

from promptlang.errors import ModelError
from promptlang.runtime.model.adapter import KVShape, ModelAdapter
from promptlang.runtime.model.attention import ATTENTION, attention, attention_mask
from promptlang.runtime.model.families import FAMILIES
from promptlang.runtime.model.internals import (FLASH_WITH_LSE, attention_implementation,
                                                use_attention)


class RopeAdapter(ModelAdapter):
    scheme = "rope"

    def __init__(self, hf_model, fingerprint: str | None = None):
        super().__init__(hf_model, fingerprint)
        if attention_implementation(self.config) in ("sdpa", ATTENTION):
            use_attention(hf_model, ATTENTION, attention, attention_mask)

    def unmasked_in_one_pass(self, past: int) -> bool:
        return attention_implementation(self.config) == ATTENTION and (past == 0 or self._splits)

    @property
    def reads_shared(self) -> bool:
        return attention_implementation(self.config) == ATTENTION and self._splits

    @property
    def attends_in_parallel(self) -> bool:
        return attention_implementation(self.config) == ATTENTION

    @property
    def _splits(self) -> bool:        # pieces of keys attended apart, merged (CPU only)
        return self.device.type == "cpu" and FLASH_WITH_LSE is not None

    def _run(self, input_ids, positions, key_positions, mask, cache, rows, shared=(),
             contexts=None, model=None):
        if attention_implementation(self.config) != ATTENTION:
            return super()._run(input_ids, positions, key_positions, mask, cache, rows,
                                model=model)
        extra = {"promptlang_shared": shared} if shared else {}
        sink = self.state.query_sink
        if sink is not None:
            extra["promptlang_query"] = sink
        if contexts is not None:            # every key slot: the past's flags, new keys not
            flags = torch.zeros(key_positions.shape[0], dtype=torch.bool, device=self.device)
            n = min(int(contexts.context.shape[0]), int(flags.shape[0]))
            flags[:n] = contexts.context[:n]
            extra["promptlang_contexts"] = contexts._replace(context=flags)
        # the memo and the fast attention mark a call as the runtime's own (model/attention.py)
        return (self.model if model is None else model)(input_ids=input_ids, position_ids=positions[None],
                                     attention_mask=mask, cache=cache, use_cache=True,
                                     logits_to_keep=rows, promptlang_masks={},
                                     promptlang_attend=self.fast.attention, **extra)


class LearnedPositionAdapter(ModelAdapter):
    scheme = "learned"

    @property
    def max_positions(self) -> int | None:
        return getattr(self.config, "n_positions", None) or super().max_positions

    def _kv_shape(self) -> KVShape:
        c = self.config
        return KVShape(c.n_layer, c.n_head, c.n_embd // c.n_head, c.n_embd // c.n_head)


class AlibiAdapter(ModelAdapter):
    """BLOOM: biases from real key positions, substituted by a pre-hook on each attention."""

    scheme = "alibi"

    def __init__(self, hf_model, fingerprint: str | None = None):
        super().__init__(hf_model, fingerprint)
        self._slopes = _alibi_slopes(self.config.n_head).to(self.device)   # [H]
        with self.lock:
            if not self.state.hooked:    # once per model, however many adapters wrap it
                for block in hf_model.transformer.h:
                    block.self_attention.register_forward_pre_hook(self.state.substitute,
                                                                   with_kwargs=True)
                self.state.hooked = True

    @property
    def max_positions(self) -> int | None:
        return None     # ALiBi has no position table

    def _kv_shape(self) -> KVShape:
        c = self.config
        return KVShape(c.n_layer, c.n_head, c.hidden_size // c.n_head, c.hidden_size // c.n_head)

    def _run(self, input_ids, positions, key_positions, mask, cache, rows, shared=(),
             contexts=None, model=None):
        # model: always None here (bfloat16 compute serves RoPE models only)
        # softmax is shift-invariant per row, so slope * key_position equals -slope * distance
        bias = self._slopes[:, None, None] * key_positions.to(torch.float32)   # [H, 1, K]
        self.state.alibi = bias.to(self.dtype)
        self.state.mask = mask
        try:
            return self.model(input_ids=input_ids, attention_mask=None, cache=cache,
                              use_cache=True, logits_to_keep=rows)
        finally:
            self.state.alibi = self.state.mask = None


def _alibi_slopes(heads: int) -> torch.Tensor:
    """ALiBi's geometric slopes (a head count that is no power of two adds a second series)."""
    closest = 2 ** math.floor(math.log2(heads))
    base = 2 ** (-(2 ** -(math.log2(closest) - 3)))
    slopes = [base ** (i + 1) for i in range(closest)]
    if closest != heads:
        extra = 2 ** (-(2 ** -(math.log2(2 * closest) - 3)))
        slopes += [extra ** (2 * i + 1) for i in range(min(closest, heads - closest))]
    return torch.tensor(slopes, dtype=torch.float32)


_ADAPTERS = {"rope": RopeAdapter, "learned": LearnedPositionAdapter, "alibi": AlibiAdapter}


def adapt(hf_model: torch.nn.Module, fingerprint: str | None = None) -> ModelAdapter:
    """The adapter for `hf_model`'s position scheme; ModelError if it has none.
    `fingerprint`: the model's, where known already (ModelAdapter)."""
    model_type = getattr(getattr(hf_model, "config", None), "model_type", None)
    family = FAMILIES.get(model_type)
    if family is None:
        raise ModelError(f"unsupported architecture: {model_type} "
                         f"(supported: {', '.join(FAMILIES)})")
    return _ADAPTERS[family.scheme](hf_model, fingerprint)
