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
model's name, 408 for a body that took too long, 429 when the queue is full, 500 for a
fault of the server's own. Every field is checked before a request is queued (`_parse`);
once queued, any way out but its answer cancels the job.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Mapping

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from promptlang.errors import (HTTPError, InternalError, PromptLangError, QueueFullError,
                               RequestError)
from promptlang.server.prompts import (ChatSchemas, check_extension,
                                       check_messages, completion_prompt, completion_text,
                                       extension_prompt, parse_messages)
from promptlang.server.worker import EngineWorker, Job
from promptlang.tokenizer import PreparedIds, min_token_count

log = logging.getLogger("promptlang.server")

MAX_BODY_BYTES = 8 << 20            # a request body larger than this is refused (413)
DEFAULT_CHAT_TOKENS = 256           # max_tokens when a chat request gives none
DEFAULT_COMPLETION_TOKENS = 16      # the OpenAI API's default for completions
DISCONNECT_POLL_S = 0.25            # how often a non-streamed request checks its client
BODY_TIMEOUT_S = 30.0               # a request body must arrive within this (else 408, closed)
MAX_JSON_DEPTH = 64                 # arrays and objects nested deeper are refused (400)
# a body at least this big is decoded, checked and parsed on a thread of its own, so the
# event loop serves other requests meanwhile (the checks of megabytes take tens of ms)
OFF_LOOP_BYTES = 1 << 20
_SURROGATE = re.compile("[\ud800-\udfff]")   # JSON's "\ud800" escapes: not Unicode text


def _error_response(error: HTTPError) -> JSONResponse:
    """The OpenAI-style error object of `error`, with its status."""
    return JSONResponse({"error": {"message": error.message, "type": error.kind,
                                   "param": error.param, "code": None}},
                        status_code=error.status,
                        headers={"Connection": "close"} if error.close else None)


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
    body_timeout: float = BODY_TIMEOUT_S
    ahead: Any = None                # a twin of llm.tokenizer for request threads, or None
    metrics: Metrics = field(default_factory=Metrics)
    created: int = field(default_factory=lambda: int(time.time()))


def create_app(llm, *, functions: Mapping[str, Any] | None = None,
               model_name: str = "promptlang", api_key: str | None = None,
               max_queue: int = 64, max_batch: int = 16,
               on_open: Callable[[Any, Mapping], None] | None = None,
               body_timeout: float = BODY_TIMEOUT_S) -> FastAPI:
    """The ASGI app serving `llm` (a runtime LLM, schemas registered); `functions`: @prompt
    functions by name. The engine thread starts now (decoding up to `max_batch` requests
    together) and stops at the app's shutdown, after the requests already queued.
    `on_open(generation, extensions)`: called on the engine thread with each request it
    opens (a runtime Generation) and the ASGI scope's `extensions` (a cluster replica learns
    which units it now holds: cluster.py). `body_timeout`: seconds a request's body may
    take to arrive (then 408, and the connection is closed)."""
    worker = EngineWorker(max_queue=max_queue, max_batch=max_batch)
    state = ServerState(llm, worker, ChatSchemas(llm), dict(functions or {}), model_name,
                        api_key, on_open, body_timeout, ahead=_tokenize_ahead(llm))
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await asyncio.to_thread(worker.close)       # serve what is queued, then stop

    app = FastAPI(title="promptlang", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)
    app.state.promptlang = state

    @app.exception_handler(HTTPError)
    async def _http_error(request: Request, error: HTTPError):
        return _error_response(error)

    @app.exception_handler(StarletteHTTPException)
    async def _starlette_error(request: Request, error: StarletteHTTPException):
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        response = _error_response(HTTPError(error.status_code, str(error.detail), kind))
        response.headers.update(error.headers or {})          # e.g. 405's Allow
        return response

    @app.exception_handler(Exception)
    async def _server_error(request: Request, error: Exception):
        log.error("request failed", exc_info=error)
        return _error_response(HTTPError(500, f"internal error: {type(error).__name__}",
                                         "server_error"))

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
    key_matches = hmac.compare_digest(token.strip().encode(), state.api_key.encode())
    if scheme.lower() != "bearer" or not key_matches:
        raise HTTPError(401, "missing or wrong API key (Authorization: Bearer KEY)",
                        "authentication_error")


