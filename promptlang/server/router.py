"""`ModuleAffinityRouter`: Ray Serve's request router, choosing replicas by the modules
they hold (the rule is affinity.py's; this file adapts it to Ray Serve's `RequestRouter`).

Ray Serve calls `choose_replicas` with the request as the ingress sent it to the engine
deployment (cluster.Call: its routing keys and their weights, routing.py) and takes the
returned ranks in order, within a rank the replica with the shortest queue that has room.
What each replica holds comes from two sources: the router records where it sent each
request (the replica will hold those modules), and each replica reports, every
`request_routing_stats_period_s`, the routing keys whose KV is still in its memory tiers
(`EngineReplica.record_routing_stats`), which replaces what was recorded of it (but for
what was sent to it in the last `report_grace_s`: a report can be older). A replica
that dies, or leaves in a scale-down, is forgotten.

Imported only where Ray Serve is installed (the `cluster` extra).
"""

from __future__ import annotations

from typing import Any, List, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from promptlang.server.affinity import (DEFAULT_IMBALANCED_THRESHOLD, DEFAULT_MIN_MATCH,
                                        DEFAULT_REPLICA_BYTES, AffinityTable, rank_replicas)

ROUTER_PATH = "promptlang.server.router:ModuleAffinityRouter"


class ModuleAffinityRouter(RequestRouter):
    """Replicas holding the most of a request's module bytes first (when one holds at least
    `min_match` of them); the least loaded first when queue lengths differ by more than
    `imbalanced_threshold` (affinity.rank_replicas)."""

    def initialize_state(self, imbalanced_threshold: float = DEFAULT_IMBALANCED_THRESHOLD,
                         min_match: float = DEFAULT_MIN_MATCH,
                         replica_bytes: int = DEFAULT_REPLICA_BYTES,
                         report_grace_s: float = 5.0) -> None:
        self._table = AffinityTable(int(replica_bytes))
        self._grace = float(report_grace_s)
        self._threshold = float(imbalanced_threshold)
        self._min_match = float(min_match)
        self._reports: dict[ReplicaID, Any] = {}     # the report last taken, per replica

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None
                              ) -> List[List[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True   # no replica had room
        by_id = {replica.replica_id: replica for replica in candidate_replicas}
        for replica in candidate_replicas:
            self._take_report(replica)
        queued = {rid: self.replica_queue_len_cache.get(rid) or 0 for rid in by_id}
        ranks = rank_replicas(request_keys(pending_request), list(by_id), queued,
                              self._table, self._threshold, self._min_match)
        return [[by_id[rid] for rid in rank] for rank in ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: Any) -> None:
        self._table.record(replica_id, request_keys(pending_request))

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._table.drop(replica_id)
        self._reports.pop(replica_id, None)

    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        super().update_replicas(replicas)
        current = [replica.replica_id for replica in replicas]
        self._table.keep_only(current)
        for gone in set(self._reports) - set(current):
            del self._reports[gone]

    def _take_report(self, replica: RunningReplica) -> None:
        stats = replica.routing_stats or {}
        held = stats.get("held")
        if held is None or self._reports.get(replica.replica_id) is stats:
            return
        self._reports[replica.replica_id] = stats
        self._table.observe(replica.replica_id, held, self._grace, stats.get("capacity"))


def request_keys(pending_request: Optional[PendingRequest]) -> dict[str, int]:
    """The routing keys (-> weights) of the request: its first argument's `keys`."""
    if pending_request is None or not pending_request.args:
        return {}
    keys = getattr(pending_request.args[0], "keys", None)
    return dict(keys) if isinstance(keys, dict) else {}
