"""The discrete-event simulator and its cost model, on hand-built schedules (independent
of the builders)."""

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshpipe.schedules.actions import Action, B, F, I, Kind, W
from meshpipe.schedules.builders import build
from meshpipe.schedules.schedule import Schedule
from meshpipe.schedules import (
    BackwardCostMismatch,
    CostModel,
    SimulationDeadlock,
    TimedAction,
    fit_costs,
    recompute_compute_fraction,
    recompute_memory_fraction,
    simulate,
)
from meshpipe.schedules.costs import fit_message_seconds
from meshpipe.schedules.simulator import mean_speeds
from meshpipe.schedules.timeline import Timeline
from meshpipe.schedules.validation import ScheduleError


def gpipe(p: int, m: int) -> Schedule:
    """Every rank runs all forwards, then all backwards."""
    ranks = [[F(r, i) for i in range(m)] + [B(r, i) for i in range(m)] for r in range(p)]
    return Schedule(p, p, m, tuple(range(p)), ranks, name="gpipe")


def one_f_one_b(p: int, m: int, split: bool = False) -> Schedule:
    """Warm-up forwards, then alternate F and B; ``split`` runs each B as I then W."""
    ranks = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        actions = [F(r, i) for i in range(warmup)]
        for i in range(m):
            if warmup + i < m:
                actions.append(F(r, warmup + i))
            actions.extend([I(r, i), W(r, i)] if split else [B(r, i)])
        ranks.append(actions)
    return Schedule(p, p, m, tuple(range(p)), ranks, name="1f1b")


def lowered(schedule: Schedule) -> Schedule:
    """Hand-lowered: a receive before each compute that needs a remote input, a send after
    each compute whose output goes to another rank."""
    last = schedule.num_stages - 1
    ranks = []
    for actions in schedule.ranks:
        out = []
        for a in actions:
            if a.kind is Kind.F and a.stage > 0:
                out.append(Action(Kind.RECV_F, a.stage, a.microbatch))
            if a.kind is Kind.B and a.stage < last:
                out.append(Action(Kind.RECV_B, a.stage, a.microbatch))
            out.append(a)
            if a.kind is Kind.F and a.stage < last:
                out.append(Action(Kind.SEND_F, a.stage, a.microbatch))
            if a.kind is Kind.B and a.stage > 0:
                out.append(Action(Kind.SEND_B, a.stage, a.microbatch))
        ranks.append(out)
    return schedule.replace_ranks(ranks)


def starts(simulation) -> dict[str, float]:
    return {str(t.action): t.start for t in simulation.timeline}


sizes = st.tuples(st.integers(1, 16), st.integers(1, 64))


@settings(max_examples=40, deadline=None)
@given(sizes, st.sampled_from([1.0, 2.0]))
def test_gpipe_and_1f1b_bubbles_match_the_closed_form(size, backward):
    p, m = size
    costs = CostModel(forward=1.0, backward=backward)
    for schedule in (gpipe(p, m), one_f_one_b(p, m)):
        simulation = simulate(schedule, costs)
        assert simulation.makespan == pytest.approx((m + p - 1) * (1 + backward))
        assert simulation.bubble_ratio == pytest.approx((p - 1) / (m + p - 1))
        assert simulation.busy == pytest.approx([m * (1 + backward)] * p)


@settings(max_examples=40, deadline=None)
@given(sizes)
def test_1f1b_peak_live_activations_is_min_of_remaining_ranks_and_microbatches(size):
    p, m = size
    assert simulate(one_f_one_b(p, m)).peak_activations == tuple(
        min(p - r, m) for r in range(p))
    assert simulate(gpipe(p, m)).peak_activations == (m,) * p


def test_split_backward_keeps_activations_until_the_weight_gradient():
    split = simulate(one_f_one_b(4, 8, split=True))
    # The gradient travels up with each I (1) instead of each B (2): 3 ranks save 1 each.
    assert split.makespan == simulate(one_f_one_b(4, 8)).makespan - 3
    assert split.peak_activations == (4, 3, 2, 1)
    # Deferring every W to the end keeps all microbatches live.
    deferred = Schedule(1, 1, 3, (0,), [[F(0, 0), I(0, 0), F(0, 1), I(0, 1), F(0, 2), I(0, 2),
                                         W(0, 0), W(0, 1), W(0, 2)]])
    assert simulate(deferred).peak_activations == (3,)


