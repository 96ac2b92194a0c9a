"""The expert-parallel all-to-all in the cost model (``CostModel.a2a``) and what an OVERLAP
action (combined 1F1B, DualPipeV) hides of it."""

import pytest

from meshpipe.schedules.actions import Action, B, F, I, Kind, W
from meshpipe.schedules.schedule import Schedule
from meshpipe.schedules.builders import build
from meshpipe.schedules.compare import compare
from meshpipe.schedules.interleaved import combined_1f1b
from meshpipe.schedules import CostModel, simulate

# name, pp, microbatches, stages per rank: every builder, OVERLAP schedules included.
SIZES = [("none", 1, 4, 1), ("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("interleaved", 4, 8, 2),
         ("zb-h1", 4, 8, 1), ("zb-v", 4, 8, 2), ("dualpipe-v", 4, 8, 2),
         ("combined-1f1b", 4, 8, 2), ("combined-1f1b", 2, 8, 1), ("combined-1f1b", 1, 4, 1)]


def timed(simulation) -> list[tuple[str, float, float]]:
    return [(str(t.action), t.start, t.end) for t in simulation.timeline]


def durations(simulation) -> dict[str, float]:
    return {str(t.action): t.duration for t in simulation.timeline}


def single_rank(*actions: Action, stages: int = 1) -> Schedule:
    return Schedule(1, stages, 1 + max(a.microbatch for a in actions), (0,) * stages,
                    [list(actions)])


@pytest.mark.parametrize("name, p, m, v", SIZES)
def test_no_all_to_all_leaves_every_timeline_as_an_overlap_of_f_plus_b(name, p, m, v):
    # The explicit overlap cost F + B is the cost model's old default for an OVERLAP.
    schedule = build(name, p, m, stages_per_rank=v)
    given = dict(forward=1.5, backward=4, backward_input=1, comm=0.25)
    assert CostModel(**given).a2a == 0.0
    assert timed(simulate(schedule, CostModel(**given))) == timed(
        simulate(schedule, CostModel(**given, a2a=0.0, overlap=5.5)))


def test_no_all_to_all_keeps_the_published_overlap_schedule_figures():
    p, m, v = 4, 8, 2
    dualpipe = simulate(build("dualpipe-v", p, m))  # F = I = W = 1 per stage
    assert dualpipe.makespan == 6 * m + 2 * (p - 1)
    combined = simulate(build("combined-1f1b", p, m, stages_per_rank=v),
                        CostModel().scaled(1 / v))
    assert combined.bubble_ratio == pytest.approx((p - 1) / (v * m + p - 1))


def test_an_all_to_all_lengthens_f_b_and_i_but_not_w():
    costs = CostModel(forward=1, backward_input=2, backward_weight=3, a2a=0.5)
    split = simulate(single_rank(F(0, 0), I(0, 0), W(0, 0)), costs)
    assert durations(split) == {"0F0": 1.5, "0I0": 2.5, "0W0": 3.0}
    full = simulate(single_rank(F(0, 0), B(0, 0)), costs)
    assert durations(full) == {"0F0": 1.5, "0B0": 5.5}
    assert full.makespan == split.makespan  # one reverse all-to-all, in B or in I


def test_per_stage_all_to_alls_follow_their_stage():
    schedule = Schedule(2, 2, 1, (0, 1), [[F(0, 0), B(0, 0)], [F(1, 0), B(1, 0)]])
    simulation = simulate(schedule, CostModel(forward=1, backward=2, a2a=(0.25, 1)))
    assert durations(simulation) == {"0F0": 1.25, "1F0": 2.0, "1B0": 3.0, "0B0": 2.25}
    assert simulation.makespan == 1.25 + 2 + 3 + 2.25


@pytest.mark.parametrize("a2a", [0.25, 1.5, 2.0, 3.0])
def test_combined_1f1b_on_one_rank_hides_each_all_to_all_behind_the_other_compute(a2a):
    # F0; three OVERLAPs F(k+1)+B(k); B3
    f, b = 1.0, 2.0
    schedule = combined_1f1b(1, 4)
    assert [a.kind for a in schedule.ranks[0]] == [Kind.F] + [Kind.OVERLAP] * 3 + [Kind.B]
    simulation = simulate(schedule, CostModel(forward=f, backward=b, a2a=a2a))
    overlap = max(f + b, 2 * a2a)
    assert [t.duration for t in simulation.timeline] == [f + a2a] + [overlap] * 3 + [b + a2a]
    assert simulation.makespan == (f + a2a) + 3 * overlap + (b + a2a)


def test_an_overlap_of_two_stages_pairs_their_compute_and_their_all_to_alls():
    # Forward on stage 1 with backward on stage 0, then the other way round.
    schedule = single_rank(F(0, 0), F(1, 0), B(1, 0), F(0, 1),
                           Action.overlap(F(1, 1), B(0, 0)), Action.overlap(F(0, 2), B(1, 1)),
                           Action.overlap(F(1, 2), B(0, 1)), stages=2)
    costs = CostModel(forward=(1, 2), backward=(4, 8), a2a=(3, 5))
    overlaps = [t.duration for t in simulate(schedule, costs).timeline][4:]
    assert overlaps == [max(2 + 4, 5 + 3), max(1 + 8, 3 + 5), max(2 + 4, 5 + 3)] == [8, 9, 8]


def test_an_explicit_overlap_cost_wins_over_the_all_to_all_formula():
    simulation = simulate(combined_1f1b(1, 4), CostModel(a2a=5, overlap=0.5))
    assert [t.duration for t in simulation.timeline][1:4] == [0.5] * 3


@pytest.mark.parametrize("p, m", [(1, 4), (1, 8), (2, 8), (4, 8)])
def test_combined_1f1b_beats_1f1b_only_with_an_all_to_all(p, m):
    def makespan(name, a2a):
        return simulate(build(name, p, m, stages_per_rank=1), CostModel(a2a=a2a)).makespan

    assert makespan("combined-1f1b", 0) == makespan("1f1b", 0)
    for a2a in (0.25, 0.5, 2):
        assert makespan("combined-1f1b", a2a) < makespan("1f1b", a2a)


def test_dualpipe_v_gains_over_zb_h1_only_with_an_all_to_all():
    def makespans(a2a):
        rows = compare(4, 8, costs=CostModel(a2a=a2a), names=["zb-h1", "dualpipe-v"])
        return {row.name: row.simulation.makespan for row in rows}

    plain, moe = makespans(0), makespans(0.5)
    assert plain["dualpipe-v"] == plain["zb-h1"]
    assert moe["dualpipe-v"] < moe["zb-h1"]
    assert moe["dualpipe-v"] > plain["dualpipe-v"]  # the all-to-all is not free


def test_compare_at_pp_2_gives_combined_1f1b_the_shortest_step_of_its_family():
    rows = {row.name: row.simulation.makespan for row in
            compare(2, 8, costs=CostModel(a2a=0.5), names=["1f1b", "interleaved",
                                                            "combined-1f1b"])}
    assert rows["combined-1f1b"] < rows["interleaved"] < rows["1f1b"]
    plain = {row.name: row.simulation.makespan for row in
             compare(2, 8, names=["interleaved", "combined-1f1b"])}
    assert plain["combined-1f1b"] == plain["interleaved"]


def test_the_all_to_all_scales_with_stages_and_is_not_recomputed():
    assert CostModel(a2a=(1, 3)).scaled(0.5).a2a == (0.5, 1.5)
    assert CostModel(a2a=2).for_stages_of(build("interleaved", 2, 4, stages_per_rank=2)).a2a == 1
    recomputed = CostModel(forward=1, backward=2, a2a=0.5).with_recompute("full")
    assert recomputed.a2a == 0.5
    simulation = simulate(single_rank(F(0, 0), B(0, 0)), recomputed)
    assert durations(simulation) == {"0F0": 1.5, "0B0": 2 + 1 + 0.5}


def test_all_to_all_costs_are_checked_like_the_others():
    with pytest.raises(ValueError, match="CostModel.a2a holds -1"):
        CostModel(a2a=-1)
    with pytest.raises(ValueError, match="CostModel.a2a has 3 per-stage values but the "
                                         "schedule has 1 stages"):
        simulate(single_rank(F(0, 0), B(0, 0)), CostModel(a2a=(1, 1, 1)))
