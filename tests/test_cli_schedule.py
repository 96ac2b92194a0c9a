"""``meshpipe schedule show / compare`` and ``meshpipe demo``."""

import json
import subprocess
import sys

import matplotlib.image
import pytest

from meshpipe.cli import main
from meshpipe.schedules.schedule import Schedule
from meshpipe.schedules.builders import SCHEDULES, build
from meshpipe.schedules.compare import compare
from meshpipe.schedules.lowering import lower
from meshpipe.schedules.render import to_text
from meshpipe.schedules import CostModel, simulate

pytestmark = pytest.mark.distributed


def run(capsys, *argv):
    status = main(list(argv))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_show_prints_the_grid_and_the_simulated_figures(capsys):
    status, out, err = run(capsys, "schedule", "show", "1f1b", "--pp", "4", "--microbatches", "8")
    assert (status, err) == (0, "")
    simulation = simulate(build("1f1b", 4, 8))
    assert [line for line in out.splitlines() if line.startswith("rank ")] == [
        line for line in to_text(simulation).splitlines() if line.startswith("rank ")]
    assert f"makespan {simulation.makespan:g}, bubble {100 * simulation.bubble_ratio:.1f}%" in out
    assert "peak live activations per rank: 4 3 2 1" in out


def test_show_writes_csv_png_and_trace_of_the_lowered_schedule(capsys, tmp_path):
    paths = {kind: tmp_path / "sub" / f"s.{kind}" for kind in ("csv", "png", "json")}
    status, out, _ = run(capsys, "schedule", "show", "interleaved", "--pp", "2", "--vpp", "2",
                         "--microbatches", "4", "--lowered", "--csv", str(paths["csv"]),
                         "--png", str(paths["png"]), "--trace", str(paths["json"]))
    assert status == 0
    expected = lower(build("interleaved", 2, 4, stages_per_rank=2))
    assert Schedule.from_csv(paths["csv"].read_text()) == expected
    assert matplotlib.image.imread(paths["png"]).ndim == 3
    trace = json.loads(paths["json"].read_text())
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(slices) == sum(len(actions) for actions in expected.ranks)
    assert any(e["tid"] == 1 for e in slices)  # sends and receives on the comm thread
    for path in paths.values():
        assert f"wrote {path}" in out


def test_show_takes_costs_placement_and_forward_only(capsys):
    status, out, _ = run(capsys, "schedule", "show", "gpipe", "--pp", "3", "--microbatches",
                         "4", "--placement", "wraparound", "--forward-only", "--f", "2",
                         "--comm", "0.5")
    assert status == 0
    schedule = build("gpipe", 3, 4, placement="wraparound", forward_only=True)
    # Costs are per rank's share: wrap-around splits 3 ranks' model into 4 stages.
    simulation = simulate(schedule, CostModel(forward=1.5, comm=0.5))
    assert f"makespan {simulation.makespan:g}," in out
    assert "B0" not in out


@pytest.mark.parametrize("argv, fragment", [
    (["schedule", "show", "nope", "--pp", "2", "-m", "2"], "invalid choice: 'nope'"),
    (["schedule", "show", "1f1b", "--pp", "0", "-m", "2"], "expected a number >= 1, got 0"),
    (["schedule", "show", "1f1b", "--pp", "x", "-m", "2"], "expected a whole number"),
    (["schedule", "show", "1f1b", "-m", "2"], "required: --pp"),
    (["schedule", "compare", "--pp", "2", "-m", "2", "--comm", "-1"], "finite cost >= 0"),
    (["schedule", "show", "1f1b", "--pp", "2", "-m", "2", "--a2a", "-1"],
     "argument --a2a: expected a finite cost >= 0, got -1"),
    (["schedule", "show", "none", "--pp", "2", "-m", "2"], "runs on 1 rank"),
    (["schedule", "show", "zb-h1", "--pp", "2", "-m", "2", "--placement", "v"],
     "runs on the loop placement"),
    (["schedule"], "required: SUBCOMMAND"),
    (["schedule", "compare", "--pp", "2", "-m", "2", "--recompute", "half"],
     "argument --recompute: invalid choice: 'half'"),
    (["schedule", "show", "1f1b", "--pp", "2", "-m", "2", "--heads", "0"],
     "argument --heads: expected a number >= 1, got 0"),
    (["schedule", "compare", "--pp", "4", "-m", "8", "--b", "4", "--i", "1", "--w", "1"],
     "meshpipe: error: a full backward must cost what its split halves cost: --b 4 but --i 1 "
     "+ --w 1 = 2; give --b alone"),
    (["schedule", "show", "zb-h1", "--pp", "2", "-m", "2", "--b", "1", "--i", "3"],
     "--b 1 but --i 3 alone is more"),
])
def test_bad_input_is_one_line_and_exit_status_2(capsys, argv, fragment):
    status, out, err = run(capsys, *argv)
    assert status == 2
    assert out == ""
    assert err.count("\n") == 1 and fragment in err
    assert "Traceback" not in err


