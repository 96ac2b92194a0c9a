"""Tensor parallelism in training: every layout's first step equals one process.

Each case runs the real Trainer on a pooled group of ranks; ``--check`` recomputes the step
in one process on rank 0 (in the run's precision) and compares loss and every gradient,
with the tensor-parallel shards put back together.
"""


import pytest
import torch

from meshpipe.testing import run_distributed
from meshpipe.train.config import TrainConfig
from meshpipe.train.loop.trainer import Trainer, run as run_training

from trainer_cases import SMALL, check_first_step, resume_plan, train

pytestmark = pytest.mark.distributed

LAYOUTS = {
    "pp2-tp2": dict(pp=2, tp=2),
    "pp2-tp2-sequence-parallel": dict(pp=2, tp=2, sequence_parallel=True),
    "pp2-tp2-batched-p2p": dict(pp=2, tp=2, p2p="batched"),
    "pp2-vpp2-tp2-interleaved": dict(pp=2, vpp=2, tp=2, schedule="interleaved"),
    "pp2-tp2-zbv": dict(pp=2, vpp=2, tp=2, schedule="zb-v"),
    "tp2-ulysses2": dict(pp=1, schedule="none", tp=2, cp_ulysses=2),
    "tp2-ring2-sequence-parallel": dict(pp=1, schedule="none", tp=2, cp_ring=2,
                                        sequence_parallel=True),
    "tp2-dp2-tied": dict(pp=1, schedule="none", tp=2, dp=2, tie_embeddings=True),
    "pp2-stage-tp-2-1-root": dict(pp=2, stage_tp="2,1", stage_link="root"),
    "pp2-stage-tp-1-2-fanout": dict(pp=2, stage_tp="1,2", stage_link="fanout"),
    "pp3-stage-tp-1-2-1-wraparound-root": dict(pp=3, stage_tp="1,2,1", placement="wraparound",
                                               layers=3, tie_embeddings=True),
    "pp3-stage-tp-1-2-1-wraparound-fanout-batched": dict(
        pp=3, stage_tp="1,2,1", stage_link="fanout", placement="wraparound", layers=3,
        p2p="batched"),
    "pp2-stage-tp-2-1-zb-h1": dict(pp=2, stage_tp="2,1", schedule="zb-h1"),
}


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_tensor_parallel_step_matches_single_process(layout):
    config = TrainConfig(**{**SMALL, **layout})
    report = run_distributed(config.world_size, check_first_step, config)[0]
    assert report["mismatched"] == []
    assert report["passed"], report
    assert report["max_grad_difference"] < 1e-5


@pytest.mark.parametrize("layout", [dict(pp=2, tp=2), dict(pp=2, stage_tp="1,2"),
                                    dict(pp=1, schedule="none", tp=2, cp_ring=2)],
                         ids=["tp2", "stage-tp-1-2", "tp2-ring2"])
def test_bf16_step_matches_single_process_in_bf16(layout):
    config = TrainConfig(**{**SMALL, **layout, "dtype": "bf16"})
    report = run_distributed(config.world_size, check_first_step, config)[0]
    assert report["passed"], report
    assert report["dtype"] == "bf16" and report["tolerance"]["rtol"] > 1e-3


def test_fp16_check_passes_with_loss_scaling():
    config = TrainConfig(**{**SMALL, "pp": 2, "tp": 2, "dtype": "fp16"})
    report = run_distributed(config.world_size, check_first_step, config)[0]
    assert report["passed"], report


def _overflowing_step(rank, world_size, config):
    """One fp16 step whose loss scale overflows the fp16 gradients, then one that does not."""
    trainer = Trainer(config)
    trainer.scaler.scale = 2.0 ** 60
    before = {name: p.detach().clone() for name, p in trainer.parameters}
    first = trainer.train_step(0)
    unchanged = all(torch.equal(before[name], p) for name, p in trainer.parameters)
    scale_after_overflow = trainer.scaler.scale
    trainer.scaler.scale = 2.0 ** 10
    second = trainer.train_step(1)
    changed = any(not torch.equal(before[name], p) for name, p in trainer.parameters)
    return (first.skipped, unchanged, scale_after_overflow, second.skipped, changed,
            trainer.scaler.skipped_steps)


