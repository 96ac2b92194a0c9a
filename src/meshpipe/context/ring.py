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

Tiles run on ``blockwise.CPU_FLASH`` on CPU (PyTorch's CPU flash kernel, which returns the
log-sum-exp and takes it back in backward) and on ``blockwise.MATH`` elsewhere. Rows and
columns of a rectangle are views, not copies; partial results are merged in place, in
float32 whatever the input dtype. The first tile that covers every row is the running output
itself, so a step allocates nothing the size of the block beyond what the kernel returns.
Keys, values and their gradient accumulators travel as separate ``[b, s, h, d]`` tensors
(the accumulators in float32), with no stacking copy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.profiler import record_function

from ..comm.collectives import COMM_LABEL
from .blockwise import (CAUSAL, BlockKernel, TileMask, heads_first, kernel_for,
                        merge_block, tile_mask)
from .layout import GroupLayout, attention_layout
from .masks import (BlockPlan, Piece, TokenRun, plan_block, plan_pieces, split_causal,
                    token_runs)

# Key/value blocks and their gradient accumulators use different tags so the two streams
# between a pair of ranks can never be matched with each other.
_KV_TAG = 11
_GRAD_KV_TAG = 12
_RING_LABEL = COMM_LABEL + "ring"
CAUSAL_LEAF = 256
"""Causal squares longer than this are cut into halves (``masks.split_causal``)."""


class _Transfer:
    """Posted sends and receives; ``wait`` returns the received tensors."""

    def __init__(self, received: tuple[Tensor, ...], works: list,
                 keep_alive: tuple[Tensor, ...]):
        self._received = received
        self._works = works
        self._keep_alive: tuple[Tensor, ...] | None = keep_alive

    def wait(self) -> tuple[Tensor, ...]:
        with record_function(_RING_LABEL):
            for work in self._works:
                work.wait()
        self._keep_alive = None
        return self._received


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

    def shift(self, tensors: tuple[Tensor, ...], step: int, tag: int) -> _Transfer:
        """Send ``tensors`` (``[b, s, h, d]`` blocks) to the next rank and receive, from the
        previous one, the blocks this rank holds at ``step``."""
        if self.size == 1:
            return _Transfer(tensors, [], keep_alive=())
        rows = self.block_sizes[self.source(step)]
        sent = tuple(tensor.contiguous() for tensor in tensors)
        received = tuple(tensor.new_empty((tensor.shape[0], rows, *tensor.shape[2:]))
                         for tensor in sent)
        operations = []
        for outgoing, incoming in zip(sent, received):
            operations += [
                dist.P2POp(dist.isend, outgoing, group=self.group,
                           group_peer=(self.rank + 1) % self.size, tag=tag),
                dist.P2POp(dist.irecv, incoming, group=self.group,
                           group_peer=(self.rank - 1) % self.size, tag=tag)]
        with record_function(_RING_LABEL):
            works = dist.batch_isend_irecv(operations)
        return _Transfer(received, works, keep_alive=sent)


Index = Tensor | slice | None
"""Rows or columns of a tile: a local index range, an index tensor, or None for all."""


@dataclass(frozen=True)
class _Tile:
    """One kernel call: query rows ``rows`` against key columns ``cols`` under ``mask``
    (``blockwise.CAUSAL``, None, or a boolean mask)."""

    rows: Index
    cols: Index
    mask: TileMask

    @staticmethod
    def of_plan(plan: BlockPlan | None) -> list[_Tile]:
        return [] if plan is None else [_Tile(plan.rows, plan.cols, tile_mask(plan.mask))]

    @staticmethod
    def of_piece(piece: Piece) -> _Tile:
        return _Tile(piece.rows, piece.cols, CAUSAL if piece.causal else None)


def _take(x: Tensor, dim: int, index: Index) -> Tensor:
    """``x`` at ``index`` along ``dim``: a view for a range, a copy for an index tensor."""
    if index is None:
        return x
    if isinstance(index, slice):
        return x.narrow(dim, index.start, index.stop - index.start)
    return x.index_select(dim, index)


