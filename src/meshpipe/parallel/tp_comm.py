"""Autograd collectives over a tensor-parallel (TP) group, Megatron style.

Each function is a pair of conjugate collectives: what the forward does to activations,
the backward does the transpose of to gradients, so gradients stay exact. Activations are
``[batch, seq, ...]``; the sequence dim is 1. ``group=None`` (or a group of one rank)
means no TP: every function returns its input unchanged.

Reductions of bfloat16/float16 tensors run in float32 and are cast back (upcast, reduce,
downcast): gloo cannot sum half types well and a low-precision sum over ranks loses bits.

A rank passing a shape its peers do not expect makes gloo abort the process. Setting
``MESHPIPE_CHECK_COLLECTIVES=1`` makes the gathers exchange shapes first and raise a
``ValueError`` naming every rank's shape instead (one extra small collective per call).
"""

from __future__ import annotations


import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import FunctionCtx

from meshpipe.comm import ops
from meshpipe.comm.checks import checks_enabled, exchange_shapes
from meshpipe.graph_breaks import graph_break

__all__ = [
    "copy_to_tp", "gather_from_sequence", "reduce_from_tp", "reduce_scatter_to_sequence",
    "scatter_to_sequence", "tp_rank_and_size",
]

SEQ_DIM = 1
_HALF_TYPES = (torch.bfloat16, torch.float16)


def tp_rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """This rank's index in the TP group and the group's size; ``(0, 1)`` for ``None``."""
    if group is None:
        return 0, 1
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise ValueError(f"global rank {dist.get_rank()} is not a member of the TP group "
                         f"it was given; pass the TP group that contains this rank")
    return rank, size


def _tp_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _reduce_dtype(x: Tensor) -> torch.dtype:
    return torch.float32 if x.dtype in _HALF_TYPES else x.dtype


