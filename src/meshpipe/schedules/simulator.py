"""Discrete-event simulation of a schedule.

``simulate(schedule, costs)`` runs every rank's action list in order under a cost model:
an action starts as soon as its rank is free and its inputs have arrived, so the result is
the earliest possible execution of that exact order, as a ``Timeline``.
"""

from __future__ import annotations
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from meshpipe.schedules.actions import Kind
from meshpipe.schedules.schedule import Schedule
from meshpipe.schedules.costs import CostModel
from meshpipe.schedules.dataflow import (BACKWARD_EDGE, FORWARD, FORWARD_EDGE, GRADIENT,
                                         INPUT_GRADIENT, Rules, Run, Stall, execute)
from meshpipe.schedules.table import B_CODE, F_CODE, I_CODE, KINDS, W_CODE
from meshpipe.schedules.timeline import Timeline
from meshpipe.schedules.validation import ScheduleError


class SimulationDeadlock(ScheduleError):
    """The schedule cannot finish: some rank waits for something that never happens.

    ``rank``, ``index``, ``action`` and ``waiting_for`` locate the first stuck rank; the
    message lists every stuck rank.
    """


@dataclass(frozen=True)
class Simulation:
    """The outcome of ``simulate``: the timeline and what it costs in time and memory."""

    schedule: Schedule
    costs: CostModel
    timeline: Timeline

    @property
    def makespan(self) -> float:
        return self.timeline.makespan

    @property
    def busy(self) -> tuple[float, ...]:
        return self.timeline.busy

    @property
    def bubble_ratios(self) -> tuple[float, ...]:
        return self.timeline.bubble_ratios

    @property
    def bubble_ratio(self) -> float:
        return self.timeline.bubble_ratio

    @cached_property
    def peak_activations(self) -> tuple[int, ...]:
        """Per rank, the most (stage, microbatch) pairs whose activations are live at once."""
        return tuple(int(p) for p in self.timeline.peak_activations())

    @cached_property
    def peak_activation_bytes(self) -> tuple[float, ...] | None:
        """Per rank, the peak live activation size, with what a split backward holds from I
        to W (``costs.held_for_weights``); None without ``costs.activation_bytes``."""
        num_stages = self.schedule.num_stages
        sizes = self.costs.per_stage("activation_bytes", num_stages)
        return None if sizes is None else self.timeline.peak_activations(
            sizes, self.costs.per_stage("held_for_weights", num_stages))

    def summary(self) -> str:
        """One line: makespan, overall bubble and the largest peak of live activations."""
        peak = max(self.peak_activations, default=0)
        return (f"makespan {self.makespan:g}, bubble {100 * self.bubble_ratio:.1f}%, "
                f"peak live activations {peak}")


_EVENT_NAMES = {FORWARD: "F", GRADIENT: "B or I", INPUT_GRADIENT: "I"}
_PRODUCING_KINDS = {FORWARD: (Kind.F,), GRADIENT: (Kind.B, Kind.I), INPUT_GRADIENT: (Kind.I,)}


# Processor sharing: at most this many timings, and the relative change of every duration
# under which the timing counts as settled.
SHARING_ROUNDS = 60
SHARING_TOLERANCE = 1e-6


