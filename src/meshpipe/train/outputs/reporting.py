"""What a run reports: each step's metrics record and progress-bar text, the experts'
statistics, the measured timeline of one step (a picture and a Chrome trace, with its bubble beside the simulated one)
and, at the end, ``metrics.json`` with the whole history and a one-line summary.

Only rank 0 writes and prints; every rank sends its actions' times for the timeline step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshpipe.comm import ops

from meshpipe.schedules import Schedule
from meshpipe.schedules.costs import fit_costs
from meshpipe.schedules.render import to_png, write_chrome_trace
from meshpipe.schedules.simulator import simulate
from meshpipe.schedules.timeline import Timeline
from meshpipe.train.config import TrainConfig
from meshpipe.train.outputs.metrics import FILE_NAME as METRICS_FILE
from meshpipe.train.outputs.metrics import dumps
from meshpipe.train.outputs.metrics import read as read_metrics
from meshpipe.train.outputs.plots import plot_run


def step_record(config: TrainConfig, step: int, stats: Any, lr: float,
                loss_scale: float | None) -> tuple[dict[str, Any], str]:
    """The metrics record of one step and its progress-bar text."""
    tokens_per_s = config.tokens_per_step / stats.seconds
    record = {"step": step, "loss": stats.loss, "lr": lr, "grad_norm": stats.grad_norm,
              "step_seconds": stats.seconds, "tokens_per_s": tokens_per_s}
    if loss_scale is not None:
        record.update(skipped=stats.skipped, loss_scale=loss_scale)
    if stats.nonfinite:
        record.update(skipped=True, nonfinite=True)
    if stats.sources:
        record.update(stats.sources)
    postfix = f"loss {stats.loss:.3f} | {tokens_per_s:,.0f} tok/s"
    if stats.moe is not None:
        record.update(stats.moe)
        postfix += (f" | aux {stats.moe['moe_aux_loss']:.3f} | experts "
                    f"{stats.moe['min_tokens_per_expert']}-"
                    f"{stats.moe['max_tokens_per_expert']} tok"
                    + (f", {stats.moe['dropped_tokens']} dropped"
                       if config.moe_capacity_factor else ""))
    return record, postfix


class ExpertStats:
    """The mixture-of-experts layers' statistics of a step, over the whole job.

    ``moe_index`` gives each local expert layer's global layer index (its place in the
    step's counts); ``experts`` is the number of experts per layer. The ranks of a
    tensor-parallel group route the same tokens: only ``counted`` ones add theirs."""

    def __init__(self, config: TrainConfig, stages: dict[int, Any], moe_index: dict[int, int],
                 device: torch.device, experts: int, counted: bool = True):
        self.config = config
        self.stages = stages
        self.moe_index = moe_index
        self.device = device
        self.experts = experts
        self.counted = counted

    def take(self) -> list[tuple[int, Any]]:
        """Each local expert layer's stats since the last call (global layer index, stats)."""
        return [(self.moe_index[id(module)], module.take_stats())
                for stage in self.stages.values() for module in stage.module.modules()
                if id(module) in self.moe_index]

    def metrics(self) -> dict[str, float] | None:
        """The step's load-balancing loss (mean per microbatch, summed over layers), the
        most and fewest picks any expert of any layer got, and the dropped picks, over the
        whole job (one all-reduce on every rank); None without experts."""
        if not self.moe_index:
            return None
        experts = self.experts
        counts = torch.zeros(len(self.moe_index) * experts + 2, dtype=torch.float64,
                             device=self.device)
        taken = self.take()  # on every rank: each starts counting anew
        for index, stats in taken if self.counted else []:
            counts[index * experts:(index + 1) * experts] += stats.tokens_per_expert.to(
                counts.device, torch.float64)
            counts[-2] += stats.dropped.to(counts.device, torch.float64)
            counts[-1] += stats.aux_loss.to(counts.device)
        ops.all_reduce(counts)
        per_expert = counts[:-2]
        return {"moe_aux_loss": counts[-1].item() / (self.config.dp * self.config.microbatches),
                "max_tokens_per_expert": int(per_expert.max().item()),
                "min_tokens_per_expert": int(per_expert.min().item()),
                "dropped_tokens": int(counts[-2].item())}


