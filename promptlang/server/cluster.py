"""promptlang on Ray Serve: engine replicas behind one ingress, routed by the modules they hold.

    Ingress        (one replica) the HTTP face: reads each request's body, names the modules
                   it needs (routing.py: no model), and calls the engine deployment with a
                   `Call`; retries a call whose replica died before answering
    EngineReplica  (N replicas) one engine each: the model, its own device/host tiers, the
                   disk tier on the shared `store` folder; runs the single-server app
                   (app.py) in-process, so the API, errors, streaming and auth are the same
    router         ModuleAffinityRouter (router.py) by default; Ray Serve's power-of-two
                   choices ("pow2") or Ray Serve LLM's prefix-cache router ("prefix")

`build_app(config)` is the application (`serve run promptlang.server.cluster:build_app
store=... replicas=2`, or a serve config file: docs/SCALING.md); `serve_cluster` is what
`promptlang serve --ray` runs. Replicas share stored KV through the disk tier: a key names
its content, files are written under a temporary name and renamed (two writers of one key
write the same bytes), and every read verifies the file's checksum (store/kvfile.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Mapping

from ray import serve
from ray.exceptions import RayActorError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from promptlang.server.routing import RequestRoute, SchemaBook, route

log = logging.getLogger("promptlang.server.cluster")

ROUTE_EXTENSION = "promptlang.route"   # ASGI scope extension: the request's module routes
REPLICA_HEADER = "x-promptlang-replica"
ATTEMPT_HEADER = "x-promptlang-attempt"    # set when a call was sent again
ATTEMPTS = 3                # an ingress call whose replica died before answering: tries
MAX_BODY_BYTES = 8 << 20    # as app.MAX_BODY_BYTES
HELD_KEYS = 65536           # routing keys a replica remembers (least recently used dropped)
ROUTERS = ("affinity", "pow2", "prefix")
PREFIX_ROUTER = ("ray.llm._internal.serve.routing_policies.prefix_aware."
                 "prefix_aware_router:PrefixCacheAffinityRouter")


@dataclass
class ClusterConfig:
    """What a cluster serves and how; JSON-serialisable (a serve config's `args`)."""

    store: str                              # the shared disk tier's folder
    replicas: int = 2
    model: str | None = None
    schemas: list[str] = field(default_factory=list)
    threads: int | None = None              # torch threads per replica (default cores/N)
    device_budget_bytes: int | None = None  # each replica's memory tier
    disk_budget_bytes: int | None = None    # the shared folder, all replicas' files counted
    max_batch: int = 16
    max_queue: int = 64
    recompute: str | None = None
    api_key: str | None = None
    model_name: str = "promptlang"
    router: str = "affinity"
    imbalanced_threshold: float = 4.0       # queue spread at which load beats affinity
    min_match: float = 0.1                  # affinity below this share of a request's bytes
    stats_period_s: float = 1.0

    @classmethod
    def from_args(cls, args: Mapping[str, Any]) -> "ClusterConfig":
        """From a serve config's `args` (or `serve run`'s key=value strings: numbers are
        parsed, `schemas` may be comma-separated); unknown names are an error."""
        import dataclasses

        from promptlang.errors import ConfigError

        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(args) - set(known))
        if unknown:
            raise ConfigError(f"unknown cluster setting(s) {unknown}; known: "
                              f"{', '.join(known)}")
        if "store" not in args:
            raise ConfigError("a cluster needs store=FOLDER: the disk tier its replicas "
                              "share")
        values = {}
        for name, value in args.items():
            kind = str(known[name].type)
            try:
                if isinstance(value, str) and name == "schemas":
                    value = [part for part in value.split(",") if part]
                elif isinstance(value, str) and kind.startswith("int"):
                    value = int(value)
                elif isinstance(value, str) and kind.startswith("float"):
                    value = float(value)
            except ValueError:
                raise ConfigError(f"cluster setting {name}={value!r} is not a number") \
                    from None
            values[name] = value
        config = cls(**values)
        config.check()
        return config

    def check(self) -> None:
        from promptlang.errors import ConfigError

        if self.router not in ROUTERS:
            raise ConfigError(f"router must be one of {', '.join(ROUTERS)}, "
                              f"not {self.router!r}")
        if self.replicas < 1 or self.max_batch < 1 or self.max_queue < 1:
            raise ConfigError("replicas, max_batch and max_queue must be at least 1")
        if self.threads is not None and self.threads < 1:
            raise ConfigError("threads must be at least 1")
        for name in ("device_budget_bytes", "disk_budget_bytes"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ConfigError(f"{name} must be a byte count >= 0 (or absent: unlimited)")


@dataclass
class Call:
    """One HTTP request, as the ingress hands it to an engine replica."""

    method: str
    path: str
    headers: list[tuple[str, str]]
    body: bytes
    modules: dict[str, tuple[str, int]]   # module path -> (routing key, weight)
    prompt: str = ""                      # the request's text (Ray's prefix router reads it)

    @property
    def keys(self) -> dict[str, int]:
        return {key: weight for key, weight in self.modules.values()}


class EngineReplica:
    """One engine: loads the model and schemas, serves `Call`s through app.py, and reports
    the routing keys whose units it still holds in memory."""

    def __init__(self, config: dict):
        import torch

        from promptlang.runtime import engine
        from promptlang.runtime.store import ModuleStore
        from promptlang.server.app import create_app
        from promptlang.server.load import load_schemas

        cfg = ClusterConfig(**config)
        torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 1) // cfg.replicas))
        # each replica trims the shared folder to the disk budget, counting every replica's
        # files (store/disk.py scans the folder)
        store = ModuleStore(device_budget_bytes=cfg.device_budget_bytes, disk_dir=cfg.store,
                            disk_budget_bytes=cfg.disk_budget_bytes)
        options = {} if cfg.recompute is None else {"recompute": cfg.recompute}
        self.llm = engine.load(cfg.model, store=store, **options)
        functions = load_schemas(self.llm, cfg.schemas)
        self._held: OrderedDict[str, tuple[set[str], int]] = OrderedDict()
        self._lock = threading.Lock()
        self.app = create_app(self.llm, functions=functions, model_name=cfg.model_name,
                              api_key=cfg.api_key, max_queue=cfg.max_queue,
                              max_batch=cfg.max_batch, on_open=self._opened)
        try:
            self.name = serve.get_replica_context().replica_id.unique_id
        except Exception:      # noqa: BLE001 - constructed outside a replica (tests)
            self.name = "local"

    async def __call__(self, call: Call) -> AsyncIterator[tuple]:
        """The app's ASGI messages for `call`: ("start", status, headers), then ("body",
        bytes, more)."""
        async for message in asgi_messages(self.app, call, self.name):
            yield message

    def record_routing_stats(self) -> dict[str, Any]:
        """Ray Serve's routing stats: "held", routing key -> weight, least recently used
        first, for the keys whose units are all in this replica's memory tiers; and
        "capacity", its memory budget in the same weight units (converted at the bytes per
        weight of what it holds; None: unlimited, or nothing held yet)."""
        with self._lock:
            entries = list(self._held.items())
        store = self.llm.store
        held = {}
        weights = 0
        nbytes = 0
        for key, (stored, weight) in entries:
            sizes = [store.memory_bytes(k) for k in stored]
            if sizes and all(sizes):
                held[key] = weight
                weights = weights + weight
                nbytes = nbytes + sum(sizes)
        budget = store.memory_budget_bytes
        capacity = None if budget is None or not nbytes else budget * weights / nbytes
        return {"held": held, "capacity": capacity}

    def _opened(self, generation, extensions: Mapping) -> None:
        """On the engine thread, for each request opened: its modules' routing keys now
        name the store keys of the units that hold them."""
        routes = extensions.get(ROUTE_EXTENSION) or {}
        if not routes:
            return
        bound = generation.opened.bound
        primed = frozenset(generation.opened.primed)     # "+primed": the entries it served
        found: dict[str, tuple[set[str], int]] = {}
        for unit_id in bound.units:
            unit = bound.layout.units[unit_id]
            store_key = self.llm.encoder.key(bound.layout, unit_id, primed)
            for path in unit.modules:
                hit = routes.get("/".join(path))
                if hit is not None:
                    found.setdefault(hit[0], (set(), int(hit[1])))[0].add(store_key)
        with self._lock:
            for key, entry in found.items():
                self._held.pop(key, None)
                self._held[key] = entry
            while len(self._held) > HELD_KEYS:
                self._held.popitem(last=False)

    def __del__(self):
        state = getattr(getattr(getattr(self, "app", None), "state", None), "promptlang", None)
        if state is not None:
            state.worker.close()          # serve what is queued, then stop


