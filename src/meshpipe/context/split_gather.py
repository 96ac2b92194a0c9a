"""A sequence split over, and gathered from, the ranks of a context-parallel group, with
autograd: a split's backward gathers the gradient, a gather's backward keeps this rank's part.

Layouts are ``meshpipe.context.shards.ShardLayout``: contiguous (``split``/``gather``, any
sizes), zigzag, packed documents, and hybrid (ring, then Ulysses). Sizes that do not divide
by the group size are exact (``split_sizes``), with no padding.

Gradient scaling (``grad_scale``): ``"up"`` multiplies the gradient by the group size,
``"down"`` divides it, ``None`` leaves it. Splits default to ``"down"`` and gathers to
``"up"``, so a split followed by a gather scales by one. With ``None``, a split's input
gradient is every rank's shard gradient gathered (the gradient of the sum of the ranks'
losses; ``"down"`` makes it that of their mean), and a gather's input gradient is this
rank's part of its own output gradient (the gradient of one loss that every rank computes
identically; ``"up"`` makes it that of the sum of those copies). Composite layouts (hybrid)
scale at each level, so ``"down"`` divides by ring size x Ulysses size.
"""

from __future__ import annotations

import math
from typing import Literal, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from meshpipe.comm import ops
from meshpipe.comm.checks import (checks_enabled, exchange_shapes, group_rank, group_size,
                                  normalize_dim, require_same_except, require_sizes_along)
from meshpipe.comm.collectives import split_sizes

from .shards import ShardLayout

__all__ = [
    "GradScale", "gather", "hybrid_gather", "hybrid_split", "packed_gather",
    "packed_hybrid_gather", "packed_hybrid_split", "packed_split", "split", "zigzag_gather",
    "zigzag_split",
]

GradScale = Literal["up", "down"] | None


def _check_grad_scale(grad_scale: GradScale) -> GradScale:
    if grad_scale not in ("up", "down", None):
        raise ValueError(f"grad_scale must be 'up', 'down' or None, got {grad_scale!r}")
    return grad_scale


def _scale_gradient(grad: Tensor, grad_scale: GradScale, group_size: int) -> Tensor:
    if grad_scale == "up":
        return grad * group_size
    if grad_scale == "down":
        return grad / group_size
    return grad


def _gather_rank_major(x: Tensor, group: dist.ProcessGroup | None,
                       sizes: list[int]) -> Tensor:
    """Every rank's ``x`` (``sizes[r]`` rows on dim 0) concatenated on dim 0 in rank order."""
    x = x.contiguous()
    rest_shape = x.shape[1:]
    world = len(sizes)
    if len(set(sizes)) == 1:
        gathered = torch.empty((world * sizes[0], *rest_shape), dtype=x.dtype, device=x.device)
        ops.all_gather_into(gathered, x, group=group)
        return gathered
    # Unequal parts: each rank sends its own rows to every peer, nothing more.
    row = math.prod(rest_shape)
    received = torch.empty(sum(sizes) * row, dtype=x.dtype, device=x.device)
    ops.all_to_all_single(received, x.view(-1).repeat(world),
                           output_split_sizes=[size * row for size in sizes],
                           input_split_sizes=[x.numel()] * world, group=group)
    return received.view(sum(sizes), *rest_shape)


def _gather_layout(x: Tensor, group: dist.ProcessGroup | None, dim: int,
                   layout: ShardLayout, what: str) -> Tensor:
    """The full tensor along ``dim`` from every rank's shard of ``layout``."""
    rank = group_rank(group)
    sizes = layout.local_sizes()
    if checks_enabled():
        shapes = exchange_shapes(x, group, what)
        require_same_except(shapes, dim, what)
        require_sizes_along(shapes, dim, sizes, what)
    if x.size(dim) != sizes[rank]:
        raise ValueError(
            f"{what}: rank {rank} holds {x.size(dim)} elements along dim {dim} but its shard "
            f"has {sizes[rank]} (shards {sizes}); pass the sizes every rank actually holds")
    if layout.world_size == 1:
        return x
    rank_major = _gather_rank_major(x.movedim(dim, 0), group, sizes)
    return layout.assemble(rank_major, 0).movedim(0, dim).contiguous()


def _take_layout(full: Tensor, group: dist.ProcessGroup | None, dim: int,
                 layout: ShardLayout, what: str) -> Tensor:
    if full.size(dim) != layout.total:
        raise ValueError(f"{what}: the tensor has {full.size(dim)} elements along dim {dim} "
                         f"but the layout covers {layout.total}")
    return layout.take(full, dim, group_rank(group))


