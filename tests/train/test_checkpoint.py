"""Checkpoints that cannot be torn, and what ``--resume`` continues from.

The save/load tests run ``checkpoint.save`` on 2 pooled ranks with tiny ``nn.Linear``
parameters and AdamW; the ``plan_resume`` tests write checkpoint directories by hand (a
``meta.json`` and an empty dcp ``.metadata``), since the plan only reads files.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest
import torch

from meshpipe.testing import run_distributed
from meshpipe.train.checkpoints import store as checkpoint
from meshpipe.train.config import TrainConfig
from meshpipe.train.loop.learning_rate import LearningRate
from meshpipe.train.checkpoints.resume import (IGNORED_FIELDS, LAYOUT_FIELDS, MODEL_FIELDS, RUN_FIELDS,
                                   SCHEDULE_FIELDS,
                                   plan_resume)

pytestmark = pytest.mark.distributed

WORLD = 2


def _model(rank: int, seed: int = 0):
    """A replicated layer and one layer of this rank's own, trained one AdamW step."""
    torch.manual_seed(seed)
    shared = torch.nn.Linear(4, 3)
    torch.manual_seed(seed + 100 + rank)
    own = torch.nn.Linear(3, 2)
    parameters = [(f"shared.{n}", p) for n, p in shared.named_parameters()]
    parameters += [(f"own{rank}.{n}", p) for n, p in own.named_parameters()]
    optimizer = torch.optim.AdamW([p for _, p in parameters], lr=0.1)
    # The replicated layer's gradient must not depend on the rank (dcp writes it once).
    (shared(torch.ones(2, 4)).square().sum() + own(torch.ones(2, 3)).square().sum()).backward()
    optimizer.step()
    return parameters, optimizer


def _snapshot(parameters, optimizer) -> dict[str, torch.Tensor]:
    values = {}
    for name, param in parameters:
        values[name] = param.detach().clone()
        for key, value in optimizer.state[param].items():
            values[f"{name}.{key}"] = value.clone()
    return values


def _save_steps(rank, world_size, root, run_id, steps, keep=2, seed=0):
    """Save each of ``steps`` (one after another); return the directories."""
    parameters, optimizer = _model(rank, seed)
    return [checkpoint.save(Path(root), parameters, optimizer, step, config={"seed": seed},
                            run_id=run_id, keep=keep) for step in steps]


def _round_trip(rank, world_size, root):
    import warnings

    parameters, optimizer = _model(rank)
    saved = _snapshot(parameters, optimizer)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):  # a step saved again (after a resume) is no overwrite for dcp
            directory = checkpoint.save(Path(root), parameters, optimizer, 7,
                                        config={"dim": 8}, run_id="run-a")
        with torch.no_grad():
            for _, param in parameters:
                param.add_(1.0)
                for value in optimizer.state[param].values():
                    value.add_(1.0)
        step = checkpoint.load(directory, parameters, optimizer)
    loaded = _snapshot(parameters, optimizer)
    return step, str(directory), saved, loaded, [str(w.message) for w in seen]


def test_save_then_load_round_trip_without_warnings(tmp_path):
    results = run_distributed(WORLD, _round_trip, str(tmp_path))
    for step, directory, saved, loaded, seen in results:
        assert step == 7 and directory == str(tmp_path / "step-000007")
        assert saved.keys() == loaded.keys()
        for key in saved:
            torch.testing.assert_close(loaded[key], saved[key], rtol=0, atol=0)
        assert seen == []  # no per-rank noise from dcp
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000007"]
    meta = json.loads((tmp_path / "step-000007" / "meta.json").read_text())
    assert meta["step"] == 7 and meta["run_id"] == "run-a" and meta["format"] == 1
    assert meta["config"] == {"dim": 8} and abs(meta["saved_at"] - time.time()) < 60
    info = checkpoint.newest(tmp_path)
    assert info == checkpoint.CheckpointInfo(tmp_path / "step-000007", 7, "run-a",
                                             meta["saved_at"], {"dim": 8})


