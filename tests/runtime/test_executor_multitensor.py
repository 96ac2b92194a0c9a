"""Stages exchanging several tensors of different dtypes, a None and a Python int: parity.

Every pipeline message is ``(hidden float32, side bfloat16, ids int64, None, length int)``;
the sequence length differs in every microbatch and no shape or dtype is declared
anywhere. The float32 and bfloat16 tensors carry gradients back, the int64 ids, the None
and the int travel forward only. Loss and every parameter gradient must equal one process
running the same blocks on the same microbatches.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from meshpipe.comm.p2p import P2PTransport
from meshpipe.runtime import Executor, Stage
from meshpipe.schedules import build
from meshpipe.testing import run_distributed
from pipeline_cases import stage_gradients

pytestmark = pytest.mark.distributed

DIM = 8
VOCAB = 16
MICROBATCH_SIZE = 2

# (schedule, stages_per_rank) run on every world size, with 2 * world_size microbatches (what
# interleaved needs); one worker call per world size.
SCHEDULES = [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)]
WORLD_SIZES = [2, 4]


class MultiTensorBlock(nn.Module):
    """Consumes and produces the whole multi-dtype message; checks its non-tensor parts."""

    def __init__(self, index: int):
        super().__init__()
        generator = torch.Generator().manual_seed(100 + index)
        self.hidden = nn.Linear(DIM, DIM)
        self.side = nn.Linear(DIM, DIM)
        self.embed = nn.Embedding(VOCAB, DIM)
        for parameter in self.parameters():
            with torch.no_grad():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)

    def forward(self, hidden, side, ids, nothing, length):
        if nothing is not None or not isinstance(length, int) or hidden.shape[1] != length:
            raise ValueError(f"bad message: nothing={nothing!r} length={length!r} "
                             f"hidden={tuple(hidden.shape)}")
        if side.dtype != torch.bfloat16 or ids.dtype != torch.int64:
            raise ValueError(f"dtypes arrived as {side.dtype}, {ids.dtype}")
        mixed = torch.tanh(self.hidden(hidden) + self.embed(ids) + side.float())
        next_side = self.side(mixed).to(torch.bfloat16)
        next_ids = (ids * 5 + 3) % VOCAB
        return mixed, next_side, next_ids, None, length


def multitensor_loss(output, target):
    hidden, side, _, _, _ = output
    return ((hidden - target) ** 2).mean() + side.float().pow(2).mean()


def microbatches(count: int, seed: int = 7):
    """Messages for stage 0 and targets; microbatch ``m`` has sequence length ``3 + m``."""
    generator = torch.Generator().manual_seed(seed)
    inputs, targets = [], []
    for m in range(count):
        length = 3 + m
        hidden = torch.randn(MICROBATCH_SIZE, length, DIM, generator=generator)
        side = torch.randn(MICROBATCH_SIZE, length, DIM, generator=generator).to(torch.bfloat16)
        ids = torch.randint(0, VOCAB, (MICROBATCH_SIZE, length), generator=generator)
        inputs.append((hidden, side, ids, None, length))
        targets.append(torch.randn(MICROBATCH_SIZE, length, DIM, generator=generator))
    return inputs, targets


def reference(num_stages: int, num_microbatches: int):
    """Mean loss over microbatches and parameter gradients of one process."""
    blocks = [MultiTensorBlock(s) for s in range(num_stages)]
    inputs, targets = microbatches(num_microbatches)
    losses = []
    for message, target in zip(inputs, targets):
        for block in blocks:
            message = block(*message)
        loss = multitensor_loss(message, target)
        (loss / num_microbatches).backward()
        losses.append(loss.detach())
    grads = {f"{s}.{n}": p.grad for s, b in enumerate(blocks) for n, p in b.named_parameters()}
    return torch.stack(losses).mean(), grads


def run_schedules(rank, world_size):
    """On every rank: one step of each schedule in SCHEDULES; loss and this rank's grads."""
    transport = P2PTransport()
    inputs, targets = microbatches(2 * world_size)
    results = {}
    for name, stages_per_rank in SCHEDULES:
        schedule = build(name, world_size, 2 * world_size, stages_per_rank=stages_per_rank)
        last = schedule.num_stages - 1
        stages = {s: Stage(MultiTensorBlock(s), s, schedule.num_stages,
                           loss_fn=multitensor_loss if s == last else None)
                  for s in schedule.stages_of(rank)}
        executor = Executor(schedule, stages, pp_rank=rank,
                            pipeline_ranks=list(range(world_size)), transport=transport)
        step = executor.step(inputs, targets)
        results[name] = {
            "loss": step.loss,
            "grads": stage_gradients(stages),
        }
    return results


@pytest.fixture(scope="module")
def pipeline_results():
    return {world_size: run_distributed(world_size, run_schedules) for world_size in WORLD_SIZES}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("name,stages_per_rank", SCHEDULES, ids=[s[0] for s in SCHEDULES])
def test_multitensor_messages_match_single_process(pipeline_results, world_size, name,
                                                   stages_per_rank):
    per_rank = [r[name] for r in pipeline_results[world_size]]
    loss, grads = reference(world_size * stages_per_rank, 2 * world_size)
    losses = [r["loss"] for r in per_rank if r["loss"] is not None]
    assert len(losses) == 1, "exactly one rank holds the last stage"
    torch.testing.assert_close(torch.tensor(losses[0]), loss)
    seen = {name: grad for r in per_rank for name, grad in r["grads"].items()}
    assert seen.keys() == grads.keys()
    for parameter, grad in seen.items():
        torch.testing.assert_close(grad, grads[parameter], msg=lambda m, p=parameter: f"{p}: {m}")