class _SplitByLayout(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, group: dist.ProcessGroup | None, dim: int,
                layout: ShardLayout, grad_scale: GradScale, what: str) -> Tensor:
        ctx.group, ctx.dim, ctx.layout, ctx.grad_scale, ctx.what = (
            group, dim, layout, grad_scale, what)
        return _take_layout(x, group, dim, layout, what)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor | None, ...]:
        grad = _scale_gradient(grad, ctx.grad_scale, ctx.layout.world_size)
        full = _gather_layout(grad, ctx.group, ctx.dim, ctx.layout, f"{ctx.what} (backward)")
        return full, None, None, None, None, None


class _GatherByLayout(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, group: dist.ProcessGroup | None, dim: int,
                layout: ShardLayout, grad_scale: GradScale, what: str) -> Tensor:
        ctx.group, ctx.dim, ctx.layout, ctx.grad_scale, ctx.what = (
            group, dim, layout, grad_scale, what)
        return _gather_layout(x, group, dim, layout, what)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor | None, ...]:
        grad = _scale_gradient(grad, ctx.grad_scale, ctx.layout.world_size)
        part = _take_layout(grad, ctx.group, ctx.dim, ctx.layout, f"{ctx.what} (backward)")
        return part, None, None, None, None, None


def _split_by_layout(x: Tensor, group: dist.ProcessGroup | None, dim: int,
                     layout: ShardLayout, grad_scale: GradScale, what: str) -> Tensor:
    """``dim`` is already normalised by the public caller."""
    return _SplitByLayout.apply(x, group, dim, layout, _check_grad_scale(grad_scale), what)


def _gather_by_layout(x: Tensor, group: dist.ProcessGroup | None, dim: int,
                      layout: ShardLayout, grad_scale: GradScale, what: str) -> Tensor:
    """``dim`` is already normalised by the public caller."""
    return _GatherByLayout.apply(x, group, dim, layout, _check_grad_scale(grad_scale), what)


def _checked_sizes(sizes: Sequence[int], world: int, what: str) -> list[int]:
    sizes = [int(size) for size in sizes]
    if len(sizes) != world:
        raise ValueError(f"{what}: {len(sizes)} sizes {sizes} given for a group of {world} "
                         f"ranks; give one size per rank")
    return sizes


def split(x: Tensor, group: dist.ProcessGroup | None, dim: int,
          sizes: Sequence[int] | None = None, grad_scale: GradScale = "down") -> Tensor:
    """Keep this rank's part of ``x`` along ``dim``; backward gathers the gradient.

    ``sizes`` gives every rank's part (default ``split_sizes``, uneven allowed). Every rank
    passes the same full ``x``; see the module docstring for ``grad_scale``.
    """
    what = f"split(dim={dim})"
    world = group_size(group)
    dim_ = normalize_dim(dim, x.dim(), what)
    sizes = (split_sizes(x.size(dim_), world) if sizes is None
             else _checked_sizes(sizes, world, what))
    if sum(sizes) != x.size(dim_):
        raise ValueError(f"{what}: sizes {sizes} sum to {sum(sizes)} but the tensor has "
                         f"{x.size(dim_)} elements along dim {dim}")
    return _split_by_layout(x, group, dim_, ShardLayout.contiguous(sizes), grad_scale, what)


def gather(x: Tensor, group: dist.ProcessGroup | None, dim: int,
           sizes: Sequence[int] | None = None, grad_scale: GradScale = "up") -> Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order; backward keeps this part.

    ``sizes`` gives every rank's size along ``dim``; when omitted the ranks exchange their
    shapes first (one small collective), so unequal parts need no sizes.
    """
    what = f"gather(dim={dim})"
    world = group_size(group)
    dim_ = normalize_dim(dim, x.dim(), what)
    if sizes is None:
        shapes = exchange_shapes(x, group, what)
        require_same_except(shapes, dim_, what)
        sizes = [shape[dim_] for shape in shapes]
    else:
        sizes = _checked_sizes(sizes, world, what)
    return _gather_by_layout(x, group, dim_, ShardLayout.contiguous(sizes), grad_scale, what)


# ------------------------------------------------------------------------------ zigzag


def zigzag_split(x: Tensor, group: dist.ProcessGroup | None, dim: int,
                 grad_scale: GradScale = "down") -> Tensor:
    """Keep chunks ``r`` and ``2*cp-1-r`` of ``2*cp`` along ``dim`` (causal ring balance)."""
    what = f"zigzag_split(dim={dim})"
    dim_ = normalize_dim(dim, x.dim(), what)
    layout = ShardLayout.zigzag(x.size(dim_), group_size(group))
    return _split_by_layout(x, group, dim_, layout, grad_scale, what)


def zigzag_gather(x: Tensor, group: dist.ProcessGroup | None, dim: int,
                  grad_scale: GradScale = "up") -> Tensor:
    """The full sequence in order from every rank's zigzag shard (two equal chunks)."""
    what = f"zigzag_gather(dim={dim})"
    world = group_size(group)
    dim_ = normalize_dim(dim, x.dim(), what)
    local = x.size(dim_)
    if world > 1 and local % 2 != 0:
        raise ValueError(f"{what}: a zigzag shard is two equal chunks, but rank "
                         f"{group_rank(group)} holds {local} elements along dim {dim}")
    layout = ShardLayout.zigzag(local * world, world)
    return _gather_by_layout(x, group, dim_, layout, grad_scale, what)


