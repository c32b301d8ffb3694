"""Prometheus metrics of one server, in a registry of its own (two servers in one process do not mix).

Gauges and counters are read at scrape time from the engines' latest ``stats()`` snapshots, so they
are exactly the engines' figures: summed over replicas under the single-engine names, and, when
there are several replicas, once more per replica under ``mmkv_replica_*`` with a ``replica``
label (so that summing over the labelled series never counts a replica twice). The two histograms
are observed by the HTTP front per request.
"""

from __future__ import annotations

from typing import Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
GAUGES = {  # metric: (help, how to read it from engine stats)
    "mmkv_requests_running": ("Requests with a sequence in the running batch", "requests_running"),
    "mmkv_requests_waiting": ("Requests queued or preempted, not running", "requests_waiting"),
    "mmkv_kv_blocks_in_use": ("KV blocks referenced by requests", "blocks_in_use"),
    "mmkv_kv_blocks_total": ("KV blocks in the device pool", "blocks_total"),
    "mmkv_kv_pool_tokens": ("Tokens the device KV pool holds (more with a compressed --kv-cache-dtype)",
                            "kv_pool_tokens"),
    "mmkv_kv_pool_bytes": ("Bytes of the device KV pool, compressed blocks' scales included",
                           "kv_pool_bytes"),
    "mmkv_weight_bytes": ("Bytes of the model's weights as held (quantized layers at their codes, "
                          "scales and offsets; a draft model's included)", "weight_bytes"),
}
COUNTERS = {  # metric (without _total): (help, stats keys summed)
    "mmkv_prompt_tokens": ("Prompt tokens submitted", ("prompt_tokens",)),
    "mmkv_cached_prompt_tokens": ("Prompt tokens served from the radix tree", ("cached_prompt_tokens",)),
    "mmkv_generation_tokens": ("Tokens generated", ("generated_tokens",)),
    "mmkv_encoder_calls": ("Vision encoder calls", ("encoder_calls",)),
    "mmkv_preemptions": ("Sequences preempted (swapped or recomputed)",
                         ("preemptions_swap", "preemptions_recompute")),
    "mmkv_preemptions_swap": ("Preemptions that swapped the sequence to the host tier",
                              ("preemptions_swap",)),
    "mmkv_preemptions_recompute": ("Preemptions that dropped the sequence's K/V to recompute",
                                   ("preemptions_recompute",)),
    "mmkv_recomputed_tokens": ("Tokens computed again after a preemption", ("recomputed_tokens",)),
    "mmkv_swapped_bytes": ("Bytes of K/V swapped to the host tier", ("swapped_bytes",)),
    "mmkv_evictions": ("Cached KV blocks evicted", ("evictions",)),
    "mmkv_spec_drafted_tokens": ("Draft tokens proposed by speculative decoding", ("spec_drafted_tokens",)),
    "mmkv_spec_accepted_tokens": ("Draft tokens the target accepted", ("spec_accepted_tokens",)),
    "mmkv_xattn_blocks_computed": ("Image cross-attention KV blocks computed", ("xattn_blocks_computed",)),
    "mmkv_xattn_blocks_reused": ("Image cross-attention KV blocks taken from the cache", ("xattn_blocks_reused",)),
}
RATIOS = {  # metric: (help, numerator key, denominator key), over every replica's sums
    "mmkv_kv_usage_fraction": ("Share of the device KV pool's blocks referenced by requests",
                               "blocks_in_use", "blocks_total"),
    "mmkv_prefix_cache_hit_rate": ("Share of submitted prompt tokens served from the radix tree",
                                   "cached_prompt_tokens", "prompt_tokens"),
}
MAXIMA = {  # metric: (help, stats key), the largest over replicas
    "mmkv_max_preemptions_per_request": ("The most times one request was preempted",
                                         "max_preemptions_per_request"),
}


def _replica_name(name: str) -> str:
    return name.replace("mmkv_", "mmkv_replica_", 1)


class _EngineStats(Collector):
    def __init__(self) -> None:
        self.replicas: dict[str, dict[str, int]] = {}  # set before each scrape

    def collect(self) -> Iterator[Metric]:
        replicas = self.replicas
        for name, (text, key) in GAUGES.items():
            yield GaugeMetricFamily(name, text, value=sum(s.get(key, 0) for s in replicas.values()))
        for name, (text, keys) in COUNTERS.items():
            yield CounterMetricFamily(name, text, value=sum(s.get(k, 0) for s in replicas.values()
                                                           for k in keys))
        for name, (text, key) in MAXIMA.items():
            yield GaugeMetricFamily(name, text, value=max((s.get(key, 0) for s in replicas.values()),
                                                          default=0))
        for name, (text, top, bottom) in RATIOS.items():
            total = sum(s.get(bottom, 0) for s in replicas.values())
            yield GaugeMetricFamily(name, text, value=sum(s.get(top, 0) for s in replicas.values()) / total
                                    if total else 0.0)
        if len(replicas) < 2:
            return
        for name, (text, key) in GAUGES.items():
            family = GaugeMetricFamily(_replica_name(name), f"{text}, per replica", labels=["replica"])
            for replica, s in replicas.items():
                family.add_metric([replica], s.get(key, 0))
            yield family
        for name, (text, keys) in COUNTERS.items():
            family = CounterMetricFamily(_replica_name(name), f"{text}, per replica", labels=["replica"])
            for replica, s in replicas.items():
                family.add_metric([replica], sum(s.get(k, 0) for k in keys))
            yield family


class ServerMetrics:
    """The metrics ``GET /metrics`` shows: engine figures and per-request latency histograms."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._engines = _EngineStats()
        self.registry.register(self._engines)
        self.time_to_first_token = Histogram(
            "mmkv_time_to_first_token_seconds", "From request arrival to its first generated token",
            buckets=LATENCY_BUCKETS, registry=self.registry)
        self.request_latency = Histogram(
            "mmkv_request_latency_seconds", "From request arrival to its last token",
            buckets=LATENCY_BUCKETS, registry=self.registry)

    def render(self, replicas: dict[str, dict[str, int]]) -> bytes:
        """The exposition text, engine figures from ``replicas`` (replica name -> its stats)."""
        self._engines.replicas = replicas
        return generate_latest(self.registry)
