"""`promptlang bench serve`: the OpenAI server under load, measured with the `openai` client.

The server (promptlang/server/) runs in this process on a thread, on 127.0.0.1 and a free
port, over the already loaded model; the clients run in a child process (so that parsing
their streams never holds this process's interpreter lock), one thread each with its own
`openai` client, streaming. The workload mixes two kinds of request, in turns:

  rag   k of N documents (bench/rag.py's generator) through the `promptlang` extension
        field, then a question about one of them
  chat  a plain chat request (system text and a one-line question; documents travel as
        cached modules in the rag requests, not as new text)

built on a fixed set of `distinct` requests (their documents and questions), and every
request sent is new: its question starts with its own number ("Request 17: ..."), as a
served RAG workload asks new questions of the same documents. Before the timed levels
every request the levels will send is served once alone (greedy): the reference answer;
its modules' KV (and exact entries, under the default recompute policy) are stored then,
so the levels measure serving. The prompt tails those runs keep are dropped before each
level (runtime/kv/tails.py: a request seen whole before computes nothing, which would make
the levels measure a cache of answers): in a level every request computes its question.

For each level of concurrency (1, 4, 16, 32 clients; 1 and 2 with --quick) every client
sends `requests` requests one after another, more where the level would send fewer than
`level_requests` in all (one client: 16 in a row, so that every level sees each distinct
request's documents at least twice, the same mix); a level stops early at `level_timeout`
seconds (what was not sent counts as not sent, not as lost). Per level: requests answered
and lost (an exception, or a stream without its end), TTFT p50 and p99 (to the first
generated text), the time per output token after the first (median over requests),
aggregate output tokens per second (all tokens over the level's wall time), and how many
answers equal the reference. The one-client level runs again after the others ("1 (again)":
the machine's speed drifts over a run), and the ratios take the better of the two as "one
client's" -- the stricter baseline. Goals: aggregate tokens/s at 16 clients >= 5x
one client's; TTFT p50 at 4 clients <= 2x one client's; no request lost; every answer equal
to the request served alone.

Beside the throughput goal the report prints what the arithmetic alone allows: every
answered request's FLOPs (its uncached prompt tokens and decode steps through every
layer's matmuls and attention, one LM-head row per generated token: `request_flops`, from
the usage the server reports) at the best sustained float32 sgemm rate measured in the same
run (bench/floor.py). An engine serves the level faster than that ceiling only by computing
faster than the machine's best float32 matmul, whatever its batching.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from promptlang.bench import qa
from promptlang.bench.rag import build_prompt, build_schema, plan_requests
from promptlang.bench.report import Goal, Section
from promptlang.bench.shapes import ModelShape
from promptlang.errors import ServerStartError

THROUGHPUT_CLIENTS = 16
THROUGHPUT_GOAL = 5.0            # tokens/s at 16 clients >= 5x one client's
TTFT_CLIENTS = 4
TTFT_GOAL = 2.0                  # TTFT p50 at 4 clients <= 2x one client's
CHILD_START_SECONDS = 120.0       # the clients' process: start (imports) and slack, at most


@dataclass(frozen=True)
class ServeOptions:
    clients: tuple[int, ...] = (1, 4, 16, 32)
    requests: int = 4                # per client per level
    level_requests: int = 16         # ... and at least this many per level in all (one client:
                                     # 16 in a row, every distinct request twice, as the others)
    distinct: int = 8                # distinct documents/questions the requests draw from
    docs: int = 8                    # RAG documents in the schema
    k: int = 4                       # documents per RAG request
    doc_tokens: int = 300
    max_tokens: int = 32
    level_timeout: float = 600.0     # seconds per level, at most
    llama_server: bool = False       # also load llama-cpp-python's server (serve_peer.py)
    llama_clients: tuple[int, ...] = (1, 4, 16)   # ... at these levels
    request_timeout: float = 300.0   # seconds per request, at most

    @classmethod
    def quick(cls) -> "ServeOptions":
        return cls(clients=(1, 2), requests=2, level_requests=2, distinct=3, docs=3, k=2,
                   doc_tokens=24, max_tokens=4, level_timeout=120.0, request_timeout=60.0,
                   llama_clients=(1,))


@dataclass
class Sample:
    ttft: float | None
    seconds: float
    tokens: int
    text: str
    lost: str | None = None          # why it was lost (None: answered)
    prompt_tokens: int | None = None     # the usage the server reported (None: none)
    cached_tokens: int | None = None     # ... of which served from cached KV


@dataclass
class Level:
    clients: int
    wall: float
    samples: list[Sample] = field(default_factory=list)
    sent: int = 0
    identical: int = 0
    again: bool = False              # the one-client level run a second time, at the end
    steps: int | None = None         # the engine's decode steps during the level (/metrics)
    busy: float | None = None        # ... and its busy seconds (None: not a promptlang server)

    def answered(self) -> list[Sample]:
        return [s for s in self.samples if s.lost is None]

    def tokens_per_s(self) -> float:
        return sum(s.tokens for s in self.answered()) / self.wall if self.wall > 0 else 0.0

    def ttft(self, q: float) -> float | None:
        times = sorted(s.ttft for s in self.answered() if s.ttft is not None)
        if not times:
            return None
        return times[min(len(times) - 1, int(q * len(times)))] if q < 1 else times[-1]

    def per_token(self) -> float | None:
        rates = [(s.seconds - s.ttft) / (s.tokens - 1) for s in self.answered()
                 if s.ttft is not None and s.tokens > 1]
        return statistics.median(rates) if rates else None

    def ceiling(self, shape: ModelShape, flops_per_s: float) -> float | None:
        """Tokens/s the level's answered requests allow at `flops_per_s` if the engine
        did nothing but their arithmetic (None: no request reported its usage)."""
        counted = [s for s in self.answered() if s.prompt_tokens is not None]
        flops = sum(request_flops(shape, s.prompt_tokens, s.cached_tokens or 0, s.tokens)
                    for s in counted)
        return flops_per_s * sum(s.tokens for s in counted) / flops if flops > 0 else None

    def row(self) -> dict[str, Any]:
        answered = self.answered()

        def ms(v):
            return None if v is None else round(v * 1e3, 1)

        return {"clients": f"{self.clients} (again)" if self.again else self.clients,
                "sent": self.sent, "answered": len(answered),
                "lost": len(self.samples) - len(answered), "ttft p50 ms": ms(self.ttft(0.5)),
                "ttft p99 ms": ms(self.ttft(0.99)), "ms/token": ms(self.per_token()),
                "tokens/s": round(self.tokens_per_s(), 2), "identical": self.identical,
                "wall s": round(self.wall, 2),
                **({} if self.busy is None else {
                    "engine steps": self.steps,
                    "engine busy %": round(100 * self.busy / self.wall, 1) if self.wall else None})}


@dataclass
class ServeReport:
    options: ServeOptions
    model: str
    levels: list[Level] = field(default_factory=list)
    reference_seconds: float = 0.0
    goals: list[Goal] = field(default_factory=list)
    llama_levels: list[Level] = field(default_factory=list)   # llama-cpp-python's server
    llama_missing: str | None = None                           # why it was not loaded
    shape: ModelShape | None = None          # the served model's (for the ceiling)
    sgemm_flops_per_s: float | None = None   # the run's best sustained sgemm (None: not
                                             # measured: no ceiling printed)


def request_flops(shape: ModelShape, prompt: int, cached: int, completion: int) -> float:
    """The FLOPs a request costs any float32 engine: its `prompt - cached` new prompt
    tokens and `completion - 1` decode steps through every layer's matmuls (2 per weight)
    and attention (QK and PV: 4 per key per head dimension), and one LM-head row per
    generated token. A prefill row attends to the cached past and the new tokens up to
    itself, a decode row to the prompt and the tokens generated before it."""
    new = max(0, prompt - cached)
    steps = max(0, completion - 1)
    keys = new * cached + new * (new + 1) // 2 + steps * prompt + steps * (steps + 1) // 2
    return (2 * shape.layers * shape.linear_params_per_layer() * (new + steps)
            + 4 * shape.layers * shape.heads * shape.head_dim * keys
            + 2 * shape.vocab * shape.hidden * completion)


def run_serve(llm, options: ServeOptions = ServeOptions(), *, model_name: str = "",
              sgemm_flops_per_s: float | None = None) -> ServeReport:
    """Start the server on `llm`, serve the reference requests, then each level.
    sgemm_flops_per_s: the machine's float32 matmul rate, for the arithmetic ceiling."""
    import openai

    from promptlang.bench.shapes import shape_from_config
    from promptlang.server.app import create_app

    report = ServeReport(options, model_name, sgemm_flops_per_s=sgemm_flops_per_s)
    try:
        report.shape = shape_from_config(llm.adapter.config)
    except ValueError:           # a config without the numbers: no ceiling
        report.shape = None
    levels = list(options.clients)
    if 1 in levels and len(levels) > 1:                           # the baseline, once more
        levels.append(1)
    counts = sorted(set(levels) | (set(options.llama_clients) if options.llama_server else set()))
    sends = _workload(llm, options, [_per_client(options, c) * c for c in counts])
    sends = dict(zip(counts, sends))                  # clients -> (bodies, plain) per send
    server = _Server(create_app(llm, model_name="bench", max_queue=max(options.clients) + 1))
    clients = concurrent.futures.ProcessPoolExecutor(
        1, mp_context=multiprocessing.get_context("spawn"))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none",
                               timeout=options.request_timeout, max_retries=0)
        began = time.perf_counter()
        references = {c: [_one(client, body).text for body in sends[c][0]]
                      for c in dict.fromkeys(levels)}
        report.reference_seconds = time.perf_counter() - began
        for i, count in enumerate(levels):
            llm.tails.clear()                     # the references' tails: every request new
            before = engine_counters(server.url)
            level = clients.submit(_level, server.url, sends[count][0], references[count],
                                   count, options)
            report.levels.append(level.result(options.level_timeout + options.request_timeout
                                              + CHILD_START_SECONDS))
            report.levels[-1].again = i == len(options.clients)
            after = engine_counters(server.url)
            report.levels[-1].steps = int(after[0] - before[0])
            report.levels[-1].busy = after[1] - before[1]
        server.stop()
        if options.llama_server:
            _llama_levels(report, {c: sends[c][1] for c in options.llama_clients}, clients,
                          options)
    finally:
        clients.shutdown(cancel_futures=True)
        server.stop()
    report.goals = goals(report)
    return report