def test_fp16_overflow_skips_the_step_and_halves_the_scale():
    config = TrainConfig(**{**SMALL, "pp": 2, "tp": 2, "dtype": "fp16"})
    for skipped, unchanged, scale, next_skipped, changed, count in run_distributed(
            4, _overflowing_step, config):
        assert skipped and unchanged and scale == 2.0 ** 59
        assert not next_skipped and changed and count == 1


@pytest.mark.slow
def test_resume_a_tensor_parallel_run_without_tensor_parallelism(tmp_path):
    """Shards are saved whole: a tp 2 checkpoint resumes with tp 1 (and the loss follows)."""
    base = dict(SMALL, out_dir=str(tmp_path), checkpoint_every=2)
    straight = run_distributed(4, train, TrainConfig(**base, pp=2, tp=2))[0]
    resumed = run_distributed(2, train, TrainConfig(**base, pp=2, resume=True),
                              rewind_to="step-000002")[0]
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(straight))


def _train_fp16_and_report_scale(rank, world_size, config, rewind_to=None):
    trainer = Trainer(config, resume=resume_plan(config, rewind_to))
    metrics = trainer.fit()
    return [h["loss"] for h in metrics["history"]], trainer.scaler.state_dict()


def test_fp16_resume_continues_the_loss_scale(tmp_path):
    base = dict(SMALL, out_dir=str(tmp_path), checkpoint_every=2, pp=2, dtype="fp16", steps=3)
    losses, state = run_distributed(2, _train_fp16_and_report_scale, TrainConfig(**base))[0]
    assert state["good_steps"] == 3
    resumed, resumed_state = run_distributed(
        2, _train_fp16_and_report_scale, TrainConfig(**base, resume=True),
        rewind_to="step-000002")[0]
    assert resumed == losses
    assert resumed_state == state


def _losses_and_grads(rank, world_size, config):
    trainer = Trainer(config)
    result = trainer.executor.step(*trainer.microbatches(trainer.train_data, 0))
    return result.losses, {name: p.grad.clone() for name, p in trainer.parameters}


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_recompute_gives_the_same_loss_and_gradients(recompute):
    base = {**SMALL, "pp": 2, "schedule": "zb-h1"}
    plain = run_distributed(2, _losses_and_grads, TrainConfig(**base))
    again = run_distributed(2, _losses_and_grads, TrainConfig(**base, recompute=recompute))
    for (losses, grads), (losses_rc, grads_rc) in zip(plain, again):
        assert losses == losses_rc
        for name in grads:
            torch.testing.assert_close(grads_rc[name], grads[name], rtol=0, atol=0)


@pytest.mark.parametrize("bad,message", [
    (dict(pp=2, tp=3), "tensor parallelism 3 must divide the query heads"),
    (dict(pp=2, tp=4, kv_heads=2), "must divide the key/value heads"),
    (dict(pp=2, stage_tp="1,3", dim=48, heads=3, kv_heads=3), "must divide the SwiGLU width"),
    (dict(pp=2, stage_tp="2,1", tie_embeddings=True), "--tie-embeddings shares the embedding"),
])
def test_layouts_the_model_cannot_take_fail_before_any_process_starts(bad, message):
    config = TrainConfig(**{**SMALL, **bad})
    with pytest.raises(ValueError, match=message):
        run_training(config)


@pytest.mark.parametrize("bad,message", [
    (dict(stage_tp="2,1,1"), "gives 3 sizes for --pp 2"),
    (dict(stage_link="fanout"), "--stage-link says how stages"),
    (dict(sequence_parallel=True), "needs --tp 2 or more"),
    (dict(tp=2, sequence_parallel=True, seq_len=17), "use a multiple of 2"),
    (dict(stage_tp="1,2", sequence_parallel=True), "use --tp instead of --stage-tp"),
    (dict(tp=2, stage_tp="1,2"), "not both"),
    (dict(p2p="ring"), "unknown --p2p 'ring'"),
    (dict(dtype="fp8"), "unknown --dtype 'fp8'"),
    (dict(recompute="some"), "unknown --recompute 'some'"),
])
def test_bad_tensor_parallel_flags_are_rejected(bad, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**{**SMALL, "pp": 2, **bad})
