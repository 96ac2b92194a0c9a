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

The checks take time linear in the number of actions.
"""

from __future__ import annotations

from collections import deque

from meshpipe.schedules.actions import Action, Kind, Schedule

__all__ = ["ScheduleError", "check_work", "validate"]


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
    lowered = schedule.is_lowered
    if lowered:
        _check_messages(schedule, work.forward_only)
    _Execution(schedule, work, lowered).run()


def check_work(schedule: Schedule) -> bool:
    """Point 1 of the module doc alone (ScheduleError if it fails); True if forward-only."""
    return _Work(schedule).forward_only


def _where(rank: int, index: int, action: Action) -> str:
    return f"rank {rank} #{index} {action}"


def _find(schedule: Schedule, rank: int, wanted: Action) -> int | None:
    """Position of ``wanted`` (alone or inside an OVERLAP) in rank ``rank``'s list."""
    for index, action in enumerate(schedule.ranks[rank]):
        if action == wanted or wanted in action.parts:
            return index
    return None


class _Work:
    """Counts of the compute actions per (stage, microbatch), checked for completeness."""

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        size = schedule.num_stages * schedule.num_microbatches
        self.counts = {kind: bytearray(size) for kind in (Kind.F, Kind.B, Kind.I, Kind.W)}
        self._count(schedule)
        self.forward_only = not any(any(self.counts[k]) for k in (Kind.B, Kind.I, Kind.W))
        self._check_complete()

    def _slot(self, stage: int, microbatch: int) -> int:
        return stage * self.schedule.num_microbatches + microbatch

    def _count(self, schedule: Schedule) -> None:
        counts = self.counts
        num_microbatches = schedule.num_microbatches
        for rank, actions in enumerate(schedule.ranks):
            for index, action in enumerate(actions):
                if action.kind.is_comm:
                    continue
                for part in action.computations:
                    tally = counts[part.kind]
                    slot = part.stage * num_microbatches + part.microbatch
                    if tally[slot]:
                        first = _find_before(schedule, rank, index, part)
                        raise ScheduleError(
                            f"{_where(rank, index, action)}: stage {part.stage} microbatch "
                            f"{part.microbatch} already has {part} at #{first}; every "
                            f"(stage, microbatch) runs each kind once",
                            rank=rank, index=index, action=action)
                    tally[slot] = 1

    def _check_complete(self) -> None:
        schedule = self.schedule
        f, b, i, w = (self.counts[k] for k in (Kind.F, Kind.B, Kind.I, Kind.W))
        for stage in range(schedule.num_stages):
            rank = schedule.placement[stage]
            for microbatch in range(schedule.num_microbatches):
                slot = self._slot(stage, microbatch)
                problem = None
                if not f[slot]:
                    problem = f"has no forward {stage}F{microbatch}"
                elif self.forward_only:
                    continue
                elif b[slot] and (i[slot] or w[slot]):
                    problem = ("has both a full backward B and a split one (I/W); use one "
                               "B, or one I and one W")
                elif not b[slot] and not (i[slot] and w[slot]):
                    if i[slot] or w[slot]:
                        missing = "W" if i[slot] else "I"
                        problem = (f"has {'I' if i[slot] else 'W'} without "
                                   f"{stage}{missing}{microbatch}; a split backward needs "
                                   f"both I and W")
                    else:
                        problem = ("has no backward (B, or I and W) although other "
                                   "microbatches do; a training schedule backwards every "
                                   "(stage, microbatch)")
                if problem:
                    raise ScheduleError(f"rank {rank}: stage {stage} microbatch {microbatch} "
                                        f"{problem}", rank=rank)

    def gradient_kind(self, stage: int, microbatch: int) -> Kind:
        """B or I: which action produces the input gradient of (stage, microbatch)."""
        return Kind.B if self.counts[Kind.B][self._slot(stage, microbatch)] else Kind.I


def _find_before(schedule: Schedule, rank: int, index: int, part: Action) -> int | None:
    for position, action in enumerate(schedule.ranks[rank][:index]):
        if part in action.computations:
            return position
    return None


# A message is identified by the stage that produces it: forward output of stage s goes to
# s+1, the input gradient of stage s goes to s-1.
_MESSAGE_OF = {Kind.SEND_F: (Kind.F, 0), Kind.RECV_F: (Kind.F, -1),
               Kind.SEND_B: (Kind.B, 0), Kind.RECV_B: (Kind.B, +1)}


def _message_text(direction: Kind, producer: int, microbatch: int) -> str:
    return (f"the output of {producer}F{microbatch}" if direction is Kind.F
            else f"the input gradient of stage {producer} microbatch {microbatch}")