def test_forward_only_schedules_hold_one_activation_at_a_time():
    schedule = Schedule(2, 2, 3, (0, 1), [[F(0, i) for i in range(3)],
                                          [F(1, i) for i in range(3)]])
    simulation = simulate(schedule)
    assert simulation.makespan == 4
    assert simulation.peak_activations == (1, 1)


def test_backward_waits_for_the_input_gradient_and_weight_waits_for_its_input_half():
    schedule = Schedule(2, 2, 1, (0, 1), [[F(0, 0), I(0, 0), W(0, 0)],
                                          [F(1, 0), B(1, 0)]])
    # Stage 0 splits its backward (I 2, W 5); stage 1 runs a full B of 3.
    costs = CostModel(forward=1, backward=(7, 3), backward_input=(2, 1), backward_weight=(5, 2))
    assert starts(simulate(schedule, costs)) == {
        "0F0": 0, "1F0": 1, "1B0": 2, "0I0": 5, "0W0": 7}
    assert simulate(schedule, costs).makespan == 12


def test_comm_latency_applies_only_between_ranks():
    # Stages 0 and 1 share rank 0; stage 2 is on rank 1.
    schedule = Schedule(2, 3, 1, (0, 0, 1), [[F(0, 0), F(1, 0), B(1, 0), B(0, 0)],
                                             [F(2, 0), B(2, 0)]])
    simulation = simulate(schedule, CostModel(forward=1, backward=1, comm=0.5))
    assert starts(simulation) == {"0F0": 0, "1F0": 1, "2F0": 2.5, "2B0": 3.5,
                                  "1B0": 5, "0B0": 6}
    assert simulation.makespan == 7


def test_per_stage_costs_and_per_stage_comm_of_the_sender():
    schedule = Schedule(2, 2, 1, (0, 1), [[F(0, 0), B(0, 0)], [F(1, 0), B(1, 0)]])
    costs = CostModel(forward=(1, 2), backward=(3, 4), comm=(0.25, 0.5))
    # 1F0 waits for 0F0's message (0.25), 0B0 for 1B0's (0.5).
    assert starts(simulate(schedule, costs)) == {"0F0": 0, "1F0": 1.25, "1B0": 3.25,
                                                 "0B0": 7.75}


def test_overlap_costs_its_halves_by_default_and_waits_for_both_inputs():
    halves = [F(1, 1), B(1, 0)]
    schedule = Schedule(2, 2, 2, (0, 1), [
        [F(0, 0), F(0, 1), B(0, 0), B(0, 1)],
        [F(1, 0), Action.overlap(*halves), B(1, 1)],
    ])
    simulation = simulate(schedule, CostModel(forward=(1, 2), backward=(3, 4)))
    assert starts(simulation)["(1F1;1B0)OVERLAP_F_B"] == 3
    timed = {str(t.action): t for t in simulation.timeline}
    assert timed["(1F1;1B0)OVERLAP_F_B"].duration == 6
    assert timed["0B0"].start == 9  # gradient of microbatch 0 leaves with the OVERLAP
    assert simulation.peak_activations == (2, 2)
    explicit = simulate(schedule, CostModel(forward=(1, 2), backward=(3, 4), overlap=(9, 5)))
    assert {str(t.action): t for t in explicit.timeline}[
        "(1F1;1B0)OVERLAP_F_B"].duration == 5


def test_activation_bytes_weigh_the_live_pairs_per_stage():
    schedule = Schedule(1, 2, 2, (0, 0), [[F(0, 0), F(1, 0), F(0, 1), F(1, 1),
                                           B(1, 0), B(0, 0), B(1, 1), B(0, 1)]])
    simulation = simulate(schedule, CostModel(activation_bytes=(10.0, 100.0)))
    assert simulation.peak_activations == (4,)
    assert simulation.peak_activation_bytes == (220.0,)
    assert simulate(schedule).peak_activation_bytes is None


