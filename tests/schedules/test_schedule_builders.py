"""Schedule builders and placements: pinned orders, the registry, and rejected inputs."""

import types

import pytest

from meshpipe.schedules import (SCHEDULES, CostModel, Kind, Schedule, build, combined_1f1b,
                                dualpipe_v,
                                gpipe, interleaved_1f1b, loop_placement, no_pipelining,
                                one_f_one_b, resolve_placement, simulate, v_placement,
                                validate, wraparound_placement, zb_h1, zb_v)
from meshpipe.schedules.interleaved import virtual_microbatch_table


def _rows(schedule: Schedule) -> list[str]:
    return [" ".join(str(a) for a in actions) for actions in schedule.ranks]


# --- placement -------------------------------------------------------------------------

def test_named_placements():
    assert loop_placement(3) == (0, 1, 2)
    assert loop_placement(3, 2) == (0, 1, 2, 0, 1, 2)
    assert v_placement(3) == (0, 1, 2, 2, 1, 0)
    assert wraparound_placement(3) == (0, 1, 2, 0)
    assert resolve_placement(None, 2, 2) == (0, 1, 0, 1)
    assert resolve_placement("v", 2) == (0, 1, 1, 0)
    assert resolve_placement("wraparound", 2) == (0, 1, 0)
    assert resolve_placement([1, 0, 1], 2) == (1, 0, 1)


@pytest.mark.parametrize("placement, num_ranks, match", [
    ((0, 2), 2, r"placement\[1\] = 2 is not a rank"),
    ((0, 0), 2, r"leaves ranks \[1\] without a stage"),
    ((), 1, "empty"),
    ("diagonal", 2, "unknown placement 'diagonal'"),
])
def test_bad_placements_are_rejected(placement, num_ranks, match):
    with pytest.raises(ValueError, match=match):
        resolve_placement(placement, num_ranks)


def test_an_explicit_placement_sets_the_stages_per_rank():
    assert resolve_placement((0, 1, 0, 1), 2, 2) == (0, 1, 0, 1)
    assert resolve_placement((0, 1, 0), 2, 2) == (0, 1, 0)  # ragged: at most 2 on a rank
    with pytest.raises(ValueError, match=r"placement \(0, 1\) holds up to 1 stages per rank, "
                                         r"but stages_per_rank=3"):
        resolve_placement((0, 1), 2, 3)
    with pytest.raises(ValueError, match=r"placement \(0, 1\) holds up to 1 stages per rank, "
                                         r"but stages_per_rank=3"):
        build("gpipe", 2, 4, stages_per_rank=3, placement=(0, 1))
    with pytest.raises(ValueError, match=r"holds up to 2 stages per rank, but stages_per_rank=3"):
        build("1f1b", 2, 4, stages_per_rank=3, placement=[0, 1, 1, 0])


def test_placement_sizes_are_checked():
    with pytest.raises(ValueError, match="num_ranks must be >= 1"):
        loop_placement(0)
    with pytest.raises(TypeError, match="num_ranks must be an int"):
        v_placement(2.0)
    with pytest.raises(ValueError, match="V placement holds 2 stages per rank"):
        resolve_placement("v", 2, 3)
    with pytest.raises(ValueError, match="wrap-around placement"):
        resolve_placement("wraparound", 2, 2)


# --- closed-form orders ----------------------------------------------------------------

def test_no_pipelining_accumulates_gradients_one_microbatch_at_a_time():
    assert _rows(no_pipelining(3)) == ["0F0 0B0 0F1 0B1 0F2 0B2"]
    assert _rows(no_pipelining(3, forward_only=True)) == ["0F0 0F1 0F2"]


def test_gpipe_and_1f1b_orders():
    assert _rows(gpipe(2, 3)) == ["0F0 0F1 0F2 0B0 0B1 0B2", "1F0 1F1 1F2 1B0 1B1 1B2"]
    assert _rows(one_f_one_b(3, 4)) == [
        "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3",
        "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3",
        "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3",
    ]
    assert _rows(one_f_one_b(3, 1)) == ["0F0 0B0", "1F0 1B0", "2F0 2B0"]
    assert _rows(one_f_one_b(2, 2, forward_only=True)) == ["0F0 0F1", "1F0 1F1"]


