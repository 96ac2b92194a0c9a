"""Ulysses exchanges q, k and v in one all-to-all (and back in one) where the heads allow.

Counts ``torch.distributed.all_to_all_single`` and ``batch_isend_irecv`` calls in one
forward and one backward of ``UlyssesAttention``, and checks output and gradients against
SDPA on the whole sequence. In float64 the local attention is SDPA: one all-to-all each way.
In float32 on CPU the attention runs tile by tile around point-to-point exchanges
(``_PipelinedUlysses``): in forward one gathers q/k/v and one returns the output, in
backward one gathers the output gradient and one returns the q/k/v gradients.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshpipe.comm.collectives import split_sizes
from meshpipe.context import UlyssesAttention
from meshpipe.context.blockwise import CAUSAL
from meshpipe.context.tiles import CAUSAL_LEAF
from meshpipe.context.ulysses import _plan_tiles
from meshpipe.testing import run_distributed

pytestmark = pytest.mark.distributed


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               causal: bool) -> torch.Tensor:
    group = q.shape[2] // k.shape[2]
    k, v = (x.repeat_interleave(group, dim=2) for x in (k, v))
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                         v.transpose(1, 2), is_causal=causal)
    return out.transpose(1, 2)


def _count_ulysses_exchanges(rank: int, world_size: int, seq: int, heads_q: int,
                             heads_kv: int, causal: bool, dtype: torch.dtype = torch.float64,
                             strided: bool = False, batch: int = 2) -> dict:
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(1234)
    head_dim = 8
    q_full = torch.randn(batch, seq, heads_q, head_dim, generator=gen, dtype=dtype)
    k_full = torch.randn(batch, seq, heads_kv, head_dim, generator=gen, dtype=dtype)
    v_full = torch.randn(batch, seq, heads_kv, head_dim, generator=gen, dtype=dtype)
    weight = torch.randn(batch, seq, heads_q, head_dim, generator=gen, dtype=dtype)

    ref_inputs = [x.clone().requires_grad_() for x in (q_full, k_full, v_full)]
    ref_out = _reference(*ref_inputs, causal)
    (ref_out * weight).sum().backward()

    sizes = split_sizes(seq, world_size)
    start = sum(sizes[:rank])

    def shard(x: torch.Tensor) -> torch.Tensor:
        return x.narrow(1, start, sizes[rank])

    inputs = [shard(x).clone().requires_grad_() for x in (q_full, k_full, v_full)]
    if strided:  # the same values in heads-first memory: non-contiguous [b, s, h, d] views
        inputs = [x.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
                  for x in inputs]
    attention = UlyssesAttention()

    calls = {"all_to_all": 0, "transfers": 0}
    originals = {"all_to_all": dist.all_to_all_single, "transfers": dist.batch_isend_irecv}

    def counting(name):
        def count(*args, **kwargs):
            calls[name] += 1
            return originals[name](*args, **kwargs)
        return count

    dist.all_to_all_single = counting("all_to_all")
    dist.batch_isend_irecv = counting("transfers")
    try:
        out = attention(*inputs, causal=causal)
        forward_calls = dict(calls)
        (out * shard(weight)).sum().backward()
        backward_calls = {name: calls[name] - forward_calls[name] for name in calls}
    finally:
        dist.all_to_all_single = originals["all_to_all"]
        dist.batch_isend_irecv = originals["transfers"]

    tolerance = {} if dtype != torch.bfloat16 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(out, shard(ref_out.detach()), **tolerance)
    for got, ref in zip(inputs, ref_inputs):
        torch.testing.assert_close(got.grad, shard(ref.grad), **tolerance)
    return {"forward": forward_calls, "backward": backward_calls}


@pytest.mark.parametrize(("seq", "heads_q", "heads_kv", "causal", "expected"), [
    pytest.param(16, 4, 4, True, 2, id="mha-aligned"),
    pytest.param(13, 4, 4, False, 2, id="mha-uneven-seq"),
    pytest.param(12, 8, 2, True, 2, id="gqa-kv-divides-group"),
    pytest.param(12, 4, 1, True, 3, id="gqa-replicated-kv-separate"),
    pytest.param(12, 3, 3, False, 3, id="uneven-heads-separate"),
])
def test_ulysses_all_to_all_count(seq, heads_q, heads_kv, causal, expected):
    results = run_distributed(2, _count_ulysses_exchanges, seq, heads_q, heads_kv, causal)
    counts = {"all_to_all": expected, "transfers": 0}
    for rank, calls in enumerate(results):
        assert calls == {"forward": counts, "backward": counts}, (rank, calls)


def _assert_pipelined(results: list[dict]) -> None:
    counts = {"all_to_all": 0, "transfers": 2}
    for rank, calls in enumerate(results):
        assert calls == {"forward": counts, "backward": counts}, (rank, calls)


@pytest.mark.parametrize(("seq", "heads_q", "heads_kv", "causal"), [
    pytest.param(16, 8, 8, True, id="mha"),
    pytest.param(13, 8, 4, False, id="gqa-uneven-seq"),
    pytest.param(2 * CAUSAL_LEAF + 7, 4, 2, True, id="long-gqa"),
])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
def test_float32_ulysses_runs_tiles_around_one_exchange_each_way(seq, heads_q, heads_kv,
                                                                 causal, strided):
    results = run_distributed(2, _count_ulysses_exchanges, seq, heads_q, heads_kv, causal,
                              torch.float32, strided)
    _assert_pipelined(results)


@pytest.mark.parametrize(("world", "seq", "causal"), [
    pytest.param(2, 2 * CAUSAL_LEAF + 5, True, id="cp2-long-uneven"),
    pytest.param(4, 4 * CAUSAL_LEAF + 3, True, id="cp4-long-uneven"),
    pytest.param(4, 3, True, id="cp4-a-rank-without-tokens"),
    pytest.param(2, 1, True, id="cp2-one-token-no-peer-rows"),
    pytest.param(4, 21, False, id="cp4-not-causal"),
])
def test_one_row_batch_receives_in_place(world, seq, causal):
    """A one-row batch receives every peer's rows straight into the gathered buffer (the
    path the benchmark's long sequences take), at cp 2 and 4, with uneven shards."""
    results = run_distributed(world, _count_ulysses_exchanges, seq, 8, 8, causal,
                              torch.float32, False, 1)
    _assert_pipelined(results)


