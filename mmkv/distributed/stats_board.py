"""Where engine replicas report their ``Engine.stats()``: a small Ray actor (no CPU) that keeps
each replica's latest report and when it came.

A replica reports after every batch it answers (Ray Data) or request it finishes, and on a
heartbeat (Serve), so the board's totals are the cluster's figures once the work is done. A
replica that dies keeps its last report: its work happened. Each incarnation of a replica reports
under a name of its own, so a restarted replica's fresh counters never overwrite the old ones.
"""

from __future__ import annotations

import time

import ray


@ray.remote(num_cpus=0)
class _Board:
    def __init__(self) -> None:
        self.reports: dict[str, tuple[float, dict[str, int]]] = {}
        self.first: dict[str, float] = {}

    def report(self, replica: str, stats: dict[str, int]) -> None:
        self.reports[replica] = (time.time(), stats)
        self.first.setdefault(replica, self.reports[replica][0])

    def first_reports(self) -> dict[str, float]:
        return dict(sorted(self.first.items()))

    def snapshot(self, max_age_s: float | None) -> dict[str, dict[str, int]]:
        now = time.time()
        return {name: stats for name, (at, stats) in sorted(self.reports.items())
                if max_age_s is None or now - at <= max_age_s}


class StatsBoard:
    """Every replica's latest stats. Pass one to ``answer(..., stats=board)``, read it after the
    dataset is consumed. Guarantees: ``total(k)`` sums ``k`` over every replica incarnation that
    reported, dead ones included."""

    def __init__(self) -> None:
        self.actor = _Board.remote()

    def report(self, replica: str, stats: dict[str, int]) -> None:
        """Record ``replica``'s stats (waits until the board has them)."""
        ray.get(self.actor.report.remote(replica, stats))

    def snapshot(self, max_age_s: float | None = None) -> dict[str, dict[str, int]]:
        """Replica name -> its latest stats (only those reported within ``max_age_s``, if given)."""
        return ray.get(self.actor.snapshot.remote(max_age_s))

    def first_reports(self) -> dict[str, float]:
        """Replica name -> when (``time.time()``) it first reported: when its engine was ready."""
        return ray.get(self.actor.first_reports.remote())

    def total(self, key: str) -> int:
        return sum(stats.get(key, 0) for stats in self.snapshot().values())
