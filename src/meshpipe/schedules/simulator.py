"""Discrete-event simulation of a schedule.

``simulate(schedule, costs)`` runs every rank's action list in order under a cost model:
an action starts as soon as its rank is free and its inputs have arrived, so the result is
the earliest possible execution of that exact order, as a ``Timeline``.
"""

from __future__ import annotations
from array import array
from dataclasses import dataclass
from functools import cached_property
from operator import add

from meshpipe.schedules.actions import Action, Kind, Schedule
from meshpipe.schedules.costs import CostModel
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
        """Per rank, the peak live activation size; None without ``costs.activation_bytes``."""
        sizes = self.costs.per_stage("activation_bytes", self.schedule.num_stages)
        return None if sizes is None else self.timeline.peak_activations(sizes)

    def summary(self) -> str:
        """One line: makespan, overall bubble and the largest peak of live activations."""
        peak = max(self.peak_activations, default=0)
        return (f"makespan {self.makespan:g}, bubble {100 * self.bubble_ratio:.1f}%, "
                f"peak live activations {peak}")


# Token spaces of the simulation: what a finished action makes available.
_FORWARD_DONE, _GRAD_DONE, _INPUT_GRAD_DONE = 0, 1, 2
_TOKEN_NAMES = {_FORWARD_DONE: "F", _GRAD_DONE: "B or I", _INPUT_GRAD_DONE: "I"}


def simulate(schedule: Schedule, costs: CostModel | None = None) -> Simulation:
    """Execute ``schedule`` under ``costs`` as early as its order and data flow allow.

    Each rank runs its list in order; a compute action starts when its rank is free and its
    inputs are ready: F(s,m) after F(s-1,m), B or I(s,m) after F(s,m) and the input
    gradient from B or I(s+1,m), W(s,m) after I(s,m), an OVERLAP after both halves'
    inputs; each lasts as ``CostModel`` says (expert-parallel all-to-alls included, hidden
    in an OVERLAP). An input produced on another rank arrives ``costs.comm`` later. SEND/RECV
    actions of a lowered schedule take no time (communication is modelled by ``comm``).
    Raises ``SimulationDeadlock`` naming the stuck ranks if the schedule cannot finish.
    """
    costs = CostModel() if costs is None else costs
    return Simulation(schedule, costs, _Simulator(schedule, costs).run())


def _plus(costs: tuple[float, ...], extra: tuple[float, ...]) -> tuple[float, ...]:
    """Per stage, ``costs + extra`` (exactly ``costs`` where ``extra`` is 0)."""
    return tuple(map(add, costs, extra))


