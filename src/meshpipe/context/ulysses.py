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
``_PipelinedUlysses`` runs on the blockwise kernel: the tiles of a rank's own rows and
columns run while the exchange is still on its way in (they need nothing from the other
ranks), and the rows the other ranks get back are computed and sent first.

On CUDA around local attention the heads run in groups (``head_groups``, automatic by
default, ``context.head_groups``): one group's exchange travels while another attends.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..comm.collectives import COMM_LABEL, all_to_all, post_transfers
from ..comm.collectives import split_sizes
from .heads import HeadPlan, plan_heads
from .interface import Attention, AttentionError
from .blockwise import BlockKernel, heads_first, kernel_for
from .derived import derived
from .head_groups import HeadGroupUlysses, automatic_head_groups, by_peer
from .layout import GroupLayout, attention_layout
from .local import LocalAttention
from .masks import Piece, is_plain_sequence, split_causal, window_applies
from .tiles import (CAUSAL_LEAF, SEQ, Tile, TileGradients, accumulate, attend, empty_output,
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
    rank order with ``split_sizes`` (what ``context.split_gather.split`` produces); the tokens'
    own positions and documents are free (zigzag, packed), they only feed the mask.
    """

    def __init__(self, inner: Attention | None = None, group: dist.ProcessGroup | None = None,
                 head_groups: int | None = None):
        super().__init__()
        if head_groups is not None and (not isinstance(head_groups, int) or head_groups < 1):
            raise ValueError(f"UlyssesAttention: head_groups must be a positive int or None "
                             f"(automatic), got {head_groups!r}")
        self.inner = inner if inner is not None else LocalAttention()
        self.group = group
        self.head_groups = head_groups

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, positions: Tensor | None = None,
                doc_ids: Tensor | None = None, causal: bool = True, window: int | None = None,
                scale: float | None = None, softcap: float | None = None) -> Tensor:
        layout, where = attention_layout("UlyssesAttention", q, k, v, positions, doc_ids,
                                         causal, self.group)
        heads_q = q.shape[_HEAD_DIM]
        ranks, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        expected = split_sizes(layout.total, ranks)
        if layout.sizes != expected:
            raise AttentionError(
                f"{where}: the Ulysses ranks hold {layout.sizes} tokens (by group rank), but a "
                f"sequence of {layout.total} tokens must be split as {expected} (the first "
                f"ranks one more); shard the sequence with context.split_gather.split")
        plan = plan_heads(heads_q, k.shape[2], ranks, where)
        query_order = plan.query_order()
        fused = _can_fuse(q, k, v, plan, ranks)
        everywhere = layout.gathered_positions()
        windowed = window is not None and derived(
            ("window", window, layout.total), (everywhere,),
            lambda: window_applies(window, everywhere, layout.total))
        groups = self._head_groups(q, k, ranks, fused, where)

        def attend(q_heads: Tensor, k_heads: Tensor, v_heads: Tensor) -> Tensor:
            return self.inner(
                q_heads, k_heads, v_heads,
                positions=None if positions is None else layout.gathered_positions(),
                doc_ids=layout.gathered_doc_ids(), causal=causal, window=window, scale=scale,
                softcap=softcap)

        if groups > 1:
            wants_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
            return HeadGroupUlysses.apply(q, k, v, attend, self.group, layout.total, groups,
                                          wants_grad)
        if (fused and not windowed and softcap is None
                and self._pipelines(q, layout, positions, doc_ids)):
            scale = next(s for s in (scale, self.inner.scale, q.shape[-1] ** -0.5)
                         if s is not None)
            return _PipelinedUlysses.apply(q, k, v, self.group, layout.total, causal, scale)
        if fused:
            q_heads, k_heads, v_heads = self._exchange_qkv(q, k, v, ranks, layout.total)
        else:
            q_heads = all_to_all(_take_heads(q, query_order, _HEAD_DIM), self.group,
                                 scatter_dim=_HEAD_DIM, gather_dim=_SEQ_DIM,
                                 gather_size=layout.total)
            k_heads, v_heads = self._gather_kv(k, v, plan, rank, layout.total)
        out_heads = attend(q_heads, k_heads, v_heads)
        out = all_to_all(out_heads, self.group, scatter_dim=_SEQ_DIM, gather_dim=_HEAD_DIM,
                         gather_size=heads_q)
        return _take_heads(out, _inverse(query_order), _HEAD_DIM)

    def _head_groups(self, q: Tensor, k: Tensor, ranks: int, fused: bool, where: str) -> int:
        """How many head groups this call runs in (``head_groups``): as asked, or
        ``automatic_head_groups``; one where the heads cannot share an exchange."""
        kv_per_rank = k.shape[_HEAD_DIM] // ranks
        if self.head_groups is None:
            return automatic_head_groups(q.device.type, type(self.inner) is LocalAttention,
                                         kv_per_rank) if fused else 1
        if self.head_groups > 1 and (not fused or kv_per_rank % self.head_groups):
            raise AttentionError(
                f"{where}: head_groups={self.head_groups} needs every rank to get an equal, "
                f"contiguous share of the heads whose {kv_per_rank} key/value heads split in "
                f"{self.head_groups} ({q.shape[_HEAD_DIM]} query and {k.shape[_HEAD_DIM]} "
                f"key/value heads over {ranks} ranks); choose a divisor or head_groups=1")
        return self.head_groups

    def _pipelines(self, q: Tensor, layout: GroupLayout, positions: Tensor | None,
                   doc_ids: Tensor | None) -> bool:
        """Whether this call runs tile by tile around its exchanges (``_PipelinedUlysses``):
        local attention on the CPU kernel (``tiles.runs_on_cpu_kernel``) over one plain
        sequence."""
        everywhere = layout.gathered_positions()
        return (type(self.inner) is LocalAttention and runs_on_cpu_kernel(q)
                and doc_ids is None
                and (positions is None or derived(
                    "plain", (everywhere, None), lambda: is_plain_sequence(everywhere, None))))

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
        packed = torch.cat([by_peer(x, ranks) for x in (q, k, v)], dim=_HEAD_DIM + 1)
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


_EXCHANGE_TAG = 13  # ring attention uses 11 and 12
_EXCHANGE_LABEL = COMM_LABEL + "ulysses"


def _write_side_by_side(into: Tensor, parts: list[Tensor]) -> Tensor:
    """Copy ``parts`` (``[b, s, h_i, d]``) next to each other along the heads of ``into``."""
    for place, part in zip(into.split([part.shape[_HEAD_DIM] for part in parts],
                                      dim=_HEAD_DIM), parts):
        place.copy_(part)
    return into


def _side_by_side(parts: list[Tensor], dtype: torch.dtype) -> Tensor:
    """``parts`` next to each other along the heads, in one new contiguous ``dtype`` tensor."""
    shape = list(parts[0].shape)
    shape[_HEAD_DIM] = sum(part.shape[_HEAD_DIM] for part in parts)
    return _write_side_by_side(parts[0].new_empty(shape, dtype=dtype), parts)


@dataclass(frozen=True)
class _TilePlan:
    """One rank's share of the attention square of its heads, by what each tile reads.

    ``rows[r]`` are group rank ``r``'s tokens in the gathered sequence. ``local`` tiles read
    only this rank's own rows and columns, which it holds before any exchange arrives;
    ``peer_rows`` tiles make the output (forward) rows other ranks get back; ``own_rows``
    are the rest: this rank's rows against other ranks' columns.
    """

    rows: list[slice]
    rank: int
    local: list[Tile]
    peer_rows: list[Tile]
    own_rows: list[Tile]

    @property
    def own(self) -> slice:
        return self.rows[self.rank]

    def peers(self) -> list[int]:
        return [peer for peer in range(len(self.rows)) if peer != self.rank]

    def local_halves(self) -> tuple[list[Tile], list[Tile]]:
        """The local tiles cut where half their work (rows x columns) is done: the first
        half runs while an exchange comes in, the second while one goes out. (Which
        transfer has arrived cannot be asked of gloo without waiting for it.)"""
        work = [_count(tile.rows) * _count(tile.cols) for tile in self.local]
        done, half = 0, sum(work) / 2
        for cut, tile_work in enumerate(work):
            if done >= half:
                return self.local[:cut], self.local[cut:]
            done += tile_work
        return self.local, []


def _tiles(rows: slice, cols: slice, causal: bool, total: int) -> list[Tile]:
    """Tiles of a non-empty rectangle: a causal square cut down to ``CAUSAL_LEAF`` rows, or
    one unmasked tile."""
    if rows.stop == rows.start or cols.stop == cols.start:
        return []
    return [Tile.of_piece(piece) for piece in split_causal(Piece(rows, cols, causal), total,
                                                            CAUSAL_LEAF)]


def _plan_tiles(total: int, ranks: int, rank: int, causal: bool) -> _TilePlan:
    """Cut the square of ``total`` tokens by who holds the rows and columns: this rank's own
    square, the rows before and after it, and its rows against the other columns."""
    sizes = split_sizes(total, ranks)
    starts = [sum(sizes[:r]) for r in range(ranks)]
    rows = [slice(start, start + size) for start, size in zip(starts, sizes)]
    own = rows[rank]
    before, after = slice(0, own.start), slice(own.stop, total)
    if causal:
        peer_rows = [*_tiles(before, before, True, total),
                     *_tiles(after, slice(0, own.stop), False, total),
                     *_tiles(after, after, True, total)]
        own_rows = _tiles(own, before, False, total)
    else:
        everything = slice(0, total)
        peer_rows = [*_tiles(before, everything, False, total),
                     *_tiles(after, everything, False, total)]
        own_rows = [*_tiles(own, before, False, total), *_tiles(own, after, False, total)]
    return _TilePlan(rows, rank, _tiles(own, own, causal, total), peer_rows, own_rows)


class _Exchange:
    """One Ulysses exchange as point-to-point transfers: a block to every peer, and a block
    from every peer that lands in its places (``[b, s, h_i, d]`` views, side by side along
    the heads). A block whose one place is contiguous and of the wire dtype is received
    straight into it; any other goes through a buffer copied into its places at ``wait``."""

    def __init__(self, group: dist.ProcessGroup | None, sends: dict[int, Tensor],
                 places: dict[int, list[Tensor]], dtype: torch.dtype):
        receives, self._landings = [], []
        for peer, targets in places.items():
            if len(targets) == 1 and targets[0].is_contiguous() and targets[0].dtype == dtype:
                receives.append((peer, targets[0]))
                continue
            shape = list(targets[0].shape)
            shape[_HEAD_DIM] = sum(target.shape[_HEAD_DIM] for target in targets)
            buffer = targets[0].new_empty(shape, dtype=dtype)
            receives.append((peer, buffer))
            self._landings.append((buffer, targets))
        self._pending = post_transfers(
            [(peer, block) for peer, block in sends.items() if block.numel()],
            [(peer, block) for peer, block in receives if block.numel()], group,
            _EXCHANGE_TAG, _EXCHANGE_LABEL)

    def wait(self) -> None:
        self._pending.wait()
        for buffer, targets in self._landings:
            for target, part in zip(targets, buffer.split(
                    [target.shape[_HEAD_DIM] for target in targets], dim=_HEAD_DIM)):
                target.copy_(part)


class _PipelinedUlysses(torch.autograd.Function):
    """Ulysses around blockwise local attention, own rows first.

    The rank's heads gather their q/k/v over the whole sequence into one float32 buffer,
    ``[b, seq, (q, k, v heads), d]``. The rank writes its own rows itself and receives
    every peer's rows straight into place (point-to-point, one transfer per peer and
    direction). So the first half (by work) of the tiles that read only its own rows and
    columns (``_TilePlan.local_halves``) runs while the exchange travels. The output rows
    other ranks get back are computed next and sent, and the remaining tiles (its own rows,
    the second local half) run while they travel. Backward does the same with the output
    gradients, and sends the q/k/v gradients of the other ranks' rows once every other
    tile is done. The tiles are the causal square cut down to ``CAUSAL_LEAF`` rows on the
    ``blockwise`` kernel. (Splitting the heads into groups whose exchanges overlap each
    other's compute was slower in every measurement, by up to 6 %, at cp 2 and 4 on CPU:
    the local tiles hide the exchange as well, and smaller kernel calls cost more.)
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup | None,
                total: int, causal: bool, scale: float) -> Tensor:
        ranks = dist.get_world_size(group)
        plan = _plan_tiles(total, ranks, dist.get_rank(group), causal)
        kernel = kernel_for(q.device)
        sizes = [x.shape[_HEAD_DIM] // ranks for x in (q, k, v)]
        gathered = q.new_empty((q.shape[0], total, sum(sizes), q.shape[-1]),
                               dtype=torch.float32)
        incoming = _post_gather(gathered, [by_peer(x, ranks) for x in (q, k, v)], plan,
                                group, q.dtype)
        q_heads, k_heads, v_heads = gathered.split(sizes, dim=_HEAD_DIM)
        queries, kv = heads_first(q_heads), (k_heads, v_heads)
        early, late = plan.local_halves()
        out, lse = attend(kernel, queries, kv, early, scale)
        incoming.wait()
        out, lse = attend(kernel, queries, kv, plan.peer_rows, scale, out, lse)
        if out is None:
            out, lse = empty_output(queries)
        result = q.new_empty(q.shape)
        places = by_peer(result, ranks)
        outgoing = _Exchange(
            group, {peer: _side_by_side([_rows_of(out, plan.rows[peer])], q.dtype)
                    for peer in plan.peers()},
            {peer: [places[peer]] for peer in plan.peers()}, q.dtype)
        attend(kernel, queries, kv, plan.own_rows + late, scale, out, lse)
        places[plan.rank].copy_(_rows_of(out, plan.own))
        outgoing.wait()
        ctx.group, ctx.plan, ctx.scale, ctx.kernel = group, plan, scale, kernel
        ctx.ranks, ctx.saved = ranks, (queries, kv, out, lse)
        ctx.shapes = (q.shape, k.shape, v.shape)
        return result

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        ranks, plan = ctx.ranks, ctx.plan
        gathered = grad_output.new_empty((grad_output.shape[0], plan.rows[-1].stop,
                                          grad_output.shape[_HEAD_DIM] // ranks,
                                          grad_output.shape[-1]), dtype=torch.float32)
        incoming = _post_gather(gathered, [by_peer(grad_output, ranks)], plan, ctx.group,
                                grad_output.dtype)
        queries, kv, out, lse = ctx.saved
        gradients = _Gradients(ctx.kernel, queries, heads_first(gathered), out, lse, ctx.scale,
                               kv)
        early, late = plan.local_halves()
        gradients.run(early)
        incoming.wait()
        gradients.run(plan.peer_rows + plan.own_rows)
        grads = [grad_output.new_empty(shape) for shape in ctx.shapes]
        places = [by_peer(whole, ranks) for whole in grads]
        outgoing = _Exchange(
            ctx.group, {peer: _side_by_side(gradients.at(plan.rows[peer]), grad_output.dtype)
                        for peer in plan.peers()},
            {peer: [place[peer] for place in places] for peer in plan.peers()},
            grad_output.dtype)
        gradients.run(late)
        for place, part in zip(places, gradients.at(plan.own)):
            place[plan.rank].copy_(part)
        outgoing.wait()
        return (*grads, None, None, None, None)


def _count(rows: slice) -> int:
    return rows.stop - rows.start


def _rows_of(heads_first_output: Tensor, rows: slice) -> Tensor:
    """The tokens ``rows`` of a ``[b, h, s, d]`` output, as ``[b, s_rows, h, d]`` (a view)."""
    return heads_first_output.narrow(2, rows.start, _count(rows)).transpose(1, 2)


def _post_gather(gathered: Tensor, parts: list[Tensor], plan: _TilePlan,
                 group: dist.ProcessGroup | None, dtype: torch.dtype) -> _Exchange:
    """Start gathering this rank's heads over the whole sequence into ``gathered``
    (``[b, seq, heads, d]``): ``parts`` are ``[ranks, b, s_local, h_i, d]`` views of this
    rank's tokens, one per tensor sent side by side. Writes this rank's own rows at once;
    every peer's rows arrive in place by ``wait``."""
    own = plan.own
    _write_side_by_side(gathered.narrow(_SEQ_DIM, own.start, _count(own)),
                        [part[plan.rank] for part in parts])
    return _Exchange(group, {peer: _side_by_side([part[peer] for part in parts], dtype)
                             for peer in plan.peers()},
                     {peer: [gathered.narrow(_SEQ_DIM, plan.rows[peer].start,
                                             _count(plan.rows[peer]))]
                      for peer in plan.peers()}, dtype)


class _Gradients:
    """This rank's heads' q/k/v gradients over the whole gathered sequence, tile by tile."""

    def __init__(self, kernel: BlockKernel, queries: Tensor, grad_out: Tensor, out: Tensor,
                 lse: Tensor, scale: float, kv: tuple[Tensor, Tensor]):
        self._queries = TileGradients(kernel, queries, grad_out, out, lse, scale)
        self._kv = kv
        self._keys: Tensor | None = None
        self._values: Tensor | None = None

    def run(self, tiles: list[Tile]) -> None:
        for tile in tiles:
            block_k, block_v = self._queries.gradients(tile, self._kv)
            self._keys = accumulate(self._keys, block_k, SEQ, tile.cols, self._kv[0].shape)
            self._values = accumulate(self._values, block_v, SEQ, tile.cols, self._kv[1].shape)

    def at(self, rows: slice) -> list[Tensor]:
        """The q, k and v gradients of the tokens ``rows``, each ``[b, s, h, d]`` (views)."""
        grad_q = self._queries.grad_queries
        if grad_q is None:
            grad_q = torch.zeros_like(self._queries.queries)
        keys = self._keys if self._keys is not None else torch.zeros_like(self._kv[0])
        values = self._values if self._values is not None else torch.zeros_like(self._kv[1])
        count = _count(rows)
        return [_rows_of(grad_q, rows), keys.narrow(SEQ, rows.start, count),
                values.narrow(SEQ, rows.start, count)]
