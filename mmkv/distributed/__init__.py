"""Scale-out on Ray: batch Q&A over Ray Data with image/prefix affinity (``answer``), and the
multi-replica Serve app with its cache-aware router (``serve_app``, ``router``). Needs the ``ray``
extra: ``pip install 'mmkv[ray]'``."""

from mmkv.distributed.batch import answer
from mmkv.distributed.stats_board import StatsBoard

__all__ = ["StatsBoard", "answer"]
