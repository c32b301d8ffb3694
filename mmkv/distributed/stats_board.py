"""Where engine replicas report their ``Engine.stats()``: a small Ray actor (no CPU) that keeps
each replica's latest report and when it came.

A batch replica reports once its engine is built and after every call it answers (``Replicas``);
a Serve replica on a heartbeat, so the board's totals are the cluster's figures once the work is
done. A replica that dies keeps its last report: its work happened. Each incarnation of a replica
reports under a name of its own, so a restarted replica's fresh counters never overwrite the old
ones.
"""

from __future__ import annotations

import time

import ray


@ray.remote(num_cpus=0)
class _Board:
    def __init__(self) -> None:
        self.reports: dict[str, tuple[float, dict[str, int]]] = {}

    def report(self, replica: str, stats: dict[str, int]) -> None:
        self.reports[replica] = (time.time(), stats)

    def snapshot(self, max_age_s: float | None) -> dict[str, dict[str, int]]:
        now = time.time()
        return {name: stats for name, (at, stats) in sorted(self.reports.items())
                if max_age_s is None or now - at <= max_age_s}


class StatsBoard:
    """Every replica's latest stats (``Replicas.stats``: read it after ``answer``). Guarantees: ``total(k)`` sums ``k`` over every replica incarnation that
    reported, dead ones included."""

    def __init__(self) -> None:
        self.actor = _Board.remote()

    def report(self, replica: str, stats: dict[str, int]) -> None:
        """Record ``replica``'s stats (waits until the board has them)."""
        ray.get(self.actor.report.remote(replica, stats))

    def snapshot(self, max_age_s: float | None = None) -> dict[str, dict[str, int]]:
        """Replica name -> its latest stats (only those reported within ``max_age_s``, if given)."""
        return ray.get(self.actor.snapshot.remote(max_age_s))

    def total(self, key: str) -> int:
        return sum(stats.get(key, 0) for stats in self.snapshot().values())
