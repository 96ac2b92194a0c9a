"""--zero's bad input and its notice, before any process starts."""

import pytest

from meshpipe.train.config import TrainConfig
from meshpipe.train.run.plan import plan_run


@pytest.mark.parametrize("zero", [-1, 3])
def test_a_zero_level_other_than_0_1_2_is_one_line(zero):
    with pytest.raises(ValueError, match=rf"^--zero {zero}: choose 0 .*, 1 .* or 2 "):
        TrainConfig(zero=zero)


def test_zero_without_replicas_is_a_notice_not_an_error(tmp_path):
    notes = plan_run(TrainConfig(zero=1, out_dir=str(tmp_path), device="cpu")).notes
    assert ("--zero 1: each weight has one replica (dp x cp = 1), so there is nothing to "
            "shard; the run is the same as --zero 0") in notes
    with_replicas = plan_run(TrainConfig(zero=2, dp=2, out_dir=str(tmp_path), device="cpu"))
    assert not any("--zero" in note for note in with_replicas.notes)
