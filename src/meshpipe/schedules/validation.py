"""Checking a schedule before any process runs it.

``validate`` accepts compute-only and lowered schedules and raises ``ScheduleError`` at the
first violation, naming the rank, the position in its list, the action and what it waits
for. It checks, in this order:

1. work: every (stage, microbatch) has exactly one F and either one B or one I and one W
   (none at all in a forward-only schedule);
2. messages (lowered schedules): every SEND/RECV is a stage-to-stage edge that crosses
   ranks (stages on one rank hand over locally, the last stage sends no forward and stage 0
   no gradient), every such edge has exactly one SEND and one RECV, and for every ordered
   pair of ranks the SENDs on the source and the RECVs on the destination list the same
   messages in the same order (NCCL matches point-to-point messages in posting order);
3. execution: the lists run to the end under the executor's semantics. SEND and RECV only
   post (non-blocking); a compute action waits until every message it consumes has been
   posted by its SEND on the peer rank and received by a RECV earlier in its own list;
   what it needs from its own rank (its forward before its backward, an I before its W, the
   previous stage's output when that stage is on the same rank) must come earlier in its
   list. In a compute-only schedule a cross-rank input is ready once the producing action
   has run. A rank that waits for itself is an ordering error; ranks waiting for each other
   in a cycle are a deadlock.

The checks read the schedule's table (``table``) a range of rows at a time in numpy, and
point 3 runs on the dataflow engine (``dataflow``: the rules with messages for a lowered
schedule, without for a compute-only one), so tens of millions of actions validate in
seconds. Only an error's text is worked out action by action.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from meshpipe.schedules.actions import Action, Kind
from meshpipe.schedules.schedule import Schedule
from meshpipe.schedules import table as codes
from meshpipe.schedules.table import KINDS, Parts, Repeats, positions_in_runs, stable_order
from meshpipe.schedules.dataflow import (FORWARD, INPUT_GRADIENT, RECEIVED_B, RECEIVED_F,
                                         SENT_B, SENT_F, Rules, Stall, execute)

__all__ = ["ScheduleError", "WorkSummary", "check_work", "validate"]


class ScheduleError(ValueError):
    """A schedule that cannot run as written.

    ``rank`` and ``index`` locate the offending action in ``schedule.ranks`` (None where
    the fault is an absence), ``action`` is that action, ``waiting_for`` the action it
    waits for (text form, e.g. ``"0SEND_F2"``) when it waits.
    """

    def __init__(self, message: str, *, rank: int | None = None, index: int | None = None,
                 action: Action | None = None, waiting_for: str | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.index = index
        self.action = action
        self.waiting_for = waiting_for


def validate(schedule: Schedule) -> None:
    """Raise ``ScheduleError`` unless ``schedule`` is complete and runs to the end."""
    work = _Work(schedule)
    if work.lowered:
        _Messages(schedule, work.forward_only).check()
    _Execution(schedule, work).run()


@dataclass(frozen=True)
class WorkSummary:
    """What the work check learns about a schedule on the way."""

    lowered: bool
    forward_only: bool


def check_work(schedule: Schedule) -> WorkSummary:
    """Point 1 of the module doc alone: ScheduleError unless every (stage, microbatch) has
    its work."""
    work = _Work(schedule)
    return WorkSummary(work.lowered, work.forward_only)


def _where(rank: int, index: int, action: Action) -> str:
    return f"rank {rank} #{index} {action}"


def _find(schedule: Schedule, rank: int, wanted: Action, before: int | None = None) -> int | None:
    """Position of ``wanted`` (alone or inside an OVERLAP) in rank ``rank``'s list."""
    for index, action in enumerate(schedule.ranks[rank][:before]):
        if action == wanted or wanted in action.parts:
            return index
    return None


def _first_set_byte(mask: int) -> int:
    """Index of the lowest non-zero byte of a bitmap held as an int (``mask != 0``)."""
    return ((mask & -mask).bit_length() - 1) // 8


_F, _B, _I, _W = Kind.F, Kind.B, Kind.I, Kind.W
_SEND_F, _RECV_F, _SEND_B, _RECV_B = Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B


