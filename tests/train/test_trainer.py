"""End-to-end training: parity of a full training step for PP x CP x DP layouts, resume.

Each case runs the real Trainer on a pooled group of ranks; its built-in ``--check`` computes
the same step in one process on rank 0 and compares loss and every gradient.
"""

import dataclasses
import json
import math
import subprocess
import sys

import pytest
import torch

from meshpipe.testing import run_distributed
from meshpipe.train.config import TrainConfig
from meshpipe.train.loop.parity import compare_with_single_process
from meshpipe.train.loop.trainer import Trainer
from meshpipe.train.run.sources import reference_step as reference_gradients
from trainer_cases import SMALL, check_first_step, resume_plan, train

pytestmark = pytest.mark.distributed

LAYOUTS = {
    "pp2-cp2-ulysses": dict(pp=2, cp_ulysses=2),
    "pp2-cp2-ring": dict(pp=2, cp_ring=2),
    "cp4-ring": dict(pp=1, schedule="none", cp_ring=4),
    "cp2x2-hybrid": dict(pp=1, schedule="none", cp_ring=2, cp_ulysses=2),
    "pp2-interleaved-cp2": dict(pp=2, vpp=2, schedule="interleaved", cp_ring=2),
    "pp2-dp2-zbv": dict(pp=2, dp=2, schedule="zb-v", vpp=2),
    "pp2-tied-embeddings-dp2": dict(pp=2, dp=2, tie_embeddings=True),
    "pp3-wraparound-tied": dict(pp=3, placement="wraparound", tie_embeddings=True, layers=4),
}


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_training_step_matches_single_process(layout):
    config = TrainConfig(**{**SMALL, **layout})
    report = run_distributed(config.world_size, check_first_step, config)[0]
    assert report["mismatched"] == []
    assert report["passed"], report


def _learning_rates(rank, world_size, config, rewind_to=None):
    """The (step, learning rate) of every step in the run's history."""
    metrics = Trainer(config, resume=resume_plan(config, rewind_to)).fit()
    return [(h["step"], h["lr"]) for h in metrics["history"]]


def _cosine(config: TrainConfig, progress: float) -> float:
    return config.min_lr + (config.lr - config.min_lr) * 0.5 * (1 + math.cos(math.pi * progress))


def test_resume_extends_or_shortens_a_run_and_re_spans_the_decay(tmp_path):
    """--steps 2, then --steps 3 --resume: step 3 goes on from the decay's progress at step 2
    (0.5) over the new remaining steps, to 0.75; and 4 -> 2 from step 1 speeds it up."""
    base = dict(SMALL, pp=2, warmup_steps=0, checkpoint_every=1, keep_checkpoints=4)
    for name in ("extend", "shorten"):
        (tmp_path / name).mkdir()
    two = TrainConfig(**{**base, "steps": 2}, out_dir=str(tmp_path / "extend"))
    assert run_distributed(2, _learning_rates, two)[0] == [
        (1, pytest.approx(_cosine(two, 0))), (2, pytest.approx(_cosine(two, 0.5)))]
    three = dataclasses.replace(two, steps=3, resume=True)
    assert run_distributed(2, _learning_rates, three)[0] == [
        (1, pytest.approx(_cosine(two, 0))), (2, pytest.approx(_cosine(two, 0.5))),
        (3, pytest.approx(_cosine(two, 0.75)))]
    four = TrainConfig(**{**base, "steps": 4}, out_dir=str(tmp_path / "shorten"))
    run_distributed(2, _learning_rates, four)
    two_of_four = dataclasses.replace(four, steps=2, resume=True)
    assert run_distributed(2, _learning_rates, two_of_four, rewind_to="step-000001")[0] == [
        (1, pytest.approx(_cosine(four, 0))), (2, pytest.approx(_cosine(four, 0.5)))]


def test_resume_continues_exactly_and_across_layouts(tmp_path):
    base = dict(SMALL, out_dir=str(tmp_path), checkpoint_every=2)
    straight = run_distributed(2, train, TrainConfig(**base, pp=2))[0]
    assert sorted(p.name for p in (tmp_path / "checkpoint").glob("step-*")) == [
        "step-000002", "step-000004"]
    resumed = run_distributed(2, train, TrainConfig(**base, pp=2, resume=True),
                              rewind_to="step-000002")[0]
    # The history continues (steps 1-2 from the first run), and the resumed steps are the
    # straight run's bit for bit.
    assert resumed == straight
    relayout = run_distributed(4, train, TrainConfig(**base, pp=4, resume=True),
                               rewind_to="step-000002")[0]
    torch.testing.assert_close(torch.tensor(relayout), torch.tensor(straight))


