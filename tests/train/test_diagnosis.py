"""Failure and hang reports from what the ranks recorded (no processes: pure functions)."""

import json
import math
import os
import sys
import time

import pytest

from meshpipe.runtime import activity
from meshpipe.train.outputs.metrics import MetricsLog, dumps, read
from meshpipe.train.supervisor.diagnosis import failure_report, hang_report, read_statuses


def _record(rank, time, cause, consequence=False, where="step 1, stage 0"):
    return {"rank": rank, "reported_by": rank, "time": time, "traceback": f"tb {rank}\n",
            "consequence": consequence, "cause": cause, "where": where, "log": None}


def test_the_first_real_error_is_named_not_an_earlier_consequence():
    records = [_record(0, 1.0, "PeerFailedError: rank 1 stopped", consequence=True),
               _record(1, 2.0, "ValueError: bad batch", where="step 3, stage 1")]
    line, rank, details = failure_report(records, {}, 2)
    assert rank == 1
    assert line == "rank 1 failed at step 3, stage 1: ValueError: bad batch"
    assert "tb 0" in details and "tb 1" in details


def test_identical_errors_on_every_rank_are_not_called_consequences():
    records = [_record(r, 1.0 + r, "ValueError: same") for r in (2, 0, 1)]
    line, rank, _ = failure_report(records, {}, 3)
    assert rank == 0
    assert line.endswith("; ranks 1, 2 failed the same way")


def test_a_rank_that_died_without_a_word_is_the_cause_over_closed_connections():
    records = [_record(0, 1.0, "RuntimeError: Connection closed by peer", consequence=True)]
    status = {"since": 0.0, "waiting": False, "what": "1F2", "step": 4, "stage": 1,
              "microbatch": 2, "action": "1F2"}
    died = {1: {"time": 1.5, "exit_code": -9, "status": status}}
    line, rank, _ = failure_report(records, died, 2)
    assert rank == 1
    assert line == ("rank 1 was killed by SIGKILL (out of memory, or killed from outside) "
                    "at step 4, stage 1, microbatch 2, action 1F2")


def _status(what, since, waiting=False, **fields):
    return {"what": what, "since": since, "waiting": waiting, "limit": None, **fields}


def test_a_hang_follows_who_waits_on_whom_to_the_stuck_rank():
    statuses = {0: _status("message", 0.0, True, peer=1, step=2),
                1: _status("1F3", 1.0, step=2, stage=1, microbatch=3, action="1F3"),
                2: _status("barrier", 0.5, True, peers=[0, 1, 2], step=2)}
    assert hang_report(statuses, 20.0, 30.0, [None] * 3) is None
    picture, line, rank = hang_report(statuses, 40.0, 30.0, [None] * 3)
    assert rank == 1
    assert line.startswith("rank 1 hangs: runs 1F3 for 39 s without finishing "
                           "[step 2, stage 1, microbatch 3, action 1F3]")
    assert line.endswith("ranks 0, 2 wait on it")
    assert "rank 0: waits 40 s for message from rank 1 [step 2] -> rank 1" in picture


def test_a_rank_waiting_on_the_stuck_one_is_named_before_its_own_limit():
    statuses = {0: {**_status("message", 30.0, True, peer=1), "limit": 60.0},
                1: _status("1F0", 0.0, step=1, stage=1, microbatch=0, action="1F0")}
    _, line, rank = hang_report(statuses, 40.0, 30.0, [None, None])
    assert rank == 1 and line.endswith("; rank 0 waits on it")


def test_a_cycle_of_waits_is_a_deadlock():
    statuses = {0: _status("message", 0.0, True, peer=1), 1: _status("message", 0.0, True,
                                                                       peer=0)}
    _, line, rank = hang_report(statuses, 40.0, 30.0, [None, None])
    assert rank == 0 and "ranks 0 -> 1 -> 0 wait on each other (a deadlock)" in line


def test_a_long_phase_gets_its_own_limit():
    statuses = {0: {**_status("the --check step", 0.0), "limit": 900.0},
                1: {**_status("gather", 0.0, True, peers=[0, 1]), "limit": 900.0}}
    assert hang_report(statuses, 100.0, 30.0, [None, None]) is None


def _freeze_at(control, rank, **fields):
    """The where-file rank ``rank`` leaves when it freezes inside ``fields``; its time."""
    activity.reset()
    reporter = activity.Reporter(rank, control, 30.0, interval_s=60).start()
    with activity.doing("action", **fields):
        reporter.stop()  # the where-file keeps this place
    activity.reset()
    return activity.read_where_record(control / f"where-{rank}")["written_at"]


def _write_status(control, rank, status):
    (control / f"status-{rank}.json").write_text(json.dumps({"rank": rank, **status}))