def test_an_unwritable_output_path_is_reported(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    status, _, err = run(capsys, "schedule", "show", "1f1b", "--pp", "2", "-m", "2",
                         "--csv", str(blocker / "x.csv"))
    assert status == 2 and f"cannot write {blocker / 'x.csv'}" in err


def test_compare_lists_every_schedule_with_figures_or_the_reason(capsys, tmp_path):
    path = tmp_path / "compare.json"
    status, out, _ = run(capsys, "schedule", "compare", "--pp", "4", "--microbatches", "8",
                         "--comm", "0.25", "--json", str(path))
    assert status == 0
    rows = compare(4, 8, costs=CostModel(comm=0.25))
    table = [line for line in out.splitlines() if line.startswith("| ")][2:]
    assert [line.split("|")[1].strip() for line in table] == list(SCHEDULES)
    for line, row in zip(table, rows):
        cells = [cell.strip() for cell in line.split("|")[1:-1]]
        if row.simulation is None:
            assert cells[-1] == row.reason
        else:
            assert cells[2:5] == [f"{100 * row.simulation.bubble_ratio:.1f}%",
                                  f"{row.simulation.makespan:g}", str(row.peak_activations)]
    assert "runs on 1 rank" in out  # 'none' cannot run on 4 ranks: listed, not a crash
    document = json.loads(path.read_text())
    assert document["costs"]["comm"] == 0.25
    assert [r["schedule"] for r in document["schedules"]] == list(SCHEDULES)
    one_f_one_b = next(r for r in document["schedules"] if r["schedule"] == "1f1b")
    assert one_f_one_b["peak_activations"] == [4, 3, 2, 1]


def test_compare_with_only_b_gives_split_backward_schedules_the_same_work(capsys, tmp_path):
    path = tmp_path / "compare.json"
    status, out, _ = run(capsys, "schedule", "compare", "--pp", "4", "-m", "8", "--b", "4",
                         "--json", str(path))
    assert status == 0
    assert "costs F=1 B=4 I=2 W=2 comm=0" in out
    document = json.loads(path.read_text())
    assert (document["costs"]["backward_input"], document["costs"]["backward_weight"]) == (2, 2)
    makespans = {row["schedule"]: row["makespan"] for row in document["schedules"]
                 if "makespan" in row}
    assert makespans["1f1b"] == 55  # (m + p - 1)(F + B)
    # No schedule finishes before one rank's own work, m (F + B) = 40.
    assert min(makespans.values()) >= 40
    assert makespans["zb-h1"] < makespans["1f1b"]


def _table(out):
    rows = [line for line in out.splitlines() if line.startswith("| ")][2:]
    return {cells[0]: cells[1:] for cells in
            ([cell.strip() for cell in line.split("|")[1:-1]] for line in rows)}


def test_compare_recompute_changes_the_makespan_and_memory_columns(capsys, tmp_path):
    path = tmp_path / "compare.json"
    _, plain, _ = run(capsys, "schedule", "compare", "--pp", "4", "-m", "8")
    status, out, err = run(capsys, "schedule", "compare", "--pp", "4", "-m", "8",
                           "--recompute", "full", "--seq-len", "128", "--dim", "64",
                           "--heads", "8", "--json", str(path))
    assert (status, err) == (0, "")
    # 5 a s / h = 80: 2/114 of the activations kept; B, I and W re-run the forward
    assert ("costs F=1 B=2 I=1 W=1 comm=0; recompute full (seq-len 128, dim 64, heads 8): "
            "B, I and W re-run 100% of F, 1.75% of activations kept") in out
    before, after = _table(plain), _table(out)
    assert before["1f1b"][2:5] == ["33", "4", "4"]
    assert after["1f1b"][2:5] == ["44", "4", f"{4 * 2 / 114:g}"]  # makespan, peaks, memory
    rows = compare(4, 8, costs=CostModel(activation_bytes=1).with_recompute(
        "full", seq_len=128, dim=64, heads=8))
    for row in rows:
        if row.simulation is not None:
            assert after[row.name][2] == f"{row.simulation.makespan:g}"
            assert after[row.name][4] == f"{row.peak_activation_memory:g}"
    document = json.loads(path.read_text())
    assert document["costs"]["backward"] == 2  # the costs given, before recomputation
    assert document["recompute"] == {"mode": "full", "seq_len": 128, "dim": 64, "heads": 8,
                                     "compute_fraction": 1.0,
                                     "memory_fraction": pytest.approx(2 / 114)}
    one_f_one_b = next(r for r in document["schedules"] if r["schedule"] == "1f1b")
    assert one_f_one_b["makespan"] == 44


def test_show_recompute_changes_the_makespan_and_memory(capsys):
    _, plain, _ = run(capsys, "schedule", "show", "1f1b", "--pp", "4", "-m", "8")
    assert "peak activation memory per rank: 4 3 2 1 (1 = one microbatch's" in plain
    assert "recompute" not in plain
    status, out, _ = run(capsys, "schedule", "show", "1f1b", "--pp", "4", "-m", "8",
                         "--recompute", "selective")
    assert status == 0
    simulation = simulate(build("1f1b", 4, 8),
                          CostModel(activation_bytes=1).with_recompute("selective"))
    assert f"makespan {simulation.makespan:g}," in out and "makespan 33," in plain
    assert ("peak activation memory per rank: "
            + " ".join(f"{m:.3g}" for m in simulation.peak_activation_bytes)) in out
    assert "recompute selective (seq-len 64, dim 64, heads 4): B and I re-run 14.3% of F, " \
           "63% of activations kept" in out


def test_compare_a2a_gives_combined_1f1b_a_shorter_step_than_1f1b_and_interleaved(
        capsys, tmp_path):
    path = tmp_path / "compare.json"
    _, plain, _ = run(capsys, "schedule", "compare", "--pp", "2", "-m", "8")
    status, out, err = run(capsys, "schedule", "compare", "--pp", "2", "-m", "8", "--a2a",
                           "0.5", "--json", str(path))
    assert (status, err) == (0, "")
    assert "costs F=1 B=2 I=1 W=1 comm=0 a2a=0.5\n" in out
    assert "costs F=1 B=2 I=1 W=1 comm=0\n" in plain and "a2a" not in plain
    makespan = {name: float(cells[2]) for name, cells in _table(out).items() if cells[2] != "-"}
    assert makespan["combined-1f1b"] < makespan["interleaved"] < makespan["1f1b"]
    before = {name: float(cells[2]) for name, cells in _table(plain).items() if cells[2] != "-"}
    assert before["combined-1f1b"] == before["interleaved"]  # no all-to-all to hide
    document = json.loads(path.read_text())
    assert document["costs"]["a2a"] == 0.5
    rows = {r["schedule"]: r for r in document["schedules"]}
    assert rows["combined-1f1b"]["makespan"] == makespan["combined-1f1b"]


def test_show_a2a_lengthens_the_simulated_step_and_says_so(capsys):
    _, plain, _ = run(capsys, "schedule", "show", "combined-1f1b", "--pp", "2", "-m", "4")
    status, out, _ = run(capsys, "schedule", "show", "combined-1f1b", "--pp", "2", "-m", "4",
                         "--a2a", "0.5")
    assert status == 0
    schedule = build("combined-1f1b", 2, 4, stages_per_rank=2)
    simulation = simulate(schedule, CostModel(a2a=0.5, activation_bytes=1).for_stages_of(
        schedule))
    assert f"makespan {simulation.makespan:g}," in out
    assert f"makespan {simulate(schedule, CostModel().for_stages_of(schedule)).makespan:g}," \
        in plain
    assert "expert-parallel all-to-all a2a=0.5 (one rank's share)" in out
    assert "all-to-all" not in plain


def test_demo_trains_then_compares_and_draws_the_best_schedule(capsys, tmp_path):
    status, out, _ = run(capsys, "demo", "--out", str(tmp_path / "out"), "--steps", "6")
    assert status == 0
    metrics = json.loads((tmp_path / "out" / "train" / "metrics.json").read_text())
    assert metrics["check"]["passed"] and len(metrics["history"]) == 6
    assert (tmp_path / "out" / "train" / "timeline.png").exists()
    assert matplotlib.image.imread(tmp_path / "out" / "train" / "loss.png").shape[0] > 300
    assert "| zb-h1 |" in out and "| 1f1b |" in out
    image = matplotlib.image.imread(tmp_path / "out" / "schedule.png")
    assert image.shape[1] > 600


def test_python_dash_m_meshpipe_runs_the_cli():
    result = subprocess.run([sys.executable, "-m", "meshpipe", "schedule", "show", "1f1b",
                             "--pp", "2", "--microbatches", "0"], capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.strip().endswith("expected a number >= 1, got 0 (see --help)")
    assert "Traceback" not in result.stderr


def test_a_reader_that_stops_early_is_not_an_error():
    command = (f"{sys.executable} -m meshpipe schedule show 1f1b --pp 16 --microbatches 512"
               " | head -1")
    result = subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True,
                            text=True)
    assert result.stdout.startswith("1f1b: 16 ranks")
    assert "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr
    assert result.returncode == 0