def test_1f1b_follows_stages_on_a_permuted_placement():
    schedule = one_f_one_b(2, 2, placement=(1, 0))
    assert schedule.placement == (1, 0)
    assert _rows(schedule) == ["1F0 1B0 1F1 1B1", "0F0 0F1 0B0 0B1"]


# --- interleaved 1F1B: the exact Megatron-Core order -----------------------------------

def test_megatron_schedule_table():
    # Megatron-Core's own example: PP2, N=3 microbatches per group, M=5, VP2.
    table = virtual_microbatch_table(5, 2, 3)
    assert [m for m, _ in table] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
    assert [c for _, c in table] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]


def test_interleaved_order_hand_checked():
    # p=2, v=2, m=4, N=2. Rank 0 warms up 2*(2-0-1) + (2-1)*2 = 4 forwards, rank 1 2.
    # Chunk of virtual microbatch k is (k mod 4) div 2; backwards use the mirrored chunk.
    assert _rows(interleaved_1f1b(2, 4, 2)) == [
        "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3",
        "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3",
    ]


@pytest.mark.parametrize("p, m, v, group", [(4, 8, 2, None), (4, 12, 3, None), (2, 5, 2, 3),
                                             (3, 7, 2, 4), (1, 3, 4, None)])
def test_interleaved_warmup_counts(p, m, v, group):
    schedule = interleaved_1f1b(p, m, v, microbatch_group_size=group)
    n = p if group is None else group
    for rank, actions in enumerate(schedule.ranks):
        leading_forwards = next(i for i, a in enumerate(actions) if a.kind is Kind.B)
        expected = min(v * m, 2 * (p - rank - 1) + (v - 1) * n)
        # a warmup that covers every forward leaves no steady forward behind it
        assert leading_forwards == (v * m if expected == v * m else expected + 1)


def test_interleaved_matches_torch_pipelining_when_m_is_a_multiple_of_p():
    # torch.distributed.pipelining's ScheduleInterleaved1F1B implements the same order
    # (rounds of p microbatches, warmup 2(p-r-1) + (v-1)p); compare compute orders.
    from torch.distributed.pipelining import schedules as torch_schedules

    for p, m, v in [(2, 4, 2), (4, 8, 2), (3, 6, 3)]:
        fake = types.SimpleNamespace(pp_group_size=p, n_local_stages=v,
                                     microbatches_per_round=p, _n_microbatches=m)
        ours = interleaved_1f1b(p, m, v)
        for rank in range(p):
            theirs = torch_schedules.ScheduleInterleaved1F1B._calculate_single_rank_operations(
                fake, rank)
            assert [str(a) for a in ours.ranks[rank]] == [str(a) for a in theirs
                                                          if a is not None]


def test_interleaved_rejects_microbatch_counts_megatron_rejects():
    with pytest.raises(ValueError, match=r"use 4 or 8 microbatches, or schedule '1f1b'"):
        interleaved_1f1b(4, 6, 2)
    with pytest.raises(ValueError, match=r"use 4 microbatches"):
        interleaved_1f1b(4, 3, 2)
    with pytest.raises(ValueError, match="microbatch_group_size must be >= num_ranks"):
        interleaved_1f1b(4, 8, 2, microbatch_group_size=2)
    # a last group of 3 >= p microbatches is accepted
    validate(interleaved_1f1b(2, 7, 2, microbatch_group_size=4))