def _check_messages(schedule: Schedule, forward_only: bool) -> None:
    """Structure of a lowered schedule's SEND/RECV actions (point 2 of the module doc)."""
    placement = schedule.placement
    num_stages = schedule.num_stages
    sends: dict[tuple[Kind, int, int], tuple[int, int]] = {}
    receives: dict[tuple[Kind, int, int], tuple[int, int]] = {}
    pair_sends: dict[tuple[int, int], list[tuple[Kind, int, int]]] = {}
    pair_receives: dict[tuple[int, int], list[tuple[Kind, int, int]]] = {}
    for rank, actions in enumerate(schedule.ranks):
        for index, action in enumerate(actions):
            if action.kind.is_compute:
                continue
            direction, offset = _MESSAGE_OF[action.kind]
            producer = action.stage + offset
            consumer = producer + (1 if direction is Kind.F else -1)
            where = _where(rank, index, action)
            if not (0 <= producer < num_stages and 0 <= consumer < num_stages):
                raise ScheduleError(f"{where}: no stage {min(producer, consumer)} -> "
                                    f"{max(producer, consumer)} edge exists "
                                    f"({num_stages} stages)", rank=rank, index=index,
                                    action=action)
            if direction is Kind.B and forward_only:
                raise ScheduleError(f"{where}: a forward-only schedule has no gradients to "
                                    f"move", rank=rank, index=index, action=action)
            if placement[producer] == placement[consumer]:
                raise ScheduleError(f"{where}: stages {producer} and {consumer} are both on "
                                    f"rank {rank} and hand over locally; remove this action",
                                    rank=rank, index=index, action=action)
            message = (direction, producer, action.microbatch)
            is_send = action.kind in (Kind.SEND_F, Kind.SEND_B)
            seen = sends if is_send else receives
            if message in seen:
                raise ScheduleError(f"{where}: {_message_text(*message)} is already "
                                    f"{'sent' if is_send else 'received'} at "
                                    f"#{seen[message][1]}", rank=rank, index=index,
                                    action=action)
            seen[message] = (rank, index)
            pair = (placement[producer], placement[consumer])
            (pair_sends if is_send else pair_receives).setdefault(pair, []).append(message)
    _check_every_edge_has_messages(schedule, forward_only, sends, receives)
    for pair, sent in pair_sends.items():
        _check_pair_order(schedule, pair, sent, pair_receives[pair], sends, receives)


def _check_every_edge_has_messages(schedule: Schedule, forward_only: bool,
                                   sends: dict, receives: dict) -> None:
    placement = schedule.placement
    for producer in range(schedule.num_stages):
        consumers = [producer + 1] + ([] if forward_only else [producer - 1])
        for consumer in consumers:
            if not 0 <= consumer < schedule.num_stages:
                continue
            if placement[producer] == placement[consumer]:
                continue
            direction = Kind.F if consumer > producer else Kind.B
            for microbatch in range(schedule.num_microbatches):
                message = (direction, producer, microbatch)
                for table, side, stage, kind in (
                        (sends, "send", producer,
                         Kind.SEND_F if direction is Kind.F else Kind.SEND_B),
                        (receives, "receive", consumer,
                         Kind.RECV_F if direction is Kind.F else Kind.RECV_B)):
                    if message not in table:
                        rank = placement[stage]
                        raise ScheduleError(
                            f"rank {rank} has no {Action(kind, stage, microbatch)} to {side} "
                            f"{_message_text(*message)} between ranks {placement[producer]} "
                            f"and {placement[consumer]}; lower the compute-only schedule "
                            f"with meshpipe.schedules.lower", rank=rank)


def _check_pair_order(schedule: Schedule, pair: tuple[int, int], sent: list, received: list,
                      sends: dict, receives: dict) -> None:
    source, destination = pair
    for position, (send_message, receive_message) in enumerate(zip(sent, received)):
        if send_message != receive_message:
            send_rank, send_index = sends[send_message]
            receive_rank, receive_index = receives[receive_message]
            send_action = schedule.ranks[send_rank][send_index]
            receive_action = schedule.ranks[receive_rank][receive_index]
            raise ScheduleError(
                f"rank {source} -> rank {destination}: message {position} is "
                f"{send_action} (rank {source} #{send_index}) but rank {destination}'s "
                f"receive {position} is {receive_action} (#{receive_index}); receives must "
                f"follow the order of the sends (point-to-point messages match in posting "
                f"order)", rank=receive_rank, index=receive_index, action=receive_action,
                waiting_for=str(send_action))


# Event kinds the execution tracks, one flag per (event, stage, microbatch), and the kind
# of action that sets each (the input gradient comes from a B or an I).
_FORWARD, _GRADIENT, _SENT_F, _SENT_B, _RECEIVED_F, _RECEIVED_B = range(6)
_EVENT_SET_BY = {Kind.F: _FORWARD, Kind.B: _GRADIENT, Kind.I: _GRADIENT, Kind.SEND_F: _SENT_F,
                 Kind.SEND_B: _SENT_B, Kind.RECV_F: _RECEIVED_F, Kind.RECV_B: _RECEIVED_B}
