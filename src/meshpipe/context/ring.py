"""Ring attention: key/value blocks travel around the context-parallel group.

Each rank keeps its queries. At step ``t`` it holds the key/value block of group rank
``(rank - t) mod n``: it posts the send of that block to the next rank and the receive of
the following one from the previous rank, computes its queries against the block it holds
while the transfer runs, and folds the result into a running output with a log-sum-exp
merge. Backward runs the same ring again; each block's key/value gradient accumulator
travels with it and, after a full turn, arrives back at the block's owner. Communication
sits inside one ``autograd.Function``, so autograd never traces through it.

The layout is data: every rank learns every block's positions and document ids (see
``layout.py``) and plans each tile from them. A block that is one document in increasing
order is, against itself, one tile in the kernel's causal mode (``blockwise.CAUSAL``, which
skips the masked half). Blocks made of runs of consecutive positions (zigzag halves, the
documents of a pack) are cut into rectangles that are either unmasked or causal
(``masks.plan_pieces``): a zigzag off-diagonal tile is then its live half, and a pack never
materialises a mask or computes across documents. Only scattered positions fall back to a
tile with an additive mask. With the zigzag layout (rank ``r`` holds chunks ``r`` and
``2n-1-r``) every rank does the same work.

Tiles run on ``blockwise.kernel_for`` the device and dtype: ``CPU_FLASH`` on CPU (PyTorch's
CPU flash kernel, which returns the log-sum-exp and takes it back in backward), on CUDA the
flash kernel in bf16/fp16 and ``CUDA_EFFICIENT`` (the memory-efficient kernel, which does
the same) in float32, and ``MATH`` elsewhere, and wherever the scores are soft-capped
(Gemma 2: no fused kernel caps them). Causal squares are halved only for the CPU's kernels
(``BlockKernel.causal_leaf``); CUDA's skip the masked blocks of a whole square. On the
flash kernel the documents of a pack are one variable-length call per ring step
(``varlen.segments_of``), not one call each. Rows and
columns of a rectangle are views, not copies; partial results are merged in place, in
float32 whatever the input dtype. The first tile that covers every row is the running output
itself, so a step allocates nothing the size of the block beyond what the kernel returns.
Keys, values and their gradient accumulators travel as separate ``[b, s, h, d]`` tensors
(the accumulators in float32), with no stacking copy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..comm.collectives import COMM_LABEL, PendingTransfers, post_transfers
from .blockwise import BlockKernel, flash_takes, heads_first, kernel_for
from .derived import derived
from .layout import GroupLayout, attention_layout
from .masks import (MAX_JOINED_RUNS, MAX_RUNS, Piece, TokenRun, plan_block, plan_pieces,
                    split_causal, token_runs, window_applies)
from .tiles import SEQ, Tile, TileGradients, accumulate, attend, causal_square, empty_output
from .varlen import Segments, lse_per_token, segments_of

# Key/value blocks and their gradient accumulators use different tags so the two streams
# between a pair of ranks can never be matched with each other.
_KV_TAG = 11
_GRAD_KV_TAG = 12
_RING_LABEL = COMM_LABEL + "ring"


@dataclass(frozen=True)
class _Ring:
    """A context-parallel group seen as a ring, with each rank's block length."""

    group: dist.ProcessGroup | None
    rank: int
    size: int
    block_sizes: list[int]

    def source(self, step: int) -> int:
        """Group rank whose key/value block this rank holds at ``step``."""
        return (self.rank - step) % self.size

    def shift(self, tensors: tuple[Tensor, ...], step: int, tag: int) -> PendingTransfers:
        """Send ``tensors`` (``[b, s, h, d]`` blocks) to the next rank and receive, from the
        previous one, the blocks this rank holds at ``step``."""
        if self.size == 1:
            return PendingTransfers(tensors, [], (), _RING_LABEL)
        rows = self.block_sizes[self.source(step)]
        sent = tuple(tensor.contiguous() for tensor in tensors)
        received = [tensor.new_empty((tensor.shape[0], rows, *tensor.shape[2:]))
                    for tensor in sent]
        following, preceding = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        return post_transfers([(following, tensor) for tensor in sent],
                              [(preceding, tensor) for tensor in received], self.group, tag,
                              _RING_LABEL)


