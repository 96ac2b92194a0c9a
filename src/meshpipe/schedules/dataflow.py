"""The dataflow rules of a schedule, written once, and the engine that runs them.

**Rules.** Every action waits for *events* and makes events happen. An event is named by
its space and a (stage, microbatch) slot: ``event = space * S * M + stage * M + microbatch``.

============  ===========================================  ================================
action        waits for, in this order                     makes happen
============  ===========================================  ================================
F(s, m)       s > 0: the output of F(s-1, m) (1)           FORWARD(s, m)
B or I(s, m)  FORWARD(s, m); s < last: the input gradient   GRADIENT(s, m), and for I
              of B/I(s+1, m) (1)                            INPUT_GRADIENT(s, m)
W(s, m)       INPUT_GRADIENT(s, m)                         nothing
SEND_F(s, m)  FORWARD(s, m)                                SENT_F(s, m)
SEND_B(s, m)  GRADIENT(s, m)                               SENT_B(s, m)
RECV_F/B      nothing (a receive only posts)               RECEIVED_F/B(s, m)
============  ===========================================  ================================

(1) *With messages* (a lowered schedule, as validation runs it) an input from another rank
is two events: the receive posted on this rank (RECEIVED_F(s, m) or RECEIVED_B(s, m)) and
the send posted on the peer (SENT_F(s-1, m) or SENT_B(s+1, m)). *Without messages* (the
simulation, and validation of a compute-only schedule) it is the producing action itself,
with an edge latency when it runs on another rank, and SEND/RECV actions wait for nothing
and make nothing happen. An OVERLAP waits for what both halves wait for, the forward's
first, and makes both halves' events happen.

**Engine.** Each event has one producing action, so every wait is a wait on an action.
Waits on an earlier action of the same rank are met by running in order; the others make
their action a *gate*. Between gates a rank runs without waiting, so the engine advances
in rounds over gates: in each round, every rank whose current gate's producers have all
run passes it (numpy over all ranks at once). A schedule of tens of millions of actions
takes about as many rounds as its longest rank has gates. With durations the engine also
gives every action's start and end, the earliest execution of that order. A round where
no rank can move is a stall: the schedule cannot finish, and ``Stall`` says where.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from meshpipe.schedules.schedule import Schedule
from meshpipe.schedules.table import (B_CODE, F_CODE, I_CODE, OVERLAP_CODE, RECV_B_CODE,
                                      RECV_F_CODE, SEND_B_CODE, SEND_F_CODE, W_CODE,
                                      ActionTable, Parts)

FORWARD, GRADIENT, INPUT_GRADIENT, SENT_F, SENT_B, RECEIVED_F, RECEIVED_B = range(7)
NUM_SPACES = 7
# How far an input travels: not at all, or along a forward or backward stage edge.
LOCAL, FORWARD_EDGE, BACKWARD_EDGE = 0, 1, 2


# The rules as tables, by case: a unit's kind picks its first case, and an input from a
# neighbour stage adds 1 (at hand: on the same rank, or without messages) or 2 (a message).
# Per case, three waits in rule order: the event space (-1: none), whether the slot is the
# input's (the neighbour stage) or the unit's own, and the edge the input crosses.
_CASE_OF_KIND = np.full(16, 9, np.int64)  # a RECV, or an inert unit (kind -1: the last entry)
_CASE_OF_KIND[[F_CODE, B_CODE, I_CODE, W_CODE, SEND_F_CODE, SEND_B_CODE]] = [0, 3, 3, 6, 7, 8]
_OWN, _INPUT = False, True
_CASES = (  # (space, slot, edge) per wait
    (),                                                                   # F of stage 0
    ((FORWARD, _INPUT, FORWARD_EDGE),),                                   # F, input at hand
    ((RECEIVED_F, _OWN, LOCAL), (SENT_F, _INPUT, LOCAL)),                 # F, by message
    ((FORWARD, _OWN, LOCAL),),                                            # B/I of last stage
    ((FORWARD, _OWN, LOCAL), (GRADIENT, _INPUT, BACKWARD_EDGE)),          # B/I, at hand
    ((FORWARD, _OWN, LOCAL), (RECEIVED_B, _OWN, LOCAL), (SENT_B, _INPUT, LOCAL)),  # message
    ((INPUT_GRADIENT, _OWN, LOCAL),),                                     # W
    ((FORWARD, _OWN, LOCAL),),                                            # SEND_F
    ((GRADIENT, _OWN, LOCAL),),                                           # SEND_B
    (),                                                                   # RECV, or inert
)
_WAIT_COUNT = np.array([len(waits) for waits in _CASES], np.int64)
_WAIT_SPACE = np.full((len(_CASES), 3), -1, np.int64)
_WAITS_ON_INPUT = np.zeros((len(_CASES), 3), bool)
_WAIT_EDGE = np.zeros((len(_CASES), 3), np.int8)
for _case, _waits in enumerate(_CASES):
    for _column, (_space, _slot, _edge) in enumerate(_waits):
        _WAIT_SPACE[_case, _column] = _space
        _WAITS_ON_INPUT[_case, _column] = _slot
        _WAIT_EDGE[_case, _column] = _edge


@dataclass(frozen=True)
class Needs:
    """Every wait of every action, in rule order (rows increasing): the waiting ``row``, the
    ``event`` it waits for, the ``edge`` the input crosses and the waiting part's ``stage``
    (which with the edge picks a latency)."""

    row: np.ndarray
    event: np.ndarray
    edge: np.ndarray
    stage: np.ndarray


@dataclass(frozen=True)
class Effects:
    """Every event an action makes happen: ``row`` makes ``event`` happen."""

    row: np.ndarray
    event: np.ndarray


class Rules:
    """The rules of the module doc applied to one schedule, a range of rows at a time (so
    that the temporaries of a schedule of millions of actions stay small)."""

    def __init__(self, schedule: Schedule, *, messages: bool) -> None:
        self.schedule = schedule
        self.messages = messages
        self.table: ActionTable = schedule.table
        self.size = schedule.num_stages * schedule.num_microbatches
        self.row_index = np.int32 if len(self.table) < 1 << 31 else np.int64
        self._placement = np.asarray(schedule.placement, np.int32)
        self.ranges = self.table.ranges

    def _units(self, begin: int, end: int) -> tuple[Parts, Parts]:
        """The acting units of rows ``begin:end``: one per row (an OVERLAP's forward half;
        without messages a SEND/RECV has kind -1 and does nothing), and the backward halves
        of the OVERLAPs among them."""
        table = self.table
        kind = table.kind[begin:end]
        plain = (np.where(kind == OVERLAP_CODE, np.int8(F_CODE), kind)
                 if table.overlap_rows.size else kind)
        if not self.messages:
            plain = np.where(kind >= SEND_F_CODE, np.int8(-1), plain)
        rows = Parts(np.arange(begin, end), plain, table.stage[begin:end],
                     table.microbatch[begin:end])
        first, last = np.searchsorted(table.overlap_rows, (begin, end))
        halves = Parts(table.overlap_rows[first:last], np.full(last - first, B_CODE, np.int8),
                       table.overlap_stage[first:last], table.overlap_microbatch[first:last])
        return rows, halves

    def needs(self, begin: int, end: int) -> Needs:
        """The waits of the actions of rows ``begin:end``, in rule order."""
        rows, halves = self._units(begin, end)
        own = self._needs_of(rows)
        if not halves.row.size:
            return own
        theirs = self._needs_of(halves)
        order = np.argsort(np.concatenate([own.row * 2, theirs.row * 2 + 1]), kind="stable")
        return Needs(*(np.concatenate([mine, other])[order] for mine, other in
                       zip((own.row, own.event, own.edge, own.stage),
                           (theirs.row, theirs.event, theirs.edge, theirs.stage))))

    def _needs_of(self, units: Parts) -> Needs:
        """The waits of each unit, units in order, each unit's waits in rule order."""
        num_microbatches = self.schedule.num_microbatches
        last = self.schedule.num_stages - 1
        kind, stage = units.kind, units.stage.astype(np.int64)
        is_f, is_gradient = kind == F_CODE, (kind == B_CODE) | (kind == I_CODE)
        has_input = (is_f & (stage > 0)) | (is_gradient & (stage < last))
        neighbour = np.where(is_f, stage - 1, stage + 1)
        neighbour[~has_input] = 0
        case = _CASE_OF_KIND[kind] + has_input
        if self.messages:
            case += has_input & (self._placement[neighbour] != self._ranks_of_units(units))
        slot = stage * num_microbatches + units.microbatch
        input_slot = neighbour * num_microbatches + units.microbatch
        count = _WAIT_COUNT[case]
        total = int(count.sum())
        first = np.cumsum(count) - count  # each unit's first place in the flat lists
        row, event = np.empty(total, units.row.dtype), np.empty(total, np.int64)
        edge, waiting_stage = np.empty(total, np.int8), np.empty(total, units.stage.dtype)
        for column in range(_WAIT_SPACE.shape[1]):
            chosen = np.flatnonzero(count > column)
            if not chosen.size:
                break
            at, chosen_case = first[chosen] + column, case[chosen]
            row[at] = units.row[chosen]
            waiting_stage[at] = units.stage[chosen]
            edge[at] = _WAIT_EDGE[chosen_case, column]
            event[at] = _WAIT_SPACE[chosen_case, column] * self.size + np.where(
                _WAITS_ON_INPUT[chosen_case, column], input_slot[chosen], slot[chosen])
        return Needs(row, event, edge, waiting_stage)

    def effects(self, begin: int, end: int) -> Effects:
        """The events the actions of rows ``begin:end`` make happen."""
        rows, halves = self._units(begin, end)
        made = [self._effects_of(rows), self._effects_of(halves)]
        return Effects(np.concatenate([e.row for e in made]),
                       np.concatenate([e.event for e in made]))

    def _effects_of(self, units: Parts) -> Effects:
        size = self.size
        kind = units.kind
        slot = units.stage.astype(np.int64) * self.schedule.num_microbatches + units.microbatch
        space = np.full(kind.size, -1, np.int64)
        for chosen, value in ((kind == F_CODE, FORWARD),
                              ((kind == B_CODE) | (kind == I_CODE), GRADIENT),
                              (kind == SEND_F_CODE, SENT_F), (kind == SEND_B_CODE, SENT_B),
                              (kind == RECV_F_CODE, RECEIVED_F), (kind == RECV_B_CODE, RECEIVED_B)):
            space[chosen] = value
        acting, inputs = space >= 0, kind == I_CODE
        return Effects(np.concatenate([units.row[acting], units.row[inputs]]),
                       np.concatenate([space[acting] * size + slot[acting],
                                       INPUT_GRADIENT * size + slot[inputs]]))

    @property
    def producers(self) -> np.ndarray:
        """Per event, the row that makes it happen (-1: none; the last one if several)."""
        return self._producers[0]

    @cached_property
    def _producers(self) -> tuple[np.ndarray, bool]:
        """The producers, and whether some event is made more than once."""
        # Without messages only FORWARD, GRADIENT and INPUT_GRADIENT (spaces 0-2) happen.
        spaces = NUM_SPACES if self.messages else INPUT_GRADIENT + 1
        producer = np.full(spaces * self.size, -1, self.row_index)
        repeats = False
        for begin, end in self.ranges():
            made = self.effects(begin, end)
            repeats = repeats or bool((producer[made.event] >= 0).any())
            producer[made.event] = made.row
            repeats = repeats or bool((producer[made.event] != made.row).any())
        return producer, repeats

    def first_repeat(self) -> tuple[int, int] | None:
        """(row, event) of the first action, in table order, that makes an event happen a
        second time, or None."""
        if not self._producers[1]:
            return None
        made = [self.effects(begin, end) for begin, end in self.ranges()]
        rows = np.concatenate([e.row for e in made])
        events = np.concatenate([e.event for e in made])
        order = np.lexsort((rows, events))
        events, rows = events[order], rows[order]
        repeated = np.flatnonzero(events[1:] == events[:-1]) + 1
        best = repeated[np.argmin(rows[repeated])]
        return int(rows[best]), int(events[best])

    def _ranks_of_units(self, units: Parts) -> np.ndarray:
        rows = units.row
        if rows.size and rows[-1] - rows[0] == rows.size - 1:  # one unit per row
            return self.table.ranks_between(int(rows[0]), int(rows[-1]) + 1)
        return self.rank_of(rows)

    def rank_of(self, rows: np.ndarray) -> np.ndarray:
        """The rank of each row."""
        return np.searchsorted(self.table.offsets, rows, side="right") - 1

    def decode(self, event: int) -> tuple[int, int, int]:
        """(space, stage, microbatch) of an event."""
        space, slot = divmod(int(event), self.size)
        return (space, *divmod(slot, self.schedule.num_microbatches))


