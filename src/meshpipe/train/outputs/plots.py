"""``loss.png``: a run's ``metrics.jsonl`` as a picture, to see at a glance how training went.

Three panels against the step: training and validation loss, learning rate, gradient norm.
It reads only the file, so it draws any run: one that finished, failed or is still going.
A null value (a non-finite loss, a skipped step's gradient norm) is a gap in its line, and
skipped steps are marked under the loss.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshpipe.train.outputs.metrics import FILE_NAME as METRICS_FILE
from meshpipe.train.outputs.metrics import read

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

FILE_NAME = "loss.png"

Records = list[dict[str, Any]]


def plot_run(out_dir: str | os.PathLike) -> Path:
    """Draw ``out_dir/metrics.jsonl`` into ``out_dir/loss.png``; its path.

    A ValueError (one line) when there is no step to draw."""
    out_dir = Path(out_dir)
    records = read(out_dir / METRICS_FILE)
    steps = [r for r in records if "loss" in r]
    if not steps:
        raise ValueError(_nothing_to_draw(out_dir))
    evaluations = [r for r in records if "val_loss" in r]
    path = out_dir / FILE_NAME
    _figure(steps, evaluations, _title(out_dir, steps, evaluations)).savefig(
        os.fspath(path), dpi=100)
    return path


def _nothing_to_draw(out_dir: Path) -> str:
    """Why there is no picture, and what to do instead."""
    source = out_dir / METRICS_FILE
    reason = ("the run stopped before its first step (see its logs/)" if source.exists()
              else "no such file")
    return (f"no training steps recorded in {source}: {reason}; give the --out-dir of a run "
            f"that trained at least one step")


def _title(out_dir: Path, steps: Records, evaluations: Records) -> str:
    skipped = sum(_skipped(r) for r in steps)
    return (f"{out_dir}: {_count(len(steps), 'step')}, "
            f"{_count(len(evaluations), 'evaluation')}"
            + (f", {skipped} skipped" if skipped else ""))


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def _figure(steps: Records, evaluations: Records, title: str) -> Figure:
    """Loss (training and validation), learning rate and gradient norm sharing the step
    axis (Agg canvas, no pyplot state: draws headless)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 7), layout="constrained")
    FigureCanvasAgg(figure)
    loss, lr, grad_norm = figure.subplots(3, 1, sharex=True,
                                          gridspec_kw={"height_ratios": (2, 1, 1)})
    figure.suptitle(title)
    _line(loss, steps, "loss", "training", "#4C72B0")
    _line(loss, evaluations, "val_loss", "validation", "#DD8452", marker="o")
    _mark_skipped(loss, steps)
    loss.set_ylabel("loss")
    loss.legend(loc="upper right")
    _line(lr, steps, "lr", None, "#55A868")
    lr.set_ylabel("learning rate")
    _line(grad_norm, steps, "grad_norm", None, "#8172B3")
    grad_norm.set_ylabel("gradient norm")
    grad_norm.set_xlabel("step")
    for axes in (loss, lr, grad_norm):
        axes.grid(alpha=0.3)
    return figure


def _line(axes: Axes, records: Records, key: str, label: str | None, colour: str,
          marker: str = "") -> None:
    """``key`` against the step; a null is a gap, and a point between gaps gets a dot so
    that it still shows (a run of one step too)."""
    steps = [r["step"] for r in records]
    values = [_number(r.get(key)) for r in records]
    axes.plot(steps, values, color=colour, label=label, marker=marker or ".",
              markevery=None if marker else _isolated(values))


def _isolated(values: list[float]) -> list[int]:
    """Indices of the finite values whose neighbours are both gaps (or ends)."""
    finite = [False, *(math.isfinite(v) for v in values), False]
    return [i for i in range(len(values))
            if finite[i + 1] and not finite[i] and not finite[i + 2]]


def _mark_skipped(axes: Axes, steps: Records) -> None:
    """A cross at the bottom of the panel for each step whose update was skipped."""
    skipped = [r["step"] for r in steps if _skipped(r)]
    if skipped:
        axes.plot(skipped, [0.0] * len(skipped), "x", color="#C44E52", clip_on=False,
                  transform=axes.get_xaxis_transform(), label=f"skipped ({len(skipped)})")


def _skipped(record: dict[str, Any]) -> bool:
    return bool(record.get("skipped")) or record.get("loss") is None


def _number(value: Any) -> float:
    return math.nan if value is None else float(value)
