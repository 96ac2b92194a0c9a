"""Pictures of schedules: a text grid, a PNG and a Chrome trace (Perfetto, chrome://tracing).

Each renderer takes a ``Schedule`` (laid out by ``simulate`` under the default cost model:
F = I = W = 1, B = 2), a ``Simulation``, or a ``Timeline`` (for instance one measured in a
real training step). Compute actions are drawn as boxes; sends and receives are not drawn
in the grid and the PNG (their latency shows as gaps) and appear on a separate "comm"
thread in the trace.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshpipe.schedules.actions import Action, Kind
from meshpipe.schedules.schedule import Schedule
from meshpipe.schedules.compare import Comparison
from meshpipe.schedules.costs import CostModel
from meshpipe.schedules.simulator import Simulation, simulate
from meshpipe.schedules.timeline import Timeline, TimedAction

if TYPE_CHECKING:
    from matplotlib.figure import Figure

Renderable = Schedule | Simulation | Timeline

KIND_COLOURS = {
    Kind.F: "#4C72B0",
    Kind.B: "#55A868",
    Kind.I: "#DD8452",
    Kind.W: "#8172B3",
    Kind.OVERLAP: "#C44E52",
}
"""Box colour of each compute kind; later chunks of a rank are drawn in lighter shades."""

_MAX_TEXT_COLUMNS = 1000
_MAX_EXPLICIT_COLUMNS = 10 * _MAX_TEXT_COLUMNS
_IDLE = "."


@dataclass(frozen=True)
class _Picture:
    """What every renderer needs: the timeline, a title and each stage's chunk index."""

    timeline: Timeline
    title: str
    chunk_of_stage: dict[int, int]
    summary: str

    @property
    def num_chunks(self) -> int:
        return 1 + max(self.chunk_of_stage.values(), default=0)

    def chunk(self, action: Action) -> int:
        """Which of its rank's stages ``action`` runs on (0 = the rank's first stage)."""
        return self.chunk_of_stage.get(action.stage, 0)

    def label(self, action: Action) -> str:
        """Short cell text: ``F3``, or ``2F3`` (stage 2) where a rank holds several stages."""
        if action.kind is Kind.OVERLAP:
            return "+".join(self.label(part) for part in action.parts)
        prefix = str(action.stage) if self.num_chunks > 1 else ""
        return f"{prefix}{action.kind.value}{action.microbatch}"


def _picture(x: Renderable) -> _Picture:
    if isinstance(x, Schedule):
        x = simulate(x, CostModel())
    if isinstance(x, Simulation):
        schedule = x.schedule
        chunks = {stage: schedule.stages_of(rank).index(stage)
                  for stage, rank in enumerate(schedule.placement)}
        title = (f"{schedule.name or 'schedule'}: {schedule.num_ranks} ranks, "
                 f"{schedule.num_stages} stages, {schedule.num_microbatches} microbatches")
        return _Picture(x.timeline, title, chunks, x.summary())
    if isinstance(x, Timeline):
        chunks = {}
        for timed in x.ranks:
            stages = sorted({p.stage for t in timed for p in t.action.computations
                             if t.action.kind.is_compute})
            chunks.update({stage: index for index, stage in enumerate(stages)})
        summary = (f"makespan {x.makespan:g} {_unit_name(x)}, bubble "
                   f"{100 * x.bubble_ratio:.1f}%")
        return _Picture(x, f"timeline: {x.num_ranks} ranks", chunks, summary)
    raise TypeError(f"cannot render a {type(x).__name__}: give a Schedule, a Simulation "
                    f"or a Timeline")


def _unit_name(timeline: Timeline) -> str:
    if timeline.seconds_per_unit is None:
        return "units"
    return "s" if timeline.seconds_per_unit == 1 else f"x {timeline.seconds_per_unit:g} s"


def _compute_boxes(timeline: Timeline) -> list[TimedAction]:
    return [t for t in timeline if t.action.kind.is_compute]