async def _body(request: Request, timeout: float) -> tuple[dict, int]:
    """The request's JSON object and its size in bytes: at most MAX_BODY_BYTES, arrived
    within `timeout` seconds, nested at most MAX_JSON_DEPTH deep, every string valid Unicode;
    else an HTTPError. A body of OFF_LOOP_BYTES or more is decoded on a thread."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise HTTPError(413, f"the request body is {int(length):,} bytes; at most "
                             f"{MAX_BODY_BYTES:,} are read", close=True)
    _check_content_type(request.headers.get("content-type"))

    async def read() -> bytearray:
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > MAX_BODY_BYTES:
                raise HTTPError(413, f"the request body is over {MAX_BODY_BYTES:,} bytes",
                                close=True)
        return raw
    try:
        raw = await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        raise HTTPError(408, f"the request body did not arrive within {timeout:g} s",
                        close=True) from None
    if len(raw) >= OFF_LOOP_BYTES:
        return await asyncio.to_thread(_decoded, raw), len(raw)
    return _decoded(raw), len(raw)


def _decoded(raw: bytearray) -> dict:
    """The JSON object in `raw`, checked; else an HTTPError (400)."""
    try:
        body = json.loads(bytes(raw).decode("utf-8"), parse_constant=_not_json)
    except ValueError as error:        # UnicodeDecodeError, JSONDecodeError, NaN/Infinity
        raise HTTPError(400, f"the request body is not valid JSON: {error}") from None
    except RecursionError:
        raise HTTPError(400, "the request body is nested too deeply (at most "
                             f"{MAX_JSON_DEPTH} levels of arrays and objects)") from None
    if not isinstance(body, dict):
        raise HTTPError(400, "the request body must be a JSON object")
    _check_json(body)
    return body


def _check_content_type(value: str | None) -> None:
    """A body is JSON: no Content-Type (read as JSON), application/json or a +json type,
    in UTF-8; anything else is a 400."""
    if value is None:
        return
    media, _, params = value.partition(";")
    media = media.strip().lower()
    charset = next((v.strip().strip('"').lower() for k, _, v in
                    (p.strip().partition("=") for p in params.split(";"))
                    if k.strip().lower() == "charset"), "utf-8")
    is_json = media == "application/json" or (media.startswith("application/")
                                              and media.endswith("+json"))
    if is_json and charset in ("utf-8", "utf8"):
        return
    raise HTTPError(400, f"the request body must be JSON in UTF-8 (Content-Type: "
                         f"application/json), not {value[:100]!r}")


def _not_json(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _check_json(body: dict) -> None:
    """400 for a body nested deeper than MAX_JSON_DEPTH or holding a string (or key) that
    is not Unicode text (a lone surrogate, "\\ud800"): no tokenizer or schema sees it."""
    stack: list[tuple[Any, int, str | None]] = [(body, 1, None)]
    while stack:
        value, depth, field_ = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                raise HTTPError(400, f"{field_ or 'the request body'} holds a lone surrogate "
                                     "(e.g. \"\\ud800\"): text must be valid Unicode",
                                param=field_)
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth > MAX_JSON_DEPTH:
            raise HTTPError(400, f"{field_ or 'the request body'} is nested too deeply (at "
                                 f"most {MAX_JSON_DEPTH} levels of arrays and objects)",
                            param=field_)
        if isinstance(value, dict):
            for key, item in value.items():
                name = field_
                if name is None:               # a top-level field names what it holds
                    name = "a field name" if _SURROGATE.search(key) else key
                stack += [(key, depth + 1, name), (item, depth + 1, name)]
        else:
            stack += [(item, depth + 1, field_) for item in value]


@dataclass
class Parsed:
    """A request, every field checked (`_parse`) before anything is queued."""

    options: dict                    # LLM.start's sampling options (SamplingParams' fields)
    stream: bool
    include_usage: bool
    max_tokens: int | None           # as the client gave it (None: the default)
    recompute: str | None = None     # the extension field's policy
    extension: Mapping | None = None
    messages: list | None = None     # parse_messages' Messages
    text: str | None = None          # a completion's prompt


_SAMPLING_PARAMS = {"max_new_tokens": "max_tokens", "temperature": "temperature",
                    "top_p": "top_p", "seed": "seed", "stop": "stop", "regex": "promptlang",
                    "grammar": "promptlang", "json_schema": "response_format",
                    "give at most one": "response_format"}


def _parse(state: ServerState, body: dict, chat: bool) -> Parsed:
    """Every field the request gives, checked: types, ranges, the prompt's shape (a PML
    text is parsed, and its names bound, on the engine thread). An HTTPError (400, 404)
    before any work is queued."""
    from promptlang.runtime.decoding.sampling import SamplingParams

    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise HTTPError(400, "model must be a string", param="model")
    if model not in (None, state.model_name):
        raise HTTPError(404, f"the model {model!r} is not served here (this server serves "
                             f"{state.model_name!r})", "not_found_error", "model")
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise HTTPError(400, "n must be 1: one choice per request is served", param="n")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise HTTPError(400, f"stream must be true or false, not {stream!r}", param="stream")
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise HTTPError(400, "stream_options must be an object ({\"include_usage\": true})",
                        param="stream_options")
    include_usage = (stream_options or {}).get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise HTTPError(400, "stream_options.include_usage must be true or false",
                        param="stream_options")
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_tokens = body.get(name)
    if max_tokens is not None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise HTTPError(400, f"{name} must be a positive integer", param=name)
        limit = state.llm.max_positions
        if limit is not None and max_tokens > limit:
            raise HTTPError(400, f"{name} is {max_tokens:,}, more than this model's context of "
                                 f"{limit:,} tokens", param=name)
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, (str, list)):
        raise HTTPError(400, "stop must be a string or a list of strings", param="stop")

    def given(key: str, default: Any) -> Any:
        return default if body.get(key) is None else body[key]

    default = DEFAULT_CHAT_TOKENS if chat else DEFAULT_COMPLETION_TOKENS
    options = {"max_new_tokens": default if max_tokens is None else max_tokens,
               "temperature": given("temperature", 1.0),      # the OpenAI API's defaults
               "top_p": given("top_p", 1.0), "seed": body.get("seed"),
               "stop": () if stop is None else ((stop,) if isinstance(stop, str) else tuple(stop))}
    options.update(_response_format(body.get("response_format")))
    parsed = Parsed(options, bool(stream), bool(include_usage), max_tokens)
    try:
        if "promptlang" in body:
            ext = body["promptlang"]
            check_extension(ext, state.functions)
            parsed.extension = ext
            parsed.recompute = ext.get("recompute")
            options.update({key: ext[key] for key in ("regex", "grammar")
                            if ext.get(key) is not None})
        elif chat:
            parsed.messages = parse_messages(body.get("messages"))
            check_messages(parsed.messages)
            _check_fits(state.llm, [m.content for m in parsed.messages])
        else:
            parsed.text = completion_text(body.get("prompt"))
            _check_fits(state.llm, [parsed.text])
        SamplingParams(**options)                   # its checks, before anything is queued
    except PromptLangError as error:
        message = str(error)
        param = next((p for key, p in _SAMPLING_PARAMS.items() if message.startswith(key)),
                     "promptlang" if parsed.extension is not None or "promptlang" in body
                     else "messages" if chat else "prompt")
        raise HTTPError(400, message.replace("max_new_tokens", name), param=param) from None
    return parsed


def _tokenize_ahead(llm) -> Any:
    """A twin of the engine's tokenizer for the request threads, the engine's tokenizer
    given a `PreparedIds` to take their ids from; None where the tokenizer has no twin."""
    twin = getattr(llm.tokenizer, "twin", None)
    if twin is None or not hasattr(llm.tokenizer, "prepared"):
        return None
    llm.tokenizer.prepared = PreparedIds()
    return twin()


async def _prepare_long_texts(state: ServerState, parsed: Parsed) -> None:
    """Tokenize a request's long texts on a thread of their own before it is queued (the
    engine thread then takes their ids, and one long request does not stall the others);
    a 400 when they alone pass the model's context."""
    long = [t for t in _texts(parsed) if len(t) >= PreparedIds.MIN_CHARS]
    if state.ahead is None or not long:
        return
    counted = await asyncio.to_thread(_tokenize_texts, state, long)
    limit = state.llm.max_positions
    if limit is not None and counted > limit:
        raise HTTPError(400, f"the prompt holds at least {counted:,} tokens; this model's "
                             f"context is {limit:,}",
                        param="messages" if parsed.messages is not None else "prompt")


