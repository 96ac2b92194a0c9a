"""Context-parallel collectives with autograd.

Every function here is differentiable: ``all_to_all``'s backward is the reverse all-to-all,
a split's backward gathers the gradient, a gather's backward keeps this rank's part of it.

Sizes that do not divide by the group size are exact: the first ranks hold one element more
(``split_sizes``) and only real data travels; ``all_to_all_single`` carries per-peer split
sizes, because gloo's list-form ``all_to_all``/``all_gather`` reject unequal sizes.

Gradient scaling of the split/gather family (``grad_scale``): ``"up"`` multiplies the
gradient by the group size, ``"down"`` divides it, ``None`` leaves it. Splits default to
``"down"`` and gathers to ``"up"`` (as seed 004), so a split followed by a gather scales by
one. With ``None``, a split's input gradient is every rank's shard gradient gathered (the
gradient of the sum of the ranks' losses; ``"down"`` makes it that of their mean), and a
gather's input gradient is this rank's part of its own output gradient (the gradient of one
loss that every rank computes identically; ``"up"`` makes it that of the sum of those
copies). Composite layouts (hybrid) scale at each level, so ``"down"`` divides by ring size
x Ulysses size.

Setting the environment variable ``MESHPIPE_CHECK_COLLECTIVES=1`` makes the ranks exchange
their shapes before each all-to-all and gather, so that a rank passing a shape its peers do
not expect makes every rank raise the same ``CollectiveShapeError`` instead of hanging.
"""

from __future__ import annotations

import math
import os
from typing import Literal, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable
from torch.profiler import record_function

from . import ops
from .shards import (ShardLayout, contiguous_positions, document_ids, hybrid_positions,
                     packed_hybrid_positions, packed_positions, positions_in_document,
                     split_sizes, zigzag_positions)

__all__ = [
    "CollectiveShapeError", "GradScale", "ShardLayout", "all_to_all", "contiguous_positions",
    "document_ids", "gather", "hybrid_gather", "hybrid_positions", "hybrid_split",
    "packed_gather", "packed_hybrid_gather", "packed_hybrid_positions", "packed_hybrid_split",
    "packed_positions", "packed_split", "positions_in_document", "split", "split_sizes",
    "zigzag_gather", "zigzag_positions", "zigzag_split", "exchange_counts", "exchange_rows",
    "all_to_all_rows", "post_transfers", "PendingTransfers",
]

GradScale = Literal["up", "down"] | None

CHECK_ENV = "MESHPIPE_CHECK_COLLECTIVES"
COMM_LABEL = "meshpipe.comm."
"""Prefix of the profiler ranges around communication (``torch.profiler``): what a trace of
context-parallel attention shows as time spent sending and waiting, beside the kernels."""
_MAX_EXCHANGED_INTS = 32


class CollectiveShapeError(ValueError):
    """The ranks of a group passed shapes that do not fit one collective."""


def _checks_enabled() -> bool:
    return os.environ.get(CHECK_ENV, "0") not in ("", "0")


def _group_size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group)


def _group_rank(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group)


def _normalize_dim(dim: int, ndim: int, what: str) -> int:
    if not -ndim <= dim < ndim:
        raise ValueError(f"{what}: dim {dim} is out of range for a tensor with {ndim} dims")
    return dim % ndim


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


def _exchange_ints(values: Sequence[int], group: dist.ProcessGroup | None, what: str,
                   device: torch.device) -> list[list[int]]:
    """Every rank's ``values`` (fewer than 32 ints), in group-rank order."""
    if len(values) >= _MAX_EXCHANGED_INTS:
        raise ValueError(f"{what}: cannot check shapes of tensors with this many dims "
                         f"({len(values)} values to exchange)")
    mine = torch.zeros(_MAX_EXCHANGED_INTS, dtype=torch.int64, device=device)
    mine[0] = len(values)
    mine[1:len(values) + 1] = torch.tensor(list(values), dtype=torch.int64, device=device)
    table = torch.empty(_group_size(group) * _MAX_EXCHANGED_INTS, dtype=torch.int64,
                        device=device)
    ops.all_gather_into(table, mine, group=group)
    rows = table.view(_group_size(group), _MAX_EXCHANGED_INTS).tolist()
    return [row[1:row[0] + 1] for row in rows]


