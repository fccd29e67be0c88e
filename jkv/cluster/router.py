"""The KV-aware request router for Ray Serve: `routing.rank_replicas` over what each replica
reports (`Replica.record_routing_stats`) and the queue lengths Serve tracks."""

from __future__ import annotations

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from jkv.cluster.asgi import RoutedRequest
from jkv.cluster.routing import ReplicaView, rank_replicas


def _routed(pending: PendingRequest | None) -> RoutedRequest | None:
    args = [] if pending is None else pending.args
    return next((a for a in args if isinstance(a, RoutedRequest)), None)


class KVAwareRouter(FIFOMixin, RequestRouter):
    """A request goes to the replica that served its session or holds the longest prefix
    of its prompt, unless that one's queue is longer than the shortest by more than
    `bound`; anything else (no routed request: a call of another method) to any replica,
    Serve taking the shortest queue."""

    def initialize_state(self, bound: int = 4, **_) -> None:
        self.bound = int(bound)

    def _view(self, replica: RunningReplica) -> ReplicaView:
        stats = replica.routing_stats or {}
        queue = self.replica_queue_len_cache.get(replica.replica_id)
        return ReplicaView(replica.replica_id.unique_id,
                           stats.get("queue", 0) if queue is None else queue,
                           frozenset(stats.get("sessions", ())),
                           frozenset(stats.get("blocks", ())), stats.get("active", 0))

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        routed = _routed(pending_request)
        if routed is None or not candidate_replicas:
            return [candidate_replicas]
        by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
        groups = rank_replicas([self._view(r) for r in candidate_replicas], routed.hashes,
                               routed.session, self.bound)
        return [[by_name[name] for name in group] for group in groups]


__all__ = ["KVAwareRouter"]
