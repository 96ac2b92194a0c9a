"""The tuner's short training runs (``measure``): a base layout on ``world_size`` processes
(local CPU processes, or under torchrun the job's ranks on their GPUs), the smallest pp
above 1 the world size allows, with 1F1B and with ZB-H1, then in a second phase with 1F1B
at every microbatch size the ranked layouts use (``measured_sizes``, ``measured_phases``),
the runs of a phase taking steps in turn (so a slow spell of the machine touches them
alike). The executor's per-action timeline of each step gives every stage's F and B (1F1B),
I and W (ZB-H1) (``fit_costs``; on shared cores each action shortened to what it would have
taken alone, from the ranks computing beside it), F + B at each microbatch size, what an
input from another rank costs (``fit_message_seconds``) and the pipeline's span, and the
trainer's step time the rest. The same processes time a message between two ranks, an
all-reduce over all of them (at two sizes each: latency and bandwidth), an optimizer step,
and for each cp size the layouts offer, a layer with Ulysses attention over cp ranks against
the same layer on the rank's tokens alone, at the smallest and largest microbatch. Step 2
of ``meshpipe.train.tune.tuner``.
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from meshpipe.context import LocalAttention, UlyssesAttention
from meshpipe.process_exit import under_torchrun
from meshpipe.runtime import activity
from meshpipe.schedules import Timeline, fit_costs
from meshpipe.schedules.costs import fit_message_seconds
from meshpipe.schedules.ranking import (Layout, Link, Prediction, Profile, TuneError, buildable,
                                        layouts, predict)
from meshpipe.schedules.simulator import mean_speeds
from meshpipe.train.config import TrainConfig
from meshpipe.train.run.devices import local_ranks, plan_devices
from meshpipe.train.supervisor import faults
from meshpipe.train.supervisor.launch import Supervision, device_for_this_rank, launch
from meshpipe.train.tune.profile import (UNMEASURED_LINK, clocked, hidden_states, layer_step,
                                         priced_shape, timed_layer)

# Training steps of the measured run; the first is a warm-up and not used.
MEASURE_STEPS = 6
# Repetitions of each timed operation (the median counts).
REPEATS = 7


@dataclass(frozen=True)
class Measurement:
    """What the base layout's short run measured (seconds; per stage, one microbatch)."""

    layout: Layout
    forward: tuple[float, ...]
    backward: tuple[float, ...]
    backward_input: tuple[float, ...]
    backward_weight: tuple[float, ...]
    # Per microbatch size trained (the base size among them): F + B of one microbatch,
    # summed over the stages.
    sizes: tuple[tuple[int, float], ...]
    pipeline_s: float
    step_s: float
    message_s: float | None  # an input from another rank: producer's end to consumer's start
    message: Link
    all_reduce: Link
    optimizer_s_per_parameter: float
    ulysses: tuple[tuple[int, Link], ...] = ()  # per cp: a layer's overhead (``Profile``)


def base_layout(world_size: int, profile: Profile, global_batch: int,
                microbatch_size: int) -> Layout:
    """The layout measured: 1F1B at the smallest pp above 1, one stage per rank, no
    context parallelism, microbatches nearest ``microbatch_size``; one rank: no pipeline."""
    candidates = [layout for layout in layouts(world_size, profile, global_batch)
                  if layout.cp == 1 and layout.vpp == 1 and layout.schedule in ("1f1b", "none")]
    if not candidates:
        raise TuneError(f"world size {world_size} has no layout without context parallelism "
                        f"to measure: use a world size with a pipeline or data-parallel layout")
    return min(candidates, key=lambda layout: (layout.pp == 1, layout.pp,
                                               abs(layout.microbatch_size - microbatch_size),
                                               -layout.microbatches))


def config_for(layout: Layout, config: TrainConfig, **overrides: Any) -> TrainConfig:
    """``config`` with ``layout``'s sizes (cp as Ulysses) and schedule."""
    return replace(config, pp=layout.pp, vpp=layout.vpp, dp=layout.dp, cp_ulysses=layout.cp,
                   cp_ring=1, microbatches=layout.microbatches,
                   microbatch_size=layout.microbatch_size, schedule=layout.schedule,
                   zero=layout.zero, placement="auto", **overrides)


