"""Ulysses (DeepSpeed-style) context parallelism: trade the sequence shard for a head shard.

Each rank holds a shard of the sequence with every head. One all-to-all turns that into the
whole sequence (of the group) for a subset of the heads; any attention runs on it
unchanged; a second all-to-all turns the output back. Sequence lengths and head counts
need not divide by the group size (``comm.collectives.all_to_all`` is exact for uneven
sizes), and grouped-query attention sends each rank only the key/value heads its query
heads use (``heads.plan_heads``). ``positions`` and ``doc_ids`` are gathered alongside, so
the inner attention sees the masks of the whole gathered sequence.

Where q, k and v share one exchange, the inner attention is ``LocalAttention``, the tensors
are on CPU in a float32/bf16/fp16 dtype and the sequence is plain (no documents),
``_PipelinedUlysses`` runs the heads in groups on the blockwise kernel: one group's exchange
travels while another computes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..comm.collectives import all_to_all, post_all_to_all
from ..comm.shards import split_sizes
from .heads import HeadPlan, plan_heads
from .interface import Attention, AttentionError
from .blockwise import heads_first, kernel_for
from .layout import GroupLayout, attention_layout
from .local import LocalAttention
from .masks import is_plain_sequence
from .tiles import (SEQ, Tile, TileGradients, accumulate, attend, causal_square, empty_output,
                    runs_on_cpu_kernel)

_SEQ_DIM = 1
_HEAD_DIM = 2


def _take_heads(x: Tensor, heads: list[int], dim: int) -> Tensor:
    """``x`` with its heads in the order ``heads`` (no copy when that is the identity)."""
    if heads == list(range(x.shape[dim])):
        return x
    return x.index_select(dim, torch.tensor(heads, device=x.device))


def _inverse(order: list[int]) -> list[int]:
    inverse = [0] * len(order)
    for position, head in enumerate(order):
        inverse[head] = position
    return inverse


class UlyssesAttention(nn.Module):
    """Context-parallel attention over ``group`` by head/sequence all-to-all around ``inner``.

    ``inner`` is any attention (default: ``LocalAttention``; ``RingAttention`` over another
    group gives the hybrid). The ranks must hold the group's sequence split contiguously in
    rank order with ``split_sizes`` (what ``comm.collectives.split`` produces); the tokens'
    own positions and documents are free (zigzag, packed), they only feed the mask.
    """

    def __init__(self, inner: Attention | None = None, group: dist.ProcessGroup | None = None):
        super().__init__()
        self.inner = inner if inner is not None else LocalAttention()
        self.group = group

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, positions: Tensor | None = None,
                doc_ids: Tensor | None = None, causal: bool = True) -> Tensor:
        layout, where = attention_layout("UlyssesAttention", q, k, v, positions, doc_ids,
                                         causal, self.group)
        heads_q = q.shape[_HEAD_DIM]
        ranks, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        expected = split_sizes(layout.total, ranks)
        if layout.sizes != expected:
            raise AttentionError(
                f"{where}: the Ulysses ranks hold {layout.sizes} tokens (by group rank), but a "
                f"sequence of {layout.total} tokens must be split as {expected} (the first "
                f"ranks one more); shard the sequence with comm.collectives.split")
        plan = plan_heads(heads_q, k.shape[2], ranks, where)
        query_order = plan.query_order()
        fused = _can_fuse(q, k, v, plan, ranks)
        if fused and self._pipelines(q, layout, positions, doc_ids):
            scale = self.inner.scale if self.inner.scale is not None else q.shape[-1] ** -0.5
            return _PipelinedUlysses.apply(q, k, v, self.group, layout.total,
                                           causal_square(layout.total, causal), scale)
        if fused:
            q_heads, k_heads, v_heads = self._exchange_qkv(q, k, v, ranks, layout.total)
        else:
            q_heads = all_to_all(_take_heads(q, query_order, _HEAD_DIM), self.group,
                                 scatter_dim=_HEAD_DIM, gather_dim=_SEQ_DIM,
                                 gather_size=layout.total)
            k_heads, v_heads = self._gather_kv(k, v, plan, rank, layout.total)
        out_heads = self.inner(
            q_heads, k_heads, v_heads,
            positions=None if positions is None else layout.gathered_positions(),
            doc_ids=layout.gathered_doc_ids(), causal=causal)
        out = all_to_all(out_heads, self.group, scatter_dim=_SEQ_DIM, gather_dim=_HEAD_DIM,
                         gather_size=heads_q)
        return _take_heads(out, _inverse(query_order), _HEAD_DIM)

    def _pipelines(self, q: Tensor, layout: GroupLayout, positions: Tensor | None,
                   doc_ids: Tensor | None) -> bool:
        """Whether this call runs head group by head group (``_PipelinedUlysses``): local
        attention on the CPU kernel (``tiles.runs_on_cpu_kernel``) over one plain
        sequence."""
        return (type(self.inner) is LocalAttention and runs_on_cpu_kernel(q)
                and doc_ids is None
                and (positions is None or is_plain_sequence(layout.gathered_positions(), None)))

    def _exchange_qkv(self, q: Tensor, k: Tensor, v: Tensor, ranks: int,
                      total: int) -> tuple[Tensor, Tensor, Tensor]:
        """q, k and v for this rank's heads over the whole sequence, in one all-to-all.

        One cat packs the heads peer-major, ``[peer, batch, seq, (q_r, k_r, v_r), head_dim]``,
        so that the block for rank ``r`` is contiguous and goes on the wire as it lies; with a
        one-row batch the received buffer already is ``[1, seq, heads, head_dim]`` and q, k
        and v are views of it. The backward (autograd of ``all_to_all`` and ``cat``) is one
        all-to-all and one copy of each gradient back into its place.
        """
        per_rank = [x.shape[_HEAD_DIM] // ranks for x in (q, k, v)]
        packed = torch.cat([_group_heads(x, ranks, 1, 0) for x in (q, k, v)], dim=_HEAD_DIM + 1)
        gathered = all_to_all(packed, self.group, scatter_dim=0, gather_dim=_SEQ_DIM + 1,
                              gather_size=total).squeeze(0)
        q_heads, k_heads, v_heads = gathered.split(per_rank, dim=_HEAD_DIM)
        return q_heads, k_heads, v_heads

    def _gather_kv(self, k: Tensor, v: Tensor, plan: HeadPlan, rank: int,
                   total: int) -> tuple[Tensor, Tensor]:
        """This rank's key/value heads over the whole sequence, one per query head group."""
        kv = _take_heads(torch.stack((k, v)), plan.kv_order(), _HEAD_DIM + 1)
        kv = all_to_all(kv, self.group, scatter_dim=_HEAD_DIM + 1, gather_dim=_SEQ_DIM + 1,
                        gather_size=total)
        kv = _as_grouped_query_heads(kv, plan.local_kv_index(rank))
        return kv[0], kv[1]


