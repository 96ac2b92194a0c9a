"""Ulysses exchanges q, k and v in one all-to-all (and back in one) where the heads allow.

Counts ``torch.distributed.all_to_all_single`` calls in one forward and one backward of
``UlyssesAttention`` on 2 ranks, and checks output and gradients against SDPA on the whole
sequence. In float64 the local attention is SDPA: one exchange each way. In float32 on CPU
the heads run in groups (``_PipelinedUlysses``), one exchange each way per group.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshpipe.comm.shards import split_sizes
from meshpipe.context import UlyssesAttention
from meshpipe.context.tiles import CAUSAL_LEAF
from meshpipe.testing import run_distributed


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               causal: bool) -> torch.Tensor:
    group = q.shape[2] // k.shape[2]
    k, v = (x.repeat_interleave(group, dim=2) for x in (k, v))
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                         v.transpose(1, 2), is_causal=causal)
    return out.transpose(1, 2)


def _count_ulysses_all_to_all(rank: int, world_size: int, seq: int, heads_q: int,
                              heads_kv: int, causal: bool, dtype: torch.dtype = torch.float64,
                              strided: bool = False) -> dict:
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(1234)
    batch, head_dim = 2, 8
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

    calls = {"n": 0}
    original = dist.all_to_all_single

    def counting(*args, **kwargs):
        calls["n"] += 1
        return original(*args, **kwargs)

    dist.all_to_all_single = counting
    try:
        out = attention(*inputs, causal=causal)
        forward_calls = calls["n"]
        (out * shard(weight)).sum().backward()
        backward_calls = calls["n"] - forward_calls
    finally:
        dist.all_to_all_single = original

    torch.testing.assert_close(out, shard(ref_out.detach()))
    for got, ref in zip(inputs, ref_inputs):
        torch.testing.assert_close(got.grad, shard(ref.grad))
    return {"forward": forward_calls, "backward": backward_calls}


@pytest.mark.parametrize(("seq", "heads_q", "heads_kv", "causal", "expected"), [
    pytest.param(16, 4, 4, True, 2, id="mha-aligned"),
    pytest.param(13, 4, 4, False, 2, id="mha-uneven-seq"),
    pytest.param(12, 8, 2, True, 2, id="gqa-kv-divides-group"),
    pytest.param(12, 4, 1, True, 3, id="gqa-replicated-kv-separate"),
    pytest.param(12, 3, 3, False, 3, id="uneven-heads-separate"),
])
def test_ulysses_all_to_all_count(seq, heads_q, heads_kv, causal, expected):
    results = run_distributed(2, _count_ulysses_all_to_all, seq, heads_q, heads_kv, causal)
    for rank, counts in enumerate(results):
        assert counts == {"forward": expected, "backward": expected}, (rank, counts)


@pytest.mark.parametrize(("seq", "heads_q", "heads_kv", "causal", "groups"), [
    pytest.param(16, 8, 8, True, 2, id="mha-2-groups"),
    pytest.param(13, 8, 4, False, 2, id="gqa-uneven-seq-2-groups"),
    pytest.param(2 * CAUSAL_LEAF + 7, 4, 2, True, 1, id="long-gqa-1-group"),
])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
def test_float32_ulysses_runs_head_group_by_head_group(seq, heads_q, heads_kv, causal, groups,
                                                       strided):
    results = run_distributed(2, _count_ulysses_all_to_all, seq, heads_q, heads_kv, causal,
                              torch.float32, strided)
    for rank, counts in enumerate(results):
        assert counts == {"forward": 2 * groups, "backward": 2 * groups}, (rank, counts)