def _llama_levels(report: ServeReport, sends: dict[int, list[dict]], clients,
                  options) -> None:
    """The same load on llama-cpp-python's server (serve_peer.py), after promptlang's:
    `sends`, the plain chat form of the requests each level sends."""
    import openai
    import torch

    from promptlang.bench.serve_peer import LlamaServer, available
    from promptlang.default_model import GGUF_FILE, default_model_dir

    gguf = default_model_dir() / GGUF_FILE
    report.llama_missing = available() or (
        None if gguf.is_file() else f"no default model GGUF at {gguf}")
    if report.llama_missing:
        return
    peer = LlamaServer(str(gguf), torch.get_num_threads(), n_ctx=4096)
    try:
        client = openai.OpenAI(base_url=peer.url + "/v1", api_key="none",
                               timeout=options.request_timeout, max_retries=0)
        for count in options.llama_clients:
            references = [_one(client, body).text for body in sends[count]]
            level = clients.submit(_level, peer.url, sends[count], references, count, options)
            report.llama_levels.append(level.result(
                options.level_timeout + options.request_timeout + CHILD_START_SECONDS))
    finally:
        peer.stop()


def _per_client(options: ServeOptions, clients: int) -> int:
    """Requests each client of a level sends, one after another."""
    return max(options.requests, -(-options.level_requests // clients))


def _workload(llm, options: ServeOptions, levels: Sequence[int]
              ) -> list[tuple[list[dict], list[dict]]]:
    """For levels sending `levels[i]` requests: each request's body (keyword arguments of
    chat.completions.create), and the same request as plain chat (for a server without the
    promptlang field). Request n of all is distinct request n % `distinct` (RAG and chat in
    turns) with its question numbered n + 1."""
    from promptlang.bench.latency.sweep import document
    from promptlang.bench.serve_peer import plain_body
    from promptlang.pml.writer import write

    texts = []
    questions = []
    for i in range(options.docs):
        text, item = document(llm.tokenizer, options.doc_tokens, seed=9000 + i)
        texts.append(text)
        questions.append(item.question)
    llm.add_schema(build_schema(texts, "serve-bench"))
    plan = plan_requests(options.docs, options.k, options.distinct, seed=1)
    out = []
    first = 0
    for sent in levels:
        bodies = []
        plain = []
        for n in range(first, first + sent):
            j = n % len(plan)
            request = plan[j]
            question = f"Request {n + 1}: {questions[request.question_of]}"
            if j % 2 == 0:
                pml = write(build_prompt(request.docs, question, "serve-bench"))
                body = {"messages": [], "extra_body": {"promptlang": {"pml": pml}}}
            else:
                body = {"messages": [                       # a short chat turn
                    {"role": "system", "content": qa.SYSTEM_PROMPT},
                    {"role": "user", "content": f"Question: {question}"}]}
            body.update(model="bench", max_tokens=options.max_tokens, temperature=0)
            bodies.append(body)
            plain.append(plain_body(body, texts, request.docs, question) if j % 2 == 0
                         else dict(body))
        out.append((bodies, plain))
        first += sent
    return out


def _one(client, body: dict) -> Sample:
    """One streamed request: its TTFT, total time, tokens and text (or why it was lost)."""
    began = time.perf_counter()
    ttft = None
    parts = []
    tokens = None
    finished = False
    usage = None
    try:
        stream = client.chat.completions.create(stream=True,
                                                stream_options={"include_usage": True},
                                                **body)
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
                tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                if choice.delta.content:
                    if ttft is None:
                        ttft = time.perf_counter() - began
                    parts.append(choice.delta.content)
                if choice.finish_reason is not None:
                    finished = True
    except Exception as error:          # a lost request: counted, never raised
        return Sample(ttft, time.perf_counter() - began, tokens or len(parts), "".join(parts),
                      f"{type(error).__name__}: {error}")
    lost = None if finished else "the stream ended without a finish reason"
    if tokens is None:     # a server without stream usage: one token per content chunk
        tokens = len(parts)
    details = getattr(usage, "prompt_tokens_details", None)
    return Sample(ttft, time.perf_counter() - began, tokens, "".join(parts), lost,
                  prompt_tokens=getattr(usage, "prompt_tokens", None),
                  cached_tokens=getattr(details, "cached_tokens", None))


def engine_counters(url: str) -> tuple[float, float]:
    """(decode steps, engine busy seconds) so far, from the server's /metrics."""
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line and not line.startswith("#") and len(line.split()) == 2}
    return (values["promptlang_steps_total"], values["promptlang_engine_busy_seconds_total"])


def _level(url: str, bodies: Sequence[dict], references: Sequence[str], clients: int,
           options: ServeOptions) -> Level:
    """One level, in the clients' child process: `clients` threads, each sending its
    requests one after another."""
    import openai

    deadline = time.perf_counter() + options.level_timeout
    per_client = _per_client(options, clients)
    lock = threading.Lock()
    level = Level(clients, 0.0)

    def client_loop(index: int) -> None:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none",
                               timeout=options.request_timeout, max_retries=0)
        for r in range(per_client):
            if time.perf_counter() > deadline:
                return
            which = index * per_client + r          # every request its own
            with lock:
                level.sent += 1
            sample = _one(client, bodies[which])
            with lock:
                level.samples.append(sample)
                level.identical += sample.lost is None and sample.text == references[which]

    threads = [threading.Thread(target=client_loop, args=(i,), daemon=True)
               for i in range(clients)]
    began = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, deadline - time.perf_counter()) + options.request_timeout)
    level.wall = time.perf_counter() - began
    return level


