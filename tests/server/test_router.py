"""ModuleAffinityRouter (promptlang/server/router.py) on Ray Serve's RequestRouter, driven
directly with stand-in replicas: reports, routed requests, death and scale-down."""

from __future__ import annotations

import asyncio
import types

import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install -e "
                                        "'.[cluster]' (CI installs it)")

from ray.serve._private.common import (DeploymentHandleSource, DeploymentID,  # noqa: E402
                                       ReplicaID)

from promptlang.server.router import ModuleAffinityRouter  # noqa: E402

DEPLOYMENT = DeploymentID(name="engine", app_name="app")


class Replica:
    """What the router reads of a RunningReplica."""

    def __init__(self, name: str):
        self.replica_id = ReplicaID(name, DEPLOYMENT)
        self.routing_stats: dict = {}
        self.max_ongoing_requests = 10

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return 0


def pending(keys: dict) -> types.SimpleNamespace:
    call = types.SimpleNamespace(keys=keys)          # cluster.Call's routing keys
    return types.SimpleNamespace(args=(call,), kwargs={},
                                 routing_context=types.SimpleNamespace(should_backoff=False))


def names(ranks) -> list[list[str]]:
    return [[replica.replica_id.unique_id for replica in rank] for rank in ranks]


def test_the_router_follows_reports_and_routings_and_forgets_the_dead():
    async def scenario():
        router = ModuleAffinityRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN)
        router.initialize_state(imbalanced_threshold=4, report_grace_s=60)
        a, b, c = Replica("a"), Replica("b"), Replica("c")
        router.update_replicas([a, b, c])
        a.routing_stats = {"held": {"doc1": 10, "doc2": 10}, "capacity": None}
        request = pending({"doc2": 10, "doc1": 10, "doc3": 10})
        assert names(await router.choose_replicas([a, b, c], request))[0] == ["a"]
        assert request.routing_context.should_backoff     # Serve backs off, not spins
        # sent to b: b holds doc9 now, before any report from it
        router.on_request_routed(pending({"doc9": 10}), b.replica_id, None)
        assert names(await router.choose_replicas([a, b, c], pending({"doc9": 10})))[0] \
            == ["b"]
        # a reports again: doc1 evicted
        a.routing_stats = {"held": {"doc2": 10}, "capacity": None}
        ranks = names(await router.choose_replicas([a, b, c], pending({"doc1": 10})))
        assert ranks[0] != ["a"]
        # a dies; then c leaves in a scale-down: nothing of theirs is remembered
        router.on_replica_actor_died(a.replica_id)
        assert router._table.held_bytes(a.replica_id) == 0
        router.update_replicas([b])
        assert names(await router.choose_replicas([b], pending({"doc2": 10}))) == [["b"]]
        assert set(router._table._held) <= {b.replica_id}

    asyncio.run(scenario())
