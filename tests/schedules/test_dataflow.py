"""The array form of schedules and the dataflow engine that lowers, validates and simulates
them: the same results as a plain action-by-action reference, in every range size."""

import functools
import random

import numpy as np
import pytest

from meshpipe.schedules import (SCHEDULES, Action, CostModel, Kind, Schedule, ScheduleError,
                                build, lower, simulate, validate)
from meshpipe.schedules import table as table_module
from meshpipe.schedules.actions import B, F, I, W
from meshpipe.schedules.table import ActionTable


def _every_schedule():
    for name in SCHEDULES:
        for ranks, stages_per_rank, microbatches in ((1, 1, 3), (2, 1, 5), (3, 2, 6),
                                                     (4, 2, 8), (2, 2, 4)):
            try:
                yield build(name, ranks, microbatches, stages_per_rank=stages_per_rank)
            except ValueError:
                continue


def _reference_times(schedule: Schedule, costs: CostModel):
    """Start and end of every action, found by trying each rank's next action until none
    can run: what the simulator's docstring promises, written the plain way."""
    num_stages, placement = schedule.num_stages, schedule.placement
    per = {name: costs.per_stage(name, num_stages) for name in
           ("forward", "backward", "backward_input", "backward_weight", "a2a", "comm")}
    done: dict[tuple, float] = {}

    def latency(producer_stage, consumer_stage):
        crosses = placement[producer_stage] != placement[consumer_stage]
        return per["comm"][producer_stage] if crosses else 0.0

    def inputs(part):
        stage, microbatch = part.stage, part.microbatch
        if part.kind is Kind.F:
            if stage == 0:
                return []
            return [(("F", stage - 1, microbatch), latency(stage - 1, stage))]
        if part.kind in (Kind.B, Kind.I):
            needs = [(("F", stage, microbatch), 0.0)]
            if stage < num_stages - 1:
                needs.append((("G", stage + 1, microbatch), latency(stage + 1, stage)))
            return needs
        if part.kind is Kind.W:
            return [(("I", stage, microbatch), 0.0)]
        return []

    def duration(action):
        kind, stage = action.kind.value, action.stage
        if kind == "OVERLAP_F_B":
            forward, backward = action.parts
            return max(per["forward"][forward.stage] + per["backward"][backward.stage],
                       per["a2a"][forward.stage] + per["a2a"][backward.stage])
        return {"F": per["forward"][stage] + per["a2a"][stage],
                "B": per["backward"][stage] + per["a2a"][stage],
                "I": per["backward_input"][stage] + per["a2a"][stage],
                "W": per["backward_weight"][stage]}.get(kind, 0.0)

    position = [0] * schedule.num_ranks
    clock = [0.0] * schedule.num_ranks
    times = [[] for _ in range(schedule.num_ranks)]
    moved = True
    while moved:
        moved = False
        for rank, actions in enumerate(schedule.ranks):
            while position[rank] < len(actions):
                action = actions[position[rank]]
                needs = [need for part in action.computations for need in inputs(part)]
                if any(key not in done for key, _ in needs):
                    break
                start = max([clock[rank]] + [done[key] + extra for key, extra in needs])
                clock[rank] = start + duration(action)
                for part in action.computations:
                    kind = part.kind.value
                    if kind == "F":
                        done[("F", part.stage, part.microbatch)] = clock[rank]
                    if kind in ("B", "I"):
                        done[("G", part.stage, part.microbatch)] = clock[rank]
                    if kind == "I":
                        done[("I", part.stage, part.microbatch)] = clock[rank]
                times[rank].append((start, clock[rank]))
                position[rank] += 1
                moved = True
    return times


@pytest.mark.parametrize("schedule", list(_every_schedule()), ids=str)
def test_simulation_times_are_the_reference_floats(schedule):
    rng = random.Random(schedule.num_ranks * 100 + schedule.num_microbatches)
    stages = schedule.num_stages
    costs = CostModel(forward=[rng.uniform(0.3, 2.0) for _ in range(stages)],
                      backward_input=[rng.uniform(0.3, 2.0) for _ in range(stages)],
                      backward_weight=[rng.uniform(0.1, 1.0) for _ in range(stages)],
                      comm=[rng.uniform(0.0, 0.3) for _ in range(stages)],
                      a2a=[rng.uniform(0.0, 0.2) for _ in range(stages)])
    timeline = simulate(schedule, costs).timeline
    for rank, expected in enumerate(_reference_times(schedule, costs)):
        got = [(timed.start, timed.end) for timed in timeline.rank(rank)]
        assert got == expected  # exactly: summed in the same order