def _write(path: Path, files: dict[str, str]) -> None:
    path.mkdir(parents=True)
    for name, text in files.items():
        (path / name).write_text(text)


def test_newest_ignores_partial_and_incomplete_directories(tmp_path):
    run_distributed(WORLD, _save_steps, str(tmp_path), "run-a", [1])
    later = json.dumps({"step": 5, "run_id": "run-a", "saved_at": time.time() + 100,
                        "config": {}, "format": 1})
    _write(tmp_path / "step-000005.partial-run-b", {".metadata": "", "meta.json": later})
    _write(tmp_path / "step-000006", {".metadata": ""})               # no meta.json
    _write(tmp_path / "step-000007", {"meta.json": later})            # no dcp .metadata
    _write(tmp_path / "step-000008", {".metadata": "", "meta.json": "{not json"})
    (tmp_path / "step-000009").write_text("a file, not a directory")
    assert [info.step for info in checkpoint.complete_checkpoints(tmp_path)] == [1]
    assert checkpoint.newest(tmp_path).directory == tmp_path / "step-000001"
    assert [p.name for p in checkpoint.incomplete_checkpoints(tmp_path)] == [
        "step-000005.partial-run-b", "step-000006", "step-000007", "step-000008"]
    assert checkpoint.newest(tmp_path / "missing") is None