def _texts(parsed: Parsed) -> list[str]:
    """The free texts of a request: its messages' contents, or its completion prompt."""
    if parsed.messages is not None:
        return [m.content for m in parsed.messages]
    return [parsed.text] if parsed.text is not None else []


def _tokenize_texts(state: ServerState, texts: list[str]) -> int:
    """Tokens of `texts`, each kept for the engine's tokenizer (a text the twin refuses is
    left to the engine, which refuses it the same way)."""
    total = 0
    for text in texts:                   # the twin serialises its own calls
        try:
            ids = state.ahead.encode(text)
        except PromptLangError:
            continue
        state.llm.tokenizer.prepared.put(text, ids)
        total += len(ids)
    return total


def _check_fits(llm, texts: list[str]) -> None:
    """RequestError when `texts` cannot fit the model's context whatever they tokenize to:
    a lower bound on their tokens from their characters alone (`min_token_count`), so a
    prompt of megabytes is refused before it is tokenized on the engine thread."""
    limit = llm.max_positions
    if limit is None:
        return
    least = 0
    for text in texts:
        least += min_token_count(llm.tokenizer, text, enough=limit - least)
        if least > limit:
            break
    if least > limit:
        raise RequestError(f"the prompt holds at least {least:,} tokens; this model's context "
                           f"is {limit:,}")


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


