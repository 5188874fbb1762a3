"""`promptlang serve`: an OpenAI-compatible HTTP server over one engine (docs/SERVING.md).

    app.py      the routes: /v1/models, /v1/chat/completions, /v1/completions, /health,
                /metrics; errors as OpenAI error objects; server-sent events
    prompts.py  a request -> a prompt: chat messages, completion text, or the `promptlang`
                extension field (PML, or a @prompt function by name)
    worker.py   the engine's one thread and its bounded queue
    load.py     what `--schemas` names (PML files, folders of them, @prompt files)
    affinity.py module affinity: ranks replicas by the stored units a request needs
                (the routing rule of a multi-replica deployment; no Ray in it)
    routing.py  a request's modules named from its body, without the model (routing keys)
    cluster.py  promptlang on Ray Serve: the ingress, the engine replicas, `serve --ray`
    router.py   ModuleAffinityRouter: affinity.py on Ray Serve's RequestRouter
                (cluster.py and router.py import Ray: the `cluster` extra; docs/SCALING.md)

Importing this package imports FastAPI, not torch; `serve` loads the model.
"""

from __future__ import annotations

__all__ = ["create_app", "serve", "load_schemas"]


def __getattr__(name: str):
    import importlib

    home = {"create_app": "app", "serve": "load", "load_schemas": "load"}.get(name)
    if home is None:
        raise AttributeError(f"module 'promptlang.server' has no attribute {name!r}")
    return getattr(importlib.import_module(f"promptlang.server.{home}"), name)
