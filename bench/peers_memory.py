"""`bench peers`' load and memory measurement, in a process of its own (run by bench/peers.py):

    python -m promptlang.bench.peers_memory MODEL DOC_TOKENS

prints one JSON line: {"load_s": the `load` call's seconds (a new process, the model's
conversion made earlier), "rss_bytes": this process's resident memory after one request whose
~DOC_TOKENS-token document is a cached module, then a question, "kv_bytes": the KV the store
holds then, "libraries_bytes": the resident memory before the load, the libraries imported
(torch, transformers, promptlang)}. MODEL "-" is the default model.
"""

from __future__ import annotations

import json
import sys
import time

from promptlang.bench.peers_llama import resident_bytes


def measure(model: str | None, doc_tokens: int) -> dict:
    from promptlang.bench.latency.sweep import build_prompt, build_schema, document
    from promptlang.runtime import engine

    libraries = resident_bytes()
    began = time.perf_counter()
    llm = engine.load(model, disk_budget_bytes=0)        # memory only: this run's KV alone
    load_s = time.perf_counter() - began
    text, item = document(llm.tokenizer, doc_tokens, seed=20)
    schema = build_schema("peers-memory", text)
    llm.add_schema(schema)
    llm.generate(build_prompt("peers-memory", item.question), max_new_tokens=2)
    stats = llm.store.stats
    kv = stats.device_bytes + stats.host_bytes
    return {"load_s": load_s, "rss_bytes": resident_bytes(), "kv_bytes": kv,
            "libraries_bytes": libraries}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    model = None if argv[0] == "-" else argv[0]
    sys.stdout.write(json.dumps(measure(model, int(argv[1]))) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