def test_rotation_deletes_only_this_runs_older_checkpoints(tmp_path):
    run_distributed(WORLD, _save_steps, str(tmp_path), "run-a", [0, 1, 2])
    run_distributed(WORLD, _save_steps, str(tmp_path), "run-b", [3, 4, 5])
    owners = {info.directory.name: info.run_id
              for info in checkpoint.complete_checkpoints(tmp_path)}
    assert owners == {"step-000001": "run-a", "step-000002": "run-a",
                      "step-000004": "run-b", "step-000005": "run-b"}
    run_distributed(WORLD, _save_steps, str(tmp_path), "run-a", [6], 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step-000002", "step-000004", "step-000005", "step-000006"]


def test_a_step_another_run_reached_is_replaced_whole(tmp_path):
    run_distributed(WORLD, _save_steps, str(tmp_path), "run-a", [3])
    run_distributed(WORLD, _save_steps, str(tmp_path), "run-b", [3])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000003"]
    assert checkpoint.newest(tmp_path).run_id == "run-b"


def test_newest_is_the_last_save_not_the_largest_step(tmp_path):
    run_distributed(WORLD, _save_steps, str(tmp_path), "long-run", [9])
    run_distributed(WORLD, _save_steps, str(tmp_path), "short-run", [3])
    info = checkpoint.newest(tmp_path)
    assert (info.step, info.run_id) == (3, "short-run")
    assert [i.step for i in checkpoint.complete_checkpoints(tmp_path)] == [9, 3]


def test_the_next_save_removes_stale_partial_directories(tmp_path):
    run_distributed(WORLD, _save_steps, str(tmp_path), "run-a", [1])
    _write(tmp_path / "step-000002.partial-killed", {"__0_0.distcp": "torn"})
    _write(tmp_path / "step-000004.partial-run-a", {"__1_0.distcp": "torn"})
    run_distributed(WORLD, _save_steps, str(tmp_path), "run-c", [3])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000001", "step-000003"]


def _save_that_dies(rank, world_size, root):
    parameters, optimizer = _model(rank)

    def die(step):
        raise KeyboardInterrupt(f"killed after writing step {step}")

    try:
        checkpoint.save(Path(root), parameters, optimizer, 2, config={}, run_id="dies",
                        after_write=die)
    except KeyboardInterrupt as error:
        return str(error)
    return None


def test_a_save_killed_after_writing_leaves_the_last_checkpoint_in_charge(tmp_path):
    run_distributed(WORLD, _save_steps, str(tmp_path), "run-a", [1])
    assert run_distributed(WORLD, _save_that_dies, str(tmp_path)) == [
        "killed after writing step 2"] * 2
    assert (tmp_path / "step-000002.partial-dies" / ".metadata").exists()  # data all written
    assert not (tmp_path / "step-000002").exists()
    assert checkpoint.newest(tmp_path).step == 1


# ---- plan_resume: pure file reading ----

def _fake(root: Path, step: int, config: TrainConfig | dict, saved_at: float | None = None,
          run_id: str = "run", learning_rate: dict | None = None) -> Path:
    values = config.to_dict() if isinstance(config, TrainConfig) else config
    directory = root / "checkpoint" / f"step-{step:06d}"
    _write(directory, {".metadata": "", "meta.json": json.dumps(
        {"step": step, "run_id": run_id, "config": values, "format": 1,
         "saved_at": time.time() if saved_at is None else saved_at,
         "learning_rate": learning_rate})})
    return directory


def _config(tmp_path, **fields) -> TrainConfig:
    return TrainConfig(out_dir=str(tmp_path), resume=True, **fields)


def _refusal(config: TrainConfig) -> str:
    with pytest.raises(ValueError) as caught:
        plan_resume(config)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_every_config_field_is_in_exactly_one_group():
    groups = MODEL_FIELDS + SCHEDULE_FIELDS + RUN_FIELDS + LAYOUT_FIELDS + IGNORED_FIELDS
    names = [field.name for field in dataclasses.fields(TrainConfig)]
    assert sorted(groups) == sorted(names)
    assert len(set(groups)) == len(groups)


def test_resume_notes_the_checkpoint_and_a_changed_layout(tmp_path):
    saved_at = time.mktime((2026, 11, 24, 8, 30, 12, 0, 0, -1))
    directory = _fake(tmp_path, 10, _config(tmp_path, pp=2, eval_every=3), saved_at)
    plan = plan_resume(_config(tmp_path, pp=4, schedule="gpipe", hang_timeout=5.0))
    assert plan.checkpoint.directory == directory and plan.start_step == 10
    assert plan.notes == [
        f"resuming from {directory} (saved 2026-11-24 08:30:12): step 11 of 30 is next",
        "run settings changed: eval_every 3 -> 10, hang_timeout 30.0 -> 5.0",
        "layout changed: pp 2 -> 4, schedule 1f1b -> gpipe (checkpoints are layout-free)"]


def test_resume_picks_the_newest_save_even_with_a_lower_step(tmp_path):
    _fake(tmp_path, 21, _config(tmp_path), saved_at=1000.0, run_id="long")
    _fake(tmp_path, 5, _config(tmp_path), saved_at=2000.0, run_id="short")
    plan = plan_resume(_config(tmp_path))
    assert (plan.checkpoint.run_id, plan.start_step) == ("short", 5)


def test_resume_without_any_checkpoint_says_to_run_without_resume(tmp_path):
    message = _refusal(_config(tmp_path))
    assert message.startswith(f"no complete checkpoint in {tmp_path / 'checkpoint'}")
    assert "no incomplete one" in message and "run once without --resume" in message


def test_resume_with_only_interrupted_saves_says_so(tmp_path):
    _write(tmp_path / "checkpoint" / "step-000003.partial-abc", {"__0_0.distcp": ""})
    _write(tmp_path / "checkpoint" / "step-000004", {".metadata": ""})
    message = _refusal(_config(tmp_path))
    assert "no complete checkpoint" in message and "2 incomplete" in message
    assert "step-000003.partial-abc, step-000004" in message


def test_another_model_is_always_refused_naming_each_field(tmp_path):
    _fake(tmp_path, 4, _config(tmp_path, dim=64, layers=4, tie_embeddings=True))
    message = _refusal(_config(tmp_path, dim=32, layers=6, allow_config_change=True))
    assert "holds another model" in message
    assert "dim 64 -> 32, layers 4 -> 6, tie_embeddings True -> False" in message


def test_changed_training_settings_need_allow_config_change(tmp_path):
    _fake(tmp_path, 4, _config(tmp_path, lr=3e-3, seed=0, dp=1))
    message = _refusal(_config(tmp_path, lr=1e-3, seed=7, dp=2))
    assert "lr 0.003 -> 0.001, min_lr 0.0003 -> 0.0001, seed 0 -> 7, dp 1 -> 2" in message
    assert "--allow-config-change" in message
    plan = plan_resume(_config(tmp_path, lr=1e-3, seed=7, dp=2, allow_config_change=True))
    assert plan.start_step == 4
    assert plan.notes[1] == ("training settings changed: lr 0.003 -> 0.001, min_lr 0.0003 -> "
                             "0.0001, seed 0 -> 7, dp 1 -> 2 (accepted with "
                             "--allow-config-change)")


@pytest.mark.parametrize("steps", [30, 20])
def test_nothing_to_train_says_to_raise_steps(tmp_path, steps):
    _fake(tmp_path, 30, _config(tmp_path, steps=steps))
    message = _refusal(_config(tmp_path, steps=steps))
    assert message == (f"nothing to train: checkpoint step-000030 holds 30 steps and --steps is "
                       f"{steps}; give a larger --steps to continue the run")


def test_a_longer_or_shorter_run_is_taken_with_the_learning_rate_rule(tmp_path):
    _fake(tmp_path, 2, _config(tmp_path, steps=4, warmup_steps=0, eval_every=2))
    longer = plan_resume(_config(tmp_path, steps=6, warmup_steps=0, eval_every=3))
    assert longer.start_step == 2
    assert longer.learning_rate == LearningRate.of(
        _config(tmp_path, steps=6, warmup_steps=0), {"step": 1, "progress": 0.25})
    assert longer.notes[1] == (
        "run settings changed: steps 4 -> 6, eval_every 2 -> 3; the cosine decay goes on from "
        f"step 3 at lr {longer.learning_rate.at(2):.3g} (40% decayed) and reaches --min-lr "
        "0.0003 at step 6 (was 4)")
    shorter = plan_resume(_config(tmp_path, steps=3, warmup_steps=0))
    assert shorter.learning_rate.anchor == {"step": 1, "progress": 0.25}
    assert shorter.learning_rate.progress(2) == pytest.approx(0.625)


def test_a_resume_continues_the_anchor_its_checkpoint_saved(tmp_path):
    _fake(tmp_path, 8, _config(tmp_path, steps=20, warmup_steps=0),
          learning_rate={"step": 4, "progress": 0.4})
    same = plan_resume(_config(tmp_path, steps=20, warmup_steps=0))
    assert same.learning_rate.anchor == {"step": 4, "progress": 0.4}
    assert "run settings changed" not in " ".join(same.notes)
    longer = plan_resume(_config(tmp_path, steps=30, warmup_steps=0))
    assert longer.learning_rate.anchor == {"step": 7, "progress": pytest.approx(0.4 + 0.6 * 3 / 16)}


def test_a_changed_learning_rate_still_needs_allow_config_change(tmp_path):
    _fake(tmp_path, 2, _config(tmp_path, steps=2))
    message = _refusal(_config(tmp_path, steps=3, lr=1e-3))
    assert "lr 0.003 -> 0.001, min_lr 0.0003 -> 0.0001" in message
    assert "--allow-config-change" in message


def test_ignored_fields_and_an_older_or_newer_saved_config(tmp_path):
    """Output and fault flags may differ (noted); a field an older version did not save
    counts as its default; one this version does not know is noted."""
    saved = _config(tmp_path).to_dict()
    del saved["moe_capacity_factor"], saved["ep"]
    saved.update(out_dir="elsewhere", eval_every=1, hang_timeout=1.0, future_flag=3)
    _fake(tmp_path, 3, saved)
    plan = plan_resume(_config(tmp_path, checkpoint_every=5, progress=False))
    assert plan.notes[1:] == ["run settings changed: eval_every 1 -> 10, checkpoint_every 0 -> "
                              "5, progress True -> False, hang_timeout 1.0 -> 30.0",
                              "ignoring settings this version does not know in the "
                              "checkpoint: future_flag"]
    saved["dim"] = 32  # and a missing model field still counts as its default
    del saved["layers"]
    _fake(tmp_path, 4, saved)
    assert "dim 32 -> 64" in _refusal(_config(tmp_path))
