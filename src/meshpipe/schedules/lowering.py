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
peer: receive buffers are allocated shortly before they are used, not all at the start
of the step.
"""

from __future__ import annotations

from array import array

from meshpipe.schedules._building import check_count
from meshpipe.schedules.actions import Action, Kind, Schedule
from meshpipe.schedules.validation import check_work

__all__ = ["lower"]

_F, _B, _I = Kind.F, Kind.B, Kind.I
_SEND_F, _SEND_B, _RECV_F, _RECV_B = Kind.SEND_F, Kind.SEND_B, Kind.RECV_F, Kind.RECV_B


class _Traffic:
    """Who sends what to whom, and where each rank consumes what it receives.

    A message is numbered by its receive: ``(is_gradient * num_stages + receiving stage) *
    num_microbatches + microbatch``.
    """

    def __init__(self, schedule: Schedule) -> None:
        num_ranks = schedule.num_ranks
        num_microbatches = schedule.num_microbatches
        size = schedule.num_stages * num_microbatches
        self.schedule = schedule
        # sends[rank]: (index of the compute action it follows, SEND kind, stage, microbatch)
        self.sends: list[list[tuple[int, Kind, int, int]]] = [[] for _ in range(num_ranks)]
        # incoming[destination][source]: messages from source to destination, in send order
        self.incoming: list[dict[int, list[int]]] = [{} for _ in range(num_ranks)]
        # consumer[message]: index of the compute action consuming it on its receiving rank
        self.consumer = array("l", [0]) * (2 * size)
        placement = schedule.placement
        last_stage = schedule.num_stages - 1
        consumer = self.consumer
        for rank, actions in enumerate(schedule.ranks):
            sends, incoming = self.sends[rank], self.incoming
            for index, action in enumerate(actions):
                for part in action.parts or (action,):
                    kind, stage, microbatch = part.kind, part.stage, part.microbatch
                    slot = stage * num_microbatches + microbatch
                    if kind is _F:
                        if stage > 0 and placement[stage - 1] != rank:
                            consumer[slot] = index
                        if stage < last_stage and placement[stage + 1] != rank:
                            sends.append((index, _SEND_F, stage, microbatch))
                            incoming[placement[stage + 1]].setdefault(rank, []).append(
                                slot + num_microbatches)
                    elif kind is _B or kind is _I:
                        if stage < last_stage and placement[stage + 1] != rank:
                            consumer[size + slot] = index
                        if stage > 0 and placement[stage - 1] != rank:
                            sends.append((index, _SEND_B, stage, microbatch))
                            incoming[placement[stage - 1]].setdefault(rank, []).append(
                                size + slot - num_microbatches)

    def receive_slots(self, rank: int, lookahead: int) -> dict[int, list[Action]]:
        """RECV actions of ``rank``, keyed by the index of the compute action they precede."""
        consumer = self.consumer
        num_microbatches = self.schedule.num_microbatches
        size = self.schedule.num_stages * num_microbatches
        slots: dict[int, list[Action]] = {}
        for _, messages in sorted(self.incoming[rank].items()):
            placed = []
            latest = None
            for message in reversed(messages):
                slot = max(0, consumer[message] - lookahead)
                latest = slot if latest is None else min(latest, slot)
                placed.append((latest, message))
            for slot, message in reversed(placed):
                is_gradient, rest = divmod(message, size)
                stage, microbatch = divmod(rest, num_microbatches)
                slots.setdefault(slot, []).append(
                    Action(_RECV_B if is_gradient else _RECV_F, stage, microbatch))
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
    if check_work(schedule).lowered:
        raise ValueError(f"schedule {schedule.name!r} is already lowered (it holds SEND/RECV "
                         f"actions); lower the compute-only schedule once")
    traffic = _Traffic(schedule)
    lowered = []
    for rank, actions in enumerate(schedule.ranks):
        slots = traffic.receive_slots(rank, lookahead)
        sends = traffic.sends[rank]
        next_send = 0
        out: list[Action] = []
        for index, action in enumerate(actions):
            if index in slots:
                out.extend(slots[index])
            out.append(action)
            while next_send < len(sends) and sends[next_send][0] == index:
                _, kind, stage, microbatch = sends[next_send]
                out.append(Action(kind, stage, microbatch))
                next_send += 1
        lowered.append(out)
    return schedule.replace_ranks(lowered)
