"""`promptlang serve`: the OpenAI HTTP API over one engine (promptlang/server/).

    promptlang serve [--model PATH] [--host 127.0.0.1] [--port 8000]
                     [--schemas DIR_OR_FILE ...] [--api-key KEY] [--max-queue N] [--max-batch N]
                     [--recompute POLICY] [--model-name NAME]
                     [--memory-budget SIZE] [--disk-budget SIZE]
                     [--max-connections N] [--keep-alive S] [--header-timeout S]
                     [--body-timeout S]
                     [--ray [--replicas N] [--store DIR] [--router affinity|pow2|prefix]
                            [--threads N] [--replica-memory BYTES]]

Loads the model once, registers the schemas and @prompt functions named, and serves until
SIGINT or SIGTERM (requests in flight finish first). FastAPI, uvicorn and the runtime are
imported when the command runs. With --ray: the same API from N engine replicas on a local
Ray Serve cluster, routed by the modules each holds (promptlang/server/cluster.py; needs
the `cluster` extra; docs/SCALING.md).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from promptlang.cli import numerics
from promptlang.cli.tune import hint_when_untuned

API_KEY_ENV = "PROMPTLANG_API_KEY"


def register(subparsers: Any) -> None:
    serve = subparsers.add_parser(
        "serve", help="serve the OpenAI HTTP API (chat, completions, PML)",
        description="An OpenAI-compatible server: /v1/models, /v1/chat/completions, "
                    "/v1/completions (with stream), /health, /metrics. PML prompts and "
                    "@prompt functions travel in the `promptlang` extension field "
                    "(docs/SERVING.md). Binds 127.0.0.1 unless --host says otherwise.")
    serve.add_argument("--model", metavar="PATH",
                       help="transformers model folder (default: the embedded SmolLM2-135M)")
    numerics.add(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    serve.add_argument("--schemas", nargs="+", default=[], metavar="DIR_OR_FILE",
                       help=".pml schema files, folders of them, or Python files of @prompt "
                            "functions (imported: their top-level code runs)")
    serve.add_argument("--api-key", metavar="KEY",
                       help=f"require 'Authorization: Bearer KEY' (or set {API_KEY_ENV})")
    serve.add_argument("--max-queue", type=int, default=64, metavar="N",
                       help="requests that may wait for the engine; more get 429 (default 64)")
    serve.add_argument("--max-batch", type=int, default=16, metavar="N",
                       help="requests decoded together, one pass per step (default 16)")
    serve.add_argument("--recompute", metavar="POLICY", default=None,
                       help="the default recompute policy (default exact; docs/RECOMPUTE.md)")
    serve.add_argument("--tail-mib", type=int, default=None, metavar="MIB",
                       help="KV of recent requests' prompt tails kept for later requests "
                            "that start the same way (default 64; 0: off; runtime/kv/tails.py)")
    serve.add_argument("--memory-budget", metavar="SIZE", default=None,
                       help="RAM the module store may hold, e.g. 2GiB, or none for no limit "
                            "(with --ray: all replicas together, shared out evenly). Least "
                            "recently used units are evicted past it. Default: a quarter of "
                            "the RAM, at most 8 GiB.")
    serve.add_argument("--disk-budget", metavar="SIZE", default=None,
                       help="disk the module store may fill in its folder, e.g. 10GiB, 0 for "
                            "no disk tier, or none for no limit (with --ray: the folder the "
                            "replicas share, every replica's files counted). Default: a tenth "
                            "of the free space there, at most 20 GiB.")
    serve.add_argument("--max-connections", type=int, default=None, metavar="N",
                       help="connections served at once, more get 503. Default 512, 0 for "
                            "no limit.")
    serve.add_argument("--keep-alive", type=int, default=None, metavar="S",
                       help="seconds an idle keep-alive connection stays open (default 5)")
    serve.add_argument("--header-timeout", type=float, default=None, metavar="S",
                       help="seconds a request's line and headers may take to arrive, then "
                            "408 and the connection closes. Default 10.")
    serve.add_argument("--body-timeout", type=float, default=None, metavar="S",
                       help="seconds a request's body may take to arrive, then 408 and the "
                            "connection closes. Default 30.")
    serve.add_argument("--model-name", metavar="NAME", default=None,
                       help="the model id clients send and /v1/models lists (default: the "
                            "model's name)")
    ray = serve.add_argument_group("scale-out on Ray Serve (pip install 'promptlang[cluster]')")
    ray.add_argument("--ray", action="store_true",
                     help="serve from engine replicas on a local Ray Serve cluster")
    ray.add_argument("--replicas", type=int, default=2, metavar="N",
                     help="engine replicas (default 2)")
    ray.add_argument("--store", metavar="DIR", default=None,
                     help="the disk tier the replicas share (default PROMPTLANG_HOME/kv; a "
                          "network filesystem across machines)")
    ray.add_argument("--router", choices=("affinity", "pow2", "prefix"), default="affinity",
                     help="module affinity (default), Ray Serve's power of two choices, or "
                          "Ray Serve LLM's prefix-cache router")
    ray.add_argument("--threads", type=int, default=None, metavar="N",
                     help="torch threads per replica (default: cores / replicas)")
    ray.add_argument("--replica-memory", type=int, default=None, metavar="BYTES",
                     help="each replica's memory tier for module KV, in bytes (default: "
                          "--memory-budget shared out over the replicas)")
    serve.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    from promptlang.errors import InvalidArgumentError
    from promptlang.home import kv_dir
    from promptlang.runtime import engine
    from promptlang.server.load import load_schemas, serve
    from promptlang.sizes import format_size

    if not 0 < args.port < 65536:
        print(f"promptlang serve: --port must be 1-65535, not {args.port}", file=sys.stderr)
        return 2
    if args.max_queue < 1 or args.max_batch < 1:
        print("promptlang serve: --max-queue and --max-batch must be at least 1",
              file=sys.stderr)
        return 2
    limits = {"--max-connections": args.max_connections, "--keep-alive": args.keep_alive,
              "--body-timeout": args.body_timeout, "--header-timeout": args.header_timeout}
    for flag, value in limits.items():
        if value is not None and (value < 0 or (value == 0 and flag != "--max-connections")):
            print(f"promptlang serve: {flag} must be positive, not {value}", file=sys.stderr)
            return 2
    if args.tail_mib is not None and args.tail_mib < 0:
        print(f"promptlang serve: --tail-mib must be >= 0, not {args.tail_mib}",
              file=sys.stderr)
        return 2
    if args.ray:
        if args.memory_budget is not None and args.replica_memory is not None:
            print("promptlang serve: give --memory-budget (all replicas together) or "
                  "--replica-memory (each replica), not both", file=sys.stderr)
            return 2
        if args.tail_mib is not None:
            print("promptlang serve: --tail-mib is not available with --ray yet (each replica "
                  "keeps the default 64 MiB)", file=sys.stderr)
            return 2
        if numerics.load_options(args):
            print("promptlang serve: --dtype, --quantize, --kv-dtype, --int8-linears and "
                  "--bf16-attention are not available with --ray yet (the replicas load the checkpoint as it is)",
                  file=sys.stderr)
            return 2
        return _serve_ray(args)
    options: dict[str, Any] = {} if args.recompute is None else {"recompute": args.recompute}
    if args.tail_mib is not None:
        options["tail_budget_bytes"] = args.tail_mib << 20
    try:
        budgets = store_budgets(args.memory_budget, args.disk_budget)
    except InvalidArgumentError as error:
        print(f"promptlang serve: {error}", file=sys.stderr)
        return 2
    options.update(budgets)
    print(f"promptlang serve: module store budgets: memory "
          f"{format_size(budgets['memory_budget_bytes'])}, disk "
          f"{format_size(budgets['disk_budget_bytes'])} ({kv_dir()})", file=sys.stderr)
    llm = engine.load(args.model, **options, **numerics.load_options(args))
    hint_when_untuned(llm, args.model)
    functions = load_schemas(llm, args.schemas)
    name = args.model_name or _model_name(args.model)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    print(f"promptlang serve: {name} on http://{args.host}:{args.port}/v1 "
          f"({len(functions)} @prompt functions)", file=sys.stderr)
    serve(llm, functions=functions, host=args.host, port=args.port, api_key=api_key,
          model_name=name, max_queue=args.max_queue, max_batch=args.max_batch,
          **connection_limits(args))
    return 0


def _serve_ray(args: argparse.Namespace) -> int:
    from promptlang.errors import PromptLangError
    from promptlang.home import kv_dir
    from promptlang.sizes import format_size

    store = os.path.abspath(args.store) if args.store else str(kv_dir())
    try:
        memory, disk = cluster_budgets(args, store)
    except PromptLangError as error:
        print(f"promptlang serve --ray: {error}", file=sys.stderr)
        return 2
    try:
        from promptlang.server.cluster import ClusterConfig, serve_cluster
    except ImportError as missing:
        print(f"promptlang serve --ray: Ray Serve is not installed ({missing}); "
              "pip install 'promptlang[cluster]'", file=sys.stderr)
        return 2
    config = ClusterConfig.from_args({
        "store": store,
        "replicas": args.replicas,
        "model": os.path.abspath(args.model) if args.model and os.path.exists(args.model)
        else args.model,
        "schemas": [os.path.abspath(s) for s in args.schemas], "threads": args.threads,
        "device_budget_bytes": memory, "disk_budget_bytes": disk, "max_batch": args.max_batch,
        "max_queue": args.max_queue, "recompute": args.recompute,
        "api_key": args.api_key or os.environ.get(API_KEY_ENV) or None,
        "model_name": args.model_name or _model_name(args.model), "router": args.router})
    print(f"promptlang serve --ray: {config.replicas} replicas of {config.model_name} on "
          f"http://{args.host}:{args.port}/v1 (router {config.router}, shared store "
          f"{config.store})", file=sys.stderr)
    print(f"promptlang serve --ray: module store budgets: memory {format_size(memory)} per "
          f"replica, disk {format_size(disk)} for the shared folder", file=sys.stderr)
    serve_cluster(config, host=args.host, port=args.port)
    return 0


def cluster_budgets(args: argparse.Namespace, store: str) -> tuple[int | None, int | None]:
    """(each replica's memory budget, the shared folder's disk budget) for `serve --ray`:
    --replica-memory as given, else --memory-budget (or the machine's default) shared out
    evenly over the replicas; --disk-budget (or a tenth of the free space, as `serve`) for
    the folder every replica trims, all replicas' files counted."""
    from promptlang.errors import InvalidArgumentError
    from promptlang.sizes import default_disk_budget, default_memory_budget, parse_size

    if args.replica_memory is not None:
        if args.replica_memory < 0:
            raise InvalidArgumentError(f"--replica-memory must be >= 0, not "
                                       f"{args.replica_memory}")
        memory = args.replica_memory
    else:
        total = (default_memory_budget() if args.memory_budget is None
                 else parse_size(args.memory_budget, "--memory-budget"))
        memory = None if total is None else total // max(1, args.replicas)
    disk = (default_disk_budget(Path(store)) if args.disk_budget is None
            else parse_size(args.disk_budget, "--disk-budget"))
    return memory, disk


DEFAULT_MODEL_NAME = "smollm2-135m-instruct"


def connection_limits(args: argparse.Namespace) -> dict[str, Any]:
    """`serve`'s connection keyword arguments the command line gives (the rest default)."""
    limits: dict[str, Any] = {}
    if args.max_connections is not None:
        limits["limit_concurrency"] = args.max_connections or None
    if args.keep_alive is not None:
        limits["timeout_keep_alive"] = args.keep_alive
    if args.body_timeout is not None:
        limits["body_timeout"] = args.body_timeout
    if args.header_timeout is not None:
        limits["header_timeout"] = args.header_timeout
    return limits


def store_budgets(memory: str | None, disk: str | None) -> dict[str, int | None]:
    """`load`'s store budgets from --memory-budget / --disk-budget (None: the defaults sized
    to this machine, promptlang/sizes.py)."""
    from promptlang.home import kv_dir
    from promptlang.sizes import default_disk_budget, default_memory_budget, parse_size

    return {"memory_budget_bytes": default_memory_budget() if memory is None
            else parse_size(memory, "--memory-budget"),
            "disk_budget_bytes": default_disk_budget(kv_dir()) if disk is None
            else parse_size(disk, "--disk-budget")}


def _model_name(model: str | None) -> str:
    """The id clients send: the model folder's name, or the default model's."""
    if model:
        return os.path.basename(os.path.normpath(str(model))) or str(model)
    return DEFAULT_MODEL_NAME