def _grid_quantum(boxes: Sequence[TimedAction], origin: float, makespan: float) -> float:
    """The time one column stands for. It starts from a short but typical box duration
    (the 10th percentile, so that a rare tiny box of a measured step does not stretch the
    picture) and takes the coarsest division of it, by up to 8, that puts every box edge
    on a column boundary; measured times fit no such grid and keep the typical duration.
    At most ``_MAX_TEXT_COLUMNS`` columns."""
    durations = sorted(t.duration for t in boxes if t.duration > 0)
    if not durations:
        return 1.0
    typical = durations[len(durations) // 10]
    quantum = typical
    for divisor in range(1, 9):
        step = typical / divisor
        if all(_on_grid(t.start - origin, step) and _on_grid(t.end - origin, step)
               for t in boxes):
            quantum = step
            break
    return max(quantum, makespan / _MAX_TEXT_COLUMNS)


def _on_grid(value: float, step: float) -> bool:
    ratio = value / step
    return abs(ratio - round(ratio)) <= 1e-6 * max(1.0, abs(ratio))


def to_text(x: Renderable, *, resolution: float | None = None) -> str:
    """A ranks x time grid: one row per rank, one column per ``resolution`` time units.

    Each column shows the action running on that rank then (``F3`` = forward of
    microbatch 3; ``2F3`` = on stage 2, where ranks hold several stages; ``F3+B1`` = an
    OVERLAP), ``.`` when the rank is idle. By default a column is the largest step that
    keeps every box edge exact, so a box of length k fills k columns (at most 1000 columns);
    a ``resolution`` giving more than 10000 columns is a ValueError.
    """
    picture = _picture(x)
    timeline = picture.timeline
    boxes = _compute_boxes(timeline)
    origin, makespan = timeline.origin, timeline.makespan
    if resolution is not None and not resolution > 0:
        raise ValueError(f"resolution must be a positive time step, got {resolution}")
    quantum = resolution or _grid_quantum(boxes, origin, makespan)
    columns = max(1, math.ceil(makespan / quantum - 1e-9))
    if columns > _MAX_EXPLICIT_COLUMNS:
        raise ValueError(f"resolution {quantum:g} makes {columns} columns of a makespan of "
                         f"{makespan:g}, more than {_MAX_EXPLICIT_COLUMNS}: use a resolution "
                         f">= {makespan / _MAX_EXPLICIT_COLUMNS:.3g}, or leave it unset")
    grid = [[_IDLE] * columns for _ in range(timeline.num_ranks)]
    for timed in boxes:
        first = min(columns - 1, round((timed.start - origin) / quantum))
        last = max(first + 1, min(columns, round((timed.end - origin) / quantum)))
        label = picture.label(timed.action)
        for column in range(first, last):
            grid[timed.rank][column] = label
    width = max(len(cell) for row in grid for cell in row) if grid else 1
    name_width = len(f"rank {timeline.num_ranks - 1}")
    ticks = [" "] * (columns * (width + 1))
    for column in range(0, columns, 10):
        text = f"{column * quantum:.3g}"
        at = column * (width + 1)
        if all(c == " " for c in ticks[max(0, at - 1):at + len(text)]):
            ticks[at:at + len(text)] = text
    lines = [f"{picture.title}; time per column: {quantum:.3g} ({_unit_name(timeline)})",
             f"{'time'.ljust(name_width)} | {''.join(ticks).rstrip()}"]
    for rank, row in enumerate(grid):
        cells = " ".join(cell.ljust(width) for cell in row).rstrip()
        lines.append(f"{f'rank {rank}'.ljust(name_width)} | {cells}")
    lines.append(picture.summary)
    return "\n".join(lines) + "\n"


def _shade(colour: str, chunk: int, num_chunks: int) -> tuple[float, float, float]:
    """``colour`` mixed with white: chunk 0 full strength, later chunks lighter."""
    red, green, blue = (int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5))
    mix = 0.0 if num_chunks <= 1 else 0.6 * chunk / (num_chunks - 1)
    return tuple(c + (1 - c) * mix for c in (red, green, blue))


def _text_colour(rgb: tuple[float, float, float]) -> str:
    luminance = 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2]
    return "black" if luminance > 0.6 else "white"


def _box_label(action: Action) -> str:
    """Microbatch numbers in a box: ``3``, or ``3/1`` for an OVERLAP (forward/backward)."""
    return "/".join(str(part.microbatch) for part in action.computations)


def to_png(x: Renderable, path: str | os.PathLike, title: str | None = None) -> None:
    """Draw ``to_figure(x, title)`` into a PNG file at ``path``."""
    to_figure(x, title).savefig(os.fspath(path), dpi=100)


