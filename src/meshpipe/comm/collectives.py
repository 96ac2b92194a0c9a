"""Collectives with autograd that context and expert parallelism build on.

- ``all_to_all`` scatters one dimension over a group and gathers another (Ulysses), its
  backward the reverse all-to-all; ``start_all_to_all`` starts one without autograd and
  returns at once;
- ``post_transfers`` posts point-to-point sends and receives at once (ring attention,
  Ulysses' tiles), on one ``batch_isend_irecv``;
- ``exchange_counts``, ``exchange_rows`` and ``all_to_all_rows`` move expert-parallel
  tokens in rows of exact sizes.

Sizes that do not divide by the group size are exact: the first ranks hold one element more
(``split_sizes``) and only real data travels; ``all_to_all_single`` carries per-peer split
sizes, because gloo's list-form ``all_to_all``/``all_gather`` reject unequal sizes. With
``MESHPIPE_CHECK_COLLECTIVES=1`` the ranks exchange their shapes first
(``meshpipe.comm.checks``). Splitting and gathering a sequence over context-parallel ranks
is in ``meshpipe.context.split_gather`` (its names still import from here).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable
from torch.profiler import record_function

from . import ops
from .checks import (CHECK_ENV, CollectiveShapeError, checks_enabled, exchange_ints,
                     group_rank, group_size, normalize_dim, require_same_except,
                     require_sizes_along)

__all__ = [
    "CHECK_ENV", "COMM_LABEL", "CollectiveShapeError", "PendingAllToAll", "PendingTransfers",
    "all_to_all", "all_to_all_rows", "exchange_counts", "exchange_rows", "post_transfers",
    "split_sizes", "start_all_to_all",
]

COMM_LABEL = "meshpipe.comm."
"""Prefix of the profiler ranges around communication (``torch.profiler``): what a trace of
context-parallel attention shows as time spent sending and waiting, beside the kernels."""


def split_sizes(total: int, parts: int) -> list[int]:
    """``parts`` sizes summing to ``total``; the first ``total % parts`` get one extra."""
    if parts < 1:
        raise ValueError(f"cannot split {total} elements into {parts} parts: parts must be >= 1")
    if total < 0:
        raise ValueError(f"cannot split a negative size {total} into {parts} parts")
    base, extra = divmod(total, parts)
    return [base + 1 if part < extra else base for part in range(parts)]


# ---------------------------------------------------------------------------- all-to-all


class PendingAllToAll:
    """An all-to-all in flight (``start_all_to_all``); ``wait()`` gives the gathered tensor."""

    def __init__(self, work: Any, received: Tensor, sent: Tensor | None,
                 block_shape: list[int], gather_dim: int, gather_sizes: list[int]):
        self._work, self._received, self._sent = work, received, sent
        self._block_shape, self._gather_dim = block_shape, gather_dim
        self._gather_sizes = gather_sizes
        self._result: Tensor | None = None

    @classmethod
    def finished(cls, result: Tensor) -> "PendingAllToAll":
        """An all-to-all over one rank: its result is ``x`` itself."""
        pending = cls(None, result, None, [], 0, [])
        pending._result = result
        return pending

    def wait(self) -> Tensor:
        if self._result is None:
            if self._work is not None:
                with record_function(COMM_LABEL + "all_to_all"):
                    self._work.wait()
            self._result = _joined_blocks(self._received, self._block_shape,
                                          self._gather_dim, self._gather_sizes)
            self._work = self._sent = None
        return self._result


def start_all_to_all(x: Tensor, group: dist.ProcessGroup | None, scatter_dim: int,
                     gather_dim: int, gather_size: int | None = None) -> PendingAllToAll:
    """Start ``all_to_all`` (without autograd) and return at once: on NCCL the exchange runs
    on the communicator's stream while the caller's stream goes on with other work, on gloo
    in its worker thread. ``x`` must not change until ``wait()``."""
    what = "all_to_all"
    if x.dim() < 2:
        raise ValueError(f"{what}: needs distinct scatter and gather dims, got a "
                         f"{x.dim()}-dim tensor of shape {list(x.shape)}")
    scatter_dim = normalize_dim(scatter_dim, x.dim(), what)
    gather_dim = normalize_dim(gather_dim, x.dim(), what)
    if scatter_dim == gather_dim:
        raise ValueError(f"{what}: scatter_dim and gather_dim are both {scatter_dim}; "
                         f"they must differ")
    world, rank = group_size(group), group_rank(group)
    total_gather = x.size(gather_dim) * world if gather_size is None else gather_size
    gather_sizes = split_sizes(total_gather, world)
    if checks_enabled():
        _check_all_to_all_shapes(x, group, scatter_dim, gather_dim, gather_sizes)
    if x.size(gather_dim) != gather_sizes[rank]:
        raise ValueError(
            f"{what}: rank {rank} of {world} holds {x.size(gather_dim)} elements along gather "
            f"dim {gather_dim}, but a gathered size of {total_gather} gives it "
            f"{gather_sizes[rank]} (split {gather_sizes}); pass gather_size = the total size")
    if world == 1:
        return PendingAllToAll.finished(x)
    scatter_sizes = split_sizes(x.size(scatter_dim), world)
    send, send_counts = _peer_blocks(x, scatter_dim, scatter_sizes)
    block_shape = list(x.shape)
    block_shape[scatter_dim] = scatter_sizes[rank]
    receive_counts = [_numel(block_shape, gather_dim, size) for size in gather_sizes]
    received = torch.empty(sum(receive_counts), dtype=x.dtype, device=x.device)
    aligned = x.size(scatter_dim) % world == 0 and total_gather % world == 0
    with record_function(COMM_LABEL + "all_to_all"):
        work = ops.all_to_all_single_started(
            received, send, output_split_sizes=None if aligned else receive_counts,
            input_split_sizes=None if aligned else send_counts, group=group)
    return PendingAllToAll(work, received, send, block_shape, gather_dim, gather_sizes)


def _all_to_all(x: Tensor, group: dist.ProcessGroup | None, scatter_dim: int, gather_dim: int,
                gather_size: int | None) -> Tensor:
    """Scatter ``scatter_dim`` over the group and gather ``gather_dim``, exactly."""
    return start_all_to_all(x, group, scatter_dim, gather_dim, gather_size).wait()


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
    rows = exchange_ints([scatter_dim, gather_dim, sum(gather_sizes), *x.shape], group, what,
                          x.device)
    if len({tuple(row[:3]) for row in rows}) > 1:
        raise CollectiveShapeError(
            f"{what}: ranks disagree on (scatter_dim, gather_dim, gathered size): "
            f"{[row[:3] for row in rows]} (by group rank); pass the same on every rank")
    shapes = [row[3:] for row in rows]
    require_same_except(shapes, gather_dim, what)
    require_sizes_along(shapes, gather_dim, gather_sizes, what)


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
    if send_counts.dim() < 1 or send_counts.size(0) != group_size(group):
        raise ValueError(f"exchange_counts: needs one row per rank of the group "
                         f"({group_size(group)}), got shape {list(send_counts.shape)}")
    send_counts = send_counts.contiguous()
    if group_size(group) == 1:
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
    world = group_size(group)
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
