"""Study (not a test): a GGUF served from its blocks against its float32 copies, each in a
process of its own.

    python tests/studies/blocks_or_floats.py MODEL.gguf [--tokens 64] [--rounds 3]

Each round starts one process per setting (`load(path)`: the blocks as the file stores them;
`load(path, quantized=False)`: every weight a float32 copy), in turn: it loads the model
(converted earlier, else the first load converts it), answers one short prompt greedily
(warm-up), then the same prompt with --tokens new tokens, timed, and reports its resident
memory then (the peak: ru_maxrss) and the answer's token ids. The medians per setting, and
whether both answered with the same tokens, are printed; nothing is written.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = r"""
import json, resource, sys, time
from promptlang.runtime import engine
path, quantized, tokens = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3])
llm = engine.load(path, recompute="none", quantized=quantized)
schema = '<schema name="s"><system>You are a helpful assistant.</system></schema>'
prompt = '<prompt schema="s"><user>Write a long story about a cat.</user><assistant></prompt>'
llm.generate(prompt, schema=schema, max_new_tokens=4)
start = time.perf_counter()
out = llm.generate(prompt, schema=schema, max_new_tokens=tokens)
seconds = time.perf_counter() - start
print(json.dumps({"s_per_token": seconds / len(out.token_ids), "ids": list(out.token_ids),
                  "weights_from_blocks": llm.adapter.fast.decoder.quantized_weights,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""

SETTINGS = {"blocks": "1", "float32 copies": "0"}


def one(path: str, quantized: str, tokens: int) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, path, quantized, str(tokens)],
                          capture_output=True, text=True, check=True, timeout=1800)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    for _ in range(args.rounds):
        for name, quantized in SETTINGS.items():
            runs[name].append(one(args.model, quantized, args.tokens))
    for name, results in runs.items():
        ms = statistics.median(r["s_per_token"] for r in results) * 1e3
        rss = statistics.median(r["peak_rss_mb"] for r in results)
        print(f"{name}: {results[0]['weights_from_blocks']} linear weights from blocks; "
              f"{ms:.1f} ms a token (prefill included, median of {len(results)}); "
              f"peak resident {rss:,.0f} MB")
    same = runs["blocks"][0]["ids"] == runs["float32 copies"][0]["ids"]
    print(f"the same {args.tokens} answer tokens from both: {same}")


if __name__ == "__main__":
    main()