@dataclass(frozen=True)
class Stall:
    """Where a run stopped for good: per rank, how many actions it ran (``progress``), and
    for each rank that did not finish (``stuck``, increasing), the first event its next
    action waits for that has not happened (``waiting_for``, aligned with ``stuck``)."""

    progress: np.ndarray
    stuck: tuple[int, ...]
    waiting_for: tuple[int, ...]


@dataclass(frozen=True)
class Run:
    """A finished run: each row's start and end (None when run without durations)."""

    starts: np.ndarray | None
    ends: np.ndarray | None


def execute(rules: Rules, durations: np.ndarray | None = None,
            latencies: dict[int, np.ndarray] | None = None) -> Run | Stall:
    """Run every rank's actions in order under ``rules``.

    ``durations`` (one per row) and ``latencies`` (per edge class, one per stage) make it
    time the run; without them it only finds whether the schedule finishes. An action waits
    for the producers of its events; an event nobody produces, or one produced later on
    the waiting rank, never happens. Times are summed in execution order, action by action,
    so they are the same floats a sequential simulation gives.
    """
    table = rules.table
    producer = rules.producers
    timed = durations is not None
    per_edge = {edge: np.asarray(per_stage, np.float64)
                for edge, per_stage in (latencies or {}).items() if np.any(per_stage)}
    kept: list[tuple[np.ndarray, ...]] = []
    for begin, end in rules.ranges():
        needs = rules.needs(begin, end)
        pred = producer[needs.event]
        missing = pred < 0
        rank = table.ranks_between(begin, end)[needs.row - begin]
        same_rank = (pred >= table.offsets[rank]) & (pred < table.offsets[rank + 1])
        gating = ~(same_rank & (pred < needs.row))
        found = [needs.row[gating].astype(rules.row_index),
                 np.where(missing | same_rank, -1, pred)[gating]]
        if per_edge:
            latency = np.zeros(needs.row.size)
            for edge, per_stage in per_edge.items():
                chosen = needs.edge == edge
                latency[chosen] = per_stage[needs.stage[chosen]]
            found.append(latency[gating])
        kept.append(tuple(found))
    columns = [np.concatenate(column) for column in zip(*kept)]
    del kept
    waiting_row, pred = columns[0], columns[1]
    blocked = pred < 0
    gates = _Gates(table, waiting_row)
    gate_of_need = gates.governing(waiting_row)
    if not timed:
        pred_gate = np.where(blocked, gates.never, gates.governing(np.maximum(pred, 0)))
        stopped = _advance(gates, gates.pack(gate_of_need, pred_gate, fill=gates.always))
        return Run(None, None) if stopped is None else _stall(rules, gates, stopped, producer)
    latency = columns[2] if per_edge else None
    rows = len(table)
    never_row, always_row = rows, rows + 1
    sources = gates.pack(gate_of_need, np.where(blocked, never_row, pred), fill=always_row)
    delays = None if latency is None else gates.pack(gate_of_need, latency, fill=0.0)
    timer = _Timer(gates, durations)
    stopped = _advance(gates, sources, timer, delays)
    if stopped is not None:
        return _stall(rules, gates, stopped, producer)
    return Run(timer.starts[:rows], timer.ends[:rows])


