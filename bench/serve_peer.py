"""`promptlang bench serve --llama-server`: the same load on llama-cpp-python's OpenAI server.

After promptlang's levels, llama-cpp-python's own server (`python -m llama_cpp.server`, in
a process of its own, on 127.0.0.1 and a free port, the same thread count) serves the
default model's GGUF, and the same clients (the child process, one `openai` client per
thread, streaming) send the same requests as plain chat: a RAG request's documents travel
as text in its user message, in the order promptlang lays them out, then the question (it
cannot take PML). Its `interrupt_requests` is off: by default a new request cuts the
stream in progress off (measured: 2 of 3 concurrent streams ended without text). It
sends no usage in a stream, so its tokens are counted one per content chunk. Each
request is served once alone first (its own reference:
its 4-bit weights do not give promptlang's float32 answers), then the levels. Its server
answers one request at a time (llama-cpp-python holds one model behind a lock); its prompt
cache keeps the previous request's tokens.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Sequence

from promptlang.bench import qa
from promptlang.errors import ServerStartError

START_TIMEOUT = 180.0            # seconds for llama-cpp-python's server to answer, at most


def plain_body(body: dict, texts: Sequence[str], docs: Sequence[int], question: str) -> dict:
    """A RAG body as one plain chat request: the system turn, then the documents (in
    layout order) and the question in the user turn -- the text promptlang's schema holds."""
    documents = "".join(texts[i] + "\n\n" for i in sorted(docs))
    out = {k: v for k, v in body.items() if k not in ("messages", "extra_body")}
    out["messages"] = [{"role": "system", "content": qa.SYSTEM_PROMPT},
                       {"role": "user", "content": f"Documents:\n\n{documents}"
                                                   f"Question: {question}"}]
    return out


def available() -> str | None:
    """None when llama-cpp-python's server can run here, else why not."""
    try:
        import llama_cpp.server.app  # noqa: F401
    except ImportError as error:
        return f"llama-cpp-python's server is not installed ({error}); " \
               "pip install 'llama-cpp-python[server]'"
    return None


class LlamaServer:
    """llama-cpp-python's server on 127.0.0.1 and a free port, in a process of its own."""

    def __init__(self, gguf: str, threads: int, n_ctx: int):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--host", "127.0.0.1",
             "--port", str(port), "--n_threads", str(threads), "--n_threads_batch",
             str(threads), "--n_ctx", str(n_ctx), "--verbose", "False",
             "--interrupt_requests", "False"],     # its default cuts a stream off for a newer
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=dict(os.environ))
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=2):
                    return
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise ServerStartError("llama-cpp-python's server did not start") from None
                time.sleep(0.5)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(30)


def llama_lines(report) -> list[str]:
    """The report's lines about llama-cpp-python's levels beside promptlang's."""
    if report.llama_missing:
        return [f"not run: {report.llama_missing}"]
    lines = ["llama-cpp-python's OpenAI server (python -m llama_cpp.server) on the default "
             "model's Q4_1 GGUF, same threads; the same requests as plain chat (a RAG "
             "request's documents as text); identical: equal to its own answer alone"]
    ours = {level.clients: level for level in report.levels if not level.again}
    for level in report.llama_levels:
        mine = ours.get(level.clients)
        both_measured = (mine is not None and level.tokens_per_s() > 0
                         and mine.ttft(0.5) is not None and level.ttft(0.5) is not None)
        if both_measured:
            lines.append(f"{level.clients} clients: promptlang {mine.tokens_per_s():.1f} "
                         f"vs llama-cpp-python {level.tokens_per_s():.1f} tokens/s "
                         f"({mine.tokens_per_s() / level.tokens_per_s():.1f}x); TTFT p50 "
                         f"{mine.ttft(0.5) * 1e3:.0f} vs {level.ttft(0.5) * 1e3:.0f} ms")
    return lines