class _Simulator:
    """The event-driven core: each rank advances until an input is missing, then parks
    on that input until the action producing it ends. Linear in the number of actions."""

    def __init__(self, schedule: Schedule, costs: CostModel) -> None:
        self.schedule = schedule
        num_stages = schedule.num_stages
        placement = schedule.placement
        # What an OVERLAP co-schedules: compute on one stream, all-to-alls on the other.
        self.forward_compute = costs.per_stage("forward", num_stages)
        self.backward_compute = costs.per_stage("backward", num_stages)
        self.a2a = costs.per_stage("a2a", num_stages)
        # How long each plain kind lasts, read by the hot loop: F, B and I wait for their
        # stage's all-to-alls, W has none.
        self.forward = _plus(self.forward_compute, self.a2a)
        self.backward = _plus(self.backward_compute, self.a2a)
        self.backward_input = _plus(costs.per_stage("backward_input", num_stages), self.a2a)
        self.backward_weight = costs.per_stage("backward_weight", num_stages)
        self.overlap = costs.per_stage("overlap", num_stages)
        comm = costs.per_stage("comm", num_stages)
        # Latency of the input of stage s: from s-1 (forward) or s+1 (backward).
        self.forward_latency = tuple(
            comm[s - 1] if s > 0 and placement[s - 1] != placement[s] else 0.0
            for s in range(num_stages))
        self.backward_latency = tuple(
            comm[s + 1] if s + 1 < num_stages and placement[s + 1] != placement[s] else 0.0
            for s in range(num_stages))
        size = num_stages * schedule.num_microbatches
        # End time of each token (index stage * M + microbatch); -1 while not produced.
        self.done = [array("d", [-1.0]) * size for _ in range(3)]
        self.waiting: list[dict[int, list[int]]] = [{}, {}, {}]

    def run(self) -> Timeline:
        schedule = self.schedule
        num_ranks = schedule.num_ranks
        self.position = [0] * num_ranks
        self.clock = [0.0] * num_ranks
        self.starts = [array("d", bytes(8 * len(actions))) for actions in schedule.ranks]
        self.ends = [array("d", bytes(8 * len(actions))) for actions in schedule.ranks]
        self.blocked_on: list[tuple[int, int] | None] = [None] * num_ranks
        runnable = list(range(num_ranks))
        while runnable:
            runnable.extend(self._advance(runnable.pop()))
        stuck = [r for r in range(num_ranks) if self.position[r] < len(schedule.ranks[r])]
        if stuck:
            raise self._deadlock(stuck)
        return Timeline.from_columns(schedule.ranks, self.starts, self.ends, origin=0.0)

    def _advance(self, rank: int) -> list[int]:
        """Run ``rank`` until it finishes or waits; return the ranks its actions woke up.

        The hot loop of the simulator: plain kinds are handled inline with local names
        (millions of actions at p=512); OVERLAP and SEND/RECV take the slower general path.
        """
        actions = self.schedule.ranks[rank]
        num_microbatches = self.schedule.num_microbatches
        last_stage = self.schedule.num_stages - 1
        forward_done, grad_done, input_grad_done = self.done
        forward_waiting, grad_waiting, input_grad_waiting = self.waiting
        forward, backward = self.forward, self.backward
        backward_input, backward_weight = self.backward_input, self.backward_weight
        forward_latency, backward_latency = self.forward_latency, self.backward_latency
        kind_f, kind_b, kind_i, kind_w, kind_overlap = Kind.F, Kind.B, Kind.I, Kind.W, Kind.OVERLAP
        starts, ends = self.starts[rank], self.ends[rank]
        woken: list[int] = []
        position = self.position[rank]
        clock = self.clock[rank]
        count = len(actions)
        while position < count:
            action = actions[position]
            kind = action.kind
            if kind is kind_f:
                stage = action.stage
                token = stage * num_microbatches + action.microbatch
                if stage:
                    ready = forward_done[token - num_microbatches]
                    if ready < 0:
                        self._park(rank, _FORWARD_DONE, token - num_microbatches)
                        break
                    ready += forward_latency[stage]
                    if ready > clock:
                        clock = ready
                start = clock
                clock += forward[stage]
                if forward_done[token] >= 0:
                    self._duplicate(rank, position, _FORWARD_DONE, token)
                forward_done[token] = clock
                if forward_waiting and token in forward_waiting:
                    woken.extend(forward_waiting.pop(token))
            elif kind is kind_b or kind is kind_i:
                stage = action.stage
                token = stage * num_microbatches + action.microbatch
                ready = forward_done[token]
                if ready < 0:
                    self._park(rank, _FORWARD_DONE, token)
                    break
                if stage < last_stage:
                    grad = grad_done[token + num_microbatches]
                    if grad < 0:
                        self._park(rank, _GRAD_DONE, token + num_microbatches)
                        break
                    grad += backward_latency[stage]
                    if grad > ready:
                        ready = grad
                if ready > clock:
                    clock = ready
                start = clock
                if kind is kind_b:
                    clock += backward[stage]
                else:
                    clock += backward_input[stage]
                    input_grad_done[token] = clock
                    if input_grad_waiting and token in input_grad_waiting:
                        woken.extend(input_grad_waiting.pop(token))
                if grad_done[token] >= 0:
                    self._duplicate(rank, position, _GRAD_DONE, token)
                grad_done[token] = clock
                if grad_waiting and token in grad_waiting:
                    woken.extend(grad_waiting.pop(token))
            elif kind is kind_w:
                stage = action.stage
                token = stage * num_microbatches + action.microbatch
                ready = input_grad_done[token]
                if ready < 0:
                    self._park(rank, _INPUT_GRAD_DONE, token)
                    break
                if ready > clock:
                    clock = ready
                start = clock
                clock += backward_weight[stage]
            elif kind is kind_overlap:
                ready = self._overlap_ready(rank, action)
                if ready is None:
                    break
                start = max(clock, ready)
                clock = start + self._overlap_cost(action)
                for part in action.parts:
                    token = part.stage * num_microbatches + part.microbatch
                    self._produce(rank, position, _FORWARD_DONE if part.kind is kind_f
                                  else _GRAD_DONE, token, clock, woken)
            else:
                start = clock
            starts[position] = start
            ends[position] = clock
            position += 1
        self.position[rank] = position
        self.clock[rank] = clock
        return woken

    def _overlap_ready(self, rank: int, action: Action) -> float | None:
        """When both halves' inputs are ready, or None after parking on a missing one."""
        forward_part, backward_part = action.parts
        num_microbatches = self.schedule.num_microbatches
        needs = []
        if forward_part.stage:
            needs.append((_FORWARD_DONE, forward_part, -1, self.forward_latency))
        needs.append((_FORWARD_DONE, backward_part, 0, None))
        if backward_part.stage < self.schedule.num_stages - 1:
            needs.append((_GRAD_DONE, backward_part, +1, self.backward_latency))
        ready = 0.0
        for space, part, offset, latency in needs:
            token = (part.stage + offset) * num_microbatches + part.microbatch
            end = self.done[space][token]
            if end < 0:
                self._park(rank, space, token)
                return None
            ready = max(ready, end + (latency[part.stage] if latency else 0.0))
        return ready

    def _overlap_cost(self, action: Action) -> float:
        """The explicit ``overlap`` cost, else the co-scheduled time (see ``CostModel``):
        both halves' compute back to back, or both all-to-alls if they take longer."""
        forward_stage, backward_stage = (part.stage for part in action.parts)
        if self.overlap is not None:
            return self.overlap[forward_stage]
        return max(self.forward_compute[forward_stage] + self.backward_compute[backward_stage],
                   self.a2a[forward_stage] + self.a2a[backward_stage])

    def _park(self, rank: int, space: int, token: int) -> None:
        self.waiting[space].setdefault(token, []).append(rank)
        self.blocked_on[rank] = (space, token)

    def _produce(self, rank: int, position: int, space: int, token: int, end: float,
                 woken: list[int]) -> None:
        done = self.done[space]
        if done[token] >= 0:
            self._duplicate(rank, position, space, token)
        done[token] = end
        waiters = self.waiting[space].pop(token, None)
        if waiters:
            woken.extend(waiters)

    def _duplicate(self, rank: int, position: int, space: int, token: int) -> None:
        stage, microbatch = divmod(token, self.schedule.num_microbatches)
        action = self.schedule.ranks[rank][position]
        raise ScheduleError(
            f"rank {rank} action #{position} {action}: {_TOKEN_NAMES[space]} of stage {stage} "
            f"microbatch {microbatch} runs a second time; each (stage, microbatch) needs "
            f"exactly one F and one B (or one I and one W): check the schedule with "
            f"meshpipe.schedules.validation.validate", rank=rank, index=position, action=action)

    def _deadlock(self, stuck: list[int]) -> SimulationDeadlock:
        schedule = self.schedule
        producers = {}
        for rank, actions in enumerate(schedule.ranks):
            for index, action in enumerate(actions):
                for part in action.computations:
                    producers.setdefault((part.kind, part.stage, part.microbatch), (rank, index))
        lines, waits = [], []
        for rank in stuck:
            index = self.position[rank]
            space, token = self.blocked_on[rank]
            stage, microbatch = divmod(token, schedule.num_microbatches)
            kinds = {_FORWARD_DONE: (Kind.F,), _GRAD_DONE: (Kind.B, Kind.I),
                     _INPUT_GRAD_DONE: (Kind.I,)}[space]
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
        first = stuck[0]
        return SimulationDeadlock(
            "schedule cannot finish (deadlock): " + "; ".join(lines)
            + ". Reorder the actions so every input is produced before it is needed.",
            rank=first, index=self.position[first],
            action=schedule.ranks[first][self.position[first]], waiting_for=waits[0])