def _can_fuse(q: Tensor, k: Tensor, v: Tensor, plan: HeadPlan, ranks: int) -> bool:
    """Whether q, k and v can share one all-to-all: every rank gets an equal, contiguous
    run of query heads and exactly the key/value heads those use (no replicas, no reorder),
    and the three agree on everything but the head count."""
    heads_q, heads_kv = q.shape[_HEAD_DIM], k.shape[_HEAD_DIM]
    if heads_q % ranks or heads_kv % ranks or v.shape[_HEAD_DIM] != heads_kv:
        return False
    if not (q.shape[:_HEAD_DIM] == k.shape[:_HEAD_DIM] == v.shape[:_HEAD_DIM]
            and q.shape[_HEAD_DIM + 1:] == k.shape[_HEAD_DIM + 1:] == v.shape[_HEAD_DIM + 1:]):
        return False
    if not (q.dtype == k.dtype == v.dtype and q.device == k.device == v.device):
        return False
    kv_per_rank = heads_kv // ranks
    return (plan.query_order() == list(range(heads_q))
            and all(heads == tuple(range(r * kv_per_rank, (r + 1) * kv_per_rank))
                    for r, heads in enumerate(plan.kv_heads)))


def _as_grouped_query_heads(kv: Tensor, kv_of_query: list[int]) -> Tensor:
    """Arrange the local key/value heads so that local query head ``i`` uses head ``i // g``.

    When the local query heads come in equal runs per key/value head (the usual case) the
    heads are already in that form; otherwise they are repeated to one per query head.
    """
    heads = kv.shape[_HEAD_DIM + 1]
    group, remainder = divmod(len(kv_of_query), heads)
    if remainder == 0 and kv_of_query == [i // group for i in range(len(kv_of_query))]:
        return kv
    return kv.index_select(_HEAD_DIM + 1, torch.tensor(kv_of_query, device=kv.device))


HEAD_GROUPS = 2
"""Ulysses on CPU runs a rank's heads in up to this many groups: one group's all-to-all
travels while another computes (with four, the smaller kernel calls cost more than the
overlap hides on a 2-core machine)."""


def _head_groups(kv_heads_per_rank: int) -> int:
    """The most groups, up to ``HEAD_GROUPS``, that split a rank's key/value heads evenly
    (and so its query heads, a multiple of them)."""
    return max(g for g in range(1, HEAD_GROUPS + 1) if kv_heads_per_rank % g == 0)


def _group_heads(x: Tensor, ranks: int, groups: int, group: int) -> Tensor:
    """``[b, s, heads, d]`` -> ``[ranks, b, s, heads_per_group, d]``: head group ``group`` of
    every rank's share of the heads, peer-major (a view of a contiguous ``x``)."""
    batch, seq, heads, head_dim = x.shape
    split = x.reshape(batch, seq, ranks, groups, heads // (ranks * groups), head_dim)
    return split[:, :, :, group].movedim(2, 0)


def _place_group(whole: Tensor, part: Tensor, ranks: int, groups: int, group: int) -> None:
    """Write ``part`` (``[ranks, b, s, heads_per_group, d]``) into head group ``group`` of
    every rank's share of ``whole``'s heads (``[b, s, heads, d]``)."""
    _group_heads(whole, ranks, groups, group).copy_(part)


class _PipelinedUlysses(torch.autograd.Function):
    """Ulysses around blockwise local attention, head group by head group.

    Forward posts every group's q/k/v all-to-all at once (packed peer-major, as in
    ``UlyssesAttention._exchange_qkv``), then computes group after group as each arrives and
    posts its output's all-to-all while the next group computes. Backward does the same with
    the output gradients and the q/k/v gradients. Only the first group's exchange in and the
    last one's exchange out wait on the wire; the kernel is ``blockwise`` with the causal
    square cut into tiles (``tiles.causal_square``).
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup | None,
                total: int, tiles: list[Tile], scale: float) -> Tensor:
        ranks = dist.get_world_size(group)
        groups = _head_groups(k.shape[_HEAD_DIM] // ranks)
        kernel = kernel_for(q.device)
        incoming = [post_all_to_all(torch.cat([_group_heads(x, ranks, groups, g)
                                               for x in (q, k, v)], dim=_HEAD_DIM + 1),
                                    group, scatter_dim=0, gather_dim=_SEQ_DIM + 1,
                                    gather_size=total)
                    for g in range(groups)]
        sizes = [x.shape[_HEAD_DIM] // (ranks * groups) for x in (q, k, v)]
        saved, outgoing = [], []
        for g in range(groups):
            q_g, k_g, v_g = incoming[g].wait().squeeze(0).split(sizes, dim=_HEAD_DIM)
            queries = heads_first(q_g)
            out, lse = attend(kernel, queries, (k_g, v_g), tiles, scale)
            if out is None:
                out, lse = empty_output(queries)
            saved.append((queries, (k_g, v_g), out, lse))
            outgoing.append(post_all_to_all(out.transpose(1, 2).to(q.dtype).unsqueeze(0), group,
                                            scatter_dim=_SEQ_DIM + 1, gather_dim=0,
                                            gather_size=ranks))
        result = q.new_empty(q.shape)  # contiguous: _place_group writes through views
        for g in range(groups):
            _place_group(result, outgoing[g].wait(), ranks, groups, g)
        ctx.group, ctx.total, ctx.tiles, ctx.scale, ctx.kernel = group, total, tiles, scale, kernel
        ctx.ranks, ctx.groups, ctx.sizes, ctx.saved = ranks, groups, sizes, saved
        ctx.shapes = (q.shape, k.shape, v.shape)
        return result

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        ranks, groups, group = ctx.ranks, ctx.groups, ctx.group
        incoming = [post_all_to_all(_group_heads(grad_output, ranks, groups, g), group,
                                    scatter_dim=0, gather_dim=_SEQ_DIM + 1,
                                    gather_size=ctx.total)
                    for g in range(groups)]
        outgoing = []
        for g in range(groups):
            queries, kv, out, lse = ctx.saved[g]
            gradients = TileGradients(ctx.kernel, queries,
                                      heads_first(incoming[g].wait().squeeze(0)), out, lse,
                                      ctx.scale)
            grad_k = grad_v = None
            for tile in ctx.tiles:
                block_k, block_v = gradients.gradients(tile, kv)
                grad_k = accumulate(grad_k, block_k, SEQ, tile.cols, kv[0].shape)
                grad_v = accumulate(grad_v, block_v, SEQ, tile.cols, kv[1].shape)
            packed = torch.cat((gradients.grad_queries.transpose(1, 2), grad_k, grad_v),
                               dim=_HEAD_DIM).to(grad_output.dtype)
            outgoing.append(post_all_to_all(packed.unsqueeze(0), group,
                                            scatter_dim=_SEQ_DIM + 1, gather_dim=0,
                                            gather_size=ranks))
        grads = [grad_output.new_empty(shape) for shape in ctx.shapes]
        for g in range(groups):
            for whole, part in zip(grads, outgoing[g].wait().split(ctx.sizes, dim=_HEAD_DIM + 1)):
                _place_group(whole, part, ranks, groups, g)
        return (*grads, None, None, None, None)