def _exchange_shapes(x: Tensor, group: dist.ProcessGroup | None, what: str) -> list[list[int]]:
    return _exchange_ints(list(x.shape), group, what, x.device)


def _require_same_except(shapes: list[list[int]], dim: int, what: str) -> None:
    """Every rank has the same shape except (possibly) along ``dim``."""
    masked = [shape[:dim] + shape[dim + 1:] if len(shape) > dim else shape for shape in shapes]
    if any(len(shape) != len(shapes[0]) for shape in shapes) or len(
            {tuple(shape) for shape in masked}) > 1:
        raise CollectiveShapeError(
            f"{what}: the ranks' shapes {shapes} (by group rank) must agree on every dim "
            f"except dim {dim}; pass tensors of matching shapes on every rank")


def _require_sizes_along(shapes: list[list[int]], dim: int, expected: list[int],
                         what: str) -> None:
    found = [shape[dim] for shape in shapes]
    if found != expected:
        raise CollectiveShapeError(
            f"{what}: the ranks hold {found} elements along dim {dim} (by group rank) but "
            f"{expected} were expected; pass matching sizes on every rank")


# ---------------------------------------------------------------------------- all-to-all


def _all_to_all(x: Tensor, group: dist.ProcessGroup | None, scatter_dim: int, gather_dim: int,
                gather_size: int | None) -> Tensor:
    """Scatter ``scatter_dim`` over the group and gather ``gather_dim``, exactly."""
    what = "all_to_all"
    if x.dim() < 2:
        raise ValueError(f"{what}: needs distinct scatter and gather dims, got a "
                         f"{x.dim()}-dim tensor of shape {list(x.shape)}")
    scatter_dim = _normalize_dim(scatter_dim, x.dim(), what)
    gather_dim = _normalize_dim(gather_dim, x.dim(), what)
    if scatter_dim == gather_dim:
        raise ValueError(f"{what}: scatter_dim and gather_dim are both {scatter_dim}; "
                         f"they must differ")
    world, rank = _group_size(group), _group_rank(group)
    total_gather = x.size(gather_dim) * world if gather_size is None else gather_size
    gather_sizes = split_sizes(total_gather, world)
    if _checks_enabled():
        _check_all_to_all_shapes(x, group, scatter_dim, gather_dim, gather_sizes)
    if x.size(gather_dim) != gather_sizes[rank]:
        raise ValueError(
            f"{what}: rank {rank} of {world} holds {x.size(gather_dim)} elements along gather "
            f"dim {gather_dim}, but a gathered size of {total_gather} gives it "
            f"{gather_sizes[rank]} (split {gather_sizes}); pass gather_size = the total size")
    if world == 1:
        return x
    scatter_sizes = split_sizes(x.size(scatter_dim), world)
    send, send_counts = _peer_blocks(x, scatter_dim, scatter_sizes)
    block_shape = list(x.shape)
    block_shape[scatter_dim] = scatter_sizes[rank]
    receive_counts = [_numel(block_shape, gather_dim, size) for size in gather_sizes]
    received = torch.empty(sum(receive_counts), dtype=x.dtype, device=x.device)
    aligned = x.size(scatter_dim) % world == 0 and total_gather % world == 0
    with record_function(COMM_LABEL + "all_to_all"):
        ops.all_to_all_single(
            received, send, output_split_sizes=None if aligned else receive_counts,
            input_split_sizes=None if aligned else send_counts, group=group)
    return _joined_blocks(received, block_shape, gather_dim, gather_sizes)


class PendingTransfers:
    """Point-to-point sends and receives in flight (``post_transfers``)."""

    def __init__(self, received: tuple[Tensor, ...], works: list, sent: tuple[Tensor, ...],
                 label: str, landing: tuple[Tensor, ...] | None = None):
        self._received, self._works, self._label = received, works, label
        self._sent: tuple[Tensor, ...] | None = sent  # alive until the sends are done
        # Host buffers the receives land in when they travel through the host (else None).
        self._landing = landing

    def wait(self) -> tuple[Tensor, ...]:
        """Block until every transfer is done; the receive buffers, in the order posted."""
        if self._works:
            with record_function(self._label):
                for work in self._works:
                    work.wait()
            self._works = []
        if self._landing is not None:
            for tensor, host in zip(self._received, self._landing):
                tensor.copy_(host)
            self._landing = None
        self._sent = None
        return self._received


