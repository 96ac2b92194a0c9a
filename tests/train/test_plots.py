"""``loss.png`` from a hand-written metrics.jsonl, and ``meshpipe plot``."""

import io
import json

import matplotlib.image
import pytest

from meshpipe.cli import main
from meshpipe.train.outputs.plots import plot_run


def step(number, loss, grad_norm=1.0, **extra):
    return {"step": number, "loss": loss, "lr": 1e-3 * (number + 1), "grad_norm": grad_norm,
            "step_seconds": 0.25, "tokens_per_s": 8000.0, **extra}


A_RUN = [step(0, 5.5), step(1, 5.1),
         step(2, None, None, skipped=True, nonfinite=True),  # a NaN loss, written as null
         step(3, 4.8, None, skipped=True, loss_scale=1024.0),  # fp16 overflow: skipped
         step(4, 4.2), {"step": 4, "val_loss": 4.4}, step(5, 3.9),
         {"step": 5, "val_loss": None}]


def write_jsonl(directory, records, tail=""):
    directory.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in records) + tail
    (directory / "metrics.jsonl").write_text(text)
    return directory


def assert_picture(path):
    assert path.name == "loss.png"
    pixels = matplotlib.image.imread(path)
    assert pixels.shape[0] >= 400 and pixels.shape[1] >= 400 and pixels.ndim == 3


def test_a_run_with_gaps_skips_and_evaluations_draws(tmp_path):
    # A line cut by a crash mid-write ends the file: it is dropped, not a failure.
    out = write_jsonl(tmp_path / "run", A_RUN, tail='{"step": 6, "lo')
    path = plot_run(out)
    assert path == out / "loss.png"
    assert_picture(path)


@pytest.mark.parametrize("records", [[step(0, 5.5)], [step(0, None, None, skipped=True)],
                                     [step(0, 5.5), step(1, 5.0)]],
                         ids=["one step", "one null step", "no evaluation"])
def test_a_short_run_still_draws(tmp_path, records):
    assert_picture(plot_run(write_jsonl(tmp_path, records)))


def test_no_metrics_file_is_a_one_line_error(tmp_path):
    with pytest.raises(ValueError, match=r"^no training steps recorded in .*metrics\.jsonl: "
                       r"no such file; give the --out-dir of a run") as caught:
        plot_run(tmp_path)
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "loss.png").exists()


def test_a_run_without_steps_is_a_one_line_error(tmp_path):
    write_jsonl(tmp_path, [{"step": 0, "val_loss": 5.0}])
    with pytest.raises(ValueError, match="no training steps recorded in .*: the run stopped "
                       "before its first step"):
        plot_run(tmp_path)


def test_meshpipe_plot_draws_a_run_and_prints_the_path(tmp_path):
    out = write_jsonl(tmp_path / "failed-run", A_RUN)
    printed = io.StringIO()
    assert main(["plot", str(out)], out=printed) == 0
    assert printed.getvalue() == f"wrote {out / 'loss.png'}\n"
    assert_picture(out / "loss.png")


def test_meshpipe_plot_without_steps_prints_one_line_and_exits_2(tmp_path, capsys):
    assert main(["plot", str(tmp_path)], out=io.StringIO()) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"meshpipe: error: no training steps recorded in {tmp_path}")
    assert error.count("\n") == 1


def test_the_end_of_a_run_draws_it_and_says_where(tmp_path, capsys):
    from meshpipe.train.outputs.reporting import write_metrics

    out = write_jsonl(tmp_path, A_RUN)
    write_metrics(out, {})
    assert f"loss curves in {out / 'loss.png'}" in capsys.readouterr().out
    assert_picture(out / "loss.png")


def test_a_failed_run_draws_the_steps_it_took(tmp_path, capsys, monkeypatch):
    from meshpipe.train.loop import trainer
    from meshpipe.train.supervisor.launch import LaunchError

    def fail(config):
        write_jsonl(tmp_path, A_RUN[:2])
        raise LaunchError("rank 1 raised RuntimeError: boom (see logs/rank1.log)", rank=1)

    monkeypatch.setattr(trainer, "run", fail)
    assert main(["train", "--out-dir", str(tmp_path)], out=io.StringIO()) == 1
    error = capsys.readouterr().err
    assert error == (f"meshpipe: training failed: rank 1 raised RuntimeError: boom (see "
                     f"logs/rank1.log); the loss so far in {tmp_path / 'loss.png'}\n")
    assert_picture(tmp_path / "loss.png")