def _advance(gates: _Gates, waits: np.ndarray, timer: _Timer | None = None,
             delays: np.ndarray | None = None) -> np.ndarray | None:
    """Pass gates in rounds until every rank is done (None) or none can move (the current
    gate of every rank, returned).

    Untimed, ``waits[g]`` holds the gates whose blocks gate g waits for; timed, the rows
    it waits for, ``delays[g]`` their latencies (None: all 0), and the timer records every
    row's times.
    """
    current, end = gates.first.copy(), gates.first + gates.per_rank
    passed = np.zeros(gates.count + 2, bool)
    passed[gates.always] = True
    active = np.flatnonzero(current < end)
    while active.size:
        at = current[active]
        pending = waits[at]
        if timer is None:
            ready = passed[pending].all(axis=1)
        else:
            arrivals = timer.ends[pending]
            ready = (arrivals >= 0).all(axis=1)
        if not ready.any():
            return current
        moving, gate = active[ready], at[ready]
        if timer is None:
            passed[gate] = True
        else:
            arrived = arrivals[ready] if delays is None else arrivals[ready] + delays[gate]
            timer.run_blocks(moving, gate, arrived.max(axis=1))
        current[moving] += 1
        active = active[current[active] < end[active]]
    return None


class _Gates:
    """The gate actions (those with a wait not met by running in order, plus every rank's
    first action), in table order; each gate's block runs from it to the next gate."""

    def __init__(self, table: ActionTable, gating_rows: np.ndarray) -> None:
        is_gate = np.zeros(len(table), bool)
        is_gate[gating_rows] = True
        is_gate[table.offsets[:-1][table.counts() > 0]] = True
        index = np.int64 if is_gate.size >> 31 else np.int32
        self.rows = np.flatnonzero(is_gate).astype(index)
        self.count = self.rows.size
        self._of_row = np.cumsum(is_gate.view(np.uint8), dtype=index)
        self._of_row -= 1
        self.never, self.always = self.count, self.count + 1
        boundaries = np.searchsorted(self.rows, table.offsets)
        self.first = boundaries[:-1]
        self.per_rank = np.diff(boundaries)
        self.lengths = np.diff(self.rows, append=len(table)).astype(self._of_row.dtype)

    def governing(self, rows: np.ndarray) -> np.ndarray:
        """The gate whose block holds each row (every rank's first row is a gate), which for
        a gate row is its own number."""
        return self._of_row[rows]

    def pack(self, gate: np.ndarray, values: np.ndarray, fill) -> np.ndarray:
        """Per gate, its values in one row of a (gates + 2, widest) matrix (``gate`` is
        sorted), padded with ``fill``; the two extra rows are for the sentinels."""
        dtype = np.asarray(values).dtype
        if gate.size < 2 or bool((gate[1:] != gate[:-1]).all()):  # one value per gate
            matrix = np.full((self.count + 2, 1), fill, dtype=dtype)
            matrix[gate, 0] = values
            return matrix
        counts = np.bincount(gate, minlength=self.count + 2)
        matrix = np.full((self.count + 2, int(counts.max())), fill, dtype=dtype)
        starts = np.cumsum(counts) - counts
        matrix[gate, np.arange(gate.size) - starts[gate]] = values
        return matrix