def goals(report: ServeReport) -> list[Goal]:
    """The goals against the better of the two one-client runs (first and last: the
    machine's speed drifts), which is the stricter baseline for both ratios."""
    by = {level.clients: level for level in report.levels if not level.again}
    out = []
    ones = [level for level in report.levels if level.clients == 1 and level.answered()]
    one = max(ones, key=Level.tokens_per_s, default=None)
    fastest = min((level for level in ones if level.ttft(0.5) is not None),
                  key=lambda level: level.ttft(0.5), default=None)
    many = by.get(THROUGHPUT_CLIENTS)
    if one is None or many is None or one.tokens_per_s() <= 0:
        out.append(Goal(f"tokens/s at {THROUGHPUT_CLIENTS} clients >= {THROUGHPUT_GOAL:g}x one "
                        "client's", None, f"needs levels 1 and {THROUGHPUT_CLIENTS}"))
    else:
        ratio = many.tokens_per_s() / one.tokens_per_s()
        out.append(Goal(f"tokens/s at {THROUGHPUT_CLIENTS} clients >= {THROUGHPUT_GOAL:g}x one "
                        "client's", ratio >= THROUGHPUT_GOAL,
                        f"{many.tokens_per_s():.1f} vs {one.tokens_per_s():.1f} tokens/s = "
                        f"{ratio:.2f}x" + _ceiling_note(report, many, one)))
    four = by.get(TTFT_CLIENTS)
    one = fastest
    if one is None or four is None or one.ttft(0.5) is None or four.ttft(0.5) is None:
        out.append(Goal(f"TTFT p50 at {TTFT_CLIENTS} clients <= {TTFT_GOAL:g}x one client's",
                        None, f"needs levels 1 and {TTFT_CLIENTS}"))
    else:
        ratio = four.ttft(0.5) / one.ttft(0.5)
        out.append(Goal(f"TTFT p50 at {TTFT_CLIENTS} clients <= {TTFT_GOAL:g}x one client's",
                        ratio <= TTFT_GOAL, f"{four.ttft(0.5) * 1e3:.1f} vs "
                        f"{one.ttft(0.5) * 1e3:.1f} ms = {ratio:.2f}x"))
    lost = sum(len(level.samples) - len(level.answered()) for level in report.levels)
    sent = sum(level.sent for level in report.levels)
    out.append(Goal("no request lost", lost == 0, f"{lost} of {sent} lost"))
    answered = sum(len(level.answered()) for level in report.levels)
    same = sum(level.identical for level in report.levels)
    out.append(Goal("every answer equals the request served alone (greedy)",
                    same == answered and answered > 0, f"{same} of {answered}"))
    return out