class _Work:
    """One flag per kind and (stage, microbatch) slot, checked for completeness."""

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        self.size = schedule.num_stages * schedule.num_microbatches
        self.lowered = bool((schedule.table.kind >= codes.FIRST_COMM).any())
        self.f, self.b, self.i, self.w = self._count()
        self.forward_only = 1 not in self.b and 1 not in self.i and 1 not in self.w
        self._check_complete()

    def _count(self) -> tuple[bytearray, ...]:
        """One flag per kind and slot for every compute part (ScheduleError on a repeat)."""
        schedule = self.schedule
        table = schedule.table
        flags = np.zeros((4, self.size), np.uint8)  # F, B, I, W: their codes 0..3
        repeats_in = Repeats(4 * self.size)
        for begin, end in table.ranges():
            parts = table.parts_between(begin, end)
            slot = parts.stage.astype(np.int64) * schedule.num_microbatches + parts.microbatch
            repeats = flags[parts.kind, slot] != 0
            repeats |= repeats_in.within(parts.kind.astype(np.int64) * self.size + slot)
            if repeats.any():
                first = int(np.argmax(repeats))
                self._raise_repeat(int(parts.row[first]), first, parts)
            flags[parts.kind, slot] = 1
        return tuple(bytearray(flags[kind].tobytes())
                     for kind in (codes.F_CODE, codes.B_CODE, codes.I_CODE, codes.W_CODE))

    def _raise_repeat(self, row: int, part_index: int, parts: Parts) -> None:
        """The error for the part at ``part_index`` (of row ``row``), a repeat."""
        table = self.schedule.table
        rank = int(np.searchsorted(table.offsets, row, side="right")) - 1
        index = row - int(table.offsets[rank])
        action = self.schedule.ranks[rank][index]
        part = Action(KINDS[parts.kind[part_index]], int(parts.stage[part_index]),
                      int(parts.microbatch[part_index]))
        first = _find(self.schedule, rank, part, before=index)
        raise ScheduleError(
            f"{_where(rank, index, action)}: stage {part.stage} microbatch "
            f"{part.microbatch} already has {part} at #{first}; every "
            f"(stage, microbatch) runs each kind once",
            rank=rank, index=index, action=action)

    def _check_complete(self) -> None:
        ones = int.from_bytes(b"\x01" * self.size, "little")
        forwards = int.from_bytes(self.f, "little")
        if forwards != ones:
            self._raise_incomplete(_first_set_byte(forwards ^ ones))
        if self.forward_only:
            return
        full, inputs, weights = (int.from_bytes(x, "little") for x in (self.b, self.i, self.w))
        # per slot: exactly one of B and I, and W exactly where I is
        wrong = (full ^ inputs ^ ones) | (inputs ^ weights)
        if wrong:
            self._raise_incomplete(_first_set_byte(wrong))

    def _raise_incomplete(self, slot: int) -> None:
        schedule = self.schedule
        stage, microbatch = divmod(slot, schedule.num_microbatches)
        b, i, w = self.b[slot], self.i[slot], self.w[slot]
        if not self.f[slot]:
            problem = f"has no forward {stage}F{microbatch}"
        elif b and (i or w):
            problem = ("has both a full backward B and a split one (I/W); use one B, or one I "
                       "and one W")
        elif i or w:
            problem = (f"has {'I' if i else 'W'} without {stage}{'W' if i else 'I'}"
                       f"{microbatch}; a split backward needs both I and W")
        else:
            problem = ("has no backward (B, or I and W) although other microbatches do; a "
                       "training schedule backwards every (stage, microbatch)")
        rank = schedule.placement[stage]
        raise ScheduleError(f"rank {rank}: stage {stage} microbatch {microbatch} {problem}",
                            rank=rank)

    def gradient_kind(self, stage: int, microbatch: int) -> Kind:
        """B or I: which action produces the input gradient of (stage, microbatch)."""
        return _B if self.b[stage * self.schedule.num_microbatches + microbatch] else _I


# A message is named by the stage that produces it: the output of stage s goes to s+1
# (direction 0), the input gradient of stage s to s-1 (direction 1).
_FORWARD_MESSAGE, _GRADIENT_MESSAGE = 0, 1


def _message_text(direction: int, producer: int, microbatch: int) -> str:
    return (f"the output of {producer}F{microbatch}" if direction == _FORWARD_MESSAGE
            else f"the input gradient of stage {producer} microbatch {microbatch}")


def _message_kinds(direction: int) -> tuple[Kind, Kind]:
    return (_SEND_F, _RECV_F) if direction == _FORWARD_MESSAGE else (_SEND_B, _RECV_B)


