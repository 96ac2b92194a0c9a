"""A skip connection through the whole pipeline: an encoder output consumed by every stage.

Stage 0 encodes its input and sends ``(hidden, encoded)``; every later stage uses
``encoded`` and passes it on unchanged, so the encoder's gradient is the sum of the
contributions of all stages, carried back through each stage boundary beside the hidden
state's gradient. Loss and every parameter gradient must equal the unsplit model.
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
SEQ = 5
MICROBATCH_SIZE = 2
WORLD_SIZE = 4
NUM_MICROBATCHES = 8

# (schedule, stages_per_rank): 1F1B, and zero-bubble with split backward, on one stage per
# rank and on the V placement (two stages per rank, handed over locally at the turn).
SCHEDULES = [("1f1b", 1), ("zb-h1", 1), ("zb-v", 2)]


def _seeded(module: nn.Module, seed: int) -> nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.4)
    return module


class Encoder(nn.Module):
    """Stage 0: the hidden state starts from the input, the encoding is sent along with it."""

    def __init__(self):
        super().__init__()
        self.encode = nn.Linear(DIM, DIM)
        self.embed = nn.Linear(DIM, DIM)

    def forward(self, x):
        return self.embed(x), torch.tanh(self.encode(x))


class DecoderBlock(nn.Module):
    """A later stage: attends to the encoding (here: mixes it in) and forwards it unchanged."""

    def __init__(self):
        super().__init__()
        self.mix = nn.Linear(DIM, DIM)
        self.cross = nn.Linear(DIM, DIM, bias=False)

    def forward(self, hidden, encoded):
        return hidden + torch.tanh(self.mix(hidden) + self.cross(encoded)), encoded


def make_chunk(stage: int) -> nn.Module:
    return _seeded(Encoder() if stage == 0 else DecoderBlock(), 40 + stage)


def skip_loss(output, target):
    hidden, _ = output
    return ((hidden - target) ** 2).mean()


def data():
    generator = torch.Generator().manual_seed(5)
    inputs = torch.randn(NUM_MICROBATCHES * MICROBATCH_SIZE, SEQ, DIM, generator=generator)
    targets = torch.randn(NUM_MICROBATCHES * MICROBATCH_SIZE, SEQ, DIM, generator=generator)
    return inputs, targets


def reference(num_stages: int):
    """The unsplit model over the whole batch: loss and parameter gradients."""
    chunks = [make_chunk(s) for s in range(num_stages)]
    inputs, targets = data()
    output = chunks[0](inputs)
    for chunk in chunks[1:]:
        output = chunk(*output)
    loss = skip_loss(output, targets)
    loss.backward()
    grads = {f"{s}.{n}": p.grad for s, c in enumerate(chunks) for n, p in c.named_parameters()}
    return loss.detach(), grads


def run_schedules(rank, world_size):
    transport = P2PTransport()
    inputs, targets = data()
    results = {}
    for name, stages_per_rank in SCHEDULES:
        schedule = build(name, world_size, NUM_MICROBATCHES, stages_per_rank=stages_per_rank)
        last = schedule.num_stages - 1
        stages = {s: Stage(make_chunk(s), s, schedule.num_stages,
                           loss_fn=skip_loss if s == last else None)
                  for s in schedule.stages_of(rank)}
        executor = Executor(schedule, stages, pp_rank=rank,
                            pipeline_ranks=list(range(world_size)), transport=transport)
        step = executor.step(list(inputs.split(MICROBATCH_SIZE)),
                             list(targets.split(MICROBATCH_SIZE)))
        results[name] = {
            "loss": step.loss,
            "grads": stage_gradients(stages),
        }
    return results


@pytest.fixture(scope="module")
def pipeline_results():
    return run_distributed(WORLD_SIZE, run_schedules)


@pytest.mark.parametrize("name,stages_per_rank", SCHEDULES, ids=[s[0] for s in SCHEDULES])
def test_encoder_output_used_by_every_stage_matches_unsplit_model(pipeline_results, name,
                                                                  stages_per_rank):
    per_rank = [r[name] for r in pipeline_results]
    loss, grads = reference(WORLD_SIZE * stages_per_rank)
    losses = [r["loss"] for r in per_rank if r["loss"] is not None]
    assert len(losses) == 1, "exactly one rank holds the last stage"
    torch.testing.assert_close(torch.tensor(losses[0]), loss)
    seen = {name: grad for r in per_rank for name, grad in r["grads"].items()}
    assert seen.keys() == grads.keys()
    for parameter, grad in seen.items():
        torch.testing.assert_close(grad, grads[parameter], msg=lambda m, p=parameter: f"{p}: {m}")
