"""Pipeline positions of different sizes through the real Executor: VTPTransport (root +
broadcast) and FanoutTransport (linked ranks, averaged fan-in), async and batched.

Every rank of a position holds identical weights (no tensor parallelism is needed to test
the transport: a position's ranks compute the same output, as tensor-parallel ranks do), so
the loss and the gradients on every rank equal one process running the whole model.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from meshpipe.comm.averaging import average_messages
from meshpipe.comm.errors import MessageMismatchError
from meshpipe.comm.transport import is_stop_notice, stop_notice
from meshpipe.comm.vtp import FanoutTransport, VTPTransport, linked_ranks
from meshpipe.runtime import Executor, ExecutorError, Stage
from meshpipe.schedules import build
from meshpipe.testing import run_distributed

pytestmark = pytest.mark.distributed

DIM = 4
MICROBATCHES = 4
TIMEOUT = 30.0
GROUP_TIMEOUT = timedelta(seconds=30)


class Block(nn.Module):
    """One stage: a linear layer and a tanh; ``fail_at`` makes that forward call raise."""

    def __init__(self, index: int, fail_at: int | None = None):
        super().__init__()
        generator = torch.Generator().manual_seed(100 + index)
        self.linear = nn.Linear(DIM, DIM)
        with torch.no_grad():
            self.linear.weight.copy_(torch.randn(DIM, DIM, generator=generator) / 2)
            self.linear.bias.copy_(torch.randn(DIM, generator=generator) / 2)
        self.fail_at = fail_at
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("deliberate failure inside the module")
        return torch.tanh(self.linear(x))


def mean_square(output, target):
    return ((output - target) ** 2).mean()


def data(microbatches: int = MICROBATCHES):
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(3, DIM, generator=generator) for _ in range(microbatches)]
    targets = [torch.randn(3, DIM, generator=generator) for _ in range(microbatches)]
    return inputs, targets


def reference(num_stages: int):
    """Mean loss and every stage's gradients, in one process."""
    blocks = [Block(s) for s in range(num_stages)]
    inputs, targets = data()
    losses = []
    for x, target in zip(inputs, targets):
        for block in blocks:
            x = block(x)
        losses.append(mean_square(x, target))
    loss = torch.stack(losses).mean()
    loss.backward()
    return loss.detach(), {s: {n: p.grad for n, p in block.named_parameters()}
                           for s, block in enumerate(blocks)}


def _transport(kind: str, stage_ranks, mode: str, group):
    """The stage-link transport over ``group``, plus every stage's group (made on all ranks,
    in the same order, as dist.new_group needs)."""
    rank = dist.get_rank()
    intra = [dist.new_group(list(ranks), timeout=GROUP_TIMEOUT) for ranks in stage_ranks]
    mine = next(s for s, ranks in enumerate(stage_ranks) if rank in ranks)
    if kind == "root":
        transport = VTPTransport(stage_ranks, intra[mine], group=group, timeout=TIMEOUT,
                                 mode=mode)
    else:
        transport = FanoutTransport(stage_ranks, group=group, timeout=TIMEOUT, mode=mode)
    return transport, intra


def _pipeline(rank, stage_ranks, schedule, kind, mode, fail=None):
    """This rank's executor over identical-weight blocks, and its groups."""
    group = dist.new_group(timeout=GROUP_TIMEOUT)
    transport, intra = _transport(kind, stage_ranks, mode, group)
    position = next(p for p, ranks in enumerate(stage_ranks) if rank in ranks)
    last = schedule.num_stages - 1
    stages = {s: Stage(Block(s, fail_at=fail.get(rank) if fail and s == 0 else None),
                       s, schedule.num_stages, loss_fn=mean_square if s == last else None)
              for s in schedule.stages_of(position)}
    # any rank names its position; this rank names its own
    pipeline_ranks = [rank if p == position else ranks[0]
                      for p, ranks in enumerate(stage_ranks)]
    executor = Executor(schedule, stages, pp_rank=position, pipeline_ranks=pipeline_ranks,
                        transport=transport, recv_timeout=TIMEOUT)
    return executor, stages, transport, [group, *intra]


