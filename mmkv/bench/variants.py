"""Engines that plan attention another way, for the benchmarks that measure what a planning
choice saves (``mmkv.runner.AttentionPlanning``); every other engine plans with both on."""

from __future__ import annotations

from mmkv.engine import Engine
from mmkv.runner import AttentionPlanning


class NoCascadeEngine(Engine):
    """Attends every sequence's pages apart, the pages it shares with others too."""

    attention_planning = AttentionPlanning(shared_prefix=False)


class CrossApartEngine(Engine):
    """Attends each image's cross-attention apart (a page gather and SDPA per image group)."""

    attention_planning = AttentionPlanning(one_call_cross=False)