def test_what_a_split_backward_holds_for_w_is_live_from_each_i_to_its_w():
    late = Schedule(1, 1, 2, (0,), [[F(0, 0), F(0, 1), I(0, 0), I(0, 1), W(0, 0), W(0, 1)]])
    early = Schedule(1, 1, 2, (0,), [[F(0, 0), I(0, 0), W(0, 0), F(0, 1), I(0, 1), W(0, 1)]])
    costs = CostModel(activation_bytes=10.0, held_for_weights=3.0)
    assert simulate(late, costs).peak_activation_bytes == (26.0,)  # both pairs, both held
    assert simulate(early, costs).peak_activation_bytes == (13.0,)
    assert simulate(late, costs).peak_activations == (2,)  # counts pairs only
    assert simulate(late, CostModel(activation_bytes=10.0)).peak_activation_bytes == (20.0,)
    fused = Schedule(1, 1, 2, (0,), [[F(0, 0), F(0, 1), B(0, 0), B(0, 1)]])
    assert simulate(fused, costs).peak_activation_bytes == (20.0,)  # a B holds nothing more


def test_lowered_schedules_simulate_like_unlowered_ones_with_free_sends_and_receives():
    schedule = one_f_one_b(4, 6)
    costs = CostModel(comm=0.5)
    plain, low = simulate(schedule, costs), simulate(lowered(schedule), costs)
    assert low.makespan == plain.makespan
    assert low.bubble_ratio == plain.bubble_ratio
    comm = [t for t in low.timeline if t.action.kind.is_comm]
    assert comm and all(t.duration == 0 for t in comm)
    compute = {str(t.action): (t.start, t.end) for t in low.timeline if t.action.kind.is_compute}
    assert compute == {str(t.action): (t.start, t.end) for t in plain.timeline}


def test_a_deadlock_names_the_stuck_ranks_actions_and_what_they_wait_for():
    schedule = Schedule(2, 2, 1, (0, 1), [[F(0, 0), B(0, 0)], [B(1, 0), F(1, 0)]])
    with pytest.raises(SimulationDeadlock) as error:
        simulate(schedule)
    message = str(error.value)
    assert (error.value.rank, error.value.index, error.value.waiting_for) == (0, 1, "1B0 or 1I0")
    assert "rank 1 is stuck at action #0 1B0: it waits for 1F0, scheduled at rank 1 " \
           "action #1" in message
    assert "rank 0 is stuck at action #1 0B0: it waits for 1B0 or 1I0" in message


def test_a_missing_producer_is_reported_as_run_by_no_rank():
    schedule = Schedule(2, 2, 2, (0, 1), [[F(0, 0), B(0, 0)], [F(1, 0), F(1, 1), B(1, 0)]])
    with pytest.raises(SimulationDeadlock, match=r"rank 1 is stuck at action #1 1F1: it waits "
                                                 r"for 0F1, which no rank runs"):
        simulate(schedule)


def test_a_duplicated_forward_is_an_error_not_a_silent_overwrite():
    schedule = Schedule(1, 1, 1, (0,), [[F(0, 0), F(0, 0), B(0, 0)]])
    with pytest.raises(ScheduleError, match=r"rank 0 action #1 0F0: F of stage 0 microbatch 0 "
                                            r"runs a second time"):
        simulate(schedule)


def test_cost_model_checks_its_values():
    with pytest.raises(ValueError, match="finite and >= 0"):
        CostModel(forward=-1)
    with pytest.raises(TypeError, match="CostModel.comm must be a number"):
        CostModel(comm="fast")
    with pytest.raises(ValueError, match="empty sequence"):
        CostModel(backward_input=[])
    with pytest.raises(ValueError, match="CostModel.forward has 3 per-stage values but the "
                                         "schedule has 2 stages"):
        simulate(gpipe(2, 2), CostModel(forward=[1, 1, 1]))
    assert CostModel(forward=[1, 2]).forward == (1.0, 2.0)


def test_large_schedules_simulate_in_linear_passes():
    simulation = simulate(one_f_one_b(64, 512))
    assert simulation.bubble_ratio == pytest.approx(63 / 575)
    assert simulation.peak_activations[0] == 64