@dataclass(frozen=True)
class _MessageRows:
    """Per SEND/RECV action: whether it sends, whether it moves a forward output, the
    producing and consuming stages, whether that is no edge between ranks, the message it
    moves and its pair of ranks (producer's rank * num_ranks + consumer's rank)."""

    is_send: np.ndarray
    forward: np.ndarray
    producer: np.ndarray
    consumer: np.ndarray
    not_an_edge: np.ndarray
    message: np.ndarray
    pair: np.ndarray


class _Messages:
    """Structure of a lowered schedule's SEND/RECV actions (point 2 of the module doc)."""

    def __init__(self, schedule: Schedule, forward_only: bool) -> None:
        self.schedule = schedule
        self.forward_only = forward_only
        self.size = schedule.num_stages * schedule.num_microbatches
        # per message: its position among the messages of its pair of ranks, on each side
        self.send_position = np.full(2 * self.size, -1, np.int32)
        self.receive_position = np.full(2 * self.size, -1, np.int32)

    def _decode(self, message: int) -> tuple[int, int, int]:
        direction, slot = divmod(message, self.size)
        return (direction, *divmod(slot, self.schedule.num_microbatches))

    def check(self) -> None:
        schedule = self.schedule
        table = schedule.table
        num_ranks = schedule.num_ranks
        # per side (receive, send) and pair of ranks: messages seen so far
        seen_per_pair = np.zeros((2, num_ranks * num_ranks), np.int64)
        seen = np.zeros((2, 2 * self.size), bool)
        repeats_in = Repeats(4 * self.size)
        for begin, end in table.ranges():
            rows = np.flatnonzero(table.kind[begin:end] >= codes.FIRST_COMM) + begin
            found = self._read(rows)
            is_send, message, pair = found.is_send, found.message, found.pair
            side = is_send.astype(np.int64)
            repeated = seen[side, message] | repeats_in.within(side * (2 * self.size) + message)
            offending = np.flatnonzero(found.not_an_edge | repeated)
            if offending.size:
                self._raise_first(rows, int(offending[0]), found)
            seen[side, message] = True
            for chosen, positions, counts in ((is_send, self.send_position, seen_per_pair[1]),
                                              (~is_send, self.receive_position,
                                               seen_per_pair[0])):
                pairs = pair[chosen]
                by_pair = stable_order(pairs, num_ranks * num_ranks)
                positions[message[chosen][by_pair]] = \
                    positions_in_runs(pairs[by_pair]) + counts[pairs[by_pair]]
                counts += np.bincount(pairs, minlength=counts.size)
        expected = self._expected_messages()
        if seen_per_pair[1].sum() != expected or seen_per_pair[0].sum() != expected:
            self._raise_missing()
        if not np.array_equal(self.send_position, self.receive_position):
            self._raise_out_of_order()

    def _read(self, rows: np.ndarray) -> _MessageRows:
        """What the SEND/RECV actions at ``rows`` move, and between which ranks."""
        schedule = self.schedule
        table = schedule.table
        num_stages = schedule.num_stages
        kind, stage = table.kind[rows], table.stage[rows].astype(np.int64)
        is_send = (kind == codes.SEND_F_CODE) | (kind == codes.SEND_B_CODE)
        forward = (kind == codes.SEND_F_CODE) | (kind == codes.RECV_F_CODE)
        producer = np.where(is_send, stage, np.where(forward, stage - 1, stage + 1))
        consumer = np.where(forward, producer + 1, producer - 1)
        placement = np.asarray(schedule.placement, np.int64)
        producer_rank = placement[np.clip(producer, 0, num_stages - 1)]
        consumer_rank = placement[np.clip(consumer, 0, num_stages - 1)]
        not_an_edge = ((producer < 0) | (producer >= num_stages) | (consumer < 0)
                       | (consumer >= num_stages) | (producer_rank == consumer_rank)
                       | (~forward & self.forward_only))
        message = (np.where(forward, _FORWARD_MESSAGE, _GRADIENT_MESSAGE) * self.size
                   + np.clip(producer, 0, num_stages - 1) * schedule.num_microbatches
                   + table.microbatch[rows])
        return _MessageRows(is_send, forward, producer, consumer, not_an_edge, message,
                            producer_rank * schedule.num_ranks + consumer_rank)

    def _raise_first(self, rows: np.ndarray, at: int, found: _MessageRows) -> None:
        """The error of the first offending SEND/RECV (``rows[at]``)."""
        table = self.schedule.table
        row = int(rows[at])
        rank = int(np.searchsorted(table.offsets, row, side="right")) - 1
        index = row - int(table.offsets[rank])
        action = self.schedule.ranks[rank][index]
        if found.not_an_edge[at]:
            direction = _FORWARD_MESSAGE if found.forward[at] else _GRADIENT_MESSAGE
            self._raise_not_an_edge(rank, index, action, direction, int(found.producer[at]),
                                    int(found.consumer[at]))
        self._raise_repeated(rank, index, action, bool(found.is_send[at]),
                             int(found.message[at]))

    def _raise_not_an_edge(self, rank: int, index: int, action: Action, direction: int,
                           producer: int, consumer: int) -> None:
        where = _where(rank, index, action)
        num_stages = self.schedule.num_stages
        if not (0 <= producer < num_stages and 0 <= consumer < num_stages):
            problem = (f"no stage {min(producer, consumer)} -> {max(producer, consumer)} edge "
                       f"exists ({num_stages} stages)")
        elif direction == _GRADIENT_MESSAGE and self.forward_only:
            problem = "a forward-only schedule has no gradients to move"
        else:
            problem = (f"stages {min(producer, consumer)} and {max(producer, consumer)} are "
                       f"both on rank {rank} and hand over locally; remove this action")
        raise ScheduleError(f"{where}: {problem}", rank=rank, index=index, action=action)

    def _raise_repeated(self, rank: int, index: int, action: Action, is_send: bool,
                        message: int) -> None:
        first = _find(self.schedule, rank, action, before=index)
        what = _message_text(*self._decode(message))
        raise ScheduleError(f"{_where(rank, index, action)}: {what} is already "
                            f"{'sent' if is_send else 'received'} at #{first}",
                            rank=rank, index=index, action=action)

    def _edges(self):
        """Every (direction, producer, consumer) stage edge that crosses ranks."""
        placement = self.schedule.placement
        for producer in range(self.schedule.num_stages):
            for direction, consumer in ((_FORWARD_MESSAGE, producer + 1),
                                        (_GRADIENT_MESSAGE, producer - 1)):
                if direction == _GRADIENT_MESSAGE and self.forward_only:
                    continue
                if (0 <= consumer < self.schedule.num_stages
                        and placement[producer] != placement[consumer]):
                    yield direction, producer, consumer

    def _expected_messages(self) -> int:
        return sum(1 for _ in self._edges()) * self.schedule.num_microbatches

    def _raise_missing(self) -> None:
        placement = self.schedule.placement
        num_microbatches = self.schedule.num_microbatches
        for direction, producer, consumer in self._edges():
            send_kind, receive_kind = _message_kinds(direction)
            for microbatch in range(num_microbatches):
                message = direction * self.size + producer * num_microbatches + microbatch
                for positions, side, stage, kind in (
                        (self.send_position, "send", producer, send_kind),
                        (self.receive_position, "receive", consumer, receive_kind)):
                    if positions[message] < 0:
                        rank = placement[stage]
                        raise ScheduleError(
                            f"rank {rank} has no {Action(kind, stage, microbatch)} to {side} "
                            f"{_message_text(direction, producer, microbatch)} between ranks "
                            f"{placement[producer]} and {placement[consumer]}; lower the "
                            f"compute-only schedule with meshpipe.schedules.lower", rank=rank)

    def _nth_message_action(self, rank: int, kinds: tuple[Kind, Kind], peer: int,
                            position: int) -> tuple[int, Action]:
        """The ``position``-th SEND (or RECV) of rank ``rank`` exchanged with rank ``peer``."""
        placement = self.schedule.placement
        seen = 0
        for index, action in enumerate(self.schedule.ranks[rank]):
            if action.kind in kinds and placement[action.peer] == peer:
                if seen == position:
                    return index, action
                seen += 1
        raise AssertionError("message positions are counted from these lists")

    def _raise_out_of_order(self) -> None:
        placement = self.schedule.placement
        first: tuple[int, int, int] | None = None  # (receive position, source, destination)
        for message in np.flatnonzero(self.send_position != self.receive_position).tolist():
            sent, received = int(self.send_position[message]), int(self.receive_position[message])
            direction, producer, _ = self._decode(message)
            consumer = producer + (1 if direction == _FORWARD_MESSAGE else -1)
            candidate = (min(sent, received), placement[producer], placement[consumer])
            first = candidate if first is None else min(first, candidate)
        position, source, destination = first
        send_index, send_action = self._nth_message_action(source, (_SEND_F, _SEND_B),
                                                           destination, position)
        receive_index, receive_action = self._nth_message_action(
            destination, (_RECV_F, _RECV_B), source, position)
        raise ScheduleError(
            f"rank {source} -> rank {destination}: message {position} is {send_action} "
            f"(rank {source} #{send_index}) but rank {destination}'s receive {position} is "
            f"{receive_action} (#{receive_index}); receives must follow the order of the "
            f"sends (point-to-point messages match in posting order)",
            rank=destination, index=receive_index, action=receive_action,
            waiting_for=str(send_action))


