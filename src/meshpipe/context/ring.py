"""Ring attention: key/value blocks travel around the context-parallel group.

Each rank keeps its queries. At step ``t`` it holds the key/value block of group rank
``(rank - t) mod n``: it posts the send of that block to the next rank and the receive of
the following one from the previous rank, computes its queries against the block it holds
while the transfer runs, and folds the result into a running output with a log-sum-exp
merge. Backward runs the same ring again; each block's key/value gradient accumulator
travels with it and, after a full turn, arrives back at the block's owner. Communication
sits inside one ``autograd.Function``, so autograd never traces through it.

The layout is data: every rank learns every block's positions and document ids (see
``layout.py``), plans each tile (``masks.plan_block``) and computes only its live rows and
columns. With the zigzag layout (rank ``r`` holds chunks ``r`` and ``2n-1-r``) a causal
off-diagonal tile is exactly half live, so every rank does the same work; a tile that is
fully masked (another document of a pack, or the future) is skipped.

Tiles run on ``blockwise.CPU_FLASH`` on CPU (PyTorch's CPU flash kernel, which returns the
log-sum-exp and takes it back in backward) and on ``blockwise.MATH`` elsewhere; partial
results and gradients are accumulated in float32 whatever the input dtype. A tile whose mask
is the square lower triangle (the diagonal tile of a causal layout, zigzag or contiguous) runs
in the kernel's causal mode (``blockwise.CAUSAL``), which skips the masked half; an unmasked
tile runs without a mask; any other mask (packed documents, arbitrary positions) goes to the
kernel as an additive mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .blockwise import BlockKernel, TileMask, heads_first, kernel_for, merge_block, tile_mask
from .layout import GroupLayout, attention_layout
from .masks import BlockPlan, plan_block

# Key/value blocks and their gradient accumulators use different tags so the two streams
# between a pair of ranks can never be matched with each other.
_KV_TAG = 11
_GRAD_KV_TAG = 12


class _Transfer:
    """A posted send/receive pair; ``wait`` returns the received tensor."""

    def __init__(self, received: Tensor, works: list, keep_alive: Tensor | None = None):
        self._received = received
        self._works = works
        self._keep_alive = keep_alive

    def wait(self) -> Tensor:
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

    def shift(self, tensor: Tensor, incoming_rows: int, tag: int) -> _Transfer:
        """Send ``tensor`` ([2, b, s, ...]) to the next rank, receive the previous rank's one."""
        if self.size == 1:
            return _Transfer(tensor, [])
        shape = list(tensor.shape)
        shape[2] = incoming_rows
        received = torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
        operations = [
            dist.P2POp(dist.isend, tensor, group=self.group,
                       group_peer=(self.rank + 1) % self.size, tag=tag),
            dist.P2POp(dist.irecv, received, group=self.group,
                       group_peer=(self.rank - 1) % self.size, tag=tag),
        ]
        return _Transfer(received, dist.batch_isend_irecv(operations), keep_alive=tensor)


@dataclass(frozen=True)
class _Tile:
    """A ``BlockPlan`` with its mask in kernel form: ``blockwise.CAUSAL`` for the square lower
    triangle, None for no mask, else the boolean mask."""

    rows: Tensor | None
    cols: Tensor | None
    mask: TileMask

    @staticmethod
    def of(plan: BlockPlan | None) -> _Tile | None:
        if plan is None:
            return None
        return _Tile(rows=plan.rows, cols=plan.cols, mask=tile_mask(plan.mask))


def _select(x: Tensor, dim: int, index: Tensor | None) -> Tensor:
    return x if index is None else x.index_select(dim, index)


