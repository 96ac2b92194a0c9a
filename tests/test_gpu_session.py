"""``benchmarks/gpu_session.py``: a lent GPU's session within its budget (no GPU needed:
the session's items here are small Python commands)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import gpu_bench  # noqa: E402
import gpu_check  # noqa: E402
import gpu_session  # noqa: E402
import moe_layer  # noqa: E402
import step_profile  # noqa: E402

PARSERS = {"gpu_bench.py": gpu_bench.parse_args, "gpu_check.py": gpu_check.parse_args,
           "moe_layer.py": moe_layer.parse_args, "step_profile.py": step_profile.parse_args}


@pytest.mark.parametrize("rehearsal", [False, True], ids=["gpu", "cpu-rehearsal"])
def test_every_items_command_parses_with_its_script(rehearsal, tmp_path):
    """A flag renamed in a benchmark would cost a GPU session the item: each command is
    parsed here by its own script's parser."""
    for item in gpu_session.ITEMS:
        argv = [a.replace("{out}", str(tmp_path)) for a in gpu_session._argv(item, rehearsal)]
        if argv[:2] == ["-m", "pytest"]:
            assert (gpu_session.ROOT / argv[-1]).exists() and "gpu" in argv
            continue
        script = gpu_session.ROOT / argv[0]
        assert script.exists(), item.name
        args = PARSERS[script.name](argv[1:])
        assert args.out == tmp_path
        assert getattr(args, "cpu_rehearsal", False) is rehearsal


def _item(name: str, code: str, expected_s: float = 0.01) -> gpu_session.Item:
    return gpu_session.Item(name, f"the {name} item", ("-c", code), expected_s=expected_s)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.distributed
def test_a_session_says_what_became_of_each_item(tmp_path):
    items = [_item("fine", "print('measured 1.0 ms')"),
             _item("broken", "import sys; print('no GPU kernel'); sys.exit(3)"),
             _item("late", "print('never')", expected_s=1000.0)]
    session = gpu_session.Session(tmp_path / "out", budget_s=60.0, rehearsal=True,
                                  machine=gpu_session.machine_facts(rehearsal=True))
    assert gpu_session.run_session(items, session) == 1
    by_name = {o.name: o for o in session.outcomes}
    assert [by_name[n].status for n in ("fine", "broken", "late")] == [
        "passed", "failed", "not started"]
    assert by_name["broken"].returncode == 3 and "exit status 3" in by_name["broken"].why
    out = tmp_path / "out"
    assert (out / "fine.log").read_text() == "measured 1.0 ms\n"
    assert (out / "broken.log").read_text() == "no GPU kernel\n"
    assert not (out / "late.log").exists() and "it takes about 1000" in by_name["late"].why
    table = (out / "session.md").read_text()
    assert "| broken | failed |" in table and "| late | not started |" in table
    assert "--items late`" in table
    recorded = json.loads((out / "session.json").read_text())
    assert [i["status"] for i in recorded["items"]] == ["passed", "failed", "not started"]


@pytest.mark.distributed
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads processes from /proc")
def test_an_item_running_when_the_budget_is_spent_is_stopped_with_what_it_started(tmp_path):
    grandchild = tmp_path / "grandchild.pid"
    sleeper = ("import subprocess, sys, time; "
               "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
               f"open({str(grandchild)!r}, 'w').write(str(p.pid)); "
               "print('started', flush=True); time.sleep(60)")
    items = [_item("slow", sleeper), _item("next", "print('never')")]
    session = gpu_session.Session(tmp_path, budget_s=2.0, rehearsal=True,
                                  machine=gpu_session.machine_facts(rehearsal=True))
    start = time.monotonic()
    assert gpu_session.run_session(items, session) == 1
    assert time.monotonic() - start < 2.0 + 15  # stopped at the budget, not after 60 s
    assert [o.status for o in session.outcomes] == ["stopped", "not started"]
    assert (tmp_path / "slow.log").read_text() == "started\n"
    assert not _alive(int(grandchild.read_text()))  # the whole process group went
    assert "--items slow next`" in (tmp_path / "session.md").read_text()


