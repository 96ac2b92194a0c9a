"""Timelines of simulated or measured steps: per rank, the start and end of every action.

A ``Timeline`` is what ``simulate`` yields and equally what a real training step records;
everything derived from it (makespan, bubbles, live activations) and every picture drawn
from it (``render``) works the same for both. The runtime builds its measured timeline from
this module alone.
"""

from __future__ import annotations
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from meshpipe.schedules.actions import Action
from meshpipe.schedules.table import (B_CODE, F_CODE, FIRST_COMM, I_CODE, OVERLAP_CODE,
                                      W_CODE, ActionTable)

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
        starts: list[float] = []
        ends: list[float] = []
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
            starts.extend(item.start for item in timed)
            ends.extend(item.end for item in timed)
        self._init_columns(ActionTable.from_actions(actions), np.array(starts, np.float64),
                           np.array(ends, np.float64), origin, seconds_per_unit)

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
        return cls.from_table(ActionTable.from_actions(actions),
                              np.concatenate([np.asarray(b, np.float64) for b in starts])
                              if starts else np.zeros(0),
                              np.concatenate([np.asarray(e, np.float64) for e in ends])
                              if ends else np.zeros(0),
                              origin=origin, seconds_per_unit=seconds_per_unit)

    @classmethod
    def from_table(cls, table: ActionTable, starts: np.ndarray, ends: np.ndarray, *,
                   origin: float | None = None,
                   seconds_per_unit: float | None = None) -> Timeline:
        """The actions of ``table`` with one start and end per row (the path ``simulate``
        takes: no ``Action`` objects are made)."""
        timeline = cls.__new__(cls)
        timeline._init_columns(table, np.asarray(starts, np.float64),
                               np.asarray(ends, np.float64), origin, seconds_per_unit)
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

    def _init_columns(self, table: ActionTable, starts: np.ndarray, ends: np.ndarray,
                      origin: float | None, seconds_per_unit: float | None) -> None:
        self._table = table
        self._starts = starts
        self._ends = ends
        earliest = float(starts.min()) if starts.size else None
        if origin is None:
            origin = 0.0 if earliest is None else earliest
        elif earliest is not None and earliest < origin:
            self._raise_start_before(origin)
        self.origin = float(origin)
        self.seconds_per_unit = seconds_per_unit

    def _raise_start_before(self, origin: float) -> None:
        """Name the first action (by rank) that starts before ``origin``."""
        row = int(np.argmax(self._starts < origin))
        rank = int(np.searchsorted(self._table.offsets, row, side="right")) - 1
        index = row - int(self._table.offsets[rank])
        raise ValueError(
            f"rank {rank} action #{index} {self._table.action(row)} starts at "
            f"{self._starts[row]:g}, before the timeline's origin {origin:g}: give an "
            f"origin at or before the earliest start ({self._starts.min():g}), or leave "
            f"it unset")

    def _rows(self, rank: int) -> slice:
        return slice(int(self._table.offsets[rank]), int(self._table.offsets[rank + 1]))

    @property
    def num_ranks(self) -> int:
        return self._table.num_ranks

    @cached_property
    def ranks(self) -> tuple[tuple[TimedAction, ...], ...]:
        """Per rank, a tuple of ``TimedAction`` in execution order."""
        return tuple(self.rank(r) for r in range(self.num_ranks))

    def rank(self, rank: int) -> tuple[TimedAction, ...]:
        """The timed actions of one rank, in execution order."""
        rows = self._rows(rank)
        return tuple(TimedAction(rank, a, s, e) for a, s, e in
                     zip(self._table.rank_actions(rank), self._starts[rows].tolist(),
                         self._ends[rows].tolist()))

    def __iter__(self) -> Iterator[TimedAction]:
        """Every timed action, rank by rank."""
        for rank in range(self.num_ranks):
            yield from self.rank(rank)

    def __len__(self) -> int:
        return len(self._table)

    @cached_property
    def end(self) -> float:
        """When the last action ends."""
        return float(self._ends.max()) if self._ends.size else self.origin

    @property
    def makespan(self) -> float:
        """Time from the origin until the last action ends."""
        return max(0.0, self.end - self.origin)

    @cached_property
    def busy(self) -> tuple[float, ...]:
        """Per rank, the total time spent in compute actions (sends and receives excluded)."""
        durations = self._ends - self._starts
        compute = self._table.kind < FIRST_COMM
        return tuple(math.fsum(durations[rows][compute[rows]].tolist())
                     for rows in map(self._rows, range(self.num_ranks)))

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
        table = self._table
        return not (table.overlap_rows.size or np.isin(table.kind, (B_CODE, I_CODE, W_CODE)).any())

    def peak_activations(self, activation_bytes: Sequence[float] | None = None,
                         held_for_weights: Sequence[float] | None = None
                         ) -> tuple[float, ...]:
        """Per rank, the peak of live activations: a count, or bytes if sizes are given.

        A (stage, microbatch) pair is live from the start of its forward until the end of
        its backward (of its W for a split backward); in a forward-only timeline, until
        the end of its forward. ``activation_bytes[stage]`` weighs each pair; without it
        each pair counts 1. With sizes, ``held_for_weights[stage]`` is live too from the
        start of a pair's I to the end of its W. Each rank's actions are swept in execution
        order.
        """
        held = held_for_weights if activation_bytes is not None else None
        adds, removes = _live_changes(self._table, activation_bytes, self.forward_only, held)
        peaks = tuple(_peak_live(adds[rows], removes[rows])
                      for rows in map(self._rows, range(self.num_ranks)))
        return peaks if activation_bytes is not None else tuple(int(p) for p in peaks)

    def __repr__(self) -> str:
        return (f"Timeline({self.num_ranks} ranks, {len(self)} actions, "
                f"makespan={self.makespan:g})")


def _live_changes(table: ActionTable, weights: Sequence[float] | None, forward_only: bool,
                  held: Sequence[float] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the activations it makes live (when it starts) and frees (when it ends): a
    forward (or an OVERLAP's forward half) adds its pair, a B or W (an OVERLAP's backward
    half; forward-only, the forward itself) frees one. ``weights[stage]`` weighs a pair;
    ``held[stage]`` is added by an I and freed by its W."""
    weight = (np.ones(max(1, int(table.stage.max(initial=0)) + 1)) if weights is None
              else np.asarray(weights, np.float64))
    kind = table.kind
    adds_pair = (kind == F_CODE) | (kind == OVERLAP_CODE)
    adds = np.where(adds_pair, weight[table.stage], 0.0)
    frees = (kind == F_CODE) if forward_only else (kind == B_CODE) | (kind == W_CODE)
    removes = np.where(frees, weight[table.stage], 0.0)
    if table.overlap_rows.size:
        removes[table.overlap_rows] = weight[table.overlap_stage]
    if held is not None:
        held_here = np.asarray(held, np.float64)[table.stage]
        adds += np.where(kind == I_CODE, held_here, 0.0)
        removes += np.where(kind == W_CODE, held_here, 0.0)
    return adds, removes


def _peak_live(adds: np.ndarray, removes: np.ndarray) -> float:
    """One rank's peak of live activations, its rows swept in execution order."""
    if not adds.size:
        return 0.0
    live_before = np.zeros(adds.size)
    np.cumsum((adds - removes)[:-1], out=live_before[1:])
    candidates = (live_before + adds)[adds > 0]
    return max(0.0, float(candidates.max())) if candidates.size else 0.0