class _RingAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, ring: _Ring,
                plans: list[_Tile | None], scale: float) -> Tensor:
        kernel = kernel_for(q.device)
        queries = heads_first(q)
        out = torch.zeros_like(queries)
        lse = torch.full(queries.shape[:-1], float("-inf"), device=q.device)
        kv = torch.stack((k, v))
        for step in range(ring.size):
            incoming = None
            if step < ring.size - 1:
                incoming = ring.shift(kv, ring.block_sizes[ring.source(step + 1)], _KV_TAG)
            plan = plans[step]
            if plan is not None:
                keys, values = _block_kv(kv, plan)
                block_out, block_lse = kernel.forward(_select(queries, 2, plan.rows), keys,
                                                      values, plan.mask, scale)
                merge_block(out, lse, block_out, block_lse, plan.rows)
            if incoming is not None:
                kv = incoming.wait()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.plans, ctx.scale, ctx.kernel = ring, plans, scale, kernel
        return out.transpose(1, 2).to(q.dtype)

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        ring, plans = ctx.ring, ctx.plans
        tile = _TileGradients(ctx.kernel, heads_first(q), heads_first(grad_output), out, lse,
                              ctx.scale)
        kv = torch.stack((k, v))
        grad_kv_transfer = None
        for step in range(ring.size):
            incoming = None
            if step < ring.size - 1:
                incoming = ring.shift(kv, ring.block_sizes[ring.source(step + 1)], _KV_TAG)
            plan = plans[step]
            block_grads = None if plan is None else tile.gradients(plan, kv)
            # The accumulator arrives while this tile computes; add to it only now.
            grad_kv = (torch.zeros(kv.shape, device=kv.device) if grad_kv_transfer is None
                       else grad_kv_transfer.wait())
            if block_grads is not None:
                _add_columns(grad_kv, block_grads, plan.cols)
            grad_kv_transfer = ring.shift(grad_kv, ring.block_sizes[ring.source(step + 1)],
                                          _GRAD_KV_TAG)
            if incoming is not None:
                kv = incoming.wait()
        grad_kv = grad_kv_transfer.wait()
        grad_q = tile.grad_queries.transpose(1, 2).to(q.dtype)
        return grad_q, grad_kv[0].to(k.dtype), grad_kv[1].to(v.dtype), None, None, None


def _block_kv(kv: Tensor, plan: _Tile) -> tuple[Tensor, Tensor]:
    """The live keys and values of a ``[2, b, s, hkv, d]`` block, heads first, float32."""
    return heads_first(_select(kv[0], 1, plan.cols)), heads_first(_select(kv[1], 1, plan.cols))


class _TileGradients:
    """This rank's query gradient, accumulated tile by tile in backward."""

    def __init__(self, kernel: BlockKernel, queries: Tensor, grad_out: Tensor, out: Tensor,
                 lse: Tensor, scale: float):
        self.kernel, self.queries, self.grad_out = kernel, queries, grad_out
        self.out, self.lse, self.scale = out, lse, scale
        self.grad_queries = torch.zeros_like(queries)

    def gradients(self, plan: _Tile, kv: Tensor) -> Tensor:
        """Add one tile's query gradient; return its ``[2, b, s_live, hkv, d]`` key/value one."""
        rows = plan.rows
        keys, values = _block_kv(kv, plan)
        grad_q, grad_k, grad_v = self.kernel.backward(
            _select(self.grad_out, 2, rows), _select(self.queries, 2, rows), keys, values,
            _select(self.out, 2, rows), _select(self.lse, 2, rows), plan.mask, self.scale)
        if rows is None:
            self.grad_queries += grad_q
        else:
            self.grad_queries.index_add_(2, rows, grad_q)
        return torch.stack((grad_k, grad_v)).transpose(2, 3)


def _add_columns(grad_kv: Tensor, block_grads: Tensor, cols: Tensor | None) -> None:
    """Add a tile's key/value gradient to the block accumulator at the tile's live columns."""
    if cols is None:
        grad_kv += block_grads
    else:
        grad_kv.index_add_(2, cols, block_grads)


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


def _plan_ring(ring: _Ring, layout: GroupLayout, causal: bool) -> list[_Tile | None]:
    """This rank's tile plan for each ring step."""
    mine = ring.rank
    doc_ids = layout.doc_ids
    plans = []
    for step in range(ring.size):
        source = ring.source(step)
        plans.append(_Tile.of(plan_block(
            layout.positions[mine], None if doc_ids is None else doc_ids[mine],
            layout.positions[source], None if doc_ids is None else doc_ids[source], causal)))
    return plans
