"""--max-restarts: a job that loses a rank starts again from its newest checkpoint and ends
bit for bit where the uninterrupted job ends; restarts that gain no step stop as a crash
loop; a fault can fire once per job; --keep-checkpoints holds across resumes."""

import json
from pathlib import Path

import pytest
import torch

from meshpipe.cli import _train_and_report
from meshpipe.train.checkpoints.store import META_FILE, complete_checkpoints, read_tensors
from meshpipe.train.config import TrainConfig
from meshpipe.train.loop.trainer import run
from meshpipe.train.outputs.metrics import read, steps_done
from meshpipe.train.supervisor import faults
from meshpipe.train.supervisor.launch import LaunchError
from meshpipe.train.supervisor.restarts import CRASH_LOOP_EXIT_STATUS, CrashLoop, Restarts
from trainer_cases import SMALL

RUN = dict(SMALL, pp=2, steps=6, checkpoint_every=2, keep_checkpoints=2, hang_timeout=5)


def write_steps(out_dir: Path, last: int) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": step, "loss": 1.0}) + "\n" for step in range(1, last + 1)))


def test_restarts_resume_until_none_is_left_or_no_step_is_gained(tmp_path, capsys):
    config = TrainConfig(**RUN, max_restarts=5, out_dir=str(tmp_path))
    restarts = Restarts(config)
    error = LaunchError("rank 1 failed at step 4, stage 1: InjectedFault", 1)
    write_steps(tmp_path, 3)
    again = restarts.after(error)
    assert again.resume is False and again.max_restarts == 5  # nothing saved: from step 1
    assert "restart 1 of 5 after: rank 1 failed at step 4" in capsys.readouterr().out
    write_steps(tmp_path, 5)
    restarts.after(error)  # two steps gained
    restarts.after(error)  # none gained: 1
    with pytest.raises(CrashLoop, match="crash loop: 3 failures in a row at step 6 gained no "
                                        "step, so the job stops after 3 of --max-restarts 5"):
        restarts.after(error)
    no_restarts = Restarts(TrainConfig(**RUN, out_dir=str(tmp_path)))
    with pytest.raises(LaunchError) as raised:
        no_restarts.after(error)
    assert raised.value is error
    assert steps_done(tmp_path / "nowhere") == 0


def test_a_fault_once_per_job(tmp_path, monkeypatch):
    monkeypatch.setenv(faults.ENVIRONMENT_VARIABLE, "kind=raise,at=step,rank=1,step=2,once=1")
    fault = faults.from_environment(1, tmp_path)
    assert fault.once and fault.fired_file == str(tmp_path / faults.FIRED_FILE)
    with pytest.raises(faults.InjectedFault):
        fault.fire()
    assert faults.from_environment(1, tmp_path) is None  # fired: a restart runs without it
    faults.forget_fired(tmp_path)  # a new job
    assert faults.from_environment(1, tmp_path) is not None
    monkeypatch.setenv(faults.ENVIRONMENT_VARIABLE, "kind=raise,at=step,rank=1,step=2,once=2")
    with pytest.raises(ValueError, match="once=2 .*: give once=1"):
        faults.from_environment(1, tmp_path)


def assert_same_ending(restarted: Path, whole: Path) -> None:
    """The two runs' last checkpoints hold equal tensors and their step losses are equal."""
    last, = [info for info in complete_checkpoints(restarted / "checkpoint") if info.step == 6]
    reference, = [info for info in complete_checkpoints(whole / "checkpoint") if info.step == 6]
    ours, theirs = read_tensors(last.directory), read_tensors(reference.directory)
    assert ours.keys() == theirs.keys() and any(key.startswith("optim") for key in ours)
    assert all(torch.equal(ours[key], theirs[key]) for key in ours)
    losses = [(r["step"], r["loss"]) for r in read(restarted / "metrics.jsonl") if "loss" in r]
    assert losses == [(r["step"], r["loss"]) for r in read(whole / "metrics.jsonl")
                      if "loss" in r]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("whole")
    run(TrainConfig(**RUN, out_dir=str(out)))
    return out


FAULTS = {"raise": "kind=raise,at=forward,rank=1,step=4,once=1",
          "kill": "kind=kill,at=backward,rank=0,step=5,once=1",
          "nan": "kind=nan,at=loss,rank=1,step=3,once=1"}


