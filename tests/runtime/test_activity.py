"""What a rank leaves for its launcher to read: the where-file, written at every move, and
the status, rewritten every interval (``runtime.activity``)."""

import json
import time

from meshpipe.runtime import activity


def _read_status(control, rank, ready):
    """The rank's status file once ``ready(status)`` holds (it is replaced, never torn)."""
    deadline = time.time() + 5
    while time.time() < deadline:
        try:
            status = json.loads((control / f"status-{rank}.json").read_text())
        except OSError:
            status = None
        if status is not None and ready(status):
            return status
        time.sleep(0.01)
    raise AssertionError(f"rank {rank}'s status never got ready within 5 s")


def test_the_where_file_holds_the_place_and_when_the_rank_got_there(tmp_path):
    activity.reset()
    reporter = activity.Reporter(1, tmp_path, 30.0, interval_s=60).start()
    try:
        with activity.doing("step 7", step=7):
            with activity.doing("1F2", stage=1, microbatch=2, action="1F2"):
                inside = activity.read_where_record(tmp_path / "where-1")
                since = activity.snapshot()["since"]
                place = activity.read_where(tmp_path / "where-1")
            after = activity.read_where_record(tmp_path / "where-1")
    finally:
        reporter.stop()
        activity.reset()
    assert inside == {"step": 7, "stage": 1, "microbatch": 2, "action": "1F2",
                      "written_at": since}
    assert place == "step 7, stage 1, microbatch 2, action 1F2"
    assert after["step"] == 7 and "action" not in after
    assert after["written_at"] >= since


def test_a_half_written_record_is_never_read(tmp_path):
    """A rank frozen while it writes the next record leaves the previous one readable."""
    activity.reset()
    reporter = activity.Reporter(0, tmp_path, 30.0, interval_s=60).start()
    try:
        with activity.doing("step 3", step=3):
            path = tmp_path / "where-0"
            other = 1 - path.read_bytes()[2]  # the slot not in use
            with open(path, "r+b") as stream:  # in place: the rank maps this file
                stream.seek(activity._HEADER_BYTES + other * activity._SLOT_BYTES)
                stream.write(b'{"step": 4, ')
            record = activity.read_where_record(path)
    finally:
        reporter.stop()
        activity.reset()
    assert record["step"] == 3


def test_a_rank_that_never_moved_has_no_where_record(tmp_path):
    activity.reset()
    reporter = activity.Reporter(0, tmp_path, 30.0, interval_s=60).start()
    reporter.stop()
    assert activity.read_where_record(tmp_path / "where-0") is None
    assert activity.read_where(tmp_path / "missing") is None


def test_the_reporter_rewrites_an_unchanged_status_every_interval(tmp_path):
    """The heartbeat: ``reported_at`` moves on while ``since`` (the last change) stays."""
    activity.reset()
    reporter = activity.Reporter(0, tmp_path, 30.0, interval_s=0.01).start()
    try:
        with activity.doing("3F0", stage=3):
            first = _read_status(tmp_path, 0, lambda status: status.get("stage") == 3)
            later = _read_status(tmp_path, 0, lambda status: status["reported_at"]
                                 > first["reported_at"])
    finally:
        reporter.stop()
        activity.reset()
    assert later["since"] == first["since"]