_PRODUCING_KIND = {FORWARD: _F, INPUT_GRADIENT: _I, SENT_F: _SEND_F, SENT_B: _SEND_B,
                   RECEIVED_F: _RECV_F, RECEIVED_B: _RECV_B}


class _Execution:
    """Runs every rank's list as far as it can go (point 3 of the module doc) on the
    dataflow engine, and explains a stall."""

    def __init__(self, schedule: Schedule, work: _Work) -> None:
        self.schedule = schedule
        self.work = work
        self.rules = Rules(schedule, messages=work.lowered)

    def run(self) -> None:
        stall = execute(self.rules)
        if not isinstance(stall, Stall):
            return
        self.position = stall.progress.tolist()
        self.waiting_for = dict(zip(stall.stuck, stall.waiting_for))
        placement = self.schedule.placement
        for rank in stall.stuck:
            _, stage, _ = self.rules.decode(self.waiting_for[rank])
            if placement[stage] == rank:
                index = self.position[rank]
                self._raise_out_of_order(rank, index, self.schedule.ranks[rank][index],
                                         self.waiting_for[rank])
        self._raise_deadlock(stall.stuck[0])

    def _producer(self, event: int) -> tuple[int, Action]:
        """The rank and the action whose execution makes ``event`` happen."""
        space, stage, microbatch = self.rules.decode(event)
        kind = _PRODUCING_KIND.get(space) or self.work.gradient_kind(stage, microbatch)
        return self.schedule.placement[stage], Action(kind, stage, microbatch)

    def _raise_out_of_order(self, rank: int, index: int, action: Action, event: int) -> None:
        _, needed = self._producer(event)
        where = _where(rank, index, action)
        later = _find(self.schedule, rank, needed)
        if later == index:
            detail = (f"which this same OVERLAP computes; pair {needed} with work it does not "
                      f"feed")
        elif later is None:
            detail = f"which rank {rank} never runs"
        elif needed.kind is _RECV_F or needed.kind is _RECV_B:
            detail = f"but the receive is posted later, at #{later}; post it before its consumer"
        else:
            detail = f"which rank {rank} only runs later, at #{later}"
        raise ScheduleError(f"{where} needs {needed}, {detail}", rank=rank, index=index,
                            action=action, waiting_for=str(needed))

    def _blocked_text(self, rank: int) -> tuple[int, Action, str]:
        index = self.position[rank]
        _, needed = self._producer(self.waiting_for[rank])
        return index, self.schedule.ranks[rank][index], str(needed)

    def _raise_deadlock(self, first: int) -> None:
        index, action, needed = self._blocked_text(first)
        chain = []
        seen = {first}
        rank = first
        while True:
            producer_rank, _ = self._producer(self.waiting_for[rank])
            if producer_rank in seen or producer_rank not in self.waiting_for:
                break
            seen.add(producer_rank)
            blocked_index, blocked_action, blocked_need = self._blocked_text(producer_rank)
            chain.append(f"rank {producer_rank} is blocked at #{blocked_index} "
                         f"{blocked_action} waiting for {blocked_need}")
            rank = producer_rank
        detail = f" ({'; '.join(chain)})" if chain else ""
        raise ScheduleError(f"deadlock: {_where(first, index, action)} waits for "
                            f"{needed}{detail}", rank=first, index=index, action=action,
                            waiting_for=needed)