def test_timeline_from_measured_records():
    records = [
        (1, "1F0", 10.5, 11.5), (0, "0F0", 10.0, 10.5), (0, "0SEND_F0", 10.5, 10.6),
        (1, "1B0", 11.5, 13.0), (0, "0B0", 13.0, 14.0),
    ]
    timeline = Timeline.from_records(records)
    assert timeline.seconds_per_unit == 1.0
    assert timeline.origin == 10.0
    assert timeline.makespan == 4.0
    assert [str(t.action) for t in timeline.ranks[0]] == ["0F0", "0SEND_F0", "0B0"]
    assert timeline.busy == (1.5, 2.5)
    assert timeline.bubble_ratios == (pytest.approx(2.5 / 4), pytest.approx(1.5 / 4))
    assert timeline.bubble_ratio == pytest.approx(4 / 8)
    assert timeline.peak_activations() == (1, 1)


def test_timeline_rejects_inconsistent_data():
    with pytest.raises(ValueError, match="says rank 1 but is listed under rank 0"):
        Timeline([[TimedAction(1, F(0, 0), 0, 1)]])
    with pytest.raises(ValueError, match="ends at 1 before it starts at 2"):
        Timeline([[TimedAction(0, F(0, 0), 2, 1)]])
    with pytest.raises(ValueError, match="records name ranks \\[3\\], outside 0..1"):
        Timeline.from_records([(3, "0F0", 0, 1)], num_ranks=2)
    with pytest.raises(ValueError, match="rank 0: 1 actions, 2 starts"):
        Timeline.from_columns([[F(0, 0)]], [[0, 1]], [[1]])


def test_scaled_costs_scale_compute_and_memory_but_not_messages():
    costs = CostModel(forward=2, backward_input=(1, 3), comm=0.5, activation_bytes=8).scaled(0.5)
    assert (costs.forward, costs.backward_input, costs.comm, costs.activation_bytes) == (
        1.0, (0.5, 1.5), 0.5, 4.0)
    assert costs.backward == (1.0, 2.0) and costs.overlap is None
    wraparound = build("gpipe", 3, 2, placement="wraparound")  # 3 ranks' model in 4 stages
    assert CostModel(forward=3, comm=1).for_stages_of(wraparound) == CostModel(
        forward=2.25, backward_input=0.75, backward_weight=0.75, comm=1)


@pytest.mark.parametrize("given, expected", [
    (dict(), (2, 1, 1)),
    (dict(backward=4), (4, 2, 2)),
    (dict(backward=4, backward_input=3), (4, 3, 1)),
    (dict(backward=4, backward_weight=4), (4, 0, 4)),
    (dict(backward_input=3), (4, 3, 1)),
    (dict(backward_weight=0.5), (1.5, 1, 0.5)),
    (dict(backward_input=2, backward_weight=3), (5, 2, 3)),
    (dict(backward=0.3, backward_input=0.1, backward_weight=0.2), (0.3, 0.1, 0.2)),
    (dict(backward=(4, 2)), ((4, 2), (2, 1), (2, 1))),
    (dict(backward=4, backward_input=(1, 3)), (4, (1, 3), (3, 1))),
])
def test_a_full_backward_costs_its_split_halves(given, expected):
    costs = CostModel(**given)
    assert (costs.backward, costs.backward_input, costs.backward_weight) == expected


def test_backward_alone_makes_split_and_full_backward_schedules_cost_the_same():
    costs = CostModel(backward=4)
    full, split = simulate(one_f_one_b(4, 8), costs), simulate(one_f_one_b(4, 8, True), costs)
    assert full.busy == split.busy == (8 * (1 + 4),) * 4


@pytest.mark.parametrize("given, message", [
    (dict(backward=4, backward_input=1, backward_weight=1),
     "backward 4 but backward_input 1 + backward_weight 1 = 2;"),
    (dict(backward=1, backward_weight=2), "backward 1 but backward_weight 2 alone is more"),
    (dict(backward=(2, 4), backward_input=1, backward_weight=1),
     "backward 4 but backward_input 1 + backward_weight 1 = 2 on stage 1"),
])
def test_a_backward_that_differs_from_its_halves_is_rejected(given, message):
    with pytest.raises(BackwardCostMismatch, match="a full backward must cost what its split "
                                                   "halves cost: " + re.escape(message)):
        CostModel(**given)


