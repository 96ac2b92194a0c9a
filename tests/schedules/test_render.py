"""Text grid, PNG figure and Chrome trace of schedules, simulations and measured timelines."""

import json

import matplotlib.image
import pytest
from matplotlib.colors import to_rgb
from matplotlib.patches import Rectangle

from meshpipe.schedules.actions import Action, B, F, I, Kind, W
from meshpipe.schedules.schedule import Schedule
from meshpipe.schedules.render import (
    KIND_COLOURS,
    to_chrome_trace,
    to_figure,
    to_png,
    to_text,
    write_chrome_trace,
)
from meshpipe.schedules import CostModel, Timeline, simulate


def gpipe(p: int, m: int) -> Schedule:
    ranks = [[F(r, i) for i in range(m)] + [B(r, i) for i in range(m)] for r in range(p)]
    return Schedule(p, p, m, tuple(range(p)), ranks, name="gpipe")


def v_shape(m: int) -> Schedule:
    """4 stages on 2 ranks in a V (rank 0 holds stages 0 and 3), GPipe order."""
    order = {0: (0, 3), 1: (1, 2)}
    ranks = []
    for r in (0, 1):
        first, second = order[r]
        ranks.append([F(first, i) for i in range(m)] + [F(second, i) for i in range(m)]
                     + [B(second, i) for i in range(m)] + [B(first, i) for i in range(m)])
    return Schedule(2, 4, m, (0, 1, 1, 0), ranks, name="v")


def zero_bubble_like() -> Schedule:
    """Split backwards and an OVERLAP, to exercise every compute kind."""
    return Schedule(2, 2, 2, (0, 1), [
        [F(0, 0), F(0, 1), I(0, 0), W(0, 0), I(0, 1), W(0, 1)],
        [F(1, 0), Action.overlap(F(1, 1), B(1, 0)), B(1, 1)],
    ], name="mixed")


def grid_rows(text: str) -> dict[int, list[str]]:
    rows = {}
    for line in text.splitlines():
        if line.startswith("rank "):
            name, _, cells = line.partition("|")
            rows[int(name.split()[1])] = cells.split()
    return rows


def expected_rows(simulation, quantum: float, label) -> dict[int, list[str]]:
    columns = round(simulation.makespan / quantum)
    rows = {r: ["."] * columns for r in range(simulation.schedule.num_ranks)}
    for timed in simulation.timeline:
        if timed.action.kind.is_compute:
            for column in range(round(timed.start / quantum), round(timed.end / quantum)):
                rows[timed.rank][column] = label(timed.action)
    return {r: _trim(row) for r, row in rows.items()}


def _trim(row: list[str]) -> list[str]:
    while row and row[-1] == ".":
        row = row[:-1]
    return row


def short_label(action: Action) -> str:
    return "+".join(f"{p.kind.value}{p.microbatch}" for p in action.computations)


@pytest.mark.parametrize("schedule", [gpipe(3, 4), zero_bubble_like()])
def test_text_grid_shows_every_action_in_its_time_columns(schedule):
    text = to_text(schedule)
    expected = expected_rows(simulate(schedule), 1.0, short_label)
    assert {r: _trim(row) for r, row in grid_rows(text).items()} == expected


def test_text_grid_labels_an_overlap_with_both_halves():
    assert "F1+B0" in grid_rows(to_text(zero_bubble_like()))[1]


def test_text_grid_of_a_small_gpipe_reads_naturally():
    rows = grid_rows(to_text(gpipe(2, 2)))
    assert rows[0] == "F0 F1 . . . B0 B0 B1 B1".split()
    assert rows[1] == ". F0 F1 B0 B0 B1 B1 . .".split()


def test_text_grid_names_stages_when_ranks_hold_several():
    schedule = v_shape(2)
    rows = grid_rows(to_text(schedule))
    expected = expected_rows(simulate(schedule), 1.0, str)
    assert {r: _trim(row) for r, row in rows.items()} == expected
    assert "3F0" in rows[0] and "0F0" in rows[0]


def test_text_grid_resolution_follows_fractional_costs():
    schedule = gpipe(2, 3)
    simulation = simulate(schedule, CostModel(forward=1.0, backward=1.5))
    text = to_text(simulation)
    assert "time per column: 0.5" in text
    assert {r: _trim(row) for r, row in grid_rows(text).items()} == expected_rows(
        simulation, 0.5, short_label)
    assert grid_rows(text)[1][:3] == [".", ".", "F0"]
    assert grid_rows(to_text(simulation, resolution=1.5))[0][0] == "F0"
    with pytest.raises(ValueError, match="resolution must be a positive"):
        to_text(simulation, resolution=0)
    # makespan 10: 10000 columns draw, 10001 are refused with the smallest usable step
    assert len(grid_rows(to_text(simulation, resolution=1e-3))[0]) == 10000
    with pytest.raises(ValueError, match=r"resolution 0\.0001 makes 100000 columns of a "
                                         r"makespan of 10, more than 10000: use a resolution "
                                         r">= 0\.001"):
        to_text(simulation, resolution=1e-4)