def post_transfers(sends: Sequence[tuple[int, Tensor]], receives: Sequence[tuple[int, Tensor]],
                   group: dist.ProcessGroup | None, tag: int,
                   label: str = COMM_LABEL + "transfers") -> PendingTransfers:
    """Post sends of contiguous tensors to, and receives into contiguous tensors from, group
    ranks (``(peer, tensor)`` pairs), all at once and without waiting.

    One ``batch_isend_irecv``: on NCCL that is one grouped launch, so two ranks exchanging
    both ways never wait on each other. Between two ranks, transfers with one tag match in
    the order they were posted, so both sides must post theirs in the same order. GPU
    tensors through a gloo group (ranks sharing a GPU) travel through host copies, and
    ``wait`` copies what arrived into the receive tensors (``ops.through_host``).
    """
    received = tuple(tensor for _, tensor in receives)
    landing = None
    tensors = [tensor for _, tensor in (*sends, *receives)]
    if tensors and ops.through_host(tensors[0], group):
        sends = [(peer, tensor.to("cpu", copy=True)) for peer, tensor in sends]
        receives = [(peer, torch.empty_like(tensor, device="cpu")) for peer, tensor in receives]
        landing = tuple(tensor for _, tensor in receives)
    operations = [dist.P2POp(dist.isend, tensor, group=group, group_peer=peer, tag=tag)
                  for peer, tensor in sends]
    operations += [dist.P2POp(dist.irecv, tensor, group=group, group_peer=peer, tag=tag)
                   for peer, tensor in receives]
    works = []
    if operations:
        with record_function(label):
            works = dist.batch_isend_irecv(operations)
    return PendingTransfers(received, works, tuple(tensor for _, tensor in sends), label,
                            landing)


def _numel(shape: list[int], dim: int, size: int) -> int:
    """Elements of ``shape`` with ``shape[dim]`` replaced by ``size``."""
    return math.prod(shape[:dim]) * size * math.prod(shape[dim + 1:])


def _peer_blocks(x: Tensor, dim: int, sizes: list[int]) -> tuple[Tensor, list[int]]:
    """The send buffer: peer ``r``'s block ``x.narrow(dim, start_r, sizes[r])`` after peer
    ``r - 1``'s, each in ``x``'s own dimension order, and the element count of each block.

    When ``x`` is contiguous and every dimension before ``dim`` has size 1 (the sequence of
    a one-row batch, say), the blocks already lie in that order: ``x`` is sent as it is.
    Otherwise each block is copied once into its place; there is no other copy.
    """
    counts = [_numel(list(x.shape), dim, size) for size in sizes]
    if x.is_contiguous() and math.prod(x.shape[:dim]) == 1:
        return x.view(-1), counts
    send = torch.empty(x.numel(), dtype=x.dtype, device=x.device)
    offset = start = 0
    for size, count in zip(sizes, counts):
        block = x.narrow(dim, start, size)
        send.narrow(0, offset, count).view(block.shape).copy_(block)
        offset, start = offset + count, start + size
    return send, counts


def _joined_blocks(received: Tensor, block_shape: list[int], dim: int,
                   sizes: list[int]) -> Tensor:
    """The received peer blocks (``block_shape`` with ``sizes[r]`` along ``dim`` from peer
    ``r``, one after another) joined along ``dim``: a view of ``received`` when every
    dimension before ``dim`` has size 1, else one copy of each block into its place."""
    shape = list(block_shape)
    shape[dim] = sum(sizes)
    if math.prod(block_shape[:dim]) == 1:
        return received.view(shape)
    joined = received.new_empty(shape)
    block = list(block_shape)
    offset = start = 0
    for size in sizes:
        block[dim] = size
        count = math.prod(block)
        joined.narrow(dim, start, size).copy_(received.narrow(0, offset, count).view(block))
        offset, start = offset + count, start + size
    return joined


