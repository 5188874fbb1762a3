"""llama.cpp's side of `promptlang bench peers`, run in a process of its own (no torch here).

    python -m promptlang.bench.peers_llama      (one JSON object a line, both ways)

The first line is the session: {"gguf": path, "threads": N, "n_ctx": N}, answered by
{"version": llama_cpp.__version__, "load_s": the model's load} or {"error": why}; then each
line one request, {"tokens": [...], "decode": N}, answered by {"ttft_s", "reused",
"decode_s_per_token", "rss_bytes": the process's resident memory after it} or {"error":
why}; the process ends at end of input. The requests run in order on ONE
`llama_cpp.Llama`, so its prompt cache works as it does for its users: a request whose
tokens start with the previous request's reuses that common prefix and computes the rest
("reused" says how many; any other request is computed whole). Per request: the time from
the call to the first greedy token (TTFT), and with "decode": N, the time of each next
greedy token (the generation does not stop at end-of-sequence, so every request decodes N
tokens). The parent interleaves its own measurements with these requests.
"""

from __future__ import annotations

import json
import sys
import time


def resident_bytes() -> int:
    """This process's resident memory (VmRSS), in bytes; 0 where /proc does not say."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Session:
    """One `llama_cpp.Llama` and its prompt cache."""

    def __init__(self, job: dict):
        import llama_cpp

        self.version = llama_cpp.__version__
        began = time.perf_counter()
        self.llm = llama_cpp.Llama(model_path=job["gguf"], n_ctx=int(job["n_ctx"]),
                                   n_threads=int(job["threads"]),
                                   n_threads_batch=int(job["threads"]), n_batch=512,
                                   verbose=False, logits_all=False)
        self.load_s = time.perf_counter() - began

    def request(self, request: dict) -> dict:
        llm = self.llm
        tokens = [int(t) for t in request["tokens"]]
        before = list(llm._input_ids)            # what its prompt cache holds
        reused = 0
        for a, b in zip(before, tokens):
            if a != b:
                break
            reused += 1
        decode = int(request.get("decode", 0))
        began = time.perf_counter()
        steps = llm.generate(tokens, top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                             repeat_penalty=1.0, reset=True)
        next(steps)
        ttft = time.perf_counter() - began
        per_token = None
        if decode:
            began = time.perf_counter()
            for _ in range(decode):
                next(steps)
            per_token = (time.perf_counter() - began) / decode
        steps.close()
        return {"ttft_s": ttft, "reused": min(reused, len(tokens) - 1),
                "decode_s_per_token": per_token, "rss_bytes": resident_bytes()}


def _open(job: dict) -> Session | dict:
    try:
        return Session(job)
    except ImportError as error:
        return {"error": f"llama-cpp-python is not installed ({error})"}


def _answer(out: dict) -> None:
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()


def main() -> int:
    """The line protocol (module docstring)."""
    try:
        session = _open(json.loads(sys.stdin.readline()))
    except Exception as error:                   # reported to the parent, not raised there
        session = {"error": f"{type(error).__name__}: {error}"}
    if isinstance(session, dict):
        _answer(session)
        return 0
    _answer({"version": session.version, "load_s": session.load_s})
    for line in sys.stdin:
        try:
            _answer(session.request(json.loads(line)))
        except Exception as error:
            _answer({"error": f"{type(error).__name__}: {error}"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