def test_interleaved_with_one_stage_per_rank_takes_any_microbatch_count():
    # Megatron's last-group rule guards chunk changes; one chunk has none to stall on.
    for p, m in [(4, 5), (4, 2), (3, 7), (5, 1)]:
        schedule = interleaved_1f1b(p, m, 1)
        validate(schedule)
        assert simulate(schedule).bubble_ratio == pytest.approx((p - 1) / (m + p - 1))
    assert build("interleaved", 4, 5, stages_per_rank=1) == interleaved_1f1b(4, 5, 1)
    with pytest.raises(ValueError, match="interleaved: microbatch_group_size applies to "
                                         "interleaved pipelining"):
        interleaved_1f1b(4, 8, 1, microbatch_group_size=4)


# --- combined 1F1B ---------------------------------------------------------------------

def test_combined_without_pipelining_pairs_each_backward_with_the_next_forward():
    assert _rows(combined_1f1b(1, 4)) == [
        "0F0 (0F1;0B0)OVERLAP_F_B (0F2;0B1)OVERLAP_F_B (0F3;0B2)OVERLAP_F_B 0B3"]


def test_combined_warms_up_one_more_forward_than_interleaved():
    for p, m, v in [(2, 4, 2), (4, 8, 2), (3, 6, 1), (1, 5, 3)]:
        combined = combined_1f1b(p, m, v)
        for rank, actions in enumerate(combined.ranks):
            first_overlap = next((i for i, a in enumerate(actions) if a.kind is Kind.OVERLAP),
                                 None)
            if first_overlap is not None:
                assert first_overlap == 2 * (p - rank - 1) + (v - 1) * p + 1
                for action in actions:
                    if action.kind is Kind.OVERLAP:
                        forward, backward = action.parts
                        assert (forward.stage, forward.microbatch) != (backward.stage,
                                                                       backward.microbatch)
        validate(combined)


def test_combined_rejects_a_group_size_without_virtual_stages():
    with pytest.raises(ValueError, match="applies to interleaved"):
        combined_1f1b(2, 4, microbatch_group_size=2)


# --- zero bubble: ZB-H1, ZB-V, DualPipeV -----------------------------------------------

def test_zb_h1_defers_weight_gradients_by_rank():
    assert _rows(zb_h1(3, 4)) == [
        "0F0 0F1 0F2 0I0 0W0 0F3 0I1 0W1 0I2 0W2 0I3 0W3",
        "1F0 1F1 1I0 1F2 1I1 1W0 1F3 1I2 1W1 1I3 1W2 1W3",
        "2F0 2I0 2F1 2I1 2F2 2I2 2W0 2F3 2I3 2W1 2W2 2W3",
    ]


@pytest.mark.parametrize("p, m", [(2, 4), (3, 7), (4, 8), (2, 3), (3, 2)])
def test_zero_bubble_orders_match_torch_pipelining(p, m):
    from torch.distributed.pipelining import schedules as torch_schedules

    v_fake = types.SimpleNamespace(pp_group_size=p, num_stages=2 * p, _n_microbatches=m)
    # with one stage per rank, torch's interleaved zero-bubble order is ZB-H1
    h1_fake = types.SimpleNamespace(pp_group_size=p, n_local_stages=1,
                                    microbatches_per_round=p, _n_microbatches=m)
    pairs = [(zb_v(p, m), torch_schedules.ScheduleZBVZeroBubble, v_fake),
             (zb_h1(p, m), torch_schedules.ScheduleInterleavedZeroBubble, h1_fake)]
    torch_dualpipe_v = getattr(torch_schedules, "ScheduleDualPipeV", None)  # torch >= 2.9
    if m >= 2 * p and torch_dualpipe_v is not None:
        pairs.append((dualpipe_v(p, m), torch_dualpipe_v, v_fake))
    for ours, cls, fake in pairs:
        for rank in range(p):
            theirs = cls._calculate_single_rank_operations(fake, rank)
            assert _rows(ours)[rank].split() == [str(a) for a in theirs if a is not None], (
                ours.name, rank)


def test_dualpipe_v_needs_two_microbatches_per_stage_pair():
    with pytest.raises(ValueError, match=r"num_microbatches >= 2 \* num_ranks \(= 8\).*'zb-v'"):
        dualpipe_v(4, 7)