def gather_timeline(records: list[tuple], pipeline_ranks: list[int],
                    is_main: bool) -> Timeline | None:
    """Every rank's ``(pp_rank, action, start, end)`` records of one step; rank 0's
    pipeline as a measured timeline on rank 0, None elsewhere."""
    gathered: list[Any] = [None] * dist.get_world_size() if is_main else None
    dist.gather_object(records, gathered, dst=0)
    if not is_main:
        return None
    return Timeline.from_records([r for rank in pipeline_ranks for r in gathered[rank]],
                                 num_ranks=len(pipeline_ranks), seconds_per_unit=1.0)


def draw_timeline(config: TrainConfig, timeline: Timeline, out: Path) -> str:
    """Draw a measured step as a picture and a Chrome trace; the picture's path."""
    out.mkdir(parents=True, exist_ok=True)
    title = (f"measured step: {config.schedule}, pp {config.pp}, "
             f"{config.microbatches} microbatches")
    to_png(timeline, out / "timeline.png", title=title)
    write_chrome_trace(timeline, out / "timeline.trace.json")
    return str(out / "timeline.png")


def measured_bubble(timeline: Timeline, schedule: Schedule, step: int) -> dict[str, Any]:
    """The bubble of a measured step beside the simulated bubble of the same schedule at
    the costs fitted from that step (compute only, messages free): their difference is what
    communication and the runtime add."""
    costs = fit_costs(timeline, schedule.num_stages)
    return {"step": step, "measured": timeline.bubble_ratio,
            "simulated": simulate(schedule, costs).bubble_ratio,
            "fitted_costs_s": {"forward": costs.forward, "backward": costs.backward,
                               "backward_input": costs.backward_input,
                               "backward_weight": costs.backward_weight}}


def write_metrics(out: Path, metrics: dict[str, Any]) -> None:
    """metrics.json: the whole history (earlier runs of a resumed one included), the
    evaluations and a summary; loss.png, the picture of that history; the summary line on
    the terminal."""
    records = read_metrics(out / METRICS_FILE)
    history = [r for r in records if "loss" in r]
    metrics["history"] = history
    metrics["eval"] = [r for r in records if "val_loss" in r]
    if history:
        steady = [h["tokens_per_s"] for h in history[1:]] or [history[0]["tokens_per_s"]]
        metrics["summary"] = {"first_loss": history[0]["loss"],
                              "last_loss": history[-1]["loss"],
                              "median_tokens_per_s": sorted(steady)[len(steady) // 2],
                              "skipped_steps": sum(bool(h.get("skipped")) for h in history),
                              "nonfinite_steps": sum(bool(h.get("nonfinite"))
                                                     for h in history)}
    (out / "metrics.json").write_text(dumps(metrics, indent=2))
    summary = metrics.get("summary")
    if summary:
        picture = plot_run(out)
        first, last = summary["first_loss"], summary["last_loss"]
        bubble = metrics.get("bubble")
        bubbles = (f", bubble {100 * bubble['measured']:.1f}% measured vs "
                   f"{100 * bubble['simulated']:.1f}% simulated" if bubble else "")
        steps = f"{len(history)} step{'' if len(history) == 1 else 's'}"
        print(f"loss {_number(first)} -> {_number(last)} over {steps}, "
              f"{summary['median_tokens_per_s']:,.0f} tokens/s{bubbles}; metrics in "
              f"{out / 'metrics.json'}, loss curves in {picture}")


def _number(value: float | None) -> str:
    return "nan" if value is None else f"{value:.3f}"