def test_per_stage_backward_costs_must_agree_in_length():
    with pytest.raises(ValueError, match="have 2 and 3 per-stage values"):
        CostModel(backward=(1, 2, 3), backward_input=(1, 1))


@pytest.mark.parametrize("sizes, selective, full", [
    ((64, 64, 4), 34 / 54, 2 / 54),              # the trainer's defaults: 5as/h = 20
    ((2048, 12288, 96), 34 / 114, 2 / 114),      # GPT-3 175B: 5as/h = 80
])
def test_recompute_memory_fraction_is_korthikantis_per_layer_estimate(sizes, selective, full):
    assert recompute_memory_fraction("none", *sizes) == 1.0
    assert recompute_memory_fraction("selective", *sizes) == pytest.approx(selective)
    assert recompute_memory_fraction("full", *sizes) == pytest.approx(full)


def test_recompute_compute_fraction_is_the_share_of_the_forward_rerun():
    assert recompute_compute_fraction("none", 64, 64) == 0.0
    assert recompute_compute_fraction("full", 64, 64) == 1.0
    # attention core 4bs^2h of 24bsh^2 + 4bs^2h: s / (6h + s)
    assert recompute_compute_fraction("selective", 64, 64) == pytest.approx(1 / 7)
    assert recompute_compute_fraction("selective", 2048, 12288) == pytest.approx(1 / 37)