def test_an_explicit_origin_after_a_start_is_refused_and_one_before_shifts_the_grid():
    records = [(0, "0F0", 0.0, 1.0), (0, "0F1", 1.0, 2.0)]
    with pytest.raises(ValueError, match=r"rank 0 action #0 0F0 starts at 0, before the "
                                         r"timeline's origin 0\.5: give an origin at or before "
                                         r"the earliest start \(0\)"):
        Timeline.from_records(records, origin=0.5)
    with pytest.raises(ValueError, match="rank 1 action #1 1F1 starts at 3, before"):
        Timeline.from_columns([[F(0, 0)], [F(1, 0), F(1, 1)]], [[5], [5, 3]], [[6], [6, 4]],
                              origin=4)
    earlier = Timeline.from_records(records, origin=-1.0)
    assert earlier.makespan == 3
    assert _trim(grid_rows(to_text(earlier))[0]) == ". F0 F1".split()


def test_text_grid_of_a_measured_timeline_starts_at_its_origin():
    timeline = Timeline.from_records([(0, "0F0", 100.0, 100.5), (1, "1F0", 100.5, 101.0),
                                      (1, "1B0", 101.0, 102.0), (0, "0B0", 102.0, 103.0)])
    text = to_text(timeline)
    assert "(s)" in text
    rows = {r: _trim(row) for r, row in grid_rows(text).items()}
    assert rows == {0: "F0 . . . B0 B0".split(), 1: ". F0 B0 B0".split()}


def test_figure_draws_one_box_per_compute_action_in_its_kind_colour():
    schedule = zero_bubble_like()
    simulation = simulate(schedule)
    figure = to_figure(simulation)
    axes = figure.axes[0]
    boxes = [p for p in axes.patches if isinstance(p, Rectangle)]
    compute = [t for t in simulation.timeline if t.action.kind.is_compute]
    assert len(boxes) == len(compute)
    by_position = {(round(b.get_x(), 6), round(b.get_y() + 0.4)): b for b in boxes}
    for timed in compute:
        box = by_position[(round(timed.start, 6), timed.rank)]
        assert box.get_width() == pytest.approx(timed.duration)
        assert box.get_facecolor()[:3] == pytest.approx(to_rgb(KIND_COLOURS[timed.action.kind]))
    labels = sorted(t.get_text() for t in axes.texts)
    assert labels == sorted(["0", "1", "0", "0", "1", "1", "0", "1/0", "1"])


def test_figure_shades_the_chunks_of_a_rank_differently():
    figure = to_figure(v_shape(2))
    boxes = [p for p in figure.axes[0].patches if isinstance(p, Rectangle)]
    forward_colours = {tuple(b.get_facecolor()[:3]) for b in boxes
                       if b.get_y() < 0 and b.get_x() < 6}
    assert len(forward_colours) == 2
    legend = [t.get_text() for t in figure.axes[0].get_legend().get_texts()]
    assert "F forward, chunk 0" in legend and "F forward, chunk 1" in legend


def test_png_is_written_and_readable(tmp_path):
    path = tmp_path / "schedule.png"
    to_png(gpipe(2, 3), path, title="gpipe 2 x 3")
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[1] > image.shape[0]


def test_figure_of_8_ranks_by_64_microbatches_labels_every_box():
    schedule = gpipe(8, 64)
    axes = to_figure(schedule).axes[0]
    assert len(axes.texts) == 2 * 8 * 64
    assert min(text.get_fontsize() for text in axes.texts) >= 5


def test_chrome_trace_has_a_process_per_rank_and_an_event_per_action(tmp_path):
    schedule = Schedule(2, 2, 1, (0, 1), [
        [F(0, 0), Action(Kind.SEND_F, 0, 0), Action(Kind.RECV_B, 0, 0), B(0, 0)],
        [Action(Kind.RECV_F, 1, 0), F(1, 0), B(1, 0), Action(Kind.SEND_B, 1, 0)],
    ])
    simulation = simulate(schedule, CostModel(comm=0.5))
    trace = to_chrome_trace(simulation)
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(slices) == len(list(simulation.timeline))
    for event, timed in zip(slices, simulation.timeline):
        assert event["pid"] == timed.rank
        assert event["tid"] == (0 if timed.action.kind.is_compute else 1)
        assert event["ts"] == pytest.approx(1000 * timed.start)
        assert event["dur"] == pytest.approx(1000 * timed.duration)
        assert (event["args"]["stage"], event["args"]["microbatch"]) == (
            timed.action.stage, timed.action.microbatch)
    assert next(e for e in slices if e["args"]["action"] == "0SEND_F0")["args"][
        "peer_stage"] == 1
    path = tmp_path / "trace.json"
    write_chrome_trace(simulation, path)
    assert json.loads(path.read_text()) == trace


def test_chrome_trace_of_measured_seconds_is_in_microseconds():
    timeline = Timeline.from_records([(0, "(0F1;0B0)OVERLAP_F_B", 2.0, 2.25)])
    (event,) = [e for e in to_chrome_trace(timeline)["traceEvents"] if e["ph"] == "X"]
    assert (event["ts"], event["dur"]) == (0.0, 250000.0)
    assert (event["args"]["backward_stage"], event["args"]["backward_microbatch"]) == (0, 0)


def test_rendering_something_else_is_a_type_error():
    with pytest.raises(TypeError, match="give a Schedule, a Simulation or a Timeline"):
        to_text([[F(0, 0)]])


def test_a_tiny_measured_box_does_not_stretch_the_grid_or_the_figure():
    records = [(0, f"0F{m}", 1.03 * m, 1.03 * m + 1.0 + 0.01 * m) for m in range(20)]
    records.append((0, "0B0", 30.0, 30.0001))
    timeline = Timeline.from_records(records)
    rows = grid_rows(to_text(timeline))
    assert len(rows[0]) < 40
    assert rows[0][:3] == ["F0", "F1", "F2"]
    assert to_figure(timeline).get_figwidth() < 12
