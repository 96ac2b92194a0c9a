"""``MESHPIPE_FAULT`` is read before any process starts: a value that names no fault this run
can fire is one line saying what is wrong, not a rank's traceback."""

import pytest

from meshpipe.train.config import TrainConfig
from meshpipe.train.run.plan import plan_run
from meshpipe.train.supervisor import faults


def test_a_fault_is_read_with_its_step_counted_from_one():
    assert faults.parse("kind=hang, at=forward, rank=1, step=2, microbatch=0") == faults.Fault(
        "hang", "forward", 1, 2, 0)
    at_step = faults.Fault("raise", "step", 0, 2)
    assert at_step.due(2) and not at_step.due(1)


@pytest.mark.parametrize("text,says", [
    ("kind=hang", "lacks at, rank, step"),
    ("kind=hang,at=forward,rank=1", "lacks step"),
    ("kind=hang,at=forward,rank,step=2", "'rank' in 'kind=hang,at=forward,rank,step=2' is not "
                                         "key=value"),
    ("kind=hang,at=forward,rank=one,step=2", "rank=one in"),
    ("kind=hang,at=forward,rank=1,step=2,when=now", "unknown key 'when'"),
    ("kind=melt,at=forward,rank=1,step=2", "unknown kind 'melt'"),
    ("kind=hang,at=forward,rank=5,step=2", "rank=5 is not a rank of this run of 2 processes"),
    ("kind=hang,at=forward,rank=1,step=0", "steps count from 1"),
])
def test_a_malformed_fault_is_one_line_before_any_process(text, says, tmp_path, monkeypatch):
    monkeypatch.setenv(faults.ENVIRONMENT_VARIABLE, text)
    with pytest.raises(ValueError) as caught:
        plan_run(TrainConfig(pp=2, out_dir=str(tmp_path)))
    message = str(caught.value)
    assert says in message and message.startswith("MESHPIPE_FAULT: ") and "\n" not in message


def test_a_well_formed_fault_plans(tmp_path, monkeypatch):
    monkeypatch.setenv(faults.ENVIRONMENT_VARIABLE, "kind=raise,at=loss,rank=1,step=1")
    assert plan_run(TrainConfig(pp=2, out_dir=str(tmp_path))).config.pp == 2