@pytest.mark.parametrize("bad,message", [
    (dict(schedule="zigzag"), "unknown schedule 'zigzag'"),
    (dict(heads=6, kv_heads=4), "--heads 6 must be a multiple of --kv-heads 4"),
    (dict(cp_ring=2, seq_len=30), "--seq-len 30 is not divisible"),
    (dict(microbatches=0), "--microbatches must be >= 1"),
    (dict(eval_every=-1), "--eval-every must be >= 0"),
    (dict(checkpoint_every=-2), "--checkpoint-every must be >= 0"),
    (dict(lr=-1.0), "need 0 < --lr"),
    (dict(lr=1e-3, min_lr=1e-2), "--min-lr <= --lr"),
    (dict(steps=3, timeline_step=5), "--timeline-step 5 is after the last step 3"),
    (dict(lr=float("inf")), "--lr must be a finite number, got inf"),
    (dict(min_lr=float("nan")), "--min-lr must be a finite number, got nan"),
    (dict(grad_clip=float("nan")), "--grad-clip must be a finite number, got nan"),
    (dict(hang_timeout=0.0), "--hang-timeout must be > 0"),
    (dict(keep_checkpoints=0), "--keep-checkpoints must be >= 1"),
    (dict(schedule="zb-v", vpp=3), "zb-v places 2 stages per pipeline rank"),
])
def test_bad_configuration_is_rejected_with_the_fix(bad, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**bad)


def test_v_schedules_record_the_two_stages_per_rank_they_run():
    for schedule in ("zb-v", "dualpipe-v"):
        config = TrainConfig(schedule=schedule)
        assert config.vpp == 2 and config.to_dict()["vpp"] == 2


def test_cli_trains_and_writes_metrics(tmp_path):
    command = [sys.executable, "-m", "meshpipe", "train", "--pp", "2", "--steps", "3",
               "--dim", "32", "--seq-len", "16", "--eval-every", "2", "--no-progress",
               "--timeline-step", "2", "--out-dir", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert len(metrics["history"]) == 3 and len(metrics["eval"]) == 1
    assert (tmp_path / "timeline.png").stat().st_size > 1000
    assert "tokens/s" in done.stdout
    bubble = metrics["bubble"]  # of the timeline step, beside the simulated one
    assert bubble["step"] == 2 and 0 <= bubble["simulated"] < 1 and 0 <= bubble["measured"] < 1
    assert f"bubble {100 * bubble['measured']:.1f}% measured" in done.stdout


def test_cli_reports_a_bad_layout_in_one_line(tmp_path):
    command = [sys.executable, "-m", "meshpipe", "train", "--pp", "2", "--layers", "1",
               "--out-dir", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert "--layers 1 cannot fill the 2 stages" in done.stderr
    assert "Traceback" not in done.stderr


def test_resume_a_tied_model_in_another_layout(tmp_path):
    """Tied weights are saved under one full-model name whatever the layout that wrote them."""
    base = dict(SMALL, out_dir=str(tmp_path), checkpoint_every=2, tie_embeddings=True)
    straight = run_distributed(1, train, TrainConfig(**base, pp=1, schedule="none"))[0]
    relayout = run_distributed(2, train, TrainConfig(**base, pp=2, resume=True),
                               rewind_to="step-000002")[0]
    torch.testing.assert_close(torch.tensor(relayout), torch.tensor(straight))


def test_check_fails_when_a_gradient_is_missing():
    config = TrainConfig(**SMALL, pp=1, schedule="none")
    loss, grads = reference_gradients(config)
    assert compare_with_single_process(config, loss, [grads])["passed"]
    del grads["layers.1.attention.wq.weight"]
    report = compare_with_single_process(config, loss, [grads])
    assert not report["passed"]
    assert report["mismatched"] == ["layers.1.attention.wq.weight"]


def _train_from_plan(rank, world_size, plan):
    """A rank given the launcher's plan builds from it: building a schedule here fails."""
    from meshpipe.schedules import builders
    from meshpipe.train.run import plan as plan_module
    def refuse(*args, **kwargs):
        raise AssertionError("a rank with a plan built a schedule")

    saved = builders.build, plan_module.build
    builders.build = plan_module.build = refuse
    try:
        trainer = Trainer(plan.config, plan=plan)
        stats = trainer.train_step(0)
    finally:
        builders.build, plan_module.build = saved
    return trainer.schedule is plan.schedule, stats.loss


def test_ranks_build_from_the_launchers_plan_without_deciding_again(tmp_path):
    from meshpipe.train.run.plan import plan_run

    config = TrainConfig(**{**SMALL, "pp": 2, "schedule": "zb-v", "out_dir": str(tmp_path)})
    plan = plan_run(config)
    assert plan.layers == (1, 1, 1, 1) and plan.eval_schedule.forward_only
    for from_plan, loss in run_distributed(2, _train_from_plan, plan):
        assert from_plan and (loss is None or loss > 0)
