"""``compare``: every schedule built and simulated at the same sizes and costs."""

import importlib

import pytest

from meshpipe.schedules import SCHEDULES, Schedule, ScheduleError, build, compare
from meshpipe.schedules.actions import B, F
from meshpipe.schedules import CostModel, SimulationDeadlock, simulate
from meshpipe.schedules.table import W_CODE

# ``meshpipe.schedules.compare`` is the function once the package is imported; the module
# is reached through importlib.
compare_module = importlib.import_module("meshpipe.schedules.compare")


def test_compare_runs_every_schedule_like_for_like():
    p, m, v = 4, 8, 2
    rows = {row.name: row for row in compare(p, m, stages_per_rank=v)}
    assert list(rows) == list(SCHEDULES)
    assert rows["none"].simulation is None and "runs on 1 rank" in rows["none"].reason
    assert rows["none"].as_dict() == {"schedule": "none", "stages_per_rank": 1,
                                      "reason": rows["none"].reason}
    assert rows["1f1b"].simulation.bubble_ratio == pytest.approx((p - 1) / (m + p - 1))
    interleaved = rows["interleaved"]
    assert interleaved.stages_per_rank == v
    assert interleaved.simulation.bubble_ratio == pytest.approx((p - 1) / (v * m + p - 1))
    halved = simulate(build("interleaved", p, m, stages_per_rank=v), CostModel().scaled(1 / v))
    assert interleaved.simulation.makespan == halved.makespan
    for row in rows.values():
        if row.simulation is not None:
            assert row.peak_activation_memory == pytest.approx(
                max(row.simulation.peak_activations) / row.stages_per_rank)
    assert rows["1f1b"].as_dict()["peak_activation_memory"] == [4, 3, 2, 1]


@pytest.mark.parametrize("costs", [dict(backward=4), dict(backward=1), dict(backward_input=3),
                                   dict(backward=3, backward_weight=0.5)])
def test_every_schedule_does_the_same_work_whatever_backward_cost_is_given(costs):
    p, m = 4, 8
    model = CostModel(**costs)
    work = p * m * (model.forward + model.backward)  # every rank's share: m F and m B
    rows = [row for row in compare(p, m, costs=model) if row.simulation is not None]
    assert {row.name for row in rows} >= {"1f1b", "zb-h1", "zb-v", "dualpipe-v"}
    for row in rows:
        assert sum(row.simulation.busy) == pytest.approx(work), row.name
        assert row.simulation.makespan >= m * (model.forward + model.backward) - 1e-9


def test_recompute_adds_a_forward_to_every_backwards_work_and_shrinks_its_memory():
    """Full recomputation re-runs the forward in every B or I, and in every W of a split
    backward."""
    p, m = 4, 8
    base = {row.name: row for row in compare(p, m) if row.simulation is not None}
    recomputed = CostModel().with_recompute("full", memory_fraction=0.25)
    rows = {row.name: row for row in compare(p, m, costs=recomputed)
            if row.simulation is not None}
    assert rows.keys() == base.keys() >= {"1f1b", "zb-h1", "zb-v", "dualpipe-v"}
    for name, row in rows.items():
        simulation = row.simulation
        table, stages = simulation.schedule.table, simulation.schedule.num_stages
        recomputed_in_w = simulation.costs.per_stage("weight_recompute", stages)
        extra = sum(recomputed_in_w[stage] for stage in table.stage[table.kind == W_CODE])
        assert (extra > 0) == (name in {"zb-h1", "zb-v", "dualpipe-v"}), name
        assert sum(simulation.busy) == pytest.approx(p * m * (1 + 2 + 1) + extra), name
        assert row.simulation.makespan > base[name].simulation.makespan, name
        assert row.peak_activation_memory == pytest.approx(
            base[name].peak_activation_memory * 0.25), name


def test_compare_reports_costs_that_do_not_fit_a_schedule_as_its_reason():
    rows = {row.name: row for row in compare(2, 4, costs=CostModel(forward=(1, 1)),
                                             names=["1f1b", "zb-v"])}
    assert rows["1f1b"].simulation is not None
    assert "CostModel.forward has 2 per-stage values but the schedule has 4 stages" in \
        rows["zb-v"].reason


def test_rows_report_the_stages_per_rank_each_schedule_runs_with_run_or_not():
    # m = 6 on 4 ranks: dualpipe-v needs m >= 8 and interleaved a multiple of 4.
    rows = {row.name: row for row in compare(4, 6, stages_per_rank=3)}
    assert rows["dualpipe-v"].simulation is None and rows["zb-v"].simulation is not None
    assert rows["interleaved"].simulation is None
    assert {name: row.stages_per_rank for name, row in rows.items()} == {
        "none": 1, "gpipe": 1, "1f1b": 1, "interleaved": 3, "zb-h1": 1, "zb-v": 2,
        "dualpipe-v": 2, "combined-1f1b": 3}
    assert rows["zb-v"].simulation.schedule.stages_per_rank == 2


def _deadlocking_build(name, num_ranks, num_microbatches, **options):
    return Schedule(1, 1, 1, (0,), [[B(0, 0), F(0, 0)]], name=name)


def _invalid_build(name, num_ranks, num_microbatches, **options):
    raise ScheduleError("rank 0 action #0 0B0: no forward before it")


@pytest.mark.parametrize("faulty_build, error", [(_deadlocking_build, SimulationDeadlock),
                                                 (_invalid_build, ScheduleError)])
def test_a_builder_that_emits_a_schedule_that_cannot_run_is_raised_not_tabulated(
        monkeypatch, faulty_build, error):
    monkeypatch.setattr(compare_module, "build", faulty_build)
    with pytest.raises(error) as raised:
        compare(2, 4, names=["1f1b"])
    assert raised.value.__notes__ == [
        "comparing schedule '1f1b' with 2 ranks, 4 microbatches, 1 stages per rank"]


def test_an_unknown_schedule_name_is_an_error_not_a_row():
    with pytest.raises(ValueError, match=r"unknown schedules \['1f2b'\]; choose from none, "):
        compare(2, 4, names=["1f1b", "1f2b"])
