"""Lowering (SEND/RECV insertion) and validation: pinned shapes and located errors."""

import pytest

from meshpipe.schedules import (Action, Kind, Schedule, ScheduleError, gpipe, interleaved_1f1b,
                                lower, one_f_one_b, validate, wraparound_placement, zb_v)
from meshpipe.schedules.actions import B, F


def _rows(schedule: Schedule) -> list[str]:
    return [" ".join(str(a) for a in actions) for actions in schedule.ranks]


def _schedule(*rows: str) -> Schedule:
    return Schedule.from_csv("\n".join(",".join(row.split()) for row in rows) + "\n")


# --- lowering --------------------------------------------------------------------------

def test_lowered_1f1b_shape():
    # sends right after their compute; each receive one compute action ahead of its consumer
    assert _rows(lower(one_f_one_b(2, 2))) == [
        "0F0 0SEND_F0 0RECV_B0 0F1 0SEND_F1 0RECV_B1 0B0 0B1",
        "1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 1F1 1B1 1SEND_B1",
    ]
    assert _rows(lower(one_f_one_b(2, 2), lookahead=0)) == [
        "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
        "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1",
    ]


def test_stages_on_one_rank_hand_over_locally():
    lowered = lower(gpipe(2, 2, placement=(0, 0, 1)))
    messages = [a for a in lowered.actions() if a.kind.is_comm]
    assert all(a.stage in (1, 2) for a in messages)  # none between stages 0 and 1
    assert sorted(str(a) for a in messages) == sorted(
        ["1SEND_F0", "1SEND_F1", "2RECV_F0", "2RECV_F1", "2SEND_B0", "2SEND_B1",
         "1RECV_B0", "1RECV_B1"])
    validate(lowered)


def test_wraparound_sends_from_the_last_rank_back_to_the_first():
    lowered = lower(one_f_one_b(3, 2, placement=wraparound_placement(3)))
    assert "3RECV_F0" in _rows(lowered)[0].split()
    assert "2SEND_F0" in _rows(lowered)[2].split()
    assert "3SEND_B0" in _rows(lowered)[0].split()
    validate(lowered)


def test_overlap_sends_both_halves_in_part_order():
    schedule = Schedule(2, 2, 2, (0, 1), (
        (F(0, 0), F(0, 1), B(0, 0), B(0, 1)),
        (F(1, 0), Action.overlap(F(1, 1), B(1, 0)), B(1, 1)),
    ))
    rank1 = _rows(lower(schedule))[1].split()
    overlap = rank1.index("(1F1;1B0)OVERLAP_F_B")
    assert rank1[overlap + 1] == "1SEND_B0"  # the last stage sends no forward


def test_receives_follow_the_send_order_of_each_peer():
    # ZB-V's rank 0 sends its down-stage output and its up-stage gradient to rank 1,
    # which consumes them in another order: receives are hoisted to keep send order.
    lowered = lower(zb_v(2, 4))
    validate(lowered)
    sent = [a for a in lowered.ranks[0] if a.kind in (Kind.SEND_F, Kind.SEND_B)]
    received = [a for a in lowered.ranks[1] if a.kind in (Kind.RECV_F, Kind.RECV_B)]
    as_message = {Kind.SEND_F: lambda a: ("F", a.stage, a.microbatch),
                  Kind.SEND_B: lambda a: ("B", a.stage, a.microbatch),
                  Kind.RECV_F: lambda a: ("F", a.stage - 1, a.microbatch),
                  Kind.RECV_B: lambda a: ("B", a.stage + 1, a.microbatch)}
    assert [as_message[a.kind](a) for a in sent] == [as_message[a.kind](a) for a in received]


def test_lowering_rejects_lowered_and_incomplete_schedules():
    lowered = lower(one_f_one_b(2, 2))
    with pytest.raises(ValueError, match="already lowered"):
        lower(lowered)
    with pytest.raises(ScheduleError, match="stage 1 microbatch 1 has no forward"):
        lower(_schedule("0F0 0F1 0B0 0B1", "1F0 1B0 1B1"))
    with pytest.raises(ValueError, match="lookahead must be >= 0"):
        lower(one_f_one_b(2, 2), lookahead=-1)


# --- validation: located errors ---------------------------------------------------------

def _error(schedule: Schedule) -> ScheduleError:
    with pytest.raises(ScheduleError) as info:
        validate(schedule)
    assert isinstance(info.value, ValueError)
    return info.value


def test_cross_rank_deadlock_is_located():
    error = _error(_schedule("0F0 0B0 0F1 0B1", "1F1 1B1 1F0 1B0"))
    assert str(error) == ("deadlock: rank 0 #1 0B0 waits for 1B0 (rank 1 is blocked at #0 1F1 "
                          "waiting for 0F1)")
    assert (error.rank, error.index, error.action, error.waiting_for) == (0, 1, B(0, 0), "1B0")


def test_hand_written_lowered_deadlock_is_located():
    schedule = _schedule("0F0 0SEND_F0 0RECV_B0 0B0 0F1 0SEND_F1 0RECV_B1 0B1",
                         "1RECV_F0 1RECV_F1 1F0 1F1 1B0 1SEND_B0 1B1 1SEND_B1")
    error = _error(schedule)
    assert str(error) == ("deadlock: rank 0 #3 0B0 waits for 1SEND_B0 (rank 1 is blocked at #3 "
                          "1F1 waiting for 0SEND_F1)")
    assert (error.rank, error.index, error.waiting_for) == (0, 3, "1SEND_B0")