def size_layout(layout: Layout, size: int) -> Layout:
    """``layout`` at microbatches of ``size`` sequences, about as many sequences per step."""
    return replace(layout, microbatch_size=size,
                   microbatches=max(1, layout.microbatches * layout.microbatch_size // size))


def measured_sizes(predictions: list[Prediction], layout: Layout, profile: Profile,
                   memory_budget: float | None = None) -> list[int]:
    """The microbatch sizes to train ``layout`` at: its own, and every size a ranked layout
    uses where ``layout`` at that size can run and fits ``memory_budget``."""
    def runs(sized: Layout) -> bool:
        return buildable(sized) and (memory_budget is None
                                     or predict(sized, profile).peak_bytes <= memory_budget)

    sizes = {prediction.layout.microbatch_size for prediction in predictions}
    return sorted({layout.microbatch_size}
                  | {size for size in sizes if runs(size_layout(layout, size))})


def measured_phases(layout: Layout, sizes: Sequence[int] = ()) -> list[dict[str, Layout]]:
    """The runs measured, in two phases (the runs of a phase take their steps in turn):
    ``fused`` (the base layout) and ``split`` (with ZB-H1, which times I and W apart; where
    it can run), then, with more than one of ``sizes``, one run per microbatch size (the
    base size among them: each size's cost is taken against it, in the same phase).

    The sizes run apart because every run taking its steps in turn slows the others (each
    step starts with caches the other runs filled): with five more runs, the base layout's
    step came out 9-15 % slower than with the split run alone, so the base level is taken
    where fewer runs share the processes and the sizes give only ratios."""
    first = {"fused": layout, "split": replace(layout, schedule="zb-h1")}
    if layout.pp == 1 or not buildable(first["split"]):
        del first["split"]
    if len(sizes) < 2:
        return [first]
    return [first, {f"size {size}": size_layout(layout, size) for size in sizes}]


def run_configs(config: TrainConfig, layout: Layout, sizes: Sequence[int] = (),
                steps: int = MEASURE_STEPS) -> list[list[TrainConfig]]:
    """The measured runs' configs, phase by phase, in ``measured_phases`` order."""
    return [[config_for(measured, config, steps=steps, timeline_step=0, eval_every=0,
                        check=False, progress=False, resume=False, checkpoint_every=0,
                        export="", device=device_for_this_rank().type)
             for measured in phase.values()] for phase in measured_phases(layout, sizes)]


def measure(config: TrainConfig, layout: Layout, sizes: Sequence[int] = (),
            cores: float | None = None,
            ulysses: dict[int, list[int]] | None = None) -> Measurement:
    """Run a few training steps of each of ``measured_phases(layout, sizes)`` on local
    processes (or the job's ranks under torchrun) and time them; ``cores``: the cores they
    share (None: each its own); ``ulysses``: the cp sizes and microbatch sizes to time
    Ulysses at (``ulysses_sizes``)."""
    phases = run_configs(config, layout, sizes)
    first = phases[0][0]
    faults.check_environment(first.world_size)
    logs = Path(tempfile.mkdtemp(prefix="meshpipe-tune-logs-"))
    with tempfile.TemporaryDirectory(prefix="meshpipe-tune-") as tmp:
        result = Path(tmp) / "measured.json"
        launch(_measure_on_this_rank, first.world_size, phases, str(result),
               ulysses or {}, supervision=Supervision(hang_timeout=first.hang_timeout,
                                                      log_dir=logs),
               devices=plan_devices(first.device, "auto", local_ranks(first.world_size)))
        # Only a failed run's logs are kept: its error names them.
        shutil.rmtree(logs, ignore_errors=True)
        return _measurement(layout, json.loads(result.read_text()), sizes, cores)


def _measure_on_this_rank(phases: list[list[TrainConfig]], result_path: str,
                          ulysses: dict[int, list[int]]) -> None:
    """Every rank: each phase's training steps, its runs taking steps in turn (one step of
    each, then the next step of each: a slow spell of the machine touches every run alike,
    so what they differ by is the layouts'); after the first phase, the link, optimizer
    and Ulysses timings. What every rank measured goes to ``result_path``: written by rank
    0 of local processes, by every rank under torchrun (each rank there runs ``tune`` and
    reads its own file)."""
    # Imported here: the trainer is only needed in the measuring processes.
    from meshpipe.train.loop.trainer import Trainer

    torch.set_num_threads(1)
    runs: list[list[dict[str, Any]]] = []
    mine: dict[str, Any] = {}
    for configs in phases:
        trainers = [Trainer(config) for config in configs]
        runs.extend(_steps_in_turn(trainers, configs[0].steps))
        mine = mine or _probes(trainers[0], configs[0], ulysses)
        del trainers  # the next phase's trainers need the memory
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {**mine, "runs": runs})
    if dist.get_rank() == 0 or under_torchrun():
        Path(result_path).write_text(json.dumps(gathered))


def _steps_in_turn(trainers: list[Any], steps: int) -> list[list[dict[str, Any]]]:
    """``steps`` timed steps of each trainer (``_timed_step``), one step of each in turn."""
    runs: list[list[dict[str, Any]]] = [[] for _ in trainers]
    for step in range(steps):
        for trainer, timed in zip(trainers, runs):
            timed.append(_timed_step(trainer, step))
    return runs


def _probes(trainer: Any, config: TrainConfig, ulysses: dict[int, list[int]]
            ) -> dict[str, Any]:
    """This rank's place, and the message, all-reduce, optimizer and Ulysses timings."""
    device = trainer.device
    parameters = [p for _, p in trainer.parameters]
    hidden = config.microbatch_size * config.seq_len // config.layout.cp * config.dim
    return {"pipeline": list(trainer.topology.pipeline_ranks),
            "pp_rank": trainer.topology.pp_rank,
            "message": _message_times(hidden, device),
            "all_reduce": _all_reduce_times(parameters, device),
            "optimizer_s_per_parameter": _optimizer_seconds(trainer) / max(
                1, sum(p.numel() for p in parameters)),
            "ulysses": _ulysses_times(config, ulysses, device)}


def _timed_step(trainer: Any, step: int) -> dict[str, Any]:
    """One step's time and this rank's executor timeline (every rank starts together)."""
    trainer.step = step  # what an injected fault (MESHPIPE_FAULT) counts
    dist.barrier()
    with activity.doing(f"step {step + 1}", step=step + 1):
        stats = trainer.train_step(step)
    return {"seconds": stats.seconds,
            "actions": [(str(t.action), t.start, t.end) for t in trainer.last_result.timeline]}


def _timed(operation: Callable[[], None], device: torch.device) -> float:
    """Median seconds of ``operation`` after one untimed call; every rank calls it."""
    operation()
    return statistics.median(clocked(operation, device, dist.barrier) for _ in range(REPEATS))


def _message_times(hidden_floats: int, device: torch.device) -> list[tuple[int, float]]:
    """One-way seconds of a message rank 0 -> rank 1 (half a ping-pong) of one float and of
    one activation message; the other ranks wait. No points with one rank: nothing travels."""
    if dist.get_world_size() < 2:
        return []
    results = []
    for floats in (1, hidden_floats):
        buffer = torch.zeros(floats, device=device)

        def ping_pong() -> None:
            if dist.get_rank() == 0:
                dist.send(buffer, 1)
                dist.recv(buffer, 1)
            elif dist.get_rank() == 1:
                dist.recv(buffer, 0)
                dist.send(buffer, 0)

        results.append((4 * floats, _timed(ping_pong, device) / 2))
    return results


def _all_reduce_times(parameters: list[torch.nn.Parameter],
                      device: torch.device) -> list[tuple[int, float]]:
    """Seconds of an all-reduce over every rank of one float and of this rank's gradients
    (the largest size over the ranks, so every rank reduces the same tensor)."""
    size = torch.tensor([sum(p.numel() for p in parameters)], device=device)
    dist.all_reduce(size, op=dist.ReduceOp.MAX)
    results = []
    for floats in (1, int(size.item())):
        buffer = torch.zeros(floats, device=device)
        results.append((4 * floats, _timed(lambda: dist.all_reduce(buffer), device)))
    return results


def _ulysses_times(config: TrainConfig, sizes: dict[int, list[int]],
                   device: torch.device) -> list[tuple[int, float, float, float]]:
    """``(cp, hidden bytes, ulysses_s, local_s)`` per cp size and microbatch size of
    ``sizes``: the median seconds of one layer's forward + backward with Ulysses attention
    over cp ranks on this rank's contiguous share of the sequence, and of the same layer
    with local attention on as many tokens shaped as ``layer_curve`` prices them, the two
    taken in turn. The cp groups take turns too, the other ranks waiting at a barrier, so
    that a group shares the machine with nobody."""
    rank, world = dist.get_rank(), dist.get_world_size()
    layer = timed_layer(config, device)
    results = []
    for cp, microbatch_sizes in sizes.items():
        groups = [dist.new_group(list(range(first, first + cp))) for first in range(0, world, cp)]
        member, place = divmod(rank, cp)
        share = config.seq_len // cp
        attentions = {"ulysses": UlyssesAttention(group=groups[member]),
                      "local": LocalAttention()}
        for size in microbatch_sizes:
            inputs = {"ulysses": (
                hidden_states(config, (size, share), device),
                torch.arange(place * share, (place + 1) * share, device=device))}
            rows, length = priced_shape(config, size * share)
            # The whole sequence on one rank: no positions, as the trainer gives it.
            inputs["local"] = (hidden_states(config, (rows, length), device), None)
            for turn in range(len(groups)):
                if turn == member:
                    medians = _medians_in_turn(layer, attentions, inputs, groups[member],
                                               config, device)
                dist.barrier()
            hidden = inputs["ulysses"][0]
            results.append((cp, hidden.element_size() * hidden.numel(),
                            medians["ulysses"], medians["local"]))
    return results


def _medians_in_turn(layer: torch.nn.Module, attentions: dict[str, torch.nn.Module],
                     inputs: dict[str, tuple[torch.Tensor, torch.Tensor | None]],
                     group: dist.ProcessGroup, config: TrainConfig,
                     device: torch.device) -> dict[str, float]:
    """Median seconds of ``layer``'s forward + backward (in ``config``'s precision) with
    each of ``attentions`` on its ``inputs``, the attentions taken in turn, ``REPEATS``
    times after a warm-up round; the ranks of ``group`` start each call together."""
    seconds: dict[str, list[float]] = {name: [] for name in attentions}
    for repeat in range(REPEATS + 1):
        for name, attention in attentions.items():
            layer.attention.core_attention = attention
            hidden, positions = inputs[name]
            call_s = clocked(lambda: layer_step(layer, hidden, positions, config, device),
                             device, lambda: dist.barrier(group))
            if repeat:
                seconds[name].append(call_s)
    return {name: statistics.median(times) for name, times in seconds.items()}


def _ulysses_links(times: list[tuple[int, float, float, float]],
                   cores: float | None) -> tuple[tuple[int, Link], ...]:
    """Per cp: Ulysses' overhead over local attention (``_ulysses_times``) as a line in the
    hidden bytes, each time as if its ranks ran alone (a group of more ranks than ``cores``
    ran at ``cores / cp`` of their speed: ``simulate(..., cores=)`` slows them again)."""
    points: dict[int, list[tuple[float, float]]] = {}
    for cp, size, ulysses_s, local_s in times:
        speed = 1.0 if cores is None else min(1.0, cores / cp)
        points.setdefault(cp, []).append((size, max(0.0, ulysses_s - local_s) * speed))
    return tuple((cp, _link(sorted(found))) for cp, found in sorted(points.items()))


def _optimizer_seconds(trainer: Any) -> float:
    """One AdamW step over this rank's parameters (zero gradients: the run is thrown away)."""
    for _, param in trainer.parameters:
        param.grad = torch.zeros_like(param)
    return _timed(trainer.optimizer.step, trainer.device)


def _link(points: list[tuple[float, float]], factor: float = 1.0) -> Link:
    """The ``Link`` through the first and last ``(bytes, seconds)`` points (bytes
    increasing; ``factor``: the bytes each rank moves per byte given, as in an all-reduce);
    a single point, or times that do not grow with size, is all latency (their mean); no
    points (nothing was sent) is free."""
    if not points:
        return UNMEASURED_LINK
    (small, small_s), (large, large_s) = points[0], points[-1]
    if large <= small or large_s <= small_s:
        return Link(latency=statistics.mean(s for _, s in points), bytes_per_s=1e15)
    per_byte = (large_s - small_s) / (factor * (large - small))
    return Link(latency=max(0.0, small_s - factor * small * per_byte), bytes_per_s=1 / per_byte)


def _measurement(layout: Layout, gathered: list[dict[str, Any]], sizes: Sequence[int] = (),
                 cores: float | None = None) -> Measurement:
    """Fit the costs of rank 0's pipeline from the steps after the first: F, B, the span
    and the step time from the first run, I and W from the ZB-H1 run if there was one,
    F + B at each microbatch size from the size runs (``_size_costs``); with ``cores``,
    each action's time is what it would take alone (``_alone``)."""
    stages = layout.pp * layout.vpp
    runs = {name: run for phase in measured_phases(layout, sizes) for name, run in phase.items()}
    fits = dict(zip(runs, (_fit_run(gathered, run, stages, cores) for run in range(len(runs)))))
    fused, fused_span, _ = fits["fused"]
    split = fits["split"][0] if "split" in fits else None
    hops = [hop for _, _, hop in fits.values() if hop is not None]
    world = len(gathered)
    backward = fused.per_stage("backward", stages)

    def forward_and_backward(name: str) -> float:
        costs = fits[name][0]
        return sum(costs.per_stage("forward", stages) + costs.per_stage("backward", stages))

    return Measurement(
        sizes=_size_costs(layout, {run.microbatch_size: forward_and_backward(name)
                                   for name, run in runs.items() if name.startswith("size")},
                          forward_and_backward("fused")),
        layout=layout, forward=fused.per_stage("forward", stages), backward=backward,
        backward_input=(split.per_stage("backward_input", stages) if split
                        else tuple(b / 2 for b in backward)),
        backward_weight=(split.per_stage("backward_weight", stages) if split
                         else tuple(b / 2 for b in backward)),
        pipeline_s=fused_span, message_s=statistics.median(hops) if hops else None,
        # The upper median, as the span's step is: every step's time covers its span, so
        # the same order statistic of each keeps step_s >= pipeline_s (a mean of the two
        # middle steps could fall below the larger one's span).
        step_s=statistics.median_high(max(g["runs"][0][index]["seconds"] for g in gathered)
                                      for index in range(1, len(gathered[0]["runs"][0]))),
        message=_link(gathered[0]["message"]),
        all_reduce=_link(gathered[0]["all_reduce"], 2 * (world - 1) / world if world > 1
                         else 1.0),
        optimizer_s_per_parameter=statistics.median(g["optimizer_s_per_parameter"]
                                                    for g in gathered),
        ulysses=_ulysses_links(gathered[0]["ulysses"], cores))


def _size_costs(layout: Layout, measured: dict[int, float], base_s: float
                ) -> tuple[tuple[int, float], ...]:
    """F + B per microbatch size, ``measured`` (the size runs) scaled so that the base size
    costs ``base_s`` (the fused run's): the size runs give ratios, the base run the level;
    without size runs, the base size alone."""
    if not measured:
        return ((layout.microbatch_size, base_s),)
    scale = base_s / measured[layout.microbatch_size]
    return tuple((size, seconds * scale) for size, seconds in sorted(measured.items()))


def _fit_run(gathered: list[dict[str, Any]], run: int, stages: int,
             cores: float | None = None):
    """The costs (``fit_costs``), pipeline span and message time (``fit_message_seconds``)
    of run ``run``'s median step (by span) after the first, on rank 0's pipeline; with
    ``cores``, the costs of actions running alone (``_alone``)."""
    pipeline = gathered[0]["pipeline"]
    steps = [{rank: g["runs"][run][index]["actions"] for rank, g in enumerate(gathered)}
             for index in range(1, len(gathered[0]["runs"][run]))]

    def timeline(records: dict[int, list]) -> Timeline:
        return Timeline.from_records([(gathered[rank]["pp_rank"], *action)
                                      for rank in pipeline for action in records[rank]],
                                     num_ranks=len(pipeline))

    timelines = sorted(((timeline(records), records) for records in steps),
                       key=lambda pair: pair[0].makespan)
    median, records = timelines[len(timelines) // 2]
    alone = median if cores is None else timeline(_alone(records, cores))
    return fit_costs(alone, stages), median.makespan, fit_message_seconds(median)


def _alone(records: dict[int, list], cores: float) -> dict[int, list]:
    """Every rank's actions of one step, each shortened to what it would have taken alone:
    while ``n`` ranks computed at once on ``cores`` cores, each ran at ``min(1, cores / n)``
    (the processor sharing ``simulate(..., cores=)`` assumes)."""
    flat = [(rank, action) for rank, actions in records.items() for action in actions]
    starts = np.array([start for _, (_, start, _) in flat])
    ends = np.array([end for _, (_, _, end) in flat])
    speeds = mean_speeds(starts, ends, cores)
    alone: dict[int, list] = {rank: [] for rank in records}
    for (rank, (text, start, end)), speed in zip(flat, speeds):
        alone[rank].append((text, start, start + (end - start) * speed))
    return alone