class _JobStream(StreamingResponse):
    """A streamed answer whose job is cancelled however the response ends (sent, failed, or
    never started because the client went away)."""

    def __init__(self, job: Job, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.job = job

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel()


async def _complete(state: ServerState, request: Request, chat: bool):
    """One completion request. Every field is checked before its job is queued; from then
    on, any way out but a finished answer cancels the job (the engine drops it at its next
    step and its slot and buffer are free)."""
    endpoint = "chat" if chat else "completions"
    job = None
    try:
        _authorize(state, request)
        body, size = await _body(request, state.body_timeout)
        if size >= OFF_LOOP_BYTES:              # its text's checks, off the event loop too
            parsed = await asyncio.to_thread(_parse, state, body, chat)
        else:
            parsed = _parse(state, body, chat)
        await _prepare_long_texts(state, parsed)
        job = Job(_opener(state, parsed, request.scope.get("extensions") or {}),
                  asyncio.get_running_loop())
        try:
            state.worker.submit(job)
        except QueueFullError as full:
            raise HTTPError(429, str(full), "rate_limit_error") from None
        kind, value = await _first_event(job, request)
        if kind == "error":
            raise _as_http(value)
        ids = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        if parsed.stream:
            response = _JobStream(job, _sse(state, job, ids, chat, parsed.include_usage),
                                  media_type="text/event-stream",
                                  headers={"Cache-Control": "no-cache"})
            state.metrics.count(endpoint, 200)
            job = None                          # the response cancels it when it ends
            return response
        answer = await _answer(state, job, request, chat, ids)
        state.metrics.count(endpoint, answer.status_code if isinstance(answer, JSONResponse)
                            else 200)
        return answer
    except HTTPError as error:
        state.metrics.count(endpoint, error.status)
        return _error_response(error)
    except Exception as error:                  # a fault of ours: logged, the type told
        log.error("request failed", exc_info=error)
        state.metrics.count(endpoint, 500)
        return _error_response(HTTPError(500, f"internal error: {type(error).__name__}",
                                         "server_error"))
    finally:
        if job is not None:
            job.cancel()                        # a no-op once the job has finished


async def _answer(state: ServerState, job: Job, request: Request, chat: bool, ids: str):
    """A non-streamed answer: the job's deltas gathered, then the response body (a dict),
    or an error response."""
    text = []
    result = None
    while True:
        kind, value = await _next_event(job, request)
        if kind == "delta":
            text.append(value)
        elif kind == "done":
            result = value
            break
        elif kind == "error":
            return _error_response(_as_http(value))
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


def _opener(state: ServerState, parsed: Parsed, extensions: Mapping):
    """The job's thunk (run on the engine thread): the request's prompt, then LLM.start --
    bind, retrieve, assemble, prefill (a short one is left to the next decode step) -- or
    an error."""
    def open_request():
        if parsed.extension is not None:
            prompt = extension_prompt(parsed.extension, state.functions)
        elif parsed.messages is not None:
            prompt = state.chats.prompt(parsed.messages)
        else:
            prompt = completion_prompt(state.llm, parsed.text)
        try:
            if parsed.max_tokens is not None:
                _check_room(state.llm, prompt, parsed.max_tokens)
            opened = state.llm.start(prompt, recompute=parsed.recompute,
                                     defer=state.worker.prefill_in_step, **parsed.options)
        finally:
            prepared = getattr(state.llm.tokenizer, "prepared", None)
            if prepared is not None:        # its long texts' ids are no longer needed
                prepared.discard(_texts(parsed))
        if state.on_open is not None:
            state.on_open(opened, extensions)
        return opened
    return open_request


def _check_room(llm, prompt, max_tokens: int) -> None:
    """A 400, as vLLM answers, when the prompt and `max_tokens` together pass the model's
    context (a request that gives no max_tokens gets what room is left, up to its default)."""
    limit = llm.max_positions
    if limit is None:
        return
    end = llm.bind(prompt).end            # a prompt that alone passes it: ContextLengthError
    if end + max_tokens > limit:
        raise HTTPError(400, f"this model's context is {limit:,} tokens, but the request asks "
                             f"for {end + max_tokens:,} ({end:,} for the prompt, {max_tokens:,} "
                             "for the completion): lower max_tokens or shorten the prompt",
                        param="max_tokens")


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
    if isinstance(error, (PromptLangError, RequestError)) and \
            not isinstance(error, InternalError):      # a bug: the server's fault
        return HTTPError(400, str(error))
    log.error("request failed", exc_info=error)
    return HTTPError(500, f"internal error: {type(error).__name__}", "server_error")


def _prometheus(state: ServerState) -> str:
    """The counters in the Prometheus text exposition format."""
    m = state.metrics
    w = state.worker
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
              f"promptlang_store_misses_total {stats.misses}",
              "# HELP promptlang_store_evictions_total Units evicted past a tier's budget.",
              "# TYPE promptlang_store_evictions_total counter"]
    for tier in ("device", "host", "disk"):
        lines.append(f'promptlang_store_evictions_total{{tier="{tier}"}} '
                     f"{getattr(stats, tier + '_evictions')}")
    budget = state.llm.store.memory_budget_bytes
    lines += ["# HELP promptlang_store_memory_bytes KV bytes the store's memory tiers hold now.",
              "# TYPE promptlang_store_memory_bytes gauge",
              f"promptlang_store_memory_bytes {stats.device_bytes + stats.host_bytes}",
              "# HELP promptlang_store_memory_budget_bytes The memory tiers' budget (-1: none).",
              "# TYPE promptlang_store_memory_budget_bytes gauge",
              f"promptlang_store_memory_budget_bytes {-1 if budget is None else budget}"]
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