def _step(rank, world_size, stage_ranks, name, placement, vpp, kind, mode):
    schedule = build(name, len(stage_ranks), MICROBATCHES, stages_per_rank=vpp,
                     placement=placement)
    executor, stages, transport, groups = _pipeline(rank, stage_ranks, schedule, kind, mode)
    inputs, targets = data()
    result = executor.step(inputs if executor.holds_first_stage else None,
                           targets if schedule.num_stages - 1 in stages else None)
    stats = transport.stats
    grads = {s: {n: p.grad.clone() for n, p in stage.module.named_parameters()}
             for s, stage in stages.items()}
    for group in groups:
        dist.destroy_process_group(group)
    return {"loss": result.loss, "grads": grads, "batches": stats.batches_posted,
            "sent": stats.messages_sent, "received": stats.messages_received,
            "messages": stats.messages_sent + stats.messages_received,
            "broadcasts": stats.broadcasts}


# (stage ranks per position, schedule, placement, stages per rank)
LAYOUTS = [
    ([[0], [1, 2]], "1f1b", None, 1),
    ([[0, 1], [2]], "1f1b", None, 1),
    ([[0], [1, 2]], "zb-v", None, 2),            # V: position 1 sends back to position 0
    ([[0], [1, 2], [3]], "1f1b", "wraparound", 1),  # the last position feeds position 0
    ([[0, 1], [2], [3]], "gpipe", "wraparound", 1),
]


@pytest.mark.parametrize("mode", ["async", "batched"])
@pytest.mark.parametrize("kind", ["root", "fanout"])
@pytest.mark.parametrize("stage_ranks, name, placement, vpp", LAYOUTS,
                         ids=[f"{'-'.join(str(len(r)) for r in c[0])}-{c[1]}"
                              f"{'-wrap' if c[2] else ''}" for c in LAYOUTS])
def test_positions_of_different_sizes_match_one_process(stage_ranks, name, placement, vpp,
                                                        kind, mode):
    world_size = sum(len(ranks) for ranks in stage_ranks)
    results = run_distributed(world_size, _step, stage_ranks, name, placement, vpp, kind, mode)
    num_stages = len(stage_ranks) * vpp + (placement == "wraparound")
    loss, grads = reference(num_stages)
    losses = [r["loss"] for r in results if r["loss"] is not None]
    last_position = build(name, len(stage_ranks), MICROBATCHES, stages_per_rank=vpp,
                          placement=placement).placement[num_stages - 1]
    assert len(losses) == len(stage_ranks[last_position])  # every rank of it has the loss
    for value in losses:
        torch.testing.assert_close(torch.tensor(value), loss)
    held = set()
    for rank, r in enumerate(results):
        for stage, stage_grads in r["grads"].items():
            held.add(stage)
            for param, grad in stage_grads.items():
                torch.testing.assert_close(grad, grads[stage][param],
                                           msg=lambda m, s=stage, p=param, k=rank:
                                           f"rank {k} stage {s} {p}: {m}")
        assert (r["batches"] > 0) == (mode == "batched" and r["messages"] > 0)
        if kind == "fanout":  # every rank talks, nobody broadcasts
            assert r["broadcasts"] == 0 and r["messages"] > 0
        elif rank not in [ranks[0] for ranks in stage_ranks]:  # only roots talk
            assert r["messages"] == 0 and r["broadcasts"] > 0
    assert held == set(range(num_stages))
    assert sum(r["sent"] for r in results) == sum(r["received"] for r in results)


def _links(rank, world_size, stage_ranks):
    transport = FanoutTransport(stage_ranks, timeout=TIMEOUT)
    others = [s for s in range(len(stage_ranks)) if s != transport.stage_index]
    return (transport.stage_index, transport.tp_index, transport.stage_of(3),
            {s: transport.links(s) for s in others})


