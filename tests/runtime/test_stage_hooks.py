"""The executor's stage hooks fire at the right actions: before a stage's first forward and
after its last weight-gradient action (B, or W under split backward), for every schedule."""

import pytest

from meshpipe.runtime.hooks import stage_moments
from meshpipe.schedules import build
from meshpipe.schedules.actions import Kind
from meshpipe.schedules.lowering import lower

CASES = [("1f1b", 2, 1), ("gpipe", 3, 1), ("interleaved", 2, 2), ("zb-h1", 2, 1),
         ("zb-v", 2, 2), ("dualpipe-v", 2, 2), ("combined-1f1b", 2, 1)]


@pytest.mark.parametrize("name,pp,vpp", CASES)
def test_hooks_sit_at_each_stage_s_first_forward_and_last_weight_gradient(name, pp, vpp):
    schedule = lower(build(name, pp, 4, stages_per_rank=vpp))
    for rank, actions in enumerate(schedule.ranks):
        before, after = stage_moments(actions)
        stages = set(schedule.stages_of(rank))
        assert sorted(s for at in before.values() for s in at) == sorted(stages)
        assert sorted(s for at in after.values() for s in at) == sorted(stages)
        for index, at in before.items():
            for stage in at:
                forwards = [i for i, a in enumerate(actions) for part in a.computations
                            if part.kind is Kind.F and part.stage == stage]
                assert forwards[0] == index
        for index, at in after.items():
            for stage in at:
                weights = [i for i, a in enumerate(actions) for part in a.computations
                           if part.kind in (Kind.B, Kind.W) and part.stage == stage]
                assert weights[-1] == index


def test_a_forward_only_schedule_has_no_gradient_moment():
    schedule = lower(build("1f1b", 2, 4, forward_only=True))
    for actions in schedule.ranks:
        assert stage_moments(actions)[1] == {}
