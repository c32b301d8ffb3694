"""The Serve request router of ``mmkv serve --replicas N``: ``routing.rank_replicas`` on Ray
Serve's ``RequestRouter`` API.

Each request carries its affinity key as the ``affinity`` keyword (computed by the ingress:
``ReplicaSetFront``). Queue lengths come from the router's cache (updated as requests are sent and
finish) and, for replicas it has no fresh figure for, from a probe (0 when the probe goes
unanswered). Every replica is returned as a
rank of its own, most preferred first, so Serve sends the request to the first that accepts it
(one whose queue is full refuses and the next is tried).
"""

from __future__ import annotations

from typing import List, Optional

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from mmkv.distributed.routing import rank_replicas


class CacheAwareRouter(RequestRouter):
    """Routes requests with one affinity key (an image, a document prefix) to one replica while
    the load is balanced, and to the shortest queue when it is not (see ``routing.py``)."""

    def initialize_state(self, threshold: int = 8, ratio: float = 1.5) -> None:
        self.threshold = threshold
        self.ratio = ratio

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None
                              ) -> List[List[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        lens: dict[str, int] = {}
        unknown = []
        for r in candidate_replicas:
            queue_len = self.replica_queue_len_cache.get(r.replica_id)
            if queue_len is None:
                unknown.append(r)
            else:
                lens[r.replica_id.unique_id] = queue_len
        for r, queue_len in await self._probe_queue_lens(unknown, 0) if unknown else ():
            # No fresh figure means this router sent the replica nothing lately; one whose probe
            # misses the deadline (a busy machine) counts as idle instead of leaving the ranking,
            # or a burst would all go to the replicas that happened to answer.
            lens[r.replica_id.unique_id] = 0 if queue_len is None else queue_len
        key = pending_request.kwargs.get("affinity") if pending_request is not None else None
        return [[by_id[r]] for r in rank_replicas(key, lens, self.threshold, self.ratio)]
