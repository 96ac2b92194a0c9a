"""--tensorboard: metrics records as TensorBoard scalars, read back with tensorboard's own
event reader."""

import dataclasses
import math

import pytest

from meshpipe.testing import run_distributed
from meshpipe.train.config import TrainConfig
from meshpipe.train.loop.trainer import Trainer
from meshpipe.train.outputs import tensorboard
from meshpipe.train.outputs.metrics import MetricsLog
from meshpipe.train.run.plan import plan_run
from trainer_cases import SMALL, resume_plan

event_accumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator")


def scalars(out_dir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar curve under ``out_dir/tensorboard``: tag -> [(step, value)]."""
    reader = event_accumulator.EventAccumulator(str(out_dir / tensorboard.DIRECTORY),
                                                size_guidance={"scalars": 0})
    reader.Reload()
    return {name: [(event.step, event.value) for event in reader.Scalars(name)]
            for name in reader.Tags()["scalars"]}


@pytest.mark.parametrize("key,expected", [
    ("loss", "train/loss"), ("lr", "train/lr"), ("val_loss", "val/loss"),
    ("bubble_measured", "bubble/measured"), ("moe_aux_loss", "moe/moe_aux_loss"),
    ("max_tokens_per_expert", "moe/max_tokens_per_expert"),
    ("dropped_tokens", "moe/dropped_tokens"), ("loss_scale", "train/loss_scale")])
def test_each_metric_has_its_group(key, expected):
    assert tensorboard.tag(key) == expected


def test_records_become_scalars_at_their_steps_and_a_resume_purges_what_it_redoes(tmp_path):
    log = MetricsLog(tmp_path, 0, tensorboard=True)
    for step in range(1, 5):
        log.append({"step": step, "loss": 6.0 - step, "lr": 1e-3, "grad_norm": None,
                    "skipped": step == 3})
    log.append({"step": 4, "val_loss": 4.5})
    log.append({"step": 2, "bubble_measured": 0.3, "bubble_simulated": 0.2})
    log.close()
    curves = scalars(tmp_path)
    assert curves["train/loss"] == [(1, 5.0), (2, 4.0), (3, 3.0), (4, 2.0)]
    assert curves["train/skipped"] == [(1, 0.0), (2, 0.0), (3, 1.0), (4, 0.0)]
    assert curves["val/loss"] == [(4, 4.5)]
    assert curves["bubble/measured"] == [(2, pytest.approx(0.3))]
    assert "train/grad_norm" not in curves  # null: not finite, left out
    resumed = MetricsLog(tmp_path, 2, tensorboard=True)  # 2 steps done: redoes steps 3 and 4
    resumed.append({"step": 3, "loss": 2.5, "lr": 1e-3, "grad_norm": float("nan")})
    resumed.close()
    curves = scalars(tmp_path)
    assert curves["train/loss"] == [(1, 5.0), (2, 4.0), (3, 2.5)]
    assert "train/grad_norm" not in curves


def test_without_the_package_the_flag_is_one_line_before_any_process(tmp_path, monkeypatch):
    monkeypatch.setattr(tensorboard.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"^--tensorboard needs the tensorboard package: pip "
                       r"install 'meshpipe\[tb\]'") as caught:
        plan_run(TrainConfig(tensorboard=True, out_dir=str(tmp_path), device="cpu"))
    assert "\n" not in str(caught.value)


def _fit(rank, world_size, config, rewind_to=None):
    return Trainer(config, resume=resume_plan(config, rewind_to)).fit()["history"]


@pytest.mark.distributed
def test_a_run_writes_its_curves_and_a_resumed_run_continues_them(tmp_path):
    config = TrainConfig(**{**SMALL, "steps": 3, "eval_every": 2, "timeline_step": 2}, pp=2,
                         tensorboard=True, checkpoint_every=1, keep_checkpoints=3,
                         out_dir=str(tmp_path))
    history = run_distributed(2, _fit, config)[0]
    curves = scalars(tmp_path)
    for key in ("loss", "lr", "grad_norm", "step_seconds", "tokens_per_s"):
        assert curves[f"train/{key}"] == [(r["step"], pytest.approx(r[key])) for r in history]
    assert [step for step, _ in curves["val/loss"]] == [2]
    assert [step for step, _ in curves["bubble/measured"]] == [2]
    assert [step for step, _ in curves["bubble/simulated"]] == [2]
    longer = dataclasses.replace(config, steps=4, resume=True, timeline_step=0)
    resumed = run_distributed(2, _fit, longer, rewind_to="step-000002")[0]
    curves = scalars(tmp_path)
    assert [step for step, _ in curves["train/loss"]] == [1, 2, 3, 4]
    assert curves["train/loss"] == [(r["step"], pytest.approx(r["loss"])) for r in resumed]
    assert all(math.isfinite(value) for _, value in curves["train/lr"])