@pytest.mark.distributed
def test_the_first_item_starts_however_long_it_takes(tmp_path):
    """A call for one long item (``--items``) runs it; the items after it wait for another."""
    items = [_item("long", "print('ran')", expected_s=5.0),
             _item("next", "print('ran')", expected_s=5.0)]
    session = gpu_session.Session(tmp_path, budget_s=0.5, rehearsal=True,
                                  machine=gpu_session.machine_facts(rehearsal=True))
    gpu_session.run_session(items, session)
    assert [o.status for o in session.outcomes] == ["passed", "not started"]


@pytest.mark.distributed
def test_a_session_writes_its_table_after_every_item(tmp_path):
    """A command cut at the device's limit leaves the table of the items before it, and
    names the one it was running."""
    out = tmp_path / "out"
    table = out / "session.md"
    items = [_item("first", "print(1)"),
             _item("second", f"import pathlib; print(pathlib.Path({str(table)!r}).read_text())")]
    session = gpu_session.Session(out, budget_s=60, rehearsal=True,
                                  machine=gpu_session.machine_facts(rehearsal=True))
    assert gpu_session.run_session(items, session) == 0
    seen_by_second = (out / "second.log").read_text()
    assert "| first | passed |" in seen_by_second and "| second | running |" in seen_by_second


@pytest.mark.distributed
def test_the_items_children_find_meshpipe_without_an_install(tmp_path, monkeypatch):
    monkeypatch.delenv("PYTHONPATH", raising=False)
    items = [_item("where", "import meshpipe; print(meshpipe.__file__)")]
    session = gpu_session.Session(tmp_path, budget_s=60, rehearsal=True,
                                  machine=gpu_session.machine_facts(rehearsal=True))
    assert gpu_session.run_session(items, session) == 0
    found = Path((tmp_path / "where.log").read_text().strip())
    assert found.is_relative_to(gpu_session.SOURCES)


def test_bad_arguments_are_one_line_before_anything_runs(tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        gpu_session.parse_args(["--budget-s", "0", "--out", str(tmp_path)])
    assert exited.value.code == 2
    assert "--budget-s must be positive" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu_session.parse_args(["--items", "no-such-item"])
    assert not any(tmp_path.iterdir())


def test_the_default_out_is_the_devices_out_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert gpu_session.parse_args([]).out == tmp_path
    monkeypatch.delenv("OUT")
    assert gpu_session.parse_args([]).out == gpu_session.BENCHMARKS / "results" / "gpu_session"


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the session would run")
def test_without_a_gpu_and_without_a_rehearsal_nothing_runs(tmp_path, capsys):
    assert gpu_session.main(["--out", str(tmp_path / "out")]) == 0
    assert "nothing to run" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()


def test_a_stopped_check_or_benchmark_has_printed_each_finished_runs_figures():
    """What the session's logs keep of an item stopped before it wrote its table."""
    passed = {"layout": "pp2-1f1b", "ranks": 2, "how": "shared", "status": "PASS",
              "loss_difference": 1.2e-07, "max_grad_difference": 3.0e-08,
              "median_step_seconds": 0.0602, "note": ""}
    assert gpu_check.progress_line(passed) == (
        "gpu_check: PASS pp2-1f1b (shared, 2 rank(s)): loss diff 1.2e-07, max grad diff "
        "3.0e-08, step 0.0602 s")
    failed = {**passed, "status": "FAIL", "loss_difference": None, "max_grad_difference": None,
              "median_step_seconds": None, "note": "timed out after 300 s"}
    assert gpu_check.progress_line(failed).endswith("(shared, 2 rank(s)): timed out after 300 s")
    measured = {"status": "ok", "seconds": 0.2453, "first_seconds": 2.51, "peak_gib": 17.4,
                "gpu": "1980 MHz, 61, 512.3 W"}
    assert gpu_bench._round_line("trainer --compile", 2048, 1, 2, measured) == (
        "gpu_bench: round 2/2 trainer --compile seq 2048: 245.3 ms/step, first step 2.5 s, "
        "peak 17.4 GiB (1980 MHz, 61, 512.3 W)")
    stopped, _ = gpu_bench._failed("no result in 300 s (--runner-timeout)")
    assert gpu_bench._round_line("plain", 2048, 0, 2, stopped).endswith(
        "seq 2048: failed: no result in 300 s (--runner-timeout)")