async def asgi_messages(app, call: Call, replica: str) -> AsyncIterator[tuple]:
    """Run the ASGI `app` on `call` in this process; yields its response as ("start",
    status, headers) and ("body", bytes, more_body). Cancelling the iteration tells the
    app its client went away."""
    path, _, query = call.path.partition("?")
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
             "http_version": "1.1", "method": call.method, "scheme": "http", "path": path,
             "raw_path": path.encode(), "query_string": query.encode(), "root_path": "",
             "headers": [(k.lower().encode("latin-1"), v.encode("latin-1"))
                         for k, v in call.headers],
             "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0),
             "extensions": {ROUTE_EXTENSION: call.modules}}
    sent: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    delivered = False

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": call.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await sent.put(message)

    task = asyncio.ensure_future(app(scope, receive, send))
    try:
        while True:
            getter = asyncio.ensure_future(sent.get())
            await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                task.result()                     # the app failed: raise its error
                if sent.empty():
                    return
                getter = asyncio.ensure_future(sent.get())
            message = await getter
            if message["type"] == "http.response.start":
                headers = [(k.decode("latin-1"), v.decode("latin-1"))
                           for k, v in message.get("headers", [])]
                yield "start", message["status"], headers + [(REPLICA_HEADER, replica)]
            elif message["type"] == "http.response.body":
                more = bool(message.get("more_body"))
                yield "body", bytes(message.get("body", b"")), more
                if not more:
                    return
    finally:
        gone.set()                # the app sees a disconnect if it is still running


