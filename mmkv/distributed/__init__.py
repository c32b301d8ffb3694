"""Scale-out on Ray: batch Q&A over Ray Data on engine replicas built once, with image/prefix
affinity (``Replicas``, ``answer``), and the
multi-replica Serve app with its cache-aware router (``serve_app``, ``router``). Needs the ``ray``
extra: ``pip install 'mmkv[ray]'``. The public names load on first use, so a worker that only
reads rows (``rows``) does not load the engine."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmkv.lazy import lazy_exports

if TYPE_CHECKING:
    from mmkv.distributed.batch import Replicas, answer
    from mmkv.distributed.stats_board import StatsBoard

_HOMES = {"Replicas": "mmkv.distributed.batch", "StatsBoard": "mmkv.distributed.stats_board",
          "answer": "mmkv.distributed.batch"}

__all__ = sorted(_HOMES)
__getattr__, __dir__ = lazy_exports(globals(), _HOMES)
