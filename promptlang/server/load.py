"""What `promptlang serve --schemas` names, registered on an engine; and `serve` itself.

A `.pml` file holds one schema; a folder is every `.pml` file in it (not below it); a `.py`
file is compiled like `promptlang compile` does (it runs: its top-level code executes) and
its @prompt functions are served by name, each schema registered up front. Any error is a
located PromptLangError, raised before the server starts.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Sequence

from promptlang.errors import DocumentKindError, DuplicateNameError, InputFileError

DEFAULT_HOST = "127.0.0.1"       # loopback unless told otherwise
DEFAULT_PORT = 8000
LIMIT_CONCURRENCY = 512          # connections (or tasks) at once; uvicorn answers 503 beyond
TIMEOUT_KEEP_ALIVE_S = 5         # an idle keep-alive connection is closed after this
MAX_HEADER_BYTES = 16 << 10      # h11: a request line and headers larger than this are a 400


def load_schemas(llm, sources: Sequence[str | os.PathLike]) -> dict[str, Any]:
    """Register the schemas `sources` name on `llm`; returns the @prompt functions found,
    by name."""
    schemas, functions = read_sources(sources)
    for schema in schemas:
        llm.add_schema(schema)
        llm.layout(schema.name)              # fits the model: fail now, not per request
    return functions


def read_sources(sources: Sequence[str | os.PathLike]) -> tuple[list, dict[str, Any]]:
    """The schemas `sources` name (PML schemas, and the schemas of the @prompt functions
    found) and those functions by name; no model needed (a cluster's ingress reads them
    to route requests: routing.py)."""
    from promptlang.pml import nodes
    from promptlang.pml.parser import parse_file

    schemas: list = []
    functions: dict[str, Any] = {}
    for source in sources:
        path = Path(source)
        if path.is_dir():
            files = sorted(p for p in path.glob("*.pml") if p.is_file())
            if not files:
                raise InputFileError(f"{path}: no .pml files in this folder")
        else:
            files = [path]
        for file in files:
            if file.suffix == ".py":
                found = _functions(file)
                functions.update(found)
                schemas += [fn.schema for fn in found.values()]
                continue
            parsed = parse_file(file)
            if not isinstance(parsed, nodes.Schema):
                raise DocumentKindError(f"{file} holds a prompt, not a schema", parsed.span)
            schemas.append(parsed)
    return schemas, functions


def _functions(path: Path) -> dict[str, Any]:
    from promptlang.compiler.pyfile import compile_file
    from promptlang.compiler.diagnostics import errors
    from promptlang.errors import CompileError

    compiled = compile_file(str(path))
    if errors(compiled.diagnostics):
        raise CompileError(compiled.diagnostics)
    found = {}
    for fn in compiled.functions:
        name = fn.__name__
        if name in found:
            raise DuplicateNameError(f"{path}: two @prompt functions are named {name!r}")
        found[name] = fn
    return found


def serve(llm, *, functions=None, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
          api_key: str | None = None, model_name: str = "promptlang", max_queue: int = 64,
          max_batch: int = 16, log_level: str = "info",
          limit_concurrency: int | None = LIMIT_CONCURRENCY,
          timeout_keep_alive: int = TIMEOUT_KEEP_ALIVE_S, body_timeout: float | None = None,
          max_header_bytes: int = MAX_HEADER_BYTES,
          header_timeout: float | None = None) -> None:
    """Serve `llm` over HTTP until SIGINT/SIGTERM (in-flight requests finish first).

    The connection limits are uvicorn's own settings (docs/SERVING.md, *Connections*):
    `limit_concurrency` connections or tasks at once (503 beyond; None: no limit),
    `timeout_keep_alive` seconds before an idle keep-alive connection is closed, and
    `max_header_bytes` of request line and headers (h11's incomplete-event limit), which
    must arrive within `header_timeout` seconds (None: 10; 408 and closed after:
    server/protocol.py).
    `body_timeout`: seconds a request's body may take to arrive (None: the app's default,
    30 s; then 408 and the connection is closed)."""
    import uvicorn

    from promptlang.server.app import BODY_TIMEOUT_S, create_app

    app = create_app(llm, functions=functions, model_name=model_name, api_key=api_key,
                     max_queue=max_queue, max_batch=max_batch,
                     body_timeout=BODY_TIMEOUT_S if body_timeout is None else body_timeout)
    if host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        print(f"promptlang serve: listening on {host} with no --api-key: anyone who can "
              "reach it can use the model", file=sys.stderr)
    uvicorn.run(app, host=host, port=port, log_level=log_level,
                timeout_graceful_shutdown=60, **uvicorn_limits(
                    limit_concurrency=limit_concurrency, timeout_keep_alive=timeout_keep_alive,
                    max_header_bytes=max_header_bytes, header_timeout=header_timeout))


def uvicorn_limits(limit_concurrency: int | None = LIMIT_CONCURRENCY,
                   timeout_keep_alive: int = TIMEOUT_KEEP_ALIVE_S,
                   max_header_bytes: int = MAX_HEADER_BYTES,
                   header_timeout: float | None = None) -> dict:
    """uvicorn.Config's keyword arguments for the server's connection limits: its own, and
    the h11 protocol with a deadline on each request's headers (server/protocol.py; None:
    its HEADER_TIMEOUT_S)."""
    from promptlang.server.protocol import HEADER_TIMEOUT_S, with_header_timeout

    if header_timeout is None:
        header_timeout = HEADER_TIMEOUT_S
    return {"limit_concurrency": limit_concurrency, "timeout_keep_alive": timeout_keep_alive,
            "h11_max_incomplete_event_size": max_header_bytes,
            "http": with_header_timeout(header_timeout)}