# ------------------------------------------------------------------------------ packed


def packed_split(x: Tensor, group: dist.ProcessGroup | None, seq_lens: Sequence[int], dim: int,
                 grad_scale: GradScale = "down") -> Tensor:
    """Split every document of a pack across the group; keep this rank's pieces in order."""
    what = f"packed_split(dim={dim}, seq_lens={list(seq_lens)})"
    dim_ = normalize_dim(dim, x.dim(), what)
    layout = ShardLayout.packed(seq_lens, group_size(group))
    return _split_by_layout(x, group, dim_, layout, grad_scale, what)


def packed_gather(x: Tensor, group: dist.ProcessGroup | None, seq_lens: Sequence[int], dim: int,
                  grad_scale: GradScale = "up") -> Tensor:
    """The whole pack from every rank's ``packed_split`` shard."""
    what = f"packed_gather(dim={dim}, seq_lens={list(seq_lens)})"
    dim_ = normalize_dim(dim, x.dim(), what)
    layout = ShardLayout.packed(seq_lens, group_size(group))
    return _gather_by_layout(x, group, dim_, layout, grad_scale, what)


# ------------------------------------------------------------------------------ hybrid


def hybrid_split(x: Tensor, ring_group: dist.ProcessGroup | None,
                 ulysses_group: dist.ProcessGroup | None, dim: int,
                 grad_scale: GradScale = "down") -> Tensor:
    """Zigzag across the ring group, then a contiguous split across the Ulysses group."""
    ring_shard = zigzag_split(x, ring_group, dim, grad_scale)
    return split(ring_shard, ulysses_group, dim, grad_scale=grad_scale)


def hybrid_gather(x: Tensor, ring_group: dist.ProcessGroup | None,
                  ulysses_group: dist.ProcessGroup | None, dim: int, total: int,
                  grad_scale: GradScale = "up") -> Tensor:
    """The reverse of ``hybrid_split`` for a sequence of ``total`` tokens."""
    ring_size = group_size(ring_group)
    ring_total = ShardLayout.zigzag(total, ring_size).local_size(group_rank(ring_group))
    ring_shard = gather(x, ulysses_group, dim, split_sizes(ring_total, group_size(ulysses_group)),
                        grad_scale)
    return zigzag_gather(ring_shard, ring_group, dim, grad_scale)


def packed_hybrid_split(x: Tensor, ring_group: dist.ProcessGroup | None,
                        ulysses_group: dist.ProcessGroup | None, seq_lens: Sequence[int],
                        dim: int, grad_scale: GradScale = "down") -> Tensor:
    """Every document split across the ring, then this ring shard split across Ulysses."""
    ring_shard = packed_split(x, ring_group, seq_lens, dim, grad_scale)
    return split(ring_shard, ulysses_group, dim, grad_scale=grad_scale)


def packed_hybrid_gather(x: Tensor, ring_group: dist.ProcessGroup | None,
                         ulysses_group: dist.ProcessGroup | None, seq_lens: Sequence[int],
                         dim: int, grad_scale: GradScale = "up") -> Tensor:
    """The reverse of ``packed_hybrid_split``."""
    layout = ShardLayout.packed(seq_lens, group_size(ring_group))
    ring_total = layout.local_size(group_rank(ring_group))
    ring_shard = gather(x, ulysses_group, dim, split_sizes(ring_total, group_size(ulysses_group)),
                        grad_scale)
    return packed_gather(ring_shard, ring_group, seq_lens, dim, grad_scale)