@pytest.mark.distributed
@pytest.mark.parametrize("fault", [pytest.param(fault, id=name, marks=() if name == "kill"
                                                 else pytest.mark.slow)
                                    for name, fault in FAULTS.items()])
def test_a_restarted_job_ends_bit_for_bit_as_the_uninterrupted_one(tmp_path, monkeypatch,
                                                                   uninterrupted, fault, capsys):
    monkeypatch.setenv(faults.ENVIRONMENT_VARIABLE, fault)
    run(TrainConfig(**RUN, max_restarts=2, out_dir=str(tmp_path)))
    assert "meshpipe: restart 1 of 2 after: rank" in capsys.readouterr().out
    assert_same_ending(tmp_path, uninterrupted)
    kept = complete_checkpoints(tmp_path / "checkpoint")
    assert [info.step for info in kept] == [4, 6]  # --keep-checkpoints 2 across the restart
    assert len({info.run_id for info in kept}) == 1
    assert json.loads((kept[-1].directory / META_FILE).read_text())["step"] == 6


@pytest.mark.slow
@pytest.mark.distributed
def test_a_crash_loop_stops_with_its_exit_status(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(faults.ENVIRONMENT_VARIABLE, "kind=raise,at=step,rank=1,step=3")
    config = TrainConfig(**RUN, max_restarts=5, out_dir=str(tmp_path))
    assert _train_and_report(config) == CRASH_LOOP_EXIT_STATUS
    captured = capsys.readouterr()
    assert captured.out.count("meshpipe: restart") == 2
    line, = [text for text in captured.err.splitlines() if "crash loop" in text]
    assert "3 failures in a row at step 3 gained no step" in line


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("layout, fault", [
    (dict(dp=2, zero=1, dtype="fp16"), "kind=kill,at=forward,rank=2,step=5,once=1"),
    (dict(), "kind=hang,at=forward,rank=1,step=4,once=1"),
    (dict(), "kind=stop,at=forward,rank=1,step=4,once=1"),
], ids=["dp2-zero1-fp16-kill", "hang", "sigstop"])
def test_restarts_end_bit_for_bit_in_more_layouts_and_faults(tmp_path, monkeypatch, layout,
                                                              fault):
    """pp 2 x dp 2 with the optimizer states sharded and fp16's loss scale in the state; a
    hung rank and a SIGSTOPped one (the whole process frozen) found by the hang timeout."""
    whole = tmp_path / "whole"
    run(TrainConfig(**{**RUN, **layout}, out_dir=str(whole)))
    monkeypatch.setenv(faults.ENVIRONMENT_VARIABLE, fault)
    restarted = tmp_path / "restarted"
    run(TrainConfig(**{**RUN, **layout}, max_restarts=1, out_dir=str(restarted)))
    assert_same_ending(restarted, whole)


@pytest.mark.distributed
def test_background_checkpoints_equal_synchronous_ones(tmp_path, uninterrupted):
    """--checkpoint-async writes the same files as synchronous saves of the same steps, and
    training is the same."""
    run(TrainConfig(**RUN, checkpoint_async=True, out_dir=str(tmp_path)))
    assert_same_ending(tmp_path, uninterrupted)
    ours = {info.step: info for info in complete_checkpoints(tmp_path / "checkpoint")}
    theirs = {info.step: info for info in complete_checkpoints(uninterrupted / "checkpoint")}
    assert ours.keys() == theirs.keys() == {4, 6}
    first, second = read_tensors(ours[4].directory), read_tensors(theirs[4].directory)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[key], second[key]) for key in first)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_kill_during_a_background_write_resumes_from_the_previous_checkpoint(
        tmp_path, monkeypatch, uninterrupted, capsys):
    """Rank 1 dies while its part of step 4's checkpoint is being written in the background:
    step 4 is never published, the restart resumes from step 2 and ends bit for bit."""
    monkeypatch.setenv(faults.ENVIRONMENT_VARIABLE, "kind=kill,at=save,rank=1,step=4,once=1")
    run(TrainConfig(**RUN, checkpoint_async=True, max_restarts=1, out_dir=str(tmp_path)))
    assert "resuming from step 2" in capsys.readouterr().out
    assert_same_ending(tmp_path, uninterrupted)
