"""Decode speed at the goal length: our decode loop against transformers' own `generate()`
on a stock copy of the model (its default attention), the two sides' runs interleaved.
"""

from __future__ import annotations

import gc
import time
import warnings
from typing import Callable, Sequence

import torch

from promptlang.bench.report import Progress
from promptlang.bench.latency.results import DECODE_QUESTION, DecodeComparison, LatencyOptions
from promptlang.bench.latency.sweep import _Case, _Stores, build_prompt, rotated


def _compare_decode(stores: _Stores, case: _Case, options: LatencyOptions,
                    model_source, bar: Progress) -> DecodeComparison | None:
    """Per-token decode time with the document cached, against a stock transformers
    model's `generate()` on the same tokens (greedy, its own prefill subtracted): the
    two sides' runs interleaved, `decode_samples` on each, the order alternating."""
    llm = stores.memory
    length = case.length
    prompt = build_prompt(case.schema.name, DECODE_QUESTION)
    n = options.decode_tokens
    generated = len(llm.generate(prompt, max_new_tokens=n).token_ids)   # untimed: warms
    if generated < 2:
        bar.write(f"latency: decode comparison skipped: the model stopped after "
                  f"{generated} token")
        bar.update(options.decode_samples)
        return None
    ids = llm.bind(prompt).token_ids()

    def ours() -> float:
        result = llm.generate(prompt, max_new_tokens=generated)
        return (result.timings.total - result.timings.first_token) / (generated - 1)

    with _StockModel(model_source, ids) as stock:
        hf_ttft = stock.ttft()
        mine = []
        theirs = []
        for i in range(options.decode_samples):
            for side in rotated(("ours", "transformers"), i):
                if side == "ours":
                    mine.append(ours())
                else:
                    theirs.append(stock.per_token(generated))
            bar.note(tokens=length, phase="decode, interleaved")
            bar.update()
        return DecodeComparison(len(ids), generated, mine, theirs, hf_ttft, stock.attention)


class _StockModel:
    """A freshly loaded, unadapted copy of the model and its own `generate()` on `ids`
    (greedy); a context manager that drops the model on exit."""

    def __init__(self, model_source, ids: Sequence[int]):
        from promptlang.runtime.model.loading import load_hf_model

        self.model, tokenizer = load_hf_model(model_source)
        pad = tokenizer.eos_ids[0] if tokenizer.eos_ids else 0
        self._generate = _quiet_generate(self.model, pad)
        self.prompt = torch.tensor([list(ids)], device=self.model.device)
        self._generate(self.prompt[:, :16], None, 2)        # untimed: first-call costs
        self._cache = self._context = None
        self.attention = str(self.model.config._attn_implementation)

    def __enter__(self) -> "_StockModel":
        return self

    def __exit__(self, *exc: object) -> None:
        del self.model, self._generate, self._cache
        gc.collect()

    def ttft(self) -> float:
        """generate(max_new_tokens=1) on the prompt; keeps its KV for `per_token`."""
        began = time.perf_counter()
        out = self._generate(self.prompt, None, 1)
        seconds = time.perf_counter() - began
        self._cache = out.cache           # the prompt's KV
        self._context = out.sequences
        return seconds

    def _timed(self, count: int) -> float:
        extra = self._cache.get_seq_length() - self.prompt.shape[1]
        if extra:
            self._cache.crop(-extra)         # back to the prompt only
        began = time.perf_counter()
        self._generate(self._context, self._cache, count)
        return time.perf_counter() - began

    def per_token(self, tokens: int) -> float:
        """Seconds per decoded token: generating k tokens after the prompt's first is k
        one-token forward passes, so (time of `tokens` - time of 1) / (tokens - 1)."""
        one = self._timed(1)
        return (self._timed(tokens) - one) / (tokens - 1)


def _quiet_generate(model, pad_token_id: int) -> Callable:
    """`generate(input_ids, cache, n)`: exactly n greedy tokens, warnings silenced."""
    from transformers.utils import logging as hf_logging

    @torch.inference_mode()
    def generate(input_ids: torch.Tensor, cache, n: int):
        level = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                kwargs = {} if cache is None else {"cache": cache}
                return model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                      max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                      pad_token_id=pad_token_id, return_dict_in_generate=True,
                                      **kwargs)
        finally:
            hf_logging.set_verbosity(level)

    return generate
