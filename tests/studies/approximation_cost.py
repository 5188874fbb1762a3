"""Study (not a test): what the fused layers' opt-in approximations cost in answers --
`load(int8_linears=True)` (int8 weights x per-token int8 inputs) and
`load(bf16_attention=True)` (the attention's products from bfloat16 inputs) -- and what they
buy in pass time, on the default model.

    python tests/studies/approximation_cost.py --texts 24 --seed 3

Each text (the `bench accuracy` items' documents and question, generated here) runs through
the fused layers in passes of 64 new tokens over the KV of the passes before it -- how a
question or a recomputed run meets the cached past -- once with the model's own numbers
and once per approximation; at every position, the next-token distribution against the
exact one's as KL(exact || approximate) in nats (mean, 99th percentile) and how often the
top token is the same. The exact run is checked against transformers' own forward of the
whole text first. Then the pass time with no past at 1, 16, 25 and 64 rows (median of 7,
alone on the machine: run nothing else beside it).
"""

from __future__ import annotations

import argparse
import sys

import torch

from quantize_cost import pass_seconds, texts

MODES = {"exact": (False, False), "int8 linears": (True, False),
         "bf16 attention": (False, True), "both": (True, True)}
CHUNK = 64


def fused_log_probs(decoder, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] next-token log-probabilities, the text in passes of CHUNK tokens."""
    from promptlang.runtime.fast.pieces import Piece

    n, layers, heads, d = len(ids), len(decoder.layers), decoder.kv_heads, decoder.head_dim
    keys, values = torch.zeros(layers, heads, n, d), torch.zeros(layers, heads, n, d)
    out = []
    for at in range(0, n, CHUNK):
        end = min(at + CHUNK, n)
        past = [Piece(keys[:, :, :at], values[:, :, :at])] if at else []
        logits = decoder.forward(torch.tensor(ids[at:end]), torch.arange(at, end), past,
                                 keys[:, :, at:end], values[:, :, at:end],
                                 torch.arange(end - at))
        if logits is None:
            raise SystemExit("the fused layers did not take a pass: not this study's machine")
        out.append(torch.log_softmax(logits.float(), -1))
    return torch.cat(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=24)
    parser.add_argument("--seed", type=int, default=3)
    args = parser.parse_args(argv)

    from promptlang.runtime import engine

    llm = engine.load()
    decoder = llm.adapter.fast.decoder
    inputs = texts(llm.tokenizer, args.texts, args.seed)
    with torch.inference_mode():
        exact = [fused_log_probs(decoder, ids) for ids in inputs]
        own = torch.log_softmax(llm.adapter.model(torch.tensor([inputs[0]])).logits[0], -1)
    print({"texts": len(inputs), "tokens": sum(map(len, inputs)),
           "exact vs transformers' forward, largest log-prob difference":
           f"{(own - exact[0]).abs().max().item():.2e}"}, flush=True)
    for name, (int8, bf16) in MODES.items():
        with decoder.approximated(int8_linears=int8, bf16_attention=bf16), \
                torch.inference_mode():
            line = {"mode": name, "int8 weights": decoder.quantized_weights if int8 else 0}
            if name != "exact":
                got = [fused_log_probs(decoder, ids) for ids in inputs]
                kl = torch.cat([(a.exp() * (a - b)).sum(-1) for a, b in zip(exact, got)])
                same = torch.cat([a.argmax(-1) == b.argmax(-1) for a, b in zip(exact, got)])
                line.update({"positions": kl.numel(), "KL mean": f"{kl.mean().item():.2e}",
                             "KL p99": f"{kl.quantile(0.99).item():.2e}",
                             "same top token": f"{same.float().mean().item():.4f}"})
            for rows in (1, 16, 25, 64):
                line[f"pass {rows} rows ms"] = round(pass_seconds(decoder, rows) * 1e3, 1)
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