def test_bfloat16_ulysses_exchanges_in_its_own_dtype():
    results = run_distributed(2, _count_ulysses_exchanges, 2 * CAUSAL_LEAF + 1, 4, 4, True,
                              torch.bfloat16, False, 1)
    _assert_pipelined(results)


def _inside(span: slice, own: slice) -> bool:
    return own.start <= span.start and span.stop <= own.stop


def _outside(span: slice, own: slice) -> bool:
    return span.stop <= own.start or span.start >= own.stop


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("total", "ranks"), [(16, 2), (13, 2), (1031, 4), (3, 4), (700, 3)])
def test_tile_plan_covers_the_square_once(total, ranks, causal):
    """Every rank's tiles cover the attention square exactly once (causal: the lower
    triangle); local tiles read only the rank's own rows and columns, peer-row tiles only
    other ranks' rows, and own-row tiles the rank's rows against other columns."""
    expected = torch.ones(total, total, dtype=torch.int64)
    if causal:
        expected = expected.tril()
    for rank in range(ranks):
        plan = _plan_tiles(total, ranks, rank, causal)
        own = plan.own
        covered = torch.zeros(total, total, dtype=torch.int64)
        for part, tiles in (("local", plan.local), ("peer", plan.peer_rows),
                            ("own", plan.own_rows)):
            for tile in tiles:
                rows, cols = tile.rows, tile.cols
                assert _inside(rows, own) == (part != "peer"), (rank, part, tile)
                assert _outside(rows, own) == (part == "peer"), (rank, part, tile)
                if part != "peer":
                    assert _inside(cols, own) == (part == "local"), (rank, part, tile)
                    assert _outside(cols, own) == (part == "own"), (rank, part, tile)
                if tile.mask is CAUSAL:
                    block = torch.ones(rows.stop - rows.start, cols.stop - cols.start,
                                       dtype=torch.int64).tril()
                else:
                    assert tile.mask is None
                    block = 1
                covered[rows, cols] += block
        assert torch.equal(covered, expected), rank


def _work(tiles) -> int:
    return sum((t.rows.stop - t.rows.start) * (t.cols.stop - t.cols.start) for t in tiles)


@pytest.mark.parametrize(("total", "ranks", "rank"), [(2048, 2, 0), (2048, 2, 1),
                                                      (4 * CAUSAL_LEAF + 3, 4, 3), (16, 2, 1)])
def test_local_tiles_are_cut_where_half_their_work_is_done(total, ranks, rank):
    """The first local tiles run while the gather comes in, the rest while the rows for the
    other ranks go out: the cut is the first tile boundary at or past half the work."""
    plan = _plan_tiles(total, ranks, rank, True)
    early, late = plan.local_halves()
    assert early + late == plan.local
    assert 2 * _work(early) >= _work(plan.local) > 2 * _work(early[:-1])
