"""Hybrid (USP) context parallelism: Ulysses inside, ring across, and the factory."""

from __future__ import annotations

import torch.distributed as dist

from .interface import Attention
from .local import LocalAttention
from .ring import RingAttention
from .ulysses import UlyssesAttention


class HybridAttention(UlyssesAttention):
    """Ulysses over ``ulysses_group`` around ring attention over ``ring_group``.

    The context-parallel ranks form a ring x Ulysses grid (``topology`` puts the Ulysses
    axis innermost): the Ulysses all-to-all gathers the sequence of the ring rank's shard
    for a subset of heads, and ring attention runs across the ranks that hold the same heads
    of the other ring shards. Layout: the sequence is split over the ring (zigzag for causal
    balance, or per document for a pack), then each ring shard contiguously over Ulysses
    (``context.split_gather.hybrid_split`` / ``packed_hybrid_split``).
    """

    def __init__(self, ring_group: dist.ProcessGroup | None,
                 ulysses_group: dist.ProcessGroup | None, scale: float | None = None):
        super().__init__(RingAttention(ring_group, scale=scale), ulysses_group)


def make_attention(ulysses_group: dist.ProcessGroup | None = None,
                   ring_group: dist.ProcessGroup | None = None,
                   scale: float | None = None) -> Attention:
    """The attention for a context-parallel layout: local, Ulysses, ring or hybrid.

    A group of one rank (or None) means that axis is not used, so a model can call this
    with whatever groups its topology built.
    """
    use_ulysses = ulysses_group is not None and dist.get_world_size(ulysses_group) > 1
    use_ring = ring_group is not None and dist.get_world_size(ring_group) > 1
    if use_ulysses and use_ring:
        return HybridAttention(ring_group, ulysses_group, scale=scale)
    if use_ring:
        return RingAttention(ring_group, scale=scale)
    if use_ulysses:
        return UlyssesAttention(LocalAttention(scale=scale), ulysses_group)
    return LocalAttention(scale=scale)
