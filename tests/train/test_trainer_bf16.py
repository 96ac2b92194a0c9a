"""``--dtype bf16`` trains bfloat16 weights with float32 masters: the stages compute in
bfloat16, the optimizer, checkpoints and ``--check`` see the masters, and a resumed run
continues exactly. Ulysses in head groups (CUDA's default) trains as one process too."""

import pytest
import torch

from meshpipe.testing import run_distributed
from meshpipe.train.config import TrainConfig
from meshpipe.train.loop.trainer import Trainer

from trainer_cases import SMALL, check_first_step, train

pytestmark = pytest.mark.distributed


def _weights_after_steps(rank, world_size, config):
    from meshpipe.parallel.zero import OptimizerMoments

    trainer = Trainer(config)
    stage_dtypes = {p.dtype for stage in trainer.stages.values()
                    for p in stage.module.parameters()}
    optimized = {p.dtype for group in trainer.optimizer.param_groups for p in group["params"]}
    for step in range(2):
        trainer.train_step(step)
    trainer._all_weights()
    values = OptimizerMoments(trainer.optimizer, trainer.gradients.buckets)  # whole, gathered
    stale = [name for name, master in trainer.parameters
             if not torch.equal(trainer.masters.model_of(master),
                                values.value_of(master).to(torch.bfloat16))]
    model_grads = [p.grad for stage in trainer.stages.values()
                   for p in stage.module.parameters() if p.grad is not None]
    held = sum(master.untyped_storage().nbytes() for _, master in trainer.parameters)
    whole = sum(4 * master.numel() for _, master in trainer.parameters)
    return stage_dtypes, optimized, stale, len(model_grads), held / whole


@pytest.mark.parametrize(("layout", "masters_held"), [(dict(pp=2), 1.0),
                                                      (dict(pp=2, dp=2, zero=2), 0.0)],
                         ids=["pp2", "pp2-dp2-zero2"])
def test_bf16_stages_compute_in_bfloat16_and_step_float32_masters(layout, masters_held):
    config = TrainConfig(**{**SMALL, **layout, "dtype": "bf16"})
    for stage_dtypes, optimized, stale, model_grads, held in run_distributed(
            config.world_size, _weights_after_steps, config):
        assert stage_dtypes == {torch.bfloat16}
        assert optimized == {torch.float32}
        assert stale == []  # every stage holds its masters, rounded, after the steps
        assert model_grads == 0  # each gradient moved on to its master
        # Under --zero the replicas hold a shard of the masters each (in the buckets), the
        # masters themselves nothing.
        assert held == pytest.approx(masters_held, abs=1e-3)


@pytest.mark.parametrize("layout", [dict(pp=2, vpp=2, schedule="zb-v"),
                                    dict(pp=2, dp=2, zero=1, tie_embeddings=True)],
                         ids=["zb-v", "dp2-zero1-tied"])
def test_bf16_check_passes_with_master_weights(layout):
    config = TrainConfig(**{**SMALL, **layout, "dtype": "bf16"})
    report = run_distributed(config.world_size, check_first_step, config)[0]
    assert report["passed"], report
    assert report["dtype"] == "bf16"


ZERO1 = dict(pp=1, schedule="none", dp=2, zero=1)


@pytest.mark.parametrize(("layout", "resumed_as"), [
    (dict(pp=2), {}), (ZERO1, {}),
    pytest.param(ZERO1, dict(zero=0), marks=pytest.mark.slow),
    pytest.param(dict(ZERO1, zero=0), dict(zero=2), marks=pytest.mark.slow)],
    ids=["pp2", "dp2-zero1-sharded-masters", "zero1-as-zero0", "zero0-as-zero2"])
def test_a_bf16_run_resumes_exactly(tmp_path, layout, resumed_as):
    """Also across zero levels: the masters are saved whole whether they were sharded."""
    base = dict(SMALL, **layout, out_dir=str(tmp_path), checkpoint_every=2, dtype="bf16",
                steps=4)
    world = TrainConfig(**base).world_size
    straight = run_distributed(world, train, TrainConfig(**base))[0]
    resumed = run_distributed(world, train, TrainConfig(**{**base, **resumed_as}, resume=True),
                              rewind_to="step-000002")[0]
    assert resumed == straight  # the history of the whole run, the steps before the resume too


def test_a_tied_hugging_face_model_in_bf16_matches_transformers_with_masters(tmp_path):
    pytest.importorskip("transformers")
    from hf_models import save_tiny_model
    from trainer_cases import for_a_model

    directory = save_tiny_model(tmp_path / "model", "llama", tie_word_embeddings=True)
    config = TrainConfig(**for_a_model(SMALL), pp=2, dtype="bf16", model=str(directory),
                         out_dir=str(tmp_path / "run"))
    report = run_distributed(config.world_size, check_first_step, config)[0]
    assert report["passed"], report


def _check_with_two_head_groups(rank, world_size, config):
    """``--check`` with Ulysses running two head groups, as it does by itself on CUDA; the
    report and how many attention calls ran in groups on this rank."""
    from meshpipe.context import head_groups, ulysses

    calls = []
    original = head_groups.HeadGroupUlysses.apply
    ulysses.automatic_head_groups = lambda *args: 2
    head_groups.HeadGroupUlysses.apply = lambda *args: calls.append(args[6]) or original(*args)
    try:
        return Trainer(config).check_first_step(), calls
    finally:
        ulysses.automatic_head_groups = head_groups.automatic_head_groups
        head_groups.HeadGroupUlysses.apply = original


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_ulysses_head_groups_train_as_one_process(dtype):
    """The trainer's Ulysses in two head groups (their exchanges overlapping each other's
    attention on CUDA), through a ZB-V pipeline, against one process."""
    config = TrainConfig(**{**SMALL, "heads": 8, "kv_heads": 4}, pp=2, vpp=2, schedule="zb-v",
                         cp_ulysses=2, dtype=dtype)
    results = run_distributed(config.world_size, _check_with_two_head_groups, config)
    report = results[0][0]
    assert report["passed"], report
    for _, calls in results:  # every layer of every microbatch, in two groups
        assert calls and set(calls) == {2}