_KIND_SETTING = {_FORWARD: Kind.F, _SENT_F: Kind.SEND_F, _SENT_B: Kind.SEND_B,
                 _RECEIVED_F: Kind.RECV_F, _RECEIVED_B: Kind.RECV_B}


class _Execution:
    """Runs every rank's list as far as it can go (point 3 of the module doc)."""

    def __init__(self, schedule: Schedule, work: _Work, lowered: bool) -> None:
        self.schedule = schedule
        self.work = work
        self.lowered = lowered
        self.size = schedule.num_stages * schedule.num_microbatches
        self.done = bytearray(6 * self.size)
        self.position = [0] * schedule.num_ranks
        self.waiting_for: list[int | None] = [None] * schedule.num_ranks

    def _event(self, event: int, stage: int, microbatch: int) -> int:
        return event * self.size + stage * self.schedule.num_microbatches + microbatch

    def _decode(self, event_key: int) -> tuple[int, int, int]:
        event, rest = divmod(event_key, self.size)
        stage, microbatch = divmod(rest, self.schedule.num_microbatches)
        return event, stage, microbatch

    def _producer(self, event_key: int) -> tuple[int, Action]:
        """The rank and the action whose execution sets ``event_key``."""
        event, stage, microbatch = self._decode(event_key)
        kind = _KIND_SETTING.get(event) or self.work.gradient_kind(stage, microbatch)
        return self.schedule.placement[stage], Action(kind, stage, microbatch)

    def _needs(self, rank: int, part: Action) -> list[int]:
        """Events a compute part or a send needs, in the order they are checked."""
        placement = self.schedule.placement
        stage, microbatch = part.stage, part.microbatch
        kind = part.kind
        if kind is Kind.F:
            if stage == 0:
                return []
            if placement[stage - 1] == rank or not self.lowered:
                return [self._event(_FORWARD, stage - 1, microbatch)]
            return [self._event(_RECEIVED_F, stage, microbatch),
                    self._event(_SENT_F, stage - 1, microbatch)]
        if kind is Kind.B or kind is Kind.I:
            needs = [self._event(_FORWARD, stage, microbatch)]
            if stage + 1 < self.schedule.num_stages:
                if placement[stage + 1] == rank or not self.lowered:
                    needs.append(self._event(_GRADIENT, stage + 1, microbatch))
                else:
                    needs += [self._event(_RECEIVED_B, stage, microbatch),
                              self._event(_SENT_B, stage + 1, microbatch)]
            return needs
        if kind is Kind.W or kind is Kind.SEND_B:
            return [self._event(_GRADIENT, stage, microbatch)]
        if kind is Kind.SEND_F:
            return [self._event(_FORWARD, stage, microbatch)]
        return []  # RECV_F, RECV_B only post a receive

    def _sets(self, part: Action) -> int | None:
        event = _EVENT_SET_BY.get(part.kind)
        return None if event is None else self._event(event, part.stage, part.microbatch)

    def run(self) -> None:
        schedule = self.schedule
        done = self.done
        waiters: dict[int, list[int]] = {}
        runnable = deque(range(schedule.num_ranks))
        while runnable:
            rank = runnable.popleft()
            actions = schedule.ranks[rank]
            index = self.position[rank]
            while index < len(actions):
                action = actions[index]
                parts = action.computations
                blocker = None
                for part in parts:
                    for event_key in self._needs(rank, part):
                        if not done[event_key]:
                            producer_rank, _ = self._producer(event_key)
                            if producer_rank == rank:
                                self._raise_out_of_order(rank, index, action, event_key)
                            blocker = event_key
                            break
                    if blocker is not None:
                        break
                if blocker is not None:
                    self.waiting_for[rank] = blocker
                    waiters.setdefault(blocker, []).append(rank)
                    break
                for part in parts:
                    event_key = self._sets(part)
                    if event_key is not None:
                        done[event_key] = 1
                        if event_key in waiters:
                            runnable.extend(waiters.pop(event_key))
                index += 1
            else:
                self.waiting_for[rank] = None
            self.position[rank] = index
        stuck = [r for r in range(schedule.num_ranks)
                 if self.position[r] < len(schedule.ranks[r])]
        if stuck:
            self._raise_deadlock(stuck[0])

    def _raise_out_of_order(self, rank: int, index: int, action: Action, event_key: int) -> None:
        _, needed = self._producer(event_key)
        where = _where(rank, index, action)
        later = _find(self.schedule, rank, needed)
        if later == index:
            detail = (f"which this same OVERLAP computes; pair {needed} with work it does not "
                      f"feed")
        elif later is None:
            detail = f"which rank {rank} never runs"
        elif needed.kind in (Kind.RECV_F, Kind.RECV_B):
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
            if producer_rank in seen or self.waiting_for[producer_rank] is None:
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
