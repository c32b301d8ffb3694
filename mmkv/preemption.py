"""Which running sequence gives way when the KV pool cannot hold a step's work.

Priority comes first: a sequence is never preempted while one of a lower priority class (a higher
``priority`` value) is a candidate. Within the lowest class a policy ranks the candidates:

* ``"newest"``: the latest arrival first (vLLM's rule; the default: over the preemption bench's
  grid of pools, ``"cost"`` preempted more often and recomputed more prompt tokens under
  ``"recompute"``, and swapped more bytes under ``"auto"``).
* ``"cost"``: the one whose preemption costs least, in seconds::

      cost = restore + wait * waited + progress * generated + repeat * preempted

  ``restore`` (s): what bringing it back will take (``restore_estimate``), the cheaper of
  recomputing its private tokens (their ``rebuild_flops`` / the measured FLOP/s) and swapping its
  private blocks out and back in (the measured latency + seconds per block x their number; only
  while the host tier has room), with this machine's speeds (``mmkv.restore_speeds``). A block
  is private when no other sequence references it: a shared prefix costs nothing to drop. A
  private block the radix tree holds counts too: a preemption happens only when no evictable
  block is left, so the blocks it frees are the first to be evicted.
  ``waited`` (s): since the request arrived; ``generated`` (tokens): its output so far;
  ``preempted``: how often it has been preempted already. The weights are ``CostWeights``:
  ``wait`` (s of cost per s waited), ``progress`` (s per generated token), ``repeat`` (s per
  earlier preemption).

Guarantees: the ranking is a total order (ties go to the newest), so the same state always picks
the same victim; under ``"cost"`` every preemption makes a sequence ``repeat`` seconds dearer, so a
sequence preempted ``k`` times is chosen again only when no candidate costs less than ``k * repeat``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, NamedTuple

if TYPE_CHECKING:
    from cache import KVCache
    from mmkv.sequence import Sequence

POLICIES = ("cost", "newest")


@dataclass(frozen=True, slots=True)
class CostWeights:
    """The ``"cost"`` policy's weights (``python -m mmkv.bench preemption`` measures them)."""

    wait: float = 0.05  # seconds of cost per second the request has waited
    progress: float = 0.002  # seconds of cost per token it has generated
    repeat: float = 0.1  # seconds of cost per time it was preempted before

    def __post_init__(self) -> None:
        for name in ("wait", "progress", "repeat"):
            if getattr(self, name) < 0:
                raise ValueError(f"CostWeights.{name} must be >= 0, got {getattr(self, name)}")


def preemption_cost(seq: Sequence, restore: float, now: float, weights: CostWeights) -> float:
    """``seq``'s cost in seconds (the module docstring); ``restore``: its restore estimate."""
    return (restore + weights.wait * max(0.0, now - (seq.arrival_time or now))
            + weights.progress * seq.num_generated + weights.repeat * seq.preemptions)


def rank_victims(candidates: list[Sequence], policy: str, weights: CostWeights,
                 restore: Callable[[Sequence], float], now: float) -> list[Sequence]:
    """``candidates`` in the order they give way: the lowest priority class first, within it by
    ``policy`` (``"cost"``: cheapest first; ``"newest"``: latest arrival first)."""
    if policy == "newest":
        return sorted(candidates, key=lambda s: (-s.params.priority, -s.arrival))
    costs = {s.seq_id: preemption_cost(s, restore(s), now, weights) for s in candidates}
    return sorted(candidates, key=lambda s: (-s.params.priority, costs[s.seq_id], -s.arrival))


@dataclass(frozen=True, slots=True)
class RestoreSpeeds:
    """What bringing a preempted sequence back costs on a machine: recomputing ``flops`` FLOP/s of
    ``text_rebuild_flops``; swapping ``swap_latency`` seconds plus ``swap_block_seconds`` per
    block, out and back in (``math.inf`` per block when there is no host tier)."""

    flops: float
    swap_latency: float
    swap_block_seconds: float

    def __post_init__(self) -> None:
        if not self.flops > 0:
            raise ValueError(f"RestoreSpeeds.flops must be > 0, got {self.flops}")
        if not (self.swap_latency >= 0 and self.swap_block_seconds > 0):
            raise ValueError(f"RestoreSpeeds swap figures must be >= 0 and > 0, got "
                             f"{self.swap_latency} and {self.swap_block_seconds}")


class Restore(NamedTuple):
    """How a sequence would be preempted (``"swap"`` or ``"recompute"``) and the estimated
    seconds of bringing it back that way."""

    how: str
    seconds: float


def restore_estimate(seq: Sequence, kv: KVCache, mode: str, rebuild_flops: Callable[[int, int], float],
                     speeds: RestoreSpeeds) -> Restore:
    """``seq``'s restore under preemption ``mode`` (``"auto"`` takes the cheaper of the two;
    without room in the host tier, or under ``"recompute"``, it is recomputed). Only its private
    blocks count (the module docstring)."""
    moved = sum(kv.pool.refcount[b] == 1 for b in seq.table.blocks)
    bs = kv.block_size
    recompute = rebuild_flops((len(seq.table.blocks) - moved) * bs, moved * bs) / speeds.flops
    host = kv.host_pool
    if host is None or host.num_free < moved or mode == "recompute":
        return Restore("recompute", recompute)
    swap = speeds.swap_latency + moved * speeds.swap_block_seconds
    if mode == "swap" or swap < recompute:
        return Restore("swap", swap)
    return Restore("recompute", recompute)
