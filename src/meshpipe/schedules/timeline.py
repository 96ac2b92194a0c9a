"""Timelines of simulated or measured steps: per rank, the start and end of every action.

A ``Timeline`` is what ``simulate`` yields and equally what a real training step records;
everything derived from it (makespan, bubbles, live activations) and every picture drawn
from it (``render``) works the same for both. The runtime builds its measured timeline from
this module alone.
"""

from __future__ import annotations
import math
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import compress
from operator import attrgetter, sub

from meshpipe.schedules.actions import Action, Kind

# Identities of the compute kinds: membership by id() stays in C (Enum.__hash__ is Python).
_COMPUTE_KIND_IDS = frozenset(id(kind) for kind in Kind if kind.is_compute)
_kind_of = attrgetter("kind")

@dataclass(frozen=True, slots=True)
class TimedAction:
    """One action of one rank with when it started and ended (simulated units or seconds)."""

    rank: int
    action: Action
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


class Timeline:
    """Per rank, the actions it ran in execution order, each with a start and an end.

    Build one from ``TimedAction`` lists (``Timeline([[...], [...]])``) or from flat
    records of measured data (``Timeline.from_records``). ``seconds_per_unit`` says what
    one time unit is (``1.0`` for times measured in seconds; ``None`` for the abstract
    units of a simulation). ``origin`` is time zero of the step, by default the earliest
    start; no action may start before it. Times are kept in flat arrays so that simulating
    millions of actions stays cheap; ``ranks`` materialises the ``TimedAction`` tuples on
    first use.
    """

    def __init__(self, ranks: Iterable[Iterable[TimedAction]], *,
                 origin: float | None = None, seconds_per_unit: float | None = None) -> None:
        actions: list[tuple[Action, ...]] = []
        starts: list[array] = []
        ends: list[array] = []
        for rank, timed in enumerate(ranks):
            timed = tuple(timed)
            for item in timed:
                if not isinstance(item, TimedAction):
                    raise TypeError(f"rank {rank}: a Timeline holds TimedAction values, "
                                    f"got {type(item).__name__}")
                if item.rank != rank:
                    raise ValueError(f"{item.action} says rank {item.rank} but is listed "
                                     f"under rank {rank}")
                if not item.end >= item.start:
                    raise ValueError(f"rank {rank} {item.action}: ends at {item.end} before "
                                     f"it starts at {item.start}")
            actions.append(tuple(item.action for item in timed))
            starts.append(array("d", (item.start for item in timed)))
            ends.append(array("d", (item.end for item in timed)))
        self._init_columns(actions, starts, ends, origin, seconds_per_unit)

    @classmethod
    def from_columns(cls, actions: Sequence[Sequence[Action]], starts: Sequence[Sequence[float]],
                     ends: Sequence[Sequence[float]], *, origin: float | None = None,
                     seconds_per_unit: float | None = None) -> Timeline:
        """Per rank, parallel sequences of actions, start times and end times (the fast
        path ``simulate`` uses: lengths and starts against ``origin`` are checked, ends
        against starts are not)."""
        if not len(actions) == len(starts) == len(ends):
            raise ValueError(f"{len(actions)} action lists, {len(starts)} start lists and "
                             f"{len(ends)} end lists: give one of each per rank")
        for rank, (acts, begin, finish) in enumerate(zip(actions, starts, ends)):
            if not len(acts) == len(begin) == len(finish):
                raise ValueError(f"rank {rank}: {len(acts)} actions, {len(begin)} starts and "
                                 f"{len(finish)} ends: give one start and end per action")
        timeline = cls.__new__(cls)
        timeline._init_columns([tuple(a) for a in actions],
                               [b if isinstance(b, array) else array("d", b) for b in starts],
                               [e if isinstance(e, array) else array("d", e) for e in ends],
                               origin, seconds_per_unit)
        return timeline

    @classmethod
    def from_records(cls, records: Iterable[tuple[int, Action | str, float, float]], *,
                     num_ranks: int | None = None, origin: float | None = None,
                     seconds_per_unit: float | None = 1.0) -> Timeline:
        """Build from ``(rank, action, start, end)`` records, e.g. times measured in a step.

        Actions may be ``Action`` values or their text form (``"1F3"``); times are seconds
        unless ``seconds_per_unit`` says otherwise. Records are grouped by rank and ordered
        by start time; ranks without records get empty lists.
        """
        per_rank: dict[int, list[TimedAction]] = {}
        for rank, action, start, end in records:
            if isinstance(action, str):
                action = Action.parse(action)
            per_rank.setdefault(rank, []).append(
                TimedAction(rank, action, float(start), float(end)))
        count = num_ranks if num_ranks is not None else 1 + max(per_rank, default=-1)
        outside = sorted(r for r in per_rank if not 0 <= r < count)
        if outside:
            raise ValueError(f"records name ranks {outside}, outside 0..{count - 1}")
        ranks = [sorted(per_rank.get(r, ()), key=lambda t: (t.start, t.end)) for r in range(count)]
        return cls(ranks, origin=origin, seconds_per_unit=seconds_per_unit)

    def _init_columns(self, actions: list[tuple[Action, ...]], starts: list[array],
                      ends: list[array], origin: float | None,
                      seconds_per_unit: float | None) -> None:
        self._actions = tuple(actions)
        self._starts = tuple(starts)
        self._ends = tuple(ends)
        earliest = min((min(column) for column in starts if column), default=None)
        if origin is None:
            origin = 0.0 if earliest is None else earliest
        elif earliest is not None and earliest < origin:
            self._raise_start_before(origin)
        self.origin = float(origin)
        self.seconds_per_unit = seconds_per_unit

    def _raise_start_before(self, origin: float) -> None:
        """Name the first action (by rank) that starts before ``origin``."""
        for rank, column in enumerate(self._starts):
            index = next((i for i, start in enumerate(column) if start < origin), None)
            if index is not None:
                raise ValueError(
                    f"rank {rank} action #{index} {self._actions[rank][index]} starts at "
                    f"{column[index]:g}, before the timeline's origin {origin:g}: give an "
                    f"origin at or before the earliest start "
                    f"({min(min(c) for c in self._starts if c):g}), or leave it unset")

    @property
    def num_ranks(self) -> int:
        return len(self._actions)

    @cached_property
    def ranks(self) -> tuple[tuple[TimedAction, ...], ...]:
        """Per rank, a tuple of ``TimedAction`` in execution order."""
        return tuple(self.rank(r) for r in range(self.num_ranks))

    def rank(self, rank: int) -> tuple[TimedAction, ...]:
        """The timed actions of one rank, in execution order."""
        return tuple(TimedAction(rank, a, s, e) for a, s, e in
                     zip(self._actions[rank], self._starts[rank], self._ends[rank]))

    def __iter__(self) -> Iterator[TimedAction]:
        """Every timed action, rank by rank."""
        for rank in range(self.num_ranks):
            yield from self.rank(rank)

    def __len__(self) -> int:
        return sum(len(actions) for actions in self._actions)

    @cached_property
    def end(self) -> float:
        """When the last action ends."""
        return max((max(column) for column in self._ends if column), default=self.origin)

    @property
    def makespan(self) -> float:
        """Time from the origin until the last action ends."""
        return max(0.0, self.end - self.origin)

    @cached_property
    def busy(self) -> tuple[float, ...]:
        """Per rank, the total time spent in compute actions (sends and receives excluded)."""
        return tuple(
            math.fsum(compress(map(sub, ends, starts),
                               map(_COMPUTE_KIND_IDS.__contains__,
                                   map(id, map(_kind_of, acts)))))
            for acts, starts, ends in zip(self._actions, self._starts, self._ends))

    @property
    def bubble_ratios(self) -> tuple[float, ...]:
        """Per rank, the fraction of the makespan it spent idle."""
        span = self.makespan
        return tuple(0.0 if span == 0 else max(0.0, span - b) / span for b in self.busy)

    @property
    def bubble_ratio(self) -> float:
        """Idle time of all ranks over ``num_ranks * makespan``."""
        total = self.num_ranks * self.makespan
        return 0.0 if total == 0 else max(0.0, total - math.fsum(self.busy)) / total

    @cached_property
    def forward_only(self) -> bool:
        return not any(p.kind.is_backward for acts in self._actions
                       for a in acts for p in a.computations)

    def peak_activations(self, activation_bytes: Sequence[float] | None = None
                         ) -> tuple[float, ...]:
        """Per rank, the peak of live activations: a count, or bytes if sizes are given.

        A (stage, microbatch) pair is live from the start of its forward until the end of
        its backward (of its W for a split backward); in a forward-only timeline, until
        the end of its forward. ``activation_bytes[stage]`` weighs each pair; without it
        each pair counts 1. Each rank's actions are swept in execution order.
        """
        forward_only = self.forward_only
        return tuple(_peak_live(actions, activation_bytes, forward_only)
                     for actions in self._actions)

    def __repr__(self) -> str:
        return (f"Timeline({self.num_ranks} ranks, {len(self)} actions, "
                f"makespan={self.makespan:g})")


def _peak_live(actions: Sequence[Action], weights: Sequence[float] | None,
               forward_only: bool) -> float:
    """Sweep one rank's actions in order: a forward adds its pair when it starts, a B or W
    (or, forward-only, the forward itself) removes it when it ends."""
    kind_f, kind_overlap, releases = Kind.F, Kind.OVERLAP, (Kind.B, Kind.W)
    live = peak = 0
    for action in actions:
        kind = action.kind
        if kind is kind_f:
            weight = 1 if weights is None else weights[action.stage]
            live += weight
            if live > peak:
                peak = live
            if forward_only:
                live -= weight
        elif kind in releases:
            live -= 1 if weights is None else weights[action.stage]
        elif kind is kind_overlap:
            forward_half, backward_half = action.parts
            live += 1 if weights is None else weights[forward_half.stage]
            if live > peak:
                peak = live
            live -= 1 if weights is None else weights[backward_half.stage]
    return peak

