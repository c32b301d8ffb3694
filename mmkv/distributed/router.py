"""The Serve request router of ``mmkv serve --replicas N``: ``routing.rank_replicas`` and
``routing.rank_by_prefix`` on Ray Serve's ``RequestRouter`` API.

Each request carries its affinity key, or its prompt's ``PrefixRoute``, as the ``affinity``
keyword (computed by the ingress: ``ReplicaSetFront``). Every replica is returned as a rank of its
own, most preferred first, so Serve sends the request to the first that accepts it (one whose
queue is full refuses and the next is tried). A route is recorded in the router's
``PrefixIndex`` on the replica ranked first, and on the replica that accepts it if another; a
replica that dies is forgotten.

A replica's queue length is the larger of two figures:

- Serve's: the router's cache (raised as requests are sent, overwritten by each replica's reply
  to a send) or, for replicas it has no fresh figure for, a probe (0 when the probe goes
  unanswered). In a burst the replicas' replies lag the sends, and Serve ranks many requests at
  once, so this figure can stay near 0 while dozens of requests head for one replica.
- This router's own count of the requests it placed there: those it ranked the replica first for
  (until they are accepted, or for ``CLAIM_S`` seconds if they never are) and those the replica
  accepted (until they complete). Serve calls ``choose_replicas`` for every ranking, and
  ``on_request_routed`` / ``on_request_completed`` on this router's event loop, so the count is
  exact for this router's requests (the ingress is the replicas' only caller). A replica that
  dies takes its requests' completions with it: they stop counting then.
"""

from __future__ import annotations

import time
from typing import List, Optional

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from mmkv.distributed.prefix_index import PrefixIndex, PrefixRoute
from mmkv.distributed.routing import rank_by_prefix, rank_replicas

CLAIM_S = 2.0  # a ranked request neither accepted nor re-ranked for this long no longer counts


class CacheAwareRouter(RequestRouter):
    """Routes requests with one affinity key (an image, a chat's earlier turns) to one replica,
    and a prompt to the replica holding the longest of its prefixes, while the load is balanced;
    to the shortest queue when it is not (see ``routing.py``)."""

    def initialize_state(self, threshold: int = 8, ratio: float = 1.5) -> None:
        self.threshold = threshold
        self.ratio = ratio
        self.clock = time.monotonic
        self.claims: dict[str, tuple[str, float]] = {}  # request id -> (replica ranked first, when)
        self.accepted: dict[str, str] = {}  # request id -> the replica running it
        self.prefixes = PrefixIndex()

    def placed(self) -> dict[str, int]:
        """This router's requests per replica: accepted and not completed, or ranked within ``CLAIM_S``."""
        now = self.clock()
        self.claims = {rid: claim for rid, claim in self.claims.items() if now - claim[1] < CLAIM_S}
        counts: dict[str, int] = {}
        for replica in [*self.accepted.values(), *(replica for replica, _ in self.claims.values())]:
            counts[replica] = counts.get(replica, 0) + 1
        return counts

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
        placed = self.placed()
        lens = {r: max(n, placed.get(r, 0)) for r, n in lens.items()}
        key = pending_request.kwargs.get("affinity") if pending_request is not None else None
        if isinstance(key, PrefixRoute) and lens:
            ranked = rank_by_prefix(key, self.prefixes, lens, self.threshold, self.ratio)
            self.prefixes.record(ranked[0], key)
        else:
            ranked = rank_replicas(key, lens, self.threshold, self.ratio)
        if pending_request is not None and ranked:
            self.claims[pending_request.metadata.internal_request_id] = (ranked[0], self.clock())
        return [[by_id[r]] for r in ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        request_id = pending_request.metadata.internal_request_id
        claim = self.claims.pop(request_id, None)
        self.accepted[request_id] = replica_id.unique_id
        key = pending_request.kwargs.get("affinity")
        if isinstance(key, PrefixRoute) and (claim is None or claim[0] != replica_id.unique_id):
            self.prefixes.record(replica_id.unique_id, key)

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        # A refused send completes too, possibly after its request was accepted elsewhere.
        if self.accepted.get(internal_request_id) == replica_id.unique_id:
            del self.accepted[internal_request_id]

    def on_replica_actor_died(self, replica_id) -> None:
        """The requests placed on a dead replica will not complete: they no longer count."""
        super().on_replica_actor_died(replica_id)
        gone = replica_id.unique_id
        self.prefixes.forget(gone)
        self.accepted = {rid: replica for rid, replica in self.accepted.items() if replica != gone}
        self.claims = {rid: claim for rid, claim in self.claims.items() if claim[0] != gone}
