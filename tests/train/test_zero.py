"""--zero 1/2: the optimizer states (and with 2 the reduced gradients) sharded over the
replicas of each weight. Three steps of every layout end with the weights of --zero 0; each
rank holds its share of the moments; --check stays exact."""

import dataclasses
import math

import pytest
import torch

from meshpipe.testing import run_distributed
from meshpipe.train.checkpoints import store as checkpoint
from meshpipe.train.config import TrainConfig
from meshpipe.train.loop.trainer import Trainer
from trainer_cases import SMALL, check_first_step, train

pytestmark = pytest.mark.distributed

MOE = dict(SMALL, moe_experts=4)
# Each layout with the levels it runs beside --zero 0: level 2 runs level 1's path (shards,
# gathers, sharded norm) and also frees the whole gradients, so most layouts run it alone.
LAYOUTS = {
    "pp2-dp2": (dict(SMALL, pp=2, dp=2), (1, 2)),
    "dp2-ring2": (dict(SMALL, pp=1, schedule="none", dp=2, cp_ring=2), (2,)),
    "tp2-sp-dp2": (dict(SMALL, pp=1, schedule="none", tp=2, sequence_parallel=True, dp=2),
                   (2,)),
    "dp4-ep2-combined": (dict(MOE, pp=1, dp=4, ep=2, schedule="combined-1f1b"), (1, 2)),
    "pp2-dp2-zbv": (dict(SMALL, pp=2, dp=2, schedule="zb-v"), (2,)),
    "pp2-dp2-tied": (dict(SMALL, pp=2, dp=2, tie_embeddings=True), (2,)),
    "pp2-wraparound-tied-dp2": (dict(SMALL, pp=2, dp=2, placement="wraparound",
                                     tie_embeddings=True), (1,)),
    "pp2-dp2-fp16-skipped-step": (dict(SMALL, pp=2, dp=2, dtype="fp16"), (1, 2)),
    "pp2-vpp2-interleaved-ulysses2": (dict(SMALL, pp=2, vpp=2, schedule="interleaved",
                                           cp_ulysses=2), (2,)),
}


def _three_steps(rank, world_size, config):
    """Train steps 0-2 (under fp16 step 0 overflows and is skipped); the weights after, the
    steps skipped, and this rank's optimizer-state and whole-parameter element counts."""
    trainer = Trainer(config)
    skipped = []
    for step in range(3):
        if trainer.scaler is not None:
            trainer.scaler.scale = 2.0 ** 60 if step == 0 else 2.0 ** 10
        skipped.append(trainer.train_step(step).skipped)
    trainer.gradients.all_weights()
    moments = sum(state["exp_avg"].numel() for state in trainer.optimizer.state.values())
    weights = sum(p.numel() for _, p in trainer.parameters if p.requires_grad)
    buckets = len(trainer.gradients.buckets)
    return ({name: p.detach().clone() for name, p in trainer.parameters}, skipped,
            (moments, weights, buckets))


def _assert_same_training(layout: dict, levels: tuple[int, ...] = (1, 2)) -> None:
    """Three steps at each of ``levels`` end where --zero 0 does, skipping the same steps;
    each rank's AdamW moments cover its share of its stage's weights (all of them at 0; up
    to the padding of each bucket)."""
    unsharded = TrainConfig(**layout)
    expected = run_distributed(unsharded.world_size, _three_steps, unsharded)
    replicas = unsharded.dp * unsharded.layout.cp
    for zero, results in [(0, expected)] + [
            (zero, run_distributed(unsharded.world_size, _three_steps,
                                   TrainConfig(**layout, zero=zero))) for zero in levels]:
        for rank, ((weights, skipped, held), (want, want_skipped, _)) in enumerate(
                zip(results, expected)):
            assert skipped == want_skipped, (zero, rank)
            for name, tensor in weights.items():
                torch.testing.assert_close(tensor, want[name], msg=f"zero {zero} rank "
                                           f"{rank} {name}")
            moments, parameters, buckets = held
            if not unsharded.moe_experts:  # experts are shared out over their own group
                share = 1 / replicas if zero else 1
                assert math.isclose(moments, share * parameters, abs_tol=buckets), (zero, held)
        if layout.get("dtype") == "fp16":
            assert results[0][1] == [True, False, False]


# make test runs these layouts (a pipeline, context parallelism, a tied embedding); the
# others are marked slow (make test-slow, CI).
DEFAULT_LAYOUTS = ("pp2-dp2", "dp2-ring2", "pp2-dp2-tied")


@pytest.mark.parametrize("layout,levels", [
    pytest.param(*value, id=name, marks=() if name in DEFAULT_LAYOUTS else pytest.mark.slow)
    for name, value in LAYOUTS.items()])
