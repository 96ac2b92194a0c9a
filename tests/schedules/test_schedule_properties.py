"""Properties of every builder over pp 1..16, vpp 1..4, microbatches 1..64 (hypothesis), and
the simulated bubbles and memory the builders' docstrings state."""

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshpipe.schedules import (SCHEDULES, Kind, Schedule, ScheduleError, build, combined_1f1b,
                                dualpipe_v, gpipe, interleaved_1f1b, lower, one_f_one_b,
                                validate, zb_h1, zb_v)
from meshpipe.schedules import CostModel, simulate

RANKS = st.integers(1, 16)
MICROBATCHES = st.integers(1, 64)


@st.composite
def _virtual_sizes(draw: st.DrawFn) -> tuple[int, int, int]:
    """Interleaved (and combined) with the default group size p: any m with one stage per
    rank, a multiple of p with several."""
    p, v = draw(RANKS), draw(st.integers(1, 4))
    m = draw(MICROBATCHES) if v == 1 else p * draw(st.integers(1, 64 // p))
    return p, v, m


@st.composite
def _dualpipe_sizes(draw: st.DrawFn) -> tuple[int, int, int]:
    p = draw(RANKS)
    return p, 2, draw(st.integers(2 * p, 64))


# Sizes (p, v, m) within each schedule's documented constraints, written independently of
# the builders, so that every example builds a schedule.
SIZES_WITHIN = {
    "none": st.tuples(st.just(1), st.just(1), MICROBATCHES),
    "gpipe": st.tuples(RANKS, st.integers(1, 4), MICROBATCHES),
    "1f1b": st.tuples(RANKS, st.integers(1, 4), MICROBATCHES),
    "interleaved": _virtual_sizes(),
    "zb-h1": st.tuples(RANKS, st.just(1), MICROBATCHES),
    "zb-v": st.tuples(RANKS, st.just(2), MICROBATCHES),
    "dualpipe-v": _dualpipe_sizes(),
    "combined-1f1b": _virtual_sizes(),
}


@st.composite
def _not_a_multiple_of_p(draw: st.DrawFn) -> tuple[int, int, int]:
    p = draw(st.integers(2, 16))
    m = p * draw(st.integers(0, 64 // p - 1)) + draw(st.integers(1, p - 1))
    return p, draw(st.integers(2, 4)), m


@st.composite
def _too_few_for_dualpipe(draw: st.DrawFn) -> tuple[int, int, int]:
    p = draw(RANKS)
    return p, 2, draw(st.integers(1, 2 * p - 1))


# Sizes outside each schedule's constraints: a count below 1 for every schedule, and the
# schedule's own limits.
_ZERO_COUNT = st.one_of(st.tuples(st.just(0), st.integers(1, 4), MICROBATCHES),
                        st.tuples(RANKS, st.just(0), MICROBATCHES),
                        st.tuples(RANKS, st.integers(1, 4), st.just(0)))
SIZES_OUTSIDE = {
    "none": st.one_of(_ZERO_COUNT, st.tuples(st.integers(2, 16), st.integers(1, 4), MICROBATCHES),
                      st.tuples(st.just(1), st.integers(2, 4), MICROBATCHES)),
    "gpipe": _ZERO_COUNT,
    "1f1b": _ZERO_COUNT,
    "interleaved": st.one_of(_ZERO_COUNT, _not_a_multiple_of_p()),
    "zb-h1": st.one_of(_ZERO_COUNT, st.tuples(RANKS, st.integers(2, 4), MICROBATCHES)),
    "zb-v": st.one_of(_ZERO_COUNT, st.tuples(RANKS, st.integers(3, 4), MICROBATCHES)),
    "dualpipe-v": st.one_of(_ZERO_COUNT, _too_few_for_dualpipe(),
                            st.tuples(RANKS, st.integers(3, 4), MICROBATCHES)),
    "combined-1f1b": st.one_of(_ZERO_COUNT, _not_a_multiple_of_p()),
}


def _assert_one_of_each(schedule: Schedule, forward_only: bool) -> None:
    counts = Counter((part.kind, part.stage, part.microbatch)
                     for action in schedule.actions() if action.kind.is_compute
                     for part in action.computations)
    assert all(n == 1 for n in counts.values())
    for stage in range(schedule.num_stages):
        for m in range(schedule.num_microbatches):
            assert counts[(Kind.F, stage, m)] == 1
            full, split = counts[(Kind.B, stage, m)], counts[(Kind.I, stage, m)]
            assert split == counts[(Kind.W, stage, m)]
            assert full + split == (0 if forward_only else 1)


def _assert_receives_as_early_as_documented(compute_only: Schedule, lowered: Schedule,
                                            lookahead: int) -> None:
    """Each receive precedes compute action max(0, c - lookahead), c its consumer's index,
    moved up to the receive of any later message from the same peer."""
    for rank, actions in enumerate(lowered.ranks):
        compute_index = 0
        slot_of = {}
        for action in actions:
            if action.kind.is_compute:
                compute_index += 1
            elif action.kind in (Kind.RECV_F, Kind.RECV_B):
                slot_of[action] = compute_index
        consumer = {}
        for index, action in enumerate(compute_only.ranks[rank]):
            for part in action.computations:
                if part.kind is not Kind.W:
                    kind = Kind.RECV_F if part.kind is Kind.F else Kind.RECV_B
                    consumer[(kind, part.stage, part.microbatch)] = index
        by_peer = {}
        for receive in slot_of:
            by_peer.setdefault(lowered.placement[receive.peer], []).append(receive)
        for peer, receives in by_peer.items():
            sends = [a for a in lowered.ranks[peer]
                     if a.kind in (Kind.SEND_F, Kind.SEND_B) and lowered.placement[a.peer] == rank]
            in_send_order = [next(r for r in receives if r.peer == s.stage
                                  and r.microbatch == s.microbatch
                                  and (r.kind is Kind.RECV_F) == (s.kind is Kind.SEND_F))
                             for s in sends]
            earliest_later = None
            for receive in reversed(in_send_order):
                own = max(0, consumer[(receive.kind, receive.stage, receive.microbatch)]
                          - lookahead)
                earliest_later = own if earliest_later is None else min(own, earliest_later)
                assert slot_of[receive] == earliest_later


@pytest.mark.parametrize("name", SCHEDULES)
@settings(max_examples=15, deadline=None)
@given(data=st.data(), forward_only=st.booleans())
def test_every_schedule_is_complete_valid_and_simulates(name, data, forward_only):
    p, v, m = data.draw(SIZES_WITHIN[name], label="(num_ranks, stages_per_rank, microbatches)")
    schedule = build(name, p, m, stages_per_rank=v, forward_only=forward_only)
    assert (schedule.num_ranks, schedule.num_microbatches) == (p, m)
    assert schedule.stages_per_rank == v
    assert schedule.forward_only == forward_only
    _assert_one_of_each(schedule, forward_only)
    validate(schedule)
    lowered = lower(schedule)
    validate(lowered)
    assert [[a for a in actions if a.kind.is_compute] for actions in lowered.ranks] == [
        list(actions) for actions in schedule.ranks]
    _assert_receives_as_early_as_documented(schedule, lowered, lookahead=1)
    simulate(lowered)
    assert simulate(schedule).makespan > 0
    for each in (schedule, lowered):
        assert Schedule.from_csv(each.to_csv()) == each


@pytest.mark.parametrize("name", SCHEDULES)
@settings(max_examples=10, deadline=None)
@given(data=st.data(), forward_only=st.booleans())
def test_sizes_outside_a_schedules_constraints_are_a_value_error(name, data, forward_only):
    p, v, m = data.draw(SIZES_OUTSIDE[name], label="(num_ranks, stages_per_rank, microbatches)")
    with pytest.raises(ValueError) as error:
        build(name, p, m, stages_per_rank=v, forward_only=forward_only)
    assert not isinstance(error.value, ScheduleError)  # the builder's check, not a bad schedule


@settings(max_examples=15, deadline=None)
@given(placement=st.lists(st.integers(0, 3), min_size=1, max_size=10),
       num_microbatches=st.integers(1, 12), lookahead=st.integers(0, 3),
       name=st.sampled_from(["gpipe", "1f1b"]), forward_only=st.booleans())
def test_gpipe_and_1f1b_accept_any_placement(placement, num_microbatches, lookahead, name,
                                             forward_only):
    num_ranks = max(placement) + 1
    if set(placement) != set(range(num_ranks)):
        with pytest.raises(ValueError, match="without a stage"):
            build(name, num_ranks, num_microbatches, placement=placement)
        return
    schedule = build(name, num_ranks, num_microbatches, placement=placement,
                     forward_only=forward_only)
    _assert_one_of_each(schedule, forward_only)
    lowered = lower(schedule, lookahead=lookahead)
    validate(lowered)
    _assert_receives_as_early_as_documented(schedule, lowered, lookahead)
    simulate(lowered)


# --- simulated bubbles against the closed forms (free communication) --------------------

F_EQUALS_B = dict(forward=1.0, backward=1.0)  # B = F
F_I_W = dict()  # F = I = W = 1, so B = 2F


@pytest.mark.parametrize("costs", [F_EQUALS_B, F_I_W], ids=["B=F", "B=2F"])
@settings(max_examples=15, deadline=None)
@given(p=st.integers(1, 8), m=st.integers(1, 32))
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(costs, p, m):
    for builder in (gpipe, one_f_one_b):
        result = simulate(builder(p, m), CostModel(**costs))
        assert result.bubble_ratio == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("backward_factor", [1, 2], ids=["B=F", "B=2F"])
@settings(max_examples=15, deadline=None)
@given(p=st.integers(1, 8), v=st.integers(1, 4), rounds=st.integers(1, 6))
def test_interleaved_bubble_is_p_minus_1_over_vm_plus_p_minus_1(backward_factor, p, v, rounds):
    m = rounds * p
    costs = CostModel(forward=1 / v, backward=backward_factor / v)  # a chunk is 1/v of a stage
    closed_form = (p - 1) / (v * m + p - 1)
    assert simulate(interleaved_1f1b(p, m, v), costs).bubble_ratio == pytest.approx(closed_form)
    # combined 1F1B keeps the bubble of the order it pairs, when an OVERLAP costs F + B
    assert simulate(combined_1f1b(p, m, v), costs).bubble_ratio == pytest.approx(closed_form)


@settings(max_examples=15, deadline=None)
@given(p=st.integers(1, 8), m=st.integers(1, 32))
def test_combined_without_virtual_stages_keeps_the_1f1b_bubble(p, m):
    assert simulate(combined_1f1b(p, m)).bubble_ratio == pytest.approx((p - 1) / (m + p - 1))


@settings(max_examples=15, deadline=None)
@given(p=st.integers(1, 8), m=st.integers(1, 32))
def test_zb_h1_bubble_is_a_third_of_1f1b(p, m):
    work = 3 * m  # F + I + W per microbatch on every rank
    zb = simulate(zb_h1(p, m))
    if m >= p:
        baseline = simulate(one_f_one_b(p, m))
        assert zb.makespan - work == pytest.approx((baseline.makespan - work) / 3)
        assert zb.makespan == 3 * m + p - 1
    else:  # too few deferred W's to fill the tail
        assert zb.makespan == 2 * m + 2 * p - 1


@settings(max_examples=15, deadline=None)
@given(p=st.integers(1, 8), extra=st.integers(0, 16))
def test_v_schedules_bubble_no_larger_than_zb_h1(p, extra):
    m = 2 * p + extra
    reference = simulate(zb_h1(p, m)).bubble_ratio
    v_shape = simulate(zb_v(p, m))
    dual = simulate(dualpipe_v(p, m))
    assert v_shape.bubble_ratio <= reference + 1e-12
    assert dual.bubble_ratio <= reference + 1e-12
    # the figures the docstrings state: ZB-V's makespan 6m + p - 1 with no gap inside any
    # rank's busy span; DualPipeV's 6m + 2(p - 1), DeepSeek's (p-1)(F&B + B - 3W)
    assert v_shape.makespan == 6 * m + p - 1
    for rank in v_shape.timeline.ranks:
        compute = [t for t in rank if t.action.kind.is_compute]
        span = max(t.end for t in compute) - min(t.start for t in compute)
        assert span == pytest.approx(sum(t.duration for t in compute))
    assert dual.makespan == 6 * m + 2 * (p - 1)


@settings(max_examples=15, deadline=None)
@given(p=st.integers(1, 12), m=st.integers(1, 40))
def test_peak_live_activations(p, m):
    assert simulate(one_f_one_b(p, m)).peak_activations == tuple(min(p - r, m)
                                                                 for r in range(p))
    assert simulate(gpipe(p, m)).peak_activations == (m,) * p
    assert simulate(zb_h1(p, m)).peak_activations == (min(p, m),) * p
    if m >= 2 * p:
        assert simulate(zb_v(p, m)).peak_activations == (2 * p,) * p
        assert simulate(dualpipe_v(p, m)).peak_activations == (2 * p + 1,) * p