def test_long_blocks_keep_exact_sums():
    """Rank 0 of GPipe runs 150 forwards without waiting: one block, past the vectorised
    steps, summed one by one."""
    schedule = build("gpipe", 2, 150)
    costs = CostModel(forward=[0.1, 0.3], backward_input=0.7, backward_weight=0.2)
    timeline = simulate(schedule, costs).timeline
    for rank, expected in enumerate(_reference_times(schedule, costs)):
        assert [(t.start, t.end) for t in timeline.rank(rank)] == expected


def _outcome(work):
    try:
        return ("ok", work())
    except ScheduleError as error:
        return ("error", str(error), error.rank, error.index, error.waiting_for)


def _faulty_variants(schedule, rng):
    ranks = [list(actions) for actions in schedule.ranks]
    for _ in range(8):
        rank = rng.randrange(len(ranks))
        if len(ranks[rank]) < 2:
            continue
        changed = [list(actions) for actions in ranks]
        first, second = sorted(rng.sample(range(len(changed[rank])), 2))
        changed[rank].insert(second, changed[rank].pop(first))
        yield schedule.replace_ranks(changed)


def _range_size_cases() -> list:
    cases = []
    rng = random.Random(3)
    for schedule in _every_schedule():
        lowered = lower(schedule)
        cases.append(schedule)
        cases.extend(_faulty_variants(lowered, rng))
        cases.extend(_faulty_variants(schedule, rng))
    return cases


def _answers(cases: list) -> list:
    """Each case's validation, simulation and (compute-only cases) lowering, or its error."""
    out = []
    for schedule in cases:
        answers = [_outcome(lambda: validate(schedule)),
                   _outcome(lambda: simulate(schedule).timeline.rank(0))]
        if not schedule.is_lowered:
            answers.append(_outcome(lambda: lower(schedule, lookahead=2).to_csv()))
        out.append(answers)
    return out


@functools.cache
def _answers_at_the_default_range_size() -> tuple[list, list]:
    """The cases and their answers with the table's own range size (computed once for both
    range sizes tested)."""
    cases = _range_size_cases()
    return cases, _answers(cases)


@pytest.mark.parametrize("chunk,most_ranks", [(3, 2), (64, None)])
def test_results_do_not_depend_on_the_range_size(monkeypatch, chunk, most_ranks):
    """Lowering, validation and simulation go through the table a range of rows at a time;
    tiny ranges (rows of one action split across ranges) give the same answers. Ranges of
    3 rows are tried on the schedules of up to two ranks (their rows span many ranges too,
    and the larger ones take seconds at that size); ranges of 64 on every case."""
    cases, expected = _answers_at_the_default_range_size()
    chosen = [index for index, case in enumerate(cases)
              if most_ranks is None or case.num_ranks <= most_ranks]
    monkeypatch.setattr(table_module, "CHUNK", chunk)
    assert _answers([cases[index] for index in chosen]) == [expected[index] for index in chosen]


def test_table_round_trip_keeps_overlaps_and_equality():
    ranks = [(F(0, 0), Action.overlap(F(0, 1), B(0, 0)), B(0, 1)),
             (F(1, 0), I(1, 0), W(1, 0))]
    table = ActionTable.from_actions(ranks)
    assert [table.rank_actions(r) for r in range(2)] == [tuple(a) for a in ranks]
    by_actions = Schedule(2, 2, 2, (0, 1), ranks)
    by_table = Schedule(2, 2, 2, (0, 1), table)
    assert by_actions == by_table and hash(by_actions) == hash(by_table)
    assert by_table.ranks == by_actions.ranks
    assert by_table != by_actions.replace_ranks([ranks[0], (F(1, 0), B(1, 0))])


def test_schedule_is_immutable():
    schedule = build("1f1b", 2, 2)
    with pytest.raises(AttributeError, match="immutable"):
        schedule.name = "other"


def test_misplaced_action_in_a_table_is_named():
    table = ActionTable.from_columns(np.array([0, 0], np.int8), np.array([0, 1], np.int32),
                                     np.array([0, 0], np.int32), [2, 0])
    with pytest.raises(ValueError, match=r"rank 0 action #1 1F0: stage 1 is placed on rank 1"):
        Schedule(2, 2, 1, (0, 1), table)