def simulate(schedule: Schedule, costs: CostModel | None = None, *, cores: float | None = None,
             replicas: int = 1) -> Simulation:
    """Execute ``schedule`` under ``costs`` as early as its order and data flow allow.

    Each rank runs its list in order; a compute action starts when its rank is free and its
    inputs are ready: F(s,m) after F(s-1,m), B or I(s,m) after F(s,m) and the input
    gradient from B or I(s+1,m), W(s,m) after I(s,m), an OVERLAP after both halves'
    inputs; each lasts as ``CostModel`` says (expert-parallel all-to-alls included, hidden
    in an OVERLAP). An input produced on another rank arrives ``costs.comm`` later. SEND/RECV
    actions of a lowered schedule take no time (communication is modelled by ``comm``).
    Runs on the dataflow engine (``dataflow``: the rules without messages). Raises
    ``SimulationDeadlock`` naming the stuck ranks if the schedule cannot finish.

    ``cores``: the ranks share that many cores (processes on one machine) with
    ``replicas - 1`` copies of this pipeline running the same order (data- or
    context-parallel replicas): while ``n`` actions compute at once over all copies, each
    runs at ``min(1, cores / n)`` of its speed, so ``costs`` are the times of an action
    running alone. The timing is a fixed point: time the schedule, stretch each action by
    the sharing it met, time again (``sharing_durations``).
    """
    costs = CostModel() if costs is None else costs
    rules = Rules(schedule, messages=False)
    repeat = rules.first_repeat()
    if repeat is not None:
        _raise_repeat(schedule, rules, *repeat)
    durations = _durations(schedule, costs)
    latencies = _latencies(schedule, costs)
    run = execute(rules, durations, latencies)
    if cores is not None and not isinstance(run, Stall):
        run = _shared(rules, durations, latencies, run, cores, replicas)
    if isinstance(run, Stall):
        raise _deadlock(schedule, rules, run)
    return Simulation(schedule, costs,
                      Timeline.from_table(schedule.table, run.starts, run.ends, origin=0.0))


def _shared(rules: Rules, work: np.ndarray, latencies: dict[int, np.ndarray], run: Run,
            cores: float, replicas: int) -> Run:
    """The run whose durations are ``work`` stretched by the sharing of ``cores`` they meet
    in it (damped iteration from the run without sharing)."""
    durations = work
    for _ in range(SHARING_ROUNDS):
        stretched = sharing_durations(work, run.starts, run.ends, cores, replicas)
        settled = np.allclose(stretched, durations, rtol=SHARING_TOLERANCE, atol=0.0)
        durations = stretched if settled else (durations + stretched) / 2
        run = execute(rules, durations, latencies)
        if settled:
            break
    return run


def sharing_durations(work: np.ndarray, starts: np.ndarray, ends: np.ndarray, cores: float,
                      replicas: int = 1) -> np.ndarray:
    """How long each action with ``work`` seconds of compute takes when it runs at the
    speed ``cores`` allow over the interval it had (``starts``, ``ends``): the actions
    computing at any moment are those intervals, times ``replicas``, and each runs at
    ``min(1, cores / n)`` while ``n`` compute."""
    return work / mean_speeds(starts, ends, cores, replicas)


def mean_speeds(starts: np.ndarray, ends: np.ndarray, cores: float,
                replicas: int = 1) -> np.ndarray:
    """Each interval's mean speed under processor sharing: with ``n`` of the intervals
    (times ``replicas``) open at a moment, each moves at ``min(1, cores / n)``; an empty
    interval shares nothing and moves at full speed."""
    moments = np.unique(np.concatenate([starts, ends]))
    opened = np.searchsorted(np.sort(starts), moments, side="right")
    closed = np.searchsorted(np.sort(ends), moments, side="right")
    running = replicas * (opened - closed)[:-1]
    speed = np.minimum(1.0, cores / np.maximum(running, 1))
    progress = np.concatenate([[0.0], np.cumsum(speed * np.diff(moments))])
    done = np.interp(ends, moments, progress) - np.interp(starts, moments, progress)
    lengths = ends - starts
    return np.divide(done, lengths, out=np.ones(len(lengths)), where=lengths > 0)


