"""Ulysses in head groups: each group's exchange is started before the attention it can hide
behind, in forward and in backward, and the results are those of plain Ulysses.

Values against one process are checked by ``test_attention_parity.py`` (its ``groups2``
cases); here the order of the collectives and the attention calls is recorded on each rank.
"""

from __future__ import annotations

import pytest
import torch

from meshpipe.comm.collectives import split_sizes
from meshpipe.context import LocalAttention, UlyssesAttention
from meshpipe.context.head_groups import automatic_head_groups
from meshpipe.context.interface import AttentionError
from meshpipe.testing import run_distributed


class _Recorded(torch.nn.Module):
    """Local attention that logs each call, and when backward reaches its output."""

    def __init__(self, log: list[str]):
        super().__init__()
        self.inner, self.log, self.scale = LocalAttention(), log, None

    def forward(self, q, k, v, **options):
        call = sum(entry.startswith("attend ") for entry in self.log)
        self.log.append(f"attend {call}")
        out = self.inner(q, k, v, **options)
        if out.requires_grad:
            out.register_hook(lambda grad: self.log.append(f"attend-backward {call}"))
        return out


def _record_order(rank: int, world: int, groups: int) -> dict:
    import torch.distributed as dist

    torch.manual_seed(0)
    seq, heads, head_dim = 11, 8, 4
    full = [torch.randn(1, seq, heads, head_dim, dtype=torch.float64) for _ in range(3)]
    start = sum(split_sizes(seq, world)[:rank])
    local = [x.narrow(1, start, split_sizes(seq, world)[rank]).clone().requires_grad_()
             for x in full]
    log: list[str] = []
    original = dist.all_to_all_single

    class Work:
        def __init__(self, work, number):
            self.work, self.number = work, number

        def wait(self):
            log.append(f"wait {self.number}")
            return self.work.wait()

    def recording(*args, async_op=False, **kwargs):
        number = sum(entry.startswith("start ") for entry in log)
        log.append(f"start {number}" if async_op else f"blocking {number}")
        work = original(*args, async_op=async_op, **kwargs)
        return Work(work, number) if async_op else work

    dist.all_to_all_single = recording
    try:
        grouped = UlyssesAttention(_Recorded(log), head_groups=groups)
        out = grouped(*local, causal=True)
        forward = list(log)
        out.backward(torch.ones_like(out))
        backward = log[len(forward):]
    finally:
        dist.all_to_all_single = original
    grads = [x.grad for x in local]
    plain = [x.detach().clone().requires_grad_() for x in local]
    expected = UlyssesAttention(LocalAttention(), head_groups=1)(*plain, causal=True)
    expected.backward(torch.ones_like(expected))
    torch.testing.assert_close(out, expected)
    for got, want in zip(grads, (x.grad for x in plain)):
        torch.testing.assert_close(got, want)
    with torch.no_grad():
        torch.testing.assert_close(grouped(*local, causal=True), expected)
    return {"forward": forward, "backward": backward}


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_each_group_exchanges_while_another_attends(world):
    results = run_distributed(world, _record_order, 2)
    for rank, order in enumerate(results):
        # Both groups' q/k/v start out before group 0 attends; group 0's output starts back
        # before group 1 attends.
        assert order["forward"] == ["start 0", "start 1", "wait 0", "attend 0", "start 2",
                                    "wait 1", "attend 1", "start 3", "wait 2", "wait 3"], rank
        # Both groups' output gradients start in before group 0's backward; group 0's q/k/v
        # gradients start back before group 1's backward runs.
        assert order["backward"] == ["start 4", "start 5", "wait 4", "attend-backward 0",
                                     "start 6", "wait 5", "attend-backward 1", "start 7",
                                     "wait 6", "wait 7"], rank


def test_automatic_groups_only_where_exchanges_can_run_beside_the_kernels():
    assert automatic_head_groups("cuda", True, 4) == 2
    assert automatic_head_groups("cuda", True, 3) == 1  # odd key/value heads per rank
    assert automatic_head_groups("cuda", False, 4) == 1  # ring inside (hybrid)
    assert automatic_head_groups("cpu", True, 4) == 1


def test_head_groups_follow_what_is_asked_and_what_the_heads_allow():
    q, k = torch.empty(1, 8, 8, 4, device="meta"), torch.empty(1, 8, 4, 4, device="meta")
    assert UlyssesAttention()._head_groups(q, k, 2, True, "here") == 1  # not on CUDA
    assert UlyssesAttention(head_groups=2)._head_groups(q, k, 2, True, "here") == 2
    with pytest.raises(AttentionError, match="head_groups=4 .* 2 key/value heads split in 4"):
        UlyssesAttention(head_groups=4)._head_groups(q, k, 2, True, "here")
    with pytest.raises(AttentionError, match="head_groups=2"):
        UlyssesAttention(head_groups=2)._head_groups(q, k, 2, False, "here")
    with pytest.raises(ValueError, match="positive int"):
        UlyssesAttention(head_groups=0)


def _recomputed_against_saved(rank: int, world: int) -> None:
    """Head groups under activation checkpointing (``--recompute``): the forward, exchanges
    and all, runs again inside backward, and the gradients are those of the saved run."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(1)
    seq, heads, head_dim = 9, 4, 4
    full = [torch.randn(2, seq, heads, head_dim, dtype=torch.float64) for _ in range(3)]
    start = sum(split_sizes(seq, world)[:rank])
    attention = UlyssesAttention(head_groups=2)
    results = []
    for recompute in (False, True):
        local = [x.narrow(1, start, split_sizes(seq, world)[rank]).clone().requires_grad_()
                 for x in full]
        if recompute:
            out = checkpoint(lambda *qkv: attention(*qkv, causal=True), *local,
                             use_reentrant=False)
        else:
            out = attention(*local, causal=True)
        (out * out).sum().backward()
        results.append([out.detach(), *(x.grad for x in local)])
    for saved, recomputed in zip(*results):
        torch.testing.assert_close(recomputed, saved, rtol=0, atol=0)


@pytest.mark.distributed
def test_head_groups_recompute_in_backward():
    run_distributed(2, _recomputed_against_saved)