class Ingress:
    """The HTTP face: every request goes to an engine replica, chosen by the router from
    the modules the request needs."""

    def __init__(self, engine, config: dict):
        from promptlang.server.load import read_sources

        cfg = ClusterConfig(**config)
        schemas, functions = read_sources(cfg.schemas)
        self.book = SchemaBook(schemas, functions)
        self.engine = engine

    async def __call__(self, request: Request) -> Response:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
            return _error(413, f"the request body is {int(length):,} bytes; at most "
                               f"{MAX_BODY_BYTES:,} are read")
        body = await request.body()
        path = request.url.path
        call = Call(request.method, path + (f"?{request.url.query}" if request.url.query else ""),
                    list(request.headers.items()), body, {}, "")
        if request.method == "POST" and path.endswith("completions"):
            found = _route(body, path.endswith("chat/completions"), self.book)
            call.modules = found.modules
            call.prompt = found.prompt
        return await self._forward(call)

    async def _forward(self, call: Call) -> Response:
        from ray.serve.exceptions import BackPressureError

        for attempt in range(1, ATTEMPTS + 1):
            stream = self.engine.options(stream=True).remote(call)
            try:
                response = await _answer(stream)
                if attempt > 1:
                    response.headers[ATTEMPT_HEADER] = str(attempt)
                return response
            except BackPressureError as full:
                return _error(429, f"every replica's queue is full: {full}",
                              "rate_limit_error")
            except RayActorError as died:       # nothing was sent to the client yet
                log.warning("replica failed before answering (%s); attempt %d of %d",
                            type(died).__name__, attempt, ATTEMPTS)
            except BaseException:
                stream.cancel()                  # e.g. the client went away
                raise
        return _error(503, f"no replica answered in {ATTEMPTS} attempts", "server_error")


async def _answer(stream) -> Response:
    """The replica's response: a streamed one as it comes (after its first chunk, so a
    failure before the first token is retried), any other whole."""
    try:
        _, status, headers = await stream.__anext__()
    except StopAsyncIteration:
        return _error(500, "the replica sent no response", "server_error")
    if _is_stream(headers):
        return _streaming(stream, status, headers)
    chunks = [chunk async for _, chunk, _ in stream]
    response = Response(b"".join(chunks), status_code=status)
    response.raw_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers]
    return response


def _route(body: bytes, chat: bool, book: SchemaBook) -> RequestRoute:
    try:
        return route(json.loads(body), chat, book)
    except (ValueError, UnicodeDecodeError):
        return RequestRoute()                    # the replica answers the 400


