"""Which tokens of a sequence each rank of a context-parallel group holds.

Pure bookkeeping, no communication. ``split_gather`` uses a ``ShardLayout`` to cut a full
tensor into a rank's shard and to put gathered shards back in sequence order; a data
loader uses the ``*_positions`` functions to know, without talking to its peers, which
global token positions (and, for packs, which documents) the local shard holds, so that it
can build RoPE positions and attention masks.

Layouts (``parts`` ranks, ``total`` tokens):

- contiguous: rank ``r`` holds one run; by default ``split_sizes(total, parts)``, so the
  first ``total % parts`` ranks hold one token more than the others;
- zigzag: the sequence in ``2 * parts`` equal chunks, rank ``r`` holds chunks ``r`` and
  ``2 * parts - 1 - r`` (balances causal attention work across a ring);
- packed: every document of a pack split contiguously across the ranks, a rank's shard
  being its piece of document 0, then of document 1, ...
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Sequence

import torch
from torch import Tensor

from meshpipe.comm.collectives import split_sizes

Segment = tuple[int, int]
"""``(start, length)``: a run of consecutive tokens of the full sequence."""


def _check_rank(rank: int, parts: int) -> None:
    if not 0 <= rank < parts:
        raise ValueError(f"rank {rank} is outside a group of {parts} ranks (0..{parts - 1})")


def _check_lengths(name: str, lengths: Sequence[int]) -> list[int]:
    lengths = [int(length) for length in lengths]
    if any(length < 0 for length in lengths):
        raise ValueError(f"{name} must be >= 0, got {lengths}")
    return lengths


@dataclass(frozen=True)
class ShardLayout:
    """For every rank of a group, the segments of the full sequence it holds, in local order.

    The segments of all ranks together cover ``0..total-1`` exactly once.
    """

    total: int
    segments: tuple[tuple[Segment, ...], ...]

    @classmethod
    def contiguous(cls, sizes: Sequence[int]) -> ShardLayout:
        """Rank ``r`` holds ``sizes[r]`` consecutive tokens following those of ranks before it."""
        sizes = _check_lengths("contiguous shard sizes", sizes)
        starts = list(accumulate(sizes, initial=0))
        return cls(starts[-1], tuple(((start, size),) for start, size in zip(starts, sizes)))

    @classmethod
    def zigzag(cls, total: int, parts: int) -> ShardLayout:
        """Chunks ``r`` and ``2*parts-1-r`` for rank ``r``; one rank holds everything."""
        if parts == 1:
            return cls.contiguous([total])
        if parts < 1 or total < 0 or total % (2 * parts) != 0:
            raise ValueError(
                f"zigzag sharding cuts the sequence into 2 x {parts} = {2 * parts} equal chunks, "
                f"but the sequence length {total} is not a multiple of {2 * parts}; pad or "
                f"trim the sequence to a multiple of {2 * parts}")
        chunk = total // (2 * parts)
        return cls(total, tuple(((rank * chunk, chunk), ((2 * parts - 1 - rank) * chunk, chunk))
                                for rank in range(parts)))

    @classmethod
    def packed(cls, seq_lens: Sequence[int], parts: int) -> ShardLayout:
        """Every document split contiguously (``split_sizes``) across the ranks."""
        seq_lens = _check_lengths("packed sequence lengths", seq_lens)
        if parts < 1:
            raise ValueError(f"a group needs at least one rank, got {parts}")
        per_rank: list[list[Segment]] = [[] for _ in range(parts)]
        for doc_start, length in zip(accumulate(seq_lens, initial=0), seq_lens):
            sizes = split_sizes(length, parts)
            for rank, (start, size) in enumerate(zip(accumulate(sizes, initial=doc_start), sizes)):
                per_rank[rank].append((start, size))
        return cls(sum(seq_lens), tuple(tuple(segments) for segments in per_rank))

    @property
    def world_size(self) -> int:
        return len(self.segments)

    def local_size(self, rank: int) -> int:
        _check_rank(rank, self.world_size)
        return sum(length for _, length in self.segments[rank])

    def local_sizes(self) -> list[int]:
        return [self.local_size(rank) for rank in range(self.world_size)]

    def positions(self, rank: int) -> Tensor:
        """Global positions of rank ``rank``'s tokens, in local order (int64)."""
        _check_rank(rank, self.world_size)
        runs = [torch.arange(start, start + length, device="cpu")
                for start, length in self.segments[rank]]
        return torch.cat(runs) if runs else torch.zeros(0, dtype=torch.int64, device="cpu")

    def take(self, full: Tensor, dim: int, rank: int) -> Tensor:
        """Rank ``rank``'s shard of ``full`` along ``dim`` (a new tensor)."""
        pieces = [full.narrow(dim, start, length) for start, length in self.segments[rank]]
        return torch.cat(pieces, dim) if pieces else full.narrow(dim, 0, 0).clone()

    def assemble(self, rank_major: Tensor, dim: int) -> Tensor:
        """The full sequence from the shards of every rank concatenated in rank order."""
        pieces = []
        offset = 0
        for segments in self.segments:
            for start, length in segments:
                pieces.append((start, offset, length))
                offset += length
        pieces.sort()
        if all(start == offset for start, offset, _ in pieces):
            return rank_major
        return torch.cat([rank_major.narrow(dim, offset, length)
                          for _, offset, length in pieces], dim)