def _accumulate(total: Tensor | None, part: Tensor, dim: int, index: Index,
                shape: torch.Size) -> Tensor:
    """``total`` plus ``part`` at ``index`` along ``dim``; a first ``part`` covering every
    index becomes the total itself, a first partial one lands in float32 zeros of ``shape``."""
    if total is None:
        if index is None:
            return part
        total = torch.zeros(shape, device=part.device)
    if index is None:
        total += part
    elif isinstance(index, slice):
        total.narrow(dim, index.start, index.stop - index.start).add_(part)
    else:
        total.index_add_(dim, index, part)
    return total


_SEQ = 1  # the sequence dim of [b, s, h, d] blocks and of their gradient accumulators


class _RingAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, ring: _Ring,
                plans: list[list[_Tile]], scale: float) -> Tensor:
        kernel = kernel_for(q.device)
        queries = heads_first(q)
        out = lse = None
        kv = (k, v)
        for step in range(ring.size):
            incoming = ring.shift(kv, step + 1, _KV_TAG) if step < ring.size - 1 else None
            for tile in plans[step]:
                keys, values = _block_kv(kv, tile)
                block_out, block_lse = kernel.forward(_take(queries, 2, tile.rows), keys,
                                                      values, tile.mask, scale)
                if out is None and tile.rows is None:
                    out, lse = block_out, block_lse
                    continue
                if out is None:
                    out, lse = _empty_output(queries)
                merge_block(out, lse, block_out, block_lse, tile.rows)
            if incoming is not None:
                kv = incoming.wait()
        if out is None:
            out, lse = _empty_output(queries)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.plans, ctx.scale, ctx.kernel = ring, plans, scale, kernel
        return out.transpose(1, 2).to(q.dtype)

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        ring, plans = ctx.ring, ctx.plans
        tile = _TileGradients(ctx.kernel, heads_first(q), heads_first(grad_output), out, lse,
                              ctx.scale)
        kv = (k, v)
        grad_kv_transfer = None
        for step in range(ring.size):
            incoming = ring.shift(kv, step + 1, _KV_TAG) if step < ring.size - 1 else None
            block_grads = [tile.gradients(piece, kv) for piece in plans[step]]
            # The accumulators arrive while this block's tiles compute; add to them only now.
            grad_k, grad_v = (None, None) if grad_kv_transfer is None else grad_kv_transfer.wait()
            shape = kv[0].shape
            for piece, (block_k, block_v) in zip(plans[step], block_grads):
                grad_k = _accumulate(grad_k, block_k, _SEQ, piece.cols, shape)
                grad_v = _accumulate(grad_v, block_v, _SEQ, piece.cols, kv[1].shape)
            if grad_k is None:
                grad_k, grad_v = (torch.zeros(t.shape, device=t.device) for t in kv)
            grad_kv_transfer = ring.shift((grad_k, grad_v), step + 1, _GRAD_KV_TAG)
            if incoming is not None:
                kv = incoming.wait()
        grad_k, grad_v = grad_kv_transfer.wait()
        grad_q = tile.grad_queries.transpose(1, 2).to(q.dtype)
        return grad_q, grad_k.to(k.dtype), grad_v.to(v.dtype), None, None, None


def _empty_output(queries: Tensor) -> tuple[Tensor, Tensor]:
    """A running output of zeros and log-sum-exp of -inf: what no key contributes."""
    return (torch.zeros_like(queries),
            torch.full(queries.shape[:-1], float("-inf"), device=queries.device))


def _block_kv(kv: tuple[Tensor, Tensor], tile: _Tile) -> tuple[Tensor, Tensor]:
    """The keys and values of a ``[b, s, hkv, d]`` block at the tile's columns, heads first,
    float32."""
    return heads_first(_take(kv[0], _SEQ, tile.cols)), heads_first(_take(kv[1], _SEQ, tile.cols))