def _durations(schedule: Schedule, costs: CostModel) -> np.ndarray:
    """How long each row of the schedule's table lasts (SEND/RECV: 0).

    F, B and I wait for their stage's all-to-alls, W has none (a W adds what it recomputes,
    ``weight_recompute``); an OVERLAP costs the explicit
    ``overlap`` of its forward's stage, else the co-scheduled time (see ``CostModel``): both
    halves' compute back to back, or both all-to-alls if they take longer.
    """
    num_stages = schedule.num_stages
    table = schedule.table
    per_stage = {name: np.asarray(costs.per_stage(name, num_stages), np.float64)
                 for name in ("forward", "backward", "backward_input", "backward_weight",
                              "weight_recompute", "a2a")}
    a2a = per_stage["a2a"]
    by_kind = np.zeros((len(KINDS), num_stages))
    by_kind[F_CODE] = per_stage["forward"] + a2a
    by_kind[B_CODE] = per_stage["backward"] + a2a
    by_kind[I_CODE] = per_stage["backward_input"] + a2a
    by_kind[W_CODE] = per_stage["backward_weight"] + per_stage["weight_recompute"]
    durations = by_kind[table.kind, table.stage]
    if table.overlap_rows.size:
        forward_stage = table.stage[table.overlap_rows]
        backward_stage = table.overlap_stage
        if costs.overlap is not None:
            overlap = np.asarray(costs.per_stage("overlap", num_stages), np.float64)
            durations[table.overlap_rows] = overlap[forward_stage]
        else:
            durations[table.overlap_rows] = np.maximum(
                per_stage["forward"][forward_stage] + per_stage["backward"][backward_stage],
                a2a[forward_stage] + a2a[backward_stage])
    return durations


def _latencies(schedule: Schedule, costs: CostModel) -> dict[int, np.ndarray]:
    """Per edge class, the latency of the input of each stage: from s-1 (forward) or s+1
    (backward) when that stage is on another rank."""
    num_stages, placement = schedule.num_stages, schedule.placement
    comm = costs.per_stage("comm", num_stages)
    return {
        FORWARD_EDGE: np.array([comm[s - 1] if s > 0 and placement[s - 1] != placement[s]
                                else 0.0 for s in range(num_stages)]),
        BACKWARD_EDGE: np.array([comm[s + 1] if s + 1 < num_stages
                                 and placement[s + 1] != placement[s] else 0.0
                                 for s in range(num_stages)]),
    }


def _locate(schedule: Schedule, row: int) -> tuple[int, int]:
    offsets = schedule.table.offsets
    rank = int(np.searchsorted(offsets, row, side="right")) - 1
    return rank, row - int(offsets[rank])


def _raise_repeat(schedule: Schedule, rules: Rules, row: int, event: int) -> None:
    rank, position = _locate(schedule, row)
    space, stage, microbatch = rules.decode(event)
    action = schedule.ranks[rank][position]
    raise ScheduleError(
        f"rank {rank} action #{position} {action}: {_EVENT_NAMES[space]} of stage {stage} "
        f"microbatch {microbatch} runs a second time; each (stage, microbatch) needs "
        f"exactly one F and one B (or one I and one W): check the schedule with "
        f"meshpipe.schedules.validation.validate", rank=rank, index=position, action=action)


def _deadlock(schedule: Schedule, rules: Rules, stall: Stall) -> SimulationDeadlock:
    producers = {}
    for rank, actions in enumerate(schedule.ranks):
        for index, action in enumerate(actions):
            for part in action.computations:
                producers.setdefault((part.kind, part.stage, part.microbatch), (rank, index))
    lines, waits = [], []
    for rank, event in zip(stall.stuck, stall.waiting_for):
        index = int(stall.progress[rank])
        space, stage, microbatch = rules.decode(event)
        kinds = _PRODUCING_KINDS[space]
        wanted = " or ".join(f"{stage}{k.value}{microbatch}" for k in kinds)
        found = [producers[(k, stage, microbatch)] for k in kinds
                 if (k, stage, microbatch) in producers]
        if found:
            where = ", ".join(f"rank {r} action #{i}" for r, i in found)
            reason = f"scheduled at {where}, which never runs"
        else:
            reason = "which no rank runs"
        lines.append(f"rank {rank} is stuck at action #{index} "
                     f"{schedule.ranks[rank][index]}: it waits for {wanted}, {reason}")
        waits.append(wanted)
    first = stall.stuck[0]
    position = int(stall.progress[first])
    return SimulationDeadlock(
        "schedule cannot finish (deadlock): " + "; ".join(lines)
        + ". Reorder the actions so every input is produced before it is needed.",
        rank=first, index=position, action=schedule.ranks[first][position],
        waiting_for=waits[0])