def test_three_rank_deadlock_names_the_whole_cycle():
    # ring of waits: rank 0 backward waits on rank 1, rank 1 on rank 2, rank 2 on rank 0
    error = _error(_schedule("0F0 0B0 0F1 0B1", "1F0 1B0 1F1 1B1", "2F1 2B1 2F0 2B0"))
    assert str(error).startswith("deadlock: rank 0 #1 0B0 waits for 1B0 (rank 1 is blocked at "
                                 "#1 1B0 waiting for 2B0; rank 2 is blocked at #0 2F1 waiting "
                                 "for 1F1)")


@pytest.mark.parametrize("rows, match, where", [
    (("0F0 0B0 0F1 0B1", "1F0 1B0 1F0 1B1"),
     r"rank 1 #2 1F0: stage 1 microbatch 0 already has 1F0 at #0", (1, 2)),
    (("0F0 0B0 0F1", "1F0 1B0 1F1 1B1"), r"stage 0 microbatch 1 has no backward", (0, None)),
    (("0F0 0B0 0I0", "1F0 1B0"), "has both a full backward B and a split one", (0, None)),
    (("0F0 0I0", "1F0 1B0"), r"has I without 0W0", (0, None)),
    (("0F0 0B0", "1F0 1W0 1I0"), r"rank 1 #1 1W0 needs 1I0, which rank 1 only runs later, "
                                 r"at #2", (1, 1)),
    (("0B0 0F0", "1F0 1B0"), r"rank 0 #0 0B0 needs 0F0, which rank 0 only runs later", (0, 0)),
])
def test_work_and_order_errors_are_located(rows, match, where):
    error = _error(_schedule(*rows))
    assert (error.rank, error.index) == where
    assert error.args[0] == str(error)
    with pytest.raises(ScheduleError, match=match):
        validate(_schedule(*rows))


def test_an_overlap_may_not_pair_a_forward_with_its_own_backward():
    schedule = Schedule(1, 1, 1, (0,), ((Action.overlap(F(0, 0), B(0, 0)),),))
    error = _error(schedule)
    assert "needs 0F0, which this same OVERLAP computes" in str(error)
    assert (error.rank, error.index, error.waiting_for) == (0, 0, "0F0")


def test_stage_order_on_one_rank_is_checked():
    schedule = Schedule(1, 2, 1, (0, 0), ((F(1, 0), F(0, 0), B(1, 0), B(0, 0)),))
    assert "rank 0 #0 1F0 needs 0F0, which rank 0 only runs later, at #1" in str(
        _error(schedule))


@pytest.mark.parametrize("rows, match", [
    (("0F0 0SEND_F0 0RECV_B0 0B0", "1F0 1B0 1SEND_B0"), r"rank 1 has no 1RECV_F0"),
    (("0F0 0SEND_F0 0SEND_F0 0RECV_B0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"),
     r"rank 0 #2 0SEND_F0: the output of 0F0 is already sent at #1"),
    (("0F0 0SEND_F0 0RECV_B0 0B0", "1RECV_F0 1F0 1SEND_F0 1B0 1SEND_B0"),
     r"rank 1 #2 1SEND_F0: no stage 1 -> 2 edge exists"),
    (("0F0 0SEND_F0", "1RECV_F0 1F0 1SEND_B0"), "forward-only schedule has no gradients"),
    (("0F0 0SEND_F0 0F1 0SEND_F1", "1RECV_F1 1RECV_F0 1F0 1F1"),
     r"rank 0 -> rank 1: message 0 is 0SEND_F0 \(rank 0 #1\) but rank 1's receive 0 is "
     r"1RECV_F1 \(#0\)"),
    (("0SEND_F0 0F0", "1RECV_F0 1F0"), r"rank 0 #0 0SEND_F0 needs 0F0, which rank 0 only runs "
                                       r"later, at #1"),
    (("0F0 0SEND_F0", "1F0 1RECV_F0"), r"rank 1 #0 1F0 needs 1RECV_F0, but the receive is "
                                       r"posted later, at #1"),
])
def test_message_errors_are_located(rows, match):
    with pytest.raises(ScheduleError, match=match):
        validate(_schedule(*rows))


def test_local_handover_takes_no_message():
    schedule = Schedule(2, 3, 1, (0, 0, 1), (
        (F(0, 0), F(1, 0), Action(Kind.SEND_F, 0, 0)), (F(2, 0),)))
    with pytest.raises(ScheduleError, match="stages 0 and 1 are both on rank 0 and hand over "
                                            "locally"):
        validate(schedule)


def test_valid_schedules_pass_lowered_and_not():
    for schedule in (one_f_one_b(4, 8), interleaved_1f1b(2, 4, 2), zb_v(3, 6),
                     gpipe(3, 4, placement=wraparound_placement(3))):
        validate(schedule)
        validate(lower(schedule))
        validate(lower(schedule, lookahead=3))