@pytest.mark.parametrize("call, message", [
    (lambda: recompute_memory_fraction("some", 64, 64, 4),
     "unknown recompute mode 'some': choose from none, selective, full"),
    (lambda: recompute_memory_fraction("full", 64, 0, 4), "dim must be a whole number >= 1"),
    (lambda: CostModel().with_recompute("none", memory_fraction=0.5),
     "recompute 'none' keeps every activation"),
    (lambda: CostModel().with_recompute("full", memory_fraction=1.5),
     "give a number in \\[0, 1\\], got 1.5"),
    (lambda: CostModel().with_recompute("full", compute_fraction=-1),
     "give a finite number >= 0, got -1"),
])
def test_recompute_arguments_are_checked(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_full_recompute_lowers_peak_activation_memory_and_raises_the_1f1b_makespan():
    p, m = 4, 8
    costs = CostModel(activation_bytes=1.0)
    recomputed = costs.with_recompute("full")
    assert (recomputed.backward, recomputed.backward_input, recomputed.backward_weight) == (
        3.0, 2.0, 1.0)  # B = I + W with the recomputed forward in I
    assert recomputed.weight_recompute == 1.0  # and a split backward's W recomputes it again
    assert recomputed.activation_bytes == pytest.approx(2 / 54)
    for split in (False, True):
        base = simulate(one_f_one_b(p, m, split), costs)
        full = simulate(one_f_one_b(p, m, split), recomputed)
        if not split:
            assert (base.makespan, full.makespan) == ((m + p - 1) * 3, (m + p - 1) * 4)
        assert full.makespan > base.makespan
        # One more F per (stage, microbatch) in B, or in each of I and W.
        assert sum(full.busy) == sum(base.busy) + (2 if split else 1) * p * m
        assert full.peak_activations == base.peak_activations == (4, 3, 2, 1)
        assert full.peak_activation_bytes == pytest.approx(
            tuple(peak * 2 / 54 for peak in base.peak_activation_bytes))
    assert max(full.peak_activation_bytes) < max(base.peak_activation_bytes)


def test_selective_recompute_sits_between_none_and_full():
    schedule = one_f_one_b(4, 8)
    runs = {mode: simulate(schedule, CostModel(activation_bytes=1.0).with_recompute(mode))
            for mode in ("none", "selective", "full")}
    makespans = [runs[mode].makespan for mode in ("none", "selective", "full")]
    memory = [max(runs[mode].peak_activation_bytes) for mode in ("none", "selective", "full")]
    assert makespans == sorted(makespans) and len(set(makespans)) == 3
    assert memory == sorted(memory, reverse=True) and len(set(memory)) == 3


def test_with_recompute_follows_per_stage_costs_and_keeps_the_split_invariant():
    costs = CostModel(forward=(1, 2), backward=4, backward_weight=(1, 3), overlap=5)
    recomputed = costs.with_recompute("selective", compute_fraction=0.5, memory_fraction=0.25)
    assert recomputed.backward == (4.5, 5.0)
    assert recomputed.backward_input == (3.5, 2.0)
    assert recomputed.backward_weight == (1.0, 3.0)
    assert recomputed.weight_recompute == 0.0  # the attention core holds no weight
    assert recomputed.overlap == (5.5, 6.0)
    assert recomputed.activation_bytes == 0.25  # None read as 1: memory is now reported
    assert CostModel(activation_bytes=(2, 4)).with_recompute(
        "full", memory_fraction=0.5).activation_bytes == (1.0, 2.0)
    assert costs.with_recompute("none") is costs
    # recompute then split into stages == split into stages then recompute
    assert CostModel(forward=2, activation_bytes=1).with_recompute("full").scaled(0.5) == \
        CostModel(forward=2, activation_bytes=1).scaled(0.5).with_recompute("full")


@pytest.mark.parametrize("name,vpp", [("1f1b", 1), ("zb-v", 2), ("interleaved", 2),
                                      ("combined-1f1b", 2)])
def test_costs_fitted_from_a_timeline_give_back_its_costs_and_bubble(name, vpp):
    schedule = build(name, 4, 8, stages_per_rank=vpp)
    costs = CostModel(forward=tuple(1.0 + 0.1 * s for s in range(schedule.num_stages)),
                      backward_input=0.7, backward_weight=0.5)
    simulation = simulate(schedule, costs)
    fitted = fit_costs(simulation.timeline, schedule.num_stages)
    assert fitted.forward == pytest.approx(costs.forward)
    assert fitted.backward == pytest.approx((1.2,) * schedule.num_stages)
    assert simulate(schedule, fitted).bubble_ratio == pytest.approx(simulation.bubble_ratio)


def test_ranks_sharing_cores_split_them_and_lose_no_work():
    schedule = build("1f1b", 4, 8)
    costs = CostModel(forward=1.0, backward=2.0)
    alone = simulate(schedule, costs)
    work = 4 * 8 * 3.0
    assert simulate(schedule, costs, cores=1).makespan == pytest.approx(work, rel=1e-6)
    assert simulate(schedule, costs, cores=1, replicas=2).makespan == pytest.approx(
        2 * work, rel=1e-6)
    two = simulate(schedule, costs, cores=2).makespan
    assert work / 2 <= two < work and two > alone.makespan
    assert simulate(schedule, costs, cores=4).makespan == alone.makespan
    replicas = simulate(build("none", 1, 4), costs, cores=2, replicas=4)
    assert replicas.makespan == pytest.approx(2 * 12.0, rel=1e-6)


def test_mean_speeds_follow_the_intervals_open_at_once():
    starts, ends = np.array([0.0, 1.0, 5.0]), np.array([2.0, 3.0, 6.0])
    # [0, 1] alone, [1, 2] shared by two on one core, [2, 3] alone again.
    assert mean_speeds(starts, ends, cores=1) == pytest.approx([0.75, 0.75, 1.0])
    assert mean_speeds(starts, ends, cores=1, replicas=2) == pytest.approx(
        [0.375, 0.375, 0.5])
    assert mean_speeds(starts, ends, cores=2) == pytest.approx([1.0, 1.0, 1.0])


def test_a_message_costs_the_producers_end_to_the_waiting_consumers_start():
    records = [(0, "0F0", 0.0, 1.0), (0, "0F1", 1.0, 2.0), (0, "0B0", 4.5, 5.5),
               (1, "1F0", 1.25, 2.25), (1, "1F1", 2.25, 3.25),  # 1F1 did not wait: left out
               (1, "1B0", 3.25, 4.25)]
    timeline = Timeline.from_records(records, num_ranks=2)
    assert fit_message_seconds(timeline) == pytest.approx(0.25)
    assert fit_message_seconds(Timeline.from_records(records[:2], num_ranks=1)) is None
