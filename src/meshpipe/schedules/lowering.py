"""Lowering: add the SEND/RECV actions that move data between stages on different ranks.

For every stage-to-stage edge whose two stages sit on different ranks:

- ``SEND_F(s, m)`` goes on rank(s) right after the action that computes F(s, m), and
  ``SEND_B(s, m)`` right after the action that computes the input gradient of (s, m) (a B,
  an I, or the B half of an OVERLAP). The last stage sends no forward, stage 0 no gradient,
  W sends nothing. An action's sends follow the order of its parts (forward first).
- ``RECV_F(s, m)`` (the output of stage s-1) goes on rank(s) before the action computing
  F(s, m); ``RECV_B(s, m)`` (the gradient of stage s's output, from stage s+1) before the
  action computing B/I(s, m).

Stages adjacent on one rank hand over locally: no action is added for them.

Where receives go ("as early as the order allows"): a receive is posted ``lookahead``
compute actions before its consumer (default 1: right before the compute action that
precedes the consumer, so the transfer overlaps that compute), or at the start of the
list when the consumer is among the first ``lookahead`` actions. Point-to-point messages
match in posting order (NCCL has no tags), so for every pair of ranks the receives on the
destination must follow the order of the sends on the source; when a peer sends a message
that this rank consumes after a later message of the same peer, its receive moves up next
to the later message's receive. So a receive is posted at most ``lookahead`` compute
actions before its own consumer or before the consumer of a later message from the same
peer, and receive buffers are never all allocated at the start of the step.
"""

from __future__ import annotations

from typing import Iterator

from meshpipe.schedules._building import check_count
from meshpipe.schedules.actions import Action, Kind, Schedule
from meshpipe.schedules.validation import check_work

__all__ = ["lower"]

# A message is named by the receive that takes it: (RECV kind, receiving stage, microbatch).
Message = tuple[Kind, int, int]


def _sends(schedule: Schedule, rank: int, action: Action) -> Iterator[tuple[Action, int, Message]]:
    """The SEND actions that follow ``action`` on ``rank``, with their destination rank and
    message."""
    placement = schedule.placement
    for part in action.computations:
        stage, microbatch = part.stage, part.microbatch
        if part.kind is Kind.F and stage + 1 < schedule.num_stages:
            destination = placement[stage + 1]
            if destination != rank:
                yield (Action(Kind.SEND_F, stage, microbatch), destination,
                       (Kind.RECV_F, stage + 1, microbatch))
        elif part.kind in (Kind.B, Kind.I) and stage > 0:
            destination = placement[stage - 1]
            if destination != rank:
                yield (Action(Kind.SEND_B, stage, microbatch), destination,
                       (Kind.RECV_B, stage - 1, microbatch))


def _consumed(schedule: Schedule, rank: int, action: Action) -> Iterator[tuple[Message, int]]:
    """The messages ``action`` consumes from other ranks, with their source rank."""
    placement = schedule.placement
    for part in action.computations:
        stage, microbatch = part.stage, part.microbatch
        if part.kind is Kind.F and stage > 0 and placement[stage - 1] != rank:
            yield (Kind.RECV_F, stage, microbatch), placement[stage - 1]
        elif (part.kind in (Kind.B, Kind.I) and stage + 1 < schedule.num_stages
              and placement[stage + 1] != rank):
            yield (Kind.RECV_B, stage, microbatch), placement[stage + 1]


def _receive_slots(schedule: Schedule, rank: int, lookahead: int) -> dict[int, list[Action]]:
    """RECV actions of ``rank``, keyed by the index of the compute action they precede."""
    consumer_index: dict[Message, int] = {}
    sources: set[int] = set()
    for index, action in enumerate(schedule.ranks[rank]):
        for message, source in _consumed(schedule, rank, action):
            consumer_index[message] = index
            sources.add(source)
    slots: dict[int, list[Action]] = {}
    for source in sorted(sources):
        in_send_order = [message for action in schedule.ranks[source]
                         for _, destination, message in _sends(schedule, source, action)
                         if destination == rank]
        placed = []
        latest = len(schedule.ranks[rank])
        for message in reversed(in_send_order):
            latest = min(latest, max(0, consumer_index[message] - lookahead))
            placed.append((latest, message))
        for slot, (kind, stage, microbatch) in reversed(placed):
            slots.setdefault(slot, []).append(Action(kind, stage, microbatch))
    return slots


def lower(schedule: Schedule, *, lookahead: int = 1) -> Schedule:
    """``schedule`` with SEND/RECV actions for every edge between ranks (see module doc).

    ``lookahead``: how many compute actions ahead of its consumer a receive is posted
    (0 = right before the consumer). The input must be compute-only and complete (every
    (stage, microbatch) has its work; ``ScheduleError`` otherwise); whether it runs to the
    end is ``validate``'s question, and lowering keeps the answer: the lowered schedule
    deadlocks exactly when the compute-only one does.
    """
    check_count("lookahead", lookahead, minimum=0)
    if schedule.is_lowered:
        raise ValueError(f"schedule {schedule.name!r} is already lowered (it holds SEND/RECV "
                         f"actions); lower the compute-only schedule once")
    check_work(schedule)
    lowered = []
    for rank, actions in enumerate(schedule.ranks):
        slots = _receive_slots(schedule, rank, lookahead)
        out: list[Action] = []
        for index, action in enumerate(actions):
            out.extend(slots.get(index, ()))
            out.append(action)
            out.extend(send for send, _, _ in _sends(schedule, rank, action))
        lowered.append(out)
    return schedule.replace_ranks(lowered)
