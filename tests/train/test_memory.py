"""Each rank's memory in metrics.json (``train.outputs.memory``): its optimizer state counted
from the state tensors and, on CUDA, read from the allocator across the step that made it;
and a step's tensors freed by reference counting, none left to the cyclic collector."""

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


def _tensors_left_to_the_cyclic_collector(rank, world_size, config):
    """With Python's cyclic collector off, the tensors a second training step left in
    reference cycles, as ``(shape, dtype)``; the first step (setup, caches) is not counted."""
    import gc

    from meshpipe.train.loop.trainer import Trainer

    trainer = Trainer(config)
    trainer.train_step(0)
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what the collection finds stays in gc.garbage
    try:
        trainer.train_step(1)
        gc.collect()
        return [(tuple(o.shape), o.dtype) for o in gc.garbage if isinstance(o, torch.Tensor)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


@pytest.mark.distributed
@pytest.mark.parametrize("layout", [
    dict(pp=2, vpp=2, schedule="zb-v"),
    dict(pp=2, dp=2, ep=2, moe_experts=4, moe_top_k=2, schedule="combined-1f1b"),
], ids=["pp2-zb-v", "pp2-dp2-ep2-combined"])
def test_a_training_step_leaves_no_tensor_in_a_reference_cycle(layout, tmp_path):
    """A step's activations and gradients are freed when their last reference goes, not when
    Python's cyclic collector next runs (which would hold GPU memory for an unknown time)."""
    from meshpipe.testing import run_distributed
    from meshpipe.train.config import TrainConfig
    from trainer_cases import SMALL

    config = TrainConfig(**{**SMALL, **layout, "out_dir": str(tmp_path)})
    left = run_distributed(config.world_size, _tensors_left_to_the_cyclic_collector, config)
    assert left == [[]] * config.world_size