def _ceiling_note(report: ServeReport, many: Level, one: Level) -> str:
    if report.shape is None or not report.sgemm_flops_per_s:
        return ""
    ceiling = many.ceiling(report.shape, report.sgemm_flops_per_s)
    if ceiling is None:
        return ""
    return (f"; the arithmetic alone allows at most {ceiling:.0f} tokens/s = "
            f"{ceiling / one.tokens_per_s():.2f}x at this run's float32 sgemm rate "
            f"({report.sgemm_flops_per_s / 1e9:.0f} GFLOP/s)")


def sections(report: ServeReport) -> list[Section]:
    o = report.options
    lines = [f"the server in this process on 127.0.0.1 (uvicorn), the `openai` clients in "
             f"a child process, one thread each, streaming; {o.distinct} distinct requests (RAG: "
             f"{o.k} of {o.docs} documents of ~{o.doc_tokens} tokens through the promptlang "
             f"field, alternating with plain chat), {o.max_tokens} new tokens, greedy; "
             f"{o.requests} requests per client per level, at least {o.level_requests} per "
             "level in all",
             f"every request is new (its question numbered) and was served once alone "
             f"first (the reference; {report.reference_seconds:.1f} s), so its modules "
             "are stored; the prompt tails those runs kept are dropped before each level",
             "concurrent requests decode together (continuous batching, up to 16 per step); "
             "a new request's short prefill runs in the next step: alone while fewer than 8 "
             "decode, else with the decoders' tokens in one pass",
             "lost: an error or a stream without its end; identical: equal to the reference",
             "engine steps / busy %: the engine thread's decode steps during the level and "
             "the share of the level's wall time it spent opening requests and stepping "
             "(the server's /metrics)"]
    if report.shape is not None and report.sgemm_flops_per_s:
        ceilings = [(level, level.ceiling(report.shape, report.sgemm_flops_per_s))
                    for level in report.levels if not level.again]
        lines.append("the arithmetic alone (request_flops, from each answer's usage, at this "
                     f"run's best sustained float32 sgemm, "
                     f"{report.sgemm_flops_per_s / 1e9:.0f} GFLOP/s) allows at most: " + ", ".join(
                         f"{level.clients} client{'s' * (level.clients != 1)} "
                         f"{ceiling:.0f} tokens/s"
                         for level, ceiling in ceilings if ceiling is not None))
    lost = [s.lost for level in report.levels for s in level.samples if s.lost]
    if lost:
        lines.append(f"first loss: {lost[0]}")
    out = [Section(f"Serving under load ({report.model})",
                   [level.row() for level in report.levels], lines)]
    if o.llama_server:
        from promptlang.bench import serve_peer
        out.append(Section("The same load on llama-cpp-python's server",
                           [level.row() for level in report.llama_levels],
                           serve_peer.llama_lines(report)))
    return out + [Section("Goals", (), [str(g) for g in report.goals])]


def to_json(report: ServeReport) -> dict:
    return {"model": report.model, "options": report.options.__dict__,
            "levels": [level.row() for level in report.levels],
            "reference_seconds": report.reference_seconds,
            "llama_levels": [level.row() for level in report.llama_levels],
            "llama_missing": report.llama_missing,
            "sgemm_flops_per_s": report.sgemm_flops_per_s,
            "goals": [{"name": g.name, "passed": g.passed, "detail": g.detail}
                      for g in report.goals]}


class _Server:
    """uvicorn on 127.0.0.1 and a free port, on a thread."""

    def __init__(self, app, start_timeout: float = 60.0):
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + start_timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise ServerStartError("the benchmark's server did not start")
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)