def test_sharded_optimizer_trains_the_weights_of_the_unsharded_one(layout, levels):
    _assert_same_training(layout, levels)


@pytest.mark.slow
def test_a_hugging_face_model_trains_the_same_sharded(tmp_path):
    pytest.importorskip("transformers")
    from hf_models import save_tiny_model

    directory = save_tiny_model(tmp_path / "model", "llama", tie_word_embeddings=True)
    model_flags = ("dim", "layers", "heads", "kv_heads")
    _assert_same_training({**{k: v for k, v in SMALL.items() if k not in model_flags},
                           "model": str(directory), "pp": 2, "dp": 2,
                           "out_dir": str(tmp_path / "run")})


@pytest.mark.parametrize("zero", [1, 2])
def test_check_stays_exact_with_a_sharded_optimizer(zero):
    config = TrainConfig(**{**SMALL, "pp": 2, "dp": 2, "zero": zero})
    report = run_distributed(config.world_size, check_first_step, config)[0]
    assert report["mismatched"] == [] and report["passed"], report


def _load_then_save(rank, world_size, config, source, target_root):
    """Load checkpoint ``source`` into ``config``'s layout and save it again at once."""
    trainer = Trainer(config)
    step = checkpoint.read_info(source).step
    trainer.checkpointer.load(source, step)
    checkpoint.save(target_root, trainer.parameters, trainer.optimizer, step, trainer.tp_group,
                    trainer.scaler, config=config.to_dict(), run_id="copy",
                    buckets=trainer.gradients.buckets)


@pytest.mark.slow
def test_a_checkpoint_moves_between_zero_levels_and_dp_sizes_bit_for_bit(tmp_path):
    """Saved at --zero 1 --dp 2: loaded at zero 0/1/2 and dp 1/2 and saved again, every
    weight and moment is the same bytes."""
    saved = TrainConfig(**{**SMALL, "steps": 2}, pp=2, dp=2, zero=1, checkpoint_every=2,
                        out_dir=str(tmp_path / "run"))
    run_distributed(4, train, saved)
    source = tmp_path / "run" / "checkpoint" / "step-000002"
    original = checkpoint.read_tensors(source)
    assert any(key.endswith("exp_avg_sq") for key in original)
    for zero, dp in ((0, 1), (2, 2), (1, 1), (0, 2)):
        target = tmp_path / f"zero{zero}-dp{dp}"
        config = dataclasses.replace(saved, zero=zero, dp=dp, out_dir=str(tmp_path / "run"))
        run_distributed(config.world_size, _load_then_save, config, source, target)
        copied = checkpoint.read_tensors(target / "step-000002")
        assert copied.keys() == original.keys()
        for key, tensor in original.items():
            assert torch.equal(copied[key], tensor), (zero, dp, key)


@pytest.mark.slow
def test_resume_at_another_zero_level_continues_exactly(tmp_path):
    base = dict(SMALL, pp=2, dp=2, checkpoint_every=2)
    straight = run_distributed(4, train, TrainConfig(**base, out_dir=str(tmp_path / "zero0")))[0]
    sharded = TrainConfig(**base, zero=1, out_dir=str(tmp_path / "zero1"))
    torch.testing.assert_close(torch.tensor(run_distributed(4, train, sharded)[0]),
                               torch.tensor(straight))
    for zero in (0, 2):
        resumed = run_distributed(4, train, dataclasses.replace(sharded, zero=zero, resume=True),
                                  rewind_to="step-000002")[0]
        torch.testing.assert_close(torch.tensor(resumed), torch.tensor(straight))


def _reduced_step(rank, world_size, config):
    """One step's forward and backward, then the reduction: which buckets had started during
    the pipeline step, and the gradient elements held after it, whole and in shards."""
    trainer = Trainer(config)
    trainer._run(trainer.executor, trainer.train_data, 0)
    gradients = trainer.gradients
    started = [bucket.started for bucket in gradients.buckets if not bucket.deferred]
    gradients.reduce()
    whole = sum(p.grad.numel() for p in gradients.params if p.grad is not None)
    shards = sum(v.grad.numel() for b in gradients.buckets if b.sharded
                 for v in b.piece_params if v.grad is not None)
    weights = sum(p.numel() for p in gradients.params)
    return started, whole, shards, weights


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_buckets_reduce_during_the_pipeline_step_and_zero_2_frees_whole_gradients(zero):
    config = TrainConfig(**{**SMALL, "pp": 2, "dp": 2, "zero": zero})
    for started, whole, shards, weights in run_distributed(4, _reduced_step, config):
        assert started and all(started)  # every stage's buckets began in its last backward
        if zero == 0:
            assert (whole, shards) == (weights, 0)
        else:
            assert whole == (weights if zero == 1 else 0)
            assert abs(2 * shards - weights) <= 2 * 4  # half, up to each bucket's padding
