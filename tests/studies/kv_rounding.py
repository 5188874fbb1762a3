"""Study (not a test): what a 16-bit KV store costs in answers.

    python tests/studies/kv_rounding.py --texts 12 --seed 31

Texts of the `bench accuracy` kinds (quantize_cost.texts, up to 1,200 tokens each): the
default model encodes each text but its last 64 tokens, the past's keys and values are
rounded to float16 or bfloat16 (what a 16-bit store holds), and the last 64 tokens are
computed over that past; the next-token distributions' KL divergence from the float32
past's, and how often the top token is the same. docs/BENCHMARKS.md has a run.
"""

from __future__ import annotations

import argparse
import sys

import torch

from quantize_cost import texts

TAIL = 64          # tokens computed over the rounded past
MAX_TOKENS = 1200


@torch.inference_mode()
def tail_log_probs(adapter, ids: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """[TAIL, vocab] log-probabilities of the last TAIL tokens over the rest's KV, rounded
    to `dtype` (None: as computed)."""
    from promptlang.runtime.model import Past

    split = len(ids) - TAIL
    keys, values = adapter.empty_kv(len(ids))
    adapter.forward(ids[:split], torch.arange(split), Past(keys, values, torch.arange(0)), None)
    if dtype is not None:
        keys[:, :, :split] = keys[:, :, :split].to(dtype).float()
        values[:, :, :split] = values[:, :, :split].to(dtype).float()
    step = adapter.forward(ids[split:], torch.arange(split, len(ids)),
                           Past(keys, values, torch.arange(split)), None, torch.arange(TAIL))
    return torch.log_softmax(step.logits.double(), -1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=12)
    parser.add_argument("--seed", type=int, default=31)
    args = parser.parse_args(argv)

    from promptlang.runtime import engine

    llm = engine.load()
    inputs = [torch.tensor(ids[:MAX_TOKENS]) for ids in texts(llm.tokenizer, args.texts,
                                                              args.seed)]
    exact = [tail_log_probs(llm.adapter, ids, None) for ids in inputs]
    for dtype in (torch.float16, torch.bfloat16):
        got = [tail_log_probs(llm.adapter, ids, dtype) for ids in inputs]
        kl = torch.cat([(a.exp() * (a - b)).sum(-1) for a, b in zip(exact, got)])
        same = torch.cat([a.argmax(-1) == b.argmax(-1) for a, b in zip(exact, got)])
        print({"store": str(dtype), "positions": kl.numel(), "KL mean": f"{kl.mean():.2e}",
               "same top token": f"{int(same.sum())} of {same.numel()}"}, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
