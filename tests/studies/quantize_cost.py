"""Study (not a test): what weight-only quantization (`load(path, quantize=...)`) costs in
answers and buys in speed, on the default model's float copy.

    python tests/studies/quantize_cost.py --texts 24 --seed 3

The float checkpoint is the default model's converted folder (float32 safetensors). Its
weights are the GGUF's Q4_1 values already, so `q4_1` reproduces them bit for bit (the
study checks: same fingerprint, KL 0) and is the GGUF's own speed; `q8_0` re-quantizes
them. Per scheme: the next-token distribution at every position of `--texts` texts (the
`bench accuracy` items' documents and question, generated here) against the float model's,
as KL(float || quantized) in nats (mean, and the 99th percentile over positions) and how
often the top token is the same, each text one plain forward of transformers' model; then
the fused decoder's pass time with no past at 1, 16 and 64 rows (median of 7, alone on the
machine: run nothing else beside it).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

import torch


def pass_seconds(decoder, rows: int, repeats: int = 7) -> float:
    layers, heads, d = len(decoder.layers), decoder.kv_heads, decoder.head_dim
    ids = torch.randint(100, 30000, (rows,), generator=torch.Generator().manual_seed(rows))
    positions = torch.arange(rows)
    keys, values = torch.zeros(layers, heads, rows, d), torch.zeros(layers, heads, rows, d)
    last = torch.tensor([rows - 1])
    decoder.forward(ids, positions, [], keys, values, last)
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        decoder.forward(ids, positions, [], keys, values, last)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def texts(tokenizer, count: int, seed: int) -> list[list[int]]:
    from promptlang.bench import qa

    kinds = ("single", "cross", "dependent", "needle", "same-shape")
    out = []
    for i in range(count):
        item = qa.generate(1, seed=seed + i, kind=kinds[i % len(kinds)])[0]
        text = "\n\n".join(doc.text for doc in item.documents) + "\n\n" + item.question
        out.append(tokenizer.encode(text))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=24)
    parser.add_argument("--seed", type=int, default=3)
    args = parser.parse_args(argv)

    from promptlang import default_model
    from promptlang.runtime import engine

    folder = str(default_model.default_converted_dir())
    engine.load()                                   # makes the float copy if needed
    reference, logits = None, []
    for scheme in (None, "q8_0", "q4_1"):
        llm = engine.load(folder, quantize=scheme)
        model, decoder = llm.adapter.model, llm.adapter.fast.decoder
        if reference is None:
            reference = llm.adapter.fingerprint
            inputs = texts(llm.tokenizer, args.texts, args.seed)
        with torch.inference_mode():
            got = [torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
                   for ids in inputs]
        line = {"scheme": scheme or "float", "weights served as blocks":
                decoder.quantized_weights, "same fingerprint as float":
                llm.adapter.fingerprint == reference}
        if scheme is None:
            logits = got
        else:
            kl = torch.cat([(a.exp() * (a - b)).sum(-1) for a, b in zip(logits, got)])
            same = torch.cat([a.argmax(-1) == b.argmax(-1) for a, b in zip(logits, got)])
            line.update({"positions": kl.numel(), "KL mean": f"{kl.mean().item():.2e}",
                         "KL p99": f"{kl.quantile(0.99).item():.2e}",
                         "same top token": f"{same.float().mean().item():.4f}"})
        for rows in (1, 16, 64):
            line[f"pass {rows} rows ms"] = round(pass_seconds(decoder, rows) * 1e3, 1)
        print(line, flush=True)
        del llm, model, decoder
        gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