class _RingAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, ring: _Ring,
                plans: list[list[Tile]], scale: float, kernel: BlockKernel) -> Tensor:
        queries = heads_first(q, kernel.dtype)
        out = lse = None
        kv = (k, v)
        for step in range(ring.size):
            incoming = ring.shift(kv, step + 1, _KV_TAG) if step < ring.size - 1 else None
            out, lse = attend(kernel, queries, kv, plans[step], scale, out, lse)
            if incoming is not None:
                kv = incoming.wait()
        if out is None:
            out, lse = empty_output(queries)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.plans, ctx.scale, ctx.kernel = ring, plans, scale, kernel
        return out.transpose(1, 2).to(q.dtype)

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        ring, plans = ctx.ring, ctx.plans
        dtype = ctx.kernel.dtype
        tile = TileGradients(ctx.kernel, heads_first(q, dtype), heads_first(grad_output, dtype),
                              out, lse, ctx.scale)
        kv = (k, v)
        grad_kv_transfer = None
        for step in range(ring.size):
            incoming = ring.shift(kv, step + 1, _KV_TAG) if step < ring.size - 1 else None
            block_grads = [tile.gradients(piece, kv) for piece in plans[step]]
            # The accumulators arrive while this block's tiles compute; add to them only now.
            grad_k, grad_v = (None, None) if grad_kv_transfer is None else grad_kv_transfer.wait()
            for piece, (block_k, block_v) in zip(plans[step], block_grads):
                grad_k = accumulate(grad_k, block_k, SEQ, piece.cols, kv[0].shape)
                grad_v = accumulate(grad_v, block_v, SEQ, piece.cols, kv[1].shape)
            if grad_k is None:
                grad_k, grad_v = (torch.zeros(t.shape, device=t.device) for t in kv)
            grad_kv_transfer = ring.shift((grad_k, grad_v), step + 1, _GRAD_KV_TAG)
            if incoming is not None:
                kv = incoming.wait()
        grad_k, grad_v = grad_kv_transfer.wait()
        grad_q = tile.grad_queries.transpose(1, 2).to(q.dtype)
        return grad_q, grad_k.to(k.dtype), grad_v.to(v.dtype), None, None, None, None


class RingAttention(nn.Module):
    """Context-parallel attention over ``group`` with key/value blocks passed around a ring.

    Each rank passes its own queries/keys/values, and ``positions`` / ``doc_ids`` of its local
    tokens; any layout works, and the zigzag layout balances causal work. With
    ``positions=None`` the group holds one sequence split contiguously in rank order.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, scale: float | None = None):
        super().__init__()
        self.group = group
        self.scale = scale

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, positions: Tensor | None = None,
                doc_ids: Tensor | None = None, causal: bool = True, window: int | None = None,
                scale: float | None = None, softcap: float | None = None) -> Tensor:
        layout, _ = attention_layout("RingAttention", q, k, v, positions, doc_ids, causal,
                                     self.group)
        ring = _Ring(group=self.group, rank=dist.get_rank(self.group),
                     size=dist.get_world_size(self.group), block_sizes=layout.sizes)
        kernel = kernel_for(q.device, softcap, q.dtype)
        join = (partial(segments_of, rows=q.shape[0], device=q.device)
                if kernel.takes_segments and flash_takes(q) and lse_per_token() else None)

        def plan() -> list[list[Tile]]:
            everywhere = layout.gathered_positions()
            return _plan_ring(ring, layout, causal, kernel.causal_leaf, join,
                              window if window_applies(window, everywhere, layout.total)
                              else None)
        key = ("ring plans", id(self.group), ring.rank, tuple(layout.sizes), causal, window,
               kernel.causal_leaf, join is not None, q.shape[0], q.device)
        plans = derived(key, (positions, doc_ids), plan)
        scale = next(s for s in (scale, self.scale, 1.0 / math.sqrt(q.shape[-1]))
                     if s is not None)
        return _RingAttentionFunction.apply(q, k, v, ring, plans, scale, kernel)


def split_causal_attention(q: Tensor, k: Tensor, v: Tensor, scale: float | None) -> Tensor:
    """Causal attention over one process's plain sequence (``[b, s, h, d]``) on the blockwise
    kernel: the causal square halved down to ``CAUSAL_LEAF`` rows (``masks.split_causal``),
    the pieces merged by log-sum-exp. This is the ring's machinery on a ring of one rank; on
    the CPU flash kernel it skips masked work that one large causal call computes anyway."""
    count = q.shape[1]
    ring = _Ring(group=None, rank=0, size=1, block_sizes=[count])
    kernel = kernel_for(q.device, dtype=q.dtype)
    plans = [causal_square(count, True, kernel.causal_leaf)]
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return _RingAttentionFunction.apply(q, k, v, ring, plans, scale, kernel)


Join = Callable[[list[Piece], int, int], Segments | None]
"""Pieces of a query block x key block as one variable-length tile's segments, or None."""