def test_fanout_links_each_rank_of_the_bigger_stage_to_one_rank_of_the_smaller():
    # positions of 1, 2 and 1 ranks, numbered out of order
    seen = run_distributed(4, _links, [[3], [0, 2], [1]])
    assert [s[:3] for s in seen] == [(1, 0, 0), (2, 0, 0), (1, 1, 0), (0, 0, 0)]
    assert seen[3][3] == {1: [0, 2], 2: [1]}             # fan-out from a 1-rank position
    assert seen[0][3] == {0: [3], 2: [1]} == seen[2][3]  # each of 2 ranks links to the 1
    assert seen[1][3] == {0: [3], 1: [0, 2]}
    # the rule for sizes that do not divide: j of the bigger -> j * small // big
    stage_ranks = [[3], [0, 2, 1], [4, 5]]
    assert [linked_ranks(stage_ranks, r, 2) for r in (0, 2, 1)] == [[4], [4], [5]]
    assert [linked_ranks(stage_ranks, r, 1) for r in (4, 5)] == [[0, 2], [1]]
    assert linked_ranks(stage_ranks, 1, 0) == [3] and linked_ranks(stage_ranks, 3, 1) == [0, 2, 1]
    assert linked_ranks([[0, 1], [2, 3]], 1, 1) == [3]  # equal sizes: j <-> j
    with pytest.raises(ValueError, match="not another stage"):
        linked_ranks(stage_ranks, 4, 2)


def _fan_in_failure(rank, world_size, mode):
    """Rank 1 (second rank of position 0) fails on its second forward; position 1 (rank 2)
    gets a stop notice from rank 1 and a real message from rank 0 on one fan-in."""
    stage_ranks = [[0, 1], [2]]
    schedule = build("1f1b", 2, 2)
    executor, _, _, _ = _pipeline(rank, stage_ranks, schedule, "fanout", mode, fail={1: 2})
    inputs, targets = data(2)
    outcome = None
    try:
        executor.step(inputs if rank < 2 else None, targets if rank == 2 else None)
    except ExecutorError as error:
        outcome = {"type": type(error).__name__, "message": str(error),
                   "failed_rank": getattr(error, "failed_rank", None)}
    dist.barrier()  # nobody drops its transport while a peer still waits on it
    return outcome


@pytest.mark.parametrize("mode", ["async", "batched"])
def test_a_stop_notice_crosses_a_fan_in(mode):
    first, failing, last = run_distributed(3, _fan_in_failure, mode)
    assert failing["type"] == "ExecutorError"
    assert "deliberate failure inside the module" in failing["message"]
    # the fan-in returned rank 1's notice instead of averaging it with rank 0's activation
    assert last["type"] == "PeerFailedError" and last["failed_rank"] == 1
    assert "stage 0 -> 1, microbatch 1, forward" in last["message"]
    # ... and rank 2 passed the stop on to rank 0 through its fan-out
    assert first["type"] == "PeerFailedError" and first["failed_rank"] == 1
    assert "deliberate failure" in first["message"]


def test_average_messages_passes_a_stop_notice_through_and_names_differences():
    notice = stop_notice(1, "boom")
    real = (torch.ones(2), 3)
    assert is_stop_notice(notice) and not is_stop_notice({"x": 1})
    assert average_messages([real, notice], [0, 1], "m", rank=2,
                            passthrough=is_stop_notice) is notice
    with pytest.raises(MessageMismatchError, match="rank 2 cannot average 'm' from ranks"):
        average_messages([real, notice], [0, 1], "m", rank=2)
    mean = average_messages([(torch.zeros(2), 3), (torch.ones(2), 3)], [0, 1], rank=2)
    torch.testing.assert_close(mean[0], torch.full((2,), 0.5))
    assert mean[1] == 3


def _transports_implement_the_protocol(rank, world_size):
    from meshpipe.comm.p2p import P2PTransport
    from meshpipe.comm.transport import Transport

    stage_ranks = [[0], [1]]
    transports = [P2PTransport(timeout=9.0), VTPTransport(stage_ranks, timeout=9.0),
                  FanoutTransport(stage_ranks, timeout=9.0)]
    return [(type(t).__name__, isinstance(t, Transport), t.timeout) for t in transports]


def test_every_transport_offers_what_the_executor_is_typed_for():
    import typing

    from meshpipe.comm.transport import Transport
    from meshpipe.runtime.executor import Executor

    assert typing.get_type_hints(Executor.__init__)["transport"] is Transport
    for name, implements, timeout in run_distributed(2, _transports_implement_the_protocol)[0]:
        assert implements and timeout == 9.0, name