def contiguous_positions(seq_len: int, cp_size: int, cp_rank: int) -> Tensor:
    """Global positions held by ``cp_rank`` under the default contiguous split."""
    return ShardLayout.contiguous(split_sizes(seq_len, cp_size)).positions(cp_rank)


def zigzag_positions(seq_len: int, cp_size: int, cp_rank: int) -> Tensor:
    """Global positions held by ``cp_rank`` under zigzag sharding (chunks r and 2cp-1-r)."""
    return ShardLayout.zigzag(seq_len, cp_size).positions(cp_rank)


def packed_positions(seq_lens: Sequence[int], cp_size: int, cp_rank: int) -> Tensor:
    """Positions in the pack held by ``cp_rank`` when every document is split across ranks."""
    return ShardLayout.packed(seq_lens, cp_size).positions(cp_rank)


def hybrid_positions(seq_len: int, ring_size: int, ring_rank: int, ulysses_size: int,
                     ulysses_rank: int) -> Tensor:
    """Positions held after a zigzag split over the ring, then a contiguous Ulysses split."""
    ring_positions = zigzag_positions(seq_len, ring_size, ring_rank)
    return ring_positions[contiguous_positions(len(ring_positions), ulysses_size, ulysses_rank)]


def packed_hybrid_positions(seq_lens: Sequence[int], ring_size: int, ring_rank: int,
                            ulysses_size: int, ulysses_rank: int) -> Tensor:
    """Positions held after a packed split over the ring, then a contiguous Ulysses split."""
    ring_positions = packed_positions(seq_lens, ring_size, ring_rank)
    return ring_positions[contiguous_positions(len(ring_positions), ulysses_size, ulysses_rank)]


def document_ids(seq_lens: Sequence[int], positions: Tensor) -> Tensor:
    """The index of the document of the pack that each position belongs to."""
    seq_lens = _check_lengths("packed sequence lengths", seq_lens)
    ends = torch.tensor(list(accumulate(seq_lens)), dtype=torch.int64, device=positions.device)
    if len(positions) and not 0 <= int(positions.min()) <= int(positions.max()) < sum(seq_lens):
        raise ValueError(f"positions must lie in 0..{sum(seq_lens) - 1} for a pack of "
                         f"lengths {seq_lens}")
    return torch.searchsorted(ends, positions, right=True)


def positions_in_document(seq_lens: Sequence[int], positions: Tensor) -> Tensor:
    """Each position relative to the start of its own document (RoPE restarts per document)."""
    starts = torch.tensor([0, *accumulate(seq_lens)], dtype=torch.int64,
                          device=positions.device)
    return positions - starts[document_ids(seq_lens, positions)]