def _all_reduce_sum(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Sum over the group into a new tensor (float32 for half types), cast back."""
    buffer = x.to(_reduce_dtype(x), copy=True).contiguous()
    ops.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group)
    return buffer.to(x.dtype)


def _check_seq_divisible(x: Tensor, size: int, what: str) -> None:
    """``x`` has a sequence dim (dim 1) whose length ``size`` divides."""
    if x.dim() < 2:
        raise ValueError(f"{what}: expected activations [batch, seq, ...] with the sequence "
                         f"in dim 1, got a tensor of shape {tuple(x.shape)}")
    if x.shape[SEQ_DIM] % size:
        raise ValueError(f"{what}: sequence length {x.shape[SEQ_DIM]} (dim 1 of shape "
                         f"{tuple(x.shape)}) is not divisible by the TP size {size}; pad or "
                         f"cut the sequence to a multiple of {size}")


def _check_same_shapes(x: Tensor, group: dist.ProcessGroup, what: str) -> None:
    """With MESHPIPE_CHECK_COLLECTIVES set: raise on every rank if the shapes differ."""
    if not checks_enabled():
        return
    shapes = [tuple(shape) for shape in exchange_shapes(x, group, what)]
    if len(set(shapes)) > 1:
        listing = ", ".join(f"rank {r}: {s}" for r, s in enumerate(shapes))
        raise ValueError(f"{what}: every TP rank must pass the same shape, got {listing}")


def _gather_seq(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Concatenate every rank's ``x`` along dim 1, in group-rank order."""
    size = dist.get_world_size(group)
    local = x.movedim(SEQ_DIM, 0).contiguous()
    out = torch.empty((size * local.shape[0], *local.shape[1:]), dtype=x.dtype,
                      device=x.device)
    ops.all_gather_into(out, local, group=group)
    return out.movedim(0, SEQ_DIM).contiguous()


def _reduce_scatter_seq(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Sum over ranks, keep this rank's contiguous chunk of dim 1 (float32 for half types)."""
    size = dist.get_world_size(group)
    full = x.movedim(SEQ_DIM, 0).to(_reduce_dtype(x)).contiguous()
    out = torch.empty((full.shape[0] // size, *full.shape[1:]), dtype=full.dtype,
                      device=x.device)
    ops.reduce_scatter_into(out, full, op=dist.ReduceOp.SUM, group=group)
    return out.to(x.dtype).movedim(0, SEQ_DIM).contiguous()


def _seq_chunk(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    rank, size = tp_rank_and_size(group)
    return x.chunk(size, SEQ_DIM)[rank].contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:
        return _all_reduce_sum(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        return _all_reduce_sum(x, group)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return _seq_chunk(x, group)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:
        return _gather_seq(grad, ctx.group), None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return _gather_seq(x, group)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:
        return _reduce_scatter_seq(grad, ctx.group), None


class _GatherToReplicate(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return _gather_seq(x, group)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:
        return _seq_chunk(grad, ctx.group), None


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, group: dist.ProcessGroup,
                summed: bool) -> Tensor:
        counts = torch.tensor([x.shape[0]], dtype=torch.int64, device=x.device)
        every = [torch.empty_like(counts) for _ in range(dist.get_world_size(group))]
        ops.all_gather(every, counts, group)
        rows = [int(count) for count in torch.cat(every).tolist()]
        rank = dist.get_rank(group)
        ctx.group, ctx.summed = group, summed
        ctx.start, ctx.rows = sum(rows[:rank]), rows[rank]
        padded = x.new_zeros((max(rows), *x.shape[1:]))
        padded[:x.shape[0]] = x
        gathered = [torch.empty_like(padded) for _ in rows]
        ops.all_gather(gathered, padded, group)
        return torch.cat([part[:count] for part, count in zip(gathered, rows)])

    @staticmethod
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor, None, None]:
        if ctx.summed:
            grad = _all_reduce_sum(grad, ctx.group)
        return grad[ctx.start:ctx.start + ctx.rows], None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:
        return _gather_seq(grad, ctx.group), None


@graph_break
def copy_to_tp(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Identity forward, all-reduce (sum) of the gradient backward: the entry of a
    column-parallel region, where every rank's slice contributes to the input gradient."""
    if _tp_size(group) == 1:
        return x
    return _CopyToTP.apply(x, group)


@graph_break
def reduce_from_tp(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """All-reduce (sum) forward, identity backward: the exit of a row-parallel region,
    whose partial outputs add up to the full one."""
    if _tp_size(group) == 1:
        return x
    return _ReduceFromTP.apply(x, group)


@graph_break
def scatter_to_sequence(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Keep this rank's contiguous chunk of dim 1 forward, all-gather along dim 1 backward:
    enters a sequence-parallel region from replicated activations."""
    size = _tp_size(group)
    if size == 1:
        return x
    _check_seq_divisible(x, size, "scatter_to_sequence")
    return _ScatterToSequence.apply(x, group)


@graph_break
def gather_from_sequence(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """All-gather along dim 1 forward, reduce-scatter (sum) along dim 1 backward: the
    sequence-parallel rule, since every rank's use of the full sequence adds to its grad."""
    if _tp_size(group) == 1:
        return x
    _check_seq_divisible(x, 1, "gather_from_sequence")  # only needs a dim 1
    _check_same_shapes(x, group, "gather_from_sequence")
    return _GatherFromSequence.apply(x, group)


@graph_break
def gather_to_replicate(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """All-gather along dim 1 forward, this rank's chunk of the gradient backward: the entry
    of a computation every rank repeats on the whole sequence (a mixture-of-experts layer's
    routing under sequence parallelism), whose gradient is then the same on every rank;
    ``scatter_to_sequence`` is its exit."""
    if _tp_size(group) == 1:
        return x
    _check_seq_divisible(x, 1, "gather_to_replicate")  # only needs a dim 1
    _check_same_shapes(x, group, "gather_to_replicate")
    return _GatherToReplicate.apply(x, group)


@graph_break
def gather_rows_to_replicate(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """All-gather along dim 0 of as many rows as each rank has (any number, none too)
    forward, this rank's rows of the gradient backward: the ranks each compute a share of
    rows (a vision tower's images) that every rank then uses whole, so that the gradient is
    the same on every rank. One small all-gather of the counts first (a host read)."""
    if _tp_size(group) == 1:
        return x
    return _GatherRows.apply(x, group, False)


@graph_break
def gather_rows_summing_gradients(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """``gather_rows_to_replicate`` for rows each rank then uses in part (a vision tower's
    features under context parallelism: each rank's tokens take some), so that a row's
    gradient is the sum of the ranks' (an all-reduce backward, then this rank's rows)."""
    if _tp_size(group) == 1:
        return x
    return _GatherRows.apply(x, group, True)


@graph_break
def reduce_scatter_to_sequence(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Reduce-scatter (sum) along dim 1 forward, all-gather along dim 1 backward: the exit
    of a row-parallel region into a sequence-parallel one."""
    size = _tp_size(group)
    if size == 1:
        return x
    _check_seq_divisible(x, size, "reduce_scatter_to_sequence")
    _check_same_shapes(x, group, "reduce_scatter_to_sequence")
    return _ReduceScatterToSequence.apply(x, group)


class TensorParallelRegion:
    """Where a tensor-parallel region starts and ends (the identity without tensor parallelism).

    ``enter`` hands the replicated activations to column-split weights (backward: sum of the
    ranks' input gradients) or, with sequence parallelism, gathers the sequence shards;
    ``leave`` sums the partial outputs of row-split weights, or reduce-scatters them back to
    sequence shards.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, sequence_parallel: bool = False):
        self.rank, self.size = tp_rank_and_size(group)
        self.group = group
        self.sequence_parallel = sequence_parallel and self.size > 1

    def enter(self, x: Tensor) -> Tensor:
        if self.size == 1:
            return x
        if self.sequence_parallel:
            return gather_from_sequence(x, self.group)
        return copy_to_tp(x, self.group)

    def leave(self, x: Tensor) -> Tensor:
        if self.size == 1:
            return x
        if self.sequence_parallel:
            return reduce_scatter_to_sequence(x, self.group)
        return reduce_from_tp(x, self.group)

    @property
    def sequence_shards(self) -> int:
        """How many ranks share the sequence of the activations between regions."""
        return self.size if self.sequence_parallel else 1