class _TileGradients:
    """This rank's query gradient, accumulated tile by tile in backward."""

    def __init__(self, kernel: BlockKernel, queries: Tensor, grad_out: Tensor, out: Tensor,
                 lse: Tensor, scale: float):
        self.kernel, self.queries, self.grad_out = kernel, queries, grad_out
        self.out, self.lse, self.scale = out, lse, scale
        self.grad_queries: Tensor | None = None

    def gradients(self, tile: _Tile, kv: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """Add one tile's query gradient; return its key and value gradients as ``[b, s_live,
        hkv, d]`` (views of the kernel's output, which lies in that order)."""
        rows = tile.rows
        keys, values = _block_kv(kv, tile)
        grad_q, grad_k, grad_v = self.kernel.backward(
            _take(self.grad_out, 2, rows), _take(self.queries, 2, rows), keys, values,
            _take(self.out, 2, rows), _take(self.lse, 2, rows), tile.mask, self.scale)
        self.grad_queries = _accumulate(self.grad_queries, grad_q, 2, rows,
                                        self.queries.shape)
        return grad_k.transpose(1, 2), grad_v.transpose(1, 2)


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
                doc_ids: Tensor | None = None, causal: bool = True) -> Tensor:
        layout, _ = attention_layout("RingAttention", q, k, v, positions, doc_ids, causal,
                                     self.group)
        ring = _Ring(group=self.group, rank=dist.get_rank(self.group),
                     size=dist.get_world_size(self.group), block_sizes=layout.sizes)
        plans = _plan_ring(ring, layout, causal)
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(q.shape[-1])
        return _RingAttentionFunction.apply(q, k, v, ring, plans, scale)


def split_causal_attention(q: Tensor, k: Tensor, v: Tensor, scale: float | None) -> Tensor:
    """Causal attention over one process's plain sequence (``[b, s, h, d]``) on the blockwise
    kernel: the causal square halved down to ``CAUSAL_LEAF`` rows (``masks.split_causal``),
    the pieces merged by log-sum-exp. This is the ring's machinery on a ring of one rank; on
    the CPU flash kernel it skips masked work that one large causal call computes anyway."""
    count = q.shape[1]
    ring = _Ring(group=None, rank=0, size=1, block_sizes=[count])
    plans = [[_Tile.of_piece(piece)
              for piece in split_causal(Piece(None, None, True), count, CAUSAL_LEAF)]]
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return _RingAttentionFunction.apply(q, k, v, ring, plans, scale)


def _plan_ring(ring: _Ring, layout: GroupLayout, causal: bool) -> list[list[_Tile]]:
    """This rank's tiles for each ring step.

    A block whose positions run in increasing order within one document is, against itself,
    one causal square. Otherwise blocks made of runs of consecutive positions (zigzag halves,
    the documents of a pack) are cut into rectangles that need no mask (``plan_pieces``);
    causal squares longer than ``CAUSAL_LEAF`` are halved until they are not
    (``split_causal``). Only scattered positions fall back to a tile with a materialised mask.
    """
    mine = ring.rank
    doc_ids = layout.doc_ids
    runs = [token_runs(layout.positions[rank], None if doc_ids is None else doc_ids[rank])
            for rank in range(ring.size)]
    plans = []
    for step in range(ring.size):
        source = ring.source(step)
        count = ring.block_sizes[mine]
        if source == mine and _one_increasing_document(runs[mine], layout.positions[mine]):
            pieces = [Piece(None, None, causal)]
        elif runs[mine] is not None and runs[source] is not None:
            pieces = plan_pieces(runs[mine], runs[source], causal, count,
                                 ring.block_sizes[source])
        else:
            plans.append(_Tile.of_plan(plan_block(
                layout.positions[mine], None if doc_ids is None else doc_ids[mine],
                layout.positions[source], None if doc_ids is None else doc_ids[source],
                causal)))
            continue
        plans.append([_Tile.of_piece(part) for piece in pieces
                      for part in split_causal(piece, count, CAUSAL_LEAF)])
    return plans


def _one_increasing_document(runs: list[TokenRun] | None, positions: Tensor) -> bool:
    """Whether a block is one document (or none) in strictly increasing position order: its
    causal mask against itself is then the square lower triangle."""
    if not runs or len({run.doc for run in runs}) > 1:
        return False
    return bool((positions[1:] > positions[:-1]).all())