def test_v_shaped_schedules_use_the_v_placement():
    assert zb_v(3, 6).placement == v_placement(3)
    assert dualpipe_v(3, 6).placement == v_placement(3)


# --- several stages per rank: the list scheduler ---------------------------------------

@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("placement", ["wraparound", "loop", "v", (0, 0, 1, 1), (1, 0, 0)])
def test_gpipe_and_1f1b_run_on_placements_with_several_stages_per_rank(name, placement):
    per_rank = 2 if placement in ("loop", "v") else 1
    schedule = build(name, 2, 5, stages_per_rank=per_rank, placement=placement)
    validate(schedule)
    if placement == "wraparound":
        assert schedule.stages_of(0) == (0, 2)
    if name == "gpipe":  # a rank starts backwards only after all its forwards
        for actions in schedule.ranks:
            kinds = [a.kind for a in actions]
            assert kinds == sorted(kinds, key=lambda k: k is Kind.B)


def test_gpipe_runs_several_stages_per_rank_breadth_first():
    """All microbatches through a stage before the rank's next stage (backwards in reverse):
    at pp 8, 9 microbatches, 4 stages per rank the bubble is the breadth-first 16.3 %, not
    the 43.8 % of a depth-first order."""
    schedule = build("gpipe", 8, 9, stages_per_rank=4)
    for rank, actions in enumerate(schedule.ranks):
        stages = schedule.stages_of(rank)
        assert [a.stage for a in actions] == [s for s in stages for _ in range(9)] + [
            s for s in reversed(stages) for _ in range(9)]
    simulation = simulate(schedule, CostModel())
    assert simulation.bubble_ratio <= 0.163
    assert simulation.bubble_ratio == pytest.approx(0.1628, abs=1e-3)


def test_1f1b_keeps_the_in_flight_limit_on_several_stages_per_rank():
    schedule = one_f_one_b(3, 12, placement=wraparound_placement(3))
    num_stages = schedule.num_stages
    for actions in schedule.ranks:
        live = {}
        for action in actions:
            live.setdefault(action.stage, 0)
            live[action.stage] += 1 if action.kind is Kind.F else -1
            assert live[action.stage] <= num_stages - action.stage


# --- the registry ----------------------------------------------------------------------

def test_registry_builds_every_schedule_by_name():
    assert SCHEDULES == ("none", "gpipe", "1f1b", "interleaved", "zb-h1", "zb-v",
                         "dualpipe-v", "combined-1f1b")
    for name in SCHEDULES:
        p = 1 if name == "none" else 2
        schedule = build(name, p, 4, stages_per_rank=2 if name == "interleaved" else 1)
        assert schedule.name == name
        validate(schedule)
    assert build("combined-1f1b", 2, 4, stages_per_rank=2) == combined_1f1b(2, 4, 2)
    assert build("interleaved", 2, 4, stages_per_rank=2, placement="loop").num_stages == 4


@pytest.mark.parametrize("call, match", [
    (lambda: build("pipedream", 2, 4), "unknown schedule 'pipedream'; choose one of none"),
    (lambda: build("none", 2, 4), "runs on 1 rank.*'1f1b'"),
    (lambda: build("zb-h1", 2, 4, stages_per_rank=2), "one stage per rank.*'interleaved'"),
    (lambda: build("zb-v", 2, 4, placement="loop"), "runs on the v placement"),
    (lambda: build("interleaved", 2, 4, stages_per_rank=2, placement="v"),
     "runs on the loop placement"),
    (lambda: build("dualpipe-v", 2, 4, stages_per_rank=3), "2 stages per rank"),
    (lambda: build("1f1b", 2, 0), "num_microbatches must be >= 1"),
])
def test_registry_rejects_inputs_outside_the_constraints(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_sizes_must_be_integers():
    with pytest.raises(TypeError, match="num_microbatches must be an int"):
        gpipe(2, 4.0)
    with pytest.raises(TypeError, match="num_ranks must be an int"):
        zb_h1(True, 4)