def _check_all_to_all_shapes(x: Tensor, group: dist.ProcessGroup | None, scatter_dim: int,
                             gather_dim: int, gather_sizes: list[int]) -> None:
    what = f"all_to_all(scatter_dim={scatter_dim}, gather_dim={gather_dim})"
    rows = _exchange_ints([scatter_dim, gather_dim, sum(gather_sizes), *x.shape], group, what,
                          x.device)
    if len({tuple(row[:3]) for row in rows}) > 1:
        raise CollectiveShapeError(
            f"{what}: ranks disagree on (scatter_dim, gather_dim, gathered size): "
            f"{[row[:3] for row in rows]} (by group rank); pass the same on every rank")
    shapes = [row[3:] for row in rows]
    _require_same_except(shapes, gather_dim, what)
    _require_sizes_along(shapes, gather_dim, gather_sizes, what)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, group: dist.ProcessGroup | None, scatter_dim: int,
                gather_dim: int, gather_size: int | None) -> Tensor:
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        ctx.scatter_size = x.size(scatter_dim)
        return _all_to_all(x, group, scatter_dim, gather_dim, gather_size)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor | None, ...]:
        return (_all_to_all(grad, ctx.group, ctx.gather_dim, ctx.scatter_dim, ctx.scatter_size),
                None, None, None, None)


def all_to_all(x: Tensor, group: dist.ProcessGroup | None, scatter_dim: int, gather_dim: int,
               gather_size: int | None = None) -> Tensor:
    """Scatter ``scatter_dim`` across ``group`` and gather ``gather_dim`` (autograd-aware).

    Rank ``r`` receives part ``r`` of ``scatter_dim`` (``split_sizes`` of its size) from
    every rank and concatenates the pieces along ``gather_dim`` in rank order.
    ``gather_size`` is the total gathered size when it is not ``world * local`` (the local
    sizes then follow ``split_sizes(gather_size, world)``). Uneven sizes are exact, with no
    padding, and cost what even ones do: at most one copy on each side, none where every
    dimension before the scattered (gathered) one has size 1.
    """
    return _AllToAll.apply(x, group, scatter_dim, gather_dim, gather_size)


# ------------------------------------------------------- token exchange (expert parallelism)


def exchange_counts(send_counts: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """What every peer will send here: ``send_counts[r]`` (a row of ints per peer, e.g. tokens
    per expert of peer ``r``) goes to rank ``r``; row ``r`` of the result came from rank ``r``."""
    if send_counts.dim() < 1 or send_counts.size(0) != _group_size(group):
        raise ValueError(f"exchange_counts: needs one row per rank of the group "
                         f"({_group_size(group)}), got shape {list(send_counts.shape)}")
    send_counts = send_counts.contiguous()
    if _group_size(group) == 1:
        return send_counts.clone()
    received = torch.empty_like(send_counts)
    ops.all_to_all_single(received, send_counts, group=group)
    return received


def exchange_rows(x: Tensor, send_rows: Sequence[int], receive_rows: Sequence[int],
                  group: dist.ProcessGroup | None) -> Tensor:
    """Rows ``x[sum(send_rows[:r]) : sum(send_rows[:r+1])]`` go to rank ``r``; the rows
    received are concatenated in rank order (``receive_rows[r]`` from rank ``r``). Exact
    sizes, no padding: the split sizes of ``all_to_all_single``. Not differentiable (see
    ``all_to_all_rows``)."""
    world = _group_size(group)
    if len(send_rows) != world or len(receive_rows) != world:
        raise ValueError(f"exchange_rows: give one send and one receive size per rank of the "
                         f"group ({world}), got {list(send_rows)} and {list(receive_rows)}")
    if sum(send_rows) != x.size(0):
        raise ValueError(f"exchange_rows: send sizes {list(send_rows)} add up to "
                         f"{sum(send_rows)} rows but the tensor has {x.size(0)}")
    x = x.contiguous()
    if world == 1:
        return x.clone()
    received = x.new_empty((sum(receive_rows), *x.shape[1:]))
    ops.all_to_all_single(received, x, output_split_sizes=list(receive_rows),
                           input_split_sizes=list(send_rows), group=group)
    return received


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, send_rows: tuple[int, ...],
                receive_rows: tuple[int, ...], group: dist.ProcessGroup | None) -> Tensor:
        ctx.send_rows, ctx.receive_rows, ctx.group = send_rows, receive_rows, group
        return exchange_rows(x, send_rows, receive_rows, group)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor | None, ...]:
        return exchange_rows(grad, ctx.receive_rows, ctx.send_rows, ctx.group), None, None, None


