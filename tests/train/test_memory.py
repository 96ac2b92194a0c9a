"""Each rank's memory in metrics.json (``train.outputs.memory``): its optimizer state counted
from the state tensors and, on CUDA, read from the allocator across the step that made it."""

import pytest
import torch

from meshpipe.train.outputs.memory import OptimizerMemory


def _optimizer_after_steps(steps: int, device: torch.device):
    model = torch.nn.Linear(3, 2)  # 8 weights in 2 tensors
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    watched = OptimizerMemory(optimizer, device)
    for _ in range(steps):
        model(torch.ones(1, 3)).sum().backward()
        optimizer.step()
    return watched


def test_the_state_tensors_are_counted_and_a_cpu_has_no_allocator_figures():
    record = _optimizer_after_steps(2, torch.device("cpu")).record()
    # two float32 moments per weight and a float32 step per tensor (the fused kernel's)
    assert record == {"optimizer_state_bytes": 2 * 8 * 4 + 2 * 4,
                      "optimizer_state_allocator_bytes": None, "peak_allocated_bytes": None}


def test_on_cuda_the_allocator_is_read_across_the_step_that_made_the_state(monkeypatch):
    """The routing of the CUDA path, on a CPU: the allocator's readings are stand-ins."""
    readings = iter([1000, 1100, 5000, 6000])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: next(readings))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 123456)
    record = _optimizer_after_steps(3, torch.device("cuda")).record()
    assert record["optimizer_state_allocator_bytes"] == 100  # only the first step was read
    assert record["peak_allocated_bytes"] == 123456
    assert next(readings) == 5000


def _memory(rank, world_size, config):
    from meshpipe.train.loop.trainer import Trainer

    return Trainer(config).fit()["memory"]


@pytest.mark.distributed
def test_metrics_give_each_ranks_optimizer_state_a_shard_of_it_under_zero_1(tmp_path):
    from meshpipe.testing import run_distributed
    from meshpipe.train.config import TrainConfig
    from trainer_cases import SMALL

    base = dict(SMALL, pp=1, dp=2, steps=1)
    whole, sharded = (run_distributed(2, _memory, TrainConfig(
        **base, zero=zero, out_dir=str(tmp_path / str(zero)))) for zero in (0, 1))
    assert whole[1] is None and sharded[1] is None  # gathered on rank 0
    assert [record["rank"] for record in whole[0]] == [0, 1]
    for at_0, at_1 in zip(whole[0], sharded[0]):
        assert at_0["optimizer_state_allocator_bytes"] is None
        assert at_1["optimizer_state_bytes"] == pytest.approx(
            at_0["optimizer_state_bytes"] / 2, rel=0.01)
