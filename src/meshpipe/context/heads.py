"""How Ulysses deals attention heads to the ranks of its group (pure bookkeeping).

Every rank gets ``split_sizes(heads_q, n)`` query heads (the first ranks one more), and the
key/value heads those query heads use. With grouped-query attention several query heads
share a key/value head; when the ranks outnumber the key/value heads, a key/value head
must reach every rank that has one of its query heads, so it is replicated, but only to
those ranks. Two deals are used:

- more key/value heads than ranks, or no fit below: rank ``r`` takes the next run of query
  heads in order, with the key/value heads the run touches (one is shared by two ranks
  where a run boundary cuts through its group);
- ranks a multiple of key/value heads: rank ``r`` serves key/value head ``r % heads_kv``
  only, and the ``n / heads_kv`` ranks of a head share its query heads. Each rank receives
  exactly one key/value head: the minimum.

The key/value all-to-all (``comm.collectives.all_to_all``) hands rank ``r`` part ``r`` of
``split_sizes``, so the per-rank key/value counts must follow that pattern. A contiguous
deal whose counts break it (e.g. ``[1, 2, 1]``) tops every rank up to the largest count
with copies of its last head: a few extra heads, only for such uneven deals.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..comm.collectives import split_sizes
from .interface import AttentionError


@dataclass(frozen=True)
class HeadPlan:
    """Query and key/value heads of every rank, in rank order.

    ``query_heads[r]`` are the global query heads rank ``r`` computes, ``kv_heads[r]`` the
    key/value heads it receives (``kv_heads[r][i]`` at local index ``i``).
    """

    heads_q: int
    heads_kv: int
    query_heads: tuple[tuple[int, ...], ...]
    kv_heads: tuple[tuple[int, ...], ...]

    @property
    def group_size(self) -> int:
        return self.heads_q // self.heads_kv

    def query_order(self) -> list[int]:
        """Query heads in the order the all-to-all hands them out (rank 0's first)."""
        return [head for heads in self.query_heads for head in heads]

    def kv_order(self) -> list[int]:
        """Key/value heads (with replicas) in the order the all-to-all hands them out."""
        return [head for heads in self.kv_heads for head in heads]

    def local_kv_index(self, rank: int) -> list[int]:
        """For each local query head of ``rank``, the local index of its key/value head."""
        position = {head: index for index, head in reversed(list(enumerate(self.kv_heads[rank])))}
        return [position[head // self.group_size] for head in self.query_heads[rank]]


def plan_heads(heads_q: int, heads_kv: int, ranks: int, where: str = "Ulysses") -> HeadPlan:
    """Deal ``heads_q`` query heads and ``heads_kv`` key/value heads to ``ranks`` ranks."""
    if heads_q < ranks:
        raise AttentionError(
            f"{where}: {heads_q} query heads cannot be spread over a Ulysses degree of {ranks}: "
            f"every rank needs at least one head; use a Ulysses degree <= {heads_q} (and "
            f"ring attention for the rest of the context parallelism)")
    if ranks > heads_kv and ranks % heads_kv == 0:
        return _plan_shared_kv_heads(heads_q, heads_kv, ranks)
    return _plan_contiguous(heads_q, heads_kv, ranks)


def _plan_shared_kv_heads(heads_q: int, heads_kv: int, ranks: int) -> HeadPlan:
    group = heads_q // heads_kv
    sharers = ranks // heads_kv
    shares = split_sizes(group, sharers)
    query_heads, kv_heads = [], []
    for rank in range(ranks):
        kv_head, share = rank % heads_kv, rank // heads_kv
        start = kv_head * group + sum(shares[:share])
        query_heads.append(tuple(range(start, start + shares[share])))
        kv_heads.append((kv_head,))
    return HeadPlan(heads_q, heads_kv, tuple(query_heads), tuple(kv_heads))


def _plan_contiguous(heads_q: int, heads_kv: int, ranks: int) -> HeadPlan:
    group = heads_q // heads_kv
    query_heads, kv_heads = [], []
    start = 0
    for count in split_sizes(heads_q, ranks):
        query_heads.append(tuple(range(start, start + count)))
        kv_heads.append(tuple(range(start // group, (start + count - 1) // group + 1)))
        start += count
    counts = [len(heads) for heads in kv_heads]
    if counts != split_sizes(sum(counts), ranks):
        widest = max(counts)
        kv_heads = [heads + (heads[-1],) * (widest - len(heads)) for heads in kv_heads]
    return HeadPlan(heads_q, heads_kv, tuple(query_heads), tuple(kv_heads))