def all_to_all_rows(x: Tensor, send_rows: Sequence[int], receive_rows: Sequence[int],
                    group: dist.ProcessGroup | None) -> Tensor:
    """``exchange_rows`` with autograd: the backward sends each row's gradient back to the
    rank the row came from (the same exchange with the sizes swapped)."""
    return _AllToAllRows.apply(x, tuple(send_rows), tuple(receive_rows), group)


# ---------------------------------------------------------------------- split / gather


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
    rank = _group_rank(group)
    sizes = layout.local_sizes()
    if _checks_enabled():
        shapes = _exchange_shapes(x, group, what)
        _require_same_except(shapes, dim, what)
        _require_sizes_along(shapes, dim, sizes, what)
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
    return layout.take(full, dim, _group_rank(group))


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
    world = _group_size(group)
    dim_ = _normalize_dim(dim, x.dim(), what)
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
    world = _group_size(group)
    dim_ = _normalize_dim(dim, x.dim(), what)
    if sizes is None:
        shapes = _exchange_shapes(x, group, what)
        _require_same_except(shapes, dim_, what)
        sizes = [shape[dim_] for shape in shapes]
    else:
        sizes = _checked_sizes(sizes, world, what)
    return _gather_by_layout(x, group, dim_, ShardLayout.contiguous(sizes), grad_scale, what)


# ------------------------------------------------------------------------------ zigzag


def zigzag_split(x: Tensor, group: dist.ProcessGroup | None, dim: int,
                 grad_scale: GradScale = "down") -> Tensor:
    """Keep chunks ``r`` and ``2*cp-1-r`` of ``2*cp`` along ``dim`` (causal ring balance)."""
    what = f"zigzag_split(dim={dim})"
    dim_ = _normalize_dim(dim, x.dim(), what)
    layout = ShardLayout.zigzag(x.size(dim_), _group_size(group))
    return _split_by_layout(x, group, dim_, layout, grad_scale, what)


def zigzag_gather(x: Tensor, group: dist.ProcessGroup | None, dim: int,
                  grad_scale: GradScale = "up") -> Tensor:
    """The full sequence in order from every rank's zigzag shard (two equal chunks)."""
    what = f"zigzag_gather(dim={dim})"
    world = _group_size(group)
    dim_ = _normalize_dim(dim, x.dim(), what)
    local = x.size(dim_)
    if world > 1 and local % 2 != 0:
        raise ValueError(f"{what}: a zigzag shard is two equal chunks, but rank "
                         f"{_group_rank(group)} holds {local} elements along dim {dim}")
    layout = ShardLayout.zigzag(local * world, world)
    return _gather_by_layout(x, group, dim_, layout, grad_scale, what)


# ------------------------------------------------------------------------------ packed


def packed_split(x: Tensor, group: dist.ProcessGroup | None, seq_lens: Sequence[int], dim: int,
                 grad_scale: GradScale = "down") -> Tensor:
    """Split every document of a pack across the group; keep this rank's pieces in order."""
    what = f"packed_split(dim={dim}, seq_lens={list(seq_lens)})"
    dim_ = _normalize_dim(dim, x.dim(), what)
    layout = ShardLayout.packed(seq_lens, _group_size(group))
    return _split_by_layout(x, group, dim_, layout, grad_scale, what)


def packed_gather(x: Tensor, group: dist.ProcessGroup | None, seq_lens: Sequence[int], dim: int,
                  grad_scale: GradScale = "up") -> Tensor:
    """The whole pack from every rank's ``packed_split`` shard."""
    what = f"packed_gather(dim={dim}, seq_lens={list(seq_lens)})"
    dim_ = _normalize_dim(dim, x.dim(), what)
    layout = ShardLayout.packed(seq_lens, _group_size(group))
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
    ring_size = _group_size(ring_group)
    ring_total = ShardLayout.zigzag(total, ring_size).local_size(_group_rank(ring_group))
    ring_shard = gather(x, ulysses_group, dim, split_sizes(ring_total, _group_size(ulysses_group)),
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
    layout = ShardLayout.packed(seq_lens, _group_size(ring_group))
    ring_total = layout.local_size(_group_rank(ring_group))
    ring_shard = gather(x, ulysses_group, dim, split_sizes(ring_total, _group_size(ulysses_group)),
                        grad_scale)
    return packed_gather(ring_shard, ring_group, seq_lens, dim, grad_scale)
