"""Ulysses by head groups: one group's exchange travels while another group's attention runs.

Plain Ulysses exchanges q/k/v, attends, and exchanges the output back, each step waiting for
the one before. Attention is independent per head, so the rank's heads can be cut into
groups that each make that trip on their own: every group's exchange is started at once
(``start_all_to_all``: on NCCL it runs on the communicator's own stream), group ``g``'s
attention runs as soon as its q/k/v are in, and its output starts back while group
``g + 1`` attends. Backward does the same with the output gradients and the q/k/v gradients.
Any attention runs inside (the flash or variable-length kernel on CUDA; packed documents and
windows as they are), each group with its own autograd graph that ``backward`` walks.

Groups cut each rank's share of the heads, so that every group keeps whole key/value heads
with the query heads that use them: ``groups`` must divide the key/value heads a rank gets.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm.collectives import PendingAllToAll, start_all_to_all

_SEQ_DIM = 1
_HEAD_DIM = 2

GroupAttention = Callable[[Tensor, Tensor, Tensor], Tensor]
"""Attention over one head group's q, k and v for the whole sequence (``[b, s, h, d]``)."""


def by_peer(x: Tensor, ranks: int, groups: int = 1, group: int = 0) -> Tensor:
    """``[b, s, heads, d]`` -> ``[ranks, b, s, h, d]``: head group ``group`` of every rank's
    share of the heads (each rank's share cut in ``groups`` equal runs), peer-major; a view."""
    batch, seq, heads, head_dim = x.shape
    per_group = heads // (ranks * groups)
    return x.reshape(batch, seq, ranks, groups, per_group, head_dim)[:, :, :, group].movedim(2, 0)


def automatic_head_groups(device_type: str, local_attention: bool, kv_heads_per_rank: int) -> int:
    """How many head groups Ulysses runs in when not told: two on CUDA around local
    attention, where the exchanges can run beside the kernels, if the key/value heads of a
    rank split in two; one elsewhere. (On CPU the exchanges and the attention share the same
    few cores, and smaller kernel calls cost more: head groups measured slower there.)"""
    if device_type == "cuda" and local_attention and kv_heads_per_rank % 2 == 0:
        return 2
    return 1


class HeadGroupUlysses(torch.autograd.Function):
    """Ulysses over ``group`` in ``groups`` head groups whose exchanges overlap each other's
    attention (see the module). ``attend`` is called once per group with its q, k and v over
    the whole sequence, under autograd when a gradient is wanted."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, attend: GroupAttention,
                group: dist.ProcessGroup | None, total: int, groups: int,
                wants_grad: bool) -> Tensor:
        ranks = dist.get_world_size(group)
        sizes = [x.shape[_HEAD_DIM] // (ranks * groups) for x in (q, k, v)]
        incoming = [_start_gather([by_peer(x, ranks, groups, g) for x in (q, k, v)], group, total)
                    for g in range(groups)]
        outgoing, graphs = [], []
        for pending in incoming:
            heads = pending.wait().squeeze(0).split(sizes, dim=_HEAD_DIM)
            if wants_grad:
                heads = [x.detach().requires_grad_() for x in heads]
            with torch.enable_grad() if wants_grad else torch.no_grad():
                out = attend(*heads)
            graphs.append((heads, out))
            outgoing.append(start_all_to_all(out.detach(), group, scatter_dim=_SEQ_DIM,
                                             gather_dim=_HEAD_DIM, gather_size=ranks * sizes[0]))
        result = q.new_empty(q.shape)
        for g, pending in enumerate(outgoing):
            by_peer(result, ranks, groups, g).copy_(_peer_major(pending.wait(), ranks))
        ctx.graphs = graphs if wants_grad else None
        ctx.group, ctx.ranks, ctx.groups, ctx.total = group, ranks, groups, total
        ctx.shapes = (q.shape, k.shape, v.shape)
        return result

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        ranks, groups, graphs = ctx.ranks, ctx.groups, ctx.graphs
        if graphs is None:
            raise RuntimeError("UlyssesAttention: backward through head groups that ran "
                               "without autograd; call it with inputs that require grad")
        ctx.graphs = None
        incoming = [start_all_to_all(
            by_peer(grad_output, ranks, groups, g).movedim(0, _HEAD_DIM).flatten(2, 3),
            ctx.group, scatter_dim=_HEAD_DIM, gather_dim=_SEQ_DIM, gather_size=ctx.total)
            for g in range(groups)]
        returning = []
        for (heads, out), pending in zip(graphs, incoming):
            grads = torch.autograd.grad(out, heads, pending.wait())
            returning.append(start_all_to_all(torch.cat(grads, dim=_HEAD_DIM).unsqueeze(0),
                                              ctx.group, scatter_dim=_SEQ_DIM + 1,
                                              gather_dim=0, gather_size=ranks))
        results = [grad_output.new_empty(shape) for shape in ctx.shapes]
        sizes = [shape[_HEAD_DIM] // (ranks * groups) for shape in ctx.shapes]
        for g, pending in enumerate(returning):
            for whole, part in zip(results, pending.wait().split(sizes, dim=_HEAD_DIM + 1)):
                by_peer(whole, ranks, groups, g).copy_(part)
        return (*results, None, None, None, None, None)


def _start_gather(parts: list[Tensor], group: dist.ProcessGroup | None,
                  total: int) -> PendingAllToAll:
    """Start gathering ``parts`` (``[ranks, b, s_local, h_i, d]``, sent side by side) over
    the whole sequence: ``wait()`` gives ``[1, b, total, sum h_i, d]``."""
    return start_all_to_all(torch.cat(parts, dim=_HEAD_DIM + 1), group, scatter_dim=0,
                            gather_dim=_SEQ_DIM + 1, gather_size=total)


def _peer_major(received: Tensor, ranks: int) -> Tensor:
    """``[b, s, ranks * h, d]`` (every rank's heads in rank order) -> ``[ranks, b, s, h, d]``."""
    return received.unflatten(_HEAD_DIM, (ranks, -1)).movedim(_HEAD_DIM, 0)
