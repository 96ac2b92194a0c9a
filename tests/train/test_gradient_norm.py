"""The global gradient norm: the same as one process's in every layout (tied copies, tensor
shards and experts counted once, ZeRO shards summed over replicas), and computed with a
fixed number of ops whatever the number of parameters (on GPUs each op is a launch); so is
clipping. Non-finite gradients are blamed on the replica they came from."""

import math
from dataclasses import replace

import pytest

from dispatched_ops import DispatchedOps
from meshpipe.testing import run_distributed
from meshpipe.train.config import TrainConfig
from meshpipe.train.loop.nonfinite import NonFiniteError
from meshpipe.train.loop.trainer import Trainer
from meshpipe.train.run import sources
from trainer_cases import SMALL

pytestmark = pytest.mark.distributed

LAYOUTS = {
    "pp2-tied": dict(pp=2, tie_embeddings=True),
    "dp2-zero2": dict(pp=1, schedule="none", dp=2, zero=2),
    "tp2": dict(pp=1, schedule="none", tp=2),
    "ep2-dp2": dict(pp=1, schedule="none", dp=2, moe_experts=4, moe_top_k=2, ep=2),
}


def _counted(fn):
    """``fn()`` and the number of ops it ran."""
    with DispatchedOps() as ops:
        value = fn()
    return value, len(ops.called)


def _norm_of_step_zero(rank, world_size, config):
    """Step 0's gradient norm and its op count; the op count of clipping to a tenth of it,
    and the norm after."""
    trainer = Trainer(config)
    inputs, targets = trainer.microbatches(trainer.train_data, 0)
    trainer.executor.step(inputs, targets)
    trainer.gradients.reduce()
    norm, norm_ops = _counted(trainer.gradients.norm)
    trainer.gradients.config = replace(config, grad_clip=norm / 10)
    _, clip_ops = _counted(lambda: trainer.gradients.clip(norm))
    return norm, norm_ops, clip_ops, trainer.gradients.norm()


def _config(flags: dict) -> TrainConfig:
    return TrainConfig(**{**SMALL, "steps": 1, **flags})


def _norm(flags: dict) -> tuple[float, int, int, float]:
    config = _config(flags)
    found = run_distributed(config.world_size, _norm_of_step_zero, config)
    assert len({norm for norm, *_ in found}) == 1  # every rank gets the same
    return found[0]


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_every_layout_has_the_norm_of_one_process(layout):
    _, grads = sources.reference_step(_config(layout))  # the global batch, one process
    expected = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))
    norm, _, _, clipped = _norm(layout)
    assert norm == pytest.approx(expected, rel=1e-5)
    assert clipped == pytest.approx(norm / 10, rel=1e-5)


def test_norm_and_clip_take_as_many_ops_for_many_parameters_as_for_few():
    _, norm_few, clip_few, _ = _norm(dict(pp=1, schedule="none", layers=2))
    _, norm_many, clip_many, _ = _norm(dict(pp=1, schedule="none", layers=8))
    assert (norm_many, clip_many) == (norm_few, clip_few)


def _nan_gradients_on_rank_one(rank, world_size, config):
    """Step 0 with one of rank 1's weight gradients made NaN in its backward (its loss
    stays finite): what the run reports."""
    trainer = Trainer(config)
    if rank == 1:
        weight = next(p for stage in trainer.stages.values()
                      for p in stage.module.parameters())
        weight.register_hook(lambda grad: grad * float("nan"))
    try:
        trainer.train_step(0)
    except NonFiniteError as error:
        return error.blamed_rank, str(error)
    return None


def test_gradients_that_are_not_finite_on_one_replica_are_blamed_on_it():
    """Each rank's own gradients are checked before the reduction mixes them (a flag read
    only when the step is not finite), so the report names the replica they came from."""
    config = _config(dict(pp=1, schedule="none", dp=2))
    for blamed, message in run_distributed(2, _nan_gradients_on_rank_one, config):
        assert blamed == 1 and "the gradient norm is nan (first seen on rank 1" in message