def to_figure(x: Renderable, title: str | None = None) -> Figure:
    """A matplotlib figure (Agg canvas, no pyplot state): one row per rank, a box per
    compute action.

    Colours follow ``KIND_COLOURS``; a rank's later chunks (virtual stages) are lighter
    shades of the same colour; each box carries its microbatch number when it fits.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch, Rectangle

    picture = _picture(x)
    timeline = picture.timeline
    boxes = _compute_boxes(timeline)
    origin, makespan = timeline.origin, max(timeline.makespan, 1e-12)
    unit = _grid_quantum(boxes, origin, makespan)
    plot_width_in = min(80.0, max(6.0, 0.16 * makespan / unit))
    height_in = min(60.0, 1.6 + 0.42 * timeline.num_ranks)
    num_chunks = picture.num_chunks
    entries = sorted({(t.action.kind, picture.chunk(t.action)) for t in boxes},
                     key=lambda entry: (_KIND_ORDER[entry[0]], entry[1]))
    legend_names = [_legend_name(kind, chunk, num_chunks) for kind, chunk in entries]
    left_in = 0.9
    right_in = 0.5 + 0.075 * max((len(name) for name in legend_names), default=0)
    width_in = left_in + plot_width_in + right_in
    figure = Figure(figsize=(width_in, height_in))
    FigureCanvasAgg(figure)
    axes = figure.add_axes((left_in / width_in, 0.9 / height_in,
                            plot_width_in / width_in, 1 - 1.5 / height_in))
    points_per_unit = plot_width_in * 72 / makespan
    for timed in boxes:
        action = timed.action
        rgb = _shade(KIND_COLOURS[action.kind], picture.chunk(action), num_chunks)
        start = timed.start - origin
        axes.add_patch(Rectangle((start, timed.rank - 0.4), timed.duration, 0.8,
                                 facecolor=rgb, edgecolor="white", linewidth=0.5))
        label = _box_label(action)
        size = min(9.0, timed.duration * points_per_unit / (0.62 * len(label) + 0.4))
        if size >= 4:
            axes.text(start + timed.duration / 2, timed.rank, label, ha="center",
                      va="center", fontsize=size, color=_text_colour(rgb))
    axes.set_xlim(0, makespan)
    axes.set_ylim(timeline.num_ranks - 0.5, -0.5)
    axes.set_yticks(range(timeline.num_ranks),
                    [f"rank {r}" for r in range(timeline.num_ranks)])
    axes.set_xlabel(f"time ({_unit_name(timeline)})")
    axes.set_title(title if title is not None else f"{picture.title}\n{picture.summary}",
                   fontsize=10, loc="left")
    for side in ("top", "right"):
        axes.spines[side].set_visible(False)
    legend = [Patch(facecolor=_shade(KIND_COLOURS[kind], chunk, num_chunks), label=name)
              for (kind, chunk), name in zip(entries, legend_names)]
    if legend:
        axes.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.0, 1.0),
                    fontsize=8, frameon=False)
    return figure


_KIND_ORDER = {kind: index for index, kind in enumerate(KIND_COLOURS)}
_KIND_NAMES = {Kind.F: "F forward", Kind.B: "B backward", Kind.I: "I input grad",
               Kind.W: "W weight grad", Kind.OVERLAP: "F+B overlap"}


def _legend_name(kind: Kind, chunk: int, num_chunks: int) -> str:
    return _KIND_NAMES[kind] + (f", chunk {chunk}" if num_chunks > 1 else "")


def to_chrome_trace(x: Renderable, *, microseconds_per_unit: float | None = None) -> dict:
    """The timeline as a Chrome trace: one process per rank, an "X" event per action.

    Compute actions go on thread 0 ("compute"), sends and receives on thread 1 ("comm").
    Times are microseconds from the timeline's origin: measured times use the timeline's
    ``seconds_per_unit``; abstract simulation units are drawn as 1 unit = 1 ms unless
    ``microseconds_per_unit`` says otherwise.
    """
    picture = _picture(x)
    timeline = picture.timeline
    if microseconds_per_unit is None:
        seconds = timeline.seconds_per_unit
        microseconds_per_unit = 1000.0 if seconds is None else seconds * 1e6
    events: list[dict] = []
    for rank in range(timeline.num_ranks):
        events.append({"ph": "M", "name": "process_name", "pid": rank,
                       "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank,
                       "args": {"sort_index": rank}})
        for tid, name in ((0, "compute"), (1, "comm")):
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid,
                           "args": {"name": name}})
    for timed in timeline:
        action = timed.action
        events.append({
            "ph": "X",
            "name": picture.label(action),
            "cat": action.kind.value,
            "pid": timed.rank,
            "tid": 0 if action.kind.is_compute else 1,
            "ts": (timed.start - timeline.origin) * microseconds_per_unit,
            "dur": timed.duration * microseconds_per_unit,
            "args": _trace_args(action, picture),
        })
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"title": picture.title, "summary": picture.summary}}


def _trace_args(action: Action, picture: _Picture) -> dict:
    args = {"action": str(action), "kind": action.kind.name, "stage": action.stage,
            "microbatch": action.microbatch,
            "chunk": picture.chunk(action)}
    if action.kind is Kind.OVERLAP:
        backward = action.parts[1]
        args.update(backward_stage=backward.stage, backward_microbatch=backward.microbatch)
    if action.peer is not None:
        args["peer_stage"] = action.peer
    return args


def write_chrome_trace(x: Renderable, path: str | os.PathLike, **options: float) -> None:
    """Write ``to_chrome_trace(x, **options)`` as JSON to ``path``."""
    with open(path, "w", encoding="utf-8") as out:
        json.dump(to_chrome_trace(x, **options), out)


def comparison_table(rows: Sequence[Comparison]) -> str:
    """A Markdown table of ``compare`` rows: bubble, makespan, peak activations."""
    lines = ["| schedule | stages/rank | bubble | makespan | peak live activations "
             "| peak activation memory | note |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for row in rows:
        if row.simulation is None:
            lines.append(f"| {row.name} | {row.stages_per_rank} | - | - | - | - "
                         f"| {row.reason} |")
            continue
        simulation = row.simulation
        memory = row.peak_activation_memory
        lines.append(f"| {row.name} | {row.stages_per_rank} | "
                     f"{100 * simulation.bubble_ratio:.1f}% | {simulation.makespan:g} | "
                     f"{row.peak_activations} | {'-' if memory is None else f'{memory:g}'} | |")
    return "\n".join(lines) + "\n"