def test_a_frozen_rank_is_reported_where_its_where_file_last_saw_it(tmp_path):
    """Rank 1's last status is from step 333; it moved on to step 339, then froze: the
    report gives the where-file's place and its age, never the stale status as current."""
    frozen = _freeze_at(tmp_path, 1, step=339, stage=1, microbatch=2, action="1F2")
    now = frozen + 30
    _write_status(tmp_path, 0, {**_status("message", frozen, True, peer=1, step=339),
                                "reported_at": now})
    _write_status(tmp_path, 1, {**_status("1SEND_B1", frozen - 0.1, step=333, stage=1,
                                          microbatch=1, action="1SEND_B1"),
                                "reported_at": frozen - 0.05})
    picture, line, rank = hang_report(read_statuses(tmp_path, 2), now, 20.0, [None, None])
    assert rank == 1
    assert line == ("rank 1 is not responding (frozen, or holding Python's GIL); last seen "
                    "30 s ago at step 339, stage 1, microbatch 2, action 1F2; rank 0 waits on "
                    "it")
    assert picture.endswith("\n  rank 1: not responding (frozen, or holding Python's GIL); "
                            "last seen 30 s ago at step 339, stage 1, microbatch 2, action 1F2")
    assert "333" not in picture


def test_a_rank_that_still_reports_is_described_as_it_reported(tmp_path):
    """A fresh heartbeat from a running process: the status is current, whatever the
    where-file says (a running rank's where-file is often a moment ahead of its status)."""
    moved = _freeze_at(tmp_path, 1, step=3, stage=1, microbatch=4, action="1F4")
    status = {**_status("1F3", moved - 40, step=3, stage=1, microbatch=3, action="1F3"),
              "reported_at": moved, "pid": os.getpid()}
    _write_status(tmp_path, 1, status)
    statuses = read_statuses(tmp_path, 2)
    if sys.platform.startswith("linux"):
        assert statuses[1]["process_state"] == "R"  # this test's process, reading /proc
    _, line, rank = hang_report(statuses, moved + 0.5, 30.0, [None, None])
    assert rank == 1
    assert line == ("rank 1 hangs: runs 1F3 for 40 s without finishing "
                    "[step 3, stage 1, microbatch 3, action 1F3]")


def test_a_stopped_rank_ends_the_chain_even_if_it_was_waiting():
    """A stopped process waits on nobody: the rank waiting on it is no deadlock."""
    statuses = {0: _status("message", 0.0, True, peer=1, step=5),
                1: {**_status("message", 5.0, True, peer=0, step=5, stage=1),
                    "reported_at": 39.0, "process_state": "T"}}
    picture, line, rank = hang_report(statuses, 40.0, 30.0, [None, None])
    assert rank == 1
    assert line == ("rank 1 is stopped (SIGSTOP or a debugger); last seen 1 s ago at step 5, "
                    "stage 1; rank 0 waits on it")
    assert "  rank 0: waits 40 s for message from rank 1 [step 5] -> rank 1\n" in picture


def test_activity_snapshot_nests_and_remembers_where_the_first_error_was():
    activity.reset()
    with activity.doing("step 5", step=5):
        with activity.waiting("message", peer=3, label="fwd"):
            state = activity.snapshot()
        with pytest.raises(ValueError):
            with activity.doing("2B1", stage=2, microbatch=1, action="2B1"):
                raise ValueError("boom")
    assert state["waiting"] and state["peer"] == 3 and state["step"] == 5
    assert activity.describe(activity.first_failure()) == "step 5, stage 2, microbatch 1, " \
                                                          "action 2B1"
    assert activity.first_failure()["error"] == "ValueError: boom"
    assert activity.snapshot()["what"] == "idle"
    activity.reset()


def test_the_reporter_writes_status_files_the_launcher_reads(tmp_path):
    """Read the status while the activity lasts: once it ends the reporter writes 'idle'."""
    activity.reset()
    reporter = activity.Reporter(0, tmp_path, 30.0, interval_s=0.01).start()
    seen = {}
    try:
        with activity.doing("3F0", stage=3):
            deadline = time.time() + 5
            while time.time() < deadline and "stage" not in seen:
                seen = read_statuses(tmp_path, 1).get(0, {})
                time.sleep(0.01)
    finally:
        reporter.stop()
        activity.reset()
    assert seen["stage"] == 3


def test_metrics_lines_are_strict_json_and_a_resume_continues_the_history(tmp_path):
    log = MetricsLog(tmp_path, 0)
    for step, loss in enumerate([2.0, math.nan, 1.5], start=1):
        log.append({"step": step, "loss": loss})
    log.close()
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in text and json.loads(text.splitlines()[1])["loss"] is None
    resumed = MetricsLog(tmp_path, 2)  # the checkpoint was step 2: step 3 is redone
    resumed.append({"step": 3, "loss": 1.25})
    resumed.close()
    assert [r["loss"] for r in read(tmp_path / "metrics.jsonl")] == [2.0, None, 1.25]
    assert dumps({"x": math.inf, "y": [math.nan, 1.0]}) == '{"x": null, "y": [null, 1.0]}'