class _Timer:
    """Start and end of every row, summed in execution order. Two extra rows: one that never
    ends (-1: an event that never happens) and one that always has (0: padding)."""

    LONG = 64  # blocks longer than this are summed in Python, one at a time

    def __init__(self, gates: _Gates, durations: np.ndarray) -> None:
        self.gates = gates
        self.durations = durations
        rows = durations.size
        self.starts = np.full(rows + 2, -1.0)
        self.ends = np.full(rows + 2, -1.0)
        self.ends[rows + 1] = 0.0
        self.clock = np.zeros(gates.first.size)

    def run_blocks(self, ranks: np.ndarray, gates: np.ndarray, ready: np.ndarray) -> None:
        """Run the blocks of ``gates`` (on ``ranks``), each from max(its rank's clock,
        ``ready``), action after action."""
        starts, ends, durations = self.starts, self.ends, self.durations
        time = np.maximum(self.clock[ranks], ready)
        row = self.gates.rows[gates]
        lengths = self.gates.lengths[gates]
        starts[row] = time
        time = time + durations[row]
        ends[row] = time
        longest = int(lengths.max())
        for step in range(1, min(longest, self.LONG)):
            going = lengths > step
            at = row[going] + step
            starts[at] = time[going]
            time[going] += durations[at]
            ends[at] = time[going]
        if longest > self.LONG:
            for index in np.flatnonzero(lengths > self.LONG).tolist():
                time[index] = self._run_tail(int(row[index]) + self.LONG,
                                             int(row[index] + lengths[index]), float(time[index]))
        self.clock[ranks] = time

    def _run_tail(self, begin: int, end: int, time: float) -> float:
        """Rows ``begin:end`` from ``time``, summed one by one (as floats, in order)."""
        starts, ends = [], []
        for duration in self.durations[begin:end].tolist():
            starts.append(time)
            time += duration
            ends.append(time)
        self.starts[begin:end] = starts
        self.ends[begin:end] = ends
        return time


def _stall(rules: Rules, gates: _Gates, current: np.ndarray, producer: np.ndarray) -> Stall:
    """Where each unfinished rank stopped (``current``: its gate) and the first event it
    waits for there."""
    table = rules.table
    counts = table.counts()
    stuck = np.flatnonzero(current < gates.first + gates.per_rank)
    progress = counts.copy()
    stuck_rows = gates.rows[current[stuck]]
    progress[stuck] = stuck_rows - table.offsets[stuck]
    waiting = []
    for row in stuck_rows.tolist():
        needs = rules.needs(row, row + 1)
        mine = needs.row == row
        for event in needs.event[mine].tolist():
            source = int(producer[event])
            if source < 0:
                waiting.append(event)
                break
            source_rank = int(rules.rank_of(source))
            if source - int(table.offsets[source_rank]) >= progress[source_rank]:
                waiting.append(event)
                break
    return Stall(progress, tuple(int(r) for r in stuck), tuple(waiting))