def _plan_ring(ring: _Ring, layout: GroupLayout, causal: bool, leaf: int | None,
               join: Join | None = None, window: int | None = None) -> list[list[Tile]]:
    """This rank's tiles for each ring step.

    With a sliding ``window`` every block is planned from its mask (``plan_block``): a block
    wholly outside the window is skipped, not computed masked.

    A block whose positions run in increasing order within one document is, against itself,
    one causal square. Otherwise blocks made of runs of consecutive positions (zigzag halves,
    the documents of a pack) are cut into rectangles that need no mask (``plan_pieces``);
    causal squares longer than the kernel's ``leaf`` are halved until they are not
    (``split_causal``). On a kernel that takes ``varlen.Segments``, pieces that ``join``
    (a pack's documents) are one tile. Only scattered positions fall back to a tile with a
    materialised mask.
    """
    mine = ring.rank
    doc_ids = layout.doc_ids
    limit = MAX_RUNS if join is None else MAX_JOINED_RUNS
    runs = [token_runs(layout.positions[rank], None if doc_ids is None else doc_ids[rank],
                       limit) for rank in range(ring.size)]
    plans = []
    for step in range(ring.size):
        source = ring.source(step)
        count = ring.block_sizes[mine]
        tiles = None
        if window is None and source == mine and _one_increasing_document(
                runs[mine], layout.positions[mine]):
            tiles = [Tile.of_piece(part) for part in split_causal(Piece(None, None, causal),
                                                                   count, leaf)]
        elif window is None and runs[mine] is not None and runs[source] is not None:
            tiles = _tiles_of_runs(runs[mine], runs[source], causal, count,
                                   ring.block_sizes[source], leaf, join)
        if tiles is None:
            tiles = Tile.of_plan(plan_block(
                layout.positions[mine], None if doc_ids is None else doc_ids[mine],
                layout.positions[source], None if doc_ids is None else doc_ids[source],
                causal, window))
        plans.append(tiles)
    return plans


def _tiles_of_runs(q_runs: list[TokenRun], k_runs: list[TokenRun], causal: bool,
                   q_count: int, k_count: int, leaf: int | None,
                   join: Join | None) -> list[Tile] | None:
    """The tiles of a query block against a key block, both made of runs: one of segments
    where the pieces join, else a tile per piece (halved down to ``leaf``) where the blocks
    have at most ``MAX_RUNS`` runs, else None (a masked tile)."""
    pieces = plan_pieces(q_runs, k_runs, causal, q_count, k_count)
    joined = None if join is None else join(pieces, q_count, k_count)
    if joined is not None:
        return [Tile(None, None, joined)]
    if max(len(q_runs), len(k_runs)) > MAX_RUNS:
        return None
    return [Tile.of_piece(part) for piece in pieces for part in split_causal(piece, q_count, leaf)]


def _one_increasing_document(runs: list[TokenRun] | None, positions: Tensor) -> bool:
    """Whether a block is one document (or none) in strictly increasing position order: its
    causal mask against itself is then the square lower triangle."""
    if not runs or len({run.doc for run in runs}) > 1:
        return False
    return bool((positions[1:] > positions[:-1]).all())
