"""`promptlang serve`'s HTTP face: the OpenAI API over one engine (FastAPI on uvicorn).

    GET  /v1/models             the one model served
    POST /v1/chat/completions   chat; `stream: true` for server-sent events
    POST /v1/completions        text completion; `stream: true` likewise
    GET  /health                {"status": "ok"} while the engine thread is alive
    GET  /metrics               counters in the Prometheus text format

A request becomes a prompt in prompts.py (chat messages, completion text, or PML through the
`promptlang` extension field) and runs on the engine's thread (worker.py). Usage reports
`prompt_tokens_details.cached_tokens`: the prompt tokens served from cached modules.
Concurrent requests decode together (continuous batching: worker.py). Every failure is an
OpenAI error object: 400 for a bad request (a PML error keeps its located
message, `<request>:1:20: ...`), 401 for a missing or wrong `--api-key`, 404 for another
model's name, 429 when the queue is full, 500 for a fault of the server's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Mapping

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from promptlang.errors import PromptLangError
from promptlang.server.prompts import (ChatSchemas, RequestError, completion_prompt,
                                       extension_prompt, parse_messages)
from promptlang.server.worker import EngineWorker, Job, QueueFull

log = logging.getLogger("promptlang.server")

MAX_BODY_BYTES = 8 << 20            # a request body larger than this is refused (413)
DEFAULT_CHAT_TOKENS = 256           # max_tokens when a chat request gives none
DEFAULT_COMPLETION_TOKENS = 16      # the OpenAI API's default for completions
DISCONNECT_POLL_S = 0.25            # how often a non-streamed request checks its client


class HTTPError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.kind,
                                       "param": self.param, "code": None}},
                            status_code=self.status)


@dataclass
class Metrics:
    requests: dict[tuple[str, int], int] = field(default_factory=dict)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    first_token_seconds: float = 0.0
    first_token_count: int = 0

    def count(self, endpoint: str, status: int) -> None:
        key = (endpoint, status)
        self.requests[key] = self.requests.get(key, 0) + 1


@dataclass
class ServerState:
    llm: Any
    worker: EngineWorker
    chats: ChatSchemas
    functions: Mapping[str, Any]
    model_name: str
    api_key: str | None
    on_open: Callable[[Any, Mapping], None] | None = None
    metrics: Metrics = field(default_factory=Metrics)
    created: int = field(default_factory=lambda: int(time.time()))


def create_app(llm, *, functions: Mapping[str, Any] | None = None,
               model_name: str = "promptlang", api_key: str | None = None,
               max_queue: int = 64, max_batch: int = 16,
               on_open: Callable[[Any, Mapping], None] | None = None) -> FastAPI:
    """The ASGI app serving `llm` (a runtime LLM, schemas registered); `functions`: @prompt
    functions by name. The engine thread starts now (decoding up to `max_batch` requests
    together) and stops at the app's shutdown, after the requests already queued.
    `on_open(generation, extensions)`: called on the engine thread with each request it
    opens (a runtime Generation) and the ASGI scope's `extensions` (a cluster replica learns which units it now holds:
    cluster.py)."""
    worker = EngineWorker(max_queue=max_queue, max_batch=max_batch)
    state = ServerState(llm, worker, ChatSchemas(llm), dict(functions or {}), model_name,
                        api_key, on_open)
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await asyncio.to_thread(worker.close)       # serve what is queued, then stop

    app = FastAPI(title="promptlang", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)
    app.state.promptlang = state

    @app.exception_handler(HTTPError)
    async def _http_error(request: Request, error: HTTPError):
        return error.response()

    @app.get("/health")
    async def health():
        alive = worker._thread.is_alive()
        return JSONResponse({"status": "ok" if alive else "engine stopped"},
                            status_code=200 if alive else 503)

    @app.get("/metrics")
    async def metrics(request: Request):
        _authorize(state, request)
        return PlainTextResponse(_prometheus(state),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request):
        _authorize(state, request)
        return {"object": "list", "data": [_model_card(state)]}

    @app.get("/v1/models/{name}")
    async def model(name: str, request: Request):
        _authorize(state, request)
        if name != state.model_name:
            raise HTTPError(404, f"the model {name!r} is not served here (this server "
                                 f"serves {state.model_name!r})", "not_found_error", "model")
        return _model_card(state)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await _complete(state, request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _complete(state, request, chat=False)

    return app


def _model_card(state: ServerState) -> dict:
    return {"id": state.model_name, "object": "model", "created": state.created,
            "owned_by": "promptlang"}


def _authorize(state: ServerState, request: Request) -> None:
    if state.api_key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                             state.api_key.encode()):
        raise HTTPError(401, "missing or wrong API key (Authorization: Bearer KEY)",
                        "authentication_error")


async def _body(request: Request) -> dict:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise HTTPError(413, f"the request body is {int(length):,} bytes; at most "
                             f"{MAX_BODY_BYTES:,} are read")
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_BODY_BYTES:
            raise HTTPError(413, f"the request body is over {MAX_BODY_BYTES:,} bytes")
    try:
        body = json.loads(bytes(raw).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise HTTPError(400, f"the request body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise HTTPError(400, "the request body must be a JSON object")
    return body


def _sampling(body: dict, chat: bool) -> dict:
    """The request's sampling fields -> LLM.generate options (validated there too)."""
    if body.get("n", 1) != 1:
        raise HTTPError(400, "n must be 1: one choice per request is served", param="n")
    default = DEFAULT_CHAT_TOKENS if chat else DEFAULT_COMPLETION_TOKENS
    max_tokens = body.get("max_completion_tokens") if chat else None
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, (str, list)):
        raise HTTPError(400, "stop must be a string or a list of strings", param="stop")
    given = lambda name, default: default if body.get(name) is None else body[name]  # noqa: E731
    options = {"max_new_tokens": default if max_tokens is None else max_tokens,
               "temperature": given("temperature", 1.0),      # the OpenAI API's defaults
               "top_p": given("top_p", 1.0), "seed": body.get("seed"),
               "stop": () if stop is None else ((stop,) if isinstance(stop, str) else tuple(stop))}
    if not isinstance(options["max_new_tokens"], int) or options["max_new_tokens"] < 1:
        raise HTTPError(400, "max_tokens must be a positive integer", param="max_tokens")
    options.update(_response_format(body.get("response_format")))
    return options