def _is_stream(headers: list[tuple[str, str]]) -> bool:
    return any(k.lower() == "content-type" and v.startswith("text/event-stream")
               for k, v in headers)


def _streaming(stream, status: int, headers: list[tuple[str, str]]) -> StreamingResponse:
    async def chunks():
        try:
            async for _, chunk, _ in stream:
                yield chunk
        finally:
            stream.cancel()                      # a client gone mid-stream frees the replica
    kept = {k: v for k, v in headers if k.lower() not in ("content-length", "content-type")}
    return StreamingResponse(chunks(), status_code=status, headers=kept,
                             media_type="text/event-stream")


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None,
                                   "code": None}}, status_code=status)


def build_app(args: dict):
    """The Ray Serve application for `args` (ClusterConfig's fields)."""
    cfg = ClusterConfig.from_args(args)
    config = dict(cfg.__dict__)
    options: dict[str, Any] = {
        "name": "promptlang-engine", "num_replicas": cfg.replicas,
        "ray_actor_options": {"num_cpus": 0},
        "max_ongoing_requests": cfg.max_batch + cfg.max_queue,
        "max_queued_requests": cfg.max_queue * cfg.replicas,
        "health_check_period_s": 5, "graceful_shutdown_timeout_s": 60}
    router = _router_config(cfg)
    if router is not None:
        options["request_router_config"] = router
    engine = serve.deployment(EngineReplica).options(**options).bind(config)
    ingress = serve.deployment(Ingress).options(
        name="promptlang-ingress", ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=4 * (cfg.max_batch + cfg.max_queue) * cfg.replicas)
    return ingress.bind(engine, config)


def _router_config(cfg: ClusterConfig) -> dict | None:
    if cfg.router == "pow2":
        return None                               # Ray Serve's default
    if cfg.router == "prefix":
        return {"request_router_class": PREFIX_ROUTER,
                "request_router_kwargs": {"imbalanced_threshold": cfg.imbalanced_threshold,
                                          "match_rate_threshold": cfg.min_match}}
    from promptlang.server.router import ROUTER_PATH

    return {"request_router_class": ROUTER_PATH,
            "request_router_kwargs": {"imbalanced_threshold": cfg.imbalanced_threshold,
                                      "min_match": cfg.min_match,
                                      "report_grace_s": 5 * cfg.stats_period_s},
            "request_routing_stats_period_s": cfg.stats_period_s}


def serve_cluster(config: ClusterConfig, *, host: str = "127.0.0.1", port: int = 8000,
                  num_cpus: int | None = None) -> None:
    """Start a local Ray cluster (or join the one RAY_ADDRESS names, or this process is
    connected to), serve the application on host:port until SIGINT/SIGTERM, then shut the
    local cluster down (on a joined one: delete the application)."""
    import ray

    config.check()
    if host not in ("127.0.0.1", "localhost", "::1") and config.api_key is None:
        print(f"promptlang serve --ray: listening on {host} with no --api-key: anyone who "
              "can reach it can use the model", file=sys.stderr)
    stop = threading.Event()

    def on_signal(*_):
        stop.set()
    for sig in (signal.SIGINT, signal.SIGTERM):    # before the slow start: a stop request
        signal.signal(sig, on_signal)             # during it is kept, not lost
    joined = bool(os.environ.get("RAY_ADDRESS")) or ray.is_initialized()
    try:
        if not ray.is_initialized():
            if joined:                                 # join the cluster RAY_ADDRESS names
                ray.init()
            else:                                      # a local one, on this machine only
                ray.init(num_cpus=num_cpus or os.cpu_count(), include_dashboard=False)
        for sig in (signal.SIGINT, signal.SIGTERM):    # Ray's own handlers replaced ours
            signal.signal(sig, on_signal)
        if not stop.is_set():
            serve.start(http_options={"host": host, "port": port})
            serve.run(build_app(dict(config.__dict__)), name="promptlang", route_prefix="/")
            print(f"promptlang serve --ray: ready on http://{host}:{port}/v1", file=sys.stderr,
                  flush=True)
        stop.wait()
    finally:
        if ray.is_initialized():
            if joined:                # someone else's cluster: take away only this app
                serve.delete("promptlang")
            else:
                serve.shutdown()
                ray.shutdown()
