"""The action IR: text form, CSV round trip, structural checks."""

import pytest

from meshpipe.schedules.actions import Action, B, F, I, Kind, W
from meshpipe.schedules.schedule import Schedule


@pytest.mark.parametrize("text", ["0F3", "1B0", "2I1", "2W1", "0SEND_F3", "1RECV_F3",
                                  "1SEND_B0", "0RECV_B0", "12F105", "(0F3;0B1)OVERLAP_F_B",
                                  "(0F3;1B1)OVERLAP_F_B"])
def test_text_form_round_trips(text):
    assert str(Action.parse(text)) == text


def test_peer_follows_the_direction_of_the_message():
    assert Action.parse("1SEND_F3").peer == 2
    assert Action.parse("2RECV_F3").peer == 1
    assert Action.parse("2SEND_B3").peer == 1
    assert Action.parse("1RECV_B3").peer == 2
    assert F(1, 3).peer is None


def test_overlap_holds_a_forward_and_a_backward():
    action = Action.overlap(F(0, 3), B(1, 0))
    assert action.kind is Kind.OVERLAP
    assert action.computations == (F(0, 3), B(1, 0))
    with pytest.raises(ValueError, match="pairs an F with a B"):
        Action.overlap(B(0, 0), F(0, 1))


def test_overlap_built_directly_is_checked_and_stores_a_tuple():
    action = Action(Kind.OVERLAP, 0, 3, [F(0, 3), B(1, 0)])
    assert action == Action.overlap(F(0, 3), B(1, 0))
    assert isinstance(action.parts, tuple) and hash(action) == hash(Action.overlap(F(0, 3),
                                                                                    B(1, 0)))
    with pytest.raises(ValueError, match=r"OVERLAP pairs an F with a B: its parts are "
                                         r"\(forward, backward\), got \(Action\(0F0\),\)"):
        Action(Kind.OVERLAP, 0, 0, (F(0, 0),))
    with pytest.raises(ValueError, match="OVERLAP pairs an F with a B"):
        Action(Kind.OVERLAP, 0, 0, (F(0, 0), B(0, 1), B(0, 2)))
    with pytest.raises(ValueError, match="OVERLAP pairs an F with a B"):
        Action(Kind.OVERLAP, 0, 0, (F(0, 0), I(0, 1)))
    with pytest.raises(ValueError, match="OVERLAP pairs an F with a B"):
        Action(Kind.OVERLAP, 0, 0, ((Kind.F, 0, 0, ()), B(0, 1)))
    with pytest.raises(ValueError, match=r"the OVERLAP of 0F0 and 0B1 has the stage and "
                                         r"microbatch of its forward \(0, 0\), not \(5, 9\)"):
        Action(Kind.OVERLAP, 5, 9, (F(0, 0), B(0, 1)))
    with pytest.raises(ValueError, match="only an OVERLAP action has parts, not a F action"):
        Action(Kind.F, 0, 0, (F(0, 0), B(0, 1)))
    with pytest.raises(ValueError, match="OVERLAP pairs an F with a B"):
        Action(Kind.OVERLAP, 0, 0)
    with pytest.raises(TypeError, match="parts of an OVERLAP action are a sequence"):
        Action(Kind.OVERLAP, 0, 0, 7)


@pytest.mark.parametrize("bad", ["", "F3", "0X3", "0F", "-1F0", "(0F3)OVERLAP_F_B"])
def test_unparseable_text_is_rejected(bad):
    with pytest.raises(ValueError, match="cannot parse action"):
        Action.parse(bad)


def _two_rank_schedule():
    return Schedule(2, 2, 2, (0, 1), (
        (F(0, 0), F(0, 1), B(0, 0), B(0, 1)),
        (F(1, 0), B(1, 0), F(1, 1), Action.overlap(F(1, 1), B(1, 1)), W(1, 1)),
    ), name="hand")


def test_csv_round_trips_exactly():
    schedule = _two_rank_schedule()
    text = schedule.to_csv()
    assert text.splitlines()[0] == "0F0,0F1,0B0,0B1"
    assert Schedule.from_csv(text) == schedule


@pytest.mark.parametrize("cell", ["0UNSHARD", "1RESHARD", "0REDUCE_GRAD"])
def test_csv_names_torch_fsdp_and_reduce_grad_cells_as_unsupported(cell):
    with pytest.raises(ValueError, match=rf"CSV row 1 \(rank 1\): cannot parse action "
                                         rf"'{cell}': .*UNSHARD, RESHARD and REDUCE_GRAD .*"
                                         rf"compute actions .* and SEND/RECV only"):
        Schedule.from_csv(f"0F0,0B0\n1F0,{cell},1B0\n")


def test_csv_reads_torch_compute_only_rows_with_idle_slots():
    schedule = Schedule.from_csv("0F0,0F1,,0B0,,0B1\n,1F0,1B0,1F1,1B1\n")
    assert schedule.ranks[0] == (F(0, 0), F(0, 1), B(0, 0), B(0, 1))
    assert schedule.placement == (0, 1)


def test_csv_infers_placement_from_rows():
    schedule = Schedule.from_csv("0F0,3F0,3B0,0B0\n1F0,1B0\n2F0,2B0\n")
    assert schedule.placement == (0, 1, 2, 0)
    assert schedule.stages_of(0) == (0, 3)
    assert schedule.stages_per_rank == 2


def test_csv_rejects_a_stage_on_two_ranks():
    with pytest.raises(ValueError, match="stage 0 has actions on ranks 0 and 1"):
        Schedule.from_csv("0F0\n0B0\n")


def test_schedule_rejects_an_action_on_the_wrong_rank():
    with pytest.raises(ValueError, match="stage 1 is placed on rank 1"):
        Schedule(2, 2, 1, (0, 1), ((F(1, 0),), ()))


def test_derived_properties():
    schedule = _two_rank_schedule()
    assert not schedule.is_lowered
    assert not schedule.forward_only
    forward = schedule.replace_ranks([[F(0, 0)], [F(1, 0)]])
    assert forward.forward_only
    lowered = schedule.replace_ranks([[F(0, 0), Action(Kind.SEND_F, 0, 0)], [F(1, 0)]])
    assert lowered.is_lowered