def _response_format(fmt: Any) -> dict:
    """OpenAI's `response_format` -> a structured-output option of LLM.generate."""
    if fmt is None:
        return {}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_schema": {"type": "object"}}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise HTTPError(400, "response_format.json_schema.schema must be a JSON Schema "
                                 "object", param="response_format")
        return {"json_schema": schema}
    raise HTTPError(400, "response_format.type must be text, json_object or json_schema",
                    param="response_format")


async def _complete(state: ServerState, request: Request, chat: bool):
    endpoint = "chat" if chat else "completions"
    try:
        _authorize(state, request)
        body = await _body(request)
        if body.get("model") not in (None, state.model_name):
            raise HTTPError(404, f"the model {body.get('model')!r} is not served here (this "
                                 f"server serves {state.model_name!r})", "not_found_error",
                            "model")
        options = _sampling(body, chat)
        stream = bool(body.get("stream", False))
        job = Job(_opener(state, body, chat, options, request.scope.get("extensions") or {}),
                  asyncio.get_running_loop())
        try:
            state.worker.submit(job)
        except QueueFull as full:
            raise HTTPError(429, str(full), "rate_limit_error") from None
        kind, value = await _first_event(job, request)
        if kind == "error":
            raise _as_http(value)
    except HTTPError as error:
        state.metrics.count(endpoint, error.status)
        return error.response()
    state.metrics.count(endpoint, 200)
    ids = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    if stream:
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(_sse(state, job, ids, chat, include_usage),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    text, result = [], None
    while True:
        kind, value = await _next_event(job, request)
        if kind == "delta":
            text.append(value)
        elif kind == "done":
            result = value
            break
        elif kind == "error":
            return _as_http(value).response()
        elif kind == "gone":
            return JSONResponse({}, status_code=499)
    usage = _usage(state, result)
    choice = {"index": 0, "finish_reason": _finish(result.finish_reason), "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": "".join(text)}
    else:
        choice["text"] = "".join(text)
    return {"id": ids, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": state.model_name, "choices": [choice],
            "usage": usage, "promptlang": _extension(result)}


def _extension(result) -> dict:
    """The response's `promptlang` field: the request's cached units by where they came
    from (store tier, or "encoded" when no tier held them)."""
    return {"units": dict(result.units)}


def _opener(state: ServerState, body: dict, chat: bool, options: dict,
            extensions: Mapping):
    """The job's thunk (run on the engine thread): the request's prompt, then LLM.start --
    bind, retrieve, assemble, prefill (a short one is left to the next decode step) -- or
    an error."""
    def open_request():
        recompute = None
        if "promptlang" in body:
            ext = body["promptlang"]
            prompt = extension_prompt(ext, state.functions)
            recompute = ext.get("recompute") if isinstance(ext, Mapping) else None
            for name in ("regex", "grammar"):
                if isinstance(ext, Mapping) and ext.get(name) is not None:
                    options[name] = ext[name]
        elif chat:
            prompt = state.chats.prompt(parse_messages(body.get("messages")))
        else:
            prompt = completion_prompt(state.llm, body.get("prompt"))
        opened = state.llm.start(prompt, recompute=recompute,
                                 defer=state.worker.prefill_in_step, **options)
        if state.on_open is not None:
            state.on_open(opened, extensions)
        return opened
    return open_request


async def _first_event(job: Job, request: Request) -> tuple[str, Any]:
    kind, value = await _next_event(job, request)
    if kind == "gone":
        raise HTTPError(499, "the client went away")
    return kind, value


async def _next_event(job: Job, request: Request) -> tuple[str, Any]:
    """The job's next event; ("gone", None) once the client has disconnected (the job is
    cancelled then)."""
    while True:
        try:
            return await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                job.cancel()
                return "gone", None


async def _sse(state: ServerState, job: Job, ids: str, chat: bool,
               include_usage: bool) -> AsyncIterator[bytes]:
    created = int(time.time())
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(delta: str | None, finish: str | None, role: bool = False) -> bytes:
        if chat:
            body: dict = {} if delta is None else {"content": delta}
            if role:
                body["role"] = "assistant"
            choice = {"index": 0, "delta": body, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": delta or "", "finish_reason": finish,
                      "logprobs": None}
        return _event({"id": ids, "object": kind, "created": created,
                       "model": state.model_name, "choices": [choice]})

    try:
        if chat:
            yield chunk("", None, role=True)
        while True:
            event, value = await job.events.get()
            if event == "delta":
                yield chunk(value, None)
            elif event == "error":
                error = _as_http(value)
                yield _event({"error": {"message": error.message, "type": error.kind,
                                        "param": None, "code": None}})
                break
            elif event == "done":
                usage = _usage(state, value)         # counted in /metrics either way
                yield chunk(None if chat else "", _finish(value.finish_reason))
                if include_usage:
                    yield _event({"id": ids, "object": kind, "created": created,
                                  "model": state.model_name, "choices": [], "usage": usage,
                                  "promptlang": _extension(value)})
                break
        yield b"data: [DONE]\n\n"
    finally:
        job.cancel()          # a client that went away: the engine stops at its next step


def _event(data: dict) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"


def _finish(reason: str) -> str:
    return "length" if reason == "length" else "stop"      # "eos" and "stop" are OpenAI's stop


def _usage(state: ServerState, result) -> dict:
    prompt_tokens = result.prefill_tokens + result.cached_tokens
    m = state.metrics
    m.prompt_tokens += prompt_tokens
    m.cached_tokens += result.cached_tokens
    m.completion_tokens += len(result.token_ids)
    if result.timings.first_token:
        m.first_token_seconds += result.timings.first_token
        m.first_token_count += 1
    return {"prompt_tokens": prompt_tokens, "completion_tokens": len(result.token_ids),
            "total_tokens": prompt_tokens + len(result.token_ids),
            "prompt_tokens_details": {"cached_tokens": result.cached_tokens}}


def _as_http(error: BaseException) -> HTTPError:
    if isinstance(error, HTTPError):
        return error
    if isinstance(error, (PromptLangError, RequestError)):
        return HTTPError(400, str(error))
    log.error("request failed", exc_info=error)
    return HTTPError(500, f"internal error: {type(error).__name__}", "server_error")


def _prometheus(state: ServerState) -> str:
    """The counters in the Prometheus text exposition format."""
    m, w = state.metrics, state.worker
    lines = ["# HELP promptlang_requests_total HTTP requests by endpoint and status.",
             "# TYPE promptlang_requests_total counter"]
    for (endpoint, status), count in sorted(m.requests.items()):
        lines.append(f'promptlang_requests_total{{endpoint="{endpoint}",status="{status}"}} '
                     f"{count}")
    counters = [("prompt_tokens_total", "Prompt tokens of answered requests.", m.prompt_tokens),
                ("cached_tokens_total", "Prompt tokens served from cached modules or from "
                 "an earlier request's prompt tail.", m.cached_tokens),
                ("completion_tokens_total", "Generated tokens.", m.completion_tokens),
                ("first_token_seconds_sum", "Seconds from each request's start to its first "
                 "token, summed.", m.first_token_seconds),
                ("first_token_seconds_count", "Requests timed to their first token.",
                 m.first_token_count),
                ("jobs_cancelled_total", "Requests stopped because the client went away.",
                 w.stats.cancelled),
                ("steps_total", "Decode steps the engine ran (one pass each).", w.stats.steps),
                ("engine_busy_seconds_total", "Seconds the engine thread spent opening "
                 "requests and running steps (against wall time: its utilisation).",
                 round(w.stats.busy_seconds, 6))]
    for name, help_, value in counters:
        lines += [f"# HELP promptlang_{name} {help_}", f"# TYPE promptlang_{name} counter",
                  f"promptlang_{name} {value}"]
    lines += ["# HELP promptlang_queue_length Requests waiting for the engine.",
              "# TYPE promptlang_queue_length gauge", f"promptlang_queue_length {w.queue_length}",
              "# HELP promptlang_requests_running Requests the engine is serving.",
              "# TYPE promptlang_requests_running gauge",
              f"promptlang_requests_running {w.running}",
              "# HELP promptlang_batched_steps_total Decode steps run as one pass over "
              "several requests.",
              "# TYPE promptlang_batched_steps_total counter",
              f"promptlang_batched_steps_total {w.stats.batched_steps}"]
    stats = state.llm.store.stats
    lines += ["# HELP promptlang_store_hits_total Module KV found in the store, by tier.",
              "# TYPE promptlang_store_hits_total counter"]
    for tier in ("device", "host", "disk"):
        lines.append(f'promptlang_store_hits_total{{tier="{tier}"}} '
                     f"{getattr(stats, tier + '_hits')}")
    lines += ["# HELP promptlang_store_misses_total Module KV encoded because no tier held it.",
              "# TYPE promptlang_store_misses_total counter",
              f"promptlang_store_misses_total {stats.misses}"]
    tails = state.llm.tails                                # runtime/kv/tails.py
    lines += ["# HELP promptlang_tail_hits_total Requests served the opening of their last "
              "uncached run from an earlier request's.",
              "# TYPE promptlang_tail_hits_total counter",
              f"promptlang_tail_hits_total {tails.hits}",
              "# HELP promptlang_tail_reused_tokens_total Tokens those requests did not compute.",
              "# TYPE promptlang_tail_reused_tokens_total counter",
              f"promptlang_tail_reused_tokens_total {tails.reused_tokens}",
              "# HELP promptlang_tail_bytes KV bytes of prompt tails kept now.",
              "# TYPE promptlang_tail_bytes gauge", f"promptlang_tail_bytes {tails.nbytes}"]
    return "\n".join(lines) + "\n"
