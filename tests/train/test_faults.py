"""Fault injection: every fault stops the whole job, with one line naming the rank, and
leaves no process behind (the catalogue is tests/fault_cases.py; benchmarks/faults.py
prints the same cases as a table)."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from fault_cases import (CASES, PP2, command, refused_in_process, run_case, run_cases,
                         wait_for_training)
from meshpipe.train.checkpoints import store as checkpoint

pytestmark = pytest.mark.distributed

# Generous: a hang is stopped after --hang-timeout 5 s; everything else within seconds.
STOP_BOUND_S = 45


# Cases whose run a test of their own checks further (the same checks, and then more).
OWN_TESTS = ("kill during a checkpoint save", "non-finite loss, skipped")
SHARED = [c for c in CASES if c.name not in OWN_TESTS]
# Bad input needs no process to be refused: run in this process, it takes no process start.
REFUSED = [c for c in SHARED if c.status == 2 and c.before is None]
# One fault of each way a rank can end (an exception, a death, a hang, a value):
# make test runs these; the rest of the catalogue is marked slow (make test-slow, CI).
CORE = ("rank raises in forward", "rank killed (SIGKILL)", "rank hangs in forward",
        "non-finite loss")
RUN = [c for c in SHARED if c not in REFUSED and c.name in CORE]
RUN_SLOW = [c for c in SHARED if c not in REFUSED and c.name not in CORE]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """The core cases' outcomes, the cases run two at a time (``run_cases``)."""
    return run_cases(RUN, tmp_path_factory.mktemp("faults"))


@pytest.fixture(scope="module")
def slow_outcomes(tmp_path_factory):
    return run_cases(RUN_SLOW, tmp_path_factory.mktemp("faults-slow"))


@pytest.mark.parametrize("case", RUN, ids=[c.name for c in RUN])
def test_fault_stops_the_job_with_one_line(case, outcomes):
    _check_stopped(case, outcomes[case.name])


@pytest.mark.slow
@pytest.mark.parametrize("case", RUN_SLOW, ids=[c.name for c in RUN_SLOW])
def test_every_other_fault_stops_the_job_with_one_line(case, slow_outcomes):
    _check_stopped(case, slow_outcomes[case.name])


@pytest.mark.parametrize("case", REFUSED, ids=[c.name for c in REFUSED])
def test_bad_input_is_one_line_before_any_process_starts(case, tmp_path):
    outcome = refused_in_process(case, tmp_path)
    _check_stopped(case, outcome)
    assert not (outcome.out_dir / "logs").exists()  # no rank ever started


def _case(name: str):
    return next(c for c in CASES if c.name == name)


def _check_stopped(case, outcome) -> None:
    """The job ended as ``case`` says: its status, its one last line naming the rank,
    nothing left running, within the bound, with a failure log."""
    context = f"{case.name}: exit {outcome.status}, last line {outcome.last_line!r}\n" \
              f"{outcome.stderr[-3000:]}"
    assert outcome.status == case.status, context
    assert outcome.leftovers == [], context
    if case.status not in (0, -signal.SIGKILL):
        assert "Traceback" not in outcome.stderr, context
    if case.says:
        assert re.search(case.says, outcome.last_line), context
    if case.rank is not None:
        assert outcome.named_rank == case.rank, context
    if case.status in (1, 130, 143):
        assert outcome.seconds < STOP_BOUND_S, context
    if case.status == 1:
        logs = outcome.out_dir / "logs"
        assert (logs / "failure.txt").exists() or (logs / "hang.txt").exists(), context


def _losses(out_dir):
    lines = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in lines if "loss" in r]


@pytest.mark.slow
def test_kill_during_a_save_resumes_from_the_previous_checkpoint_exactly(tmp_path):
    """Acceptance: kill -9 of one worker during a save, then --resume, equals a straight
    run, bit for bit; the torn save is not used."""
    kill = _case("kill during a checkpoint save")
    straight_dir = tmp_path / "straight"  # runs beside the killed run and its resume
    straight = subprocess.Popen(command(kill.args, straight_dir), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    killed = run_case(kill, tmp_path / "killed")
    _check_stopped(kill, killed)
    saved = [c.step for c in checkpoint.complete_checkpoints(killed.out_dir / "checkpoint")]
    assert sorted(saved) == [1, 2]
    resumed = subprocess.run(command((*kill.args, "--resume"), killed.out_dir),
                             capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr
    assert "step-000002" in resumed.stdout
    _, straight_stderr = straight.communicate(timeout=240)
    assert straight.returncode == 0, straight_stderr
    assert _losses(killed.out_dir) == _losses(straight_dir)
    assert len(_losses(straight_dir)) == 4


@pytest.mark.slow
def test_a_skipped_non_finite_step_keeps_nan_out_of_the_weights(tmp_path):
    skip = _case("non-finite loss, skipped")
    outcome = run_case(skip, tmp_path)
    _check_stopped(skip, outcome)
    records = [json.loads(line) for line in
               (outcome.out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("nonfinite", False) for r in records] == [False, True, False]
    assert records[1]["loss"] is None  # strict JSON: no bare NaN
    assert all(r["loss"] is not None for r in (records[0], records[2]))
    metrics = json.loads((outcome.out_dir / "metrics.json").read_text())
    assert metrics["summary"]["nonfinite_steps"] == 1
    newest = checkpoint.newest(outcome.out_dir / "checkpoint")
    assert newest.step == 3
    whole = tmp_path / "whole.pt"
    dcp_to_torch_save(newest.directory, whole)
    weights = {k: v for k, v in torch.load(whole, weights_only=False).items()
               if k.startswith("model.")}
    assert weights and all(torch.isfinite(v).all() for v in weights.values())


@pytest.mark.slow
def test_sigusr1_prints_who_waits_on_whom_without_stopping(tmp_path):
    out = tmp_path / "run"
    process = subprocess.Popen(command(("--pp", "2", "--steps", "100000"), out),
                               stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    wait_for_training(out / "metrics.jsonl", process, 240)
    process.send_signal(signal.SIGUSR1)
    time.sleep(1.5)
    assert process.poll() is None  # still training
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130
    assert "who waits on whom" in stderr and "  rank 1: " in stderr, stderr


@pytest.mark.slow
def test_under_torchrun_every_rank_names_the_rank_that_failed(tmp_path):
    """torchrun's own failure handling stops the job; each rank prints the same culprit."""
    env = {**os.environ, "MESHPIPE_FAULT": "kind=raise,at=forward,rank=1,step=2"}
    run = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           *command(PP2, tmp_path / "run")[1:]]
    done = subprocess.run(run, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines()
             if line.startswith("meshpipe: training failed:")]
    assert len(lines) == 2, done.stderr[-3000:]
    assert all(line.startswith("meshpipe: training failed: rank 1 failed") for line in lines)
    assert all("injected fault at forward of step 2" in line for line in lines)
